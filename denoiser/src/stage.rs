//! A denoiser pool's stage: the text encoder and the transformer(s), built once from the config
//! on the devices it names, running one request's text → latent at a time on the config's mesh
//! ([`DenoiseStage`]), and the request it runs ([`DenoiseJob`]).
//!
//! Ranks. One rank runs on the calling thread. Several run on persistent rank threads
//! ([`ditstream_common::ranks`]), one per rank, each with its own model copy on its own GPU (on
//! the CPU the ranks share one copy), over communicators formed once when the stage is built:
//! NCCL with `device: cuda`, the in-process backend on the CPU.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Sender, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};

use ditstream_common::collectives::CommWorld;
#[cfg(feature = "cuda")]
use ditstream_common::collectives::DEFAULT_TIMEOUT;
use ditstream_common::collectives::cpu::CpuComm;
use ditstream_common::collectives::wire::TensorWire;
use ditstream_common::config::{AttentionBackend, Config, DeviceKind, SamplerConfig, WarmupShape};
use ditstream_common::devices::{self, first_gpu};
use ditstream_common::mesh::{LatentGeometry, Mesh};
use ditstream_common::ranks::{GroupStatus, RankError, RankGroup, RankState, Ranks, Threads};
use ditstream_kernels::{Device, Tensor};

use crate::denoise::{
    Control, DenoiseError, DenoiseParams, Experts, StepProgress, denoise_interruptible,
    initial_noise,
};
use crate::error::StageError;
use crate::models::{self, DenoiserModels};
use crate::parallel::{self, MeshComms, ParallelError, check_mesh};
use crate::text::TextEncoder;

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
    /// `attention.backend`.
    attention: AttentionBackend,
    /// How a video maps to the latent grid.
    geometry: LatentGeometry,
    ranks: DenoiseRanks,
}

/// Who runs the loop.
enum DenoiseRanks {
    /// One rank, on the calling thread.
    Single(Arc<DenoiserModels>),
    /// A mesh of persistent rank threads (one request at a time: the lock), and its status,
    /// readable while a request holds the lock.
    Mesh(Mutex<Box<dyn Ranks<MeshJob, DenoiseOut>>>, Arc<GroupStatus>),
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
    attention: AttentionBackend,
    /// `parallel_config.async_ulysses`.
    async_ulysses: bool,
    comms: Option<MeshComms<C>>,
}

impl<C> DenoiseRank<C> {
    /// Rank r's state: the model copy and device of rank r, not yet connected; the mesh and the
    /// attention settings of `cfg`.
    fn for_ranks(
        copies: &[Arc<DenoiserModels>],
        devices: &[Device],
        mesh: Mesh,
        cfg: &Config,
    ) -> Vec<Self> {
        copies
            .iter()
            .zip(devices)
            .map(|(models, &device)| DenoiseRank {
                models: Arc::clone(models),
                device,
                mesh,
                attention: cfg.attention.backend,
                async_ulysses: cfg.parallel_config.async_ulysses,
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

    fn connect(&mut self, world: &W) -> Result<(), RankError> {
        let comms = MeshComms::new(world, self.mesh).map_err(|e| RankError::Connect(e.into()))?;
        self.comms = Some(comms.with_async_ulysses(self.async_ulysses));
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
        with_attention(self.attention, || {
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
        })
    }
}

/// Runs `f` with the CUDA attention kernel `attention.backend` names for the calls it makes on
/// this thread (the CPU has one attention kernel).
fn with_attention<T>(backend: AttentionBackend, f: impl FnOnce() -> T) -> T {
    #[cfg(feature = "cuda")]
    {
        use ditstream_kernels::cuda::{AttentionKernel, with_attention_kernel};
        let kernel = match backend {
            AttentionBackend::Auto => AttentionKernel::Auto,
            AttentionBackend::Portable => AttentionKernel::Portable,
        };
        with_attention_kernel(kernel, f)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = backend;
        f()
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
    pub fn from_config(cfg: &Config) -> Result<DenoiseStage, StageError> {
        let mesh = cfg.validate(None)?;
        let devices = devices::rank_devices(cfg, "the denoiser mesh", mesh.world_size())?;
        // The text encoder is built (read from a checkpoint, or drawn on the GPU) while the
        // transformer's weights are read or drawn on the host cores. It runs once per prompt, on
        // rank 0's device; the ranks take its states from there.
        let (text, copies) = std::thread::scope(|scope| {
            let text = scope.spawn(|| models::text_encoder(cfg, devices[0]));
            let copies = models::denoiser_models(cfg, &devices);
            let text = text.join().unwrap_or(Err(StageError::TextEncoderPanicked));
            (text, copies)
        });
        let (text, copies) = (text?, copies?);
        let high = &copies[0].high;
        if high.config().text_dim != text.d_model() {
            return Err(StageError::TextDim {
                text_dim: high.config().text_dim,
                width: text.d_model(),
            });
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
                    DenoiseRank::for_ranks(&copies, &devices, mesh, cfg),
                )?),
                #[cfg(feature = "cuda")]
                DeviceKind::Cuda => Box::new(RankGroup::<
                    ditstream_common::ranks::Nccl,
                    DenoiseRank<ditstream_common::collectives::nccl::NcclComm>,
                >::start(
                    "denoise",
                    ditstream_common::ranks::Nccl {
                        gpus: devices::gpu_ordinals(&devices)?,
                        timeout: DEFAULT_TIMEOUT,
                    },
                    DenoiseRank::for_ranks(&copies, &devices, mesh, cfg),
                )?),
                #[cfg(not(feature = "cuda"))]
                DeviceKind::Cuda => return Err(StageError::NoCuda),
            };
            let status = group.status();
            DenoiseRanks::Mesh(Mutex::new(group), status)
        };
        tracing::info!(%mesh, devices = ?devices, "denoiser stage ready");
        Ok(DenoiseStage {
            text,
            sampler: cfg.sampler.clone(),
            attention: cfg.attention.backend,
            geometry: cfg.geometry(),
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

    /// How a video maps to the latent grid (the config's [`Config::geometry`]).
    pub fn geometry(&self) -> LatentGeometry {
        self.geometry
    }

    /// Latent channels (the transformer's `in_channels`).
    pub fn latent_channels(&self) -> usize {
        self.latent_channels
    }

    /// Prompt and negative prompt, encoded in one batch (repeats come from the cache):
    /// each [1, 512, text_dim], on the text encoder's device (rank 0's, or the host for `tiny`).
    pub fn text_states(&self, p: &DenoiseJob) -> Result<(Tensor, Tensor), StageError> {
        let embeds = self.text.encode(&[&p.prompt, &p.negative_prompt])?;
        Ok((
            embeds.states.narrow(0, 0, 1)?,
            embeds.states.narrow(0, 1, 1)?,
        ))
    }

    /// Runs the text encoder once and one CFG step of each shape (the sampler's guidance, a fixed
    /// prompt that then sits in the text cache), so that every kernel is compiled and every GEMM
    /// planned before the first request. Returns the time each shape took (the first includes
    /// the text encoder's first run).
    pub fn warm_up(&self, shapes: &[WarmupShape]) -> Result<Vec<f64>, StageError> {
        let mut took = Vec::with_capacity(shapes.len());
        let never = AtomicBool::new(false);
        for shape in shapes {
            let t = std::time::Instant::now();
            let job = DenoiseJob {
                prompt: "warm-up".into(),
                negative_prompt: String::new(),
                width: shape.width,
                height: shape.height,
                num_frames: shape.num_frames,
                steps: 1,
                guidance_scale: self.sampler.guidance_scale,
                guidance_scale_2: self.sampler.guidance_scale_2,
                seed: 0,
            };
            let (cond, uncond) = self.text_states(&job)?;
            self.denoise_latent(&job, &cond, &uncond, &never, |_| Control::Continue)
                .map_err(|source| StageError::WarmUp {
                    width: shape.width,
                    height: shape.height,
                    num_frames: shape.num_frames,
                    source,
                })?;
            took.push(ditstream_common::ms(t.elapsed()));
        }
        Ok(took)
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
        let (lt, lh, lw) = self.geometry.latent_grid(p.num_frames, p.height, p.width);
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
                let (cond, uncond) = (to_device(cond)?, to_device(uncond)?);
                with_attention(self.attention, || {
                    denoise_interruptible(
                        experts,
                        &params,
                        noise,
                        &cond,
                        Some(&uncond),
                        &|| interrupted.load(Ordering::Relaxed),
                        on_step,
                    )
                })
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
        .map_err(|e| failed(format!("mesh {mesh}: {e}")))?;
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
