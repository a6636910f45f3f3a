//! The denoiser pool: the Wan transformer (`model`), flow-matching samplers and CFG (`sampler`),
//! the denoise loop on one rank (`denoise`), and sequence and CFG parallelism over a device mesh
//! (`parallel`).

pub mod denoise;
pub mod model;
pub mod parallel;
pub mod sampler;
pub mod text;
