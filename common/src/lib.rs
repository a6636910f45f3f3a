//! Pieces every ditstream pool shares: the YAML config and its validation, the device mesh,
//! collectives over mesh groups (CPU threads and NCCL) and tensors through them, the persistent
//! rank threads of a multi-rank stage (`ranks`), rendezvous, the latent link between pools
//! (`link`), a pool's registration with the gateway (`registration`), every gRPC status the
//! service sends (`status`), every listener's front door (`net`) and TLS for every hop (`tls`).

pub mod collectives;
pub mod config;
pub mod devices;
pub mod link;
pub mod mesh;
pub mod net;
pub mod ranks;
pub mod registration;
pub mod rendezvous;
pub mod status;
pub mod tls;

/// Milliseconds of a duration, as the timings report them.
pub fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
