//! The `ditstream` service's processes: `serve` (the gateway and both pools in one process), the
//! disaggregated roles (`roles`), the client (`generate`) and `plan`. The front a client talks to
//! (the gateway, the HTTP API, `/metrics`, request limits, the cost model) is `ditstream-gateway`,
//! re-exported here under its module names; the pools (models, stages, gRPC services) live in
//! `ditstream-denoiser` and `ditstream-decoder`; what all use (rank threads, the latent link,
//! registration, statuses) in `ditstream-common`. The binary (`main.rs`) only parses the command
//! line.

pub use ditstream_gateway::{cost, gateway, http, metrics, pipeline, request};

pub mod generate;
pub mod plan;
pub mod roles;
pub mod serve;
