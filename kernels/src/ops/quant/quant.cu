// FP8 (e4m3) per-row quantisation, the twin of cpu.rs's quantize_rows: one block per row (grid-stride
// over rows), the row's largest magnitude by a block reduction, s = amax / 448 (1 for an all-zero
// row), codes = e4m3(x / s) with x / s an IEEE division (NVRTC's default -prec-div) and the e4m3
// rounding to nearest even, saturated to ±448 (cvt.rn.satfinite, sm_89 on): the CPU's arithmetic
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
        const float s = e4m3_scale(block_max(m));
        for (int i = threadIdx.x; i < k; i += blockDim.x) qr[i] = (unsigned char)(e4m3x2(ld(xr + i) / s, 0.0f) & 0xff);
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
        const float s = e4m3_scale(block_max(m));
        for (int w = threadIdx.x; w < words; w += blockDim.x) {
            float v[8];
            load_vec<T, 8>(xr + 8 * w, v);
            unsigned int c[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) c[j] = e4m3x2(v[2 * j] / s, v[2 * j + 1] / s);
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

// Q or K → codes in the same layout, with one scale per (batch, head, block of 128 tokens) over the
// tokens below `valid` (later ones are not written): grid (⌈valid/128⌉, H, B), 256 threads, each
// taking 8 channels of a token at a time; scales [B, H, ⌈valid/128⌉].
extern "C" __global__ void quantize_attention_blocks_e4m3_bf16(const bf16* x, unsigned char* q, float* scales,
                                                               int seq, int heads, int valid) {
    const int blk = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int t0 = blk * 128, chunks = min(128, valid - t0) * 16;
    const auto at = [&](int c) { return (((i64)b * seq + t0 + c / 16) * heads + h) * 128 + 8 * (c % 16); };
    float m = 0.0f;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        float v[8];
        load_vec<bf16, 8>(x + at(c), v);
#pragma unroll
        for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(v[j]));
    }
    const float s = e4m3_scale(block_max(m));
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        float v[8];
        load_vec<bf16, 8>(x + at(c), v);
        unsigned int w[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) w[j] = e4m3x2(v[2 * j] / s, v[2 * j + 1] / s);
        *reinterpret_cast<uint2*>(q + at(c)) = make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
    }
    if (threadIdx.x == 0) scales[((i64)b * heads + h) * gridDim.x + blk] = s;
}

// V's largest magnitude per (batch, head, channel) over the tokens below kv_len, as f32 bits
// (non-negative floats order as their bits) maxed into `amax` [B, H, 128], zeroed before: grid
// (⌈kv_len/128⌉, H, B), 128 threads, one per channel.
extern "C" __global__ void attention_v_amax_bf16(const bf16* v, unsigned* amax, int seq, int heads, int kv_len) {
    const int h = blockIdx.y, b = blockIdx.z, t0 = blockIdx.x * 128, t1 = min(t0 + 128, kv_len);
    float m = 0.0f;
    for (int t = t0; t < t1; ++t) m = fmaxf(m, fabsf(ld(v + (((i64)b * seq + t) * heads + h) * 128 + threadIdx.x)));
    atomicMax(amax + ((i64)b * heads + h) * 128 + threadIdx.x, __float_as_uint(m));
}

// V → Vᵀ codes [B, H, 128, s_pad] (s_pad a multiple of 128; 0 for keys ≥ kv_len) and its scales
// [B, H, 128] from `amax`: grid (s_pad/128, H, B), 256 threads. A block of 128 keys goes through
// shared memory (rows padded by 16 bytes); Vᵀ's column 32r + 16h + 4t + 2j + e holds key
// 32r + 16h + 8j + 2t + e, the order hopper.cu's fp8 P fragments take the keys in.
extern "C" __global__ void quantize_attention_v_e4m3_bf16(const bf16* v, const unsigned* amax, unsigned char* vt,
                                                          float* v_scales, int seq, int heads, int kv_len, int s_pad) {
    __shared__ __align__(16) bf16 tile[128][136];
    const int h = blockIdx.y, b = blockIdx.z, t0 = blockIdx.x * 128;
    const i64 head = (i64)b * heads + h;
    for (int c = threadIdx.x; c < 128 * 16; c += blockDim.x) {
        const int t = c / 16, col = 8 * (c % 16);
        uint4 w = make_uint4(0u, 0u, 0u, 0u);
        if (t0 + t < kv_len) w = *reinterpret_cast<const uint4*>(v + (((i64)b * seq + t0 + t) * heads + h) * 128 + col);
        *reinterpret_cast<uint4*>(&tile[t][col]) = w;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < 128 * 8; c += blockDim.x) {
        const int d = c / 8, col0 = 16 * (c % 8);
        const float s = e4m3_scale(__uint_as_float(amax[head * 128 + d]));
        unsigned int w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            float x[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int col = col0 + 4 * k + i, r = col % 32;  // r = 16h + 4t + 2j + e
                const int key = col - r + 16 * (r / 16) + 8 * ((r % 4) / 2) + 2 * ((r % 16) / 4) + r % 2;
                x[i] = __bfloat162float(tile[key][d]);
            }
            w[k] = e4m3x2(x[0] / s, x[1] / s) | ((unsigned int)e4m3x2(x[2] / s, x[3] / s) << 16);
        }
        *reinterpret_cast<uint4*>(vt + (head * 128 + d) * s_pad + t0 + col0) = make_uint4(w[0], w[1], w[2], w[3]);
        if (blockIdx.x == 0 && c % 8 == 0) v_scales[head * 128 + d] = s;
    }
}
