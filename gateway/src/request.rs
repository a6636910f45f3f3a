//! A generation request in domain terms, with the server's defaults filled in and every limit
//! checked. The gRPC layer converts to and from this; nothing below it sees wire types.

use ditstream_common::config::Config;
use ditstream_decoder::stage::MAX_SEGMENT_FRAMES;

/// A validated request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateParams {
    /// The prompt (non-empty).
    pub prompt: String,
    /// The negative prompt (the server's default when the client sent none).
    pub negative_prompt: String,
    /// Width in pixels (multiple of 16).
    pub width: usize,
    /// Height in pixels (multiple of 16).
    pub height: usize,
    /// Frames (4k+1).
    pub num_frames: usize,
    /// Output frame rate.
    pub fps: u32,
    /// Denoising steps.
    pub steps: usize,
    /// CFG scale.
    pub guidance_scale: f64,
    /// CFG scale of a low-noise expert.
    pub guidance_scale_2: Option<f64>,
    /// Initial-noise seed.
    pub seed: u64,
    /// Frames per media segment after the first.
    pub segment_frames: usize,
}

/// What a client asked for, before defaults and limits (`None` and an empty negative prompt or
/// model mean "the server's default").
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RawRequest {
    /// Prompt.
    pub prompt: String,
    /// Negative prompt.
    pub negative_prompt: String,
    /// Width.
    pub width: Option<u32>,
    /// Height.
    pub height: Option<u32>,
    /// Frames.
    pub num_frames: Option<u32>,
    /// Frames per second.
    pub fps: Option<u32>,
    /// Steps.
    pub steps: Option<u32>,
    /// CFG scale.
    pub guidance_scale: Option<f64>,
    /// Low-noise CFG scale.
    pub guidance_scale_2: Option<f64>,
    /// Seed.
    pub seed: Option<u64>,
    /// Model name.
    pub model: String,
    /// Segment length.
    pub segment_frames: Option<u32>,
}

/// A request broke a rule: names the field, the value and the rule (becomes INVALID_ARGUMENT).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} = {value}: {rule}")]
pub struct InvalidRequest {
    /// The request field.
    pub field: &'static str,
    /// The value sent.
    pub value: String,
    /// The rule.
    pub rule: String,
}

fn invalid(
    field: &'static str,
    value: impl std::fmt::Display,
    rule: impl Into<String>,
) -> InvalidRequest {
    InvalidRequest {
        field,
        value: value.to_string(),
        rule: rule.into(),
    }
}

/// The negative prompt of the Wan pipelines, used when a request sends none.
pub const DEFAULT_NEGATIVE_PROMPT: &str = "Bright tones, overexposed, static, blurred details, subtitles, style, works, \
paintings, images, static, overall gray, worst quality, low quality, JPEG compression residue, ugly, incomplete, extra \
fingers, poorly drawn hands, poorly drawn faces, deformed, disfigured, misshapen limbs, fused fingers, still picture, \
messy background, three legs, many people in the background, walking backwards";

impl RawRequest {
    /// Fills defaults from `cfg` and checks every limit. `model_name` is the served model.
    pub fn validate(
        &self,
        cfg: &Config,
        model_name: &str,
    ) -> Result<GenerateParams, InvalidRequest> {
        let s = &cfg.serving;
        if self.prompt.trim().is_empty() {
            return Err(invalid("prompt", "\"\"", "must not be empty"));
        }
        if self.prompt.len() > s.max_prompt_bytes {
            return Err(invalid(
                "prompt",
                format!("({} bytes)", self.prompt.len()),
                format!("must be at most {} bytes", s.max_prompt_bytes),
            ));
        }
        if self.negative_prompt.len() > s.max_prompt_bytes {
            return Err(invalid(
                "negative_prompt",
                format!("({} bytes)", self.negative_prompt.len()),
                format!("must be at most {} bytes", s.max_prompt_bytes),
            ));
        }
        if !self.model.is_empty() && self.model != model_name {
            return Err(invalid(
                "model",
                ditstream_common::status::shown(&self.model),
                format!("unknown; this server runs {model_name:?}"),
            ));
        }
        let or = |v: Option<u32>, d: usize| v.map_or(d, |v| v as usize);
        let (width, height) = (or(self.width, s.width), or(self.height, s.height));
        let g = cfg.geometry();
        let m = g.pixel_multiple();
        for (field, side) in [("width", width), ("height", height)] {
            if side == 0 || side % m != 0 || side > s.max_side {
                return Err(invalid(
                    field,
                    side,
                    format!("must be a positive multiple of {m} up to {}", s.max_side),
                ));
            }
        }
        let num_frames = or(self.num_frames, s.num_frames);
        if !g.frames_fit(num_frames) || num_frames > s.max_frames {
            return Err(invalid(
                "num_frames",
                num_frames,
                format!(
                    "must be {t}k+1 (1, {}, {}, …) and at most {}",
                    g.temporal + 1,
                    2 * g.temporal + 1,
                    s.max_frames,
                    t = g.temporal
                ),
            ));
        }
        let steps = or(self.steps, cfg.sampler.steps);
        if steps == 0 || steps > s.max_steps {
            return Err(invalid(
                "steps",
                steps,
                format!("must be in 1..={}", s.max_steps),
            ));
        }
        let fps = self.fps.unwrap_or(s.fps);
        if fps == 0 || fps > 240 {
            return Err(invalid("fps", fps, "must be in 1..=240"));
        }
        let guidance_scale = self.guidance_scale.unwrap_or(cfg.sampler.guidance_scale);
        for (field, g) in [
            ("guidance_scale", Some(guidance_scale)),
            ("guidance_scale_2", self.guidance_scale_2),
        ] {
            if let Some(g) = g
                && !(g.is_finite() && (0.0..=100.0).contains(&g))
            {
                return Err(invalid(field, g, "must be a number in [0, 100]"));
            }
        }
        let segment_frames = self.segment_frames.unwrap_or(4);
        if segment_frames == 0 || segment_frames > MAX_SEGMENT_FRAMES {
            return Err(invalid(
                "segment_frames",
                segment_frames,
                format!("must be in 1..={MAX_SEGMENT_FRAMES}"),
            ));
        }
        let negative_prompt = if self.negative_prompt.is_empty() {
            DEFAULT_NEGATIVE_PROMPT.to_string()
        } else {
            self.negative_prompt.clone()
        };
        Ok(GenerateParams {
            prompt: self.prompt.clone(),
            negative_prompt,
            width,
            height,
            num_frames,
            fps,
            steps,
            guidance_scale,
            guidance_scale_2: self.guidance_scale_2.or(cfg.sampler.guidance_scale_2),
            seed: self.seed.unwrap_or_else(random_seed),
            segment_frames: segment_frames as usize,
        })
    }
}

/// A seed for requests that did not fix one.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    // RandomState is seeded from the OS per process; mixing in the time varies it per call.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config::parse("model:\n  preset: tiny\n", "<t>").unwrap()
    }

    fn check(r: RawRequest) -> Result<GenerateParams, String> {
        r.validate(&cfg(), "tiny").map_err(|e| e.to_string())
    }

    fn req() -> RawRequest {
        RawRequest {
            prompt: "a cat".into(),
            ..RawRequest::default()
        }
    }

    #[test]
    fn defaults_fill_in() {
        let p = check(RawRequest {
            seed: Some(3),
            ..req()
        })
        .unwrap();
        assert_eq!(
            (p.width, p.height, p.num_frames, p.steps, p.fps, p.seed),
            (832, 480, 81, 50, 16, 3)
        );
        assert_eq!(p.negative_prompt, DEFAULT_NEGATIVE_PROMPT);
        assert_eq!(p.segment_frames, 4);
    }

    #[test]
    fn each_limit_names_its_field() {
        assert_eq!(
            check(RawRequest::default()).unwrap_err(),
            "prompt = \"\": must not be empty"
        );
        assert_eq!(
            check(RawRequest {
                width: Some(7),
                height: Some(7),
                ..req()
            })
            .unwrap_err(),
            "width = 7: must be a positive multiple of 16 up to 1920"
        );
        assert_eq!(
            check(RawRequest {
                num_frames: Some(80),
                ..req()
            })
            .unwrap_err(),
            "num_frames = 80: must be 4k+1 (1, 5, 9, …) and at most 241"
        );
        assert_eq!(
            check(RawRequest {
                steps: Some(1000),
                ..req()
            })
            .unwrap_err(),
            "steps = 1000: must be in 1..=100"
        );
        assert_eq!(
            check(RawRequest {
                num_frames: Some(0),
                ..req()
            })
            .unwrap_err(),
            "num_frames = 0: must be 4k+1 (1, 5, 9, …) and at most 241"
        );
        assert_eq!(
            check(RawRequest {
                model: "sora".into(),
                ..req()
            })
            .unwrap_err(),
            "model = \"sora\": unknown; this server runs \"tiny\""
        );
        // A megabyte of model name is not echoed back whole.
        let e = check(RawRequest {
            model: "m".repeat(1 << 20),
            ..req()
        })
        .unwrap_err();
        assert!(
            e.ends_with("… (1048576 bytes): unknown; this server runs \"tiny\""),
            "{e}"
        );
        assert!(e.len() < 200, "{} bytes", e.len());
        assert_eq!(
            check(RawRequest {
                guidance_scale: Some(f64::NAN),
                ..req()
            })
            .unwrap_err(),
            "guidance_scale = NaN: must be a number in [0, 100]"
        );
        assert!(
            check(RawRequest {
                prompt: "x".repeat(9000),
                ..req()
            })
            .unwrap_err()
            .starts_with("prompt = (9000 bytes)")
        );
    }
}
