//! `VaeError`: every way loading or running the VAE decoder can fail, carrying the offending values.

use std::path::PathBuf;

use ditstream_common::collectives::wire::WireError;
use ditstream_kernels::KernelError;
use ditstream_kernels::weights::WeightsError;

/// Errors from loading a VAE checkpoint and from decoding.
#[derive(Debug, thiserror::Error)]
pub enum VaeError {
    /// A file of the checkpoint folder could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// `config.json` (or a safetensors index) is not valid JSON for the expected schema; serde's
    /// message names the key (an unknown key included).
    #[error("{path}: {source}")]
    ConfigParse {
        /// The file.
        path: PathBuf,
        /// serde's message (names the key and the line).
        source: serde_json::Error,
    },
    /// A config key holds a value this decoder does not support or that breaks a rule.
    #[error("{path}: `{key}` = {value} but {rule}")]
    ConfigValue {
        /// The file (or `<in memory>` for a config built in code).
        path: PathBuf,
        /// The key.
        key: &'static str,
        /// Its value, formatted.
        value: String,
        /// The rule it breaks.
        rule: String,
    },
    /// A checkpoint tensor is missing, has the wrong shape or dtype, or a weights file is unreadable;
    /// the message names the tensor, the file and the shapes.
    #[error(transparent)]
    Weights(#[from] WeightsError),
    /// A latent chunk is not [B, z_dim, T, h, w].
    #[error("latent chunk must be [B, {z_dim}, T, h, w] (rank 5); got shape {shape:?}")]
    LatentRank {
        /// The config's latent channel count.
        z_dim: usize,
        /// The shape given.
        shape: Vec<usize>,
    },
    /// A latent chunk has the wrong channel count for the config.
    #[error("latent chunk has {got} channels but this VAE's z_dim is {expected} (shape {shape:?})")]
    LatentChannels {
        /// z_dim.
        expected: usize,
        /// Channels given.
        got: usize,
        /// The shape given.
        shape: Vec<usize>,
    },
    /// A latent chunk holds no frames (or a zero batch).
    #[error("latent chunk must hold at least one frame and one batch entry; got shape {shape:?}")]
    EmptyChunk {
        /// The shape given.
        shape: Vec<usize>,
    },
    /// A stream's latent height or width is zero.
    #[error("latent size {height}×{width} cannot be decoded: both must be ≥ 1")]
    EmptyLatentSize {
        /// Latent rows.
        height: usize,
        /// Latent columns.
        width: usize,
    },
    /// A chunk's spatial size or batch differs from the stream's.
    #[error(
        "latent chunk is [B={got_batch}, h={got_height}, w={got_width}] but the stream was opened \
         for [B={batch}, h={height}, w={width}]"
    )]
    ChunkMismatch {
        /// The stream's batch (from its first chunk).
        batch: usize,
        /// The stream's latent height.
        height: usize,
        /// The stream's latent width.
        width: usize,
        /// The chunk's batch.
        got_batch: usize,
        /// The chunk's latent height.
        got_height: usize,
        /// The chunk's latent width.
        got_width: usize,
    },
    /// A stream state was made by a decoder with a different layout (its cache slot count differs).
    #[error(
        "stream state has {got} cache slots but this decoder has {expected}: it belongs to another decoder"
    )]
    ForeignStream {
        /// This decoder's slot count.
        expected: usize,
        /// The state's slot count.
        got: usize,
    },
    /// A tensor op failed (a shape or device error inside the decoder).
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// A collective of a spatially sharded decode (parallel VAE, [`SpatialOps`](super::SpatialOps)
    /// implementations that communicate) failed: a peer rank failed, left or timed out.
    #[error(transparent)]
    Collective(#[from] ditstream_common::collectives::CollectiveError),
    /// A tensor could not cross the parallel VAE's communicator for a reason of its own (dtype,
    /// device); a transfer's collective and tensor failures are [`Self::Collective`] and
    /// [`Self::Kernel`].
    #[error(transparent)]
    Wire(WireError),
}

impl From<WireError> for VaeError {
    /// A transfer's collective failure stays a collective failure, so the parallel VAE reports a
    /// failed peer the same way wherever it surfaced
    /// ([`ParallelVaeError`](crate::parallel::ParallelVaeError)).
    fn from(err: WireError) -> Self {
        match err {
            WireError::Collective(err) => VaeError::Collective(err),
            WireError::Kernel(err) => VaeError::Kernel(err),
            err => VaeError::Wire(err),
        }
    }
}

/// Result alias for the VAE module.
pub type Result<T> = std::result::Result<T, VaeError>;
