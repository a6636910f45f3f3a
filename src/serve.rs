//! `ditstream serve`, and the embedded server `ditstream generate` starts on loopback when no
//! `--server` is given: the gateway, one denoiser pool and one decoder instance in one process,
//! joined by the in-process latent link. Requests take exactly the path they take in the
//! disaggregated deployment (admission, routing, relaying in [`crate::gateway`]), so decode(N)
//! overlaps denoise(N+1) here too.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use ditstream_common::config::Config;

use crate::gateway::{Gateway, RunningGateway};
use crate::pipeline::Pipeline;
use ditstream_common::link::pool::Pending;
use ditstream_decoder::service::DecoderService;
use ditstream_denoiser::service::DenoiserService;

/// The embedded default: CPU, the built-in tiny model (configs/cpu-tiny.yaml, compiled in).
pub const EMBEDDED_CONFIG: &str = include_str!("../configs/cpu-tiny.yaml");

/// Reads and validates a config file, or the embedded default when `path` is `None`.
pub fn load_config(path: Option<&std::path::Path>) -> anyhow::Result<Config> {
    let cfg = match path {
        Some(p) => Config::from_file(p)?,
        None => Config::parse(EMBEDDED_CONFIG, "<embedded cpu-tiny>")?,
    };
    // Every rank runs in this process: the denoiser mesh's and the VAE's, as threads on the CPU
    // or one thread per GPU of `serving.gpus` (both halves on the same list).
    cfg.validate(None)?;
    Ok(cfg)
}

/// A server running in this process.
pub struct RunningServer {
    /// Where it listens.
    pub addr: SocketAddr,
    gateway: RunningGateway,
    grace: Duration,
}

impl RunningServer {
    /// Stops admitting, lets running requests finish within `serving.shutdown_grace_s`, cancels
    /// the rest, and stops listening.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.gateway.stop(self.grace).await;
        Ok(())
    }
}

/// Builds the models (on a blocking thread), starts both pools and the gateway, and serves on
/// `listen` (port 0 picks a free port; see `addr`).
pub async fn start(cfg: Config, listen: SocketAddr) -> anyhow::Result<RunningServer> {
    let build_cfg = cfg.clone();
    let pipeline = tokio::task::spawn_blocking(move || Pipeline::from_config(&build_cfg))
        .await
        .context("model loading panicked")??;
    start_with(cfg, pipeline, listen).await
}

/// As [`start`], with stages already built from `cfg` (tests put a failing encoder in them):
/// listens, warms the stages up (`serving.warmup`), then adds the pools and returns.
pub async fn start_with(
    cfg: Config,
    pipeline: Pipeline,
    listen: SocketAddr,
) -> anyhow::Result<RunningServer> {
    let gateway = Gateway::new(&cfg, None)?;
    // Listening at once, not ready (Health, grpc.health.v1) until the pools are added after
    // their warm-up; requests that arrive meanwhile wait in the queue.
    let running = crate::gateway::serve(gateway.clone(), listen, None).await?;
    let shapes = cfg.serving.warmup_shapes();
    let fps = cfg.serving.fps;
    let (denoise, decode) = tokio::task::spawn_blocking(move || {
        let (denoise, decode) = pipeline.into_stages();
        let denoised = denoise.warm_up(&shapes)?;
        let decoded = decode.warm_up(&shapes, fps)?;
        if !shapes.is_empty() {
            tracing::info!(?shapes, ?denoised, ?decoded, "warmed up (ms per shape)");
        }
        anyhow::Ok((denoise, decode))
    })
    .await
    .context("warm-up panicked")??;
    let pending: Pending = Arc::default();
    let decoder = DecoderService::new(Arc::new(decode), Arc::clone(&pending));
    let denoiser = DenoiserService::new(Arc::new(denoise), None, Some(pending));
    gateway.add_local(Arc::new(denoiser), Arc::new(decoder));
    let gateway = running;
    Ok(RunningServer {
        addr: gateway.addr,
        gateway,
        grace: Duration::from_secs(cfg.serving.shutdown_grace_s),
    })
}

/// `ditstream serve`: serves until Ctrl-C, then drains.
pub async fn serve(
    config: Option<&std::path::Path>,
    listen: Option<SocketAddr>,
) -> anyhow::Result<()> {
    let cfg = load_config(config)?;
    let listen = match listen {
        Some(a) => a,
        None => cfg.serving.listen.parse().context("serving.listen")?,
    };
    let server = start(cfg, listen).await?;
    eprintln!("ditstream serving on {} (Ctrl-C stops)", server.addr);
    tokio::signal::ctrl_c()
        .await
        .context("waiting for Ctrl-C")?;
    eprintln!("stopping: draining running requests");
    server.stop().await
}
