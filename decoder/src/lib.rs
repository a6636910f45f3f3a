//! The decoder pool: the Wan VAE decoder (chunk by chunk), its spatially sharded (parallel VAE)
//! form, and video encoding into fragmented-MP4 segments; and the pool's runtime: the VAE built
//! from the config (`models`), the stage that decodes requests chunk by chunk (`stage`), and the
//! `DecoderPool` gRPC service with the instance process's start (`service`), which fail with
//! [`StageError`] (`error`).

pub mod encode;
pub mod error;
pub mod models;
pub mod parallel;
pub mod service;
pub mod stage;
pub mod vae;

pub use error::StageError;
