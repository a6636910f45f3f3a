//! The decoder pool: video encoding into fragmented-MP4 segments (VAE decode to follow).

pub mod encode;
