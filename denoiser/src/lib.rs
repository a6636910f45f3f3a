//! The denoiser pool: the Wan transformer (`model`), flow-matching samplers and CFG (`sampler`),
//! the denoise loop on one rank (`denoise`), sequence and CFG parallelism over a device mesh
//! (`parallel`), the text encoder (`text`); and the pool's runtime: the models built from the
//! config (`models`), the stage that runs a request on its ranks (`stage`), and the
//! `DenoiserPool` gRPC service with the pool process's start (`service`), which fail with
//! [`StageError`] (`error`).

pub mod denoise;
pub mod error;
pub mod model;
pub mod models;
pub mod parallel;
pub mod sampler;
pub mod service;
pub mod stage;
pub mod text;

pub use error::StageError;
