//! The decoder pool: the Wan VAE decoder (chunk by chunk), its spatially sharded (parallel VAE)
//! form, and video encoding into fragmented-MP4 segments.

pub mod encode;
pub mod parallel;
pub mod vae;
