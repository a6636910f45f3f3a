//! `T5Config`: the encoder's dimensions and variant, read from a transformers `config.json` the way
//! transformers' `T5Config` / `UMT5Config` read it, or from the built-in tiny preset.

use std::path::Path;

use serde_json::Value;

use super::TextError;

/// Which relative-position-bias layout the checkpoint has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum T5Variant {
    /// umT5 (`model_type: "umt5"`, Wan's text encoder): every layer has its own
    /// `relative_attention_bias`.
    UmT5,
    /// T5 / T5 v1.1 (`model_type: "t5"`): only layer 0 has one, and its bias is shared by every layer.
    T5,
}

/// The feed-forward activation (`dense_act_fn`, derived from `feed_forward_proj` as transformers does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum T5Activation {
    /// `gelu_new` / `gelu_pytorch_tanh`: GELU with the tanh approximation (what "gated-gelu" means).
    GeluTanh,
    /// `relu` (the original T5).
    Relu,
}

/// Dimensions and variant of a T5/umT5 encoder (transformers' field names).
#[derive(Debug, Clone, PartialEq)]
pub struct T5Config {
    /// umT5 (bias in every layer) or T5 (bias in layer 0, shared).
    pub variant: T5Variant,
    /// Vocabulary rows of the embedding table (`vocab_size`; may exceed the tokenizer's size).
    pub vocab_size: usize,
    /// Model width (`d_model`; 4096 for umT5-XXL).
    pub d_model: usize,
    /// Width of one attention head (`d_kv`; 64 for umT5-XXL). `num_heads · d_kv` need not be `d_model`.
    pub d_kv: usize,
    /// Attention heads (`num_heads`; 64 for umT5-XXL).
    pub num_heads: usize,
    /// Feed-forward width (`d_ff`; 10240 for umT5-XXL).
    pub d_ff: usize,
    /// Encoder layers (`num_layers`; 24 for umT5-XXL).
    pub num_layers: usize,
    /// Relative-position buckets (`relative_attention_num_buckets`; 32).
    pub num_buckets: usize,
    /// Distance beyond which relative positions share a bucket (`relative_attention_max_distance`; 128).
    pub max_distance: usize,
    /// T5LayerNorm epsilon (`layer_norm_epsilon`; 1e-6).
    pub layer_norm_eps: f32,
    /// Whether the feed-forward is gated (`feed_forward_proj` starting with `gated-`).
    pub gated: bool,
    /// The feed-forward activation.
    pub activation: T5Activation,
}

impl T5Config {
    /// The built-in tiny umT5 of the embedded default: width 64, 4 heads of 12 (inner width 48, so
    /// a mix-up of the two widths fails loudly), gated-GELU FFN of 96, 2 layers, 320 vocabulary rows
    /// (the embedded tokenizer has 209 tokens), Wan's 32 buckets / distance 128. The same dimensions as
    /// the `text_umt5` test fixture.
    pub fn tiny() -> Self {
        T5Config {
            variant: T5Variant::UmT5,
            vocab_size: 320,
            d_model: 64,
            d_kv: 12,
            num_heads: 4,
            d_ff: 96,
            num_layers: 2,
            num_buckets: 32,
            max_distance: 128,
            layer_norm_eps: 1e-6,
            gated: true,
            activation: T5Activation::GeluTanh,
        }
    }

    /// umT5-XXL, Wan's text encoder (`google/umt5-xxl`): width 4096, 64 heads of 64, FFN 10240,
    /// 24 layers, 256384 vocabulary rows. For random-weight benchmarks.
    pub fn umt5_xxl() -> Self {
        T5Config {
            variant: T5Variant::UmT5,
            vocab_size: 256_384,
            d_model: 4096,
            d_kv: 64,
            num_heads: 64,
            d_ff: 10240,
            num_layers: 24,
            num_buckets: 32,
            max_distance: 128,
            layer_norm_eps: 1e-6,
            gated: true,
            activation: T5Activation::GeluTanh,
        }
    }

    /// `num_heads · d_kv`: the width of q, k, v and of the attention output before `o`.
    pub fn inner_dim(&self) -> usize {
        self.num_heads * self.d_kv
    }

    /// Reads a transformers `config.json` (`T5EncoderModel` or `UMT5EncoderModel`). Errors name the
    /// file and the key.
    pub fn from_file(path: &Path) -> Result<Self, TextError> {
        let text = std::fs::read_to_string(path).map_err(|source| TextError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let json: Value = serde_json::from_str(&text).map_err(|e| TextError::Config {
            path: path.to_path_buf(),
            key: "(file)".into(),
            message: format!("not valid JSON: {e}"),
        })?;
        Self::from_json(&json, path)
    }

    /// Parses the config object; `path` is quoted in errors.
    pub fn from_json(json: &Value, path: &Path) -> Result<Self, TextError> {
        let err = |key: &str, message: String| TextError::Config {
            path: path.to_path_buf(),
            key: key.to_string(),
            message,
        };
        let usize_key = |key: &str, default: Option<usize>| -> Result<usize, TextError> {
            match json.get(key) {
                None | Some(Value::Null) => {
                    default.ok_or_else(|| err(key, "is missing (a positive integer)".into()))
                }
                Some(v) => match v.as_u64() {
                    Some(n) if n > 0 => Ok(n as usize),
                    _ => Err(err(key, format!("= {v}: must be a positive integer"))),
                },
            }
        };
        let model_type = json.get("model_type").and_then(Value::as_str);
        let variant = match model_type {
            Some("umt5") => T5Variant::UmT5,
            Some("t5") => T5Variant::T5,
            other => {
                return Err(err(
                    "model_type",
                    format!("= {other:?}: must be \"umt5\" or \"t5\""),
                ));
            }
        };
        let d_model = usize_key("d_model", None)?;
        let d_kv = usize_key("d_kv", None)?;
        let num_heads = usize_key("num_heads", None)?;
        let d_ff = usize_key("d_ff", None)?;
        let num_layers = usize_key("num_layers", None)?;
        let vocab_size = usize_key("vocab_size", None)?;
        let num_buckets = usize_key("relative_attention_num_buckets", Some(32))?;
        let max_distance = usize_key("relative_attention_max_distance", Some(128))?;
        if num_buckets < 4 {
            return Err(err(
                "relative_attention_num_buckets",
                format!(
                    "= {num_buckets}: must be at least 4 (two directions, exact and log buckets)"
                ),
            ));
        }
        let layer_norm_eps = match json.get("layer_norm_epsilon") {
            None | Some(Value::Null) => 1e-6,
            Some(v) => match v.as_f64() {
                Some(eps) if eps > 0.0 => eps as f32,
                _ => {
                    return Err(err(
                        "layer_norm_epsilon",
                        format!("= {v}: must be a positive number"),
                    ));
                }
            },
        };
        // transformers: `act_info = feed_forward_proj.split("-")`, gated if it starts with "gated",
        // `dense_act_fn = act_info[-1]`, and "gated-gelu" means `gelu_new` (the tanh approximation).
        // The T5 default is "relu", the umT5 default "gated-gelu".
        let default_proj = match variant {
            T5Variant::UmT5 => "gated-gelu",
            T5Variant::T5 => "relu",
        };
        let proj = match json.get("feed_forward_proj") {
            None | Some(Value::Null) => default_proj,
            Some(v) => v
                .as_str()
                .ok_or_else(|| err("feed_forward_proj", format!("= {v}: must be a string")))?,
        };
        let parts: Vec<&str> = proj.split('-').collect();
        let (gated, act_name) = match parts.as_slice() {
            [act] => (false, *act),
            ["gated", act] => (true, *act),
            _ => {
                return Err(err(
                    "feed_forward_proj",
                    format!("= {proj:?}: must be \"ACT\" or \"gated-ACT\""),
                ));
            }
        };
        let act_name = if proj == "gated-gelu" {
            "gelu_new"
        } else {
            act_name
        };
        let activation = match act_name {
            "gelu_new" | "gelu_pytorch_tanh" => T5Activation::GeluTanh,
            "relu" => T5Activation::Relu,
            other => {
                return Err(err(
                    "feed_forward_proj",
                    format!(
                        "= {proj:?}: activation {other:?} is not supported \
                         (gelu_new, gelu_pytorch_tanh, relu)"
                    ),
                ));
            }
        };
        Ok(T5Config {
            variant,
            vocab_size,
            d_model,
            d_kv,
            num_heads,
            d_ff,
            num_layers,
            num_buckets,
            max_distance,
            layer_norm_eps,
            gated,
            activation,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_wan_text_encoder_config() {
        // The fields of Wan2.1's `text_encoder/config.json` that matter.
        let json = serde_json::json!({
            "architectures": ["UMT5EncoderModel"], "d_ff": 10240, "d_kv": 64, "d_model": 4096,
            "dense_act_fn": "gelu_new", "feed_forward_proj": "gated-gelu", "is_gated_act": true,
            "layer_norm_epsilon": 1e-06, "model_type": "umt5", "num_heads": 64, "num_layers": 24,
            "relative_attention_max_distance": 128, "relative_attention_num_buckets": 32,
            "vocab_size": 256384
        });
        let c = T5Config::from_json(&json, Path::new("config.json")).unwrap();
        assert_eq!(c, T5Config::umt5_xxl());
    }

    #[test]
    fn rejects_bad_keys_by_name() {
        let base = serde_json::json!({"model_type": "t5", "d_model": 8, "d_kv": 4, "num_heads": 2,
                                       "d_ff": 16, "num_layers": 1, "vocab_size": 10});
        let c = T5Config::from_json(&base, Path::new("c.json")).unwrap();
        assert_eq!(
            (c.variant, c.gated, c.activation),
            (T5Variant::T5, false, T5Activation::Relu)
        );
        for (key, value) in [
            ("model_type", serde_json::json!("bert")),
            ("d_model", serde_json::json!(0)),
            ("feed_forward_proj", serde_json::json!("gated-silu")),
            ("feed_forward_proj", serde_json::json!("a-b-c")),
            ("layer_norm_epsilon", serde_json::json!("x")),
        ] {
            let mut j = base.clone();
            j[key] = value;
            let e = T5Config::from_json(&j, Path::new("c.json"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("c.json") && e.contains(key), "{e}");
        }
        let mut j = base.clone();
        j.as_object_mut().unwrap().remove("num_layers");
        let e = T5Config::from_json(&j, Path::new("c.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("num_layers") && e.contains("missing"), "{e}");
    }
}
