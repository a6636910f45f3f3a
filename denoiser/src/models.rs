//! The models a denoiser pool runs, built from the config: the transformer(s) (a diffusers
//! checkpoint folder, or seeded random weights of a preset), one copy per device, shared by the
//! ranks of one device; and the text encoder on rank 0's device.
//!
//! Random weights of a real-size preset are drawn ahead on every host core (one tensor per task:
//! drawing is per tensor and single-threaded, about a minute per billion weights on one core) and
//! then uploaded to each GPU, so every rank gets the same model. The CPU runs only the built-in
//! `tiny` model this way; a GPU runs any preset.

use std::path::Path;
use std::sync::Arc;

use ditstream_common::config::{Config, Dtype, WeightSource as SourceKind};
use ditstream_common::devices::{WEIGHT_SEED, check_random_on, distinct, dtype, on_each, per_rank};
use ditstream_kernels::weights::DrawnWeights;
use ditstream_kernels::{DType, Device};

use crate::error::StageError;
use crate::model::{ModelError, WanConfig, WanTransformer};
use crate::text::{PromptTokenizer, T5Config, T5Encoder, TextEncoder, WAN_MAX_LEN};

/// Seed of Wan2.2-A14B's low-noise expert with random weights (another model than the high one).
const LOW_EXPERT_SEED: u64 = 1;
/// Boundary ratio of Wan2.2-T2V-A14B (its `model_index.json`): the low-noise expert takes the
/// steps with t < 0.875·1000.
const A14B_BOUNDARY_RATIO: f64 = 0.875;

/// The built-in tokenizer (209 tokens; the one `TextEncoder::tiny` embeds), which the random
/// real-size text encoder uses too: without a checkpoint there is no umT5 tokenizer.
const BUILT_IN_TOKENIZER_JSON: &[u8] =
    include_bytes!("../tests/fixtures/text_umt5/tokenizer/tokenizer.json");

/// The transformer(s) one device runs: Wan 2.1's one, or Wan2.2-A14B's two experts.
pub struct DenoiserModels {
    /// Every step for Wan 2.1; the high-noise steps for A14B.
    pub high: WanTransformer,
    /// A14B's low-noise expert and its boundary ratio.
    pub low: Option<(WanTransformer, f64)>,
}

/// One copy of the transformer(s) per rank, on the rank's device; ranks that share a device (the
/// CPU's threads) share one copy.
pub fn denoiser_models(
    cfg: &Config,
    devices: &[Device],
) -> Result<Vec<Arc<DenoiserModels>>, StageError> {
    let dtype = dtype(cfg);
    let m = &cfg.model;
    // `model.dtype: fp8` quantises the blocks' linears of each copy on its device, once built,
    // and runs their self-attention in FP8 where the kernel exists (Hopper, head dim 128; on Ada
    // the attention stays bf16).
    let precision = |t: WanTransformer| match m.dtype {
        Dtype::Fp8 => {
            let t = t.with_fp8_linears()?;
            Ok::<_, ModelError>(
                match fp8_attention_on(t.device(), t.config().attention_head_dim) {
                    true => t.with_fp8_attention(),
                    false => t,
                },
            )
        }
        Dtype::F32 | Dtype::Bf16 => Ok(t),
    };
    let distinct = distinct(devices);
    let copies: Vec<DenoiserModels> = match (m.weights, &m.checkpoint, m.preset) {
        (SourceKind::Random, _, Some(preset)) => {
            check_random_on(preset, devices)?;
            let config = WanConfig::preset(preset);
            let high = DrawnWeights::draw(WEIGHT_SEED, |ws| {
                WanTransformer::new(config.clone(), ws, dtype, Device::Cpu).map(drop)
            })?;
            let low = match preset.spec().experts {
                2 => Some(DrawnWeights::draw(LOW_EXPERT_SEED, |ws| {
                    WanTransformer::new(config.clone(), ws, dtype, Device::Cpu).map(drop)
                })?),
                _ => None,
            };
            on_each(&distinct, |device| {
                Ok::<_, ModelError>(DenoiserModels {
                    high: precision(WanTransformer::new(config.clone(), &high, dtype, device)?)?,
                    low: match &low {
                        Some(low) => Some((
                            precision(WanTransformer::new(config.clone(), low, dtype, device)?)?,
                            A14B_BOUNDARY_RATIO,
                        )),
                        None => None,
                    },
                })
            })?
        }
        (SourceKind::Checkpoint, Some(dir), _) => {
            let boundary = low_expert_boundary(dir)?;
            on_each(&distinct, |device| {
                Ok::<_, ModelError>(DenoiserModels {
                    high: precision(WanTransformer::from_dir(
                        &dir.join("transformer"),
                        dtype,
                        device,
                    )?)?,
                    low: match boundary {
                        Some(b) => Some((
                            precision(WanTransformer::from_dir(
                                &dir.join("transformer_2"),
                                dtype,
                                device,
                            )?)?,
                            b,
                        )),
                        None => None,
                    },
                })
            })?
        }
        _ => return Err(StageError::unvalidated(m)),
    };
    Ok(per_rank(devices, &distinct, copies))
}

/// Whether `model.dtype: fp8` runs the self-attention in FP8 on `device` at `head_dim` (the
/// kernel's GPUs and head dim; the CPU has no FP8 model), with a warning where it does not.
fn fp8_attention_on(device: Device, head_dim: usize) -> bool {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(ordinal) = device {
        let on =
            ditstream_kernels::cuda::supports_fp8_attention(ordinal, head_dim).unwrap_or(false);
        if !on {
            tracing::warn!(
                "model.dtype = fp8: no FP8 attention kernel for head dim {head_dim} on {device} \
                 (it needs sm_90a and head dim 128); the self-attention stays bf16"
            );
        }
        return on;
    }
    let _ = (device, head_dim);
    false
}

/// The text encoder, on `device` (the denoiser mesh's rank 0; each rank moves the states to its
/// own device): the checkpoint's umT5 with its tokenizer; the built-in tiny one, which stays on
/// the host in f32 whatever the device (it is tiny, and its states are then exactly the CPU run's);
/// or for a random real-size preset (GPU only) umT5-XXL at its real size, drawn on the GPU
/// ([`T5Encoder::random`]: well under a second there, minutes on one host core), with the built-in
/// tokenizer, there being no umT5 tokenizer without a checkpoint.
pub fn text_encoder(cfg: &Config, device: Device) -> Result<TextEncoder, StageError> {
    let m = &cfg.model;
    // The CPU computes in f32 (bf16 weights would be widened on every call).
    let text_dtype = match device {
        Device::Cpu => DType::F32,
        Device::Cuda(_) => dtype(cfg),
    };
    Ok(match (m.weights, &m.checkpoint, m.preset) {
        (SourceKind::Random, _, Some(preset)) if preset.spec().tiny_text_encoder => {
            TextEncoder::tiny(WEIGHT_SEED)?
        }
        (SourceKind::Random, _, Some(preset)) => {
            check_random_on(preset, &[device])?;
            let tokenizer = PromptTokenizer::from_json_bytes(
                BUILT_IN_TOKENIZER_JSON,
                WAN_MAX_LEN,
                "<built-in tiny tokenizer>",
            )?;
            let started = std::time::Instant::now();
            let encoder =
                T5Encoder::random(&T5Config::umt5_xxl(), WEIGHT_SEED, text_dtype, device)?;
            tracing::info!(
                seconds = started.elapsed().as_secs_f64(),
                %device,
                "random umT5-XXL drawn"
            );
            TextEncoder::new(tokenizer, encoder)?
        }
        (SourceKind::Checkpoint, Some(dir), _) => {
            TextEncoder::from_pretrained_on(dir, WAN_MAX_LEN, text_dtype, device)?
        }
        _ => return Err(StageError::unvalidated(m)),
    })
}

/// The transformer dimensions the config serves: a preset's, or the checkpoint's
/// `transformer/config.json` (the high-noise expert's, for Wan2.2-A14B: both have the same).
pub fn transformer_config(cfg: &Config) -> Result<WanConfig, StageError> {
    let m = &cfg.model;
    match (m.weights, &m.checkpoint, m.preset) {
        (SourceKind::Random, _, Some(preset)) => Ok(WanConfig::preset(preset)),
        (SourceKind::Checkpoint, Some(dir), _) => {
            Ok(WanConfig::from_dir(&dir.join("transformer"))?)
        }
        _ => Err(StageError::unvalidated(m)),
    }
}

/// The boundary ratio of a Wan2.2-A14B checkpoint's low-noise expert (`transformer_2/` and the
/// `boundary_ratio` of `model_index.json`), or `None` for a single-transformer checkpoint.
fn low_expert_boundary(dir: &Path) -> Result<Option<f64>, StageError> {
    if !dir.join("transformer_2").is_dir() {
        return Ok(None);
    }
    let index = dir.join("model_index.json");
    let text = match std::fs::read_to_string(&index) {
        Ok(text) => text,
        Err(source) => {
            return Err(StageError::ReadIndex {
                path: index,
                source,
            });
        }
    };
    let json: serde_json::Value = match serde_json::from_str(&text) {
        Ok(json) => json,
        Err(source) => {
            return Err(StageError::ParseIndex {
                path: index,
                source,
            });
        }
    };
    match json
        .get("boundary_ratio")
        .and_then(serde_json::Value::as_f64)
    {
        Some(boundary) => Ok(Some(boundary)),
        None => Err(StageError::BoundaryRatio { path: index }),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use ditstream_common::config::Preset;
    use ditstream_kernels::Tensor;
    use ditstream_kernels::weights::RandomWeights;

    use super::*;

    #[test]
    fn drawn_ahead_equals_drawn_one_by_one() {
        let cfg = WanConfig::preset(Preset::Tiny);
        let drawn = DrawnWeights::draw(3, |ws| {
            WanTransformer::new(cfg.clone(), ws, DType::F32, Device::Cpu).map(drop)
        })
        .unwrap();
        let (a, b) = (
            WanTransformer::new(cfg.clone(), &drawn, DType::F32, Device::Cpu).unwrap(),
            WanTransformer::new(cfg.clone(), &RandomWeights::new(3), DType::F32, Device::Cpu)
                .unwrap(),
        );
        let x = Tensor::randn(&[1, cfg.in_channels, 1, 4, 4], DType::F32, 1, Device::Cpu).unwrap();
        let t = Tensor::from_vec(vec![500.0], &[1]).unwrap();
        let ctx = Tensor::randn(&[1, 3, cfg.text_dim], DType::F32, 2, Device::Cpu).unwrap();
        assert_eq!(
            a.forward(&x, &t, &ctx).unwrap().to_vec_f32().unwrap(),
            b.forward(&x, &t, &ctx).unwrap().to_vec_f32().unwrap(),
            "a model from weights drawn ahead equals one drawn one by one"
        );
    }

    #[test]
    fn real_size_random_presets_need_a_gpu() {
        let cfg = Config::parse("model:\n  preset: wan2.1-t2v-1.3b\n", "<t>").unwrap();
        let e = denoiser_models(&cfg, &[Device::Cpu]).err().unwrap();
        assert!(
            format!("{e:#}").contains("the CPU backend only runs `tiny` this way"),
            "{e:#}"
        );
    }
}
