// Attention forward with LSE (portable, f32 CUDA cores; the tensor-core kernel is flash.cu), and the
// partial-attention merges.
//
// attention_fwd: block = 4 warps, each owning 4 query rows (16 rows per block) of one (batch, head).
// Key/value tiles of 32 rows are staged in shared memory as f32; per tile, lane j scores key j for each
// of the warp's rows (q is pre-scaled), the warp updates the running max m, the running sum l and the
// output accumulator (lanes split the head dim) with the online-softmax rescale exp(m_old - m_new).
// Keys at index >= kv_len are never read. At the end out = acc / l, lse = m + ln l (or 0 and -inf when
// there is no valid key).
//
// The head-dim bound MAXD sizes the per-lane accumulators (ATT_RPW x MAXD/32 registers). Two builds:
// MAXD 256 (attention_fwd_*), and MAXD 512 (attention_fwd_wide_*, e.g. the Wan VAE's single head of
// 384), kept apart so small head dims do not carry 16 accumulator columns per row.

#define ATT_BN 32      // keys per tile (= lanes)
#define ATT_WARPS 4
#define ATT_RPW 4      // query rows per warp

template <typename T, int MAXD>
__device__ void attention_fwd(const T* q, const T* k, const T* v, T* out, float* lse, int seq_q,
                              int seq_k, int heads, int d, int kv_len, float scale) {
    extern __shared__ float smem[];
    float* ks = smem;                        // [ATT_BN][d + 1] (padded: lane j reads row j)
    float* vs = ks + ATT_BN * (d + 1);       // [ATT_BN][d]
    float* qs = vs + ATT_BN * d;             // [ATT_WARPS * ATT_RPW][d]
    const int b = blockIdx.z, h = blockIdx.y;
    const int q0 = blockIdx.x * ATT_WARPS * ATT_RPW;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const i64 tok = (i64)heads * d;  // distance between consecutive tokens
    const T* qb = q + (i64)b * seq_q * tok + (i64)h * d;
    const T* kb = k + (i64)b * seq_k * tok + (i64)h * d;
    const T* vb = v + (i64)b * seq_k * tok + (i64)h * d;

    for (int idx = threadIdx.x; idx < ATT_WARPS * ATT_RPW * d; idx += blockDim.x) {
        int r = idx / d, c = idx % d, qi = q0 + r;
        qs[idx] = qi < seq_q ? ld(qb + (i64)qi * tok + c) * scale : 0.0f;
    }

    float m[ATT_RPW], l[ATT_RPW], acc[ATT_RPW][MAXD / 32];
#pragma unroll
    for (int r = 0; r < ATT_RPW; ++r) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < MAXD / 32; ++i) acc[r][i] = 0.0f;
    }

    for (int kt = 0; kt < kv_len; kt += ATT_BN) {
        __syncthreads();  // everyone is done with the previous tile (and, first time, qs is written)
        for (int idx = threadIdx.x; idx < ATT_BN * d; idx += blockDim.x) {
            int j = idx / d, c = idx % d, kj = kt + j;
            float kv = 0.0f, vv = 0.0f;
            if (kj < kv_len) {
                kv = ld(kb + (i64)kj * tok + c);
                vv = ld(vb + (i64)kj * tok + c);
            }
            ks[j * (d + 1) + c] = kv;
            vs[j * d + c] = vv;
        }
        __syncthreads();
        const bool valid = kt + lane < kv_len;
#pragma unroll
        for (int r = 0; r < ATT_RPW; ++r) {
            const float* qr = qs + (warp * ATT_RPW + r) * d;
            const float* kr = ks + lane * (d + 1);
            float s = 0.0f;
            for (int c = 0; c < d; ++c) s += qr[c] * kr[c];
            s = valid ? s : -INFINITY;
            float tile_max = s;
            for (int o = 16; o > 0; o >>= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
            // Lane 0's key is valid (kt < kv_len), so tile_max and m_new are finite.
            float m_new = fmaxf(m[r], tile_max);
            float correction = expf(m[r] - m_new);  // 0 on the first tile (m = -inf)
            float p = valid ? expf(s - m_new) : 0.0f;
            float p_sum = p;
            for (int o = 16; o > 0; o >>= 1) p_sum += __shfl_xor_sync(0xffffffffu, p_sum, o);
            l[r] = l[r] * correction + p_sum;
            m[r] = m_new;
#pragma unroll
            for (int i = 0; i < MAXD / 32; ++i) acc[r][i] *= correction;
            for (int j = 0; j < ATT_BN; ++j) {
                float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
                for (int i = 0; i < MAXD / 32; ++i) {
                    int c = lane + 32 * i;
                    if (c < d) acc[r][i] += pj * vs[j * d + c];
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < ATT_RPW; ++r) {
        int qi = q0 + warp * ATT_RPW + r;
        if (qi >= seq_q) continue;
        float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        T* orow = out + (i64)b * seq_q * tok + (i64)qi * tok + (i64)h * d;
#pragma unroll
        for (int i = 0; i < MAXD / 32; ++i) {
            int c = lane + 32 * i;
            if (c < d) st(orow + c, acc[r][i] * inv);
        }
        if (lane == 0) lse[((i64)b * heads + h) * seq_q + qi] = l[r] > 0.0f ? m[r] + logf(l[r]) : -INFINITY;
    }
}

#define ATTENTION(NAME, TN, T, MAXD) \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) NAME##_##TN( \
        const T* q, const T* k, const T* v, T* out, float* lse, int seq_q, int seq_k, int heads, int d, \
        int kv_len, float scale) { \
        attention_fwd<T, MAXD>(q, k, v, out, lse, seq_q, seq_k, heads, d, kv_len, scale); \
    }
ATTENTION(attention_fwd, f32, float, 256)
ATTENTION(attention_fwd, bf16, bf16, 256)
ATTENTION(attention_fwd_wide, f32, float, 512)
ATTENTION(attention_fwd_wide, bf16, bf16, 512)

// ---- Merges of partial attentions. Rows r enumerate (b, s, h) in out's [B, S, H, D] order; lse is
// [B, H, S]. One thread per row (these are small next to the attention that produced the partials).

#define MAX_PARTS 16
struct Parts {
    unsigned long long out[MAX_PARTS];  // const TI*
    unsigned long long lse[MAX_PARTS];  // const float*
    int k;
    int pad_;
};

__device__ __forceinline__ i64 lse_index(i64 r, i64 seq, i64 heads) {
    i64 h = r % heads, s = (r / heads) % seq, b = r / (heads * seq);
    return (b * heads + h) * seq + s;
}

template <typename TO, typename TI>
__device__ void lse_combine(const Parts& p, TO* out, float* lse, i64 rows, i64 seq, i64 heads, int d) {
    FOR_EACH(r, rows) {
        i64 li = lse_index(r, seq, heads);
        float mx = -INFINITY;
        for (int j = 0; j < p.k; ++j) mx = fmaxf(mx, ((const float*)p.lse[j])[li]);
        TO* o = out + r * d;
        if (mx == -INFINITY) {  // no partial saw a valid key
            for (int c = 0; c < d; ++c) st(o + c, 0.0f);
            lse[li] = -INFINITY;
            continue;
        }
        float total = 0.0f;
        for (int j = 0; j < p.k; ++j) total += expf(((const float*)p.lse[j])[li] - mx);
        lse[li] = mx + logf(total);
        for (int c = 0; c < d; ++c) {
            float a = 0.0f;
            for (int j = 0; j < p.k; ++j) {
                float w = expf(((const float*)p.lse[j])[li] - mx);
                a += w / total * ld((const TI*)p.out[j] + r * d + c);
            }
            st(o + c, a);
        }
    }
}

__device__ __forceinline__ float log_sigmoid(float x) { return fminf(x, 0.0f) - log1pf(expf(-fabsf(x))); }

template <typename TO, typename TB>
__device__ void lse_merge_pair(const TO* out, const float* lse, const TB* out_blk, const float* lse_blk,
                               TO* merged, float* merged_lse, i64 rows, i64 seq, i64 heads, int d) {
    FOR_EACH(r, rows) {
        i64 li = lse_index(r, seq, heads);
        float acc = lse[li], blk = lse_blk[li];
        const TO* o = out + r * d;
        const TB* ob = out_blk + r * d;
        TO* y = merged + r * d;
        if (blk == -INFINITY) {  // the block saw no valid key: keep the accumulator
            for (int c = 0; c < d; ++c) st(y + c, ld(o + c));
            merged_lse[li] = acc;
        } else if (acc == -INFINITY) {  // empty accumulator: take the block
            for (int c = 0; c < d; ++c) st(y + c, ld(ob + c));
            merged_lse[li] = blk;
        } else {
            float w = 1.0f / (1.0f + expf(-(blk - acc)));
            for (int c = 0; c < d; ++c) {
                float a = ld(o + c);
                st(y + c, a - w * (a - ld(ob + c)));
            }
            merged_lse[li] = acc - log_sigmoid(acc - blk);
        }
    }
}

#define MERGES(ON, TO, IN, TI) \
    extern "C" __global__ void lse_combine_##ON##_##IN(Parts p, TO* out, float* lse, i64 rows, i64 seq, \
                                                       i64 heads, int d) { \
        lse_combine<TO, TI>(p, out, lse, rows, seq, heads, d); \
    } \
    extern "C" __global__ void lse_merge_pair_##ON##_##IN(const TO* out, const float* lse, const TI* out_blk, \
                                                          const float* lse_blk, TO* merged, float* merged_lse, \
                                                          i64 rows, i64 seq, i64 heads, int d) { \
        lse_merge_pair(out, lse, out_blk, lse_blk, merged, merged_lse, rows, seq, heads, d); \
    }
FOR_TYPES2(MERGES)
