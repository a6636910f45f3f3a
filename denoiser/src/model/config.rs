//! The Wan transformer's dimensions: read from a diffusers checkpoint's `transformer/config.json`,
//! or from a built-in preset.

use std::path::Path;

use ditstream_common::config::Preset;
use serde::Deserialize;

use super::ModelError;

/// `WanTransformer3DModel`'s config (diffusers names). [`WanConfig::from_dir`] refuses keys that
/// `WanTransformer3DModel` does not have (a typo or another model's config); values it cannot run are
/// refused by [`WanConfig::check`].
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct WanConfig {
    /// Patch size (t, h, w); Wan uses (1, 2, 2).
    pub patch_size: [usize; 3],
    /// Attention heads.
    pub num_attention_heads: usize,
    /// Head dimension (128 in every Wan model).
    pub attention_head_dim: usize,
    /// Latent channels in.
    pub in_channels: usize,
    /// Latent channels out.
    pub out_channels: usize,
    /// Text-encoder width (4096 for umT5-XXL).
    pub text_dim: usize,
    /// Timestep sinusoid width.
    pub freq_dim: usize,
    /// Feed-forward width.
    pub ffn_dim: usize,
    /// Transformer blocks.
    pub num_layers: usize,
    /// Whether cross-attention normalises its input (LayerNorm with affine).
    #[serde(default = "yes")]
    pub cross_attn_norm: bool,
    /// q/k normalisation; only `rms_norm_across_heads` is used by Wan.
    #[serde(default)]
    pub qk_norm: Option<String>,
    /// Epsilon of every norm.
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Image-conditioning width (I2V checkpoints only).
    #[serde(default)]
    pub image_dim: Option<usize>,
    /// Extra K/V projection width for image tokens (I2V checkpoints only).
    #[serde(default)]
    pub added_kv_proj_dim: Option<usize>,
}

/// Every option of diffusers' `WanTransformer3DModel` (0.42.1). `rope_max_seq_len` and
/// `pos_embed_seq_len` have no effect here: RoPE tables are built for the grid at hand, and
/// `pos_embed_seq_len` belongs to image conditioning, refused by [`WanConfig::check`].
const KNOWN_FIELDS: &[&str] = &[
    "patch_size",
    "num_attention_heads",
    "attention_head_dim",
    "in_channels",
    "out_channels",
    "text_dim",
    "freq_dim",
    "ffn_dim",
    "num_layers",
    "cross_attn_norm",
    "qk_norm",
    "eps",
    "image_dim",
    "added_kv_proj_dim",
    "rope_max_seq_len",
    "pos_embed_seq_len",
];

fn yes() -> bool {
    true
}

fn default_eps() -> f64 {
    1e-6
}

impl WanConfig {
    /// The dimensions of a built-in preset (its row of [`Preset::spec`]'s table). `tiny` is the
    /// embedded default: 2 heads of dim 128 (so it runs the real kernels' shapes), 2 layers.
    pub fn preset(preset: Preset) -> WanConfig {
        let spec = preset.spec();
        WanConfig {
            patch_size: [1, 2, 2],
            num_attention_heads: spec.heads,
            attention_head_dim: 128,
            in_channels: spec.latent_channels,
            out_channels: spec.latent_channels,
            text_dim: spec.text_dim,
            freq_dim: 256,
            ffn_dim: spec.ffn_dim,
            num_layers: spec.layers,
            cross_attn_norm: true,
            qk_norm: Some("rms_norm_across_heads".to_string()),
            eps: 1e-6,
            image_dim: None,
            added_kv_proj_dim: None,
        }
    }

    /// Reads `config.json` from a diffusers transformer folder and checks it.
    pub fn from_dir(dir: &Path) -> Result<WanConfig, ModelError> {
        let path = dir.join("config.json");
        let error = |message: String| ModelError::Config {
            path: path.clone(),
            message,
        };
        let text = std::fs::read_to_string(&path).map_err(|e| error(e.to_string()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| error(e.to_string()))?;
        let Some(fields) = json.as_object() else {
            return Err(error("not a JSON object".to_string()));
        };
        // diffusers' bookkeeping keys start with `_`; everything else must be an option of
        // WanTransformer3DModel (the ones read above, and those with no effect here).
        if let Some(unknown) = fields
            .keys()
            .find(|k| !k.starts_with('_') && !KNOWN_FIELDS.contains(&k.as_str()))
        {
            return Err(error(format!(
                "unknown field `{unknown}`: WanTransformer3DModel has no such option"
            )));
        }
        let cfg: WanConfig = serde_json::from_value(json).map_err(|e| error(e.to_string()))?;
        cfg.check()
            .map_err(|message| ModelError::Config { path, message })?;
        Ok(cfg)
    }

    /// Refuses what this implementation cannot run, naming the key.
    pub fn check(&self) -> Result<(), String> {
        if self.image_dim.is_some() || self.added_kv_proj_dim.is_some() {
            return Err("image_dim/added_kv_proj_dim are set: image-to-video checkpoints are not supported yet".into());
        }
        if let Some(norm) = &self.qk_norm
            && norm != "rms_norm_across_heads"
        {
            return Err(format!(
                "qk_norm = {norm:?}: only \"rms_norm_across_heads\" is supported"
            ));
        }
        if self.patch_size[0] != 1 || self.patch_size[1] == 0 || self.patch_size[2] == 0 {
            return Err(format!(
                "patch_size = {:?}: must be (1, ph, pw)",
                self.patch_size
            ));
        }
        if !self.attention_head_dim.is_multiple_of(2) || self.attention_head_dim < 6 {
            return Err(format!(
                "attention_head_dim = {}: must be even and at least 6 (3-D RoPE)",
                self.attention_head_dim
            ));
        }
        if !self.freq_dim.is_multiple_of(2) {
            return Err(format!("freq_dim = {}: must be even", self.freq_dim));
        }
        Ok(())
    }

    /// Model width D = heads × head_dim.
    pub fn dim(&self) -> usize {
        self.num_attention_heads * self.attention_head_dim
    }
}
