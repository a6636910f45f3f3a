//! The reference biased, masked softmax: plain loops, one row at a time.

use super::MASKED;

/// The logits' dimensions [B, H, S_q, S_k].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub batch: usize,
    pub heads: usize,
    pub seq_q: usize,
    pub seq_k: usize,
}

/// Row (b, h, q): v_k = logit + (table[bucket(k − q), h] + mask_k), then max-subtracted exp over the
/// row, summed in key order, each divided by the sum. Inputs are in bounds (checked by the caller).
pub(crate) fn position_bias_softmax(
    logits: &[f32],
    table: &[f32],
    buckets: &[u32],
    valid_lens: &[u32],
    d: Dims,
) -> Vec<f32> {
    debug_assert_eq!(logits.len(), d.batch * d.heads * d.seq_q * d.seq_k);
    let mut out = logits.to_vec();
    if d.seq_k == 0 {
        return out;
    }
    for (row_index, row) in out.chunks_exact_mut(d.seq_k).enumerate() {
        let q = row_index % d.seq_q;
        let h = row_index / d.seq_q % d.heads;
        let b = row_index / (d.seq_q * d.heads);
        let valid = valid_lens[b] as usize;
        // buckets[k − q + S_q − 1] for k = 0.. starts at index S_q − 1 − q.
        let row_buckets = &buckets[d.seq_q - 1 - q..][..d.seq_k];
        for (k, (v, &bucket)) in row.iter_mut().zip(row_buckets).enumerate() {
            let mask = if k < valid { 0.0 } else { MASKED };
            *v += table[bucket as usize * d.heads + h] + mask;
        }
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for v in row.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        for v in row.iter_mut() {
            *v /= sum;
        }
    }
    out
}
