// Helpers of the two CUDA convolution paths (see cuda.rs), and nearest x2 upsampling.
//
// im2col path: im2col + a cuBLASLt GEMM per block of output pixels + conv_bias_scatter.
// cuDNN path: conv_join_frames (only where a time padding is not symmetric or frames are cached) +
// cudnnConvolutionForward + conv_bias_add.
//
// im2col: for one batch item and a range [p0, p0 + np) of flattened output pixels (t, h, w), writes
// col[tap][p] = input value under kernel tap (c, dt, dh, dw) for output pixel p, or 0 in the padding.
// The input is the cached frames (if any) followed by x's frames along T, so a causal conv with a cache
// needs no concatenated copy. Adjacent threads take adjacent pixels: coalesced writes and mostly
// coalesced reads.
//
// conv_bias_scatter: the GEMM's [C_out, np] block (+ bias[c_out]) → out[c_out, p0 + p], a row of
// `p_total` pixels per output channel.
//
// conv_join_frames: out [BC, F, plane] = `zeros_front` zero frames, then cache [BC, cached, plane], then
// x [BC, x_frames, plane], then `zeros_back` zero frames along F, for every (batch, channel) row BC: the
// one copy that turns a causal conv with cached frames into a plain conv cuDNN can run (it reads one
// buffer). Bit copies in words of W (16, 4 or 2 bytes, the widest that divides a frame's bytes; the host
// picks it), so one kernel serves every dtype.
//
// conv_bias_add: out[i] += bias[(i / inner) % channels] in place (inner = T·H·W for [B, C, T, H, W],
// 1 for channels-last). `vec` (chosen on the host) processes 16-byte words of V = 16/sizeof(T) elements
// that share one channel (inner % V == 0) or hold V consecutive channels (inner == 1, channels % V == 0),
// so one index division serves V elements.

// Mirrors `ConvGeom` in cuda.rs (all i64: no padding questions).
struct ConvGeom {
    i64 c_in;
    i64 cached;  // frames of `cache` in front of x's frames
    i64 in_t, in_h, in_w;  // the input's T (cached + x frames), H, W
    i64 out_t, out_h, out_w;
    i64 kt, kh, kw;
    i64 st, sh, sw;
    i64 pt, ph, pw;  // front padding per axis (the back padding only shows in out_*)
};

template <typename T>
__device__ void im2col(const T* x, const T* cache, T* col, i64 p0, i64 np, ConvGeom g) {
    const i64 taps = g.c_in * g.kt * g.kh * g.kw;
    const i64 x_frames = g.in_t - g.cached;
    const i64 plane = g.in_h * g.in_w;
    FOR_EACH(i, taps * np) {
        i64 tap = i / np, p = p0 + i % np;
        i64 dw = tap % g.kw, r = tap / g.kw;
        i64 dh = r % g.kh;
        r /= g.kh;
        i64 dt = r % g.kt, c = r / g.kt;
        i64 ow = p % g.out_w, q = p / g.out_w;
        i64 oh = q % g.out_h, ot = q / g.out_h;
        i64 it = ot * g.st + dt - g.pt, ih = oh * g.sh + dh - g.ph, iw = ow * g.sw + dw - g.pw;
        float v = 0.0f;
        if (it >= 0 && it < g.in_t && ih >= 0 && ih < g.in_h && iw >= 0 && iw < g.in_w) {
            const T* src = it < g.cached ? cache + (c * g.cached + it) * plane
                                         : x + (c * x_frames + (it - g.cached)) * plane;
            v = ld(src + ih * g.in_w + iw);
        }
        st(col + i, v);  // a stored value round-trips exactly through f32
    }
}

template <typename T, typename B>
__device__ void conv_bias_scatter(const T* block, const B* bias, T* out, i64 c_out, i64 np, i64 p0,
                                  i64 p_total, int has_bias) {
    FOR_EACH(i, c_out * np) {
        i64 co = i / np, p = i % np;
        float v = ld(block + i);
        if (has_bias) v += ld(bias + co);
        st(out + co * p_total + p0 + p, v);
    }
}

template <typename W>
__device__ void conv_join_frames(const W* x, const W* cache, W* out, i64 rows, i64 zeros_front,
                                 i64 cached, i64 x_frames, i64 zeros_back, i64 plane) {
    const i64 frames = zeros_front + cached + x_frames + zeros_back;
    FOR_EACH(i, rows * frames * plane) {
        i64 p = i % plane, r = i / plane;
        i64 f = r % frames, row = r / frames;
        i64 fc = f - zeros_front, fx = fc - cached;
        W v = W();  // value-initialised: all-zero bits
        if (fc >= 0 && fc < cached) {
            v = cache[(row * cached + fc) * plane + p];
        } else if (fx >= 0 && fx < x_frames) {
            v = x[(row * x_frames + fx) * plane + p];
        }
        out[i] = v;
    }
}

#define JOIN(WN, W)                                                                                  \
    extern "C" __global__ void conv_join_frames_##WN(const W* x, const W* cache, W* out, i64 rows,  \
                                                     i64 zeros_front, i64 cached, i64 x_frames,     \
                                                     i64 zeros_back, i64 plane) {                   \
        conv_join_frames(x, cache, out, rows, zeros_front, cached, x_frames, zeros_back, plane);     \
    }
JOIN(w16, uint4)
JOIN(w4, unsigned int)
JOIN(w2, unsigned short)

template <typename T, typename B>
__device__ void conv_bias_add(T* out, const B* bias, i64 channels, i64 inner, i64 n, int vec) {
    constexpr int V = 16 / sizeof(T);
    if (vec) {
        FOR_EACH(wi, n / V) {
            i64 c0 = (wi * V / inner) % channels;
            uint4 word = reinterpret_cast<const uint4*>(out)[wi];
            T* vals = reinterpret_cast<T*>(&word);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                i64 c = inner == 1 ? c0 + j : c0;
                st(vals + j, ld(vals + j) + ld(bias + c));
            }
            reinterpret_cast<uint4*>(out)[wi] = word;
        }
    } else {
        FOR_EACH(i, n) { st(out + i, ld(out + i) + ld(bias + (i / inner) % channels)); }
    }
}

#define BIAS_ADD(TN, T, BN, B)                                                                        \
    extern "C" __global__ void conv_bias_add_##TN##_##BN(T* out, const B* bias, i64 channels,       \
                                                         i64 inner, i64 n, int vec) {                \
        conv_bias_add(out, bias, channels, inner, n, vec);                                           \
    }
FOR_TYPES2(BIAS_ADD)

// x [N, H, W] → out [N, 2H, 2W], out[n, i, j] = x[n, i/2, j/2].
template <typename T>
__device__ void upsample_nearest2x(const T* x, T* out, i64 n, i64 h, i64 w) {
    FOR_EACH(i, n * 4 * h * w) {
        i64 j = i % (2 * w), r = i / (2 * w);
        i64 row = r % (2 * h), img = r / (2 * h);
        out[i] = x[(img * h + row / 2) * w + j / 2];
    }
}

#define CONV(TN, T)                                                                                   \
    extern "C" __global__ void im2col_##TN(const T* x, const T* cache, T* col, i64 p0, i64 np,       \
                                           ConvGeom g) {                                              \
        im2col(x, cache, col, p0, np, g);                                                             \
    }                                                                                                 \
    extern "C" __global__ void upsample_nearest2x_##TN(const T* x, T* out, i64 n, i64 h, i64 w) {    \
        upsample_nearest2x(x, out, n, h, w);                                                          \
    }
CONV(f32, float)
CONV(bf16, bf16)

#define SCATTER(TN, T, BN, B)                                                                          \
    extern "C" __global__ void conv_bias_scatter_##TN##_##BN(const T* block, const B* bias, T* out,   \
                                                             i64 c_out, i64 np, i64 p0, i64 p_total, \
                                                             int has_bias) {                         \
        conv_bias_scatter(block, bias, out, c_out, np, p0, p_total, has_bias);                        \
    }
FOR_TYPES2(SCATTER)
