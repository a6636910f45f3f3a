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

// halo_edges: the parallel VAE's edges of a band, both sides in one launch. For each of `slabs`
// (B·C) channel slabs and F = cached + frames frames (the cache's first, then x's), `runs` runs of
// `run` words, run i of frame f starting at word `start[e]` + i·`stride` of that frame (`plane` words),
// into out[e] [slabs, F, runs, run] for edge e = blockIdx.y (0: before, 1: after). Words of W as
// copy_rows picks them. Grid: x grid-stride over an edge's words, y over the two edges.
template <typename W>
__device__ void halo_edges(const W* x, const W* cache, W* out0, W* out1, i64 slabs, i64 cached, i64 frames,
                           i64 plane, i64 runs, i64 run, i64 stride, i64 start0, i64 start1) {
    W* out = blockIdx.y == 0 ? out0 : out1;
    const i64 start = blockIdx.y == 0 ? start0 : start1, joined = cached + frames;
    const i64 n = slabs * joined * runs * run;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 k = i % run, r = i / run % runs, sf = i / (run * runs);
        const i64 f = sf % joined, s = sf / joined, at = start + r * stride + k;
        out[i] = f < cached ? cache[(s * cached + f) * plane + at]
                            : x[(s * frames + f - cached) * plane + at];
    }
}

#define HALO_EDGES(WN, W) \
    extern "C" __global__ void halo_edges_##WN(const W* x, const W* cache, W* out0, W* out1, i64 slabs, \
                                               i64 cached, i64 frames, i64 plane, i64 runs, i64 run,   \
                                               i64 stride, i64 start0, i64 start1) {                   \
        halo_edges(x, cache, out0, out1, slabs, cached, frames, plane, runs, run, stride, start0, start1); \
    }
HALO_EDGES(w16, uint4)
HALO_EDGES(w8, uint2)
HALO_EDGES(w4, unsigned int)
HALO_EDGES(w2, unsigned short)
