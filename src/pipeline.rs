//! The path from text to segments, in two halves that the pools own separately:
//! [`DenoiseStage`] (text encoder and transformer(s): prompt → latent) and [`DecodeStage`] (VAE
//! and H.264 encoder: latent chunks → fragmented-MP4 segments). [`Pipeline`] joins them in one
//! process for `ditstream serve`; the denoiser and decoder pools each build one half.
//!
//! The models are built once from the config, on the devices it names (`serving.device`,
//! `serving.gpus`: see [`crate::models`]); a request only allocates its own state.
//!
//! Ranks. One rank runs on the calling thread. Several (a denoiser mesh, a parallel-VAE decoder
//! instance) run on persistent rank threads ([`crate::ranks`]), one per rank, each with its own
//! model copy on its own GPU (on the CPU the ranks share one copy), over communicators formed once
//! when the stage is built: NCCL with `device: cuda`, the in-process backend on the CPU.

use std::sync::mpsc::{Sender, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{Context, bail};
use ditstream_common::collectives::CommWorld;
#[cfg(feature = "cuda")]
use ditstream_common::collectives::DEFAULT_TIMEOUT;
use ditstream_common::collectives::cpu::CpuComm;
use ditstream_common::collectives::wire::TensorWire;
use ditstream_common::config::{
    Config, DeviceKind, EncoderKind, SamplerConfig, VaeSplitDim, WeightSource as SourceKind,
};
use ditstream_common::mesh::Mesh;
use ditstream_decoder::encode::{
    EncoderBackend, MediaSegment, OpenH264Options, RgbFrame, SegmentPlan, SegmentWriter,
    VideoParams, X264Options, encode_single_fragment, vae_output_to_rgb,
};
use ditstream_decoder::parallel::{ParallelDecodeStream, ParallelVaeDecoder};
use ditstream_decoder::vae::{DecodeStream, WanVaeDecoder};
use ditstream_denoiser::denoise::{
    Control, DenoiseError, DenoiseParams, Experts, StepProgress, denoise_interruptible,
    initial_noise,
};
use ditstream_denoiser::parallel::{self, MeshComms, ParallelError, check_mesh};
use ditstream_denoiser::text::TextEncoder;
use ditstream_kernels::{Device, Tensor};

use crate::models::{self, DenoiserModels};
use crate::ranks::{GroupStatus, RankGroup, RankState, Ranks, Threads};
use crate::request::GenerateParams;

/// What a denoiser pool runs for one request: the prompt, the video's size and the sampling
/// parameters, validated at the gateway.
#[derive(Debug, Clone, PartialEq)]
pub struct DenoiseJob {
    /// The prompt.
    pub prompt: String,
    /// The negative prompt.
    pub negative_prompt: String,
    /// Video width in pixels.
    pub width: usize,
    /// Video height in pixels.
    pub height: usize,
    /// Video frames (4k+1).
    pub num_frames: usize,
    /// Denoising steps.
    pub steps: usize,
    /// CFG scale.
    pub guidance_scale: f64,
    /// CFG scale of a low-noise expert.
    pub guidance_scale_2: Option<f64>,
    /// Initial-noise seed.
    pub seed: u64,
}

impl DenoiseJob {
    /// The denoising half of a validated request.
    pub fn of(p: &GenerateParams) -> DenoiseJob {
        DenoiseJob {
            prompt: p.prompt.clone(),
            negative_prompt: p.negative_prompt.clone(),
            width: p.width,
            height: p.height,
            num_frames: p.num_frames,
            steps: p.steps,
            guidance_scale: p.guidance_scale,
            guidance_scale_2: p.guidance_scale_2,
            seed: p.seed,
        }
    }

    /// The latent grid it denoises.
    pub fn latent_grid(&self) -> (usize, usize, usize) {
        latent_grid(self.num_frames, self.height, self.width)
    }
}

/// What a decoder instance runs for one request: the latent's video size and how to cut it.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeJob {
    /// Video width in pixels.
    pub width: usize,
    /// Video height in pixels.
    pub height: usize,
    /// Video frames (4k+1).
    pub num_frames: usize,
    /// Frames per second of the output.
    pub fps: u32,
    /// Frames per media segment after the first.
    pub segment_frames: usize,
}

impl DecodeJob {
    /// The decoding half of a validated request.
    pub fn of(p: &GenerateParams) -> DecodeJob {
        DecodeJob {
            width: p.width,
            height: p.height,
            num_frames: p.num_frames,
            fps: p.fps,
            segment_frames: p.segment_frames,
        }
    }

    /// The latent grid it decodes.
    pub fn latent_grid(&self) -> (usize, usize, usize) {
        latent_grid(self.num_frames, self.height, self.width)
    }
}

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

/// The GPU of rank 0 (where the text states and, over an NCCL latent link, the latent leave
/// from, or where chunks arrive), or 0 on the CPU, where no link uses it.
fn first_gpu(devices: &[Device]) -> usize {
    match devices.first() {
        Some(Device::Cuda(g)) => *g,
        _ => 0,
    }
}

/// The GPU ordinals of `devices` (all `Device::Cuda` with `device: cuda`).
#[cfg(feature = "cuda")]
fn gpu_ordinals(devices: &[Device]) -> anyhow::Result<Vec<usize>> {
    devices
        .iter()
        .map(|d| match d {
            Device::Cuda(g) => Ok(*g),
            Device::Cpu => bail!("a rank of a CUDA group was placed on the CPU"),
        })
        .collect()
}

/// The denoiser pool's half: text encoder and transformer(s), run on the config's mesh.
pub struct DenoiseStage {
    text: TextEncoder,
    sampler: SamplerConfig,
    /// cfg × cp × ulysses ranks.
    mesh: Mesh,
    /// Rank r's device.
    devices: Vec<Device>,
    /// The transformer's `in_channels`.
    latent_channels: usize,
    ranks: DenoiseRanks,
}

/// Who runs the loop.
enum DenoiseRanks {
    /// One rank, on the calling thread.
    Single(Arc<DenoiserModels>),
    /// A mesh of persistent rank threads (one request at a time: the lock), and its status,
    /// readable while a request holds the lock.
    Mesh(
        Mutex<Box<dyn Ranks<MeshJob, DenoiseOut>>>,
        Arc<GroupStatus>,
    ),
}

/// What every rank of a mesh needs for one request (shared, read-only).
struct DenoiseRequest {
    params: DenoiseParams,
    /// Initial noise [1, C, T, H, W], f32, on the host.
    noise: Tensor,
    /// Text states [1, S, text_dim] where the text encoder left them; each rank moves them to its
    /// device once.
    cond: Tensor,
    uncond: Tensor,
}

/// Rank 0's progress after a step, and where the caller's verdict goes back.
type StepReport = (StepProgress, SyncSender<Control>);

/// One rank's part of a request.
struct MeshJob {
    request: Arc<DenoiseRequest>,
    /// Rank 0 only: each step's progress goes to the caller, which answers continue or cancel.
    progress: Option<Sender<StepReport>>,
}

type DenoiseOut = Result<Tensor, ParallelError>;

/// One rank of the denoiser mesh: its model copy, its device, its communicators.
struct DenoiseRank<C> {
    models: Arc<DenoiserModels>,
    device: Device,
    mesh: Mesh,
    comms: Option<MeshComms<C>>,
}

impl<C> DenoiseRank<C> {
    /// Rank r's state: the model copy and device of rank r, not yet connected.
    fn for_ranks(copies: &[Arc<DenoiserModels>], devices: &[Device], mesh: Mesh) -> Vec<Self> {
        copies
            .iter()
            .zip(devices)
            .map(|(models, &device)| DenoiseRank {
                models: Arc::clone(models),
                device,
                mesh,
                comms: None,
            })
            .collect()
    }
}

impl<W> RankState<W> for DenoiseRank<W::Comm>
where
    W: CommWorld,
    W::Comm: TensorWire + Send + 'static,
{
    type Job = MeshJob;
    type Out = DenoiseOut;

    fn connect(&mut self, world: &W) -> anyhow::Result<()> {
        self.comms = Some(MeshComms::new(world, self.mesh)?);
        Ok(())
    }

    fn disconnect(&mut self) {
        self.comms = None;
    }

    fn failed(out: &DenoiseOut) -> bool {
        // An agreed cancel ends every rank after the same step, the communicators intact.
        !matches!(
            out,
            Ok(_) | Err(ParallelError::Denoise(DenoiseError::Cancelled { .. }))
        )
    }

    fn run(&mut self, job: MeshJob) -> DenoiseOut {
        let comms = self.comms.as_ref().ok_or_else(|| ParallelError::Mesh {
            mesh: self.mesh.to_string(),
            what: "communicators",
            value: 0,
            rule: "this rank is not connected (its last join failed)".into(),
        })?;
        let r = &job.request;
        let cond = r.cond.to_device(self.device)?;
        let uncond = r.uncond.to_device(self.device)?;
        let experts = Experts {
            high: &self.models.high,
            low: self.models.low.as_ref().map(|(m, b)| (m, *b)),
        };
        parallel::denoise(
            experts,
            comms,
            &r.params,
            r.noise.clone(),
            &cond,
            Some(&uncond),
            |step| match &job.progress {
                Some(caller) => ask(caller, step),
                None => Control::Continue,
            },
        )
    }
}

/// Hands a step's progress to the caller and waits for its verdict (cancel if it has gone).
fn ask(caller: &Sender<StepReport>, step: StepProgress) -> Control {
    let (tx, rx) = sync_channel(1);
    if caller.send((step, tx)).is_err() {
        return Control::Cancel;
    }
    rx.recv().unwrap_or(Control::Cancel)
}

impl DenoiseStage {
    /// Builds the text encoder and transformer(s) the config names (validated already), on the
    /// devices it names, and forms the mesh's communicators.
    pub fn from_config(cfg: &Config) -> anyhow::Result<DenoiseStage> {
        let mesh = cfg.validate(None)?;
        let devices = models::rank_devices(cfg, "the denoiser mesh", mesh.world_size())?;
        // The text encoder is built (read from a checkpoint, or drawn on the GPU) while the
        // transformer's weights are read or drawn on the host cores. It runs once per prompt, on
        // rank 0's device; the ranks take its states from there.
        let (text, copies) = std::thread::scope(|scope| {
            let text = scope.spawn(|| models::text_encoder(cfg, devices[0]));
            let copies = models::denoiser_models(cfg, &devices);
            let text = text
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("building the text encoder panicked")));
            (text, copies)
        });
        let (text, copies) = (text?, copies?);
        let high = &copies[0].high;
        if high.config().text_dim != text.d_model() {
            bail!(
                "the transformer's text_dim {} differs from the text encoder's width {}",
                high.config().text_dim,
                text.d_model()
            );
        }
        check_mesh(&mesh, high.config(), mesh.world_size())?;
        let latent_channels = high.config().in_channels;
        let ranks = if mesh.world_size() == 1 {
            DenoiseRanks::Single(Arc::clone(&copies[0]))
        } else {
            let group: Box<dyn Ranks<MeshJob, DenoiseOut>> = match cfg.serving.device {
                DeviceKind::Cpu => Box::new(RankGroup::<Threads, DenoiseRank<CpuComm>>::start(
                    "denoise",
                    Threads,
                    DenoiseRank::for_ranks(&copies, &devices, mesh),
                )?),
                #[cfg(feature = "cuda")]
                DeviceKind::Cuda => Box::new(RankGroup::<
                    crate::ranks::Nccl,
                    DenoiseRank<ditstream_common::collectives::nccl::NcclComm>,
                >::start(
                    "denoise",
                    crate::ranks::Nccl {
                        gpus: gpu_ordinals(&devices)?,
                        timeout: DEFAULT_TIMEOUT,
                    },
                    DenoiseRank::for_ranks(&copies, &devices, mesh),
                )?),
                #[cfg(not(feature = "cuda"))]
                DeviceKind::Cuda => {
                    bail!("serving.device = cuda: this binary was built without CUDA")
                }
            };
            let status = group.status();
            DenoiseRanks::Mesh(Mutex::new(group), status)
        };
        tracing::info!(%mesh, devices = ?devices, "denoiser stage ready");
        Ok(DenoiseStage {
            text,
            sampler: cfg.sampler.clone(),
            mesh,
            devices,
            latent_channels,
            ranks,
        })
    }

    /// The mesh the loop runs on.
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// Rank r's device.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// Rank 0's GPU (0 on the CPU): where an NCCL latent link sends from.
    pub fn link_gpu(&self) -> usize {
        first_gpu(&self.devices)
    }

    /// How many times the mesh's communicators have been formed: 1 after start-up, one more
    /// before the first request after each failed one; 0 for a single rank (none needed).
    pub fn connections(&self) -> u64 {
        match &self.ranks {
            DenoiseRanks::Single(_) => 0,
            DenoiseRanks::Mesh(_, status) => status.connections(),
        }
    }

    /// Why the stage can serve nothing more, if it cannot (a rank thread is gone). Never waits
    /// for a running request.
    pub fn out_of_service(&self) -> Option<String> {
        match &self.ranks {
            DenoiseRanks::Single(_) => None,
            DenoiseRanks::Mesh(_, status) => status.out_of_service().map(str::to_string),
        }
    }

    /// Latent channels (the transformer's `in_channels`).
    pub fn latent_channels(&self) -> usize {
        self.latent_channels
    }

    /// Prompt and negative prompt, encoded in one batch (repeats come from the cache):
    /// each [1, 512, text_dim], on the text encoder's device (rank 0's, or the host for `tiny`).
    pub fn text_states(&self, p: &DenoiseJob) -> anyhow::Result<(Tensor, Tensor)> {
        let embeds = self.text.encode(&[&p.prompt, &p.negative_prompt])?;
        Ok((
            embeds.states.narrow(0, 0, 1)?,
            embeds.states.narrow(0, 1, 1)?,
        ))
    }

    /// The denoised latent [1, C, T, H/8, W/8] (f32, on the host) from the request's seed.
    /// `on_step` runs after every step; `interrupted`, once set, stops a single rank before its
    /// next transformer block (a mesh stops after the step: its ranks agree on a cancel once per
    /// step, and a rank leaving mid-step would strand the others in a collective).
    pub fn denoise_latent(
        &self,
        p: &DenoiseJob,
        cond: &Tensor,
        uncond: &Tensor,
        interrupted: &AtomicBool,
        on_step: impl FnMut(StepProgress) -> Control,
    ) -> Result<Tensor, DenoiseError> {
        let (lt, lh, lw) = p.latent_grid();
        // Drawn on the host from the seed, whatever the device: the same noise everywhere.
        let noise = initial_noise([1, self.latent_channels(), lt, lh, lw], p.seed)?;
        let params = DenoiseParams {
            sampler: self.sampler.kind,
            steps: p.steps,
            shift: self.sampler.shift,
            guidance_scale: p.guidance_scale,
            guidance_scale_2: p.guidance_scale_2,
        };
        match &self.ranks {
            DenoiseRanks::Single(models) => {
                let device = self.devices[0];
                let to_device = |t: &Tensor| {
                    t.to_device(device)
                        .map_err(|e| DenoiseError::Model(e.into()))
                };
                let experts = Experts {
                    high: &models.high,
                    low: models.low.as_ref().map(|(m, b)| (m, *b)),
                };
                denoise_interruptible(
                    experts,
                    &params,
                    noise,
                    &to_device(cond)?,
                    Some(&to_device(uncond)?),
                    &|| interrupted.load(Ordering::Relaxed),
                    on_step,
                )
            }
            DenoiseRanks::Mesh(group, _) => {
                let request = Arc::new(DenoiseRequest {
                    params,
                    noise,
                    cond: cond.clone(),
                    uncond: uncond.clone(),
                });
                let mut group = lock(group);
                run_on_mesh(&mut **group, &self.mesh, request, on_step)
            }
        }
    }
}

/// The loop on every rank of the mesh: rank 0 reports each step here, where `on_step` runs on
/// the caller's thread and its verdict goes back (the ranks agree on cancellation after every
/// step); the other ranks report nothing. Waits for every rank, so the mesh is idle when this
/// returns, and answers with rank 0's outcome (every rank ends with the same latent or an error).
fn run_on_mesh(
    group: &mut dyn Ranks<MeshJob, DenoiseOut>,
    mesh: &Mesh,
    request: Arc<DenoiseRequest>,
    mut on_step: impl FnMut(StepProgress) -> Control,
) -> Result<Tensor, DenoiseError> {
    let failed = |rule: String| DenoiseError::Input {
        what: "parallel denoise",
        rule,
    };
    let (progress_tx, progress_rx) = std::sync::mpsc::channel::<StepReport>();
    let jobs = (0..group.size())
        .map(|rank| MeshJob {
            request: Arc::clone(&request),
            progress: (rank == 0).then(|| progress_tx.clone()),
        })
        .collect();
    drop(progress_tx);
    let replies = group
        .run(jobs)
        .map_err(|e| failed(format!("mesh {mesh}: {e:#}")))?;
    // Ends when rank 0's job ends (its sender is dropped with the job).
    for (step, verdict) in progress_rx {
        let _ = verdict.send(on_step(step));
    }
    let mut outcomes = group.replies(&replies).into_iter();
    match outcomes.next() {
        Some(Ok(Ok(latent))) => Ok(latent),
        Some(Ok(Err(ParallelError::Denoise(d)))) => Err(d),
        Some(Ok(Err(other))) => Err(failed(other.to_string())),
        Some(Err(panicked)) => Err(failed(panicked)),
        None => Err(failed(format!("mesh {mesh} has no ranks"))),
    }
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The guarded values are rank groups, whose state stays consistent across a panic in a
    // caller (every field update is a single assignment).
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Milliseconds of a duration, as the timings report them.
pub fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Latent frames, height and width of a video (Wan 2.1 VAE: 4× in time, causal; 8× in space).
pub fn latent_grid(num_frames: usize, height: usize, width: usize) -> (usize, usize, usize) {
    ((num_frames.max(1) - 1) / 4 + 1, height / 8, width / 8)
}

/// The decoder pool's half: VAE and H.264 encoder.
pub struct DecodeStage {
    encoder: EncoderBackend,
    /// Latent channels the VAE decodes.
    z_dim: usize,
    /// Rank r's device.
    devices: Vec<Device>,
    /// Rank 0's VAE, for the unsharded reference decode ([`DecodeStage::render_whole`]).
    whole: Arc<WanVaeDecoder>,
    vae: VaeRanks,
}

/// Who decodes.
enum VaeRanks {
    /// One rank: any number of requests decode at once on the calling threads.
    Single(Arc<WanVaeDecoder>),
    /// A parallel-VAE instance of persistent rank threads; one chunk at a time (the lock), so
    /// every rank sees every request's steps in the same order. Its status is readable while a
    /// chunk holds the lock.
    Sharded(Mutex<Sharded>, Arc<GroupStatus>),
}

/// A parallel-VAE instance and its session numbering.
struct Sharded {
    ranks: Box<dyn Ranks<VaeJob, VaeOut>>,
    next_session: u64,
}

/// One step of one request on every rank of a parallel-VAE instance.
enum VaeJob {
    /// A request starts: a stream for its whole latent of this size.
    Start {
        session: u64,
        latent_height: usize,
        latent_width: usize,
    },
    /// The next latent chunk [1, C, n, h, w] (host or device): every rank decodes its band, rank 0
    /// gathers the frames.
    Chunk { session: u64, latent: Tensor },
    /// The request ended: its streams go.
    End { session: u64 },
}

/// A rank's answer to a [`VaeJob`].
enum VaeOut {
    /// Done: rank 0's gathered video chunk [1, 3, F, H, W] on the host, or nothing.
    Done(Option<Tensor>),
    /// Refused before any communication (the instance is as it was).
    Refused(anyhow::Error),
    /// Failed while communicating: the instance must form fresh communicators.
    Failed(anyhow::Error),
}

/// One rank of a parallel-VAE instance.
struct VaeRank<C> {
    vae: Arc<WanVaeDecoder>,
    split: VaeSplitDim,
    decoder: Option<ParallelVaeDecoder<C>>,
    streams: std::collections::HashMap<u64, ParallelDecodeStream>,
}

impl<C> VaeRank<C> {
    /// Rank r's state: the VAE copy of rank r, not yet connected.
    fn for_ranks(copies: &[Arc<WanVaeDecoder>], split: VaeSplitDim) -> Vec<Self> {
        copies
            .iter()
            .map(|vae| VaeRank {
                vae: Arc::clone(vae),
                split,
                decoder: None,
                streams: Default::default(),
            })
            .collect()
    }
}

impl<W> RankState<W> for VaeRank<W::Comm>
where
    W: CommWorld,
    W::Comm: TensorWire + Send + 'static,
{
    type Job = VaeJob;
    type Out = VaeOut;

    fn connect(&mut self, world: &W) -> anyhow::Result<()> {
        let all: Vec<usize> = (0..world.world_size()).collect();
        let comm = world
            .split(&[all])?
            .context("every rank is in the instance's one group")?;
        self.decoder = Some(ParallelVaeDecoder::new(
            Arc::clone(&self.vae),
            comm,
            self.split,
        ));
        Ok(())
    }

    fn disconnect(&mut self) {
        self.streams.clear();
        self.decoder = None;
    }

    fn failed(out: &VaeOut) -> bool {
        matches!(out, VaeOut::Failed(_))
    }

    fn run(&mut self, job: VaeJob) -> VaeOut {
        let Some(decoder) = self.decoder.as_mut() else {
            return VaeOut::Refused(anyhow::anyhow!("this VAE rank is not connected"));
        };
        match job {
            VaeJob::Start {
                session,
                latent_height,
                latent_width,
            } => match decoder.new_stream(latent_height, latent_width) {
                Ok(stream) => {
                    self.streams.insert(session, stream);
                    VaeOut::Done(None)
                }
                Err(e) => VaeOut::Refused(e.into()),
            },
            VaeJob::Chunk { session, latent } => {
                let Some(stream) = self.streams.get_mut(&session) else {
                    return VaeOut::Refused(anyhow::anyhow!("no VAE stream for session {session}"));
                };
                let mut step = || -> anyhow::Result<Option<Tensor>> {
                    let band = stream.band_of(&latent)?;
                    let frames = decoder.decode_chunk(stream, &band)?;
                    // Gathered device to device to rank 0, then to the host for encoding.
                    match decoder.gather_frames(stream, &frames)? {
                        Some(video) => Ok(Some(video.to_device(Device::Cpu)?)),
                        None => Ok(None),
                    }
                };
                match step() {
                    Ok(video) => VaeOut::Done(video),
                    Err(e) => VaeOut::Failed(e),
                }
            }
            VaeJob::End { session } => {
                self.streams.remove(&session);
                VaeOut::Done(None)
            }
        }
    }
}

impl Sharded {
    /// Runs `job(rank)` on every rank; rank 0's output, or the first error.
    fn step(&mut self, job: impl Fn() -> VaeJob) -> anyhow::Result<Option<Tensor>> {
        let jobs = (0..self.ranks.size()).map(|_| job()).collect();
        let replies = self.ranks.run(jobs)?;
        let mut first = None;
        let mut error = None;
        for (rank, reply) in self.ranks.replies(&replies).into_iter().enumerate() {
            match reply {
                Ok(VaeOut::Done(video)) if rank == 0 => first = video,
                Ok(VaeOut::Done(_)) => {}
                Ok(VaeOut::Refused(e) | VaeOut::Failed(e)) => {
                    error.get_or_insert(e.context(format!("VAE rank {rank}")));
                }
                Err(panicked) => {
                    error.get_or_insert(anyhow::anyhow!("VAE rank {rank}: {panicked}"));
                }
            }
        }
        match error {
            Some(e) => Err(e),
            None => Ok(first),
        }
    }
}

/// One request's decode state: the VAE's causal caches and the segment writer.
pub struct DecodeSession<'a> {
    stage: &'a DecodeStage,
    vae: SessionVae,
    writer: SegmentWriter,
    latent_frames: usize,
    latent_frames_done: usize,
    latent_size: (usize, usize),
    /// Video frames decoded so far.
    pub frames: u32,
    /// Segments produced so far.
    pub segments: u32,
    /// VAE time so far.
    pub decode_ms: f64,
    /// Colour conversion, encoding and muxing time so far.
    pub encode_ms: f64,
}

/// A request's VAE state: one stream, or a session on a parallel-VAE instance (its streams live
/// on the rank threads), started under the instance's `connections` count.
enum SessionVae {
    Single(DecodeStream),
    Sharded { session: u64, connections: u64 },
}

impl DecodeStage {
    /// Builds the VAE on the devices the config names, forms a parallel-VAE instance's
    /// communicators, and checks the encoder backend.
    pub fn from_config(cfg: &Config) -> anyhow::Result<DecodeStage> {
        let vae_ranks = cfg.vae_layout().size();
        let devices = models::rank_devices(cfg, "a decoder instance", vae_ranks)?;
        let copies = models::vae_decoders(cfg, &devices)?;
        let z_dim = copies[0].config().z_dim;
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
        let vae = if vae_ranks == 1 {
            VaeRanks::Single(Arc::clone(&copies[0]))
        } else {
            let split = cfg.parallel_config.parallel_vae_split_dim;
            let ranks: Box<dyn Ranks<VaeJob, VaeOut>> = match cfg.serving.device {
                DeviceKind::Cpu => Box::new(RankGroup::<Threads, VaeRank<CpuComm>>::start(
                    "vae",
                    Threads,
                    VaeRank::for_ranks(&copies, split),
                )?),
                #[cfg(feature = "cuda")]
                DeviceKind::Cuda => Box::new(RankGroup::<
                    crate::ranks::Nccl,
                    VaeRank<ditstream_common::collectives::nccl::NcclComm>,
                >::start(
                    "vae",
                    crate::ranks::Nccl {
                        gpus: gpu_ordinals(&devices)?,
                        timeout: DEFAULT_TIMEOUT,
                    },
                    VaeRank::for_ranks(&copies, split),
                )?),
                #[cfg(not(feature = "cuda"))]
                DeviceKind::Cuda => {
                    bail!("serving.device = cuda: this binary was built without CUDA")
                }
            };
            let status = ranks.status();
            VaeRanks::Sharded(
                Mutex::new(Sharded {
                    ranks,
                    next_session: 0,
                }),
                status,
            )
        };
        tracing::info!(vae_ranks, devices = ?devices, "decoder stage ready");
        Ok(DecodeStage {
            encoder,
            z_dim,
            devices,
            whole: Arc::clone(&copies[0]),
            vae,
        })
    }

    /// Latent channels the VAE decodes.
    pub fn latent_channels(&self) -> usize {
        self.z_dim
    }

    /// How many times a parallel-VAE instance's communicators have been formed: 1 after
    /// start-up, one more before the first request after each failed one; 0 for a single rank.
    pub fn connections(&self) -> u64 {
        match &self.vae {
            VaeRanks::Single(_) => 0,
            VaeRanks::Sharded(_, status) => status.connections(),
        }
    }

    /// Why the stage can serve nothing more, if it cannot (a rank thread is gone). Never waits
    /// for a chunk in progress.
    pub fn out_of_service(&self) -> Option<String> {
        match &self.vae {
            VaeRanks::Single(_) => None,
            VaeRanks::Sharded(_, status) => status.out_of_service().map(str::to_string),
        }
    }

    /// Rank r's device.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// Rank 0's GPU (0 on the CPU): where an NCCL latent link receives chunks.
    pub fn link_gpu(&self) -> usize {
        first_gpu(&self.devices)
    }

    /// Starts a request's decode; the init segment is ready at once.
    pub fn start(&self, p: &DecodeJob) -> anyhow::Result<DecodeSession<'_>> {
        let (lt, lh, lw) = p.latent_grid();
        let vae = match &self.vae {
            VaeRanks::Single(vae) => SessionVae::Single(vae.new_stream(lh, lw)?),
            VaeRanks::Sharded(sharded, _) => {
                let mut sharded = lock(sharded);
                let session = sharded.next_session;
                sharded.next_session += 1;
                sharded.step(|| VaeJob::Start {
                    session,
                    latent_height: lh,
                    latent_width: lw,
                })?;
                SessionVae::Sharded {
                    session,
                    connections: sharded.ranks.connections(),
                }
            }
        };
        Ok(DecodeSession {
            stage: self,
            vae,
            writer: SegmentWriter::new(&self.encoder, video_params(p), segment_plan(p)?)?,
            latent_frames: lt,
            latent_frames_done: 0,
            latent_size: (lh, lw),
            frames: 0,
            segments: 0,
            decode_ms: 0.0,
            encode_ms: 0.0,
        })
    }

    /// The non-streamed path, for reference: the whole latent decoded at once, unsharded, on the
    /// first rank's device, then every frame encoded into a single-fragment MP4 with the same
    /// keyframes. Streaming must produce the same pictures.
    pub fn render_whole(&self, p: &DecodeJob, latent: &Tensor) -> anyhow::Result<Vec<u8>> {
        let frames = to_rgb(&self.whole.decode(latent)?)?;
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
    pub fn init_segment(&self) -> (Vec<u8>, String) {
        (self.writer.init_segment().to_vec(), self.writer.mime_type())
    }

    /// Decodes the next latent frames [1, C, n, h, w] (host or device) into video frames
    /// [1, 3, F, H, W] on the host, in [−1, 1], without encoding them (the VAE caches advance).
    pub fn decode(&mut self, latent: &Tensor) -> anyhow::Result<Tensor> {
        let s = latent.shape();
        let n = s.get(2).copied().unwrap_or(0);
        let (lh, lw) = self.latent_size;
        if s.len() != 5 || s[0] != 1 || s[1] != self.stage.z_dim || s[3] != lh || s[4] != lw {
            bail!(
                "latent chunk shape {s:?}: this request's latent is [1, {}, n, {lh}, {lw}]",
                self.stage.z_dim
            );
        }
        if n == 0 || self.latent_frames_done + n > self.latent_frames {
            bail!(
                "latent frames {}..{} exceed the request's {} latent frames",
                self.latent_frames_done,
                self.latent_frames_done + n,
                self.latent_frames
            );
        }
        let t = Instant::now();
        let video = match (&mut self.vae, &self.stage.vae) {
            (SessionVae::Single(stream), VaeRanks::Single(vae)) => {
                vae.decode_chunk(stream, latent)?.to_device(Device::Cpu)?
            }
            (
                SessionVae::Sharded {
                    session,
                    connections,
                },
                VaeRanks::Sharded(sharded, _),
            ) => {
                let mut sharded = lock(sharded);
                if !sharded.ranks.is_connected() || sharded.ranks.connections() != *connections {
                    bail!(
                        "the decoder instance failed on another request and its ranks were \
                         re-formed: this request's decode state is gone"
                    );
                }
                let session = *session;
                sharded
                    .step(|| VaeJob::Chunk {
                        session,
                        latent: latent.clone(),
                    })?
                    .context("rank 0 of a VAE instance always receives the frames")?
            }
            _ => bail!("a decode session of another stage"),
        };
        self.decode_ms += ms(t.elapsed());
        self.latent_frames_done += n;
        Ok(video)
    }

    /// Decodes the next latent frames [1, C, n, h, w] and encodes the frames; returns the segments
    /// they completed (after the last latent frame, the final segment too).
    pub fn push(&mut self, latent: &Tensor) -> anyhow::Result<Vec<MediaSegment>> {
        let video = self.decode(latent)?;
        let t = Instant::now();
        let rgb = to_rgb(&video)?;
        let mut ready: Vec<MediaSegment> = Vec::new();
        for frame in &rgb {
            ready.extend(self.writer.push_frame(frame)?);
        }
        if self.is_done() {
            ready.extend(self.writer.finish()?);
        }
        self.encode_ms += ms(t.elapsed());
        self.frames += rgb.len() as u32;
        self.segments += ready.len() as u32;
        Ok(ready)
    }

    /// Whether every latent frame has been decoded.
    pub fn is_done(&self) -> bool {
        self.latent_frames_done == self.latent_frames
    }
}

impl Drop for DecodeSession<'_> {
    fn drop(&mut self) {
        let (SessionVae::Sharded { session, .. }, VaeRanks::Sharded(sharded, _)) =
            (&self.vae, &self.stage.vae)
        else {
            return;
        };
        let session = *session;
        let mut sharded = lock(sharded);
        // Only a connected instance still holds the session's streams (a reconnection dropped them).
        if sharded.ranks.is_connected()
            && let Err(e) = sharded.step(|| VaeJob::End { session })
        {
            tracing::warn!(error = %format!("{e:#}"), session, "ending a VAE session failed");
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
    /// Builds every model the config names (validated already). Both halves use the GPUs of
    /// `serving.gpus`: denoiser rank r and VAE rank r on `gpus[r]`.
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

    /// The denoising half.
    pub fn denoise_stage(&self) -> &DenoiseStage {
        &self.denoise
    }

    /// The decoding half.
    pub fn decode_stage(&self) -> &DecodeStage {
        &self.decode
    }

    /// The streamed path without a service, for parity tests and benchmarks: text, the loop,
    /// then every latent frame decoded and encoded as a stream would be; returns the init
    /// segment and every media segment concatenated (a whole fragmented MP4).
    pub fn render_streamed(&self, p: &GenerateParams) -> anyhow::Result<Vec<u8>> {
        let job = DenoiseJob::of(p);
        let (cond, uncond) = self.denoise.text_states(&job)?;
        let never = AtomicBool::new(false);
        let latent =
            self.denoise
                .denoise_latent(&job, &cond, &uncond, &never, |_| Control::Continue)?;
        let mut session = self.decode.start(&DecodeJob::of(p))?;
        let mut mp4 = session.init_segment().0;
        for t in 0..latent.shape()[2] {
            for segment in session.push(&latent.narrow(2, t, 1)?)? {
                mp4.extend(segment.bytes);
            }
        }
        Ok(mp4)
    }

    /// The non-streamed path, for reference (see [`DecodeStage::render_whole`]).
    pub fn render_whole(&self, p: &GenerateParams) -> anyhow::Result<Vec<u8>> {
        let job = DenoiseJob::of(p);
        let (cond, uncond) = self.denoise.text_states(&job)?;
        let never = AtomicBool::new(false);
        let latent =
            self.denoise
                .denoise_latent(&job, &cond, &uncond, &never, |_| Control::Continue)?;
        self.decode.render_whole(&DecodeJob::of(p), &latent)
    }

    /// The two halves, for `serve` to hand to its pools.
    pub fn into_stages(self) -> (DenoiseStage, DecodeStage) {
        (self.denoise, self.decode)
    }
}

fn video_params(p: &DecodeJob) -> VideoParams {
    VideoParams {
        width: p.width as u32,
        height: p.height as u32,
        fps: p.fps,
    }
}

/// Frame 0 alone (the first picture leaves as soon as latent frame 0 is decoded), then
/// `segment_frames` each.
fn segment_plan(p: &DecodeJob) -> anyhow::Result<SegmentPlan> {
    Ok(SegmentPlan::new(1, p.segment_frames as u32)?)
}

/// VAE output [1, 3, F, H, W] in [−1, 1] (any device) → RGB frames.
pub fn to_rgb(video: &Tensor) -> anyhow::Result<Vec<RgbFrame>> {
    let s = video.shape();
    Ok(vae_output_to_rgb(
        &video.to_vec_f32()?,
        s[1],
        s[2],
        s[3],
        s[4],
    )?)
}
