//! `ParallelVaeError`: every way a parallel-VAE rank can fail, carrying the offending values.

use ditstream_common::collectives::CollectiveError;
use ditstream_common::collectives::wire::WireError;
use ditstream_common::config::VaeSplitDim;

use crate::vae::VaeError;

/// Errors of one rank of a parallel-VAE instance.
#[derive(Debug, thiserror::Error)]
pub enum ParallelVaeError {
    /// The split dimension has fewer latent rows than the instance has ranks.
    #[error(
        "a {latent_height}×{latent_width} latent cannot be split along {split_dim:?} over {size} \
         ranks: its {extent} latent rows must be at least the number of ranks"
    )]
    SplitTooFine {
        /// The split dimension.
        split_dim: VaeSplitDim,
        /// Latent rows (or columns) along it.
        extent: usize,
        /// The latent's height.
        latent_height: usize,
        /// The latent's width.
        latent_width: usize,
        /// Ranks in the instance (`parallel_vae_size`).
        size: usize,
    },
    /// A group rank is not in the instance.
    #[error("rank {rank} is not a rank of a parallel-VAE instance of {size} ranks")]
    RankOutOfRange {
        /// The rank.
        rank: usize,
        /// Ranks in the instance.
        size: usize,
    },
    /// A tensor given as the whole latent does not have the stream's latent size.
    #[error(
        "the whole latent must be [B, C, T, {latent_height}, {latent_width}]; got shape {shape:?}"
    )]
    WholeLatentShape {
        /// The stream's latent height.
        latent_height: usize,
        /// The stream's latent width.
        latent_width: usize,
        /// The shape given.
        shape: Vec<usize>,
    },
    /// A latent chunk given to a rank is not that rank's band of the stream's latent.
    #[error(
        "rank {rank} owns latent {split_dim:?} rows {band_start}..{band_end} of a \
         {latent_height}×{latent_width} latent, so its chunk must be [B, C, T, {expected_height}, \
         {expected_width}]; got shape {shape:?}"
    )]
    BandShape {
        /// The caller's group rank.
        rank: usize,
        /// The split dimension.
        split_dim: VaeSplitDim,
        /// First latent row of the band.
        band_start: usize,
        /// One past its last latent row.
        band_end: usize,
        /// The whole latent's height.
        latent_height: usize,
        /// The whole latent's width.
        latent_width: usize,
        /// The band's height.
        expected_height: usize,
        /// The band's width.
        expected_width: usize,
        /// The shape given.
        shape: Vec<usize>,
    },
    /// Decoded frames given to the gather are not this rank's band of the video.
    #[error(
        "rank {rank}: frames to gather must be [B, C, F, h, w] with {expected_rows} rows along the \
         split axis (the band at spatial scale {scale}); got shape {shape:?}"
    )]
    FramesShape {
        /// The caller's group rank.
        rank: usize,
        /// The decoder's spatial scale.
        scale: usize,
        /// The band's extent along the split axis at that scale.
        expected_rows: usize,
        /// The shape given.
        shape: Vec<usize>,
    },
    /// A stream was opened by a parallel decoder of another layout (rank, size or split).
    #[error(
        "stream was opened for rank {stream_rank} of {stream_size} split along {stream_split:?}, \
         but this decoder is rank {rank} of {size} split along {split:?}"
    )]
    ForeignStream {
        /// The stream's rank.
        stream_rank: usize,
        /// The stream's instance size.
        stream_size: usize,
        /// The stream's split dimension.
        stream_split: VaeSplitDim,
        /// This decoder's rank.
        rank: usize,
        /// This decoder's instance size.
        size: usize,
        /// This decoder's split dimension.
        split: VaeSplitDim,
    },
    /// Another rank of the instance rejected its part of the same chunk (its own error says why);
    /// no rank decoded it, and the instance stays usable.
    #[error("rank {peer} of the parallel-VAE instance {ranks:?} rejected its part of this chunk")]
    PeerRejected {
        /// The first rejecting group rank.
        peer: usize,
        /// The instance's global ranks.
        ranks: Vec<usize>,
    },
    /// The ranks were given different chunks (batch, frame count, latent size or stream position
    /// differ); no rank decoded it, and the instance stays usable.
    #[error(
        "ranks disagree about this chunk: rank {rank} has {ours:?}, rank {peer} has {theirs:?} \
         (batch, latent frames, latent height, latent width, latent frames decoded)"
    )]
    RanksDisagree {
        /// The caller's group rank.
        rank: usize,
        /// Its chunk description.
        ours: Vec<i64>,
        /// The first disagreeing group rank.
        peer: usize,
        /// That rank's chunk description.
        theirs: Vec<i64>,
    },
    /// This rank failed earlier in a step that communicates, dropped its communicator (which made
    /// its peers fail too) and cannot decode any more; build a new instance.
    #[error("rank {rank} of the parallel-VAE instance {ranks:?} failed earlier and left its group")]
    Broken {
        /// The caller's group rank.
        rank: usize,
        /// The instance's global ranks.
        ranks: Vec<usize>,
    },
    /// The decoder failed on this rank's band.
    #[error(transparent)]
    Vae(VaeError),
    /// A collective failed: a peer failed, left or timed out.
    #[error(transparent)]
    Collective(#[from] CollectiveError),
}

impl From<VaeError> for ParallelVaeError {
    /// Collective failures inside the decoder's layers surface as [`ParallelVaeError::Collective`].
    fn from(err: VaeError) -> Self {
        match err {
            VaeError::Collective(err) => ParallelVaeError::Collective(err),
            err => ParallelVaeError::Vae(err),
        }
    }
}

impl From<WireError> for ParallelVaeError {
    /// Through [`VaeError`]: a transfer's collective failure is [`ParallelVaeError::Collective`].
    fn from(err: WireError) -> Self {
        VaeError::from(err).into()
    }
}

impl From<ditstream_kernels::KernelError> for ParallelVaeError {
    fn from(err: ditstream_kernels::KernelError) -> Self {
        ParallelVaeError::Vae(VaeError::Kernel(err))
    }
}

/// Result alias for the parallel VAE.
pub type Result<T> = std::result::Result<T, ParallelVaeError>;
