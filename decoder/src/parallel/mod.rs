//! The parallel VAE (DESIGN.md §4, `reference/wan.md` §2.5, `reference/visualgen.md` §4): one decoder
//! instance of `parallel_vae_size` ranks, each decoding a contiguous band of the latent's rows (or
//! columns) with the unchanged model code, and the decoded frames gathered to the encoding rank.
//!
//! ```no_run
//! # fn main() -> Result<(), ditstream_decoder::parallel::ParallelVaeError> {
//! # let (decoder, comm, latent_chunks): (
//! #     std::sync::Arc<ditstream_decoder::vae::WanVaeDecoder>,
//! #     ditstream_common::collectives::cpu::CpuComm,
//! #     Vec<ditstream_kernels::Tensor>,
//! # ) = todo!();
//! use ditstream_common::config::VaeSplitDim;
//! use ditstream_decoder::parallel::ParallelVaeDecoder;
//! // On every rank of the instance, with the instance's communicator:
//! let mut vae = ParallelVaeDecoder::new(decoder, comm, VaeSplitDim::Width);
//! let mut stream = vae.new_stream(60, 104)?; // the whole latent's h, w
//! for chunk in &latent_chunks {
//!     let band = stream.band_of(chunk)?; // this rank's columns of [1, 16, n, 60, 104]
//!     let frames = vae.decode_chunk(&mut stream, &band)?; // this rank's columns of the video
//!     if let Some(video) = vae.gather_frames(&stream, &frames)? {
//!         // group rank 0 only: [1, 3, F, 480, 832], ready to encode
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! How it stays exact. Only two operations read other pixels ([`SpatialOps`](crate::vae::SpatialOps)):
//! - every convolution with a spatial kernel k > 1 on the split axis first exchanges k/2 (= 1) rows
//!   with each neighbour, zeros only at the true image borders, and then runs with no padding on the
//!   split axis, so each rank computes exactly the unsharded output's rows of its band;
//! - the mid-block frame attention gathers every rank's keys and values (uneven counts), puts them
//!   back in the frame's row-major token order, and attends the local queries over all of them.
//!
//! Everything else is per pixel (RMS norm, SiLU, 1×1 convs, `time_conv`, the channel → frame step),
//! and the nearest ×2 upsampling maps the band of latent rows [s, e) onto rows [2s, 2e), so every
//! rank's band stays aligned through the decoder: at scale f it is rows [f·s, f·e).
//!
//! Files:
//! - [`shard`]: the band geometry (which rows a rank owns at each resolution) and nothing else.
//! - `halo`: [`HaloOps`], the communicating [`SpatialOps`](crate::vae::SpatialOps).
//! - Transfers: tensors cross the communicator in their own dtype (device to device under NCCL)
//!   through common's [`wire`](ditstream_common::collectives::wire), shared with the denoiser.
//! - `decoder`: [`ParallelVaeDecoder`] and its per-request [`ParallelDecodeStream`]: the agreement
//!   step before each chunk, the decode, the gather to rank 0, and failure handling.
//! - [`ParallelVaeError`]: every failure, with the offending values.

mod decoder;
mod error;
mod halo;
pub mod shard;

pub use decoder::{ParallelDecodeStream, ParallelVaeDecoder};
pub use error::{ParallelVaeError, Result};
pub use halo::HaloOps;
pub use shard::Shard;
