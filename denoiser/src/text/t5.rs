//! The T5 / umT5 encoder stack (transformers' `T5EncoderModel` / `UMT5EncoderModel`), forward only:
//! token embedding, then per block a pre-norm self-attention with a learned relative-position bias and
//! a pre-norm (gated) feed-forward, each added to the residual, then a final norm.
//!
//! Three T5 particulars, each checked against transformers in `tests/text_encoder.rs`:
//! - Attention logits are **not** scaled by 1/√d (T5 folds the scale into the q initialisation) and get
//!   an additive bias `bias[h, bucket(key − query)]`. The kernels' fused
//!   [`attention`](ditstream_kernels::attention) has neither a bias input nor a mask on top of one, so
//!   attention is `matmul` (QKᵀ, batched over B·H) → [`position_bias_softmax`] (bias, padding mask and
//!   softmax in one pass) → `matmul` (PV).
//! - The norms are T5LayerNorm: RMS without mean subtraction or bias, in f32 — the kernels' `rms_norm`.
//! - umT5 has a bias table in every layer; T5 in layer 0 only, reused by the later layers.
//!
//! Devices and precision: the weights are put on the encoder's device in its dtype once, at
//! construction, and every op of the forward runs there; only the token ids, the relative-position
//! buckets (a function of the length alone, see [`relative_position_bucket`]) and the valid lengths are
//! made on the host and copied over, once per forward. Activations are stored in the weights' dtype, as
//! transformers' bf16 model keeps its hidden states in bf16; every op computes in f32 (the QKᵀ logits
//! are stored in that dtype too, then the softmax reads them in f32, as transformers'
//! `softmax(scores.float())`).
//!
//! Padding: keys at or past a row's valid length get `f32::MIN` added to their logits (transformers'
//! `create_bidirectional_mask` value), so their softmax weight is exactly 0 and the valid rows equal
//! those of an unpadded run.

use ditstream_kernels::weights::{Checkpoint, WeightSource};
use ditstream_kernels::{
    DType, Device, Indices, Tensor, add, embedding, linear, matmul, position_bias_softmax,
    random_normal, rms_norm,
};

use super::TextError;
use super::config::{T5Activation, T5Config, T5Variant};

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

/// Self-attention of one block (`layer.0.SelfAttention`).
struct SelfAttention {
    /// q, k, v: [inner, d_model]; o: [d_model, inner].
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    /// `relative_attention_bias.weight` [num_buckets, heads], if this layer owns one.
    relative_bias: Option<Tensor>,
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

/// A T5/umT5 encoder: weights (on one device, in one dtype) and config.
pub struct T5Encoder {
    config: T5Config,
    dtype: DType,
    device: Device,
    /// `shared.weight` [vocab, d_model].
    embedding: Tensor,
    blocks: Vec<Block>,
    final_norm: Tensor,
}

/// The per-forward index lists the attention needs, on the encoder's device.
struct AttentionIndices {
    /// Bucket of relative position k − q at index k − q + S − 1, [2S − 1].
    buckets: Indices,
    /// Valid keys per batch row, [B].
    valid_lens: Indices,
}

impl T5Encoder {
    /// Loads the encoder of a transformers checkpoint folder (`config.json` plus `model.safetensors`
    /// or a sharded `model.safetensors.index.json`), with the checkpoint's tensor names
    /// (`shared.weight`, `encoder.block.{i}.layer.0.SelfAttention.q.weight`, …), each checked for
    /// presence and shape, stored as `dtype` on `device` (bf16 and f16 checkpoints widen to f32 exactly).
    pub fn from_dir(
        dir: &std::path::Path,
        dtype: DType,
        device: Device,
    ) -> Result<Self, TextError> {
        let config = T5Config::from_file(&dir.join("config.json"))?;
        let checkpoint = Checkpoint::open_dir(dir, "model")?;
        Self::from_checkpoint(config, &checkpoint, dtype, device)
    }

    fn from_checkpoint(
        config: T5Config,
        ckpt: &Checkpoint,
        dtype: DType,
        device: Device,
    ) -> Result<Self, TextError> {
        let (d, inner, ff) = (config.d_model, config.inner_dim(), config.d_ff);
        // Each tensor goes to the device as it is read, so a large model never needs a second host copy.
        let get = |name: &str, shape: &[usize]| -> Result<Tensor, TextError> {
            Ok(ckpt.tensor(name, shape, dtype)?.to_device(device)?)
        };
        // The embedding is tied: checkpoints save it as `shared.weight`, some also or only as
        // `encoder.embed_tokens.weight`.
        let embedding_name = if ckpt.shape("shared.weight").is_some() {
            "shared.weight"
        } else if ckpt.shape("encoder.embed_tokens.weight").is_some() {
            "encoder.embed_tokens.weight"
        } else {
            "shared.weight"
        };
        let embedding = get(embedding_name, &[config.vocab_size, d])?;
        let mut blocks = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let p = format!("encoder.block.{i}.layer");
            let has_bias = match config.variant {
                T5Variant::UmT5 => true,
                T5Variant::T5 => i == 0,
            };
            let relative_bias = if has_bias {
                let name = format!("{p}.0.SelfAttention.relative_attention_bias.weight");
                Some(get(&name, &[config.num_buckets, config.num_heads])?)
            } else {
                None
            };
            let ffn = if config.gated {
                FeedForward {
                    wi_0: get(&format!("{p}.1.DenseReluDense.wi_0.weight"), &[ff, d])?,
                    wi_1: Some(get(&format!("{p}.1.DenseReluDense.wi_1.weight"), &[ff, d])?),
                    wo: get(&format!("{p}.1.DenseReluDense.wo.weight"), &[d, ff])?,
                }
            } else {
                FeedForward {
                    wi_0: get(&format!("{p}.1.DenseReluDense.wi.weight"), &[ff, d])?,
                    wi_1: None,
                    wo: get(&format!("{p}.1.DenseReluDense.wo.weight"), &[d, ff])?,
                }
            };
            blocks.push(Block {
                attn_norm: get(&format!("{p}.0.layer_norm.weight"), &[d])?,
                attn: SelfAttention {
                    q: get(&format!("{p}.0.SelfAttention.q.weight"), &[inner, d])?,
                    k: get(&format!("{p}.0.SelfAttention.k.weight"), &[inner, d])?,
                    v: get(&format!("{p}.0.SelfAttention.v.weight"), &[inner, d])?,
                    o: get(&format!("{p}.0.SelfAttention.o.weight"), &[d, inner])?,
                    relative_bias,
                },
                ffn_norm: get(&format!("{p}.1.layer_norm.weight"), &[d])?,
                ffn,
            });
        }
        let final_norm = get("encoder.final_layer_norm.weight", &[d])?;
        Ok(T5Encoder {
            config,
            dtype,
            device,
            embedding,
            blocks,
            final_norm,
        })
    }

    /// Seeded random weights of `config`'s size, scaled like transformers' initialisation (so that
    /// activations stay O(1)): embedding N(0, 1), q N(0, 1/(d·d_kv)), k/v N(0, 1/d), o N(0, 1/inner),
    /// wi N(0, 1/d), wo N(0, 1/d_ff), bias tables N(0, 1), norms 1 + N(0, 0.1²), stored as `dtype` on
    /// `device`. Each tensor draws from its own stream `seed·1000 + k` with
    /// [`random_normal`], on the device itself: umT5-XXL's 5.7 B
    /// values take well under a second on a GPU, where a host draw and upload would take minutes. The
    /// CPU draw is bit for bit the one the tiny built-in model has always had.
    pub fn random(
        config: &T5Config,
        seed: u64,
        dtype: DType,
        device: Device,
    ) -> Result<Self, TextError> {
        let (d, inner, ff) = (config.d_model, config.inner_dim(), config.d_ff);
        let mut stream = 0u64;
        let mut draw = |shape: &[usize], std: f32, mean: f32| -> Result<Tensor, TextError> {
            stream += 1;
            let stream_seed = seed.wrapping_mul(1000).wrapping_add(stream);
            Ok(random_normal(shape, mean, std, dtype, stream_seed, device)?)
        };
        let embedding = draw(&[config.vocab_size, d], 1.0, 0.0)?;
        let mut blocks = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let has_bias = config.variant == T5Variant::UmT5 || i == 0;
            let relative_bias = if has_bias {
                Some(draw(&[config.num_buckets, config.num_heads], 1.0, 0.0)?)
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
            dtype,
            device,
            embedding,
            blocks,
            final_norm,
        })
    }

    /// The model's dimensions.
    pub fn config(&self) -> &T5Config {
        &self.config
    }

    /// Where the weights live and the forward runs.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The storage dtype of the weights and the activations.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Last hidden states of a right-padded batch.
    ///
    /// ids `[B·S]` row-major token ids with `shape = [B, S]`; valid_lens `[B]` (each ≤ S): keys at
    /// positions ≥ `valid_lens[b]` are masked (transformers' attention_mask of 1s then 0s)
    /// → [B, S, d_model] in the encoder's dtype, on its device. Padded rows are computed too, as
    /// transformers computes them.
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
        // The host's part: three small index lists, one copy each.
        let ids = Indices::new(ids, c.vocab_size, "token id", self.device)?;
        let lens: Vec<u32> = valid_lens.iter().map(|&l| l as u32).collect();
        let index = AttentionIndices {
            buckets: Indices::new(
                &relative_buckets(seq, c.num_buckets, c.max_distance),
                c.num_buckets,
                "relative-position bucket",
                self.device,
            )?,
            valid_lens: Indices::new(&lens, seq + 1, "valid length", self.device)?,
        };

        let mut x = embedding(&self.embedding, &ids)?.reshape(&[batch, seq, c.d_model])?;
        let mut table = None;
        for block in &self.blocks {
            // umT5: every layer has its own table; T5: layer 0's serves the rest.
            if let Some(own) = &block.attn.relative_bias {
                table = Some(own);
            }
            let Some(table) = table else {
                return Err(TextError::Input {
                    message: "the first encoder block has no relative_attention_bias".into(),
                });
            };
            let h = rms_norm(&x, &block.attn_norm, c.layer_norm_eps)?;
            let h = self.self_attention(&block.attn, &h, table, &index, batch, seq)?;
            x = add(&x, &h)?;
            let h = rms_norm(&x, &block.ffn_norm, c.layer_norm_eps)?;
            let h = self.feed_forward(&block.ffn, &h)?;
            x = add(&x, &h)?;
        }
        Ok(rms_norm(&x, &self.final_norm, c.layer_norm_eps)?)
    }

    /// x [B, S, d_model] (normed) → attention output projected by `o`, [B, S, d_model]; `table` is the
    /// relative-position bias [num_buckets, heads] in force for this layer.
    fn self_attention(
        &self,
        attn: &SelfAttention,
        x: &Tensor,
        table: &Tensor,
        index: &AttentionIndices,
        batch: usize,
        seq: usize,
    ) -> Result<Tensor, TextError> {
        let (heads, d_kv) = (self.config.num_heads, self.config.d_kv);
        let split_heads = |w: &Tensor| -> Result<Tensor, TextError> {
            Ok(linear(x, w, None)?.reshape(&[batch, seq, heads, d_kv])?)
        };
        let q = split_heads(&attn.q)?.permute(&[0, 2, 1, 3])?; // [B, H, S, d_kv]
        let k_t = split_heads(&attn.k)?.permute(&[0, 2, 3, 1])?; // [B, H, d_kv, S]
        let v = split_heads(&attn.v)?.permute(&[0, 2, 1, 3])?; // [B, H, S, d_kv]
        // No 1/√d_kv: T5 does not scale its logits.
        let logits = matmul(&q, &k_t)?; // [B, H, S, S]
        let weights = position_bias_softmax(&logits, table, &index.buckets, &index.valid_lens)?;
        let out =
            matmul(&weights, &v)?
                .permute(&[0, 2, 1, 3])?
                .reshape(&[batch, seq, heads * d_kv])?;
        Ok(linear(&out, &attn.o, None)?)
    }

    /// x [B, S, d_model] (normed) → wo(act(wi_0 x) · wi_1 x) (gated) or wo(act(wi x)), same shape.
    fn feed_forward(&self, ffn: &FeedForward, x: &Tensor) -> Result<Tensor, TextError> {
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

/// bucket(r) for every relative position r = k − q of a length-`seq` sequence, r = −(S − 1) ..= S − 1
/// at index r + S − 1: [2S − 1] (empty for S = 0). The layout [`position_bias_softmax`] reads.
pub fn relative_buckets(seq: usize, num_buckets: usize, max_distance: usize) -> Vec<u32> {
    let s = seq as i64;
    (1 - s..s)
        .map(|r| relative_position_bucket(r, num_buckets, max_distance) as u32)
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
        // The layout the softmax reads: index r + S − 1.
        assert_eq!(relative_buckets(3, 32, 128), [2, 1, 0, 17, 18]);
        assert!(relative_buckets(0, 32, 128).is_empty());
    }

    #[test]
    fn random_tiny_runs_and_padding_does_not_leak() {
        let c = T5Config::tiny();
        let enc = T5Encoder::random(&c, 3, DType::F32, Device::Cpu).unwrap();
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
