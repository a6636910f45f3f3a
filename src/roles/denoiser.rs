//! `ditstream denoiser`: one denoiser pool. It serves `DenoiserPool.Denoise` to the gateway, one
//! request at a time (the pool's devices run one denoise loop): text encoding and the loop, with
//! progress streamed back, then the latent sent over the latent link to the decoder the gateway
//! named, one latent frame per chunk so the decoder starts on the first while the rest are in
//! flight. The pool is free for its next request as soon as the last chunk is handed over.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Instant;

use ditstream_common::config::Config;
use ditstream_common::link::quic::Identity;
use ditstream_denoiser::denoise::{Control, DenoiseError};
use ditstream_proto::v1 as pb;
use ditstream_proto::v1::denoiser_pool_server::{DenoiserPool, DenoiserPoolServer};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};

use crate::engine::ms;
use crate::pipeline::{DenoiseStage, model_name};
use crate::request::GenerateParams;
use crate::roles::{addr, link, link_identity, registration};

struct DenoiserService {
    stage: Arc<DenoiseStage>,
    identity: Arc<Identity>,
    /// Open latent-link connections, by decoder link address.
    links: Arc<tokio::sync::Mutex<HashMap<String, link::Connection>>>,
    busy: Arc<AtomicBool>,
    active: Arc<AtomicU32>,
}

type DenoiseStream = Pin<Box<dyn Stream<Item = Result<pb::DenoiseEvent, Status>> + Send>>;

fn event(e: pb::denoise_event::Event) -> Result<pb::DenoiseEvent, Status> {
    Ok(pb::DenoiseEvent { event: Some(e) })
}

/// Frees the pool when the request ends, however it ends.
struct BusyGuard(Arc<AtomicBool>, Arc<AtomicU32>);

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
        self.1.fetch_sub(1, Ordering::Relaxed);
    }
}

impl DenoiserService {
    /// A live connection to the decoder at `address`, reusing the last one.
    async fn link(
        &self,
        kind: &str,
        address: &str,
        host: &str,
    ) -> Result<link::Connection, Status> {
        let mut links = self.links.lock().await;
        if let Some(c) = links.get(address)
            && c.is_open()
        {
            return Ok(c.clone());
        }
        let target: SocketAddr = address.parse().map_err(|_| {
            Status::invalid_argument(format!(
                "decoder_link_address = {address:?}: not an address"
            ))
        })?;
        let gpu = self.stage.link_gpu();
        let conn = link::Connection::connect(kind, target, host, &self.identity, gpu)
            .await
            .map_err(|e| Status::unavailable(format!("{e:#}")))?;
        links.insert(address.to_string(), conn.clone());
        Ok(conn)
    }
}

#[tonic::async_trait]
impl DenoiserPool for DenoiserService {
    type DenoiseStream = DenoiseStream;

    async fn denoise(
        &self,
        request: Request<pb::DenoiseRequest>,
    ) -> Result<Response<DenoiseStream>, Status> {
        let r = request.into_inner();
        if let Some(why) = self.stage.out_of_service() {
            return Err(Status::unavailable(format!(
                "this denoiser pool is out of service: {why}"
            )));
        }
        if self.busy.swap(true, Ordering::SeqCst) {
            return Err(Status::resource_exhausted(
                "this denoiser pool is running another request",
            ));
        }
        self.active.fetch_add(1, Ordering::Relaxed);
        let guard = BusyGuard(Arc::clone(&self.busy), Arc::clone(&self.active));
        let params = GenerateParams {
            prompt: r.prompt,
            negative_prompt: r.negative_prompt,
            width: r.width as usize,
            height: r.height as usize,
            num_frames: r.num_frames as usize,
            fps: 0,
            steps: r.steps as usize,
            guidance_scale: r.guidance_scale,
            guidance_scale_2: r.guidance_scale_2,
            seed: r.seed,
            segment_frames: 0,
        };
        let conn = self
            .link(
                &r.decoder_link_kind,
                &r.decoder_link_address,
                &r.decoder_link_host,
            )
            .await?;
        let links = Arc::clone(&self.links);
        let link_address = r.decoder_link_address.clone();
        let (tx, rx) = mpsc::channel::<Result<pb::DenoiseEvent, Status>>(64);
        let stage = Arc::clone(&self.stage);
        let id = r.request_id;
        tokio::spawn(async move {
            let _guard = guard;
            let progress_tx = tx.clone();
            let denoise_params = params.clone();
            let loop_result = tokio::task::spawn_blocking(move || {
                let t = Instant::now();
                let (cond, uncond) = stage.text_states(&denoise_params)?;
                let text_ms = ms(t.elapsed());
                let t = Instant::now();
                let latent = stage.denoise_latent(&denoise_params, &cond, &uncond, |s| {
                    let e = event(pb::denoise_event::Event::Progress(pb::Progress {
                        phase: pb::Phase::Denoise as i32,
                        done: s.step as u32,
                        total: s.steps as u32,
                    }));
                    // A closed stream is the gateway cancelling: stop at this step.
                    if progress_tx.blocking_send(e).is_ok() {
                        Control::Continue
                    } else {
                        Control::Cancel
                    }
                });
                let latent = match latent {
                    Err(DenoiseError::Cancelled { .. }) => anyhow::bail!("cancelled"),
                    other => other?,
                };
                Ok::<_, anyhow::Error>((latent, text_ms, ms(t.elapsed())))
            })
            .await;
            let (latent, text_ms, denoise_ms) = match loop_result {
                Ok(Ok(v)) => v,
                Ok(Err(e)) => {
                    let _ = tx
                        .send(Err(Status::internal(format!("denoiser: {e:#}"))))
                        .await;
                    return;
                }
                Err(e) => {
                    let _ = tx
                        .send(Err(Status::internal(format!("denoiser task: {e}"))))
                        .await;
                    return;
                }
            };
            let t = Instant::now();
            match conn.send_latent(&id, &latent).await {
                Ok(chunks) => {
                    let done = pb::Denoised {
                        text_ms,
                        denoise_ms,
                        send_ms: ms(t.elapsed()),
                        chunks,
                    };
                    let _ = tx
                        .send(event(pb::denoise_event::Event::Denoised(done)))
                        .await;
                }
                Err(e) => {
                    // The next request reconnects rather than reuse a broken connection.
                    links.lock().await.remove(&link_address);
                    let _ = tx
                        .send(Err(Status::unavailable(format!("latent link: {e:#}"))))
                        .await;
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// A denoiser pool running in this process.
pub struct RunningDenoiser {
    /// Its gRPC address.
    pub addr: SocketAddr,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for RunningDenoiser {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Builds the text encoder and transformer, serves gRPC and registers with the gateway.
pub async fn start(cfg: &Config, config_dir: &Path) -> anyhow::Result<RunningDenoiser> {
    let build = cfg.clone();
    let stage =
        Arc::new(tokio::task::spawn_blocking(move || DenoiseStage::from_config(&build)).await??);
    let identity = Arc::new(link_identity(cfg, config_dir)?);
    let listener =
        tokio::net::TcpListener::bind(addr("pools.denoiser_listen", &cfg.pools.denoiser_listen)?)
            .await?;
    let grpc_addr = listener.local_addr()?;
    let active = Arc::new(AtomicU32::new(0));
    let health_stage = Arc::clone(&stage);
    let health: registration::Health = Arc::new(move || health_stage.out_of_service());
    let service = DenoiserService {
        stage,
        identity,
        links: Arc::default(),
        busy: Arc::new(AtomicBool::new(false)),
        active: Arc::clone(&active),
    };
    let grpc_task = tokio::spawn(async move {
        let served = tonic::transport::Server::builder()
            .add_service(DenoiserPoolServer::new(service))
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "denoiser gRPC server failed");
        }
    });
    let registration = pb::RegisterRequest {
        role: pb::PoolRole::Denoiser as i32,
        address: grpc_addr.to_string(),
        link_address: String::new(),
        link_host: String::new(),
        model: model_name(cfg),
        link_kind: String::new(),
    };
    let reg_task = tokio::spawn(registration::keep_registered(
        cfg.pools.gateway.clone(),
        registration,
        active,
        health,
    ));
    tracing::info!(%grpc_addr, "denoiser pool up");
    Ok(RunningDenoiser {
        addr: grpc_addr,
        tasks: vec![grpc_task, reg_task],
    })
}
