//! The `ditstream` service: requests and their limits (`request`), admission's cost model
//! (`cost`), the gateway with the one request lifecycle (`gateway`), both stages in one process
//! and a request's split into their jobs (`pipeline`), `serve` (the gateway and both pools in one
//! process), the disaggregated processes (`roles`), the client (`generate`), the HTTP API (`http`), `/metrics` (`metrics`), and `plan`. The
//! pools themselves (models, stages, gRPC services) live in `ditstream-denoiser` and
//! `ditstream-decoder`; what both use (rank threads, the latent link, registration, statuses) in
//! `ditstream-common`. The binary (`main.rs`) only parses the command line.

pub mod cost;
pub mod gateway;
pub mod generate;
pub mod http;
pub mod metrics;
pub mod pipeline;
pub mod plan;
pub mod request;
pub mod roles;
pub mod serve;
