//! CPU reference attention: per (batch, head), blocks of query rows; scores through GEMM, an exact
//! softmax per row (max-subtracted), then P·V through GEMM. Plus the LSE combine and Ring merge formulas.

use crate::ops::matmul::cpu::{MatRef, gemm};

/// Query rows per block: bounds the score buffer at QUERY_BLOCK × S_k floats.
const QUERY_BLOCK: usize = 64;

/// Sizes of one attention call (q [B, S_q, H, D], k/v [B, S_k, H, D]).
pub(super) struct AttentionDims {
    pub batch: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub heads: usize,
    pub head_dim: usize,
}

/// → (out [B, S_q, H, D], lse [B, H, S_q]); only keys `0..kv_len` take part.
pub(super) fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttentionDims,
    scale: f32,
    kv_len: usize,
) -> (Vec<f32>, Vec<f32>) {
    let AttentionDims {
        batch,
        seq_q,
        seq_k,
        heads,
        head_dim,
    } = dims;
    let token_stride = heads * head_dim; // distance between consecutive tokens of one head
    let mut out = vec![0.0; batch * seq_q * token_stride];
    let mut lse = vec![f32::NEG_INFINITY; batch * heads * seq_q];
    if kv_len == 0 || head_dim == 0 {
        return (out, lse);
    }
    let mut scores = vec![0.0; QUERY_BLOCK * kv_len];
    for b in 0..batch {
        for h in 0..heads {
            // This head's keys and values: kv_len rows of head_dim, rows token_stride apart.
            let kv_offset = b * seq_k * token_stride + h * head_dim;
            let head_rows = |data| MatRef {
                data,
                rows: kv_len,
                cols: head_dim,
                row_stride: token_stride,
                col_stride: 1,
            };
            let keys = head_rows(&k[kv_offset..]);
            let values = head_rows(&v[kv_offset..]);
            for q_start in (0..seq_q).step_by(QUERY_BLOCK) {
                let rows = QUERY_BLOCK.min(seq_q - q_start);
                let q_offset = (b * seq_q + q_start) * token_stride + h * head_dim;
                let queries = MatRef {
                    data: &q[q_offset..],
                    rows,
                    cols: head_dim,
                    row_stride: token_stride,
                    col_stride: 1,
                };
                let scores = &mut scores[..rows * kv_len];
                gemm(queries, keys.t(), scores, kv_len, false);

                // Softmax per row, in place: p_j = exp(s_j − m) / l, and lse = m + ln l.
                for (r, row) in scores.chunks_exact_mut(kv_len).enumerate() {
                    row.iter_mut().for_each(|s| *s *= scale);
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0.0;
                    for s in row.iter_mut() {
                        *s = (*s - max).exp();
                        sum += *s;
                    }
                    row.iter_mut().for_each(|p| *p /= sum);
                    lse[(b * heads + h) * seq_q + q_start + r] = max + sum.ln();
                }

                let probs = MatRef::row_major(scores, rows, kv_len);
                gemm(probs, values, &mut out[q_offset..], token_stride, false);
            }
        }
    }
    (out, lse)
}

/// k-way combine; outs[i] [B, S, H, D], lses[i] [B, H, S] → (out, lse).
pub(super) fn lse_combine(
    outs: &[&[f32]],
    lses: &[&[f32]],
    [batch, seq, heads, head_dim]: [usize; 4],
) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![0.0; batch * seq * heads * head_dim];
    let mut lse = vec![f32::NEG_INFINITY; batch * heads * seq];
    let mut weights = vec![0.0; lses.len()];
    for b in 0..batch {
        for h in 0..heads {
            for s in 0..seq {
                let l_index = (b * heads + h) * seq + s;
                let max = lses
                    .iter()
                    .map(|l| l[l_index])
                    .fold(f32::NEG_INFINITY, f32::max);
                if max == f32::NEG_INFINITY {
                    continue; // no partial saw a valid key: out stays 0, lse −∞
                }
                for (w, l) in weights.iter_mut().zip(lses) {
                    *w = (l[l_index] - max).exp();
                }
                let total: f32 = weights.iter().sum();
                lse[l_index] = max + total.ln();
                let o_base = ((b * seq + s) * heads + h) * head_dim;
                let out_row = &mut out[o_base..o_base + head_dim];
                for (w, part) in weights.iter().zip(outs) {
                    let part_row = &part[o_base..o_base + head_dim];
                    for (o, &p) in out_row.iter_mut().zip(part_row) {
                        *o += w / total * p;
                    }
                }
            }
        }
    }
    (out, lse)
}

/// σ(x) = 1 / (1 + e^(−x)); saturates cleanly to 0 or 1 at ±∞.
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// log σ(x) = −softplus(−x), written so that neither exp overflows.
fn log_sigmoid(x: f32) -> f32 {
    x.min(0.0) - (-x.abs()).exp().ln_1p()
}

/// Ring's two-partial merge, element by element (see `lse_merge_pair`).
pub(super) fn lse_merge_pair(
    out: &[f32],
    lse: &[f32],
    out_blk: &[f32],
    lse_blk: &[f32],
    [batch, seq, heads, head_dim]: [usize; 4],
) -> (Vec<f32>, Vec<f32>) {
    let mut merged = out.to_vec();
    let mut merged_lse = lse.to_vec();
    for b in 0..batch {
        for h in 0..heads {
            for s in 0..seq {
                let l_index = (b * heads + h) * seq + s;
                let (acc, blk) = (lse[l_index], lse_blk[l_index]);
                let o_base = ((b * seq + s) * heads + h) * head_dim;
                let row = o_base..o_base + head_dim;
                if blk == f32::NEG_INFINITY {
                    continue; // the block saw no valid key: keep the accumulator
                }
                if acc == f32::NEG_INFINITY {
                    // Empty accumulator: take the block (the formula would compute −∞ − (−∞)).
                    merged[row.clone()].copy_from_slice(&out_blk[row]);
                    merged_lse[l_index] = blk;
                    continue;
                }
                let c = sigmoid(blk - acc);
                for (o, &ob) in merged[row.clone()].iter_mut().zip(&out_blk[row]) {
                    *o -= c * (*o - ob);
                }
                merged_lse[l_index] = acc - log_sigmoid(acc - blk);
            }
        }
    }
    (merged, merged_lse)
}
