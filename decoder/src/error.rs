//! `StageError`: how the decoder pool's runtime fails — building its VAE from the config
//! (`models`), starting its stage and decoding requests chunk by chunk (`stage`), serving them
//! (`service`). The VAE, the parallel VAE and the encoders keep their own errors; this one wraps
//! them with what the runtime was doing.

use std::path::PathBuf;

use ditstream_common::config::{ConfigError, EncoderKind, ModelConfig, Preset, WeightSource};
use ditstream_common::devices::{BuildError, DeviceError};
use ditstream_common::link::LinkError;
use ditstream_common::ranks::RankError;
use ditstream_common::registration::ServeError;
use ditstream_kernels::KernelError;

use crate::encode::EncodeError;
use crate::parallel::ParallelVaeError;
use crate::vae::VaeError;

/// Every way the decoder pool's runtime fails, carrying the offending values.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// The config is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The ranks cannot be placed on the devices the config names.
    #[error(transparent)]
    Devices(#[from] DeviceError),
    /// The VAE could not be built, read or run.
    #[error(transparent)]
    Vae(#[from] VaeError),
    /// The VAE could not be built on one of the devices.
    #[error(transparent)]
    Build(#[from] BuildError<VaeError>),
    /// A rank of a parallel-VAE instance refused or failed its step.
    #[error(transparent)]
    ParallelVae(#[from] ParallelVaeError),
    /// Encoding (colour conversion, H.264, muxing) failed.
    #[error(transparent)]
    Encode(#[from] EncodeError),
    /// A tensor op failed.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// A parallel-VAE instance's rank threads could not start, form their communicators or take
    /// a step.
    #[error(transparent)]
    Ranks(#[from] RankError),
    /// A model source the config's validation should have refused.
    #[error("model: validation should have refused this combination")]
    Unvalidated {
        /// `model.weights`.
        weights: WeightSource,
        /// `model.checkpoint`.
        checkpoint: Option<PathBuf>,
        /// `model.preset`.
        preset: Option<Preset>,
    },
    /// A preset whose VAE this decoder does not have.
    #[error(
        "model.preset = {preset}: its VAE is the Wan 2.2 VAE (z 48), which is not built yet; \
         the decoder runs the Wan 2.1 VAE (z 16)"
    )]
    UnbuiltVae {
        /// The preset.
        preset: Preset,
    },
    /// The VAE's compression differs from the model's latent geometry.
    #[error(
        "the VAE compresses {spatial}x{spatial} in space and {temporal}x in time, but the model's \
         geometry says {geometry_spatial}x{geometry_spatial} and {geometry_temporal}x"
    )]
    Geometry {
        /// The VAE's spatial factor.
        spatial: usize,
        /// The VAE's temporal factor.
        temporal: usize,
        /// The geometry's spatial factor.
        geometry_spatial: usize,
        /// The geometry's temporal factor.
        geometry_temporal: usize,
    },
    /// The configured encoder backend cannot open a stream in this build.
    #[error("serving.encoder = {encoder:?}: {source}")]
    EncoderBackend {
        /// `serving.encoder`.
        encoder: EncoderKind,
        /// The backend's refusal.
        source: EncodeError,
    },
    /// The encoder threads could not be started.
    #[error("starting {threads} encoder threads: {source}")]
    EncoderThreads {
        /// Threads asked for.
        threads: usize,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A parallel-VAE instance on GPUs in a build without the `cuda` feature.
    #[cfg(not(feature = "cuda"))]
    #[error("serving.device = cuda: this binary was built without CUDA")]
    NoCuda,
    /// A rank's split of a one-group world gave it no communicator (a bug in the split).
    #[error("every rank is in the instance's one group")]
    NotInGroup {
        /// The rank.
        rank: usize,
        /// Ranks in the world.
        ranks: usize,
    },
    /// A step reached a VAE rank whose last join failed.
    #[error("this VAE rank is not connected")]
    NotConnected,
    /// A chunk or end reached a VAE rank that has no stream for its session.
    #[error("no VAE stream for session {session}")]
    NoSession {
        /// The session.
        session: u64,
    },
    /// A rank of a parallel-VAE instance refused or failed a step.
    #[error("VAE rank {rank}: {source}")]
    Rank {
        /// The rank.
        rank: usize,
        /// Its error.
        source: Box<StageError>,
    },
    /// A rank of a parallel-VAE instance panicked in a step.
    #[error("VAE rank {rank}: {message}")]
    RankPanicked {
        /// The rank.
        rank: usize,
        /// The panic, as the rank reported it.
        message: String,
    },
    /// Rank 0 of a parallel-VAE instance gave back no frames for a chunk.
    #[error("rank 0 of a VAE instance always receives the frames")]
    NoFrames {
        /// The request's session.
        session: u64,
    },
    /// A chunk does not have the request's latent shape.
    #[error(
        "latent chunk shape {shape:?}: this request's latent is [1, {z_dim}, n, {height}, {width}]"
    )]
    ChunkShape {
        /// The chunk's shape.
        shape: Vec<usize>,
        /// Latent channels.
        z_dim: usize,
        /// The request's latent height.
        height: usize,
        /// The request's latent width.
        width: usize,
    },
    /// A chunk holds no frames, or more than the request has left.
    #[error("latent frames {done}..{end} exceed the request's {total} latent frames")]
    TooManyFrames {
        /// Latent frames decoded before the chunk.
        done: usize,
        /// One past the chunk's last latent frame.
        end: usize,
        /// The request's latent frames.
        total: usize,
    },
    /// The parallel-VAE instance re-formed its ranks since this request started: its decode
    /// state is gone.
    #[error(
        "the decoder instance failed on another request and its ranks were re-formed: this \
         request's decode state is gone"
    )]
    SessionLost {
        /// The request's session.
        session: u64,
        /// The instance's connection count when the session started.
        connections: u64,
    },
    /// A session was used with a stage other than the one that started it.
    #[error("a decode session of another stage")]
    ForeignSession,
    /// A segment failed to encode.
    #[error("encoding segment {segment} (frames {first}..={last}): {source}")]
    EncodeSegment {
        /// The segment's sequence number.
        segment: u32,
        /// Its first frame.
        first: u64,
        /// Its last frame.
        last: u64,
        /// Why.
        source: Box<StageError>,
    },
    /// A segment's encoder thread panicked or stopped.
    #[error("{message}")]
    EncoderThread {
        /// What the encoder pool reported.
        message: String,
    },
    /// A warm-up decode failed.
    #[error("warming up the decoder at {width}x{height}, {num_frames} frames: {source}")]
    WarmUp {
        /// Video width.
        width: usize,
        /// Video height.
        height: usize,
        /// Video frames asked for (the warm-up decodes at most three latent frames of them).
        num_frames: usize,
        /// Why.
        source: Box<StageError>,
    },
    /// The gateway stopped reading the decode's events, or the forwarder ended.
    #[error("the gateway went away")]
    GatewayGone,
    /// No latent chunk arrived in time.
    #[error("no latent chunk for {seconds} s")]
    ChunkTimeout {
        /// The timeout.
        seconds: u64,
    },
    /// The latent link stopped delivering before the request's last chunk.
    #[error("the latent link closed before the last chunk")]
    LinkClosed,
    /// The request's chunk stream failed on the latent link, or its pool end could not be set
    /// up (the TLS identity, the listener).
    #[error(transparent)]
    Link(#[from] LinkError),
    /// A chunk arrived with a shape other than the request's latent.
    #[error(
        "chunk {chunk_index} has shape {shape:?}; this request's latent is [1, {channels}, n, \
         {height}, {width}]"
    )]
    ArrivedShape {
        /// The chunk's index.
        chunk_index: u32,
        /// Its shape.
        shape: Vec<u64>,
        /// Latent channels.
        channels: u64,
        /// The request's latent height.
        height: u64,
        /// The request's latent width.
        width: u64,
    },
    /// The start-up task (building and warming the stage) did not finish.
    #[error(transparent)]
    StartTask(#[from] tokio::task::JoinError),
    /// The instance's gRPC service could not start serving.
    #[error(transparent)]
    Serve(#[from] ServeError),
}

impl StageError {
    /// The model source `m` names, which validation should have refused.
    pub(crate) fn unvalidated(m: &ModelConfig) -> StageError {
        StageError::Unvalidated {
            weights: m.weights,
            checkpoint: m.checkpoint.clone(),
            preset: m.preset,
        }
    }
}
