//! The Wan 2.1 VAE decoder (diffusers `AutoencoderKLWan`, z 16, 8×8×4), decoded chunk by chunk with
//! diffusers' causal cache semantics (`reference/wan.md` §2): latent frames go in as they arrive, video
//! frames come out as soon as they are final (latent frame 0 → 1 frame, each later one → 4).
//!
//! ```no_run
//! # fn main() -> Result<(), ditstream_decoder::vae::VaeError> {
//! # let latent_chunks: Vec<ditstream_kernels::Tensor> = vec![];
//! use ditstream_decoder::vae::WanVaeDecoder;
//! let decoder = WanVaeDecoder::load(std::path::Path::new("Wan2.1-T2V-1.3B-Diffusers/vae"))?;
//! let mut stream = decoder.new_stream(60, 104)?; // latent h, w
//! for chunk in &latent_chunks {
//!     let frames = decoder.decode_chunk(&mut stream, chunk)?; // [1, 16, n, h, w] → [1, 3, F, 8h, 8w]
//! }
//! # Ok(()) }
//! ```
//!
//! Files, one concern each:
//! - [`config`]: `config.json`, validated, and the layout derived from it.
//! - `weights`: checkpoint-name prefixes over the kernels crate's weight sources.
//! - `layers`: the blocks (causal conv with its cache, RMS norm, residual, attention, upsampler).
//! - [`spatial`]: the convolutions' and attention's call site, the seam for the parallel (halo) VAE.
//! - `decoder`: [`WanVaeDecoder`] and the caller-owned [`DecodeStream`]. A decoder lives on one device in
//!   one dtype: `WanVaeDecoder::load_on(folder, Device::Cuda(0), DType::BF16)` (feature `cuda` of the
//!   kernels) moves the weights once; `load` is the CPU/f32 case.
//! - [`VaeError`]: every failure, with the offending values.

pub mod config;
mod decoder;
mod error;
mod layers;
pub mod spatial;
mod weights;

pub use config::{UpBlockLayout, UpsampleMode, VaeConfig};
pub use decoder::{DecodeStream, WanVaeDecoder};
pub use error::{Result, VaeError};
pub use spatial::{SpatialOps, Unsharded};
