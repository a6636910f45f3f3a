//! The T5 / umT5 encoder stack (transformers' `T5EncoderModel` / `UMT5EncoderModel`), forward only:
//! token embedding, then per block a pre-norm self-attention with a learned relative-position bias and
//! a pre-norm (gated) feed-forward, each added to the residual, then a final norm.
//!
//! Three T5 particulars, each checked against transformers in `tests/text_encoder.rs`:
//! - Attention logits are **not** scaled by 1/√d (T5 folds the scale into the q initialisation) and get
//!   an additive bias `bias[h, bucket(key − query)]`. The kernels' [`attention`](ditstream_kernels::attention)
//!   has neither a bias input nor scale 1 with bias, so attention is written here with `matmul`, `add`
//!   and a local softmax over the last axis.
//! - The norms are T5LayerNorm: RMS without mean subtraction or bias, in f32 — the kernels' `rms_norm`.
//! - umT5 has a bias table in every layer; T5 in layer 0 only, reused by the later layers.
//!
//! Padding: keys at or past a row's valid length get `f32::MIN` added to their logits (transformers'
//! `create_bidirectional_mask` value), so their softmax weight is exactly 0 and the valid rows equal
//! those of an unpadded run.

use ditstream_kernels::{DType, Device, Tensor};

use super::TextError;
use super::config::{T5Activation, T5Config, T5Variant};
use ditstream_kernels::weights::{Checkpoint, WeightSource};

/// transformers' `_relative_position_bucket` for a bidirectional encoder: the bucket of
/// `relative_position = key − query`.
///
/// Half the buckets take positive offsets, half the rest; in each half the first `max_exact = half / 2`
/// offsets get a bucket each and larger ones share logarithmically spaced buckets up to `max_distance`.
/// The logarithm is taken in f32 exactly as transformers does it (the f64 constant `ln(max_distance /
/// max_exact)` rounded to f32, truncation toward zero), so bucket edges agree bit for bit.
pub fn relative_position_bucket(
    relative_position: i64,
    num_buckets: usize,
    max_distance: usize,
) -> usize {
    let half = num_buckets / 2;
    let direction = if relative_position > 0 { half } else { 0 };
    let distance = relative_position.unsigned_abs() as usize;
    let max_exact = half / 2;
    if distance < max_exact {
        return direction + distance;
    }
    let log_ratio = (distance as f32 / max_exact as f32).ln()
        / ((max_distance as f64 / max_exact as f64).ln() as f32);
    // log_ratio ≥ 0 here (distance ≥ max_exact), so `as usize` truncates toward zero like `.to(long)`.
    let large = max_exact + (log_ratio * (half - max_exact) as f32) as usize;
    direction + large.min(half - 1)
}

/// Row-wise softmax over the last axis (max-subtracted, f32), x [.., N] → same shape and dtype.
///
/// Lives here because the kernels crate has no standalone softmax (its attention fuses it); on a
/// non-CPU tensor it answers the device error of the host copy.
pub(crate) fn softmax_last_dim(x: &Tensor) -> Result<Tensor, TextError> {
    let n = *x.shape().last().unwrap_or(&1);
    let mut values = x.to_vec_f32()?;
    if n > 0 {
        for row in values.chunks_exact_mut(n) {
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
    }
    Ok(Tensor::from_vec(values, x.shape())?.to_dtype(x.dtype())?)
}

/// Self-attention of one block (`layer.0.SelfAttention`).
struct SelfAttention {
    /// q, k, v: [inner, d_model]; o: [d_model, inner].
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    /// `relative_attention_bias.weight` [num_buckets, heads] on the host, if this layer owns one.
    relative_bias: Option<Vec<f32>>,
}

/// The feed-forward of one block (`layer.1.DenseReluDense`).
struct FeedForward {
    /// Gated: `wi_0` (activated) and `wi_1` (linear), [d_ff, d_model]. Plain: `wi` alone.
    wi_0: Tensor,
    wi_1: Option<Tensor>,
    /// [d_model, d_ff].
    wo: Tensor,
}

/// One encoder block (`encoder.block.{i}`).
struct Block {
    attn_norm: Tensor,
    attn: SelfAttention,
    ffn_norm: Tensor,
    ffn: FeedForward,
}

/// A T5/umT5 encoder: weights and config. CPU today (the softmax and the embedding gather go through
/// host memory).
pub struct T5Encoder {
    config: T5Config,
    /// `shared.weight` [vocab, d_model].
    embedding: Tensor,
    blocks: Vec<Block>,
    final_norm: Tensor,
}

/// Tensor `name` of `shape` in f32 (the CPU compute dtype; bf16 and f16 checkpoints widen).
fn get(ckpt: &Checkpoint, name: &str, shape: &[usize]) -> Result<Tensor, TextError> {
    Ok(ckpt.tensor(name, shape, DType::F32)?)
}

impl T5Encoder {
    /// Loads the encoder of a transformers checkpoint folder (`config.json` plus `model.safetensors`
    /// or a sharded `model.safetensors.index.json`), with the checkpoint's tensor names
    /// (`shared.weight`, `encoder.block.{i}.layer.0.SelfAttention.q.weight`, …), each checked for
    /// presence and shape.
    pub fn from_dir(dir: &std::path::Path) -> Result<Self, TextError> {
        let config = T5Config::from_file(&dir.join("config.json"))?;
        let checkpoint = Checkpoint::open_dir(dir, "model")?;
        Self::from_checkpoint(config, &checkpoint)
    }

    fn from_checkpoint(config: T5Config, ckpt: &Checkpoint) -> Result<Self, TextError> {
        let (d, inner, ff) = (config.d_model, config.inner_dim(), config.d_ff);
        // The embedding is tied: checkpoints save it as `shared.weight`, some also or only as
        // `encoder.embed_tokens.weight`.
        let embedding_name = if ckpt.shape("shared.weight").is_some() {
            "shared.weight"
        } else if ckpt.shape("encoder.embed_tokens.weight").is_some() {
            "encoder.embed_tokens.weight"
        } else {
            "shared.weight"
        };
        let embedding = get(ckpt, embedding_name, &[config.vocab_size, d])?;
        let mut blocks = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let p = format!("encoder.block.{i}.layer");
            let has_bias = match config.variant {
                T5Variant::UmT5 => true,
                T5Variant::T5 => i == 0,
            };
            let relative_bias = if has_bias {
                let name = format!("{p}.0.SelfAttention.relative_attention_bias.weight");
                Some(get(ckpt, &name, &[config.num_buckets, config.num_heads])?.to_vec_f32()?)
            } else {
                None
            };
            let ffn = if config.gated {
                FeedForward {
                    wi_0: get(ckpt, &format!("{p}.1.DenseReluDense.wi_0.weight"), &[ff, d])?,
                    wi_1: Some(get(
                        ckpt,
                        &format!("{p}.1.DenseReluDense.wi_1.weight"),
                        &[ff, d],
                    )?),
                    wo: get(ckpt, &format!("{p}.1.DenseReluDense.wo.weight"), &[d, ff])?,
                }
            } else {
                FeedForward {
                    wi_0: get(ckpt, &format!("{p}.1.DenseReluDense.wi.weight"), &[ff, d])?,
                    wi_1: None,
                    wo: get(ckpt, &format!("{p}.1.DenseReluDense.wo.weight"), &[d, ff])?,
                }
            };
            blocks.push(Block {
                attn_norm: get(ckpt, &format!("{p}.0.layer_norm.weight"), &[d])?,
                attn: SelfAttention {
                    q: get(ckpt, &format!("{p}.0.SelfAttention.q.weight"), &[inner, d])?,
                    k: get(ckpt, &format!("{p}.0.SelfAttention.k.weight"), &[inner, d])?,
                    v: get(ckpt, &format!("{p}.0.SelfAttention.v.weight"), &[inner, d])?,
                    o: get(ckpt, &format!("{p}.0.SelfAttention.o.weight"), &[d, inner])?,
                    relative_bias,
                },
                ffn_norm: get(ckpt, &format!("{p}.1.layer_norm.weight"), &[d])?,
                ffn,
            });
        }
        let final_norm = get(ckpt, "encoder.final_layer_norm.weight", &[d])?;
        Ok(T5Encoder {
            config,
            embedding,
            blocks,
            final_norm,
        })
    }

    /// Seeded random weights of `config`'s size, scaled like transformers' initialisation (so that
    /// activations stay O(1)): embedding N(0, 1), q N(0, 1/(d·d_kv)), k/v N(0, 1/d), o N(0, 1/inner),
    /// wi N(0, 1/d), wo N(0, 1/d_ff), bias tables N(0, 1), norms 1 + N(0, 0.1²). Weights are stored
    /// as `dtype`. Each tensor draws from its own stream `seed·1000 + k`.
    pub fn random(config: &T5Config, seed: u64, dtype: DType) -> Result<Self, TextError> {
        let (d, inner, ff) = (config.d_model, config.inner_dim(), config.d_ff);
        let mut stream = 0u64;
        let mut draw = |shape: &[usize], std: f32, mean: f32| -> Result<Tensor, TextError> {
            stream += 1;
            let t = Tensor::randn(
                shape,
                DType::F32,
                seed.wrapping_mul(1000).wrapping_add(stream),
                Device::Cpu,
            )?;
            Ok(ditstream_kernels::affine(&t, std, mean)?.to_dtype(dtype)?)
        };
        let embedding = draw(&[config.vocab_size, d], 1.0, 0.0)?;
        let mut blocks = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let has_bias = config.variant == T5Variant::UmT5 || i == 0;
            let relative_bias = if has_bias {
                Some(draw(&[config.num_buckets, config.num_heads], 1.0, 0.0)?.to_vec_f32()?)
            } else {
                None
            };
            let wi_std = 1.0 / (d as f32).sqrt();
            blocks.push(Block {
                attn_norm: draw(&[d], 0.1, 1.0)?,
                attn: SelfAttention {
                    q: draw(&[inner, d], 1.0 / ((d * config.d_kv) as f32).sqrt(), 0.0)?,
                    k: draw(&[inner, d], wi_std, 0.0)?,
                    v: draw(&[inner, d], wi_std, 0.0)?,
                    o: draw(&[d, inner], 1.0 / (inner as f32).sqrt(), 0.0)?,
                    relative_bias,
                },
                ffn_norm: draw(&[d], 0.1, 1.0)?,
                ffn: FeedForward {
                    wi_0: draw(&[ff, d], wi_std, 0.0)?,
                    wi_1: if config.gated {
                        Some(draw(&[ff, d], wi_std, 0.0)?)
                    } else {
                        None
                    },
                    wo: draw(&[d, ff], 1.0 / (ff as f32).sqrt(), 0.0)?,
                },
            });
        }
        let final_norm = draw(&[d], 0.1, 1.0)?;
        Ok(T5Encoder {
            config: config.clone(),
            embedding,
            blocks,
            final_norm,
        })
    }

    /// The model's dimensions.
    pub fn config(&self) -> &T5Config {
        &self.config
    }

    /// Last hidden states of a right-padded batch.
    ///
    /// ids `[B·S]` row-major token ids with `shape = [B, S]`; valid_lens `[B]` (each ≤ S): keys at
    /// positions ≥ `valid_lens[b]` are masked (transformers' attention_mask of 1s then 0s)
    /// → [B, S, d_model] f32. Padded rows are computed too, as transformers computes them.
    pub fn forward(
        &self,
        ids: &[u32],
        shape: [usize; 2],
        valid_lens: &[usize],
    ) -> Result<Tensor, TextError> {
        let [batch, seq] = shape;
        let c = &self.config;
        if ids.len() != batch * seq
            || valid_lens.len() != batch
            || valid_lens.iter().any(|&l| l > seq)
        {
            return Err(TextError::Input {
                message: format!(
                    "ids hold {} values, valid_lens {valid_lens:?}; expected B·S = {batch}·{seq} ids \
                     and B lengths each ≤ S",
                    ids.len()
                ),
            });
        }
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= c.vocab_size) {
            return Err(TextError::Input {
                message: format!(
                    "token id {bad} is outside the embedding table of {} rows",
                    c.vocab_size
                ),
            });
        }
        // Embedding gather: one row per token, as f32 activations.
        let rows = ids
            .iter()
            .map(|&id| self.embedding.narrow(0, id as usize, 1))
            .collect::<Result<Vec<_>, _>>()?;
        let mut x = Tensor::concat(&rows.iter().collect::<Vec<_>>(), 0)?
            .to_dtype(DType::F32)?
            .reshape(&[batch, seq, c.d_model])?;

        let buckets = bucket_table(seq, c.num_buckets, c.max_distance);
        let mut bias = None;
        for block in &self.blocks {
            // umT5: every layer builds its own bias; T5: layer 0's is kept for the rest.
            if let Some(table) = &block.attn.relative_bias {
                bias = Some(self.attention_bias(table, &buckets, seq, valid_lens)?);
            }
            let Some(bias) = &bias else {
                return Err(TextError::Input {
                    message: "the first encoder block has no relative_attention_bias".into(),
                });
            };
            let h = ditstream_kernels::rms_norm(&x, &block.attn_norm, c.layer_norm_eps)?;
            let h = self.self_attention(&block.attn, &h, bias, batch, seq)?;
            x = ditstream_kernels::add(&x, &h)?;
            let h = ditstream_kernels::rms_norm(&x, &block.ffn_norm, c.layer_norm_eps)?;
            let h = self.feed_forward(&block.ffn, &h)?;
            x = ditstream_kernels::add(&x, &h)?;
        }
        Ok(ditstream_kernels::rms_norm(
            &x,
            &self.final_norm,
            c.layer_norm_eps,
        )?)
    }

    /// Position bias plus padding mask: [B, H, S, S] f32 with
    /// `table[bucket(k − q), h] + (k < valid_len[b] ? 0 : f32::MIN)`.
    fn attention_bias(
        &self,
        table: &[f32],
        buckets: &[usize],
        seq: usize,
        valid_lens: &[usize],
    ) -> Result<Tensor, TextError> {
        let heads = self.config.num_heads;
        let mut values = Vec::with_capacity(valid_lens.len() * heads * seq * seq);
        for &valid in valid_lens {
            for h in 0..heads {
                for row in buckets.chunks_exact(seq) {
                    values.extend(row.iter().enumerate().map(|(k, &bucket)| {
                        let mask = if k < valid { 0.0 } else { f32::MIN };
                        table[bucket * heads + h] + mask
                    }));
                }
            }
        }
        Ok(Tensor::from_vec(
            values,
            &[valid_lens.len(), heads, seq, seq],
        )?)
    }

    /// x [B, S, d_model] (normed) → attention output projected by `o`, [B, S, d_model].
    fn self_attention(
        &self,
        attn: &SelfAttention,
        x: &Tensor,
        bias: &Tensor,
        batch: usize,
        seq: usize,
    ) -> Result<Tensor, TextError> {
        use ditstream_kernels::{linear, matmul};
        let (heads, d_kv) = (self.config.num_heads, self.config.d_kv);
        let split_heads = |w: &Tensor| -> Result<Tensor, TextError> {
            Ok(linear(x, w, None)?.reshape(&[batch, seq, heads, d_kv])?)
        };
        let q = split_heads(&attn.q)?.permute(&[0, 2, 1, 3])?; // [B, H, S, d_kv]
        let k_t = split_heads(&attn.k)?.permute(&[0, 2, 3, 1])?; // [B, H, d_kv, S]
        let v = split_heads(&attn.v)?.permute(&[0, 2, 1, 3])?; // [B, H, S, d_kv]
        // No 1/√d_kv: T5 does not scale its logits.
        let logits = ditstream_kernels::add(&matmul(&q, &k_t)?, bias)?; // [B, H, S, S]
        let weights = softmax_last_dim(&logits)?;
        let out =
            matmul(&weights, &v)?
                .permute(&[0, 2, 1, 3])?
                .reshape(&[batch, seq, heads * d_kv])?;
        Ok(linear(&out, &attn.o, None)?)
    }

    /// x [B, S, d_model] (normed) → wo(act(wi_0 x) · wi_1 x) (gated) or wo(act(wi x)), same shape.
    fn feed_forward(&self, ffn: &FeedForward, x: &Tensor) -> Result<Tensor, TextError> {
        use ditstream_kernels::linear;
        let pre = linear(x, &ffn.wi_0, None)?;
        let mut h = match self.config.activation {
            T5Activation::GeluTanh => ditstream_kernels::gelu_tanh(&pre)?,
            T5Activation::Relu => ditstream_kernels::clamp(&pre, 0.0, f32::INFINITY)?,
        };
        if let Some(wi_1) = &ffn.wi_1 {
            h = ditstream_kernels::mul(&h, &linear(x, wi_1, None)?)?;
        }
        Ok(linear(&h, &ffn.wo, None)?)
    }
}

/// bucket(k − q) for every query q (rows) and key k (columns) of a length-`seq` sequence, [S·S].
fn bucket_table(seq: usize, num_buckets: usize, max_distance: usize) -> Vec<usize> {
    (0..seq)
        .flat_map(|q| {
            (0..seq).map(move |k| {
                relative_position_bucket(k as i64 - q as i64, num_buckets, max_distance)
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_by_hand() {
        // 32 buckets, distance 128: 16 per direction, offsets 0..8 exact, then log buckets 8..15.
        let b = |r| relative_position_bucket(r, 32, 128);
        assert_eq!((b(0), b(-1), b(-7), b(1), b(7)), (0, 1, 7, 17, 23));
        assert_eq!((b(-8), b(8)), (8, 24));
        // 8 + ⌊ln(n/8)/ln(16)·8⌋: n = 16 → 10, n = 127 → 15 (cap), n = 1000 → 15.
        assert_eq!((b(-16), b(-127), b(-1000), b(1000)), (10, 15, 15, 31));
    }

    #[test]
    fn softmax_rows_sum_to_one_and_masked_keys_vanish() {
        let x = Tensor::from_vec(vec![1.0, 2.0, 3.0, 0.5, f32::MIN, 0.5], &[2, 3]).unwrap();
        let p = softmax_last_dim(&x).unwrap().to_vec_f32().unwrap();
        let e = [1.0f32.exp(), 2.0f32.exp(), 3.0f32.exp()];
        let s: f32 = e.iter().sum();
        for (a, b) in p[..3].iter().zip(e.iter().map(|v| v / s)) {
            assert!((a - b).abs() < 1e-6);
        }
        assert_eq!(&p[3..], &[0.5, 0.0, 0.5]);
    }

    #[test]
    fn random_tiny_runs_and_padding_does_not_leak() {
        let c = T5Config::tiny();
        let enc = T5Encoder::random(&c, 3, DType::F32).unwrap();
        let ids = [5u32, 9, 17, 1];
        let alone = enc.forward(&ids, [1, 4], &[4]).unwrap();
        // The same prompt padded to 7 with garbage ids: its 4 valid rows must not change.
        let padded = enc
            .forward(&[5, 9, 17, 1, 0, 300, 7], [1, 7], &[4])
            .unwrap();
        let valid = padded.narrow(1, 0, 4).unwrap();
        ditstream_kernels::testing::assert_close(&valid, &alone, 1e-5, 1e-5);
        assert_eq!(alone.shape(), [1, 4, 64]);
        assert!(enc.forward(&[400], [1, 1], &[1]).is_err()); // id past the table
        assert!(enc.forward(&[1, 2], [1, 2], &[3]).is_err()); // length past S
    }
}
