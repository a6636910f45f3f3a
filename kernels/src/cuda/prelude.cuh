// Prelude of every ditstream kernel source (prepended by kernels/src/cuda/nvrtc.rs).
// Storage is f32 or bf16; maths runs in f32 registers: `ld` widens, `st` rounds to nearest even.
#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;
typedef long long i64;

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ float ld(const bf16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void st(float* p, float v) { *p = v; }
__device__ __forceinline__ void st(bf16* p, float v) { *p = __float2bfloat16_rn(v); }

// Stores V values as V elements of O at dst (aligned to V · sizeof(O) bytes): one 16- or 8-byte store.
template <typename O, int V>
__device__ __forceinline__ void store_word(O* dst, const float* v) {
    union {
        O e[V];
        uint4 w16;
        uint2 w8;
    } u;
#pragma unroll
    for (int k = 0; k < V; ++k) st(u.e + k, v[k]);
    if (sizeof(O) * V == 16) {
        *reinterpret_cast<uint4*>(dst) = u.w16;
    } else if (sizeof(O) * V == 8) {
        *reinterpret_cast<uint2*>(dst) = u.w8;
    } else {
#pragma unroll
        for (int k = 0; k < V; ++k) dst[k] = u.e[k];
    }
}

// V consecutive elements at p as f32, in 16-byte loads (one 8-byte load where V·sizeof(W) is 8);
// p aligned to min(16, V·sizeof(W)) bytes. When a thread's V elements are its word of a row (the
// row kernels' parameters, the word-wise binary op's operands), a warp reads each 32-byte sector
// once; V scalar loads, one element per lane at a time, make the L1 serve each sector V times
// (which bounded norm.cu's row kernels at ~1.5 TB/s with f32 parameters).
template <typename W, int V>
__device__ __forceinline__ void load_vec(const W* p, float* out) {
    constexpr int BYTES = V * sizeof(W);
    static_assert(BYTES % 8 == 0, "V elements are whole 8-byte pieces");
    if constexpr (BYTES % 16 == 0) {
        constexpr int PER = 16 / sizeof(W);
#pragma unroll
        for (int c = 0; c < BYTES / 16; ++c) {
            const uint4 w = reinterpret_cast<const uint4*>(p)[c];
            const W* e = reinterpret_cast<const W*>(&w);
#pragma unroll
            for (int k = 0; k < PER; ++k) out[c * PER + k] = ld(e + k);
        }
    } else {
        const uint2 w = *reinterpret_cast<const uint2*>(p);
        const W* e = reinterpret_cast<const W*>(&w);
#pragma unroll
        for (int k = 0; k < V; ++k) out[k] = ld(e + k);
    }
}

// SiLU, v · sigmoid(v), for every kernel that applies it (elementwise.cu's silu, norm.cu's fused
// norm + SiLU), so they agree bit for bit. The fast intrinsics (exp2-based __expf, reciprocal-based
// __fdividef) are within a few f32 ulps of the exact function over the range that matters (the CPU
// twin's tolerance covers them): the accurate expf and IEEE division made the VAE's norm + SiLU
// kernel instruction-bound. Where 1 + e^-v overflows (v < -88) the quotient is -0 or 0, as the limit.
__device__ __forceinline__ float silu_f32(float v) { return __fdividef(v, 1.0f + __expf(-v)); }

// Grid-stride loop over [0, n).
#define FOR_EACH(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

// Most axes a strided index walks (after merging contiguous axes on the host).
#define MAX_RANK 8

// Shape of an index space and, per operand, the element stride of each axis (0 on broadcast axes).
// Mirrors `Layout` in kernels/src/cuda/copy.rs.
struct Layout {
    int rank;
    int pad_;
    i64 shape[MAX_RANK];
    i64 stride[3][MAX_RANK];
};

// Offsets of flat index i (row-major over layout.shape) in up to three strided operands. The
// coordinates come from one division per axis: in 32 bits where the index and the axis fit (every
// DiT and VAE tensor: < 2^31 elements), as 64-bit division is a long software sequence on the GPU
// and made these kernels instruction-bound; the strides still multiply in 64 bits.
__device__ __forceinline__ void offsets(const Layout& l, i64 i, i64* o0, i64* o1, i64* o2) {
    i64 a = 0, b = 0, c = 0;
    if (i <= 0x7fffffff) {
        unsigned u = (unsigned)i;
        for (int axis = l.rank - 1; axis >= 0; --axis) {
            // An axis longer than u is the outermost one reached: its coordinate is u itself.
            const i64 n = l.shape[axis];
            const unsigned coord = n > (i64)u ? u : u % (unsigned)n;
            u = n > (i64)u ? 0 : u / (unsigned)n;
            a += (i64)coord * l.stride[0][axis];
            b += (i64)coord * l.stride[1][axis];
            c += (i64)coord * l.stride[2][axis];
        }
    } else {
        for (int axis = l.rank - 1; axis >= 0; --axis) {
            i64 n = l.shape[axis];
            i64 coord = i % n;
            i /= n;
            a += coord * l.stride[0][axis];
            b += coord * l.stride[1][axis];
            c += coord * l.stride[2][axis];
        }
    }
    *o0 = a;
    *o1 = b;
    *o2 = c;
}

// Instantiates MACRO for every (T, U) pair of storage types, passing the name suffixes too.
#define FOR_TYPES2(MACRO) \
    MACRO(f32, float, f32, float) MACRO(f32, float, bf16, bf16) \
    MACRO(bf16, bf16, f32, float) MACRO(bf16, bf16, bf16, bf16)

#if __CUDA_ARCH__ >= 800
// Shared by the kernels that stage global memory in shared memory with cp.async and read it with
// ldmatrix (flash.cu, hopper.cu, quant.cu's Vᵀ quantisation).
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
// 16 bytes global → shared, zero-filled when !valid (no bytes are read then).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
// Four 8 × 8 b16 matrices from shared memory (lanes 8i…8i+7 give matrix i's row addresses, 16
// bytes each): lane l gets row l / 4, elements 2·(l % 4) and + 1, of each (the low half first).
__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}
// The same, transposed: lane l gets column l / 4, rows 2·(l % 4) and + 1.
__device__ __forceinline__ void ldsm_x4_t(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are in flight.
template <int N>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Shared by the tensor-core attention kernels (flash.cu, hopper.cu).
// 2^x on the special-function unit (approximate; denormals flushed to zero).
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// bf16x2 with lo in the low half (the lower column index), round to nearest even: cvt puts its first
// source in the upper half.
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
#endif

// Shared by the e4m3 quantisations (quant.cu, norm.cu's *_e4m3 kernels).
// Largest v over the block, returned to every thread. Blocks are a multiple of 32 threads, ≤ 1024.
// fmaxf drops a NaN operand, as the CPU reference's f32::max does.
__device__ float block_max(float v) {
    __shared__ float partial[32];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // the previous row's readers are done with `partial`
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    float t = lane < (int)(blockDim.x / 32) ? partial[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
    return t;
}

// A row's e4m3 scale from its largest magnitude: amax / 448, 1 for an all-zero row.
__device__ __forceinline__ float e4m3_scale(float amax) { return amax > 0.0f ? amax / 448.0f : 1.0f; }
// What codes are made with: e4m3(x · e4m3_rcp(s)), one IEEE division per scale (the CPU twin's
// `quant::cpu::rcp`). With a division per element (an IEEE one is a reciprocal, FMAs, a check and
// a slow path) the quantising row kernels compiled to 2.5× the SASS of a plain RMSNorm (1,536 against
// 600 instructions; 1,112 with the reciprocal: scripts/kernel-sass.sh).
__device__ __forceinline__ float e4m3_rcp(float s) { return 1.0f / s; }

#if __CUDA_ARCH__ >= 890
// Two e4m3 codes in one 16-bit word, `lo` in the low byte (the lower address): round to nearest
// even, saturated to ±448 (cvt's satfinite; its first source goes to the upper byte).
__device__ __forceinline__ unsigned short e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}
#endif
