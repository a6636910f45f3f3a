//! The VAE a decoder instance runs, built from the config: the checkpoint's `vae/`, Wan 2.1's at
//! its real size with seeded random weights, or the built-in tiny one; one copy per device, shared
//! by the ranks of one device.

use std::sync::Arc;

use ditstream_common::config::{Config, PresetVae, WeightSource as SourceKind};
use ditstream_common::devices::{WEIGHT_SEED, check_random_on, distinct, dtype, on_each, per_rank};
use ditstream_kernels::Device;
use ditstream_kernels::weights::DrawnWeights;

use crate::error::StageError;
use crate::vae::{VaeConfig, WanVaeDecoder};

/// The VAE the config serves: its preset's (tiny or Wan 2.1's), or the checkpoint's
/// `vae/config.json`.
pub fn vae_config(cfg: &Config) -> Result<VaeConfig, StageError> {
    let m = &cfg.model;
    match (m.weights, &m.checkpoint, m.preset) {
        (SourceKind::Random, _, Some(preset)) => match preset.spec().vae {
            PresetVae::Tiny => Ok(tiny_vae_config()),
            PresetVae::Wan21 => Ok(VaeConfig::wan21()),
            PresetVae::Wan22 => Err(StageError::UnbuiltVae { preset }),
        },
        (SourceKind::Checkpoint, Some(dir), _) => {
            Ok(VaeConfig::from_file(&dir.join("vae").join("config.json"))?)
        }
        _ => Err(StageError::unvalidated(m)),
    }
}

/// One VAE decoder per rank, on the rank's device; ranks that share a device share one.
pub fn vae_decoders(
    cfg: &Config,
    devices: &[Device],
) -> Result<Vec<Arc<WanVaeDecoder>>, StageError> {
    let dtype = dtype(cfg);
    let m = &cfg.model;
    let distinct = distinct(devices);
    let copies = match (m.weights, &m.checkpoint, m.preset) {
        (SourceKind::Random, _, Some(preset)) => {
            check_random_on(preset, devices)?;
            let config = vae_config(cfg)?;
            let drawn = DrawnWeights::draw(WEIGHT_SEED, |ws| {
                WanVaeDecoder::from_weights_on(config.clone(), ws, Device::Cpu, dtype).map(drop)
            })?;
            on_each(&distinct, |device| {
                WanVaeDecoder::from_weights_on(config.clone(), &drawn, device, dtype)
            })?
        }
        (SourceKind::Checkpoint, Some(dir), _) => on_each(&distinct, |device| {
            WanVaeDecoder::load_on(&dir.join("vae"), device, dtype)
        })?,
        _ => return Err(StageError::unvalidated(m)),
    };
    Ok(per_rank(devices, &distinct, copies))
}

/// The built-in tiny model's VAE: the Wan 2.1 VAE topology at base width 16 (the real one is 96),
/// so decoding a short clip takes seconds on two cores.
fn tiny_vae_config() -> VaeConfig {
    VaeConfig {
        base_dim: 16,
        ..VaeConfig::wan21()
    }
}
