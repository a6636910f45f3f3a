//! One denoiser pool's service: `DenoiserPool.Denoise` around a [`DenoiseStage`], one request at a time
//! (the pool's devices run one denoise loop). Text encoding and the loop, with progress streamed
//! back, then the latent sent over the latent link to the decoder the gateway named, one latent
//! frame per chunk, so the decoder starts on the first while the rest are in flight. The pool is
//! free for its next request as soon as the last chunk is handed over.
//!
//! The same service runs behind its own gRPC listener (`ditstream denoiser`, registered with a
//! gateway elsewhere) and inside `ditstream serve`, where the gateway calls it directly and the
//! latent goes to the in-process decoder.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Instant;

use ditstream_common::config::Config;
use ditstream_common::tls::Identity;
use ditstream_proto::v1 as pb;
use ditstream_proto::v1::denoiser_pool_server::{DenoiserPool, DenoiserPoolServer};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use ditstream_common::link::pool::{self as link, Pending};
use ditstream_common::mesh::LatentGeometry;
use ditstream_common::{ms, registration, status};

use crate::denoise::{Control, DenoiseError};
use crate::error::StageError;
use crate::stage::{DenoiseJob, DenoiseStage};

/// Where a request's latent goes, as the gateway named it.
struct LinkTarget {
    kind: pb::LinkKind,
    address: String,
    host: String,
}

/// The request a `Denoise` call carries, in domain terms (the one wire → domain conversion).
fn job_of(
    r: pb::DenoiseRequest,
    geometry: LatentGeometry,
) -> Result<(String, DenoiseJob, LinkTarget), Status> {
    let size = geometry.check_size(r.width as usize, r.height as usize, r.num_frames as usize);
    if let Err((field, value, rule)) = size {
        return Err(status::invalid_field(field, value, &rule));
    }
    if r.steps == 0 {
        return Err(status::invalid_field("steps", 0, "must be at least 1"));
    }
    let link = LinkTarget {
        kind: pb::LinkKind::try_from(r.decoder_link_kind).unwrap_or(pb::LinkKind::Unspecified),
        address: r.decoder_link_address,
        host: r.decoder_link_host,
    };
    let job = DenoiseJob {
        prompt: r.prompt,
        negative_prompt: r.negative_prompt,
        width: r.width as usize,
        height: r.height as usize,
        num_frames: r.num_frames as usize,
        steps: r.steps as usize,
        guidance_scale: r.guidance_scale,
        guidance_scale_2: r.guidance_scale_2,
        seed: r.seed,
    };
    Ok((r.request_id, job, link))
}

/// The pool's gRPC service.
pub struct DenoiserService {
    stage: Arc<DenoiseStage>,
    /// The latent link's TLS identity (pools in other processes); `None` in `serve`.
    identity: Option<Arc<Identity>>,
    /// The decoder in this process (`serve`), for `LINK_KIND_IN_PROCESS`.
    in_process: Option<Pending>,
    /// Open latent-link connections, by decoder link address.
    links: Arc<tokio::sync::Mutex<HashMap<String, link::Link>>>,
    /// One loop at a time: a request holds the permit until its work has stopped.
    free: Arc<tokio::sync::Semaphore>,
    active: Arc<AtomicU32>,
}

/// How long a request waits for the previous one to wind down. The gateway sends the next
/// request as soon as it drops the last one's stream; that loop stops within one transformer
/// block, so a longer wait means the pool is really busy.
const WIND_DOWN: std::time::Duration = std::time::Duration::from_secs(30);

type DenoiseStream = Pin<Box<dyn Stream<Item = Result<pb::DenoiseEvent, Status>> + Send>>;

fn event(e: pb::denoise_event::Event) -> Result<pb::DenoiseEvent, Status> {
    Ok(pb::DenoiseEvent { event: Some(e) })
}

fn progress(phase: pb::Phase, done: usize, total: usize) -> Result<pb::DenoiseEvent, Status> {
    event(pb::denoise_event::Event::Progress(pb::Progress {
        phase: phase as i32,
        done: done as u32,
        total: total as u32,
    }))
}

/// Frees the pool when the request ends, however it ends (the permit goes with it).
struct BusyGuard {
    _permit: tokio::sync::OwnedSemaphorePermit,
    active: Arc<AtomicU32>,
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.active.fetch_sub(1, Ordering::Relaxed);
    }
}

impl DenoiserService {
    /// The service over `stage`; the latent goes out over QUIC/UCX/NCCL with `identity`, or to
    /// the decoder in this process through `in_process`.
    pub fn new(
        stage: Arc<DenoiseStage>,
        identity: Option<Arc<Identity>>,
        in_process: Option<Pending>,
    ) -> DenoiserService {
        DenoiserService {
            stage,
            identity,
            in_process,
            links: Arc::default(),
            free: Arc::new(tokio::sync::Semaphore::new(1)),
            active: Arc::new(AtomicU32::new(0)),
        }
    }

    /// The mesh and the devices it runs on, as `ditstream plan` names them.
    pub fn description(&self) -> String {
        let devices: Vec<String> = self.stage.devices().iter().map(|d| d.to_string()).collect();
        format!("{} on {}", self.stage.mesh(), devices.join(", "))
    }

    /// A live connection to the decoder `target` names, reusing the last one.
    async fn link(&self, target: &LinkTarget) -> Result<link::Link, Status> {
        if target.kind == pb::LinkKind::InProcess {
            return match &self.in_process {
                Some(pending) => Ok(Arc::new(link::InProcess(Arc::clone(pending)))),
                None => Err(status::invalid_field(
                    "decoder_link_kind",
                    "LINK_KIND_IN_PROCESS",
                    "this denoiser pool has no decoder in its process",
                )),
            };
        }
        let mut links = self.links.lock().await;
        if let Some(c) = links.get(&target.address)
            && c.is_open()
        {
            return Ok(c.clone());
        }
        let at: SocketAddr = target.address.parse().map_err(|_| {
            status::invalid_field("decoder_link_address", &target.address, "not an address")
        })?;
        let Some(identity) = &self.identity else {
            return Err(status::invalid_field(
                "decoder_link_kind",
                target.kind.as_str_name(),
                "this denoiser pool has no link identity (it serves in one process)",
            ));
        };
        let gpu = self.stage.link_gpu();
        let conn = link::connect(target.kind, at, &target.host, identity, gpu)
            .await
            .map_err(|e| {
                status::unreachable("decoder latent link", &target.address, format!("{e:#}"))
            })?;
        links.insert(target.address.clone(), conn.clone());
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
        let logged_id = registration::request_id_of(&request, &request.get_ref().request_id);
        let (id, job, target) = job_of(request.into_inner(), self.stage.geometry())?;
        if let Some(why) = self.stage.out_of_service() {
            return Err(status::out_of_service("denoiser pool", &why));
        }
        let permit = tokio::time::timeout(WIND_DOWN, Arc::clone(&self.free).acquire_owned())
            .await
            .map_err(|_| status::pool_busy("denoiser pool"))?
            .map_err(|_| status::pool_busy("denoiser pool"))?;
        self.active.fetch_add(1, Ordering::Relaxed);
        let guard = BusyGuard {
            _permit: permit,
            active: Arc::clone(&self.active),
        };
        let conn = self.link(&target).await?;
        let links = Arc::clone(&self.links);
        let (tx, rx) = mpsc::channel::<Result<pb::DenoiseEvent, Status>>(64);
        let stage = Arc::clone(&self.stage);
        let span = tracing::info_span!("denoise", id = %logged_id);
        let task = async move {
            let _guard = guard;
            tracing::info!(steps = job.steps, "denoising");
            // The gateway dropping the stream (cancel, client gone, deadline) stops the loop
            // before its next transformer block.
            let interrupted = Arc::new(AtomicBool::new(false));
            let watch = {
                let (tx, interrupted) = (tx.clone(), Arc::clone(&interrupted));
                tokio::spawn(async move {
                    tx.closed().await;
                    interrupted.store(true, Ordering::Relaxed);
                })
            };
            let progress_tx = tx.clone();
            let loop_span = tracing::Span::current();
            let loop_result = tokio::task::spawn_blocking(move || {
                let _entered = loop_span.entered();
                let send = |e| progress_tx.blocking_send(e).is_ok();
                send(progress(pb::Phase::Text, 0, 1));
                let t = Instant::now();
                let (cond, uncond) = stage.text_states(&job)?;
                let text_ms = ms(t.elapsed());
                send(progress(pb::Phase::Text, 1, 1));
                let t = Instant::now();
                let latent = stage.denoise_latent(&job, &cond, &uncond, &interrupted, |s| {
                    // A closed stream is the gateway cancelling: stop at this step.
                    if send(progress(pb::Phase::Denoise, s.step, s.steps)) {
                        Control::Continue
                    } else {
                        Control::Cancel
                    }
                });
                Ok::<_, StageError>((latent, text_ms, ms(t.elapsed())))
            })
            .await;
            watch.abort();
            let (latent, text_ms, denoise_ms) = match loop_result {
                Ok(Ok((Ok(latent), text_ms, denoise_ms))) => (latent, text_ms, denoise_ms),
                Ok(Ok((Err(DenoiseError::Cancelled { after_step, steps }), _, _))) => {
                    return tracing::info!(after_step, steps, "cancelled");
                }
                Ok(Ok((Err(e), _, _))) => {
                    tracing::warn!(error = %e, "denoise failed");
                    let _ = tx.send(Err(status::internal("denoiser", e))).await;
                    return;
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "text encoding failed");
                    let _ = tx.send(Err(status::internal("denoiser", e))).await;
                    return;
                }
                Err(e) => {
                    let _ = tx.send(Err(status::internal("denoiser task", e))).await;
                    return;
                }
            };
            let t = Instant::now();
            match conn.send_latent(&id, &latent).await {
                Ok(chunks) => {
                    let send_ms = ms(t.elapsed());
                    tracing::info!(text_ms, denoise_ms, send_ms, chunks, "latent handed over");
                    let done = pb::Denoised {
                        text_ms,
                        denoise_ms,
                        send_ms,
                        chunks,
                    };
                    let _ = tx
                        .send(event(pb::denoise_event::Event::Denoised(done)))
                        .await;
                }
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "latent link failed");
                    // The next request reconnects rather than reuse a broken connection.
                    links.lock().await.remove(&target.address);
                    let _ = tx
                        .send(Err(status::unreachable(
                            "decoder latent link",
                            &target.address,
                            format!("{e:#}"),
                        )))
                        .await;
                }
            }
        };
        tokio::spawn(task.instrument(span));
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// The stage after its warm-up (see [`DenoiseStage::warm_up`]): the pool registers only then.
fn warm(stage: DenoiseStage, cfg: &Config) -> Result<DenoiseStage, StageError> {
    let shapes = cfg.serving.warmup_shapes();
    let took = stage.warm_up(&shapes)?;
    if !shapes.is_empty() {
        tracing::info!(?shapes, ?took, "denoiser warmed up (ms per shape)");
    }
    Ok(stage)
}

/// Builds the text encoder and transformer, warms them up, serves gRPC and registers with the
/// gateway.
pub async fn start(cfg: &Config) -> Result<registration::RunningPool, StageError> {
    let build = cfg.clone();
    let stage = Arc::new(
        tokio::task::spawn_blocking(move || warm(DenoiseStage::from_config(&build)?, &build))
            .await??,
    );
    let identity = link::identity(cfg)?;
    let identity = Arc::new(identity);
    let health_stage = Arc::clone(&stage);
    let health: registration::Health = Arc::new(move || health_stage.out_of_service());
    let service = DenoiserService::new(stage, Some(Arc::clone(&identity)), None);
    let active = Arc::clone(&service.active);
    let server = DenoiserPoolServer::new(service)
        .max_decoding_message_size(cfg.connections.max_request_bytes);
    let (grpc_addr, grpc_task) = registration::serve(
        cfg,
        "pools.denoiser_listen",
        &cfg.pools.denoiser_listen,
        &identity,
        server,
    )
    .await?;
    let registration = pb::RegisterRequest {
        role: pb::PoolRole::Denoiser as i32,
        address: grpc_addr.to_string(),
        link_address: String::new(),
        link_host: String::new(),
        model: cfg.model_name(),
        link_kind: pb::LinkKind::Unspecified as i32,
    };
    let registration = registration::Registered::start(
        cfg.pools.gateway.clone(),
        identity,
        registration,
        active,
        health,
    );
    tracing::info!(%grpc_addr, "denoiser pool up");
    Ok(registration::RunningPool::new(
        grpc_addr,
        None,
        registration,
        vec![grpc_task],
    ))
}
