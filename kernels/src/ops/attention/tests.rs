//! Attention against a naive f64 softmax, kv_len masking against truncated keys, and both merges of
//! key-split partials against full attention.
//!
//! Tolerances (inputs N(0,1), D = 16, scale 1/4, S_k ≤ 45):
//! - a score is a 16-term f32 dot product, error ≤ γ₁₆·Σ|q_i k_i|·scale ≈ 16·6e-8·10·0.25 ≈ 2.4e-6;
//!   the lse inherits that plus ~2 ulp of |lse| ≲ 6 → atol 1e-5 on lse;
//! - a probability inherits the score error as relative error (~2.4e-6); out = Σ p_j v_j with |v| ≲ 4
//!   adds a 45-term sum (≤ 45·6e-8·4 ≈ 1e-5) → atol 5e-5 on out;
//! - the merges add O(1) further roundings of those values, within the same tolerances.

use super::*;
use crate::testing::{assert_close, assert_close_slices};

const B: usize = 2;
const H: usize = 3;
const D: usize = 16;
const OUT_ATOL: f32 = 5e-5;
const LSE_ATOL: f32 = 1e-5;

fn qkv(seq_q: usize, seq_k: usize, seed: u64) -> Result<(Tensor, Tensor, Tensor)> {
    Ok((
        Tensor::randn(&[B, seq_q, H, D], DType::F32, seed, Device::Cpu)?,
        Tensor::randn(&[B, seq_k, H, D], DType::F32, seed + 1, Device::Cpu)?,
        Tensor::randn(&[B, seq_k, H, D], DType::F32, seed + 2, Device::Cpu)?,
    ))
}

/// Textbook softmax attention in f64 → (out [B, S_q, H, D], lse [B, H, S_q]).
fn naive_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<(Vec<f32>, Vec<f32>)> {
    let (seq_q, seq_k) = (q.shape()[1], k.shape()[1]);
    let (q, k, v) = (q.to_vec_f32()?, k.to_vec_f32()?, v.to_vec_f32()?);
    let at = |s: usize, b: usize, h: usize, seq: usize| ((b * seq + s) * H + h) * D;
    let mut out = vec![0.0; B * seq_q * H * D];
    let mut lse = vec![0.0; B * H * seq_q];
    for b in 0..B {
        for h in 0..H {
            for i in 0..seq_q {
                let scores: Vec<f64> = (0..seq_k)
                    .map(|j| {
                        let (qi, kj) = (at(i, b, h, seq_q), at(j, b, h, seq_k));
                        scale
                            * (0..D)
                                .map(|d| q[qi + d] as f64 * k[kj + d] as f64)
                                .sum::<f64>()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                lse[(b * H + h) * seq_q + i] = (max + sum.ln()) as f32;
                for d in 0..D {
                    let o: f64 = (0..seq_k)
                        .map(|j| (scores[j] - max).exp() / sum * v[at(j, b, h, seq_k) + d] as f64)
                        .sum();
                    out[at(i, b, h, seq_q) + d] = o as f32;
                }
            }
        }
    }
    Ok((out, lse))
}

#[test]
fn hand_case() -> Result<()> {
    // One query, two keys: scores [0, ln 3] → p = [1/4, 3/4]; out = 4/4 + 3·8/4 = 7; lse = ln 4.
    let q = Tensor::from_vec(vec![1.0], &[1, 1, 1, 1])?;
    let k = Tensor::from_vec(vec![0.0, 3.0f32.ln()], &[1, 2, 1, 1])?;
    let v = Tensor::from_vec(vec![4.0, 8.0], &[1, 2, 1, 1])?;
    let options = AttentionOptions {
        scale: Some(1.0),
        kv_len: None,
    };
    let (out, lse) = attention(&q, &k, &v, options)?;
    assert_close_slices(&out.to_vec_f32()?, &[7.0], 1e-6, 0.0);
    assert_close_slices(&lse.to_vec_f32()?, &[4.0f32.ln()], 1e-6, 0.0);
    Ok(())
}

#[test]
fn matches_naive_softmax_with_lse() -> Result<()> {
    // S_q = 70 spans two query blocks of 64; S_q ≠ S_k as in cross-attention.
    let (q, k, v) = qkv(70, 45, 100)?;
    let (out, lse) = attention(&q, &k, &v, AttentionOptions::default())?;
    assert_eq!(out.shape(), [B, 70, H, D]);
    assert_eq!(lse.shape(), [B, H, 70]);
    let (expect_out, expect_lse) = naive_attention(&q, &k, &v, 1.0 / (D as f64).sqrt())?;
    assert_close_slices(&out.to_vec_f32()?, &expect_out, OUT_ATOL, 0.0);
    assert_close_slices(&lse.to_vec_f32()?, &expect_lse, LSE_ATOL, 0.0);
    Ok(())
}

#[test]
fn kv_len_masks_padded_keys() -> Result<()> {
    let (q, k, v) = qkv(9, 40, 200)?;
    // Padding rows hold large values, so any leak would show.
    let pad = Tensor::full(&[B, 8, H, D], 50.0, DType::F32, Device::Cpu)?;
    let k_padded = Tensor::concat(&[&k, &pad], 1)?;
    let v_padded = Tensor::concat(&[&v, &pad], 1)?;
    let masked = AttentionOptions {
        scale: None,
        kv_len: Some(40),
    };
    let (out, lse) = attention(&q, &k_padded, &v_padded, masked)?;
    let (out_ref, lse_ref) = attention(&q, &k, &v, AttentionOptions::default())?;
    // The valid keys sit at the same strides in both calls, so the arithmetic is identical.
    assert_eq!(out.to_vec_f32()?, out_ref.to_vec_f32()?);
    assert_eq!(lse.to_vec_f32()?, lse_ref.to_vec_f32()?);

    // No valid key: out 0, lse −∞.
    let none = AttentionOptions {
        scale: None,
        kv_len: Some(0),
    };
    let (out, lse) = attention(&q, &k, &v, none)?;
    assert!(out.to_vec_f32()?.iter().all(|&x| x == 0.0));
    assert!(lse.to_vec_f32()?.iter().all(|&x| x == f32::NEG_INFINITY));

    let too_long = AttentionOptions {
        scale: None,
        kv_len: Some(41),
    };
    assert!(attention(&q, &k, &v, too_long).is_err());
    Ok(())
}

/// An attention result: (out [B, S, H, D], lse [B, H, S]).
type Partial = (Tensor, Tensor);

/// Full attention and the partials over key chunks of sizes `sizes` (plus one fully padded chunk).
fn partials(sizes: &[usize]) -> Result<(Tensor, Tensor, Vec<Partial>)> {
    let seq_k: usize = sizes.iter().sum();
    let (q, k, v) = qkv(11, seq_k, 300)?;
    let (out, lse) = attention(&q, &k, &v, AttentionOptions::default())?;
    let mut parts = Vec::new();
    for (k_i, v_i) in k.split(1, sizes)?.iter().zip(v.split(1, sizes)?.iter()) {
        parts.push(attention(&q, k_i, v_i, AttentionOptions::default())?);
    }
    // A partial that saw only padding (a rank whose keys are all beyond the valid length).
    let no_keys = AttentionOptions {
        scale: None,
        kv_len: Some(0),
    };
    parts.push(attention(&q, &k, &v, no_keys)?);
    Ok((out, lse, parts))
}

#[test]
fn lse_combine_of_key_splits_equals_full_attention() -> Result<()> {
    let (out, lse, parts) = partials(&[10, 20, 15])?;
    let refs: Vec<(&Tensor, &Tensor)> = parts.iter().map(|(o, l)| (o, l)).collect();
    let (combined, combined_lse) = lse_combine(&refs)?;
    assert_close(&combined, &out, OUT_ATOL, 0.0);
    assert_close(&combined_lse, &lse, LSE_ATOL, 0.0);
    Ok(())
}

#[test]
fn ring_merge_of_key_splits_equals_full_attention() -> Result<()> {
    let (out, lse, parts) = partials(&[7, 30, 8])?;
    // A ring accumulator starts empty: out 0, lse −∞.
    let mut acc = (
        Tensor::zeros(out.shape(), DType::F32, Device::Cpu)?,
        Tensor::full(lse.shape(), f32::NEG_INFINITY, DType::F32, Device::Cpu)?,
    );
    for (blk_out, blk_lse) in &parts {
        acc = lse_merge_pair(&acc.0, &acc.1, blk_out, blk_lse)?;
    }
    assert_close(&acc.0, &out, OUT_ATOL, 0.0);
    assert_close(&acc.1, &lse, LSE_ATOL, 0.0);
    Ok(())
}

#[test]
fn bf16_inputs_accumulate_in_f32() -> Result<()> {
    let (q, k, v) = qkv(13, 21, 400)?;
    let [q16, k16, v16] = [&q, &k, &v].map(|t| t.to_dtype(DType::BF16).expect("cast"));
    let (out, lse) = attention(&q16, &k16, &v16, AttentionOptions::default())?;
    assert_eq!((out.dtype(), lse.dtype()), (DType::BF16, DType::F32));
    // Reference: the same (bf16-representable) values in f32. The f32 computations are identical, so lse
    // matches exactly; out differs only by its final rounding to bf16: bf16 keeps 8 significant bits, so
    // the unit roundoff (half an ulp, relative) is 2⁻⁸.
    let [q32, k32, v32] = [&q16, &k16, &v16].map(|t| t.to_dtype(DType::F32).expect("cast"));
    let (out_ref, lse_ref) = attention(&q32, &k32, &v32, AttentionOptions::default())?;
    assert_eq!(lse.to_vec_f32()?, lse_ref.to_vec_f32()?);
    assert_close(&out, &out_ref, 0.0, 1.0 / 256.0);
    Ok(())
}

#[test]
fn shape_and_dtype_errors() -> Result<()> {
    let (q, k, v) = qkv(4, 5, 500)?;
    let k_wrong = k.narrow(3, 0, 8)?;
    assert!(attention(&q, &k_wrong, &v, AttentionOptions::default()).is_err());
    let v16 = v.to_dtype(DType::BF16)?;
    assert!(matches!(
        attention(&q, &k, &v16, AttentionOptions::default()),
        Err(KernelError::DTypeMismatch { .. })
    ));
    let (out, lse) = attention(&q, &k, &v, AttentionOptions::default())?;
    assert!(lse_combine(&[]).is_err());
    assert!(lse_combine(&[(&out, &out)]).is_err());
    assert!(lse_merge_pair(&out, &lse.to_dtype(DType::BF16)?, &out, &lse).is_err());
    Ok(())
}
