//! A decoder instance's stage: the VAE (one rank, or a parallel-VAE instance of several) and the
//! H.264 encoder pool, built once from the config, decoding any number of requests' latents chunk
//! by chunk into fragmented-MP4 segments ([`DecodeStage`], [`DecodeSession`]), and the request it
//! runs ([`DecodeJob`]).
//!
//! Encoding beside decoding. The VAE's thread only decodes: each segment whose frames are all
//! decoded goes to the encoder pool ([`EncoderPool`]: colour conversion, H.264, muxing), and the
//! VAE goes on with the next chunk while the segment encodes. [`DecodeSession::push`] returns a
//! [`SegmentTicket`] per segment submitted; waiting on the tickets in order gives the segments in
//! order.
//!
//! Ranks. One rank runs on the calling thread. Several run on persistent rank threads
//! ([`ditstream_common::ranks`]), one per rank, each with its own model copy on its own GPU (on
//! the CPU the ranks share one copy), over communicators formed once when the stage is built:
//! NCCL with `device: cuda`, the in-process backend on the CPU.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use ditstream_common::collectives::CommWorld;
#[cfg(feature = "cuda")]
use ditstream_common::collectives::DEFAULT_TIMEOUT;
use ditstream_common::collectives::cpu::CpuComm;
use ditstream_common::collectives::wire::TensorWire;
use ditstream_common::config::{Config, DeviceKind, EncoderKind, VaeSplitDim, WarmupShape};
use ditstream_common::devices::{self, first_gpu};
use ditstream_common::mesh::LatentGeometry;
use ditstream_common::ms;
use ditstream_common::ranks::{GroupStatus, RankError, RankGroup, RankState, Ranks, Threads};
use ditstream_kernels::{DType, Device, Tensor};

use crate::encode::{
    EncoderBackend, EncoderPool, MediaSegment, OpenEncoder, OpenH264Options, RgbFrame, SegmentPlan,
    StreamInfo, Ticket, VideoParams, X264Options, Yuv420Frame, encode_segment,
    encode_single_fragment, vae_output_to_rgb,
};
use crate::error::StageError;
use crate::models;
use crate::parallel::{ParallelDecodeStream, ParallelVaeDecoder};
use crate::vae::{DecodeStream, WanVaeDecoder};

/// Largest segment the server builds (frames); longer ones only delay the first picture.
pub const MAX_SEGMENT_FRAMES: u32 = 64;

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

/// The decoder pool's half: VAE and H.264 encoder pool.
pub struct DecodeStage {
    encoder: Arc<dyn OpenEncoder>,
    encoders: EncoderPool,
    /// Latent channels the VAE decodes.
    z_dim: usize,
    /// Rank r's device.
    devices: Vec<Device>,
    /// Rank 0's VAE, for the unsharded reference decode ([`DecodeStage::render_whole`]).
    whole: Arc<WanVaeDecoder>,
    /// How a video maps to the latent grid (checked against the VAE at start).
    geometry: LatentGeometry,
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
    Refused(StageError),
    /// Failed while communicating: the instance must form fresh communicators.
    Failed(StageError),
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

    fn connect(&mut self, world: &W) -> Result<(), RankError> {
        let all: Vec<usize> = (0..world.world_size()).collect();
        let comm = world.split(&[all])?.ok_or_else(|| {
            RankError::Connect(Box::new(StageError::NotInGroup {
                rank: world.rank(),
                ranks: world.world_size(),
            }))
        })?;
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
            return VaeOut::Refused(StageError::NotConnected);
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
                    return VaeOut::Refused(StageError::NoSession { session });
                };
                let mut step = || -> Result<Option<Tensor>, StageError> {
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
    fn step(&mut self, job: impl Fn() -> VaeJob) -> Result<Option<Tensor>, StageError> {
        let jobs = (0..self.ranks.size()).map(|_| job()).collect();
        let replies = self.ranks.run(jobs)?;
        let mut first = None;
        let mut error = None;
        for (rank, reply) in self.ranks.replies(&replies).into_iter().enumerate() {
            match reply {
                Ok(VaeOut::Done(video)) if rank == 0 => first = video,
                Ok(VaeOut::Done(_)) => {}
                Ok(VaeOut::Refused(e) | VaeOut::Failed(e)) => {
                    error.get_or_insert(StageError::Rank {
                        rank,
                        source: Box::new(e),
                    });
                }
                Err(message) => {
                    error.get_or_insert(StageError::RankPanicked { rank, message });
                }
            }
        }
        match error {
            Some(e) => Err(e),
            None => Ok(first),
        }
    }
}

/// One request's decode state: the VAE's causal caches and the frames of the segment being
/// gathered.
pub struct DecodeSession<'a> {
    stage: &'a DecodeStage,
    vae: SessionVae,
    stream: Arc<StreamInfo>,
    latent_frames: usize,
    latent_frames_done: usize,
    latent_size: (usize, usize),
    /// The decoded frames of the segment not yet submitted: chunks of video [1, 3, F, H, W] on
    /// the host, in [−1, 1], each with the range of its frames that belong to the segment.
    current: Vec<(Tensor, std::ops::Range<usize>)>,
    /// Frames in `current`.
    current_frames: usize,
    /// Video frames decoded so far.
    pub frames: u32,
    /// Segments submitted to the encoders so far.
    pub segments: u32,
    /// VAE time so far (the device-to-host copy of the frames included).
    pub decode_ms: f64,
}

/// One encoded segment and what encoding it took (colour conversion, H.264, muxing) on its
/// encoder thread.
#[derive(Debug)]
pub struct Encoded {
    /// The `moof` + `mdat`.
    pub segment: MediaSegment,
    /// Time spent encoding it.
    pub encode_ms: f64,
}

/// A segment being encoded: wait on it (blocking or async) for the segment, or why it failed.
pub struct SegmentTicket(Ticket<Result<Encoded, StageError>>);

impl SegmentTicket {
    /// Waits on this (non-async) thread.
    pub fn wait(self) -> Result<Encoded, StageError> {
        self.0
            .wait()
            .map_err(|message| StageError::EncoderThread { message })?
    }

    /// Waits in an async task.
    pub async fn recv(self) -> Result<Encoded, StageError> {
        self.0
            .recv()
            .await
            .map_err(|message| StageError::EncoderThread { message })?
    }
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
    pub fn from_config(cfg: &Config) -> Result<DecodeStage, StageError> {
        let vae_ranks = cfg.vae_layout().size();
        let devices = devices::rank_devices(cfg, "a decoder instance", vae_ranks)?;
        let copies = models::vae_decoders(cfg, &devices)?;
        let z_dim = copies[0].config().z_dim;
        let geometry = cfg.geometry();
        let (spatial, temporal) = copies[0].config().scale_factors();
        if (spatial, temporal) != (geometry.spatial, geometry.temporal) {
            return Err(StageError::Geometry {
                spatial,
                temporal,
                geometry_spatial: geometry.spatial,
                geometry_temporal: geometry.temporal,
            });
        }
        let encoder = match cfg.serving.encoder {
            EncoderKind::Openh264 => EncoderBackend::OpenH264(OpenH264Options::default()),
            EncoderKind::X264 => EncoderBackend::X264(X264Options::default()),
        };
        // Fail at start-up, not on the first request, when the backend is not in this build.
        let probe = VideoParams {
            width: 16,
            height: 16,
            fps: 16,
        };
        encoder
            .parameter_sets(probe)
            .and_then(|sets| encoder.open_segment(probe, &sets, 0))
            .map_err(|source| StageError::EncoderBackend {
                encoder: cfg.serving.encoder,
                source,
            })?;
        let encoder_threads = cfg.serving.encoder_threads();
        let encoders =
            EncoderPool::new(encoder_threads).map_err(|source| StageError::EncoderThreads {
                threads: encoder_threads,
                source,
            })?;
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
                    ditstream_common::ranks::Nccl,
                    VaeRank<ditstream_common::collectives::nccl::NcclComm>,
                >::start(
                    "vae",
                    ditstream_common::ranks::Nccl {
                        gpus: devices::gpu_ordinals(&devices)?,
                        timeout: DEFAULT_TIMEOUT,
                    },
                    VaeRank::for_ranks(&copies, split),
                )?),
                #[cfg(not(feature = "cuda"))]
                DeviceKind::Cuda => return Err(StageError::NoCuda),
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
        tracing::info!(vae_ranks, devices = ?devices, encoder_threads, "decoder stage ready");
        Ok(DecodeStage {
            encoder: Arc::new(encoder),
            encoders,
            z_dim,
            devices,
            whole: Arc::clone(&copies[0]),
            geometry,
            vae,
        })
    }

    /// The stage with `encoder` in place of the configured backend: the seam through which tests
    /// make encoding fail.
    pub fn with_encoder(mut self, encoder: Arc<dyn OpenEncoder>) -> DecodeStage {
        self.encoder = encoder;
        self
    }

    /// Encoder threads (0: segments encode on the VAE's thread).
    pub fn encoder_threads(&self) -> usize {
        self.encoders.threads()
    }

    /// How a video maps to the latent grid.
    pub fn geometry(&self) -> LatentGeometry {
        self.geometry
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
    pub fn start(&self, p: &DecodeJob) -> Result<DecodeSession<'_>, StageError> {
        let (lt, lh, lw) = self.geometry.latent_grid(p.num_frames, p.height, p.width);
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
        let stream = StreamInfo::new(&*self.encoder, video_params(p), segment_plan(p)?)?;
        Ok(DecodeSession {
            stage: self,
            vae,
            stream: Arc::new(stream),
            latent_frames: lt,
            latent_frames_done: 0,
            latent_size: (lh, lw),
            current: Vec::new(),
            current_frames: 0,
            frames: 0,
            segments: 0,
            decode_ms: 0.0,
        })
    }

    /// Decodes and encodes a zero latent of each shape once, the first three latent frames of it
    /// (chunks 0, 1 and 2 meet every shape a decode has: caches of 0, 1 and 2 frames; later
    /// chunks repeat chunk 2's): every kernel compiles, every GEMM and convolution is planned
    /// (from the plan cache when it has them), and the memory pool grows to a chunk's peak before
    /// the first request. Returns the time each shape took.
    pub fn warm_up(&self, shapes: &[WarmupShape], fps: u32) -> Result<Vec<f64>, StageError> {
        let mut took = Vec::with_capacity(shapes.len());
        for shape in shapes {
            let t = Instant::now();
            let num_frames = shape.num_frames.min(2 * self.geometry.temporal + 1);
            let job = DecodeJob {
                width: shape.width,
                height: shape.height,
                num_frames,
                fps,
                segment_frames: self.geometry.temporal,
            };
            let (lt, lh, lw) = self
                .geometry
                .latent_grid(num_frames, shape.height, shape.width);
            let latent = Tensor::zeros(&[1, self.z_dim, lt, lh, lw], DType::F32, Device::Cpu)?;
            self.render_streamed(&job, &latent)
                .map_err(|e| StageError::WarmUp {
                    width: shape.width,
                    height: shape.height,
                    num_frames: shape.num_frames,
                    source: Box::new(e),
                })?;
            took.push(ms(t.elapsed()));
        }
        Ok(took)
    }

    /// The streamed path without a service: `latent` decoded one latent frame per chunk as a
    /// stream of chunks would be, its segments encoded beside the decode; returns the init
    /// segment and every media segment concatenated (a whole fragmented MP4).
    pub fn render_streamed(&self, p: &DecodeJob, latent: &Tensor) -> Result<Vec<u8>, StageError> {
        let mut session = self.start(p)?;
        let mut mp4 = session.init_segment().0;
        let mut tickets = Vec::new();
        for t in 0..latent.shape()[2] {
            tickets.extend(session.push(&latent.narrow(2, t, 1)?)?);
        }
        for ticket in tickets {
            mp4.extend(ticket.wait()?.segment.bytes);
        }
        Ok(mp4)
    }

    /// The non-streamed path, for reference: the whole latent decoded at once, unsharded, on the
    /// first rank's device, then every frame encoded into a single-fragment MP4 with the same
    /// keyframes. Streaming must produce the same pictures.
    pub fn render_whole(&self, p: &DecodeJob, latent: &Tensor) -> Result<Vec<u8>, StageError> {
        let frames = to_rgb(&self.whole.decode(latent)?)?;
        Ok(encode_single_fragment(
            &*self.encoder,
            video_params(p),
            segment_plan(p)?,
            &frames,
        )?)
    }
}

impl DecodeSession<'_> {
    /// The init segment (`ftyp` + `moov`) and its MIME type with codecs.
    pub fn init_segment(&self) -> (Vec<u8>, String) {
        (self.stream.init_segment(), self.stream.mime_type())
    }

    /// Decodes the next latent frames [1, C, n, h, w] (host or device) into video frames
    /// [1, 3, F, H, W] on the host, in [−1, 1], without encoding them (the VAE caches advance).
    pub fn decode(&mut self, latent: &Tensor) -> Result<Tensor, StageError> {
        let s = latent.shape();
        let n = s.get(2).copied().unwrap_or(0);
        let (lh, lw) = self.latent_size;
        if s.len() != 5 || s[0] != 1 || s[1] != self.stage.z_dim || s[3] != lh || s[4] != lw {
            return Err(StageError::ChunkShape {
                shape: s.to_vec(),
                z_dim: self.stage.z_dim,
                height: lh,
                width: lw,
            });
        }
        if n == 0 || self.latent_frames_done + n > self.latent_frames {
            return Err(StageError::TooManyFrames {
                done: self.latent_frames_done,
                end: self.latent_frames_done + n,
                total: self.latent_frames,
            });
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
                    return Err(StageError::SessionLost {
                        session: *session,
                        connections: *connections,
                    });
                }
                let session = *session;
                sharded
                    .step(|| VaeJob::Chunk {
                        session,
                        latent: latent.clone(),
                    })?
                    .ok_or(StageError::NoFrames { session })?
            }
            _ => return Err(StageError::ForeignSession),
        };
        self.decode_ms += ms(t.elapsed());
        self.latent_frames_done += n;
        Ok(video)
    }

    /// Decodes the next latent frames [1, C, n, h, w] and hands every segment they complete to
    /// the encoders (after the last latent frame, the final segment too); returns the segments'
    /// tickets, in order. Waits only while the encoders' queue is full.
    pub fn push(&mut self, latent: &Tensor) -> Result<Vec<SegmentTicket>, StageError> {
        // The frames are handed over as the VAE left them (a shared host tensor, no copy): the
        // conversion to f32, RGB and YUV happens on the encoder threads, so the VAE's thread goes
        // straight back to the next chunk.
        let video = self.decode(latent)?;
        let frames = video.shape()[2];
        let mut tickets = Vec::new();
        let mut from = 0;
        for t in 0..frames {
            let index = u64::from(self.frames);
            self.frames += 1;
            self.current_frames += 1;
            let (_, first, planned) = self.stream.plan.segment_of(index);
            if index + 1 == first + u64::from(planned) {
                self.current.push((video.clone(), from..t + 1));
                from = t + 1;
                tickets.push(self.submit(first));
            }
        }
        if from < frames {
            self.current.push((video, from..frames));
        }
        if self.is_done() && self.current_frames > 0 {
            let first = u64::from(self.frames) - self.current_frames as u64;
            tickets.push(self.submit(first));
        }
        Ok(tickets)
    }

    /// Hands the gathered frames, the segment starting at `first`, to the encoders.
    fn submit(&mut self, first: u64) -> SegmentTicket {
        let chunks = std::mem::take(&mut self.current);
        let count = std::mem::take(&mut self.current_frames);
        let (encoder, stream) = (Arc::clone(&self.stage.encoder), Arc::clone(&self.stream));
        self.segments += 1;
        SegmentTicket(self.stage.encoders.submit(move || {
            let t = Instant::now();
            let last = first + count as u64 - 1;
            let encode = || -> Result<MediaSegment, StageError> {
                let mut yuv = Vec::with_capacity(count);
                for (video, range) in &chunks {
                    yuv.extend(chunk_to_yuv(video, range.clone())?);
                }
                Ok(encode_segment(&*encoder, &stream, first, &yuv)?)
            };
            let segment = encode().map_err(|e| StageError::EncodeSegment {
                segment: stream.plan.segment_of(first).0,
                first,
                last,
                source: Box::new(e),
            })?;
            Ok(Encoded {
                segment,
                encode_ms: ms(t.elapsed()),
            })
        }))
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
            tracing::warn!(error = %e, session, "ending a VAE session failed");
        }
    }
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The guarded values are rank groups and session counters, whose state stays consistent across a panic in a
    // caller (every field update is a single assignment).
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn video_params(p: &DecodeJob) -> VideoParams {
    VideoParams {
        width: p.width as u32,
        height: p.height as u32,
        fps: p.fps,
    }
}

/// Frame 0 alone (the first picture leaves as soon as latent frame 0 is decoded), then
/// `segment_frames` each, the last one cut in two halves that encode in parallel (see
/// [`SegmentPlan::split_last`]).
fn segment_plan(p: &DecodeJob) -> Result<SegmentPlan, StageError> {
    Ok(SegmentPlan::new(1, p.segment_frames as u32)?.split_last(p.num_frames as u64))
}

/// Frames `range` of VAE output [1, 3, F, H, W] in [−1, 1] (any device) → YUV 4:2:0 frames.
fn chunk_to_yuv(
    video: &Tensor,
    range: std::ops::Range<usize>,
) -> Result<Vec<Yuv420Frame>, StageError> {
    let s = video.shape();
    let (frames, h, w) = (s[2], s[3], s[4]);
    let plane = h * w;
    let data = video.to_vec_f32()?;
    let mut out = Vec::with_capacity(range.len());
    let mut frame = Vec::with_capacity(3 * plane);
    for t in range {
        frame.clear();
        for c in 0..3 {
            let at = (c * frames + t) * plane;
            frame.extend_from_slice(&data[at..at + plane]);
        }
        let rgb = vae_output_to_rgb(&frame, 3, 1, h, w)?;
        out.push(Yuv420Frame::from_rgb(&rgb[0])?);
    }
    Ok(out)
}

/// VAE output [1, 3, F, H, W] in [−1, 1] (any device) → RGB frames.
pub fn to_rgb(video: &Tensor) -> Result<Vec<RgbFrame>, StageError> {
    let s = video.shape();
    Ok(vae_output_to_rgb(
        &video.to_vec_f32()?,
        s[1],
        s[2],
        s[3],
        s[4],
    )?)
}
