//! The `ditstream` service in one process: requests (`request`), the admission queue and worker
//! (`engine`), the text → denoise → decode → encode path (`pipeline`), the devices and models it
//! runs on (`models`), the persistent rank threads of its multi-rank parts (`ranks`), the gRPC
//! service (`service`), server start-up (`serve`), the client (`generate`), and `plan`; the
//! disaggregated pools in `roles`. The binary (`main.rs`) only parses the command line.

pub mod engine;
pub mod generate;
pub mod models;
pub mod pipeline;
pub mod plan;
pub mod ranks;
pub mod request;
pub mod roles;
pub mod serve;
pub mod service;
