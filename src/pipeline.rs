//! The whole path in one process: text → denoise → decode chunk by chunk → encode → segments,
//! each event handed to a [`Sink`] the moment it exists. The models are built once from the
//! config; a request only allocates its own state.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, bail};
use ditstream_common::config::{
    Config, DeviceKind, EncoderKind, Preset, WeightSource as SourceKind,
};
use ditstream_decoder::encode::{
    EncoderBackend, OpenH264Options, RgbFrame, SegmentPlan, SegmentWriter, VideoParams,
    X264Options, encode_single_fragment, vae_output_to_rgb,
};
use ditstream_decoder::vae::{VaeConfig, WanVaeDecoder};
use ditstream_denoiser::denoise::{
    Control, DenoiseError, DenoiseParams, Experts, StepProgress, denoise, initial_noise,
};
use ditstream_denoiser::model::{WanConfig, WanTransformer};
use ditstream_denoiser::text::TextEncoder;
use ditstream_kernels::weights::RandomWeights;
use ditstream_kernels::{DType, Tensor};

use crate::engine::{Event, Phase, Segment, Timings, ms};
use crate::request::GenerateParams;

/// Why the pipeline stopped a request early.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Cancelled, or the client went away.
    Cancelled,
    /// The deadline passed.
    Deadline,
}

/// How a run ended badly.
#[derive(Debug)]
pub enum RunError {
    /// Stopped on request.
    Stopped(Stop),
    /// A stage failed.
    Failed(String),
}

impl<E: std::fmt::Display> From<E> for RunError
where
    E: Into<anyhow::Error>,
{
    fn from(e: E) -> RunError {
        RunError::Failed(format!("{:#}", e.into()))
    }
}

/// Where a run's events go; also says when to stop.
pub trait Sink {
    /// `Err` when the request should stop now.
    fn check(&mut self) -> Result<(), Stop>;
    /// Delivers an event; `Err` when the request should stop now.
    fn send(&mut self, event: Event) -> Result<(), Stop>;
}

/// A finished run's accounting (the engine fills in the first-segment and total times).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Done {
    /// Measured stage durations.
    pub timings: Timings,
    /// Video frames delivered.
    pub frames: u32,
    /// Media segments delivered.
    pub segments: u32,
}

/// The models of one served configuration.
pub struct Pipeline {
    name: String,
    text: TextEncoder,
    high: WanTransformer,
    /// Wan2.2-A14B's low-noise expert and its boundary ratio.
    low: Option<(WanTransformer, f64)>,
    vae: WanVaeDecoder,
    encoder: EncoderBackend,
    cfg: Config,
}

/// Seed of the built-in tiny model's random weights: fixed, so every run serves the same model.
const TINY_WEIGHT_SEED: u64 = 0;

impl Pipeline {
    /// Builds every model the config names (validated already).
    pub fn from_config(cfg: &Config) -> anyhow::Result<Pipeline> {
        if cfg.serving.device == DeviceKind::Cuda {
            bail!("serving.device = cuda: the CUDA backend is not built yet; use `device: cpu`");
        }
        let m = &cfg.model;
        let (name, text, high, low, vae) = match (m.weights, &m.checkpoint, m.preset) {
            (SourceKind::Random, _, Some(Preset::Tiny)) => {
                let weights = RandomWeights::new(TINY_WEIGHT_SEED);
                let dit =
                    WanTransformer::new(WanConfig::preset(Preset::Tiny), &weights, DType::F32)?;
                let vae = WanVaeDecoder::from_weights(tiny_vae_config(), &weights)?;
                (
                    "tiny".to_string(),
                    TextEncoder::tiny(TINY_WEIGHT_SEED)?,
                    dit,
                    None,
                    vae,
                )
            }
            (SourceKind::Random, _, Some(p)) => bail!(
                "model.preset = {p} with random weights: the CPU backend only runs `tiny` this way \
                 (the text encoder alone would be umT5-XXL); point model.checkpoint at a checkpoint"
            ),
            (SourceKind::Checkpoint, Some(dir), _) => load_checkpoint(dir)?,
            _ => bail!("model: validation should have refused this combination"),
        };
        if high.config().text_dim != text.d_model() {
            bail!(
                "the transformer's text_dim {} differs from the text encoder's width {}",
                high.config().text_dim,
                text.d_model()
            );
        }
        if high.config().in_channels != vae.config().z_dim {
            bail!(
                "the transformer's in_channels {} differ from the VAE's z_dim {}",
                high.config().in_channels,
                vae.config().z_dim
            );
        }
        let encoder = match cfg.serving.encoder {
            EncoderKind::Openh264 => EncoderBackend::OpenH264(OpenH264Options::default()),
            EncoderKind::X264 => EncoderBackend::X264(X264Options::default()),
        };
        // Fail at start-up, not on the first request, when the backend is not in this build.
        encoder
            .open(VideoParams {
                width: 16,
                height: 16,
                fps: 16,
            })
            .with_context(|| format!("serving.encoder = {:?}", cfg.serving.encoder))?;
        Ok(Pipeline {
            name,
            text,
            high,
            low,
            vae,
            encoder,
            cfg: cfg.clone(),
        })
    }

    /// The served model's name.
    pub fn model_name(&self) -> &str {
        &self.name
    }

    /// Runs one request, sending its progress and segments to `sink` as they exist.
    pub fn run(
        &self,
        p: &GenerateParams,
        accepted: Instant,
        sink: &mut dyn Sink,
    ) -> Result<Done, RunError> {
        let stopped = |s| RunError::Stopped(s);
        sink.check().map_err(stopped)?;
        let mut timings = Timings {
            queue_ms: ms(accepted.elapsed()),
            ..Timings::default()
        };

        sink.send(Event::Progress {
            phase: Phase::Text,
            done: 0,
            total: 1,
        })
        .map_err(stopped)?;
        let t = Instant::now();
        let (cond, uncond) = self.text_states(p)?;
        timings.text_ms = ms(t.elapsed());
        sink.send(Event::Progress {
            phase: Phase::Text,
            done: 1,
            total: 1,
        })
        .map_err(stopped)?;

        let t = Instant::now();
        let mut stop = None;
        let latent = self.denoise_latent(p, &cond, &uncond, |s| {
            let event = Event::Progress {
                phase: Phase::Denoise,
                done: s.step as u32,
                total: s.steps as u32,
            };
            match sink.send(event) {
                Ok(()) => Control::Continue,
                Err(s) => {
                    stop = Some(s);
                    Control::Cancel
                }
            }
        });
        let latent = match (latent, stop) {
            (Err(DenoiseError::Cancelled { .. }), Some(s)) => return Err(stopped(s)),
            (result, _) => result?,
        };
        timings.denoise_ms = ms(t.elapsed());

        // Decode one latent frame at a time (frame 0 → 1 video frame, then 4 each), encoding and
        // sending every segment as soon as its last frame exists.
        let mut writer = SegmentWriter::new(&self.encoder, Self::video_params(p), Self::plan(p)?)?;
        let init = Event::Init {
            data: writer.init_segment().to_vec(),
            mime_type: writer.mime_type(),
        };
        sink.send(init).map_err(stopped)?;
        let (lt, lh, lw) = (latent.shape()[2], latent.shape()[3], latent.shape()[4]);
        let mut stream = self.vae.new_stream(lh, lw)?;
        let (mut frames, mut segments) = (0u32, 0u32);
        for chunk in 0..lt {
            sink.check().map_err(stopped)?;
            let t = Instant::now();
            let decoded = self
                .vae
                .decode_chunk(&mut stream, &latent.narrow(2, chunk, 1)?)?;
            timings.decode_ms += ms(t.elapsed());
            let t = Instant::now();
            let rgb = to_rgb(&decoded)?;
            let mut ready = Vec::new();
            for frame in &rgb {
                ready.extend(writer.push_frame(frame)?);
            }
            if chunk + 1 == lt {
                ready.extend(writer.finish()?);
            }
            timings.encode_ms += ms(t.elapsed());
            frames += rgb.len() as u32;
            for seg in ready {
                segments += 1;
                sink.send(Event::Segment(Segment {
                    sequence_number: seg.sequence_number,
                    first_frame: seg.first_frame as u32,
                    frame_count: seg.frame_count,
                    data: seg.bytes,
                }))
                .map_err(stopped)?;
            }
            let total = p.num_frames as u32;
            sink.send(Event::Progress {
                phase: Phase::Decode,
                done: frames,
                total,
            })
            .map_err(stopped)?;
        }
        Ok(Done {
            timings,
            frames,
            segments,
        })
    }

    /// The non-streamed path, for reference: the whole latent decoded at once, then every frame
    /// encoded into a single-fragment MP4 with the same keyframes. Streaming must produce the
    /// same pictures.
    pub fn render_whole(&self, p: &GenerateParams) -> anyhow::Result<Vec<u8>> {
        let (cond, uncond) = self.text_states(p)?;
        let latent = self.denoise_latent(p, &cond, &uncond, |_| Control::Continue)?;
        let frames = to_rgb(&self.vae.decode(&latent)?)?;
        Ok(encode_single_fragment(
            &self.encoder,
            Self::video_params(p),
            Self::plan(p)?,
            &frames,
        )?)
    }

    /// Prompt and negative prompt, encoded in one batch (repeats come from the cache):
    /// each [1, 512, text_dim].
    fn text_states(&self, p: &GenerateParams) -> anyhow::Result<(Tensor, Tensor)> {
        let embeds = self.text.encode(&[&p.prompt, &p.negative_prompt])?;
        Ok((
            embeds.states.narrow(0, 0, 1)?,
            embeds.states.narrow(0, 1, 1)?,
        ))
    }

    /// The denoised latent [1, C, T, H/8, W/8] from the request's seed.
    fn denoise_latent(
        &self,
        p: &GenerateParams,
        cond: &Tensor,
        uncond: &Tensor,
        on_step: impl FnMut(StepProgress) -> Control,
    ) -> Result<Tensor, DenoiseError> {
        let spatial = self.vae.config().spatial_scale();
        let (lt, lh, lw) = (
            (p.num_frames - 1) / 4 + 1,
            p.height / spatial,
            p.width / spatial,
        );
        let noise = initial_noise([1, self.high.config().in_channels, lt, lh, lw], p.seed)?;
        let params = DenoiseParams {
            sampler: self.cfg.sampler.kind,
            steps: p.steps,
            shift: self.cfg.sampler.shift,
            guidance_scale: p.guidance_scale,
            guidance_scale_2: p.guidance_scale_2,
        };
        let experts = Experts {
            high: &self.high,
            low: self.low.as_ref().map(|(m, b)| (m, *b)),
        };
        denoise(experts, &params, noise, cond, Some(uncond), on_step)
    }

    fn video_params(p: &GenerateParams) -> VideoParams {
        VideoParams {
            width: p.width as u32,
            height: p.height as u32,
            fps: p.fps,
        }
    }

    /// Frame 0 alone (the first picture leaves as soon as latent frame 0 is decoded), then
    /// `segment_frames` each.
    fn plan(p: &GenerateParams) -> anyhow::Result<SegmentPlan> {
        Ok(SegmentPlan::new(1, p.segment_frames as u32)?)
    }
}

/// VAE output [1, 3, F, H, W] in [−1, 1] → RGB frames.
fn to_rgb(video: &Tensor) -> anyhow::Result<Vec<RgbFrame>> {
    let s = video.shape();
    Ok(vae_output_to_rgb(
        &video.to_vec_f32()?,
        s[1],
        s[2],
        s[3],
        s[4],
    )?)
}

/// The built-in tiny model's VAE: the Wan 2.1 VAE topology at base width 16 (the real one is 96),
/// so decoding a short clip takes seconds on two cores.
fn tiny_vae_config() -> VaeConfig {
    VaeConfig {
        base_dim: 16,
        ..VaeConfig::wan21()
    }
}

type Loaded = (
    String,
    TextEncoder,
    WanTransformer,
    Option<(WanTransformer, f64)>,
    WanVaeDecoder,
);

/// A diffusers Wan checkpoint folder: `transformer/` (and `transformer_2/` with the
/// `boundary_ratio` of `model_index.json` for Wan2.2-A14B), `text_encoder/`, `tokenizer/`, `vae/`.
fn load_checkpoint(dir: &Path) -> anyhow::Result<Loaded> {
    let high = WanTransformer::from_dir(&dir.join("transformer"), DType::F32)?;
    let low = if dir.join("transformer_2").is_dir() {
        let index = dir.join("model_index.json");
        let text = std::fs::read_to_string(&index)
            .with_context(|| format!("reading {}", index.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", index.display()))?;
        let boundary = json
            .get("boundary_ratio")
            .and_then(serde_json::Value::as_f64)
            .with_context(|| {
                format!(
                    "{}: transformer_2/ exists but boundary_ratio is not a number",
                    index.display()
                )
            })?;
        Some((
            WanTransformer::from_dir(&dir.join("transformer_2"), DType::F32)?,
            boundary,
        ))
    } else {
        None
    };
    let text = TextEncoder::from_pretrained(dir, 512)?;
    let vae = WanVaeDecoder::load(&dir.join("vae"))?;
    let name = dir.file_name().map_or_else(
        || dir.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    Ok((name, text, high, low, vae))
}
