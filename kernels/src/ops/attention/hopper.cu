// ---- Hopper attention forward (shared/reference/attention.md): wgmma, bf16 in, f32
// accumulation, bf16 out plus f32 LSE, head dim 128, non-causal, optional valid-key length. sm_90a only
// (wgmma exists on no other architecture); compiled for anything else the kernel body is empty and the
// launch side (hopper.rs) refuses to run it.
//
// Two kernels share the wgmma, descriptor, softmax and store code below: the cp.async kernel described
// here (stage a), and the warp-specialised one (TMA producer, ping-pong consumers, softmax overlapped
// with P·V; stages c–d), described at its namespace `ws` further down, which `Auto` runs.
// Block = 256 threads = 2 warpgroups (WG), Br = 128 query rows (64 per WG, one wgmma M) of one
// (batch, head); K/V blocks of Bc = 128 keys. Every thread both loads and computes. Shared memory,
// 1024-aligned at run time (the dynamic base is not guaranteed to be, hence 1 KB extra): Q [128 × 128],
// then STAGES of K [128 × 128], then STAGES of V, each tile stored as the 128B-swizzle layout wgmma
// reads: two halves (columns 0–63, then 64–127, each 128 rows × 128 B), and in a half the 16-byte
// chunk c of row r at r·128 + ((c ⊕ (r & 7))·16). cp.async writes that layout directly (16-byte chunks
// to swizzled addresses).
// Per K/V block j:
//   cp.async.wait_group 0 → fence.proxy.async (the cp.async writes are generic-proxy, wgmma reads
//   through the async proxy) → barrier (block j is in; no WG still reads the stage block j+1 goes to) →
//   cp.async of block j+1 into stage (j+1) mod STAGES → S = Q·Kᵀ: 8 SS wgmma m64n128k16 (the first with scale-d = 0),
//   commit, wait 0 → mask keys ≥ kv_len (last block only) → online softmax in base 2 on raw scores
//   (m running max, p = 2^(s·c − m·c), c = scale·log2 e, thread-partial sums l) → O·α (only when some
//   row of the warp has a new max) → O += P·V: 8 RS wgmma m64n128k16 with P's bf16 A-fragments in
//   registers (the S accumulator layout packs into them without shuffles) and V N-major (trans-b = 1),
//   commit, then wait 0 (STAGES = 2) or not (STAGES = 3: P·V of block j runs on while the next
//   iteration's barrier, loads and Q·Kᵀ are issued; its wait is the one after that Q·Kᵀ, so the K/V
//   stage it reads is reloaded only 2 blocks later, hence the third stage).
// End: quad-sum l, out = O / l (0 when l = 0), lse = m·scale + ln l (−∞ when l = 0).
// Descriptors (brief §2.2): Q and K are K-major (D contiguous): swizzle 128B, SBO = 1024 (next 8 rows),
// LBO unused (16), k-step k starts at half(k/4) + 32·(k mod 4) bytes, WG w's Q rows 64·w·128 bytes into
// each half. V is N-major: SBO = 1024 (next 8 keys), LBO = 128·128 (the other 64-column half), k-step k
// (16 keys) starts 2048·k bytes in. Every tile and half starts on a 1024-byte boundary, so the base
// offset field is 0.
// Requires scale > 0 (the max is taken on raw scores) and 16-byte aligned rows (H·D·2 % 16 == 0).
// ptxas (checked with --ptxas-options=-v and the SASS): both variants issue their 8 + 8 HGMMAs back to
// back (no C7515 serialisation), 198 / 224 registers, no spills.

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HOPPER_WGMMA 1
#endif

// A CUDA tensor map (CUtensorMap: 128 opaque bytes, encoded on the host by cuTensorMapEncodeTiled),
// passed by value as a __grid_constant__ kernel parameter.
struct __align__(128) TmaMap {
    unsigned long long opaque[16];
};

#ifdef HOPPER_WGMMA

namespace hopper {

typedef unsigned long long u64;

constexpr int D = 128;                // head dim
constexpr int BR = 128;               // query rows per block (64 per warpgroup)
constexpr int BC = 128;               // keys per K/V block
constexpr int THREADS = 256;          // 2 warpgroups
constexpr int HALF = 128 * 128;       // bytes of a tile half: 128 rows × 64 bf16
constexpr int TILE = 2 * HALF;        // bytes of a [128 × 128] bf16 tile

// Makes this thread's generic-proxy shared-memory writes (cp.async) visible to the async proxy (wgmma).
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// The wait asm names no registers: without these the compiler may move reads of the accumulators above
// it, or writes of the A-fragments below an issue (brief §2.1, "fence operand").
template <int N = 64>
__device__ __forceinline__ void fence_regs(float* d) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void fence_regs(unsigned* a, int n) {
#pragma unroll
    for (int i = 0; i < n; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// Shared-memory matrix descriptor, 128B swizzle (brief §2.2): start, LBO, SBO in 16-byte units,
// base offset 0 (1024-aligned patterns), swizzle mode 1 in bits 62–63.
__device__ __forceinline__ u64 desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo >> 4) & 0x3FFF) << 16) |
           ((u64)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// d (+)= A·B over one k16 step, m64n128: A and B from shared memory through descriptors, both K-major
// (trans 0/0). `accumulate` = 0 gives d = A·B (scale-d false), so the accumulator needs no zeroing.
__device__ __forceinline__ void wgmma_ss(float* d, u64 da, u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(accumulate));
}

// As wgmma_ss, m64n176k16 (88 accumulators): Q·Kᵀ over K/V blocks of 176 keys.
__device__ __forceinline__ void wgmma_ss176(float* d, u64 da, u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n176k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, %88, %89, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
        : "l"(da), "l"(db), "r"(accumulate));
}

// As wgmma_ss, m64n192k16 (96 accumulators): Q·Kᵀ over K/V blocks of 192 keys.
__device__ __forceinline__ void wgmma_ss192(float* d, u64 da, u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "l"(da), "l"(db), "r"(accumulate));
}

// d (+)= A·B over one k16 step, m64n128: A from registers (four bf16x2 fragments, §2.3 of the brief), B
// from shared memory through a descriptor, N-major (trans-b = 1).
__device__ __forceinline__ void wgmma_rs(float* d, const unsigned* a, u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}

// d (+)= A·B over one k32 step, m64n128, e4m3 × e4m3 → f32: A and B from shared memory, both K-major
// (the only layout wgmma has for 8-bit operands: no transpose immediates).
__device__ __forceinline__ void wgmma_ss_e4m3(float* d, u64 da, u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(accumulate));
}

// d += A·B over one k32 step, m64n136, e4m3 (68 accumulators): A from registers (four words of four
// e4m3: a[0] row g, k 4t…4t+3; a[1] row g + 8, same k; a[2], a[3] the same at k + 16, with g =
// lane/4, t = lane%4, as mma.m16n8k32's 8-bit A), B from shared memory, K-major. The FP8 P·V: B is
// Vᵀ's 128 channels and 8 rows of e4m3 1.0, so columns 128–135 are the row sums of P.
// `accumulate` = 0 gives d = A·B (scale-d false).
__device__ __forceinline__ void wgmma_rs136_e4m3(float* d, const unsigned* a, u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %73, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n136k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67}, {%68, %69, %70, %71}, %72, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}

// The helpers below take N, the keys per K/V block: S holds N/2 registers per thread.
// Sets the scores of keys ≥ lim (columns of this K/V block) to −∞: register 4j + e holds column
// 8j + 2·(lane % 4) + (e & 1).
template <int N = BC>
__device__ __forceinline__ void mask_keys(float* s, int lim, int lane) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i)
        if ((i / 4) * 8 + 2 * (lane & 3) + (i & 1) >= lim) s[i] = -INFINITY;
}

// One block's online softmax in base 2 on raw scores, for this thread's rows r0 (hf 0) and r0 + 8:
// the new running max m (quad-reduced), α = 2^((m_old − m)·c) (0 on the first block, where m = −∞;
// exactly 1 when the max stays), s ← p = 2^(s·c − m·c), l ← l·α + Σ p (thread-partial). Needs a finite
// score per row. Returns whether some row of the warp has a new max, i.e. whether O needs O·α.
template <int N = BC>
__device__ __forceinline__ bool online_softmax(float* s, float* m, float* l, float* alpha, float c) {
    bool rescale = false;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        // The row max as four interleaved chains (max is exact in any order): the exponentials wait for
        // it, and one chain over N/4 values is N/4 dependent FMNMX latencies long.
        float part[4] = {m[hf], -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < N / 8; ++nt)
            part[nt % 4] = fmaxf(part[nt % 4], fmaxf(s[4 * nt + 2 * hf], s[4 * nt + 2 * hf + 1]));
        float mx = fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        alpha[hf] = ex2((m[hf] - mx) * c);
        rescale |= mx != m[hf];
        m[hf] = mx;
        const float mc = mx * c;
        float rs = 0.0f;
#pragma unroll
        for (int nt = 0; nt < N / 8; ++nt) {
            s[4 * nt + 2 * hf] = ex2(fmaf(s[4 * nt + 2 * hf], c, -mc));
            s[4 * nt + 2 * hf + 1] = ex2(fmaf(s[4 * nt + 2 * hf + 1], c, -mc));
            rs += s[4 * nt + 2 * hf] + s[4 * nt + 2 * hf + 1];
        }
        l[hf] = l[hf] * alpha[hf] + rs;
    }
    return __any_sync(0xffffffffu, rescale);
}

// O·α, skipped when no row of the warp changed its max (α = 1 exactly then). O must not be in use by
// a wgmma.
template <int N = 64>
__device__ __forceinline__ void rescale_o(float* o, const float* alpha, bool rescale) {
    if (!rescale) return;
#pragma unroll
    for (int dt = 0; dt < N / 4; ++dt) {
        o[4 * dt] *= alpha[0];
        o[4 * dt + 1] *= alpha[0];
        o[4 * dt + 2] *= alpha[1];
        o[4 * dt + 3] *= alpha[1];
    }
}

// P's bf16 A-fragment for keys 16kk…16kk+15 is S column groups 2kk and 2kk+1 (brief §2.3).
template <int N = BC>
__device__ __forceinline__ void pack_p(const float* s, unsigned (*p)[4]) {
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
        p[kk][0] = pack_bf16(s[8 * kk], s[8 * kk + 1]);
        p[kk][1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
        p[kk][2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
        p[kk][3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
    }
}

// Byte offset of 16-byte chunk C (0–15: columns 8C…8C+7) of row r in a swizzled [128 × 128] tile.
__device__ __forceinline__ unsigned tile_off(int r, int C) {
    return (unsigned)((C >> 3) * HALF + r * 128 + (((C & 7) ^ (r & 7)) << 4));
}

// Issues the cp.async of rows [row0, row0 + 128) of a [rows, H, D] slice (token stride `tok`) into the
// tile at `dst`; rows ≥ limit are zero-filled (so padded V rows are finite: their P is 0 and 0·0 = 0).
__device__ __forceinline__ void load_tile(unsigned dst, const bf16* base, int row0, int limit, i64 tok) {
    constexpr int CH = D / 8;
#pragma unroll
    for (int i = 0; i < 128 * CH / THREADS; ++i) {
        const int idx = threadIdx.x + i * THREADS;
        const int r = idx / CH, ch = idx % CH;
        const int g = row0 + r;
        const bool ok = g < limit;
        cp_async16(dst + tile_off(r, ch), base + (i64)(ok ? g : 0) * tok + ch * 8, ok);
    }
}

// Final normalisation of this thread's two rows (r0 = row0 + lane/4 and r0 + 8): O ← O / l (0 when
// l = 0; l quad-summed first), and their LSE, m·scale + ln l (−∞ when l = 0).
__device__ __forceinline__ void normalise_rows(float* o, const float* m, const float* l, float scale, float* row_lse) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        float sum = l[hf];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            o[4 * dt + 2 * hf] *= inv;
            o[4 * dt + 2 * hf + 1] *= inv;
        }
        row_lse[hf] = sum > 0.0f ? m[hf] * scale + logf(sum) : -INFINITY;
    }
}

// Stores of this thread's two normalised rows (row0 is the warp's first row in the sequence): out as
// bf16, lse by lane 0 of each quad; rows ≥ S_q dropped.
__device__ __forceinline__ void write_rows(bf16* __restrict__ out, float* __restrict__ lse, const float* o,
                                           const float* row_lse, int b, int h, int row0, int lane, int seq_q,
                                           int heads) {
    const i64 tok = (i64)heads * D;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int r = row0 + hf * 8 + (lane >> 2);
        if (r < seq_q) {
            bf16* orow = out + ((i64)b * seq_q + r) * tok + (i64)h * D + 2 * (lane & 3);
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt)
                *(unsigned*)(orow + dt * 8) = pack_bf16(o[4 * dt + 2 * hf], o[4 * dt + 2 * hf + 1]);
            if ((lane & 3) == 0) lse[((i64)b * heads + h) * seq_q + r] = row_lse[hf];
        }
    }
}

__device__ __forceinline__ void store_rows(bf16* __restrict__ out, float* __restrict__ lse, float* o, const float* m,
                                           const float* l, int b, int h, int row0, int lane, int seq_q, int heads,
                                           float scale) {
    float row_lse[2];
    normalise_rows(o, m, l, scale, row_lse);
    write_rows(out, lse, o, row_lse, b, h, row0, lane, seq_q, heads);
}

template <int STAGES>
__device__ __forceinline__ void fwd(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                    const bf16* __restrict__ v, bf16* __restrict__ out, float* __restrict__ lse,
                                    int seq_q, int seq_k, int heads, int kv_len, float scale) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const unsigned base = (smem_addr(smem) + 1023u) & ~1023u;
    const unsigned sq = base;             // Q
    static_assert(STAGES == 2 || STAGES == 3, "2 stages (P·V waited in its iteration) or 3 (left in flight)");
    const unsigned sk = base + TILE;                 // STAGES stages of K
    const unsigned sv = base + (1 + STAGES) * TILE;  // STAGES stages of V

    const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * BR;
    // threadIdx.x / 128 is warp-uniform, so every .aligned wgmma below runs converged per warpgroup.
    const int wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const i64 tok = (i64)heads * D;
    const bf16* qb = q + (i64)b * seq_q * tok + (i64)h * D;
    const bf16* kb = k + (i64)b * seq_k * tok + (i64)h * D;
    const bf16* vb = v + (i64)b * seq_k * tok + (i64)h * D;
    const float c = scale * 1.4426950408889634f;  // scale·log2 e
    const int nblk = (kv_len + BC - 1) / BC;
    // Row statistics of this thread's rows r0 and r0 + 8.
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    if (nblk <= 0) {
        // No valid key: out = 0, lse = −∞. Returning here (kv_len is uniform, no barrier has run) also
        // keeps the path that skips the loop away from the wgmma wait after it: zeroing moves of O
        // reaching that wait would make ptxas serialise every wgmma (C7515). Hence also the do-while below.
        store_rows(out, lse, o, m, l, b, h, q0 + wg * 64 + warp * 16, lane, seq_q, heads, scale);
        return;
    }

    load_tile(sq, qb, q0, seq_q, tok);
    load_tile(sk, kb, 0, kv_len, tok);
    load_tile(sv, vb, 0, kv_len, tok);
    cp_commit();

    // Accumulators in the wgmma m64nNk16 layout: register 4j + e holds row r0 = 16·warp + lane/4 (e < 2)
    // or r0 + 8 (e ≥ 2) of this WG's 64 rows, column 8j + 2·(lane % 4) + (e & 1).
    float s[64];
    unsigned p[BC / 16][4];  // P as bf16 A-fragments; with 3 stages read by a P·V still in flight
    const unsigned q_wg = sq + wg * 64 * 128;  // this WG's 64 rows, in each half

    int j = 0;
    do {
        const int stage = j % STAGES, next = (j + 1) % STAGES;
        cp_wait<0>();
        fence_proxy_async();
        // Block j is in. Every thread has passed iteration j − 1's wgmma wait 0, which covered its reads of
        // block j − 1 (2 stages) or j − 2 (3 stages: that wait came before P·V of j − 1 was issued); either
        // way the stage `next` is no longer read.
        __syncthreads();
        if (j + 1 < nblk) {
            load_tile(sk + next * TILE, kb, (j + 1) * BC, kv_len, tok);
            load_tile(sv + next * TILE, vb, (j + 1) * BC, kv_len, tok);
        }
        cp_commit();
        const unsigned kt = sk + stage * TILE, vt = sv + stage * TILE;

        // S = Q·Kᵀ over D = 128: 8 k-steps of 16; step kk reads 32 bytes of each 128-byte row in half kk/4.
        fence_regs(s);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const unsigned off = (kk >> 2) * HALF + (kk & 3) * 32;
            wgmma_ss(s, desc(q_wg + off, 16, 1024), desc(kt + off, 16, 1024), kk > 0);
        }
        wgmma_commit();
        wgmma_wait0();  // with 3 stages this also completes P·V of block j − 1
        fence_regs(s);
        if constexpr (STAGES == 3) {
            fence_regs(o);
            fence_regs(&p[0][0], BC / 4);
        }

        if ((j + 1) * BC > kv_len) mask_keys(s, kv_len - j * BC, lane);  // the partial last block
        // Key j·BC < kv_len, so each row has a finite score and the new max is finite.
        float alpha[2];
        const bool rescale = online_softmax(s, m, l, alpha, c);
        // The previous P·V has completed (a wait 0 since), so the accumulators and P may be touched.
        rescale_o(o, alpha, rescale);
        pack_p(s, p);
        // O += P·V: 8 k-steps of 16 keys; V N-major, step kk starts 16 keys = 2048 bytes in.
        fence_regs(o);
        fence_regs(&p[0][0], BC / 4);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) wgmma_rs(o, p[kk], desc(vt + kk * 2048, HALF, 1024), 1);
        wgmma_commit();
        // 2 stages: wait here. 3 stages: leave P·V in flight over the next iteration's barrier, loads and
        // Q·Kᵀ issue, so the tensor cores go from one GEMM to the next without the gap.
        if constexpr (STAGES == 2) {
            wgmma_wait0();
            fence_regs(o);
        }
    } while (++j < nblk);
    wgmma_wait0();
    fence_regs(o);
    cp_wait<0>();

    store_rows(out, lse, o, m, l, b, h, q0 + wg * 64 + warp * 16, lane, seq_q, heads, scale);
}

// ---- The warp-specialised kernel (stages c–d of the brief): 384 threads = two consumer warpgroups
// (64 query rows each; setmaxnreg 240) and a producer warpgroup (setmaxnreg 24; one thread issues the
// TMA copies, the rest exit). 128·24 + 256·240 = 64,512 of the 65,536 registers, what the entry count
// of 168 per thread (__launch_bounds__(384, 1)) hands out. Q, K and V arrive by TMA (4-D tensor maps
// over [B, S, H, 128], two 64-column boxes per tile into the two swizzled halves, out-of-range rows
// zero-filled) on mbarriers: full barriers
// (count 1: the producer's expect_tx) and empty ones (count 2: one elected thread per consumer WG
// after the wgmma that read the stage has completed). K and V have separate rings of STAGES stages;
// iteration i uses stage i mod STAGES with phase (i / STAGES) & 1, and the producer's first STAGES
// empty waits pass on the fresh barriers' odd phase. Blocks run last to first, so the partial block is
// the first one and only the prologue masks.
// Per block i ≥ 1 a consumer (brief §1, steps 2.1–2.8): waits K_i and V_{i−1}, takes its turn (named
// barrier: the two WGs' GEMMs alternate on the tensor cores, so one WG's softmax runs under the other's
// GEMMs), issues S = Q·K_iᵀ and O += P_{i−1}·V_{i−1}, hands the turn over, waits for S only
// (wait_group 1), releases K_i, runs the softmax of block i while P·V still runs (intra-warpgroup
// overlap), waits for P·V, releases V_{i−1}, then O·α and the new P. (Without turns, 11 % slower at
// (1,40,75600,128) and 4 % at (1,12,32760,128) on an H100: bench/RESULTS.md, 2026-12-06.)
// Each CTA computes one work item of `Schedule` (below): a whole tile, or one run of a tile's K/V
// blocks when the last wave is split (the chunk's first block is then its last, "last to first").
namespace ws {

constexpr int TURN = 1;   // named barriers TURN + w: consumer w's turn to issue (0 is __syncthreads')
constexpr int MERGE = 3;  // named barrier of the 256 consumer threads around a split tile's ticket

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of parity `parity` has completed. A protocol bug would otherwise hang the
// whole GPU queue: a wait that lasts over 4 s (no legitimate wait here lasts longer than one block's
// copy) traps instead, which fails the launch with an error. The loop is PTX on purpose: written as a
// C++ loop around try_wait with __trap(), ptxas (CUDA 13) ignored the consumers' setmaxnreg budget,
// capped them at the entry count of 168 registers, spilled and serialised the wgmma (C7512).
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred p;\n.reg .u64 t0, t1, dt;\nmov.u64 t0, %%globaltimer;\n"
        "WAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@p bra DONE;\n"
        "mov.u64 t1, %%globaltimer;\nsub.u64 dt, t1, t0;\nsetp.lt.u64 p, dt, 4000000000;\n@p bra WAIT;\n"
        "trap;\nDONE:\n}\n" ::"r"(bar), "r"(parity)
        : "memory");
}
__device__ __forceinline__ void bar_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void wgmma_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }

// One tile of ROWS × 128: rows [row0, row0 + ROWS) of head h of batch b, as two 64-column boxes (the
// map's box is 64 × ROWS) into the two swizzled halves at dst and dst + ROWS·128 (1024-aligned),
// completing on `bar`.
template <int ROWS>
__device__ __forceinline__ void tma_tile(unsigned dst, const TmaMap& map, unsigned bar, int row0, int h, int b) {
#pragma unroll
    for (int half = 0; half < 2; ++half)
        asm volatile(
            "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
            ::"r"(dst + half * ROWS * 128), "l"(reinterpret_cast<u64>(&map)), "r"(bar), "r"(half * 64), "r"(row0), "r"(h), "r"(b)
            : "memory");
}

// S = Q·Kᵀ over D = 128 for this WG's 64 rows and a K block of KB keys: 8 k-steps of 16; step kk reads
// 32 bytes of each 128-byte row in half kk/4 (a K half is KB rows, KB·128 bytes).
template <int KB>
__device__ __forceinline__ void qk(float* s, unsigned q_wg, unsigned kt) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const unsigned qoff = (kk >> 2) * HALF + (kk & 3) * 32, koff = (kk >> 2) * KB * 128 + (kk & 3) * 32;
        if constexpr (KB == 128) wgmma_ss(s, desc(q_wg + qoff, 16, 1024), desc(kt + koff, 16, 1024), kk > 0);
        else if constexpr (KB == 176) wgmma_ss176(s, desc(q_wg + qoff, 16, 1024), desc(kt + koff, 16, 1024), kk > 0);
        else wgmma_ss192(s, desc(q_wg + qoff, 16, 1024), desc(kt + koff, 16, 1024), kk > 0);
    }
}

// O += P·V over a V block of KB keys: KB/16 k-steps of 16 keys; V N-major (LBO = the other 64-column
// half, KB·128 bytes on), step kk starts 16 keys = 2048 bytes in.
template <int KB>
__device__ __forceinline__ void pv(float* o, unsigned (*p)[4], unsigned vt) {
#pragma unroll
    for (int kk = 0; kk < KB / 16; ++kk) wgmma_rs(o, p[kk], desc(vt + kk * 2048, KB * 128, 1024), 1);
}

// The ws kernel's work schedule (hopper.rs picks it per call). Work items are the tiles of 128 query
// rows of one (batch, head), numbered tile = q-tile + tiles_x·(h + heads·b) (the q-tiles of a head
// consecutive, so the CTAs running at once share their K/V in L2). CTA c of a 1-D grid takes items c,
// c + gridDim.x, …: one each when the grid is as large as the items; fewer CTAs than items make the
// kernel persistent, its producer loading the next item's Q and first K/V blocks while the consumers
// finish the current one (what a short key run, the cross-attention's 512 text tokens, needs). When
// the tile count leaves a last wave that would keep few SMs busy (the rest idle for a whole tile's
// time), its tiles are split over `ways` CTAs each along the keys: item n_full + (t − n_full)·ways + c
// takes the c-th of `ways` even runs of the K/V blocks of tile t. Each writes its partial rows (O
// normalised by its own row sums, and its LSE) to `part`; the last of the `ways` to take a ticket
// merges them (out = Σ_c e^(lse_c − lse)·O_c, lse = log Σ_c e^(lse_c)) in chunk order, so the result
// does not depend on which CTA finishes last.
struct Schedule {
    float* part;        // [split tiles][ways][66][256]: per consumer thread, its 64 O values and 2 LSEs
    unsigned* tickets;  // [split tiles], zero before the launch
    int tiles_x;        // q-tiles per (batch, head)
    int n_full;         // tiles computed whole by one CTA: the first n_full
    int ways;           // CTAs per split tile (1: nothing is split)
    int items;          // work items: n_full + split tiles × ways
};

// This consumer thread's slot e (0–63: O, 64–65: the LSE of its rows r0 and r0 + 8) of chunk `item`:
// element-major, so a warp's 32 threads touch 32 consecutive floats.
__device__ __forceinline__ float* part_slot(float* part, int item, int e) {
    return part + ((i64)item * 66 + e) * 256 + threadIdx.x;
}

// Item `item`'s tile: rows [q0, q0 + 128) of head h of batch b, and its K/V blocks [lo, hi) (all of
// them for a whole tile, chunk `item`'s even share for a split one).
struct Item {
    int q0, h, b, lo, hi;
};
template <int KB>
__device__ __forceinline__ Item item_of(int item, const Schedule& sched, int heads, int kv_len) {
    const bool split = item >= sched.n_full;
    const int tile = split ? sched.n_full + (item - sched.n_full) / sched.ways : item;
    const int chunk = split ? (item - sched.n_full) % sched.ways : 0;
    const int blocks = (kv_len + KB - 1) / KB;  // of the whole tile; hopper.rs splits only when ≥ 2·ways
    return Item{(tile % sched.tiles_x) * BR, (tile / sched.tiles_x) % heads, tile / (sched.tiles_x * heads),
                split ? chunk * blocks / sched.ways : 0, split ? (chunk + 1) * blocks / sched.ways : blocks};
}

// A chunk of a split tile (`item` ≥ n_full), from both consumer warpgroups (MERGE is their barrier):
// this thread's normalised rows `o` (clobbered) and their LSEs `row_lse` (natural log) to `part`,
// made visible device-wide, then a ticket; the CTA taking the tile's last ticket merges every chunk's
// rows by their LSEs into out and lse. `last`: a word of shared memory.
__device__ __forceinline__ void merge_split(float* o, float* row_lse, const Schedule& sched, int item, const Item& it,
                                            int row0, int lane, int seq_q, int heads, bf16* __restrict__ out,
                                            float* __restrict__ lse, int& last) {
    const int t = (item - sched.n_full) / sched.ways, first = t * sched.ways;
#pragma unroll
    for (int e = 0; e < 64; ++e) *part_slot(sched.part, item - sched.n_full, e) = o[e];
    *part_slot(sched.part, item - sched.n_full, 64) = row_lse[0];
    *part_slot(sched.part, item - sched.n_full, 65) = row_lse[1];
    __threadfence();
    bar_sync(MERGE);
    if (threadIdx.x == 0) last = atomicAdd(&sched.tickets[t], 1u) == (unsigned)sched.ways - 1;
    bar_sync(MERGE);
    if (!last) return;
    __threadfence();  // the other chunks' rows, fenced before their tickets, are visible from here
    // Three passes over the chunks' LSEs (a handful of loads) rather than an array indexed at run time.
    float mx[2] = {-INFINITY, -INFINITY}, wsum[2] = {0.0f, 0.0f};
    for (int k = 0; k < sched.ways; ++k)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) mx[hf] = fmaxf(mx[hf], __ldcg(part_slot(sched.part, first + k, 64 + hf)));
    for (int k = 0; k < sched.ways; ++k)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) wsum[hf] += expf(__ldcg(part_slot(sched.part, first + k, 64 + hf)) - mx[hf]);
#pragma unroll
    for (int e = 0; e < 64; ++e) o[e] = 0.0f;
    for (int k = 0; k < sched.ways; ++k) {
        const float w0 = expf(__ldcg(part_slot(sched.part, first + k, 64)) - mx[0]) / wsum[0];
        const float w1 = expf(__ldcg(part_slot(sched.part, first + k, 65)) - mx[1]) / wsum[1];
#pragma unroll
        for (int e = 0; e < 64; ++e) o[e] += ((e & 2) ? w1 : w0) * __ldcg(part_slot(sched.part, first + k, e));
    }
    row_lse[0] = mx[0] + logf(wsum[0]);
    row_lse[1] = mx[1] + logf(wsum[1]);
    write_rows(out, lse, o, row_lse, it.b, it.h, row0, lane, seq_q, heads);
}

template <int STAGES, int KB>
__device__ __forceinline__ void fwd(const TmaMap& tq, const TmaMap& tk, const TmaMap& tv, bf16* __restrict__ out,
                                    float* __restrict__ lse, int seq_q, int heads, int kv_len, float scale,
                                    const Schedule sched) {
    static_assert(KB == 128 || KB == 176 || KB == 192, "keys per K/V block: 128, FA3's 176, or 192");
    // Dynamic (Q, the K/V stages, 1 KiB alignment slack) + static (barriers, `pin`, `last`) shared memory.
    static_assert((1 + 2 * STAGES * KB / 128) * TILE + 1024 + 8 * (2 + 4 * STAGES) + 4 * 257 <= 227 * 1024,
                  "shared memory");
    constexpr int KV_TILE = KB * 256;  // bytes of a K or V tile
    extern __shared__ __align__(1024) unsigned char smem[];
    // full Q, empty Q, full K[STAGES], full V[STAGES], empty K[STAGES], empty V[STAGES]
    __shared__ __align__(8) u64 bars[2 + 4 * STAGES];
    __shared__ float pin[256];  // one slot per consumer thread, written to order the softmax (see its use)
    __shared__ int last;        // a split tile's last chunk: this CTA merges
    const unsigned base = (smem_addr(smem) + 1023u) & ~1023u;
    const unsigned sq = base, sk = base + TILE, sv = base + TILE + STAGES * KV_TILE;
    const unsigned full_q = smem_addr(&bars[0]), empty_q = full_q + 8;
    const unsigned full_k = empty_q + 8, full_v = full_k + 8 * STAGES;
    const unsigned empty_k = full_v + 8 * STAGES, empty_v = empty_k + 8 * STAGES;

    // Warpgroups 0 and 1 consume, 2 produces. The warpgroup index is made visibly warp-uniform (a
    // shuffle, brief §5.7): every .aligned instruction below runs converged per warpgroup.
    const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x / 128, 0);
    const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    if (kv_len <= 0) {  // no valid key: out = 0, lse = −∞ (kv_len is uniform; no barrier has run)
        if (wg < 2) {
            const float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
            float zero[64];
#pragma unroll
            for (int i = 0; i < 64; ++i) zero[i] = 0.0f;
            for (int item = blockIdx.x; item < sched.items; item += gridDim.x) {
                const Item it = item_of<KB>(item, sched, heads, kv_len);
                store_rows(out, lse, zero, m, l, it.b, it.h, it.q0 + wg * 64 + warp * 16, lane, seq_q, heads, scale);
            }
        }
        return;
    }
    if (threadIdx.x == 0) {
        mbar_init(full_q, 1);
        mbar_init(empty_q, 2);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_k + 8 * s, 1);
            mbar_init(full_v + 8 * s, 1);
            mbar_init(empty_k + 8 * s, 2);
            mbar_init(empty_v + 8 * s, 2);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    // Both sides count the K/V blocks this CTA has taken (`g`, across items) and its items (`n`): the
    // rings' stage and phase of block g are g mod STAGES and (g / STAGES) mod 2, Q's phase n mod 2.
    if (wg == 2) {  // producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        if (warp != 0 || lane != 0) return;
        int g = 0;
        for (int item = blockIdx.x, n = 0; item < sched.items; item += gridDim.x, ++n) {
            const Item it = item_of<KB>(item, sched, heads, kv_len);
            mbar_wait(empty_q, (n & 1) ^ 1);  // both consumers' last Q·Kᵀ of the item before
            mbar_expect_tx(full_q, TILE);
            tma_tile<BR>(sq, tq, full_q, it.q0, it.h, it.b);
            for (int j = it.hi - 1; j >= it.lo; --j, ++g) {
                const int s = g % STAGES;
                const unsigned phase = (g / STAGES) & 1;
                mbar_wait(empty_k + 8 * s, phase ^ 1);
                mbar_expect_tx(full_k + 8 * s, KV_TILE);
                tma_tile<KB>(sk + s * KV_TILE, tk, full_k + 8 * s, j * KB, it.h, it.b);
                mbar_wait(empty_v + 8 * s, phase ^ 1);
                mbar_expect_tx(full_v + 8 * s, KV_TILE);
                tma_tile<KB>(sv + s * KV_TILE, tv, full_v + 8 * s, j * KB, it.h, it.b);
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
    const int w = wg;  // consumer 0 or 1
    const bool leader = threadIdx.x % 128 == 0;    // releases stages for its WG
    const float c = scale * 1.4426950408889634f;  // scale·log2 e
    const unsigned q_wg = sq + w * 64 * 128;       // this WG's 64 rows, in each half
    const unsigned scratch = smem_addr(&pin[threadIdx.x]);
    if (w == 1) bar_arrive(TURN + 0);  // consumer 0 issues first
    int g = 0;
    for (int item = blockIdx.x, n = 0; item < sched.items; item += gridDim.x, ++n) {
        const Item it = item_of<KB>(item, sched, heads, kv_len);
        const int nblk = it.hi - it.lo;  // ≥ 1: kv_len > 0, and a split chunk has ≥ 2 blocks
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
        float o[64];
#pragma unroll
        for (int i = 0; i < 64; ++i) o[i] = 0.0f;
        float s[KB / 2];
        unsigned p[KB / 16][4];

        // Prologue: block hi − 1, the only one that can be partial.
        {
            const int st = g % STAGES;
            mbar_wait(full_q, n & 1);
            mbar_wait(full_k + 8 * st, (g / STAGES) & 1);
            bar_sync(TURN + w);
            fence_regs<KB / 2>(s);
            wgmma_fence();
            qk<KB>(s, q_wg, sk + st * KV_TILE);
            wgmma_commit();
            bar_arrive(TURN + (1 - w));
            wgmma_wait0();
            fence_regs<KB / 2>(s);
            if (leader) {
                mbar_arrive(empty_k + 8 * st);
                if (nblk == 1) mbar_arrive(empty_q);
            }
            if (it.hi * KB > kv_len) mask_keys<KB>(s, kv_len - (it.hi - 1) * KB, lane);
            float alpha[2];
            online_softmax<KB>(s, m, l, alpha, c);  // O = 0: nothing to rescale
            pack_p<KB>(s, p);
        }

        for (int i = 1; i < nblk; ++i) {
            const int st = (g + i) % STAGES, prev = (g + i - 1) % STAGES;
            const unsigned phase = ((g + i) / STAGES) & 1, prev_phase = ((g + i - 1) / STAGES) & 1;
            mbar_wait(full_k + 8 * st, phase);
            mbar_wait(full_v + 8 * prev, prev_phase);
            bar_sync(TURN + w);
            fence_regs<KB / 2>(s);
            fence_regs(o);
            fence_regs(&p[0][0], KB / 4);
            wgmma_fence();
            qk<KB>(s, q_wg, sk + st * KV_TILE);
            wgmma_commit();
            pv<KB>(o, p, sv + prev * KV_TILE);
            wgmma_commit();
            bar_arrive(TURN + (1 - w));
            wgmma_wait1();  // S is in; P·V of block i − 1 may still run
            fence_regs<KB / 2>(s);
            if (leader) {
                mbar_arrive(empty_k + 8 * st);
                if (i == nblk - 1) mbar_arrive(empty_q);  // this WG's last read of Q
            }
            float alpha[2];
            const bool rescale = online_softmax<KB>(s, m, l, alpha, c);
            // ptxas hoisted the wait below above the softmax (to just after the first row's max: every
            // MUFU.EX2 came after the WARPGROUP.DEPBAR), so the exponentials ran after P·V, not under it. A
            // store of the row sums (which need every exponential) to shared memory pins it: ptxas keeps
            // shared-memory accesses on their side of a wgmma wait.
            asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(scratch), "f"(l[0] + l[1]) : "memory");
            wgmma_wait0();
            fence_regs(o);
            fence_regs(&p[0][0], KB / 4);
            if (leader) mbar_arrive(empty_v + 8 * prev);
            rescale_o(o, alpha, rescale);
            pack_p<KB>(s, p);
        }

        // The last block's P·V (outside the turns: nothing of this WG's item follows it to overlap with).
        const int last_stage = (g + nblk - 1) % STAGES;
        mbar_wait(full_v + 8 * last_stage, ((g + nblk - 1) / STAGES) & 1);
        fence_regs(o);
        fence_regs(&p[0][0], KB / 4);
        wgmma_fence();
        pv<KB>(o, p, sv + last_stage * KV_TILE);
        wgmma_commit();
        wgmma_wait0();
        fence_regs(o);
        if (leader) mbar_arrive(empty_v + 8 * last_stage);
        g += nblk;

        const int row0 = it.q0 + w * 64 + warp * 16;
        if (item < sched.n_full) {
            store_rows(out, lse, o, m, l, it.b, it.h, row0, lane, seq_q, heads, scale);
            continue;
        }
        float row_lse[2];
        normalise_rows(o, m, l, scale, row_lse);
        merge_split(o, row_lse, sched, item, it, row0, lane, seq_q, heads, out, lse, last);
    }
    // Consumer 1 arrived on consumer 0's turn once more than consumer 0 synced on it (its opening
    // arrival): consume it, so no barrier is left mid-phase at exit.
    if (w == 0) bar_sync(TURN + 0);
}

}  // namespace ws

// ---- The FP8 forward (issue 24): the warp-specialised kernel above with e4m3 operands, following
// the recipe of its CPU reference, kernels/src/ops/quant/attention.rs, step for step. Its operands
// come quantised by quant.cu's attention kernels (launched by ops/quant/cuda.rs): Q and K e4m3
// [B, S, H, 128] with one f32 scale per (batch, head, 128 tokens); V e4m3 transposed, Vᵀ [B, H,
// 128, S_pad] (S_pad = kv_len rounded up to 128, zero past kv_len), with one scale per (batch, head,
// channel), and its keys permuted within each run of 32 (below).
// Q tiles are [128 × 128] bytes, one 128B-swizzle region (a row of 128 e4m3 is one 128-byte line),
// by TMA. K/V blocks are KB = 128 keys, each the reference's softmax step
// (`attention_fp8_reference` at step 128) and one K scale block, taken first to last as the
// reference takes them, so the running max (which sets how each P rounds to e4m3) follows the same
// sequence; the partial last block is masked where it comes. A sparse last wave is split as the
// bf16 kernel splits it (`ws::Schedule`): each chunk of a split tile's blocks is its own softmax
// from scratch, merged by the chunks' LSEs (`ws::merge_split`), and the reference takes the same
// chunks (its `KeySplit`). At (1,12,32760,128) on 132 SMs the 36 tiles of a 24th wave run as 108
// thirds: 0.7–3.3 % faster than whole tiles in 5 of 5 runs on an H200 (bench/RESULTS.md,
// 2026-12-06, eleventh session). A K block is 128 rows of 128 bytes, a Vᵀ block [128 channels ×
// 128 keys], one box each.
// GEMMs: wgmma e4m3 (8-bit operands are K-major only): S = Q·Kᵀ (m64n128k32) as 4 SS k-steps of 32
// bytes into each 128-byte row; P·V as 4 RS k-steps with P in registers and Vᵀ K-major (keys
// contiguous), the same descriptors as Q and K. P·V is m64n136k32: after each Vᵀ stage sit 8 rows
// of e4m3 1.0 (`VSTAGE`), so columns 128–135 of the accumulator are P's row sums, as rounded, added
// by the tensor cores: the softmax has no sums of its own (96 FADDs fewer per block and thread, a
// sixth of the loop's issued instructions; 7 % faster on an H100, bench/RESULTS.md, 2026-12-06,
// third session), and O is divided by the sum of the weights it holds.
// Two-level accumulation: a wgmma adds its e4m3 products to the f32 accumulator keeping ~14 bits
// relative to the larger (DeepSeek-V3's measurement of FP8 GEMMs), so an accumulator that grows
// over a long key run loses its later terms. With one accumulator over all keys, the sums came
// out off by factors e^0.63 and e^1.06 (LSE) at 32,760 and 75,600 keys of N(0, 1) inputs (an
// H100, RESULTS 2026-12-06, third and fourth sessions). So the tensor cores accumulate one window
// of WIN blocks from zero, and `promote` adds it into an f32 O in the ALU (DeepSeek-V3's promotion;
// SageAttention's two-level accumulation of P·V): at 32,768 flat keys the result is then within
// 1.7e-3 of the recipe with windows of 3 blocks, the default, and 1.2e-3 and 7.3e-4 with windows of
// 2 and 1 (`fp8_attention_matches_cpu_over_long_flat_key_runs`; 0.83 with one accumulator).
// Windows of 2 blocks cost 4 % against one accumulator, of 1 block 8 % (RESULTS, fourth session);
// windows of 3 were 0.8–2.2 % faster than 2 at the 14B shape in 9 runs of 5 H100 calls, of 4
// no faster than 2 (ninth and tenth sessions). The exponentials stay f32: sm_90 has no packed f16
// ex2 (ptxas lowers ex2.approx.f16x2 to two MUFU ops), so f16 pairs would not halve the MUFU's work.
// Softmax in base 2 on descaled scores: block j's raw scores (integer-valued products of codes,
// summed in f32) times c_j = (s_q·s_k)·scale·log2 e; m is an exponent offset over those, which
// moves only when a row's max passes it, to that max + HEADROOM (the recipe's, ops/quant/
// attention.rs); p·448 = 2^(s·c − m + log2 448) straight from ex2 (the ×448 of the reference
// folded into the exponent), rounded to e4m3 for P·V (and its sums, which are then 448·Σ rounded
// p).
// Speculative blocks (`_spec`): with the offset above every score seen by HEADROOM, a later block
// rarely passes it, so its exponentials need not wait for its row max: they are taken at the
// offsets as they stand, and a warp where one passed (p > 448) puts its rows right alone
// (`fix_rows`): from its p while they are finite, else from S taken again on the CUDA cores. In
// the parity tests the outputs matched the exact kernel's to every printed digit, except where
// scores pass the offset by ~100 nats: there the CUDA cores' f32 sums came closer to the recipe
// than the tensor cores' accumulation. Taking the row max first cost 11 % of the loop's time (the
// energy diagnostics of RESULTS, 2026-12-06, sixth session). A first version voted across the
// warpgroup (bar.red) and sent the block back through the wgmma S: 5–9 % faster than the exact
// kernel; the warp alone is 8–14 % faster (RESULTS, seventh session), ~4 % behind a diagnostic
// that never puts anything right, whose e4m3 conversions ptxas interleaves with the
// exponentials (here they wait for the branch). Packing into a second P before the branch, with
// the check read off the e4m3 codes and a passing warp's S taken again with mma.sync, was 1.5–3 %
// slower on an H100 once its spills were mended: the second P's registers cost more than the wait
// (RESULTS, eighth session). The rare path stays rolled: unrolled, its registers pushed some of O
// into local memory in the hot loop. A headroom of 2 (a factor 4) sent 7–15 % of the warpgroups'
// blocks back on N(0, 1) scores and gained nothing; 4 sends back ~0.3 %. An FMNMX chain for the
// overflow check instead of VIMNMX3 gave back 3–4 %.
// P's registers: the S accumulator gives a thread, in each 32 keys, rows g and g + 8 of keys
// {2t, 2t+1, 8+2t, 9+2t} and the same + 16 (g = lane/4, t = lane%4), while an 8-bit A fragment
// wants k = 4t…4t+3 and 16+4t…16+4t+3. Rather than shuffle registers (FlashAttention-3), the
// quantisation of V stores key 16h + 8j + 2t + e of each 32 at column 16h + 4t + 2j + e of Vᵀ, so a
// thread's accumulators are its A fragment as they stand (`pack_p`) and the sum over keys is
// unchanged.
// End: O·(s_v[col] / l) with l the promoted sums, lse = m·ln 2 + ln l − ln 448 (the reference's m +
// ln Σp).
// The two consumers issue their GEMMs as soon as their operands are in, without the bf16 kernel's
// turns: in FP8 a block's GEMMs take about as long as the MUFU's share of its softmax, so waiting
// for the other consumer's turn cost more than the order gave (4 % on an H100, bench/RESULTS.md,
// 2026-12-06; over the speculative softmax 0.6–2 % at the 14B shape and 2–5 % at the 1.3B one,
// ninth session). Measured and removed: turns, 192- and 224-key blocks (192 was 4 % faster with one
// accumulator; with two levels a second O does not fit in registers beside 192-key S), windows of 4
// blocks (level with 2 or up to 3 % behind, with the speculative softmax too), 4 stages (tied with
// 3; 1–2 % behind at the 14B shape with the speculative softmax), exponentials on the FMA pipes, S
// of the next block queued before this one's softmax, S in runs whose row max is taken under the
// next run's GEMM, Q in registers, a running max with headroom, P·V issued after the row max rather
// than with S (so that both consumers' S would run first: 1–3 % slower) (RESULTS, 2026-12-03 to
// 2026-12-06, fifth session), K and Vᵀ blocks shared by CTA pairs (a cluster of 2 on one head, each
// CTA loading half of every block into both by TMA multicast: half the L2 reads, but 1 % slower at
// the 14B shape and 4–5 % at the 1.3B one, likely because a stage refills only once both CTAs
// have released it; ninth session), P through shared memory (each block's P stored to one of its
// warpgroup's two swizzled P tiles as soon as its exponentials were in, before the branch and the
// P·V wait, and P·V an SS wgmma behind a warpgroup barrier, so the conversions no longer waited:
// 2.5–5 % slower at both shapes in 6 of 6 runs on an H200, the extra shared-memory traffic and
// barrier costing more than the wait; thirteenth session). Exponentials on the FMA pipes were
// not timed again beside the speculative softmax and the two levels: with even one of each
// thread's 16 column groups on them (the degree-4 polynomial of the third session), ptxas has too
// few registers left to pipeline the wgmmas (C7511: every QGMMA waits at once; read off
// scripts/kernel-sass.sh, eighteenth session). S as two GEMMs of 64 keys (m64n64k32, each its own
// group), the first half's exponentials taken while the tensor cores ran the second: parity as
// the default's, but 6–7 % slower at both shapes on an H100. Consumer 1 started 500 or 1,000
// cycles after consumer 0 in each CTA (a spin on clock64), so that their softmaxes would start out
// of phase: level with the default within ±1.5 % in 4 of 4 runs (eighteenth session).
// The f32 O in shared memory (64 KiB, each thread's 16 float4 at a stride of 256 threads,
// read-modify-written once per window) with fix_rows' scratch in local memory, which freed O's 64
// registers and the spills: 4–10 % more time at both shapes on an H100; with Q's A fragments in
// 16 of the freed registers as well, 2–9 % more (parity as the default's; twentieth session). Even
// with O out of the registers, exponentials on the FMA pipes serialise the wgmmas (C7511 with one
// column group of the polynomial). Q quantised here instead of by quant.cu (Q bf16 by TMA, its
// codes and scale made by the consumers before the first S, the pass then reading only K and V):
// the pass took 0.021 ms less, the call 1–3 % more on an H200 (twenty-second session).
namespace fp8 {

constexpr int KB = 128;                            // keys per K/V block: the softmax step, one K scale block
constexpr int TILE8 = 128 * 128;                   // bytes of a [128 × 128] e4m3 tile: Q, a K block, a Vᵀ block
constexpr int VSTAGE = TILE8 + 1024;               // a Vᵀ stage: the block, then 8 rows of ones (1 KiB)
constexpr float LOG2_448 = 8.8073549220576041f;    // log2 448
constexpr float LN_448 = 6.1047932324149849f;      // ln 448
constexpr unsigned ONES = 0x38383838u;             // four e4m3 1.0
constexpr int ON = 68;                             // P·V's accumulators: 64 of O, 4 of the row sums
constexpr float HEADROOM = 4.0f;                   // log2 units the offset m keeps above a new row max
constexpr int P448 = 0x43E00000;                   // the bits of 448.0f: p above it overflowed e4m3

// Writes the rows of ones after every Vᵀ stage, which its m64n136 wgmma reads as columns 128–135
// (the 17th group of 8 rows at the SBO stride of 1 KiB): every byte 0x38, so the swizzle does not
// matter. TMA never writes there; the fence makes the stores visible to wgmma (the async proxy).
template <int STAGES>
__device__ __forceinline__ void write_ones(unsigned sv) {
    constexpr int W = 1024 / 4;
    for (int i = threadIdx.x; i < STAGES * W; i += blockDim.x) {
        const unsigned at = sv + (i / W) * VSTAGE + TILE8 + 4 * (i % W);
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(at), "r"(ONES) : "memory");
    }
    fence_proxy_async();
}

// The [128 × 128] box at coordinates (c0, c1) of head h of batch b into `dst`, completing on `bar`.
__device__ __forceinline__ void tma_box(unsigned dst, const TmaMap& map, unsigned bar, int c0, int c1, int h, int b) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
        ::"r"(dst), "l"(reinterpret_cast<u64>(&map)), "r"(bar), "r"(c0), "r"(c1), "r"(h), "r"(b)
        : "memory");
}

// S = Q·Kᵀ over D = 128 bytes for a K block (128 rows of 128 bytes): 4 k-steps of 32.
__device__ __forceinline__ void qk(float* s, unsigned q_wg, unsigned kt) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
        wgmma_ss_e4m3(s, desc(q_wg + kk * 32, 16, 1024), desc(kt + kk * 32, 16, 1024), kk > 0);
}

// o (+)= P·V over a block, and the row sums of P (`VSTAGE`): 4 k-steps of 32 (Vᵀ K-major, 32
// bytes into each channel's row per step). fresh: the block's products alone (the first k-step
// overwrites the accumulator), else added to it.
__device__ __forceinline__ void pv(float* o, unsigned (*p)[4], unsigned vt, bool fresh) {
#pragma unroll
    for (int kk = 0; kk < KB / 32; ++kk) wgmma_rs136_e4m3(o, p[kk], desc(vt + kk * 32, 16, 1024), !fresh || kk > 0);
}

// The f32 O and its row sums take a window's P·V (`o`, at the max of its last block):
// ot = ot·a + o, lt = lt·a + sums, with a = 2^(m at the previous promotion − m of o).
__device__ __forceinline__ void promote(float* ot, float* lt, const float* a, const float* o) {
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) ot[4 * dt + e] = fmaf(ot[4 * dt + e], a[e >> 1], o[4 * dt + e]);
    lt[0] = fmaf(lt[0], a[0], o[64]);
    lt[1] = fmaf(lt[1], a[1], o[66]);
}

// Four e4m3 codes in one word, `a` in the low byte.
__device__ __forceinline__ unsigned e4m3x4(float a, float b, float c, float d) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    return (unsigned)lo | ((unsigned)hi << 16);
}

// P (s = p·448) as the A fragments of the 4 k-steps (see the namespace comment).
__device__ __forceinline__ void pack_p(const float* s, unsigned (*p)[4]) {
#pragma unroll
    for (int kk = 0; kk < KB / 32; ++kk) {
        const float* g = s + 16 * kk;
        p[kk][0] = e4m3x4(g[0], g[1], g[4], g[5]);
        p[kk][1] = e4m3x4(g[2], g[3], g[6], g[7]);
        p[kk][2] = e4m3x4(g[8], g[9], g[12], g[13]);
        p[kk][3] = e4m3x4(g[10], g[11], g[14], g[15]);
    }
}

// One block's online softmax for this thread's rows r0 and r0 + 8, with the block's descale c > 0.
// m is the exponent offset, not the running max: it moves only when a row's max passes it, and
// then to that max + HEADROOM (the max of the rounded products is the rounded max), so later
// blocks rarely pass it (what `spec_softmax` relies on). α = 2^(m_old − m) when it moves (0 on the
// first block), else 1; s ← 2^(s·c − m + log2 448) (the row sums come from P·V). Needs a finite
// score per row. Returns whether some row of the warp moved its offset.
__device__ __forceinline__ bool online_softmax(float* s, float* m, float* alpha, float c) {
    bool rescale = false;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        // The row max as four interleaved chains: the exponentials wait for it.
        float part[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < KB / 8; ++nt)
            part[nt % 4] = fmaxf(part[nt % 4], fmaxf(s[4 * nt + 2 * hf], s[4 * nt + 2 * hf + 1]));
        float mx = fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3])) * c;
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const bool up = mx > m[hf];  // the same in the row's four threads
        const float mn = up ? mx + HEADROOM : m[hf];
        alpha[hf] = up ? ex2(m[hf] - mn) : 1.0f;
        rescale |= up;
        m[hf] = mn;
        const float off = mn - LOG2_448;
#pragma unroll
        for (int nt = 0; nt < KB / 8; ++nt) {
            s[4 * nt + 2 * hf] = ex2(fmaf(s[4 * nt + 2 * hf], c, -off));
            s[4 * nt + 2 * hf + 1] = ex2(fmaf(s[4 * nt + 2 * hf + 1], c, -off));
        }
    }
    return __any_sync(0xffffffffu, rescale);
}

// The speculative softmax of a block: s ← 2^(s·c − m + log2 448) at the offsets m as they stand,
// without first taking the row max, so the exponentials start as soon as S is in. Returns whether
// some p of this thread passed 448, i.e. some score passed its row's offset (then its row's P is
// wrong and its warp puts it right: `fix_rows`). p ≥ 0, so the max of their bits as signed
// integers is the bits of their max, three at a time (VIMNMX3, a Hopper DPX instruction); that
// max needs every exponential, which also keeps them above the P·V wait (see `step`).
__device__ __forceinline__ bool spec_softmax(float* s, const float* m, float c) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const float off = m[hf] - LOG2_448;
#pragma unroll
        for (int nt = 0; nt < KB / 8; ++nt) {
            s[4 * nt + 2 * hf] = ex2(fmaf(s[4 * nt + 2 * hf], c, -off));
            s[4 * nt + 2 * hf + 1] = ex2(fmaf(s[4 * nt + 2 * hf + 1], c, -off));
        }
    }
    int part[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < KB / 2; j += 4) {
        part[0] = __vimax3_s32(part[0], __float_as_int(s[j]), __float_as_int(s[j + 1]));
        part[1] = __vimax3_s32(part[1], __float_as_int(s[j + 2]), __float_as_int(s[j + 3]));
    }
    return max(part[0], part[1]) > P448;
}

// Two e4m3 codes (`v`, the first in the low byte) as f32, in that order.
__device__ __forceinline__ void e4m3x2_f32(unsigned short v, float& lo, float& hi) {
    unsigned short a, b;
    asm("{\n.reg .b32 h;\ncvt.rn.f16x2.e4m3x2 h, %2;\nmov.b32 {%0, %1}, h;\n}\n" : "=h"(a), "=h"(b) : "h"(v));
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(a));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(b));
}

// 16 bytes of shared memory at `at`.
__device__ __forceinline__ uint4 lds128(unsigned at) {
    uint4 r;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(at) : "memory");
    return r;
}

// Σ of the products of 16 e4m3 code pairs, in f32.
__device__ __forceinline__ float dot16(uint4 a, uint4 b) {
    const unsigned x[4] = {a.x, a.y, a.z, a.w}, y[4] = {b.x, b.y, b.z, b.w};
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int hw = 0; hw < 2; ++hw) {
            float a0, a1, b0, b1;
            e4m3x2_f32((unsigned short)(x[j] >> (16 * hw)), a0, a1);
            e4m3x2_f32((unsigned short)(y[j] >> (16 * hw)), b0, b1);
            acc = fmaf(a0, b0, fmaf(a1, b1, acc));
        }
    return acc;
}

// S = Q·K_iᵀ for this warp's 16 rows on the CUDA cores, in f32 (the recipe's sum, in another
// order), from the tiles in shared memory: `q_rows` the warp's first Q row, `kt` the K block, both
// 1024-byte aligned, so that row r's 16-byte chunk j sits at chunk j ^ (r % 8) (the 128B swizzle).
// `fix_rows`' rare path (a wgmma takes the whole warpgroup, this warp alone), kept small and out
// of the registers: the loops stay rolled and S goes through this thread's 64 words of scratch at
// `at` (a stride of 256 words) into s.
__device__ __forceinline__ void qk_scalar(float* s, unsigned q_rows, unsigned kt, unsigned at, int lane) {
#pragma unroll 1
    for (int x = 0; x < KB / 2; ++x) {  // s[x]: row lane / 4 + 8·hf, key 8·nt + 2·(lane % 4) + e
        const int nt = x / 4, hf = (x / 2) % 2, e = x % 2;
        const int r = lane / 4 + 8 * hf, key = 8 * nt + 2 * (lane & 3) + e;
        float acc = 0.0f;
#pragma unroll 1
        for (int ch = 0; ch < 8; ++ch)
            acc += dot16(lds128(q_rows + r * 128 + ((ch ^ (r & 7)) << 4)),
                         lds128(kt + key * 128 + ((ch ^ (key & 7)) << 4)));
        asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(at + 1024 * x), "f"(acc) : "memory");
    }
#pragma unroll
    for (int x = 0; x < KB / 2; ++x) asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(s[x]) : "r"(at + 1024 * x) : "memory");
}

// A warp some of whose p passed 448 (a score passed its row's offset: rare with the headroom)
// puts its rows right alone, without the warpgroup. A row whose p are finite moves its offset to
// its max + HEADROOM, the max read off its largest p (p = 2^(x − m + log2 448)), and its p take
// α = 2^(m_old − m_new): the exact softmax's p, to the exponentials' rounding. If a p overflowed
// f32 (a score ~119 log2 units past the offset), the warp takes S again on the CUDA cores and
// the block's exact softmax. Returns whether some row of the warp moved its offset.
__device__ __forceinline__ bool fix_rows(float* s, float* m, float* alpha, float c, unsigned q_rows, unsigned kt,
                                         unsigned scratch_at, bool last, int lim, int lane) {
    float pm[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        float x = 0.0f;
#pragma unroll
        for (int nt = 0; nt < KB / 8; ++nt) x = fmaxf(x, fmaxf(s[4 * nt + 2 * hf], s[4 * nt + 2 * hf + 1]));
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
        pm[hf] = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
    }
    if (__any_sync(0xffffffffu, isinf(pm[0]) || isinf(pm[1]))) {
        qk_scalar(s, q_rows, kt, scratch_at, lane);
        if (last) mask_keys<KB>(s, lim, lane);
        return online_softmax(s, m, alpha, c);
    }
    bool rescale = false;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        if (pm[hf] > 448.0f) {
            const float mn = m[hf] + (__log2f(pm[hf]) - LOG2_448) + HEADROOM;
            alpha[hf] = ex2(m[hf] - mn);
#pragma unroll
            for (int nt = 0; nt < KB / 8; ++nt) {
                s[4 * nt + 2 * hf] *= alpha[hf];
                s[4 * nt + 2 * hf + 1] *= alpha[hf];
            }
            m[hf] = mn;
            rescale = true;
        }
    }
    return __any_sync(0xffffffffu, rescale);
}

// Block i ≥ 1: waits K_i and V_{i−1}, issues S = Q·K_iᵀ and P_{i−1}·V_{i−1} (P_{i−1} in p; from
// zero when block i − 1 opens a window, FRESH), waits for S only, runs block i's softmax while P·V
// runs, waits for P·V, then packs block i's P into p. When block i − 1 closes a window (PROMOTE),
// the window goes into the f32 O (`promote`, with a = 2^(m at the last promotion − m_{i−1})) and a
// takes block i's α; else the window's accumulator and a take α. Nothing is in flight on return.
template <int STAGES, bool FRESH, bool PROMOTE, bool SPEC>
__device__ __forceinline__ void step(float* s, float* o, float* ot, float* lt, float* a, unsigned (*p)[4], float* m,
                                     const float* ks, float cq, float cs, int i, int kv_len, unsigned q_wg,
                                     unsigned sk, unsigned sv, unsigned full_k, unsigned full_v, unsigned empty_k,
                                     unsigned empty_v, unsigned scratch, unsigned q_warp, unsigned scratch_s,
                                     bool leader, int lane) {
    using namespace ws;
    const int st = i % STAGES, prev = (i - 1) % STAGES;
    const unsigned phase = (i / STAGES) & 1, prev_phase = ((i - 1) / STAGES) & 1;
    const float c = (cq * __ldg(ks + i)) * cs;
    mbar_wait(full_k + 8 * st, phase);
    mbar_wait(full_v + 8 * prev, prev_phase);
    fence_regs<KB / 2>(s);
    fence_regs<ON>(o);
    fence_regs(&p[0][0], KB / 8);
    wgmma_fence();
    qk(s, q_wg, sk + st * TILE8);
    wgmma_commit();
    pv(o, p, sv + prev * VSTAGE, FRESH);
    wgmma_commit();
    wgmma_wait1();  // S is in; P·V of block i − 1 may still run
    fence_regs<KB / 2>(s);
    const bool last = (i + 1) * KB > kv_len;
    if (last) mask_keys<KB>(s, kv_len - i * KB, lane);
    float alpha[2] = {1.0f, 1.0f};
    bool rescale = false;
    if constexpr (SPEC) {
        // The exponentials at the offsets as they stand; a warp where a score passed its offset
        // (rare once the offsets have HEADROOM over the rows' maxima) puts its rows right alone.
        // The branch needs every exponential, which keeps the P·V wait below them. Each warp
        // releases K_i itself: `fix_rows` may still read it after the others are done.
        if (__any_sync(0xffffffffu, spec_softmax(s, m, c)))
            rescale = fix_rows(s, m, alpha, c, q_warp, sk + st * TILE8, scratch_s, last, kv_len - i * KB, lane);
        if (lane == 0) mbar_arrive(empty_k + 8 * st);
    } else {
        if (leader) mbar_arrive(empty_k + 8 * st);
        rescale = online_softmax(s, m, alpha, c);
        // Keeps the P·V wait below the exponentials (see ws::fwd): a store of a word that needs
        // every one of them, their bits folded by XOR.
        unsigned x = 0;
#pragma unroll
        for (int j = 0; j < KB / 2; j += 2) x ^= __float_as_uint(s[j]) ^ __float_as_uint(s[j + 1]);
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(scratch), "r"(x) : "memory");
    }
    // P is packed after the wait: there are no registers for a second P beside the f32 O.
    wgmma_wait0();
    fence_regs<ON>(o);
    fence_regs(&p[0][0], KB / 8);
    if (leader) mbar_arrive(empty_v + 8 * prev);
    if constexpr (PROMOTE) {
        promote(ot, lt, a, o);
        a[0] = alpha[0];
        a[1] = alpha[1];
    } else {
        rescale_o<ON>(o, alpha, rescale);
        a[0] *= alpha[0];
        a[1] *= alpha[1];
    }
    pack_p(s, p);
}

template <int STAGES, int WIN, bool SPEC>
__device__ __forceinline__ void fwd(const TmaMap& tq, const TmaMap& tk, const TmaMap& tv,
                                    const float* __restrict__ q_scales, const float* __restrict__ k_scales,
                                    const float* __restrict__ v_scales, bf16* __restrict__ out, float* __restrict__ lse,
                                    int seq_q, int heads, int kv_len, float scale, const ws::Schedule sched) {
    static_assert(WIN >= 1 && WIN <= 4, "windows of 1 to 4 blocks");
    constexpr int SCRATCH = SPEC ? 64 * 1024 : 0;  // fix_rows' S: 64 words per consumer thread
    static_assert(TILE8 + STAGES * (TILE8 + VSTAGE) + SCRATCH + 1024 + 8 * (1 + 4 * STAGES) + 4 * 256 <= 227 * 1024,
                  "shared memory");
    using namespace ws;
    extern __shared__ __align__(1024) unsigned char smem[];
    __shared__ __align__(8) u64 bars[1 + 4 * STAGES];  // full Q, full K[], full V[], empty K[], empty V[]
    __shared__ float pin[256];
    __shared__ int last;  // a split tile's last chunk: this CTA merges
    const unsigned base = (smem_addr(smem) + 1023u) & ~1023u;
    const unsigned sq = base, sk = base + TILE8, sv = base + TILE8 + STAGES * TILE8;
    const unsigned full_q = smem_addr(&bars[0]);
    const unsigned full_k = full_q + 8, full_v = full_k + 8 * STAGES;
    const unsigned empty_k = full_v + 8 * STAGES, empty_v = empty_k + 8 * STAGES;

    // One work item per CTA: a whole tile, or a run of a split tile's blocks [lo, hi) (`ws::Schedule`;
    // dispatched in order, so the split tiles' chunks fill the last wave). kv_rel: the valid keys
    // from block lo on (only the tile's last block can be partial).
    const ws::Item it = ws::item_of<KB>(blockIdx.x, sched, heads, kv_len);
    const int q0 = it.q0, h = it.h, b = it.b, lo = it.lo, nblk = it.hi - it.lo;
    const int kv_rel = kv_len - lo * KB;
    const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x / 128, 0);
    const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    if (nblk <= 0) {  // no valid key: out = 0, lse = −∞
        if (wg < 2) {
            const float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
            float zero[64];
#pragma unroll
            for (int i = 0; i < 64; ++i) zero[i] = 0.0f;
            store_rows(out, lse, zero, m, l, b, h, q0 + wg * 64 + warp * 16, lane, seq_q, heads, scale);
        }
        return;
    }
    if (threadIdx.x == 0) {
        mbar_init(full_q, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_k + 8 * s, 1);
            mbar_init(full_v + 8 * s, 1);
            mbar_init(empty_k + 8 * s, SPEC ? 8 : 2);  // `_spec`: each consumer warp releases K itself
            mbar_init(empty_v + 8 * s, 2);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    write_ones<STAGES>(sv);
    __syncthreads();

    if (wg == 2) {  // producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        if (warp != 0 || lane != 0) return;
        mbar_expect_tx(full_q, TILE8);
        tma_box(sq, tq, full_q, 0, q0, h, b);
        for (int i = 0; i < nblk; ++i) {
            const int s = i % STAGES;
            const unsigned phase = (i / STAGES) & 1;
            mbar_wait(empty_k + 8 * s, phase ^ 1);
            mbar_expect_tx(full_k + 8 * s, TILE8);
            tma_box(sk + s * TILE8, tk, full_k + 8 * s, 0, (lo + i) * KB, h, b);
            mbar_wait(empty_v + 8 * s, phase ^ 1);
            mbar_expect_tx(full_v + 8 * s, TILE8);
            tma_box(sv + s * VSTAGE, tv, full_v + 8 * s, (lo + i) * KB, 0, h, b);
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
    const int w = wg;
    const i64 head = (i64)b * heads + h;
    const float* ks = k_scales + head * ((kv_len + KB - 1) / KB) + lo;  // from block lo
    // cq = s_q, cs = scale·log2 e; a block's descale is (cq·s_k)·cs (the reference's
    // (s_q·s_k)·scale in base 2, a rounding apart).
    const float cq = q_scales[head * sched.tiles_x + q0 / BR];
    const float cs = scale * 1.4426950408889634f;
    float m[2] = {-INFINITY, -INFINITY};
    float o[ON];  // the open window's P·V and sums (the tensor cores')
#pragma unroll
    for (int i = 0; i < ON; ++i) o[i] = 0.0f;
    float ot[64], lt[2] = {0.0f, 0.0f}, a[2];  // O and its sums in f32, and the factor they wait for
#pragma unroll
    for (int i = 0; i < 64; ++i) ot[i] = 0.0f;
    const bool leader = threadIdx.x % 128 == 0;
    const unsigned q_wg = sq + w * 64 * 128;
    const unsigned scratch = smem_addr(&pin[threadIdx.x]);
    const unsigned q_warp = q_wg + warp * 16 * 128, scratch_s = sv + STAGES * VSTAGE + 4 * threadIdx.x;
    float s[KB / 2];
    unsigned p[KB / 32][4];

    // Prologue: block 0.
    const float c0 = (cq * __ldg(ks)) * cs;
    mbar_wait(full_q, 0);
    mbar_wait(full_k, 0);
    fence_regs<KB / 2>(s);
    wgmma_fence();
    qk(s, q_wg, sk);
    wgmma_commit();
    wgmma_wait0();
    fence_regs<KB / 2>(s);
    if (SPEC ? lane == 0 : leader) mbar_arrive(empty_k);
    if (KB > kv_rel) mask_keys<KB>(s, kv_rel, lane);
    online_softmax(s, m, a, c0);  // a = 0: ot = 0·0 + the first window
    pack_p(s, p);

#define FP8_STEP(I, FRESH, PROMOTE)                                                                          \
    step<STAGES, FRESH, PROMOTE, SPEC>(s, o, ot, lt, a, p, m, ks, cq, cs, I, kv_rel, q_wg, sk, sv, full_k,    \
                                       full_v, empty_k, empty_v, scratch, q_warp, scratch_s, leader, lane)
    // Window w holds blocks w·WIN … w·WIN + WIN − 1, so step i opens one (P·V_{i−1} fresh) when
    // i ≡ 1 and closes one when i ≡ 0 (mod WIN): the loop is unrolled by WIN so that both are known
    // at compile time; the steps left after it open at most one and close none.
    int i = 1;
    for (; i + WIN - 1 < nblk; i += WIN) {
        FP8_STEP(i, true, WIN == 1);
        if constexpr (WIN > 1) FP8_STEP(i + 1, false, WIN == 2);
        if constexpr (WIN > 2) FP8_STEP(i + 2, false, WIN == 3);
        if constexpr (WIN > 3) FP8_STEP(i + 3, false, WIN == 4);
    }
    bool fresh = true;  // the last block opens a window
    if (WIN > 1 && i < nblk) {
        FP8_STEP(i, true, false);
        for (++i; i < nblk; ++i) FP8_STEP(i, false, false);
        fresh = false;
    }
#undef FP8_STEP
    // The last block's P·V, then the last promotion.
    const int last_stage = (nblk - 1) % STAGES;
    mbar_wait(full_v + 8 * last_stage, ((nblk - 1) / STAGES) & 1);
    fence_regs<ON>(o);
    fence_regs(&p[0][0], KB / 8);
    wgmma_fence();
    pv(o, p, sv + last_stage * VSTAGE, fresh);
    wgmma_commit();
    wgmma_wait0();
    fence_regs<ON>(o);
    promote(ot, lt, a, o);

    // out = O·s_v / l, lse = m·ln 2 + ln l − ln 448; register 4·dt + 2·hf + e holds channel
    // 8·dt + 2·(lane % 4) + e, and lt the whole row's sum in every thread of its quad.
    const float* vs = v_scales + head * D + 2 * (lane & 3);
    float row_lse[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const float inv = lt[hf] > 0.0f ? 1.0f / lt[hf] : 0.0f;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            ot[4 * dt + 2 * hf] *= inv * __ldg(vs + 8 * dt);
            ot[4 * dt + 2 * hf + 1] *= inv * __ldg(vs + 8 * dt + 1);
        }
        row_lse[hf] = lt[hf] > 0.0f ? m[hf] * 0.69314718055994531f + logf(lt[hf]) - LN_448 : -INFINITY;
    }
    const int row0 = q0 + w * 64 + warp * 16;
    if ((int)blockIdx.x < sched.n_full) write_rows(out, lse, ot, row_lse, b, h, row0, lane, seq_q, heads);
    else ws::merge_split(ot, row_lse, sched, blockIdx.x, it, row0, lane, seq_q, heads, out, lse, last);
}

}  // namespace fp8

}  // namespace hopper

#endif  // HOPPER_WGMMA

// hopper_fwd_d128_br128_bc128_s<STAGES> (kernels/src/ops/attention/hopper.rs launches them, listed in
// HOPPER_VARIANTS of kernels/src/cuda/attention_kernel.rs): 256 threads, grid (⌈S_q/128⌉, H, B), dynamic
// shared memory (1 + 2·STAGES) tiles of 32 KiB + 1 KiB for the run-time 1024 alignment.
#ifdef HOPPER_WGMMA
#define HOPPER_BODY(STAGES) hopper::fwd<STAGES>(q, k, v, out, lse, seq_q, seq_k, heads, kv_len, scale);
#else
#define HOPPER_BODY(STAGES)
#endif
#define HOPPER_KERNEL(STAGES) \
    extern "C" __global__ void __launch_bounds__(256, 1) hopper_fwd_d128_br128_bc128_s##STAGES( \
        const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int seq_q, int seq_k, int heads, \
        int kv_len, float scale) { \
        HOPPER_BODY(STAGES) \
    }
HOPPER_KERNEL(2)
HOPPER_KERNEL(3)

// hopper_ws_fwd_d128_br128_bc<KB>_s<STAGES> (the warp-specialised kernel): 384 threads, a 1-D grid of
// at most as many CTAs as work items (ws::Schedule: n_full + split tiles × ways), dynamic shared memory Q (32 KiB) + 2·STAGES
// K/V tiles of KB·256 bytes + 1 KiB alignment slack; the tensor maps of q ([B, S_q, H, 128] bf16, box
// 64 × 128) and of k and v (S = kv_len, box 64 × KB) and the schedule come from hopper.rs; seq_k only
// keeps the argument list the cp.async kernels' (the maps carry the strides).
#ifdef HOPPER_WGMMA
#define HOPPER_WS_BODY(STAGES, KB)                                                                   \
    hopper::ws::fwd<STAGES, KB>(tq, tk, tv, out, lse, seq_q, heads, kv_len, scale,                  \
                                hopper::ws::Schedule{part, tickets, tiles_x, n_full, ways, items});
#else
#define HOPPER_WS_BODY(STAGES, KB)
#endif
#define HOPPER_WS_KERNEL(STAGES, KB)                                                                       \
    extern "C" __global__ void __launch_bounds__(384, 1) hopper_ws_fwd_d128_br128_bc##KB##_s##STAGES(      \
        const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tk, const __grid_constant__ TmaMap tv, \
        bf16* out, float* lse, int seq_q, int seq_k, int heads, int kv_len, float scale, float* part,       \
        unsigned* tickets, int tiles_x, int n_full, int ways, int items) {                                  \
        HOPPER_WS_BODY(STAGES, KB)                                                                         \
    }
HOPPER_WS_KERNEL(2, 128)
HOPPER_WS_KERNEL(3, 128)
HOPPER_WS_KERNEL(2, 176)
HOPPER_WS_KERNEL(2, 192)

// hopper_fp8_fwd_d128_br128_bc128_s<STAGES>_win<WIN> (the FP8 forward, namespace fp8; launched by
// ops/attention/hopper.rs's `attention_fp8`): 384 threads, one CTA per work item of ws::Schedule (a
// tile of 128 query rows of one (batch, head), tile = q-tile + tiles_x·(h + heads·b), or a chunk of a
// split tile's K/V blocks; `items` CTAs), dynamic shared memory Q (16 KiB) + STAGES
// K stages of 16 KiB and Vᵀ stages of 17 KiB + 1 KiB alignment slack; the tensor maps of the codes
// of q and k ([B, S, H, 128] u8, boxes 128 × 128; k's S = kv_len) and of vᵀ ([B, H, 128, S_pad] u8,
// boxes of 128 keys × 128 channels), all in the 128B swizzle, and their scales (q, k [B, H,
// ⌈S/128⌉], v [B, H, 128]).
#ifdef HOPPER_WGMMA
#define HOPPER_FP8_BODY(STAGES, WIN, SPEC)                                                                    \
    hopper::fp8::fwd<STAGES, WIN, SPEC>(tq, tk, tv, q_scales, k_scales, v_scales, out, lse, seq_q, heads, kv_len, scale, \
                                        hopper::ws::Schedule{part, tickets, tiles_x, n_full, ways, items});
#else
#define HOPPER_FP8_BODY(STAGES, WIN, SPEC)
#endif
#define HOPPER_FP8_KERNEL(STAGES, WIN, SPEC, NAME)                                                                \
    extern "C" __global__ void __launch_bounds__(384, 1) NAME(                                                   \
        const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tk, const __grid_constant__ TmaMap tv, \
        const float* q_scales, const float* k_scales, const float* v_scales, bf16* out, float* lse, int seq_q,   \
        int heads, int kv_len, float scale, float* part, unsigned* tickets, int tiles_x, int n_full, int ways,  \
        int items) {                                                                                             \
        HOPPER_FP8_BODY(STAGES, WIN, SPEC)                                                                        \
    }
HOPPER_FP8_KERNEL(3, 3, true, hopper_fp8_fwd_d128_br128_bc128_s3_win3_spec)
HOPPER_FP8_KERNEL(3, 2, true, hopper_fp8_fwd_d128_br128_bc128_s3_win2_spec)
HOPPER_FP8_KERNEL(3, 2, false, hopper_fp8_fwd_d128_br128_bc128_s3_win2)
HOPPER_FP8_KERNEL(3, 1, false, hopper_fp8_fwd_d128_br128_bc128_s3_win1)
