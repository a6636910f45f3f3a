//! The denoiser pool: flow-matching samplers and classifier-free guidance (the Wan transformer,
//! the parallel wrappers and the denoise loop build on these).

pub mod sampler;
