// FP8 (e4m3) per-row quantisation, the twin of cpu.rs's quantize_rows: one block per row (grid-stride
// over rows), the row's largest magnitude by a block reduction, s = amax / 448 (1 for an all-zero
// row), codes = e4m3(x / s) with x / s an IEEE division (NVRTC's default -prec-div) and the e4m3
// rounding to nearest even, saturated to ±448 (cvt.rn.satfinite, sm_89 on): the CPU's arithmetic
// step for step, so codes and scales agree bit for bit.

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

// Two e4m3 codes in one 16-bit word: `lo` in the low byte (the lower address).
__device__ __forceinline__ unsigned short e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float row_scale(float amax) { return amax > 0.0f ? amax / 448.0f : 1.0f; }

// Any k: element by element (the odd last code is written as a byte).
template <typename T>
__device__ void quantize_rows(const T* x, unsigned char* q, float* scales, i64 rows, int k) {
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * k;
        unsigned char* qr = q + row * k;
        float m = 0.0f;
        for (int i = threadIdx.x; i < k; i += blockDim.x) m = fmaxf(m, fabsf(ld(xr + i)));
        const float s = row_scale(block_max(m));
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
        const float s = row_scale(block_max(m));
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
