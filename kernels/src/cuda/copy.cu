// Strided copy with dtype conversion: dst[offset1(i)] = src[offset0(i)] over the index space of `l`.
// Backs permute, narrow, concat and casts on the GPU.

template <typename S, typename D>
__device__ void copy_strided(const S* src, D* dst, i64 n, const Layout& l) {
    FOR_EACH(i, n) {
        i64 s, d, unused;
        offsets(l, i, &s, &d, &unused);
        st(dst + d, ld(src + s));
    }
}

#define COPY(SN, S, DN, D) \
    extern "C" __global__ void copy_##SN##_##DN(const S* src, D* dst, i64 n, Layout l) { \
        copy_strided(src, dst, n, l); \
    }
FOR_TYPES2(COPY)
