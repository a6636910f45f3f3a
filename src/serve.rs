//! Starting and stopping the gRPC server around an engine: `ditstream serve`, and the embedded
//! server `ditstream generate` starts on loopback when no `--server` is given.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use ditstream_common::config::Config;
use ditstream_proto::v1::video_service_server::VideoServiceServer;
use tokio::sync::oneshot;
use tokio_stream::wrappers::TcpListenerStream;

use crate::engine::Engine;
use crate::pipeline::Pipeline;
use crate::service::VideoServer;

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
    shutdown: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

impl RunningServer {
    /// Stops accepting, lets open streams finish, and waits.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.task
            .await
            .context("server task panicked")?
            .context("server failed")?;
        Ok(())
    }
}

/// Builds the models (on a blocking thread), starts the engine and serves on `listen`
/// (port 0 picks a free port; see `addr`).
pub async fn start(cfg: Config, listen: SocketAddr) -> anyhow::Result<RunningServer> {
    let build_cfg = cfg.clone();
    let pipeline = tokio::task::spawn_blocking(move || Pipeline::from_config(&build_cfg))
        .await
        .context("model loading panicked")??;
    let engine = Arc::new(Engine::start(pipeline, cfg.serving.queue_depth));
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let addr = listener.local_addr()?;
    let (tx, rx) = oneshot::channel();
    let service = VideoServiceServer::new(VideoServer::new(engine, cfg))
        .max_decoding_message_size(1 << 20)
        .max_encoding_message_size(64 << 20);
    let task = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                let _ = rx.await;
            }),
    );
    tracing::info!(%addr, "serving ditstream.v1.VideoService");
    Ok(RunningServer {
        addr,
        shutdown: Some(tx),
        task,
    })
}

/// `ditstream serve`: serves until Ctrl-C.
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
    eprintln!("stopping");
    server.stop().await
}
