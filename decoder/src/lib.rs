//! The decoder pool: the Wan VAE decoder (chunk by chunk) and video encoding into fragmented-MP4
//! segments.

pub mod encode;
pub mod vae;
