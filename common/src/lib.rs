//! Pieces every ditstream pool shares: the YAML config and its validation, the device mesh,
//! collectives over mesh groups (CPU threads and NCCL) and tensors through them, rendezvous, and
//! tracing setup.

pub mod collectives;
pub mod config;
pub mod link;
pub mod mesh;
pub mod rendezvous;
