// Softmax over the keys of attention logits + T5 relative-position bias + key-padding mask.
// One warp per row (b, h, q) (grid-stride over rows); every lane walks keys lane, lane + 32, ... three
// times (max, sum, write): a row is S_k values, small enough to stay in L1 between the passes. The
// per-element arithmetic is the CPU reference's, in the same order: v = logit + (bias + mask),
// exp(v - max), division by the sum.

#define MASKED_LOGIT (-3.40282346638528859812e+38f)  // f32::MIN, transformers' mask value

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <typename T, typename W>
__device__ void position_bias_softmax(const T* logits, const W* table, const unsigned* buckets,
                                      const unsigned* valid_lens, T* out, i64 rows, int heads,
                                      int seq_q, int seq_k) {
    const int lane = threadIdx.x % 32;
    const i64 warps = (i64)gridDim.x * (blockDim.x / 32);
    for (i64 row = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < rows; row += warps) {
        const int q = (int)(row % seq_q);
        const i64 bh = row / seq_q;
        const int h = (int)(bh % heads);
        const int valid = (int)valid_lens[bh / heads];
        const T* x = logits + row * seq_k;
        T* y = out + row * seq_k;
        const unsigned* bk = buckets + (seq_q - 1 - q);  // bk[k]: bucket of k - q
        float m = -INFINITY;
        for (int k = lane; k < seq_k; k += 32) {
            float v = ld(x + k) + (ld(table + (i64)bk[k] * heads + h) + (k < valid ? 0.0f : MASKED_LOGIT));
            m = fmaxf(m, v);
        }
        m = warp_max(m);
        float s = 0.0f;
        for (int k = lane; k < seq_k; k += 32) {
            float v = ld(x + k) + (ld(table + (i64)bk[k] * heads + h) + (k < valid ? 0.0f : MASKED_LOGIT));
            s += expf(v - m);
        }
        s = warp_sum(s);
        for (int k = lane; k < seq_k; k += 32) {
            float v = ld(x + k) + (ld(table + (i64)bk[k] * heads + h) + (k < valid ? 0.0f : MASKED_LOGIT));
            st(y + k, expf(v - m) / s);
        }
    }
}

#define POSITION_BIAS_SOFTMAX(TN, T, WN, W) \
    extern "C" __global__ void position_bias_softmax_##TN##_##WN( \
        const T* logits, const W* table, const unsigned* buckets, const unsigned* valid_lens, T* out, \
        i64 rows, int heads, int seq_q, int seq_k) { \
        position_bias_softmax(logits, table, buckets, valid_lens, out, rows, heads, seq_q, seq_k); \
    }
FOR_TYPES2(POSITION_BIAS_SOFTMAX)
