// Strided copy with dtype conversion: dst[offset1(i)] = src[offset0(i)] over the index space of `l`.
// Backs permute, narrow, concat and casts on the GPU.
//
// copy_rows: the same copy where it is runs of `width` contiguous words (no cast), one per index r of
// `outer` (the other axes; its strides 0 and 1 are src's and dst's, in words): dst's run r ← src's.
// Words of W (16, 8, 4 or 2 bytes: the host picks the widest that every pointer, stride and width is a
// multiple of) and index maths once per run, not per element: narrow, concat and the frame permutes
// of the VAE run at copy bandwidth. Grid: x over words of a run, y over runs, both grid-stride.

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

template <typename W>
__device__ void copy_rows(const W* src, W* dst, i64 rows, i64 width, const Layout& outer) {
    for (i64 r = blockIdx.y; r < rows; r += gridDim.y) {
        i64 so, d, unused;
        offsets(outer, r, &so, &d, &unused);
        const W* s = src + so;
        W* t = dst + d;
        const i64 step = (i64)gridDim.x * blockDim.x;
        for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < width; k += step) t[k] = s[k];
    }
}

#define COPY_ROWS(WN, W) \
    extern "C" __global__ void copy_rows_##WN(const W* src, W* dst, i64 rows, i64 width, Layout outer) { \
        copy_rows(src, dst, rows, width, outer); \
    }
COPY_ROWS(w16, uint4)
COPY_ROWS(w8, uint2)
COPY_ROWS(w4, unsigned int)
COPY_ROWS(w2, unsigned short)
