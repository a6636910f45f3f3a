//! The denoiser pool: the Wan transformer (`model`), flow-matching samplers and CFG (`sampler`),
//! and the denoise loop on one rank (`denoise`).

pub mod denoise;
pub mod model;
pub mod sampler;
pub mod text;
