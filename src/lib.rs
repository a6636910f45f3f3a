//! The `ditstream` service in one process: requests (`request`), the admission queue and worker
//! (`engine`), the text → denoise → decode → encode path (`pipeline`), the gRPC service
//! (`service`), server start-up (`serve`), the client (`generate`), and `plan`. The binary
//! (`main.rs`) only parses the command line.

pub mod engine;
pub mod generate;
pub mod pipeline;
pub mod plan;
pub mod request;
pub mod roles;
pub mod serve;
pub mod service;
