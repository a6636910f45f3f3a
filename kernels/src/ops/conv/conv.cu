// Helpers of the three CUDA convolution paths (see cuda.rs), and nearest x2 upsampling.
//
// im2col path: im2col + a cuBLASLt GEMM per block of output pixels + conv_bias_scatter.
// cuDNN NCDHW path: conv_join_frames (only where a time padding is not symmetric or frames are cached) +
// cudnnConvolutionForward + conv_bias_add.
// cuDNN NDHWC path: conv_to_ndhwc (the frame join and the transpose in one pass) +
// cudnnConvolutionForward on channels-last data + conv_from_ndhwc (the transpose back and the bias in
// one pass).
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
//
// conv_to_ndhwc / conv_from_ndhwc: tiled transposes (below); conv_to_ndhwc_up2 also upsamples ×2
// (nearest) on the fly, for the VAE's upsamplers.

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

// ---- The channels-last path's two transposes ----
//
// Both are batched transposes through shared memory: a block of TR_THREADS threads moves tiles of
// TE × TE elements of one slab, TE = 128 bytes of elements (64 bf16, 32 f32), reading 16-byte chunks
// of rows along the source's contiguous axis and writing 16-byte chunks of rows along the
// destination's, so both global sides are coalesced. Global accesses move words of PACK elements:
// PACK = V (a whole 16-byte chunk) where both contiguous extents are multiples of V, 2 where both are
// even, else 1 (the host picks; every word is then aligned: buffers start 256-byte aligned and every
// row starts at a multiple of PACK elements). A warp moves 4 rows of 8 chunks (4 × 128 bytes) at a
// time on both sides. Shared memory holds a tile as TE rows of 8 chunks, chunk j of row r at
// j ^ (r / V % 8) (an XOR swizzle), so the chunk stores of the load phase (8 chunks of one row) and the
// element gathers of the store phase (one element from each of 8 rows r = q·V + e, q = 0..7, for 4
// columns) are both free of bank conflicts. Tiles are raw bits (an unsigned type of the element's
// size): the join is a bit copy, and the way back converts to f32 only to add the bias.

constexpr int TR_THREADS = 256;

template <int BYTES> struct Bits;
template <> struct Bits<2> { typedef unsigned short T; };
template <> struct Bits<4> { typedef unsigned int T; };
template <> struct Bits<8> { typedef unsigned long long T; };
template <> struct Bits<16> { typedef uint4 T; };

// A word of N elements of bits U, viewed either way.
template <typename U, int N> union Word {
    typename Bits<sizeof(U) * N>::T word;
    U elem[N];
};

// Elements per 16-byte chunk, and the chunk.
template <typename U> __host__ __device__ constexpr int chunk_elems() { return 16 / (int)sizeof(U); }
template <typename U> using Chunk = Word<U, chunk_elems<U>()>;

// Source row r, columns k..k+PACK of a row-major [rows, cols] source whose row is `row` (nullptr: a
// row of zeros): one word where all PACK columns are in range, else element by element, zeros past
// `cols`.
template <typename U, int PACK>
__device__ __forceinline__ Word<U, PACK> load_row(const U* row, i64 k, i64 cols) {
    Word<U, PACK> w;
    if (row != nullptr && k + PACK <= cols) {
        w.word = *reinterpret_cast<const decltype(w.word)*>(row + k);
    } else {
#pragma unroll
        for (int j = 0; j < PACK; ++j) w.elem[j] = (row != nullptr && k + j < cols) ? row[k + j] : U(0);
    }
    return w;
}

// Columns k..k+V of a row as one chunk (load_row's rules), read in words of PACK.
template <typename U, int PACK>
__device__ __forceinline__ Chunk<U> load_chunk(const U* row, i64 k, i64 cols) {
    Chunk<U> c;
#pragma unroll
    for (int m = 0; m < chunk_elems<U>(); m += PACK) {
        const Word<U, PACK> w = load_row<U, PACK>(row, k + m, cols);
#pragma unroll
        for (int j = 0; j < PACK; ++j) c.elem[m + j] = w.elem[j];
    }
    return c;
}

// The chunk's V elements to at[0..V), in words of PACK.
template <typename U, int PACK>
__device__ __forceinline__ void store_chunk(U* at, const Chunk<U>& c) {
#pragma unroll
    for (int m = 0; m < chunk_elems<U>(); m += PACK) {
        Word<U, PACK> w;
#pragma unroll
        for (int j = 0; j < PACK; ++j) w.elem[j] = c.elem[m + j];
        *reinterpret_cast<decltype(w.word)*>(at + m) = w.word;
    }
}

// upsample_nearest2x_words: upsample_nearest2x where a source row is whole 8-byte words (w · size
// a multiple of 8): a thread reads one word (K = 8 / size source elements) and writes each element
// twice as one 16-byte chunk of the output row, so both sides move full words (the element kernel
// above stores 2 or 4 bytes per thread with 64-bit index maths per element).
template <typename U>
__device__ void upsample_nearest2x_words(const U* x, U* out, i64 n, i64 h, i64 w) {
    constexpr int K = 8 / (int)sizeof(U);
    const i64 row_words = w / K;  // source words per row = output chunks per row
    FOR_EACH(i, n * 2 * h * row_words) {
        const i64 c = i % row_words, r = i / row_words;  // output row r of the n · 2h
        const i64 src_row = r / (2 * h) * h + r % (2 * h) / 2;
        Word<U, K> s;
        s.word = *reinterpret_cast<const typename Bits<8>::T*>(x + src_row * w + c * K);
        Chunk<U> d;
#pragma unroll
        for (int j = 0; j < K; ++j) d.elem[2 * j] = d.elem[2 * j + 1] = s.elem[j];
        *reinterpret_cast<uint4*>(out + r * 2 * w + c * 2 * K) = d.word;
    }
}

extern "C" __global__ void upsample_nearest2x_words_e2(const unsigned short* x, unsigned short* out, i64 n,
                                                       i64 h, i64 w) {
    upsample_nearest2x_words(x, out, n, h, w);
}
extern "C" __global__ void upsample_nearest2x_words_e4(const unsigned int* x, unsigned int* out, i64 n,
                                                       i64 h, i64 w) {
    upsample_nearest2x_words(x, out, n, h, w);
}

// One tile of a batched transpose. The source is [rows, cols], read by load(r, k) → the chunk of
// elements (r, k..k+V) (zeros out of range); the destination is [cols, rows] with rows contiguous,
// written by put(k, r, chunk) for destination row k, elements r..r+V (all in range: checked here), or
// put_tail(k, r, elem) element by element at the ragged end. Tile origin: source row r0, column k0.
// Every thread of the block must call it (it synchronises). The grids put the channel tiles first,
// so the tiles of one pixel range (which write, or read, the same lines of the channels-last side)
// run together. A block takes one tile per slab where the grid allows: that measured faster than
// blocks that walk many tiles, even with the next tile's loads in flight during the stores
// (2026-11-30, H200: 0.43 against 0.49 ms at the VAE's full-size 96-channel join).
template <typename U, typename Load, typename Put, typename PutTail>
__device__ void transpose_tile(uint4 (*tile)[8], i64 rows, i64 cols, i64 r0, i64 k0, Load load, Put put,
                               PutTail put_tail) {
    constexpr int V = chunk_elems<U>(), TE = 8 * V;
    for (int i = threadIdx.x; i < TE * 8; i += TR_THREADS) {
        const int r = i / 8, j = i % 8;
        tile[r][j ^ (r / V % 8)] = load(r0 + r, k0 + (i64)j * V).word;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < TE * 8; i += TR_THREADS) {
        const int k = i / 8, rc = i % 8;  // destination row k, its chunk rc
        const i64 kk = k0 + k, r = r0 + (i64)rc * V;
        if (kk >= cols || r >= rows) continue;
        Chunk<U> c;
#pragma unroll
        for (int e = 0; e < V; ++e) {
            c.elem[e] = reinterpret_cast<const U*>(&tile[rc * V + e][(k / V) ^ rc])[k % V];
        }
        if (r + V <= rows) {
            put(kk, r, c);
        } else {
            for (int e = 0; r + e < rows; ++e) put_tail(kk, r + e, c.elem[e]);
        }
    }
    __syncthreads();  // the tile is reused by the block's next slab
}

// A tile of elements U in shared memory: TE rows of 8 chunks.
#define TR_TILE(U) __shared__ uint4 tile[8 * chunk_elems<U>()][8]

// conv_to_ndhwc: out [B, F, plane, C] (F = zeros_front + cached + x_frames + zeros_back) ← the frame
// join of conv_join_frames (zero frames, cache [B, C, cached, plane], x [B, C, x_frames, plane], zero
// frames), transposed to channels last. Per slab s = (b, f): source [C, plane] (a channel's frame is
// contiguous), destination [plane, C]. Grid: x over channel tiles, y over plane tiles, z over slabs
// (y and z grid-stride).
//
// UP (conv_to_ndhwc_up2): x and cache hold frames of [plane / 4] = [H, W] pixels with src_w = W, and the
// join is of their nearest ×2 upsampling ([2H, 2W] = plane): destination pixel (i, j) reads source pixel
// (i/2, j/2), the same bits the upsampled tensor would hold, so the convolution's input is unchanged
// while the upsampled tensor is never written (nor read back). The upsampling reads element by element
// (a chunk's V pixels come from V / 2 source pixels, each read twice; PACK then only sets the stores).
template <typename U, int PACK, bool UP>
__device__ void conv_to_ndhwc(const U* x, const U* cache, U* out, i64 batch, i64 channels,
                              i64 zeros_front, i64 cached, i64 x_frames, i64 zeros_back, i64 plane,
                              i64 src_w) {
    constexpr int V = chunk_elems<U>(), TE = 8 * V;
    TR_TILE(U);
    const i64 frames = zeros_front + cached + x_frames + zeros_back;
    const i64 src_plane = UP ? plane / 4 : plane;
    const i64 r0 = (i64)blockIdx.x * TE;  // channel tile
    for (i64 s = blockIdx.z; s < batch * frames; s += gridDim.z) {
        const i64 b = s / frames, fc = s % frames - zeros_front, fx = fc - cached;
        auto src_frame = [&](i64 c) -> const U* {
            if (c >= channels) return nullptr;
            if (fc >= 0 && fc < cached) return cache + ((b * channels + c) * cached + fc) * src_plane;
            if (fx >= 0 && fx < x_frames) return x + ((b * channels + c) * x_frames + fx) * src_plane;
            return nullptr;
        };
        auto load = [&](i64 c, i64 k) -> Chunk<U> {
            const U* frame = src_frame(c);
            if constexpr (!UP) {
                return load_chunk<U, PACK>(frame, k, plane);
            } else {
                Chunk<U> w;
                i64 row = k / (2 * src_w), col = k % (2 * src_w);  // of pixel k, then stepped
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    const bool in = frame != nullptr && k + j < plane;
                    w.elem[j] = in ? frame[(row / 2) * src_w + col / 2] : U(0);
                    if (++col == 2 * src_w) col = 0, ++row;
                }
                return w;
            }
        };
        U* slab = out + s * plane * channels;
        auto put = [&](i64 p, i64 c, const Chunk<U>& w) { store_chunk<U, PACK>(slab + p * channels + c, w); };
        auto put_tail = [&](i64 p, i64 c, U v) { slab[p * channels + c] = v; };
        for (i64 k0 = (i64)blockIdx.y * TE; k0 < plane; k0 += (i64)gridDim.y * TE) {
            transpose_tile<U>(tile, channels, plane, r0, k0, load, put, put_tail);
        }
    }
}

// conv_to_ndhwc_halo: conv_to_ndhwc (no upsampling) where the join also puts a neighbour's halo
// around each frame along one spatial axis (the parallel VAE's band of a frame): out [B, F, plane, C]
// with plane = height × width the haloed frame, whose first `halo` rows (axis 3) or columns (axis 4)
// come from `before` and last `halo` from `after`, each [B, C, cached + x_frames, eh, ew] (the cache's
// frames first, then x's; [eh, ew] = [halo, width] or [height, halo]), and the rest from the cache
// and x frames of [height, width] less the halos; a null edge (the image's border) reads as zeros.
// Zero frames stay zero, halo included. The bits equal those of concatenating before, the band and
// after along the axis first, without that copy. A height split whose width is a multiple of a chunk
// loads whole chunks of one row in words (as the plain join does); other splits load element by
// element.
//
// UP (conv_to_ndhwc_halo_up2): the same join of the nearest ×2 upsampling, read in place. The band
// frames are [(height − 2·halo) / 2, width / 2] (rows) or [height / 2, (width − 2·halo) / 2]
// (columns), and the edges hold ⌈halo / 2⌉ rows (columns) of that resolution: the haloed frame's
// first `halo` rows are the last `halo` of before's upsampling, its last `halo` the first of
// after's. A height split whose width is a multiple of a chunk reads 8-byte words of a source row and
// writes each element twice (as upsample_nearest2x_words); other splits go element by element.
template <typename U, int PACK, bool UP>
__device__ void conv_to_ndhwc_halo(const U* x, const U* cache, const U* before, const U* after, U* out,
                                   i64 batch, i64 channels, i64 zeros_front, i64 cached, i64 x_frames,
                                   i64 zeros_back, int height, int width, int halo, int axis) {
    constexpr int V = chunk_elems<U>(), TE = 8 * V;
    constexpr int S = UP ? 1 : 0;  // source coordinate = haloed (upsampled) coordinate >> S
    TR_TILE(U);
    const i64 frames = zeros_front + cached + x_frames + zeros_back, joined = cached + x_frames;
    const i64 plane = (i64)height * width;
    const bool rows = axis == 3;
    const int band = (rows ? height : width) - 2 * halo;  // extent of the band along the axis
    const int edge_rows = UP ? (halo + 1) / 2 : halo;     // an edge's extent along the axis (source)
    // The sources' frames: [band rows, band_w] and [edge rows, edge_w] (rows split) or their transposes.
    const int band_w = rows ? width >> S : band >> S;
    const i64 band_plane = rows ? (i64)(band >> S) * (width >> S) : (i64)(height >> S) * (band >> S);
    const i64 edge_plane = rows ? (i64)edge_rows * (width >> S) : (i64)(height >> S) * edge_rows;
    const int edge_w = rows ? width >> S : edge_rows;
    const i64 r0 = (i64)blockIdx.x * TE;  // channel tile
    for (i64 s = blockIdx.z; s < batch * frames; s += gridDim.z) {
        const i64 b = s / frames, fc = s % frames - zeros_front, fx = fc - cached;
        const bool data = fc >= 0 && fc < joined;
        // Row r of channel c's haloed frame (a height split): its source row (an edge's or the
        // band's, of width >> S), nullptr for zeros.
        auto source_row = [&](i64 c, int r) -> const U* {
            if (!data || c >= channels) return nullptr;
            const i64 src_w = width >> S;
            const i64 edge_at = ((b * channels + c) * joined + fc) * edge_plane;
            if (r < halo) {
                const int e = (UP ? 2 * edge_rows - halo + r : r) >> S;
                return before == nullptr ? nullptr : before + edge_at + e * src_w;
            }
            if (r >= halo + band) {
                const int e = (r - halo - band) >> S;
                return after == nullptr ? nullptr : after + edge_at + e * src_w;
            }
            const i64 at = (i64)((r - halo) >> S) * src_w;
            return fx < 0 ? cache + ((b * channels + c) * cached + fc) * band_plane + at
                          : x + ((b * channels + c) * x_frames + fx) * band_plane + at;
        };
        auto load = [&](i64 c, i64 k) -> Chunk<U> {
            if (rows && width % V == 0) {
                // A height split whose rows hold whole chunks: the chunk is one run of one source row,
                // read in words (its offset, a multiple of the width, keeps them aligned).
                const U* row = k < plane ? source_row(c, (int)(k / width)) : nullptr;
                if constexpr (!UP) {
                    return load_chunk<U, PACK>(row, k % width, width);
                } else {
                    // V / 2 source pixels, 8 bytes, each written twice (upsample_nearest2x_words).
                    Chunk<U> w;
                    Word<U, V / 2> h;
                    typedef typename Bits<8>::T Half;
                    h.word = row == nullptr ? 0 : *reinterpret_cast<const Half*>(row + k % width / 2);
#pragma unroll
                    for (int j = 0; j < V / 2; ++j) w.elem[2 * j] = w.elem[2 * j + 1] = h.elem[j];
                    return w;
                }
            }
            Chunk<U> w;
            int r = (int)(k / width), col = (int)(k % width);  // of pixel k, then stepped (plane < 2³¹)
#pragma unroll
            for (int j = 0; j < V; ++j, col = col + 1 == width ? (++r, 0) : col + 1) {
                const i64 kk = k + j;
                U v = U(0);
                if (data && c < channels && kk < plane) {
                    const int a = rows ? r : col;      // coordinate along the split axis
                    const int o = (rows ? col : r) >> S;  // source coordinate along the other axis
                    if (a < halo || a >= halo + band) {
                        const bool first = a < halo;
                        const U* edge = first ? before : after;
                        // Upsampled: before's upsampling ends at the band, after's starts there.
                        const int e = first ? (UP ? 2 * edge_rows - halo + a : a) : a - halo - band;
                        const int er = rows ? e >> S : o, ec = rows ? o : e >> S;
                        if (edge != nullptr) {
                            v = edge[((b * channels + c) * joined + fc) * edge_plane + (i64)er * edge_w + ec];
                        }
                    } else {
                        const int ab = (a - halo) >> S;  // band source coordinate along the axis
                        const int br = rows ? ab : o, bc = rows ? o : ab;
                        const i64 at = (i64)br * band_w + bc;
                        v = fx < 0 ? cache[((b * channels + c) * cached + fc) * band_plane + at]
                                   : x[((b * channels + c) * x_frames + fx) * band_plane + at];
                    }
                }
                w.elem[j] = v;
            }
            return w;
        };
        U* slab = out + s * plane * channels;
        auto put = [&](i64 p, i64 c, const Chunk<U>& w) { store_chunk<U, PACK>(slab + p * channels + c, w); };
        auto put_tail = [&](i64 p, i64 c, U v) { slab[p * channels + c] = v; };
        for (i64 k0 = (i64)blockIdx.y * TE; k0 < plane; k0 += (i64)gridDim.y * TE) {
            transpose_tile<U>(tile, channels, plane, r0, k0, load, put, put_tail);
        }
    }
}

#define TO_NDHWC(NAME, U, PACK)                                                                       \
    extern "C" __global__ void __launch_bounds__(TR_THREADS) conv_to_ndhwc_##NAME(           \
        const U* x, const U* cache, U* out, i64 batch, i64 channels, i64 zeros_front, i64 cached,    \
        i64 x_frames, i64 zeros_back, i64 plane, i64 src_w) {                                         \
        conv_to_ndhwc<U, PACK, false>(x, cache, out, batch, channels, zeros_front, cached, x_frames,  \
                                      zeros_back, plane, src_w);                                      \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(TR_THREADS) conv_to_ndhwc_up2_##NAME(       \
        const U* x, const U* cache, U* out, i64 batch, i64 channels, i64 zeros_front, i64 cached,    \
        i64 x_frames, i64 zeros_back, i64 plane, i64 src_w) {                                         \
        conv_to_ndhwc<U, PACK, true>(x, cache, out, batch, channels, zeros_front, cached, x_frames,   \
                                     zeros_back, plane, src_w);                                       \
    }
#define TO_NDHWC_HALO(NAME, U, PACK)                                                                  \
    extern "C" __global__ void __launch_bounds__(TR_THREADS) conv_to_ndhwc_halo_##NAME(      \
        const U* x, const U* cache, const U* before, const U* after, U* out, i64 batch, i64 channels, \
        i64 zeros_front, i64 cached, i64 x_frames, i64 zeros_back, int height, int width, int halo,   \
        int axis) {                                                                                   \
        conv_to_ndhwc_halo<U, PACK, false>(x, cache, before, after, out, batch, channels, zeros_front, \
                                           cached, x_frames, zeros_back, height, width, halo, axis);  \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(TR_THREADS) conv_to_ndhwc_halo_up2_##NAME(  \
        const U* x, const U* cache, const U* before, const U* after, U* out, i64 batch, i64 channels, \
        i64 zeros_front, i64 cached, i64 x_frames, i64 zeros_back, int height, int width, int halo,   \
        int axis) {                                                                                   \
        conv_to_ndhwc_halo<U, PACK, true>(x, cache, before, after, out, batch, channels, zeros_front,  \
                                          cached, x_frames, zeros_back, height, width, halo, axis);   \
    }
// Instances per element size (e2, e4) and word: p1, p2, pw (a whole 16-byte chunk).
TO_NDHWC_HALO(e2_p1, unsigned short, 1)
TO_NDHWC_HALO(e2_p2, unsigned short, 2)
TO_NDHWC_HALO(e2_pw, unsigned short, 8)
TO_NDHWC_HALO(e4_p1, unsigned int, 1)
TO_NDHWC_HALO(e4_p2, unsigned int, 2)
TO_NDHWC_HALO(e4_pw, unsigned int, 4)
TO_NDHWC(e2_p1, unsigned short, 1)
TO_NDHWC(e2_p2, unsigned short, 2)
TO_NDHWC(e2_pw, unsigned short, 8)
TO_NDHWC(e4_p1, unsigned int, 1)
TO_NDHWC(e4_p2, unsigned int, 2)
TO_NDHWC(e4_pw, unsigned int, 4)

// Element bits ↔ f32 for the bias add on the way back.
template <typename T> struct Elem;
template <> struct Elem<float> {
    typedef unsigned int U;
    static __device__ __forceinline__ float get(U b) { return __uint_as_float(b); }
    static __device__ __forceinline__ U make(float v) { return __float_as_uint(v); }
};
template <> struct Elem<bf16> {
    typedef unsigned short U;
    static __device__ __forceinline__ float get(U b) { return __bfloat162float(__ushort_as_bfloat16(b)); }
    static __device__ __forceinline__ U make(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
};

// conv_from_ndhwc: out [B, C, P] = y [B, P, C] transposed (+ bias[c] when has_bias, added in f32 and
// rounded once). Per slab b: source [P, C] (a pixel's channels are contiguous), destination [C, P].
// Grid: x over channel tiles, y over pixel tiles, z over batch items (y and z grid-stride).
//
// has_residual: then + residual [B, C, P] (T, same layout as out), added in f32 to the value rounded
// as above and rounded again: exactly what storing the biased result and running the elementwise add
// (binary, BINARY_ADD: ld(a) + ld(b), rounded) would give, without writing and re-reading the conv's
// output. The residual is read in chunks beside the writes of out: coalesced along P.
template <typename T, typename B, int PACK>
__device__ void conv_from_ndhwc(const T* y, const B* bias, const T* residual, T* out, i64 batch,
                                i64 channels, i64 pixels, int has_bias, int has_residual) {
    typedef typename Elem<T>::U U;
    constexpr int V = chunk_elems<U>(), TE = 8 * V;
    TR_TILE(U);
    const U* yb = reinterpret_cast<const U*>(y);
    const U* rb = reinterpret_cast<const U*>(residual);
    U* ob = reinterpret_cast<U*>(out);
    const i64 k0 = (i64)blockIdx.x * TE;  // channel tile
    for (i64 b = blockIdx.z; b < batch; b += gridDim.z) {
        auto load = [&](i64 p, i64 c) -> Chunk<U> {
            return load_chunk<U, PACK>(p < pixels ? yb + (b * pixels + p) * channels : nullptr, c, channels);
        };
        // The stored value of out[b, c, ·] given the conv's sum v and the residual's element r.
        auto epilogue = [&](i64 c, U v, U r) -> U {
            U o = has_bias ? Elem<T>::make(Elem<T>::get(v) + ld(bias + c)) : v;
            if (has_residual) o = Elem<T>::make(Elem<T>::get(o) + Elem<T>::get(r));
            return o;
        };
        auto put = [&](i64 c, i64 p, const Chunk<U>& w) {
            const i64 row = (b * channels + c) * pixels;
            const Chunk<U> r = has_residual ? load_chunk<U, PACK>(rb + row, p, pixels) : w;
            Chunk<U> o;
#pragma unroll
            for (int j = 0; j < V; ++j) o.elem[j] = epilogue(c, w.elem[j], r.elem[j]);
            store_chunk<U, PACK>(ob + row + p, o);
        };
        auto put_tail = [&](i64 c, i64 p, U v) {
            const i64 at = (b * channels + c) * pixels + p;
            ob[at] = epilogue(c, v, has_residual ? rb[at] : v);
        };
        for (i64 r0 = (i64)blockIdx.y * TE; r0 < pixels; r0 += (i64)gridDim.y * TE) {
            transpose_tile<U>(tile, pixels, channels, r0, k0, load, put, put_tail);
        }
    }
}

#define FROM_NDHWC(TN, T, BN, B)                                                                      \
    extern "C" __global__ void __launch_bounds__(TR_THREADS) conv_from_ndhwc_##TN##_##BN##_p1( \
        const T* y, const B* bias, const T* residual, T* out, i64 batch, i64 channels, i64 pixels,    \
        int has_bias, int has_residual) {                                                             \
        conv_from_ndhwc<T, B, 1>(y, bias, residual, out, batch, channels, pixels, has_bias,           \
                                 has_residual);                                                       \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(TR_THREADS) conv_from_ndhwc_##TN##_##BN##_p2( \
        const T* y, const B* bias, const T* residual, T* out, i64 batch, i64 channels, i64 pixels,    \
        int has_bias, int has_residual) {                                                             \
        conv_from_ndhwc<T, B, 2>(y, bias, residual, out, batch, channels, pixels, has_bias,           \
                                 has_residual);                                                       \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(TR_THREADS) conv_from_ndhwc_##TN##_##BN##_pw(         \
        const T* y, const B* bias, const T* residual, T* out, i64 batch, i64 channels, i64 pixels,    \
        int has_bias, int has_residual) {                                                             \
        conv_from_ndhwc<T, B, chunk_elems<T>()>(y, bias, residual, out, batch, channels, pixels,      \
                                                has_bias, has_residual);                              \
    }
FOR_TYPES2(FROM_NDHWC)
