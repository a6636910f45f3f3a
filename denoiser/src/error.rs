//! `StageError`: how the denoiser pool's runtime fails — building its models from the config
//! (`models`), starting and running its stage (`stage`), starting its service (`service`).
//! The model, loop and mesh keep their own errors; this one wraps them with what the runtime
//! was doing.

use std::path::PathBuf;

use ditstream_common::config::{ConfigError, ModelConfig, Preset, WeightSource};
use ditstream_common::devices::{BuildError, DeviceError};
use ditstream_common::link::LinkError;
use ditstream_common::ranks::RankError;
use ditstream_common::registration::ServeError;
use ditstream_kernels::KernelError;

use crate::denoise::DenoiseError;
use crate::model::ModelError;
use crate::parallel::ParallelError;
use crate::text::TextError;

/// Every way the denoiser pool's runtime fails, carrying the offending values.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// The config is invalid (or its mesh does not fit).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The ranks cannot be placed on the devices the config names.
    #[error(transparent)]
    Devices(#[from] DeviceError),
    /// A transformer could not be built or read.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A transformer could not be built on one of the devices.
    #[error(transparent)]
    Build(#[from] BuildError<ModelError>),
    /// The text encoder could not be built, or could not encode.
    #[error(transparent)]
    Text(#[from] TextError),
    /// A tensor op failed.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// The mesh does not fit the transformer.
    #[error(transparent)]
    Parallel(#[from] ParallelError),
    /// The mesh's rank threads could not start or form their communicators.
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
    /// A Wan2.2-A14B checkpoint's `model_index.json` could not be read.
    #[error("reading {}: {source}", .path.display())]
    ReadIndex {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A Wan2.2-A14B checkpoint's `model_index.json` is not JSON.
    #[error("parsing {}: {source}", .path.display())]
    ParseIndex {
        /// The file.
        path: PathBuf,
        /// serde's message.
        source: serde_json::Error,
    },
    /// A checkpoint with a low-noise expert names no boundary ratio.
    #[error(
        "{}: transformer_2/ exists but boundary_ratio is not a number",
        .path.display()
    )]
    BoundaryRatio {
        /// `model_index.json`.
        path: PathBuf,
    },
    /// Building the text encoder panicked.
    #[error("building the text encoder panicked")]
    TextEncoderPanicked,
    /// The transformer and the text encoder do not fit together.
    #[error("the transformer's text_dim {text_dim} differs from the text encoder's width {width}")]
    TextDim {
        /// The transformer's `text_dim`.
        text_dim: usize,
        /// The text encoder's `d_model`.
        width: usize,
    },
    /// A mesh on GPUs in a build without the `cuda` feature.
    #[cfg(not(feature = "cuda"))]
    #[error("serving.device = cuda: this binary was built without CUDA")]
    NoCuda,
    /// A warm-up step failed.
    #[error("warming up the denoiser at {width}x{height}, {num_frames} frames: {source}")]
    WarmUp {
        /// Video width.
        width: usize,
        /// Video height.
        height: usize,
        /// Video frames.
        num_frames: usize,
        /// The loop's error.
        source: DenoiseError,
    },
    /// The start-up task (building and warming the stage) did not finish.
    #[error(transparent)]
    StartTask(#[from] tokio::task::JoinError),
    /// The latent link's pool end could not be set up (its TLS identity).
    #[error(transparent)]
    Link(#[from] LinkError),
    /// The pool's gRPC service could not start serving.
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
