// Normalisations. layer_norm / rms_norm: one block per row (grid-stride over rows), block reductions
// in f32, two passes for LayerNorm's variance as in the CPU reference. rms_norm_channels: a block
// stages a tile of positions × every channel in shared memory, so x is read from memory once (see
// below), optionally followed by SiLU in the same pass (rms_norm_channels_silu).

// Sum of v over the block, returned to every thread. Blocks are a multiple of 32 threads, ≤ 1024.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // the previous call's readers are done with `partial`
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    float t = lane < (int)(blockDim.x / 32) ? partial[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}

template <typename T, typename W>
__device__ void layer_norm(const T* x, const W* w, const W* b, T* out, i64 rows, int d, float eps,
                           int has_w, int has_b) {
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * d;
        T* yr = out + row * d;
        float s = 0.0f;
        for (int i = threadIdx.x; i < d; i += blockDim.x) s += ld(xr + i);
        float mean = block_sum(s) / d;
        float q = 0.0f;
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            float t = ld(xr + i) - mean;
            q += t * t;
        }
        float inv_std = 1.0f / sqrtf(block_sum(q) / d + eps);
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            float y = (ld(xr + i) - mean) * inv_std;
            if (has_w) y *= ld(w + i);
            if (has_b) y += ld(b + i);
            st(yr + i, y);
        }
    }
}

// LayerNorm without affine, then * (1 + scale) + shift (f32 rows of d; row r uses modulation row
// r / rows_per_mod), written once in the output type O.
template <typename T, typename O>
__device__ void layer_norm_modulate(const T* x, const float* shift, const float* scale, O* out, i64 rows,
                                    int d, i64 rows_per_mod, float eps) {
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * d;
        O* yr = out + row * d;
        const float* sh = shift + (row / rows_per_mod) * d;
        const float* sc = scale + (row / rows_per_mod) * d;
        float s = 0.0f;
        for (int i = threadIdx.x; i < d; i += blockDim.x) s += ld(xr + i);
        float mean = block_sum(s) / d;
        float q = 0.0f;
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            float t = ld(xr + i) - mean;
            q += t * t;
        }
        float inv_std = 1.0f / sqrtf(block_sum(q) / d + eps);
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            float y = (ld(xr + i) - mean) * inv_std;
            st(yr + i, y * (1.0f + sc[i]) + sh[i]);
        }
    }
}

template <typename T, typename W>
__device__ void rms_norm(const T* x, const W* w, T* out, i64 rows, int d, float eps) {
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * d;
        T* yr = out + row * d;
        float q = 0.0f;
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            float v = ld(xr + i);
            q += v * v;
        }
        float inv_rms = 1.0f / sqrtf(block_sum(q) / d + eps);
        for (int i = threadIdx.x; i < d; i += blockDim.x) st(yr + i, ld(xr + i) * inv_rms * ld(w + i));
    }
}

// x [batch, channels, positions]: y = x / max(||x[b, :, p]||, 1e-12) * sqrt(C) * gamma[c] + bias[c].
// SILU: the VAE's norm-then-SiLU in one pass: y is rounded to T (as the unfused norm stores it), then
// out = silu_f32(y) rounded to T (as the unfused silu stores it), so the result is bit-identical
// to rms_norm_channels followed by silu, with y never written to memory. The product is __fmul_rn: the
// same IEEE multiply as `*`, but never contracted into an FMA with what follows (the bias add or, for
// f32 storage where the rounding to T is a no-op, the SiLU), so each step rounds as the unfused kernels do.
//
// x / norm is computed as x · (1 / norm) (two roundings where the CPU twin's division has one):
// a division per element made the kernel instruction-bound.
//
// A block of RMS_THREADS threads takes tiles of TP = 128 bytes of positions (64 bf16, 32 f32) of one
// batch item: it copies the tile's [channels, TP] elements into shared memory (dynamic, channels × 128
// bytes, then TP floats), one thread per position sums its squares over the channels in order
// (c = 0, 1, …, as the CPU twin does), and the block writes the result back row by row. Both global
// sides move 16-byte words of one channel's V = 16 / sizeof(T) consecutive positions (VEC: positions
// is a multiple of V and the buffers are 16-byte aligned; the host checks) or single elements.
constexpr int RMS_THREADS = 256;

template <bool SILU, bool VEC, typename T, typename W>
__device__ void rms_norm_channels(const T* x, const W* gamma, const W* bias, T* out, i64 batch,
                                  int channels, i64 positions, int has_bias) {
    constexpr int V = 16 / sizeof(T), TP = 8 * V;
    extern __shared__ uint4 rms_smem[];  // [channels][8] words of V positions, then TP 1 / norm
    T* tile = reinterpret_cast<T*>(rms_smem);
    float* norms = reinterpret_cast<float*>(rms_smem + (i64)channels * 8);
    const float sqrt_c = sqrtf((float)channels);
    const i64 tiles = (positions + TP - 1) / TP;
    for (i64 t = blockIdx.x; t < batch * tiles; t += gridDim.x) {
        const i64 b = t / tiles, p0 = (t % tiles) * TP;
        const int np = (int)min((i64)TP, positions - p0);
        const i64 base = b * channels * positions + p0;
        for (int i = threadIdx.x; i < channels * 8; i += RMS_THREADS) {
            const int c = i / 8, j = i % 8;
            if (j * V >= np) continue;
            const T* src = x + base + (i64)c * positions + j * V;
            if (VEC) {
                rms_smem[i] = *reinterpret_cast<const uint4*>(src);
            } else {
                for (int e = 0; e < V && j * V + e < np; ++e) tile[i * V + e] = src[e];
            }
        }
        __syncthreads();
        for (int p = threadIdx.x; p < np; p += RMS_THREADS) {
            float q = 0.0f;
            for (int c = 0; c < channels; ++c) {
                float v = ld(tile + c * TP + p);
                q += v * v;
            }
            norms[p] = 1.0f / fmaxf(sqrtf(q), 1e-12f);  // the reciprocal: one division per position
        }
        __syncthreads();
        for (int i = threadIdx.x; i < channels * 8; i += RMS_THREADS) {
            const int c = i / 8, j = i % 8;
            if (j * V >= np) continue;
            const float g = sqrt_c * ld(gamma + c);
            const float bc = has_bias ? ld(bias + c) : 0.0f;
            uint4 word = rms_smem[i];
            T* vals = reinterpret_cast<T*>(&word);
#pragma unroll
            for (int e = 0; e < V; ++e) {
                float y = __fmul_rn(__fmul_rn(ld(vals + e), norms[min(j * V + e, np - 1)]), g);
                if (has_bias) y += bc;
                if (SILU) {
                    T rounded;
                    st(&rounded, y);
                    float v = ld(&rounded);
                    y = silu_f32(v);  // as elementwise.cu's UNARY_SILU
                }
                st(vals + e, y);
            }
            T* dst = out + base + (i64)c * positions + j * V;
            if (VEC) {
                *reinterpret_cast<uint4*>(dst) = word;
            } else {
                for (int e = 0; e < V && j * V + e < np; ++e) dst[e] = vals[e];
            }
        }
        __syncthreads();  // the tile is reused by the block's next tile
    }
}

// The word (_v) and element (_e) instances of one rms_norm_channels variant.
#define RMS_CHANNELS(NAME, SILU, T, W) \
    extern "C" __global__ void __launch_bounds__(RMS_THREADS) NAME##_v(const T* x, const W* gamma, \
            const W* bias, T* out, i64 batch, int channels, i64 positions, int has_bias) { \
        rms_norm_channels<SILU, true>(x, gamma, bias, out, batch, channels, positions, has_bias); \
    } \
    extern "C" __global__ void __launch_bounds__(RMS_THREADS) NAME##_e(const T* x, const W* gamma, \
            const W* bias, T* out, i64 batch, int channels, i64 positions, int has_bias) { \
        rms_norm_channels<SILU, false>(x, gamma, bias, out, batch, channels, positions, has_bias); \
    }

#define NORMS(TN, T, WN, W) \
    extern "C" __global__ void layer_norm_##TN##_##WN(const T* x, const W* w, const W* b, T* out, i64 rows, \
                                                      int d, float eps, int has_w, int has_b) { \
        layer_norm(x, w, b, out, rows, d, eps, has_w, has_b); \
    } \
    extern "C" __global__ void rms_norm_##TN##_##WN(const T* x, const W* w, T* out, i64 rows, int d, \
                                                    float eps) { \
        rms_norm(x, w, out, rows, d, eps); \
    } \
    RMS_CHANNELS(rms_norm_channels_##TN##_##WN, false, T, W) \
    RMS_CHANNELS(rms_norm_channels_silu_##TN##_##WN, true, T, W)
FOR_TYPES2(NORMS)

#define NORM_MODULATE(TN, T, ON, O) \
    extern "C" __global__ void layer_norm_modulate_##TN##_##ON(const T* x, const float* shift, \
                                                              const float* scale, O* out, i64 rows, \
                                                              int d, i64 rows_per_mod, float eps) { \
        layer_norm_modulate(x, shift, scale, out, rows, d, rows_per_mod, eps); \
    }
FOR_TYPES2(NORM_MODULATE)
