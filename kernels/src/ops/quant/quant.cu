// FP8 (e4m3) per-row quantisation, the twin of cpu.rs's quantize_rows: one block per row (grid-stride
// over rows), the row's largest magnitude by a block reduction, s = amax / 448 (1 for an all-zero
// row), codes = e4m3(x · r) with r = 1/s an IEEE division (NVRTC's default -prec-div) once per
// scale (e4m3_rcp), x · r one f32 product, and the e4m3 rounding to nearest even, saturated to ±448 (cvt.rn.satfinite, sm_89 on): the CPU's arithmetic
// step for step, so codes and scales agree bit for bit. block_max, e4m3_scale and e4m3x2 are the
// prelude's (norm.cu's *_e4m3 kernels quantise with them too).

// Any k: element by element (the odd last code is written as a byte).
template <typename T>
__device__ void quantize_rows(const T* x, unsigned char* q, float* scales, i64 rows, int k) {
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * k;
        unsigned char* qr = q + row * k;
        float m = 0.0f;
        for (int i = threadIdx.x; i < k; i += blockDim.x) m = fmaxf(m, fabsf(ld(xr + i)));
        const float s = e4m3_scale(block_max(m)), rs = e4m3_rcp(s);
        for (int i = threadIdx.x; i < k; i += blockDim.x) qr[i] = (unsigned char)(e4m3x2(ld(xr + i) * rs, 0.0f) & 0xff);
        if (threadIdx.x == 0) scales[row] = s;
    }
}

// k a multiple of 8, x and q 16- and 8-byte aligned: each thread reads 8 elements at a time (one or
// two 16-byte loads) and writes their 8 codes in one 8-byte store; the row's second pass reads what
// the first left in L1/L2.
template <typename T>
__device__ void quantize_rows_v8(const T* x, unsigned char* q, float* scales, i64 rows, int k) {
    const int words = k / 8;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * k;
        uint2* qr = reinterpret_cast<uint2*>(q + row * k);
        float m = 0.0f;
        for (int w = threadIdx.x; w < words; w += blockDim.x) {
            float v[8];
            load_vec<T, 8>(xr + 8 * w, v);
#pragma unroll
            for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(v[j]));
        }
        const float s = e4m3_scale(block_max(m)), rs = e4m3_rcp(s);
        for (int w = threadIdx.x; w < words; w += blockDim.x) {
            float v[8];
            load_vec<T, 8>(xr + 8 * w, v);
            unsigned int c[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) c[j] = e4m3x2(v[2 * j] * rs, v[2 * j + 1] * rs);
            qr[w] = make_uint2(c[0] | (c[1] << 16), c[2] | (c[3] << 16));
        }
        if (threadIdx.x == 0) scales[row] = s;
    }
}

#define QUANT(TN, T)                                                                                       \
    extern "C" __global__ void quantize_rows_e4m3_##TN(const T* x, unsigned char* q, float* scales,         \
                                                       i64 rows, int k) {                                   \
        quantize_rows<T>(x, q, scales, rows, k);                                                           \
    }                                                                                                      \
    extern "C" __global__ void quantize_rows_e4m3_v8_##TN(const T* x, unsigned char* q, float* scales,      \
                                                          i64 rows, int k) {                                \
        quantize_rows_v8<T>(x, q, scales, rows, k);                                                        \
    }

QUANT(f32, float)
QUANT(bf16, bf16)

// ---- The FP8 attention's operands (the twin of ops/quant/attention.rs's quantisation; hopper.cu's
// namespace fp8 reads them). Heads of 128 channels; Q, K, V bf16 [B, S, H, 128].

// Q and K → codes in their layout, with one scale per (batch, head, block of 128 tokens) over the
// tokens below their valid length (S_q; kv_len for K: later codes are not written), scales
// [B, H, ⌈valid/128⌉]; and V's largest magnitude per (batch, head, channel) over the tokens below
// kv_len, as f32 bits (non-negative floats order as their bits) maxed into `amax` [B, H, 128],
// zeroed before. One launch for the three: grid (q_blocks + 2·k_blocks, H, B), 256 threads; x below
// q_blocks is Q's block x, then K's k_blocks blocks, then V's. A Q or K block's 128 × 128 values
// stay in registers between its max and its codes, read once (the three kernels this replaced
// read Q and K twice: 8.0 ms of a 1.3B FP8 forward's recorded 338 went to the quantisation then,
// 7.4 now, bench/RESULTS.md 2026-12-04 third session); a max is exact in any order, so the codes
// and scales are the CPU recipe's bit for bit.
extern "C" __global__ void quantize_attention_qkv_bf16(const bf16* q, const bf16* k, const bf16* v,
                                                       unsigned char* q8, unsigned char* k8, float* q_scales,
                                                       float* k_scales, unsigned* amax, int seq_q, int seq_k,
                                                       int heads, int kv_len, int q_blocks, int k_blocks) {
    const int h = blockIdx.y, b = blockIdx.z;
    int blk = blockIdx.x;
    if (blk >= q_blocks + k_blocks) {  // V's amax over the block's tokens below kv_len
        const int t0 = (blk - q_blocks - k_blocks) * 128, g = threadIdx.x % 16, r = threadIdx.x / 16;
        float m[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int t = t0 + r + 16 * i;
            if (t >= kv_len) break;
            float x[8];
            load_vec<bf16, 8>(v + (((i64)b * seq_k + t) * heads + h) * 128 + 8 * g, x);
#pragma unroll
            for (int j = 0; j < 8; ++j) m[j] = fmaxf(m[j], fabsf(x[j]));
        }
        __shared__ float part[8][128];  // [warp][channel]: lanes l and l + 16 share a channel group
#pragma unroll
        for (int j = 0; j < 8; ++j) m[j] = fmaxf(m[j], __shfl_xor_sync(0xffffffffu, m[j], 16));
        if (threadIdx.x % 32 < 16)
#pragma unroll
            for (int j = 0; j < 8; ++j) part[threadIdx.x / 32][8 * g + j] = m[j];
        __syncthreads();
        if (threadIdx.x < 128) {
            float c = part[0][threadIdx.x];
#pragma unroll
            for (int w = 1; w < 8; ++w) c = fmaxf(c, part[w][threadIdx.x]);
            atomicMax(amax + ((i64)b * heads + h) * 128 + threadIdx.x, __float_as_uint(c));
        }
        return;
    }
    const bool is_q = blk < q_blocks;
    if (!is_q) blk -= q_blocks;
    const bf16* x = is_q ? q : k;
    unsigned char* codes = is_q ? q8 : k8;
    const int seq = is_q ? seq_q : seq_k, valid = is_q ? seq_q : kv_len, n = is_q ? q_blocks : k_blocks;
    // Chunk c = threadIdx.x + 256·i: token c / 16 of the block, channels 8·(c % 16) on.
    const int t0 = blk * 128, chunks = min(128, valid - t0) * 16;
    const auto at = [&](int c) { return (((i64)b * seq + t0 + c / 16) * heads + h) * 128 + 8 * (c % 16); };
    uint4 held[8];
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int c = threadIdx.x + 256 * i;
        held[i] = c < chunks ? *reinterpret_cast<const uint4*>(x + at(c)) : make_uint4(0u, 0u, 0u, 0u);
        const bf16* e = reinterpret_cast<const bf16*>(&held[i]);
#pragma unroll
        for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(ld(e + j)));
    }
    const float s = e4m3_scale(block_max(m)), rs = e4m3_rcp(s);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int c = threadIdx.x + 256 * i;
        if (c >= chunks) break;
        const bf16* e = reinterpret_cast<const bf16*>(&held[i]);
        unsigned int w[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) w[j] = e4m3x2(ld(e + 2 * j) * rs, ld(e + 2 * j + 1) * rs);
        *reinterpret_cast<uint2*>(codes + at(c)) = make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
    }
    if (threadIdx.x == 0) (is_q ? q_scales : k_scales)[((i64)b * heads + h) * n + blk] = s;
}

// V → Vᵀ codes [B, H, 128, s_pad] (s_pad a multiple of 128; 0 for keys ≥ kv_len) and its scales
// [B, H, 128] from `amax`: grid (s_pad/128, H, B), 256 threads (the loops below count on it). A
// block of 128 keys goes through shared memory (rows padded by 16 bytes, so that the 8 rows an
// ldmatrix reads start 4 banks apart); Vᵀ's column 32r + 16h + 4t + 2j + e holds key 32r + 16h +
// 8j + 2t + e, the order hopper.cu's fp8 P fragments take the keys in. Each thread's 8 chunks of V
// go to shared memory by cp.async, issued together with its loads of amax before it waits on any
// (this way the kernel took 67.9 µs at (1,12,32760,128) on an H100 against 83.1 with loads into
// registers: bench/RESULTS.md, 2026-12-07, fifteenth session). The transpose is ldmatrix's: one
// `.trans` x4 gives lane (g, t) = (l / 4, l % 4) keys 8i + 2t and + 1 of channel g in register i,
// which for i = 2h + j are Vᵀ's columns 16h + 4t + 2j + e: four codes in a row for each h, one
// word a store. It replaces 64 scalar 2-byte reads a thread with 8-way bank conflicts (by
// arithmetic 4,096 wavefronts a block against 128; a conflict-free XOR swizzle of those scalar
// reads was 20 % slower, fourteenth session), and a third of the kernel's SASS: 0.063 ms against
// 0.074 in the FP8 call's `SPLIT` at (1,12,32760,128) on an H100, codes bit for bit the same
// (kernels_unit's `ops::quant` GPU test; bench/RESULTS.md, 2026-12-07, twenty-fifth session).
extern "C" __global__ void quantize_attention_v_e4m3_bf16(const bf16* v, const unsigned* amax, unsigned char* vt,
                                                          float* v_scales, int seq, int heads, int kv_len, int s_pad) {
    constexpr int ROW = 136;  // bf16 a tile row: 128 keys' channels and 16 bytes of padding
    __shared__ __align__(16) bf16 tile[128 * ROW];
    const int h = blockIdx.y, b = blockIdx.z, t0 = blockIdx.x * 128;
    const i64 head = (i64)b * heads + h;
    const unsigned base = smem_addr(tile);
    // Chunk c = threadIdx.x + 256·i: key c / 16 of the block, channels 8·(c % 16) on (none read
    // past kv_len: zeros).
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int c = threadIdx.x + 256 * i, t = c / 16, col = 8 * (c % 16);
        const bool valid = t0 + t < kv_len;
        cp_async16(base + 2 * (t * ROW + col), v + (((i64)b * seq + t0 + (valid ? t : 0)) * heads + h) * 128 + col, valid);
    }
    cp_commit();
    // Warp w: channel blocks 2w and 2w + 1, this lane's channel 8·(block) + g in each.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    unsigned bits[2];
#pragma unroll
    for (int cb = 0; cb < 2; ++cb) bits[cb] = amax[head * 128 + 8 * (2 * warp + cb) + g];
    cp_wait<0>();
    __syncthreads();
#pragma unroll
    for (int cb = 0; cb < 2; ++cb) {
        const int c8 = 8 * (2 * warp + cb), d = c8 + g;
        const float s = e4m3_scale(__uint_as_float(bits[cb])), rs = e4m3_rcp(s);
        unsigned char* row = vt + (head * 128 + d) * s_pad + t0 + 4 * t;
#pragma unroll
        for (int run = 0; run < 4; ++run) {  // keys 32·run on
            // Matrix i = lane / 8: keys 32·run + 8i + lane % 8 (its rows), channels c8 … c8 + 7.
            unsigned r[4];
            ldsm_x4_t(base + 2 * ((32 * run + lane) * ROW + c8), r[0], r[1], r[2], r[3]);
            unsigned w[2];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const unsigned lo = r[2 * hh], hi = r[2 * hh + 1];  // j = 0, 1: keys 2t, 2t + 1 (low half first)
                w[hh] = e4m3x2(__uint_as_float(lo << 16) * rs, __uint_as_float(lo & 0xffff0000u) * rs) |
                        ((unsigned)e4m3x2(__uint_as_float(hi << 16) * rs, __uint_as_float(hi & 0xffff0000u) * rs) << 16);
            }
            *reinterpret_cast<unsigned*>(row + 32 * run) = w[0];
            *reinterpret_cast<unsigned*>(row + 32 * run + 16) = w[1];
        }
        if (blockIdx.x == 0 && t == 0) v_scales[head * 128 + d] = s;
    }
}
