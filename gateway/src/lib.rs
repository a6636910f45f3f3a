//! ditstream's front, the part a client talks to: requests and their limits (`request`),
//! admission's cost model (`cost`), the gateway with the one request lifecycle and the pool
//! registry (`gateway`), a request's split into the pools' jobs (`pipeline`), the HTTP API
//! (`http`) and `/metrics` (`metrics`). The pools it routes to live in `ditstream-denoiser` and
//! `ditstream-decoder`; `ditstream serve` (the root package) puts all three in one process.

pub mod cost;
pub mod gateway;
pub mod http;
pub mod metrics;
pub mod pipeline;
pub mod request;
