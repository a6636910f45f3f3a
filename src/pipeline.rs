//! The path from text to segments, in two halves that the pools own separately:
//! [`DenoiseStage`] (text encoder and transformer(s): prompt → latent) and [`DecodeStage`] (VAE
//! and H.264 encoder: latent chunks → fragmented-MP4 segments). [`Pipeline`] joins them in one
//! process for `ditstream serve`; the denoiser and decoder pools each build one half.
//!
//! The models are built once from the config; a request only allocates its own state.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use ditstream_common::collectives::cpu::{CpuComm, CpuRank, CpuWorld};
use ditstream_common::config::{
    Config, DeviceKind, EncoderKind, Preset, SamplerConfig, VaeSplitDim, WeightSource as SourceKind,
};
use ditstream_common::mesh::Mesh;
use ditstream_decoder::encode::{
    EncoderBackend, MediaSegment, OpenH264Options, RgbFrame, SegmentPlan, SegmentWriter,
    VideoParams, X264Options, encode_single_fragment, vae_output_to_rgb,
};
use ditstream_decoder::parallel::{ParallelDecodeStream, ParallelVaeDecoder};
use ditstream_decoder::vae::{DecodeStream, VaeConfig, WanVaeDecoder};
use ditstream_denoiser::denoise::{
    Control, DenoiseError, DenoiseParams, Experts, StepProgress, denoise, initial_noise,
};
use ditstream_denoiser::model::{WanConfig, WanTransformer};
use ditstream_denoiser::parallel::{self, MeshComms, ParallelError, check_mesh};
use ditstream_denoiser::text::TextEncoder;
use ditstream_kernels::weights::RandomWeights;
use ditstream_kernels::{DType, Device, Tensor};

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

/// Seed of the built-in tiny model's random weights: fixed, so every process of a deployment
/// (gateway, denoiser and decoder pools) serves the same model.
const TINY_WEIGHT_SEED: u64 = 0;

/// The model name a config serves: the preset, or the checkpoint folder's name.
pub fn model_name(cfg: &Config) -> String {
    match (&cfg.model.checkpoint, cfg.model.weights) {
        (Some(dir), SourceKind::Checkpoint) => dir.file_name().map_or_else(
            || dir.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        ),
        _ => cfg
            .model
            .preset
            .map_or_else(|| "?".to_string(), |p| p.name().to_string()),
    }
}

fn check_device(cfg: &Config) -> anyhow::Result<()> {
    if cfg.serving.device == DeviceKind::Cuda {
        bail!("serving.device = cuda: the CUDA backend is not built yet; use `device: cpu`");
    }
    Ok(())
}

/// The denoiser pool's half: text encoder and transformer(s), run on the config's mesh.
pub struct DenoiseStage {
    text: TextEncoder,
    high: WanTransformer,
    /// Wan2.2-A14B's low-noise expert and its boundary ratio.
    low: Option<(WanTransformer, f64)>,
    sampler: SamplerConfig,
    /// cfg × cp × ulysses ranks; on the CPU each rank is a thread.
    mesh: Mesh,
}

impl DenoiseStage {
    /// Builds the text encoder and transformer(s) the config names (validated already).
    pub fn from_config(cfg: &Config) -> anyhow::Result<DenoiseStage> {
        check_device(cfg)?;
        let m = &cfg.model;
        let (text, high, low) = match (m.weights, &m.checkpoint, m.preset) {
            (SourceKind::Random, _, Some(Preset::Tiny)) => {
                let weights = RandomWeights::new(TINY_WEIGHT_SEED);
                let dit = WanTransformer::new(
                    WanConfig::preset(Preset::Tiny),
                    &weights,
                    DType::F32,
                    Device::Cpu,
                )?;
                (TextEncoder::tiny(TINY_WEIGHT_SEED)?, dit, None)
            }
            (SourceKind::Random, _, Some(p)) => bail!(
                "model.preset = {p} with random weights: the CPU backend only runs `tiny` this way \
                 (the text encoder alone would be umT5-XXL); point model.checkpoint at a checkpoint"
            ),
            (SourceKind::Checkpoint, Some(dir), _) => load_denoiser_checkpoint(dir)?,
            _ => bail!("model: validation should have refused this combination"),
        };
        if high.config().text_dim != text.d_model() {
            bail!(
                "the transformer's text_dim {} differs from the text encoder's width {}",
                high.config().text_dim,
                text.d_model()
            );
        }
        let mesh = cfg.validate(None)?;
        check_mesh(&mesh, high.config(), mesh.world_size())?;
        Ok(DenoiseStage {
            text,
            high,
            low,
            sampler: cfg.sampler.clone(),
            mesh,
        })
    }

    /// The mesh the loop runs on.
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// Latent channels (the transformer's `in_channels`).
    pub fn latent_channels(&self) -> usize {
        self.high.config().in_channels
    }

    /// Prompt and negative prompt, encoded in one batch (repeats come from the cache):
    /// each [1, 512, text_dim].
    pub fn text_states(&self, p: &GenerateParams) -> anyhow::Result<(Tensor, Tensor)> {
        let embeds = self.text.encode(&[&p.prompt, &p.negative_prompt])?;
        Ok((
            embeds.states.narrow(0, 0, 1)?,
            embeds.states.narrow(0, 1, 1)?,
        ))
    }

    /// The denoised latent [1, C, T, H/8, W/8] from the request's seed.
    pub fn denoise_latent(
        &self,
        p: &GenerateParams,
        cond: &Tensor,
        uncond: &Tensor,
        on_step: impl FnMut(StepProgress) -> Control,
    ) -> Result<Tensor, DenoiseError> {
        let (lt, lh, lw) = latent_grid(p);
        let noise = initial_noise([1, self.latent_channels(), lt, lh, lw], p.seed)?;
        let params = DenoiseParams {
            sampler: self.sampler.kind,
            steps: p.steps,
            shift: self.sampler.shift,
            guidance_scale: p.guidance_scale,
            guidance_scale_2: p.guidance_scale_2,
        };
        let experts = Experts {
            high: &self.high,
            low: self.low.as_ref().map(|(m, b)| (m, *b)),
        };
        if self.mesh.world_size() == 1 {
            return denoise(experts, &params, noise, cond, Some(uncond), on_step);
        }
        self.denoise_on_mesh(experts, &params, noise, cond, uncond, on_step)
    }

    /// The loop on every rank of the mesh, ranks as threads over the in-process collectives: rank 0
    /// runs on the calling thread (it reports progress and can cancel; the ranks agree on
    /// cancellation after every step), the others on scoped threads. Fresh communicators per
    /// request mean a failed request leaves nothing poisoned behind.
    fn denoise_on_mesh(
        &self,
        experts: Experts<'_>,
        params: &DenoiseParams,
        noise: Tensor,
        cond: &Tensor,
        uncond: &Tensor,
        mut on_step: impl FnMut(StepProgress) -> Control,
    ) -> Result<Tensor, DenoiseError> {
        let world = CpuWorld::new(self.mesh.world_size());
        let mut ranks = world.ranks().into_iter();
        let Some(rank0) = ranks.next() else {
            unreachable!("a mesh has at least one rank");
        };
        let mesh = self.mesh;
        // The text states reach every rank once (in one process, by reference: the broadcast).
        let run = |rank: CpuRank, on_step: &mut dyn FnMut(StepProgress) -> Control| {
            let comms = MeshComms::new(&rank, mesh)?;
            parallel::denoise(
                experts,
                &comms,
                params,
                noise.clone(),
                cond,
                Some(uncond),
                on_step,
            )
        };
        let result = std::thread::scope(|scope| {
            let others: Vec<_> = ranks
                .map(|rank| scope.spawn(move || run(rank, &mut |_| Control::Continue)))
                .collect();
            let mine = run(rank0, &mut on_step);
            for other in others {
                // Every rank ends with the same latent or an error: rank 0's answer speaks for the
                // request. A panicking rank poisons the group, so rank 0 has failed too.
                let _ = other.join();
            }
            mine
        });
        result.map_err(|e| match e {
            ParallelError::Denoise(d) => d,
            other => DenoiseError::Input {
                what: "parallel denoise",
                rule: other.to_string(),
            },
        })
    }
}

/// Latent frames, height and width of a request (Wan 2.1 VAE: 4× in time, causal; 8× in space).
pub fn latent_grid(p: &GenerateParams) -> (usize, usize, usize) {
    ((p.num_frames - 1) / 4 + 1, p.height / 8, p.width / 8)
}

/// The decoder pool's half: VAE and H.264 encoder.
pub struct DecodeStage {
    vae: Arc<WanVaeDecoder>,
    encoder: EncoderBackend,
    /// Ranks of the decoder instance (`parallel_vae_size`); on the CPU each rank is a thread.
    vae_ranks: usize,
    split: VaeSplitDim,
}

/// One request's decode state: the VAE's causal caches and the segment writer.
pub struct DecodeSession<'a> {
    stage: &'a DecodeStage,
    vae: SessionVae,
    writer: SegmentWriter,
    latent_frames: usize,
    latent_frames_done: usize,
    /// Video frames decoded so far.
    pub frames: u32,
    /// Segments produced so far.
    pub segments: u32,
    /// VAE time so far.
    pub decode_ms: f64,
    /// Colour conversion, encoding and muxing time so far.
    pub encode_ms: f64,
}

impl DecodeStage {
    /// Builds the VAE and checks the encoder backend the config names.
    pub fn from_config(cfg: &Config) -> anyhow::Result<DecodeStage> {
        check_device(cfg)?;
        let m = &cfg.model;
        let vae = match (m.weights, &m.checkpoint, m.preset) {
            (SourceKind::Random, _, Some(Preset::Tiny)) => WanVaeDecoder::from_weights(
                tiny_vae_config(),
                &RandomWeights::new(TINY_WEIGHT_SEED),
            )?,
            (SourceKind::Random, _, Some(p)) => bail!(
                "model.preset = {p} with random weights: the CPU backend only runs `tiny` this way"
            ),
            (SourceKind::Checkpoint, Some(dir), _) => WanVaeDecoder::load(&dir.join("vae"))?,
            _ => bail!("model: validation should have refused this combination"),
        };
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
        Ok(DecodeStage {
            vae: Arc::new(vae),
            encoder,
            vae_ranks: cfg.vae_layout().size(),
            split: cfg.parallel_config.parallel_vae_split_dim,
        })
    }

    /// Latent channels the VAE decodes.
    pub fn latent_channels(&self) -> usize {
        self.vae.config().z_dim
    }

    /// Starts a request's decode; the init segment is ready at once.
    pub fn start(&self, p: &GenerateParams) -> anyhow::Result<DecodeSession<'_>> {
        let (lt, lh, lw) = latent_grid(p);
        let vae = if self.vae_ranks == 1 {
            SessionVae::Single(self.vae.new_stream(lh, lw)?)
        } else {
            SessionVae::Sharded(ShardedDecode::start(
                &self.vae,
                self.vae_ranks,
                self.split,
                lh,
                lw,
            )?)
        };
        Ok(DecodeSession {
            stage: self,
            vae,
            writer: SegmentWriter::new(&self.encoder, video_params(p), segment_plan(p)?)?,
            latent_frames: lt,
            latent_frames_done: 0,
            frames: 0,
            segments: 0,
            decode_ms: 0.0,
            encode_ms: 0.0,
        })
    }

    /// The non-streamed path, for reference: the whole latent decoded at once, then every frame
    /// encoded into a single-fragment MP4 with the same keyframes. Streaming must produce the
    /// same pictures.
    pub fn render_whole(&self, p: &GenerateParams, latent: &Tensor) -> anyhow::Result<Vec<u8>> {
        let frames = to_rgb(&self.vae.decode(latent)?)?;
        Ok(encode_single_fragment(
            &self.encoder,
            video_params(p),
            segment_plan(p)?,
            &frames,
        )?)
    }
}

impl DecodeSession<'_> {
    /// The init segment (`ftyp` + `moov`) and its MIME type with codecs.
    pub fn init_event(&self) -> Event {
        Event::Init {
            data: self.writer.init_segment().to_vec(),
            mime_type: self.writer.mime_type(),
        }
    }

    /// Decodes the next latent frames [1, C, n, h, w] and encodes the frames; returns the segments
    /// they completed (after the last latent frame, the final segment too).
    pub fn push(&mut self, latent: &Tensor) -> anyhow::Result<Vec<Segment>> {
        let n = latent.shape().get(2).copied().unwrap_or(0);
        if self.latent_frames_done + n > self.latent_frames {
            bail!(
                "latent frames {}..{} exceed the request's {} latent frames",
                self.latent_frames_done,
                self.latent_frames_done + n,
                self.latent_frames
            );
        }
        let t = Instant::now();
        let decoded = match &mut self.vae {
            SessionVae::Single(stream) => self.stage.vae.decode_chunk(stream, latent)?,
            SessionVae::Sharded(sharded) => sharded.decode_chunk(latent)?,
        };
        self.decode_ms += ms(t.elapsed());
        let t = Instant::now();
        let rgb = to_rgb(&decoded)?;
        let mut ready: Vec<MediaSegment> = Vec::new();
        for frame in &rgb {
            ready.extend(self.writer.push_frame(frame)?);
        }
        self.latent_frames_done += n;
        if self.latent_frames_done == self.latent_frames {
            ready.extend(self.writer.finish()?);
        }
        self.encode_ms += ms(t.elapsed());
        self.frames += rgb.len() as u32;
        self.segments += ready.len() as u32;
        Ok(ready
            .into_iter()
            .map(|s| Segment {
                sequence_number: s.sequence_number,
                first_frame: s.first_frame as u32,
                frame_count: s.frame_count,
                data: s.bytes,
            })
            .collect())
    }

    /// Whether every latent frame has been decoded.
    pub fn is_done(&self) -> bool {
        self.latent_frames_done == self.latent_frames
    }
}

/// A request's VAE state: one stream, or one per rank of a sharded decoder instance.
enum SessionVae {
    Single(DecodeStream),
    Sharded(ShardedDecode),
}

/// A decode spatially sharded over `parallel_vae_size` ranks (decoder::parallel: halo exchange
/// before every 3×3 conv, frames gathered to rank 0). Rank 0 runs on the request's thread; the
/// other ranks are threads that live as long as the request, each keeping its band's caches, and
/// take every latent chunk over a channel.
struct ShardedDecode {
    rank0: ParallelVaeDecoder<CpuComm>,
    stream0: ParallelDecodeStream,
    peers: Vec<(std::sync::mpsc::Sender<Tensor>, std::thread::JoinHandle<()>)>,
}

impl ShardedDecode {
    fn start(
        vae: &Arc<WanVaeDecoder>,
        ranks: usize,
        split: VaeSplitDim,
        lh: usize,
        lw: usize,
    ) -> anyhow::Result<ShardedDecode> {
        let world = CpuWorld::new(ranks);
        let all: Vec<usize> = (0..ranks).collect();
        let mut comms = world
            .ranks()
            .into_iter()
            .map(|r| r.group(&all))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter();
        let Some(comm0) = comms.next() else {
            bail!("parallel_vae_size = {ranks}: an instance needs at least one rank");
        };
        let rank0 = ParallelVaeDecoder::new(Arc::clone(vae), comm0, split);
        let stream0 = rank0.new_stream(lh, lw)?;
        let mut peers = Vec::new();
        for comm in comms {
            let mut dec = ParallelVaeDecoder::new(Arc::clone(vae), comm, split);
            let mut stream = dec.new_stream(lh, lw)?;
            let (tx, rx) = std::sync::mpsc::channel::<Tensor>();
            let handle = std::thread::spawn(move || {
                // A failure here reaches rank 0 through the collectives (its peers error too).
                for latent in rx {
                    let step = stream
                        .band_of(&latent)
                        .map_err(anyhow::Error::from)
                        .and_then(|band| Ok(dec.decode_chunk(&mut stream, &band)?))
                        .and_then(|frames| Ok(dec.gather_frames(&stream, &frames)?));
                    if let Err(e) = step {
                        tracing::warn!(error = %format!("{e:#}"), "VAE rank failed");
                        return;
                    }
                }
            });
            peers.push((tx, handle));
        }
        Ok(ShardedDecode {
            rank0,
            stream0,
            peers,
        })
    }

    /// Every rank decodes its band of `latent`; rank 0 returns the whole video chunk.
    fn decode_chunk(&mut self, latent: &Tensor) -> anyhow::Result<Tensor> {
        for (tx, _) in &self.peers {
            tx.send(latent.clone())
                .map_err(|_| anyhow::anyhow!("a VAE rank has stopped"))?;
        }
        let band = self.stream0.band_of(latent)?;
        let frames = self.rank0.decode_chunk(&mut self.stream0, &band)?;
        self.rank0
            .gather_frames(&self.stream0, &frames)?
            .ok_or_else(|| anyhow::anyhow!("rank 0 of a VAE instance always receives the frames"))
    }
}

impl Drop for ShardedDecode {
    fn drop(&mut self) {
        // Closing the channels ends the peers; every gather has completed by then.
        for (tx, handle) in self.peers.drain(..) {
            drop(tx);
            let _ = handle.join();
        }
    }
}

/// Both halves in one process (`ditstream serve`, the embedded default).
pub struct Pipeline {
    name: String,
    denoise: DenoiseStage,
    decode: DecodeStage,
}

impl Pipeline {
    /// Builds every model the config names (validated already).
    pub fn from_config(cfg: &Config) -> anyhow::Result<Pipeline> {
        let denoise = DenoiseStage::from_config(cfg)?;
        let decode = DecodeStage::from_config(cfg)?;
        if denoise.latent_channels() != decode.latent_channels() {
            bail!(
                "the transformer's in_channels {} differ from the VAE's z_dim {}",
                denoise.latent_channels(),
                decode.latent_channels()
            );
        }
        Ok(Pipeline {
            name: model_name(cfg),
            denoise,
            decode,
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
        let (cond, uncond) = self.denoise.text_states(p)?;
        timings.text_ms = ms(t.elapsed());
        sink.send(Event::Progress {
            phase: Phase::Text,
            done: 1,
            total: 1,
        })
        .map_err(stopped)?;

        let t = Instant::now();
        let mut stop = None;
        let latent = self.denoise.denoise_latent(p, &cond, &uncond, |s| {
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

        // Decode one latent frame at a time (frame 0 → 1 video frame, then 4 each), sending every
        // segment as soon as its last frame is encoded.
        let mut session = self.decode.start(p)?;
        sink.send(session.init_event()).map_err(stopped)?;
        for chunk in 0..latent.shape()[2] {
            sink.check().map_err(stopped)?;
            for seg in session.push(&latent.narrow(2, chunk, 1)?)? {
                sink.send(Event::Segment(seg)).map_err(stopped)?;
            }
            let event = Event::Progress {
                phase: Phase::Decode,
                done: session.frames,
                total: p.num_frames as u32,
            };
            sink.send(event).map_err(stopped)?;
        }
        timings.decode_ms = session.decode_ms;
        timings.encode_ms = session.encode_ms;
        Ok(Done {
            timings,
            frames: session.frames,
            segments: session.segments,
        })
    }

    /// The non-streamed path, for reference (see [`DecodeStage::render_whole`]).
    pub fn render_whole(&self, p: &GenerateParams) -> anyhow::Result<Vec<u8>> {
        let (cond, uncond) = self.denoise.text_states(p)?;
        let latent = self
            .denoise
            .denoise_latent(p, &cond, &uncond, |_| Control::Continue)?;
        self.decode.render_whole(p, &latent)
    }
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
fn segment_plan(p: &GenerateParams) -> anyhow::Result<SegmentPlan> {
    Ok(SegmentPlan::new(1, p.segment_frames as u32)?)
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

type DenoiserModels = (TextEncoder, WanTransformer, Option<(WanTransformer, f64)>);

/// The denoiser's part of a diffusers Wan checkpoint folder: `transformer/` (and
/// `transformer_2/` with the `boundary_ratio` of `model_index.json` for Wan2.2-A14B),
/// `text_encoder/`, `tokenizer/`.
fn load_denoiser_checkpoint(dir: &Path) -> anyhow::Result<DenoiserModels> {
    let high = WanTransformer::from_dir(&dir.join("transformer"), DType::F32, Device::Cpu)?;
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
            WanTransformer::from_dir(&dir.join("transformer_2"), DType::F32, Device::Cpu)?,
            boundary,
        ))
    } else {
        None
    };
    let text = TextEncoder::from_pretrained(dir, 512)?;
    Ok((text, high, low))
}
