// Normalisations. layer_norm / rms_norm: one block per row (grid-stride over rows), block reductions
// in f32, two passes for LayerNorm's variance as in the CPU reference; the *_rows kernels (below) do
// the same maths on rows held in registers, for rows of whole 16-byte words. rms_norm_channels: a block
// stages a tile of positions × every channel in shared memory, so x is read from memory once (see
// below), optionally followed by SiLU in the same pass (rms_norm_channels_silu). The *_e4m3 kernels
// (sm_89 on) write a norm's rows quantised for the FP8 linears that read them.

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

// Rows held in registers (the DiT's rows of D = 1,536 … 5,120): a block per row, each thread loads
// up to ROW_WORDS 16-byte words of the row (V = 16 / sizeof(T) elements each, words strided by the
// block, so a warp's loads are contiguous) once, and the reductions and the output come from those
// registers: the row is read from memory once and written once, in 16-byte accesses, where the kernels
// above read it two or three times element by element. The maths and its order per element are
// theirs. Needs d a multiple of V, 16-byte aligned rows (x and out) and d / V ≤ ROW_WORDS · blockDim
// (the host checks, and otherwise runs the kernels above).
constexpr int ROW_WORDS = 4;

template <typename T>
struct Row {
    static constexpr int V = 16 / sizeof(T);
    float v[ROW_WORDS][V];
};

// Word j of this thread: index threadIdx.x + j·blockDim.x of the row's words, if < words.
__device__ __forceinline__ int row_word(int j) { return threadIdx.x + j * blockDim.x; }

template <typename T>
__device__ __forceinline__ void load_row(const T* xr, int words, Row<T>& r) {
#pragma unroll
    for (int j = 0; j < ROW_WORDS; ++j) {
        const int w = row_word(j);
        uint4 word = make_uint4(0, 0, 0, 0);
        if (w < words) word = reinterpret_cast<const uint4*>(xr)[w];
        const T* e = reinterpret_cast<const T*>(&word);
#pragma unroll
        for (int k = 0; k < Row<T>::V; ++k) r.v[j][k] = ld(e + k);
    }
}

// Sum over the row of v (one pass over the registers), to every thread of the block.
template <typename T>
__device__ __forceinline__ float row_sum(const Row<T>& r, int words, float centre, bool square) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < ROW_WORDS; ++j) {
        if (row_word(j) >= words) continue;
#pragma unroll
        for (int k = 0; k < Row<T>::V; ++k) {
            const float t = r.v[j][k] - centre;
            s += square ? t * t : t;
        }
    }
    return block_sum(s);
}

// LayerNorm statistics of a held row: (mean, 1 / sqrt(var + eps)), two passes as layer_norm above.
template <typename T>
__device__ __forceinline__ float2 row_mean_inv_std(const Row<T>& r, int words, int d, float eps) {
    const float mean = row_sum(r, words, 0.0f, false) / d;
    const float var = row_sum(r, words, mean, true) / d;
    return make_float2(mean, 1.0f / sqrtf(var + eps));
}

// The walk every rows kernel shares: each row of this block is held (load_row), `prepare(row, r,
// words)` computes the row's statistics and returns the per-word map, and each word the thread holds
// is written as `map(i, v, y)`: the word's V values v, starting at element i of the row → V outputs y.
template <typename T, typename O, typename Prepare>
__device__ __forceinline__ void map_rows(const T* x, O* out, i64 rows, int d, Prepare prepare) {
    constexpr int V = Row<T>::V;
    const int words = d / V;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        Row<T> r;
        load_row(x + row * d, words, r);
        const auto map = prepare(row, r, words);
#pragma unroll
        for (int j = 0; j < ROW_WORDS; ++j) {
            const int wd = row_word(j);
            if (wd >= words) continue;
            float y[V];
            map(wd * V, r.v[j], y);
            store_word<O, V>(out + row * d + wd * V, y);
        }
    }
}

// The per-row maps of the LayerNorms below, shared by their bf16/f32 stores (map_rows) and their
// e4m3 ones (map_rows_e4m3), so that both do the same maths in the same order.
// LayerNorm with optional affine (parameters of type W).
template <typename T, typename W>
__device__ __forceinline__ auto layer_norm_map(const W* w, const W* b, int d, float eps, int has_w, int has_b) {
    return [=](i64, const Row<T>& r, int words) {
        const float2 s = row_mean_inv_std(r, words, d, eps);
        return [=](int i, const float* v, float* y) {
            constexpr int V = Row<T>::V;
            float wv[V], bv[V];
            if (has_w) load_vec<W, V>(w + i, wv);
            if (has_b) load_vec<W, V>(b + i, bv);
#pragma unroll
            for (int k = 0; k < V; ++k) {
                y[k] = (v[k] - s.x) * s.y;
                if (has_w) y[k] *= wv[k];
                if (has_b) y[k] += bv[k];
            }
        };
    };
}

// LayerNorm without affine, then · (1 + scale) + shift with row r's modulation row r / rows_per_mod.
template <typename T>
__device__ __forceinline__ auto layer_norm_modulate_map(const float* shift, const float* scale, int d,
                                                        i64 rows_per_mod, float eps) {
    return [=](i64 row, const Row<T>& r, int words) {
        const float2 s = row_mean_inv_std(r, words, d, eps);
        const float* sh = shift + (row / rows_per_mod) * d;
        const float* sc = scale + (row / rows_per_mod) * d;
        return [=](int i, const float* v, float* y) {
            constexpr int V = Row<T>::V;
            float shv[V], scv[V];
            load_vec<float, V>(sh + i, shv);
            load_vec<float, V>(sc + i, scv);
#pragma unroll
            for (int k = 0; k < V; ++k) y[k] = (v[k] - s.x) * s.y * (1.0f + scv[k]) + shv[k];
        };
    };
}

template <typename T, typename W>
__device__ void layer_norm_rows(const T* x, const W* w, const W* b, T* out, i64 rows, int d, float eps,
                                int has_w, int has_b) {
    map_rows(x, out, rows, d, layer_norm_map<T, W>(w, b, d, eps, has_w, has_b));
}

template <typename T, typename O>
__device__ void layer_norm_modulate_rows(const T* x, const float* shift, const float* scale, O* out,
                                         i64 rows, int d, i64 rows_per_mod, float eps) {
    map_rows(x, out, rows, d, layer_norm_modulate_map<T>(shift, scale, d, rows_per_mod, eps));
}

template <typename T, typename W>
__device__ void rms_norm_rows(const T* x, const W* w, T* out, i64 rows, int d, float eps) {
    map_rows(x, out, rows, d, [=](i64, const Row<T>& r, int words) {
        const float inv_rms = 1.0f / sqrtf(row_sum(r, words, 0.0f, true) / d + eps);
        return [=](int i, const float* v, float* y) {
            constexpr int V = Row<T>::V;
            float wv[V];
            load_vec<W, V>(w + i, wv);
#pragma unroll
            for (int k = 0; k < V; ++k) y[k] = v[k] * inv_rms * wv[k];
        };
    });
}

// The DiT's q/k preparation: rms_norm_rows over the row of d = heads · head_dim, its result rounded to
// T (as rms_norm stores it), then RoPE on interleaved pairs as rope.cu's apply_rope, with row r at
// sequence position r % seq of the f32 cos/sin tables [seq, head_dim / 2]. A word never splits a
// pair (V is even); head_dim must be even.
template <typename T, typename W>
__device__ void rms_norm_rope_rows(const T* x, const W* w, const float* cos_t, const float* sin_t, T* out,
                                   i64 rows, i64 seq, int d, int head_dim, float eps) {
    const int pairs = head_dim / 2;
    map_rows(x, out, rows, d, [=](i64 row, const Row<T>& r, int words) {
        const float inv_rms = 1.0f / sqrtf(row_sum(r, words, 0.0f, true) / d + eps);
        const float* cs = cos_t + (row % seq) * pairs;
        const float* sn = sin_t + (row % seq) * pairs;
        return [=](int i, const float* v, float* y) {
            constexpr int V = Row<T>::V;
            float wv[V];
            load_vec<W, V>(w + i, wv);
#pragma unroll
            for (int k = 0; k < V; ++k) {
                T rounded;
                st(&rounded, v[k] * inv_rms * wv[k]);
                y[k] = ld(&rounded);
            }
            // The word's V / 2 pairs: consecutive table entries when a word stays within one head
            // (head_dim a multiple of V, the DiT's case), loaded as one piece; else entry by entry.
            float cv[V / 2], sv[V / 2];
            if (head_dim % V == 0) {
                load_vec<float, V / 2>(cs + (i % head_dim) / 2, cv);
                load_vec<float, V / 2>(sn + (i % head_dim) / 2, sv);
            } else {
#pragma unroll
                for (int k = 0; k < V; k += 2) {
                    const int p = ((i + k) % head_dim) / 2;
                    cv[k / 2] = cs[p];
                    sv[k / 2] = sn[p];
                }
            }
#pragma unroll
            for (int k = 0; k < V; k += 2) {
                const float c = cv[k / 2], s = sv[k / 2], x0 = y[k], x1 = y[k + 1];
                y[k] = x0 * c - x1 * s;
                y[k + 1] = x0 * s + x1 * c;
            }
        };
    });
}

#if __CUDA_ARCH__ >= 890
// The norms whose every consumer is an FP8 linear (the DiT's, under `model.dtype: fp8`): map_rows'
// walk, each output rounded to bf16 (what the unfused norm stores) and held in the row's registers,
// then quantised per row as quant.cu's quantize_rows_v8 quantises the stored row: s = e4m3_scale of
// the row's largest magnitude, codes e4m3(y · (1/s)), one 8-byte store per word. Codes and scales are
// the unfused pair's bit for bit, without the bf16 row's write and read back. bf16 rows only (V = 8).
template <typename Prepare>
__device__ __forceinline__ void map_rows_e4m3(const bf16* x, unsigned char* q, float* scales, i64 rows,
                                              int d, Prepare prepare) {
    constexpr int V = Row<bf16>::V;
    const int words = d / V;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        Row<bf16> r;
        load_row(x + row * d, words, r);
        const auto map = prepare(row, r, words);
        float m = 0.0f;
#pragma unroll
        for (int j = 0; j < ROW_WORDS; ++j) {
            const int wd = row_word(j);
            if (wd >= words) continue;
            float y[V];
            map(wd * V, r.v[j], y);
#pragma unroll
            for (int k = 0; k < V; ++k) {
                r.v[j][k] = __bfloat162float(__float2bfloat16_rn(y[k]));
                m = fmaxf(m, fabsf(r.v[j][k]));
            }
        }
        const float s = e4m3_scale(block_max(m)), rs = e4m3_rcp(s);
#pragma unroll
        for (int j = 0; j < ROW_WORDS; ++j) {
            const int wd = row_word(j);
            if (wd >= words) continue;
            const float* v = r.v[j];
            unsigned c[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) c[k] = e4m3x2(v[2 * k] * rs, v[2 * k + 1] * rs);
            reinterpret_cast<uint2*>(q + row * d)[wd] = make_uint2(c[0] | (c[1] << 16), c[2] | (c[3] << 16));
        }
        if (threadIdx.x == 0) scales[row] = s;
    }
}

// layer_norm_rows and layer_norm_modulate_rows, quantised.
template <typename W>
__device__ void layer_norm_rows_e4m3(const bf16* x, const W* w, const W* b, unsigned char* q, float* scales,
                                     i64 rows, int d, float eps, int has_w, int has_b) {
    map_rows_e4m3(x, q, scales, rows, d, layer_norm_map<bf16, W>(w, b, d, eps, has_w, has_b));
}

__device__ void layer_norm_modulate_rows_e4m3(const bf16* x, const float* shift, const float* scale,
                                              unsigned char* q, float* scales, i64 rows, int d,
                                              i64 rows_per_mod, float eps) {
    map_rows_e4m3(x, q, scales, rows, d, layer_norm_modulate_map<bf16>(shift, scale, d, rows_per_mod, eps));
}

#define NORMS_E4M3(WN, W) \
    extern "C" __global__ void layer_norm_rows_e4m3_bf16_##WN(const bf16* x, const W* w, const W* b, unsigned char* q, \
                                                         float* scales, i64 rows, int d, float eps, int has_w, \
                                                         int has_b) { \
        layer_norm_rows_e4m3(x, w, b, q, scales, rows, d, eps, has_w, has_b); \
    }
NORMS_E4M3(f32, float)
NORMS_E4M3(bf16, bf16)

extern "C" __global__ void layer_norm_modulate_rows_e4m3_bf16(const bf16* x, const float* shift,
                                                              const float* scale, unsigned char* q,
                                                              float* scales, i64 rows, int d, i64 rows_per_mod,
                                                              float eps) {
    layer_norm_modulate_rows_e4m3(x, shift, scale, q, scales, rows, d, rows_per_mod, eps);
}

// The walk with no map: quant.cu's quantize_rows_v8 on bf16 rows (the same codes and scales: a bf16
// value rounds to itself), reading each row once instead of twice. `Fp8Tensor::quantize` runs it
// wherever the rows fit the registers (the inputs of the FP8 output projections and FFN-down).
extern "C" __global__ void quantize_rows_e4m3_rows_bf16(const bf16* x, unsigned char* q, float* scales,
                                                        i64 rows, int d) {
    map_rows_e4m3(x, q, scales, rows, d, [](i64, const Row<bf16>&, int) {
        return [](int, const float* v, float* y) {
#pragma unroll
            for (int k = 0; k < Row<bf16>::V; ++k) y[k] = v[k];
        };
    });
}
#endif

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
    extern "C" __global__ void layer_norm_rows_##TN##_##WN(const T* x, const W* w, const W* b, T* out, \
                                                           i64 rows, int d, float eps, int has_w, int has_b) { \
        layer_norm_rows(x, w, b, out, rows, d, eps, has_w, has_b); \
    } \
    extern "C" __global__ void rms_norm_rows_##TN##_##WN(const T* x, const W* w, T* out, i64 rows, int d, \
                                                         float eps) { \
        rms_norm_rows(x, w, out, rows, d, eps); \
    } \
    extern "C" __global__ void rms_norm_rope_rows_##TN##_##WN(const T* x, const W* w, const float* cos_t, \
            const float* sin_t, T* out, i64 rows, i64 seq, int d, int head_dim, float eps) { \
        rms_norm_rope_rows(x, w, cos_t, sin_t, out, rows, seq, d, head_dim, eps); \
    } \
    RMS_CHANNELS(rms_norm_channels_##TN##_##WN, false, T, W) \
    RMS_CHANNELS(rms_norm_channels_silu_##TN##_##WN, true, T, W)
FOR_TYPES2(NORMS)

#define NORM_MODULATE(TN, T, ON, O) \
    extern "C" __global__ void layer_norm_modulate_##TN##_##ON(const T* x, const float* shift, \
                                                              const float* scale, O* out, i64 rows, \
                                                              int d, i64 rows_per_mod, float eps) { \
        layer_norm_modulate(x, shift, scale, out, rows, d, rows_per_mod, eps); \
    } \
    extern "C" __global__ void layer_norm_modulate_rows_##TN##_##ON(const T* x, const float* shift, \
                                                                   const float* scale, O* out, i64 rows, \
                                                                   int d, i64 rows_per_mod, float eps) { \
        layer_norm_modulate_rows(x, shift, scale, out, rows, d, rows_per_mod, eps); \
    }
FOR_TYPES2(NORM_MODULATE)
