// Convolution as im2col + GEMM (the GEMM is cuBLASLt's, see cuda.rs), and nearest x2 upsampling.
//
// im2col: for one batch item and a range [p0, p0 + np) of flattened output pixels (t, h, w), writes
// col[tap][p] = input value under kernel tap (c, dt, dh, dw) for output pixel p, or 0 in the padding.
// The input is the cached frames (if any) followed by x's frames along T, so a causal conv with a cache
// needs no concatenated copy. Adjacent threads take adjacent pixels: coalesced writes and mostly
// coalesced reads.
//
// conv_bias_scatter: the GEMM's [C_out, np] block (+ bias[c_out]) → out[c_out, p0 + p], a row of
// `p_total` pixels per output channel.

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
