//! The `ditstream` service: requests and their limits (`request`), admission's cost model
//! (`cost`), the gateway with the one request lifecycle (`gateway`), the text → latent and
//! latent → segments stages (`pipeline`), the devices and models they run on (`models`), the
//! persistent rank threads of their multi-rank parts (`ranks`), the pool services and the
//! disaggregated processes (`roles`), every gRPC status (`status`), `serve` (the gateway and both
//! pools in one process), the client (`generate`), and `plan`. The binary (`main.rs`) only parses
//! the command line.

pub mod cost;
pub mod gateway;
pub mod generate;
pub mod models;
pub mod pipeline;
pub mod plan;
pub mod ranks;
pub mod request;
pub mod roles;
pub mod serve;
pub mod status;
