// RoPE on interleaved pairs: one thread per (b, s, h, pair); all heads share the angle table row s.
// y[2k] = x[2k] cos - x[2k+1] sin, y[2k+1] = x[2k] sin + x[2k+1] cos.

template <typename T, typename C>
__device__ void apply_rope(const T* x, const C* cos_t, const C* sin_t, T* out, i64 batch, i64 seq,
                           i64 heads, i64 pairs) {
    FOR_EACH(i, batch * seq * heads * pairs) {
        i64 k = i % pairs;
        i64 s = (i / (pairs * heads)) % seq;
        float c = ld(cos_t + s * pairs + k), sn = ld(sin_t + s * pairs + k);
        float x0 = ld(x + 2 * i), x1 = ld(x + 2 * i + 1);
        st(out + 2 * i, x0 * c - x1 * sn);
        st(out + 2 * i + 1, x0 * sn + x1 * c);
    }
}

#define ROPE(TN, T, CN, C) \
    extern "C" __global__ void apply_rope_##TN##_##CN(const T* x, const C* cos_t, const C* sin_t, T* out, \
                                                      i64 batch, i64 seq, i64 heads, i64 pairs) { \
        apply_rope(x, cos_t, sin_t, out, batch, seq, heads, pairs); \
    }
FOR_TYPES2(ROPE)
