//! The VAE's `config.json` (diffusers `AutoencoderKLWan`): parsing with every key known, validation
//! that names the key, the value and the rule, and the layout the decoder derives from it.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::error::{Result, VaeError};

/// Wan 2.1's per-channel latent mean (diffusers' default `latents_mean`).
pub const WAN21_LATENTS_MEAN: [f32; 16] = [
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517,
    -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
];

/// Wan 2.1's per-channel latent std (diffusers' default `latents_std`).
pub const WAN21_LATENTS_STD: [f32; 16] = [
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579,
    1.6382, 1.1253, 2.8251, 1.9160,
];

/// `config.json` as diffusers writes it: every `AutoencoderKLWan.__init__` argument (diffusers 0.42.1),
/// with diffusers' defaults for keys older checkpoints omit, plus the bookkeeping keys. Any other key is
/// an error (`deny_unknown_fields`) rather than silently ignored.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(rename = "_class_name", default)]
    class_name: Option<String>,
    #[serde(rename = "_diffusers_version", default)]
    _diffusers_version: Option<String>,
    #[serde(rename = "_name_or_path", default)]
    _name_or_path: Option<String>,
    #[serde(default = "default_base_dim")]
    base_dim: usize,
    #[serde(default)]
    decoder_base_dim: Option<usize>,
    #[serde(default = "default_z_dim")]
    z_dim: usize,
    #[serde(default = "default_dim_mult")]
    dim_mult: Vec<usize>,
    #[serde(default = "default_num_res_blocks")]
    num_res_blocks: usize,
    /// The decoder never reads it (diffusers passes it on but `WanDecoder3d` uses no attention outside the
    /// mid block); kept so real configs parse.
    #[serde(rename = "attn_scales", default)]
    _attn_scales: Vec<f64>,
    #[serde(default = "default_temperal_downsample")]
    temperal_downsample: Vec<bool>,
    /// Inference ignores dropout.
    #[serde(rename = "dropout", default)]
    _dropout: f64,
    #[serde(default = "default_latents_mean")]
    latents_mean: Vec<f32>,
    #[serde(default = "default_latents_std")]
    latents_std: Vec<f32>,
    #[serde(default)]
    is_residual: bool,
    /// The encoder's input channels; the decoder does not read it.
    #[serde(rename = "in_channels", default = "default_three")]
    _in_channels: usize,
    #[serde(default = "default_three")]
    out_channels: usize,
    #[serde(default)]
    patch_size: Option<usize>,
    #[serde(default)]
    scale_factor_temporal: Option<usize>,
    #[serde(default)]
    scale_factor_spatial: Option<usize>,
}

fn default_base_dim() -> usize {
    96
}
fn default_z_dim() -> usize {
    16
}
fn default_dim_mult() -> Vec<usize> {
    vec![1, 2, 4, 4]
}
fn default_num_res_blocks() -> usize {
    2
}
fn default_temperal_downsample() -> Vec<bool> {
    vec![false, true, true]
}
fn default_latents_mean() -> Vec<f32> {
    WAN21_LATENTS_MEAN.to_vec()
}
fn default_latents_std() -> Vec<f32> {
    WAN21_LATENTS_STD.to_vec()
}
fn default_three() -> usize {
    3
}

/// The validated decoder configuration (Wan 2.1 family: `is_residual = false`, no patchify).
#[derive(Debug, Clone, PartialEq)]
pub struct VaeConfig {
    /// Base channel width of the decoder (`decoder_base_dim`, or `base_dim` when that is null).
    pub base_dim: usize,
    /// Latent channels (16 for Wan 2.1).
    pub z_dim: usize,
    /// Channel multipliers, encoder order (the decoder walks them reversed).
    pub dim_mult: Vec<usize>,
    /// Residual blocks per encoder stage; each decoder up block has one more.
    pub num_res_blocks: usize,
    /// Per decoder up stage (length `dim_mult.len() − 1`): whether it also doubles time
    /// (diffusers `temperal_upsample` = `temperal_downsample` reversed).
    pub temporal_upsample: Vec<bool>,
    /// Video channels out (3).
    pub out_channels: usize,
    /// Per-channel latent mean (`z_dim` values).
    pub latents_mean: Vec<f32>,
    /// Per-channel latent std (`z_dim` values).
    pub latents_std: Vec<f32>,
}

/// Fixed layout of one decoder up block, derived from the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpBlockLayout {
    /// Channels into the first residual block.
    pub in_dim: usize,
    /// Channels of the residual blocks' outputs.
    pub out_dim: usize,
    /// The upsampler after the residual blocks, if any.
    pub upsample: Option<UpsampleMode>,
}

/// How an up block's `WanResample` grows the video.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpsampleMode {
    /// ×2 in H and W (diffusers `upsample2d`).
    Spatial,
    /// ×2 in H and W, and time doubled by `time_conv` (diffusers `upsample3d`).
    SpatioTemporal,
}

impl VaeConfig {
    /// Reads and validates `config.json`. Errors name the file and the key.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| VaeError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json(&text, path)
    }

    /// Parses and validates config JSON; `path` is only quoted in errors.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let raw: RawConfig =
            serde_json::from_str(text).map_err(|source| VaeError::ConfigParse {
                path: path.to_path_buf(),
                source,
            })?;
        raw.validate(path)
    }

    /// diffusers' `AutoencoderKLWan` defaults: the Wan 2.1 VAE (base 96, z 16, [1, 2, 4, 4], 2 blocks).
    pub fn wan21() -> Self {
        VaeConfig {
            base_dim: 96,
            z_dim: 16,
            dim_mult: vec![1, 2, 4, 4],
            num_res_blocks: 2,
            temporal_upsample: vec![true, true, false],
            out_channels: 3,
            latents_mean: WAN21_LATENTS_MEAN.to_vec(),
            latents_std: WAN21_LATENTS_STD.to_vec(),
        }
    }

    /// How much the VAE compresses: (space, time) = (2 per up stage with an upsampler, 2 per
    /// temporal upsampler): (8, 4) for the Wan 2.1 VAE.
    pub fn scale_factors(&self) -> (usize, usize) {
        let spatial = 1 << self.dim_mult.len().saturating_sub(1);
        let temporal = 1 << self.temporal_upsample.iter().filter(|&&t| t).count();
        (spatial, temporal)
    }

    /// Decoder channel widths: base · [m_last, m_last, .., m_0] (e.g. 96·[4, 4, 4, 2, 1]).
    pub fn decoder_dims(&self) -> Vec<usize> {
        let last = self.dim_mult.last().copied().unwrap_or(1);
        std::iter::once(last)
            .chain(self.dim_mult.iter().rev().copied())
            .map(|m| self.base_dim * m)
            .collect()
    }

    /// The up blocks in order (`decoder.up_blocks.{i}`), following `WanDecoder3d.__init__`: block i > 0
    /// gets in_dim halved (Wan 2.1's upsampler outputs C/2); the last block has no upsampler.
    pub fn up_blocks(&self) -> Vec<UpBlockLayout> {
        let dims = self.decoder_dims();
        let stages = self.dim_mult.len();
        (0..stages)
            .map(|i| {
                let in_dim = if i > 0 { dims[i] / 2 } else { dims[i] };
                let upsample = (i + 1 != stages).then(|| {
                    if self.temporal_upsample[i] {
                        UpsampleMode::SpatioTemporal
                    } else {
                        UpsampleMode::Spatial
                    }
                });
                UpBlockLayout {
                    in_dim,
                    out_dim: dims[i + 1],
                    upsample,
                }
            })
            .collect()
    }

    /// Video pixels per latent pixel along H and W (8 for Wan 2.1).
    pub fn spatial_scale(&self) -> usize {
        1 << self.temporal_upsample.len()
    }

    /// Video frames per later latent frame (4 for Wan 2.1); latent frame 0 always gives 1 frame.
    pub fn temporal_scale(&self) -> usize {
        1 << self.temporal_upsample.iter().filter(|&&t| t).count()
    }

    /// Video frames decoded from `latent_frames` latent frames: 1 + scale·(T − 1) (0 for 0).
    pub fn video_frames(&self, latent_frames: usize) -> usize {
        match latent_frames {
            0 => 0,
            t => 1 + self.temporal_scale() * (t - 1),
        }
    }
}

impl RawConfig {
    fn validate(self, path: &Path) -> Result<VaeConfig> {
        let bad = |key: &'static str, value: String, rule: String| VaeError::ConfigValue {
            path: PathBuf::from(path),
            key,
            value,
            rule,
        };
        if let Some(class) = &self.class_name
            && class != "AutoencoderKLWan"
        {
            return Err(bad(
                "_class_name",
                format!("{class:?}"),
                "this loader reads AutoencoderKLWan checkpoints".into(),
            ));
        }
        if self.is_residual {
            return Err(bad(
                "is_residual",
                "true".into(),
                "the residual (Wan 2.2) VAE decoder is not supported yet; only Wan 2.1 (false)"
                    .into(),
            ));
        }
        if let Some(p) = self.patch_size
            && p != 1
        {
            return Err(bad(
                "patch_size",
                p.to_string(),
                "patchified (Wan 2.2) VAEs are not supported yet; only null or 1".into(),
            ));
        }
        let base_dim = self.decoder_base_dim.unwrap_or(self.base_dim);
        if base_dim == 0 {
            let key = if self.decoder_base_dim.is_some() {
                "decoder_base_dim"
            } else {
                "base_dim"
            };
            return Err(bad(key, "0".into(), "it must be ≥ 1".into()));
        }
        if self.z_dim == 0 {
            return Err(bad("z_dim", "0".into(), "it must be ≥ 1".into()));
        }
        if self.out_channels == 0 {
            return Err(bad("out_channels", "0".into(), "it must be ≥ 1".into()));
        }
        if self.dim_mult.is_empty() || self.dim_mult.contains(&0) {
            return Err(bad(
                "dim_mult",
                format!("{:?}", self.dim_mult),
                "it must be non-empty with every multiplier ≥ 1".into(),
            ));
        }
        let stages = self.dim_mult.len() - 1;
        if self.temperal_downsample.len() != stages {
            return Err(bad(
                "temperal_downsample",
                format!("{:?}", self.temperal_downsample),
                format!(
                    "it needs one entry per resampling stage: len(dim_mult) − 1 = {stages} \
                     (dim_mult {:?})",
                    self.dim_mult
                ),
            ));
        }
        for (key, values) in [
            ("latents_mean", &self.latents_mean),
            ("latents_std", &self.latents_std),
        ] {
            if values.len() != self.z_dim {
                return Err(bad(
                    key,
                    format!("{} values", values.len()),
                    format!(
                        "it needs one value per latent channel (z_dim = {})",
                        self.z_dim
                    ),
                ));
            }
        }
        let temporal_upsample: Vec<bool> = self.temperal_downsample.iter().rev().copied().collect();
        let config = VaeConfig {
            base_dim,
            z_dim: self.z_dim,
            dim_mult: self.dim_mult,
            num_res_blocks: self.num_res_blocks,
            temporal_upsample,
            out_channels: self.out_channels,
            latents_mean: self.latents_mean,
            latents_std: self.latents_std,
        };
        // Wan 2.1 halves the channels at every upsampler: each must keep at least one channel.
        for (i, block) in config.up_blocks().iter().enumerate() {
            if block.in_dim == 0 || (block.upsample.is_some() && block.out_dim / 2 == 0) {
                return Err(bad(
                    "dim_mult",
                    format!("{:?} with base_dim {base_dim}", config.dim_mult),
                    format!(
                        "up block {i} would have 0 channels after halving (out_dim {})",
                        block.out_dim
                    ),
                ));
            }
        }
        // These only size diffusers' tiling, but a value that disagrees with the topology means the
        // config describes some other model.
        if let Some(s) = self.scale_factor_spatial
            && s != config.spatial_scale()
        {
            return Err(bad(
                "scale_factor_spatial",
                s.to_string(),
                format!(
                    "the decoder's {stages} upsampling stages give {}",
                    config.spatial_scale()
                ),
            ));
        }
        if let Some(t) = self.scale_factor_temporal
            && t != config.temporal_scale()
        {
            return Err(bad(
                "scale_factor_temporal",
                t.to_string(),
                format!(
                    "temperal_downsample {:?} gives {}",
                    self.temperal_downsample,
                    config.temporal_scale()
                ),
            ));
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wan21_vae_compresses_8x_in_space_and_4x_in_time() {
        assert_eq!(VaeConfig::wan21().scale_factors(), (8, 4));
        let three_stages = VaeConfig {
            dim_mult: vec![1, 2, 4],
            temporal_upsample: vec![true, false],
            ..VaeConfig::wan21()
        };
        assert_eq!(three_stages.scale_factors(), (4, 2));
    }

    fn parse(json: &str) -> Result<VaeConfig> {
        VaeConfig::from_json(json, Path::new("vae/config.json"))
    }

    #[test]
    fn wan21_layout_matches_the_reference_table() {
        let config = VaeConfig::wan21();
        assert_eq!(config.decoder_dims(), [384, 384, 384, 192, 96]);
        let blocks = config.up_blocks();
        let summary: Vec<_> = blocks
            .iter()
            .map(|b| (b.in_dim, b.out_dim, b.upsample))
            .collect();
        use UpsampleMode::*;
        assert_eq!(
            summary,
            [
                (384, 384, Some(SpatioTemporal)),
                (192, 384, Some(SpatioTemporal)),
                (192, 192, Some(Spatial)),
                (96, 96, None),
            ]
        );
        assert_eq!((config.spatial_scale(), config.temporal_scale()), (8, 4));
        assert_eq!(config.video_frames(21), 81);
        assert_eq!(config.video_frames(1), 1);
    }

    #[test]
    fn hub_wan21_config_parses() -> Result<()> {
        // The key set of Wan-AI/Wan2.1-T2V-1.3B-Diffusers' vae/config.json (older diffusers: no
        // is_residual, patch_size, scale factors).
        let config = parse(
            r#"{"_class_name": "AutoencoderKLWan", "_diffusers_version": "0.33.0.dev0",
                "attn_scales": [], "base_dim": 96, "dim_mult": [1, 2, 4, 4], "dropout": 0.0,
                "num_res_blocks": 2, "temperal_downsample": [false, true, true], "z_dim": 16}"#,
        )?;
        assert_eq!(config, VaeConfig::wan21());
        assert_eq!(parse("{}")?, VaeConfig::wan21()); // diffusers' defaults
        Ok(())
    }

    #[test]
    fn bad_configs_name_the_key() {
        let cases = [
            (r#"{"clip_output": false}"#, "clip_output"),
            (r#"{"is_residual": true}"#, "is_residual"),
            (r#"{"patch_size": 2}"#, "patch_size"),
            (r#"{"z_dim": 48}"#, "latents_mean"),
            (r#"{"temperal_downsample": [true]}"#, "temperal_downsample"),
            (r#"{"dim_mult": [1, 0]}"#, "dim_mult"),
            (r#"{"base_dim": 1, "dim_mult": [1, 1, 1, 1]}"#, "dim_mult"),
            (r#"{"scale_factor_spatial": 16}"#, "scale_factor_spatial"),
            (r#"{"_class_name": "AutoencoderKL"}"#, "_class_name"),
        ];
        for (json, key) in cases {
            let err = parse(json).expect_err(json).to_string();
            assert!(
                err.contains(key) && err.contains("vae/config.json"),
                "{json}: {err}"
            );
        }
    }
}
