//! `ditstream gateway`: the public `VideoService` in front of the pools, and the `PoolRegistry`
//! they register with. Each request waits in a bounded queue for a free denoiser pool, takes the
//! least-loaded decoder instance, and is relayed: the decoder's Decode stream is opened first (so
//! it is ready for the latent), then the denoiser's Denoise stream; progress, the init segment
//! and media segments go to the client as they come. A denoiser is free for the next request as
//! soon as it reports its latent handed over, while the decoder is still working.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ditstream_common::config::Config;
use ditstream_proto::v1 as pb;
use ditstream_proto::v1::decoder_pool_client::DecoderPoolClient;
use ditstream_proto::v1::denoiser_pool_client::DenoiserPoolClient;
use ditstream_proto::v1::pool_registry_server::{PoolRegistry, PoolRegistryServer};
use ditstream_proto::v1::video_service_server::{VideoService, VideoServiceServer};
use tokio::sync::{Notify, mpsc, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};

use crate::engine::ms;
use crate::pipeline::model_name;
use crate::request::{GenerateParams, RawRequest};
use crate::service::grpc_timeout;

/// A registered pool.
#[derive(Debug, Clone)]
struct Pool {
    role: pb::PoolRole,
    address: String,
    link_address: String,
    link_host: String,
    link_kind: String,
    last_seen: Instant,
    /// Requests the gateway has routed to it and not seen finish.
    inflight: u32,
}

#[derive(Default)]
struct Registry {
    pools: HashMap<String, Pool>,
}

struct Shared {
    registry: Mutex<Registry>,
    /// Woken when a pool registers or a denoiser frees.
    changed: Notify,
    /// Requests accepted and not yet holding a denoiser.
    waiting: Mutex<u32>,
    /// Requests holding a denoiser or decoding.
    running: Mutex<u32>,
    cancels: Mutex<HashMap<String, watch::Sender<bool>>>,
    next_id: AtomicU64,
    cfg: Config,
    model: String,
    heartbeat_timeout: Duration,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Each critical section is a few field updates: a poisoned lock still holds consistent data.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shared {
    /// Takes a free denoiser and the least-loaded decoder, if both exist.
    fn try_acquire(&self) -> Option<(String, Pool, String, Pool)> {
        let mut reg = lock(&self.registry);
        let denoiser = reg
            .pools
            .iter()
            .filter(|(_, p)| p.role == pb::PoolRole::Denoiser && p.inflight == 0)
            .min_by_key(|(id, _)| (*id).clone())
            .map(|(id, _)| id.clone())?;
        let decoder = reg
            .pools
            .iter()
            .filter(|(_, p)| p.role == pb::PoolRole::Decoder)
            .min_by_key(|(id, p)| (p.inflight, (*id).clone()))
            .map(|(id, _)| id.clone())?;
        for id in [&denoiser, &decoder] {
            if let Some(p) = reg.pools.get_mut(id) {
                p.inflight += 1;
            }
        }
        let (dn, dc) = (reg.pools[&denoiser].clone(), reg.pools[&decoder].clone());
        Some((denoiser, dn, decoder, dc))
    }

    /// Drops a pool that could not be reached.
    fn forget(&self, id: &str, why: &str) {
        if let Some(p) = lock(&self.registry).pools.remove(id) {
            tracing::warn!(pool_id = %id, address = %p.address, %why, "pool unreachable; forgotten");
        }
        self.changed.notify_waiters();
    }

    fn release(&self, id: &str) {
        if let Some(p) = lock(&self.registry).pools.get_mut(id) {
            p.inflight = p.inflight.saturating_sub(1);
        }
        self.changed.notify_waiters();
    }

    /// Drops pools whose heartbeat stopped.
    fn reap(&self) {
        let mut reg = lock(&self.registry);
        let timeout = self.heartbeat_timeout;
        reg.pools.retain(|id, p| {
            let alive = p.last_seen.elapsed() <= timeout;
            if !alive {
                tracing::warn!(pool_id = %id, address = %p.address, "pool missed its heartbeats; dropped");
            }
            alive
        });
    }
}

/// The gateway's gRPC services.
#[derive(Clone)]
struct Gateway(Arc<Shared>);

#[tonic::async_trait]
impl PoolRegistry for Gateway {
    async fn register(
        &self,
        request: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterResponse>, Status> {
        let r = request.into_inner();
        let role = pb::PoolRole::try_from(r.role).unwrap_or(pb::PoolRole::Unspecified);
        if role == pb::PoolRole::Unspecified {
            return Err(Status::invalid_argument(format!(
                "role = {}: must be DENOISER or DECODER",
                r.role
            )));
        }
        if r.model != self.0.model {
            return Err(Status::failed_precondition(format!(
                "model = {:?}: this gateway serves {:?}",
                r.model, self.0.model
            )));
        }
        let id = format!(
            "{}-{}",
            if role == pb::PoolRole::Denoiser {
                "denoiser"
            } else {
                "decoder"
            },
            self.0.next_id.fetch_add(1, Ordering::Relaxed)
        );
        tracing::info!(pool_id = %id, address = %r.address, link = %r.link_address, "pool registered");
        let pool = Pool {
            role,
            address: r.address,
            link_address: r.link_address,
            link_host: r.link_host,
            link_kind: r.link_kind,
            last_seen: Instant::now(),
            inflight: 0,
        };
        lock(&self.0.registry).pools.insert(id.clone(), pool);
        self.0.changed.notify_waiters();
        Ok(Response::new(pb::RegisterResponse { pool_id: id }))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let r = request.into_inner();
        let known = match lock(&self.0.registry).pools.get_mut(&r.pool_id) {
            Some(p) => {
                p.last_seen = Instant::now();
                true
            }
            None => false,
        };
        Ok(Response::new(pb::HeartbeatResponse { known }))
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateEvent, Status>> + Send>>;

fn ev(e: pb::generate_event::Event) -> Result<pb::GenerateEvent, Status> {
    Ok(pb::GenerateEvent { event: Some(e) })
}

/// Decrements a counter when dropped.
struct Count<'a>(&'a Mutex<u32>);

impl<'a> Count<'a> {
    fn new(m: &'a Mutex<u32>) -> Count<'a> {
        *lock(m) += 1;
        Count(m)
    }
}

impl Drop for Count<'_> {
    fn drop(&mut self) {
        let mut n = lock(self.0);
        *n = n.saturating_sub(1);
    }
}

#[tonic::async_trait]
impl VideoService for Gateway {
    type GenerateStream = EventStream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let deadline = grpc_timeout(request.metadata()).map(|d| Instant::now() + d);
        let raw = RawRequest::from(request.into_inner());
        let shared = &self.0;
        let params = raw
            .validate(&shared.cfg, &shared.model)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let position = {
            let mut waiting = lock(&shared.waiting);
            if *waiting as usize >= shared.cfg.serving.queue_depth {
                return Err(Status::resource_exhausted(format!(
                    "the queue is full ({} requests waiting); retry later",
                    shared.cfg.serving.queue_depth
                )));
            }
            *waiting += 1;
            *waiting - 1 + *lock(&shared.running)
        };
        let id = format!("req-{}", shared.next_id.fetch_add(1, Ordering::Relaxed));
        let (cancel_tx, cancel_rx) = watch::channel(false);
        lock(&shared.cancels).insert(id.clone(), cancel_tx);
        let (tx, rx) = mpsc::channel(64);
        let accepted = pb::Accepted {
            request_id: id.clone(),
            queue_position: position,
            width: params.width as u32,
            height: params.height as u32,
            num_frames: params.num_frames as u32,
            fps: params.fps,
            steps: params.steps as u32,
            seed: params.seed,
        };
        let _ = tx.try_send(ev(pb::generate_event::Event::Accepted(accepted)));
        let shared = Arc::clone(shared);
        tokio::spawn(async move {
            let outcome = route(&shared, &id, &params, deadline, cancel_rx, &tx).await;
            if let Err(status) = outcome {
                let _ = tx.send(Err(status)).await;
            }
            lock(&shared.cancels).remove(&id);
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn cancel(
        &self,
        request: Request<pb::CancelRequest>,
    ) -> Result<Response<pb::CancelResponse>, Status> {
        let id = request.into_inner().request_id;
        let cancelled = lock(&self.0.cancels)
            .get(&id)
            .map(|tx| tx.send(true).is_ok())
            .unwrap_or(false);
        Ok(Response::new(pb::CancelResponse { cancelled }))
    }

    async fn health(
        &self,
        _: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthResponse>, Status> {
        let (queued, running) = (*lock(&self.0.waiting), *lock(&self.0.running));
        let reg = lock(&self.0.registry);
        let has = |role| reg.pools.values().any(|p| p.role == role);
        let serving = has(pb::PoolRole::Denoiser) && has(pb::PoolRole::Decoder);
        Ok(Response::new(pb::HealthResponse {
            serving,
            queued,
            running,
        }))
    }

    async fn list_models(
        &self,
        _: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        let reg = lock(&self.0.registry);
        let count = |role| reg.pools.values().filter(|p| p.role == role).count();
        let description = format!(
            "{} denoiser pool(s), {} decoder instance(s)",
            count(pb::PoolRole::Denoiser),
            count(pb::PoolRole::Decoder)
        );
        Ok(Response::new(pb::ListModelsResponse {
            models: vec![pb::ModelInfo {
                name: self.0.model.clone(),
                description,
            }],
        }))
    }
}

/// Releases a pool when dropped (the request ended, however it ended).
struct Lease<'a> {
    shared: &'a Shared,
    id: Option<String>,
}

impl Lease<'_> {
    fn release(&mut self) {
        if let Some(id) = self.id.take() {
            self.shared.release(&id);
        }
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

/// Stops when the client is gone, `Cancel` names the request, or the deadline passes.
async fn stopped(
    tx: &mpsc::Sender<Result<pb::GenerateEvent, Status>>,
    cancel: &mut watch::Receiver<bool>,
    deadline: Option<Instant>,
) -> Status {
    let deadline = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d.into()).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tx.closed() => Status::cancelled("the client went away"),
        _ = cancel.wait_for(|c| *c) => Status::cancelled("the request was cancelled"),
        _ = deadline => Status::deadline_exceeded("the request's deadline passed"),
    }
}

/// One request's whole life at the gateway.
async fn route(
    shared: &Shared,
    id: &str,
    p: &GenerateParams,
    deadline: Option<Instant>,
    mut cancel: watch::Receiver<bool>,
    tx: &mpsc::Sender<Result<pb::GenerateEvent, Status>>,
) -> Result<(), Status> {
    let accepted = Instant::now();
    let waiting = Count(&shared.waiting);
    // Wait for a free denoiser and any decoder.
    // Wait for a free denoiser and any decoder, and reach both. A pool that cannot be reached
    // (its process died; its heartbeats have not timed out yet) is forgotten at once and the
    // request routed again, so a dead pool costs a retry, not a failed request.
    let (mut dn_lease, _dc_lease, denoiser, decoder, mut dn, mut dc) = loop {
        let changed = shared.changed.notified();
        let Some((dn_id, denoiser, dc_id, decoder)) = shared.try_acquire() else {
            tokio::select! {
                _ = changed => {}
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                status = stopped(tx, &mut cancel, deadline) => return Err(status),
            }
            continue;
        };
        let dn_lease = Lease {
            shared,
            id: Some(dn_id.clone()),
        };
        let dc_lease = Lease {
            shared,
            id: Some(dc_id.clone()),
        };
        let dc = match DecoderPoolClient::connect(format!("http://{}", decoder.address)).await {
            Ok(c) => c.max_decoding_message_size(64 << 20),
            Err(e) => {
                shared.forget(&dc_id, &e.to_string());
                continue;
            }
        };
        let dn = match DenoiserPoolClient::connect(format!("http://{}", denoiser.address)).await {
            Ok(c) => c,
            Err(e) => {
                shared.forget(&dn_id, &e.to_string());
                continue;
            }
        };
        break (dn_lease, dc_lease, denoiser, decoder, dn, dc);
    };
    drop(waiting);
    let _running = Count::new(&shared.running);
    let queue_ms = ms(accepted.elapsed());
    tracing::info!(id, denoiser = %denoiser.address, decoder = %decoder.address, "routed");

    let mut decode = dc
        .decode(pb::DecodeRequest {
            request_id: id.to_string(),
            width: p.width as u32,
            height: p.height as u32,
            num_frames: p.num_frames as u32,
            fps: p.fps,
            segment_frames: p.segment_frames as u32,
        })
        .await?
        .into_inner();
    // The decoder registers the request before its first event: the latent may now flow.
    let first = decode
        .message()
        .await?
        .ok_or_else(|| Status::internal("the decoder closed the stream at once"))?;
    let mut denoise = dn
        .denoise(pb::DenoiseRequest {
            request_id: id.to_string(),
            prompt: p.prompt.clone(),
            negative_prompt: p.negative_prompt.clone(),
            width: p.width as u32,
            height: p.height as u32,
            num_frames: p.num_frames as u32,
            steps: p.steps as u32,
            guidance_scale: p.guidance_scale,
            guidance_scale_2: p.guidance_scale_2,
            seed: p.seed,
            decoder_link_address: decoder.link_address.clone(),
            decoder_link_host: decoder.link_host.clone(),
            decoder_link_kind: decoder.link_kind.clone(),
        })
        .await?
        .into_inner();

    let send = |e: Result<pb::GenerateEvent, Status>| async move {
        tx.send(e)
            .await
            .map_err(|_| Status::cancelled("the client went away"))
    };
    let mut timings = pb::Timings {
        queue_ms,
        ..Default::default()
    };
    let (mut denoised, mut decoded) = (None, None);
    let mut pending_first = Some(first);
    loop {
        if let Some(e) = pending_first.take() {
            relay_decode(e, &mut decoded, &mut timings, accepted, &send).await?;
            continue;
        }
        if denoised.is_some() && decoded.is_some() {
            break;
        }
        tokio::select! {
            msg = denoise.message(), if denoised.is_none() => match msg?.and_then(|m| m.event) {
                Some(pb::denoise_event::Event::Progress(pr)) => send(ev(pb::generate_event::Event::Progress(pr))).await?,
                Some(pb::denoise_event::Event::Denoised(d)) => {
                    timings.text_ms = d.text_ms;
                    timings.denoise_ms = d.denoise_ms;
                    denoised = Some(d);
                    // The latent is handed over: the denoiser takes its next request now.
                    dn_lease.release();
                }
                None => return Err(Status::internal("the denoiser ended without its latent")),
            },
            msg = decode.message() => match msg? {
                Some(e) => relay_decode(e, &mut decoded, &mut timings, accepted, &send).await?,
                None => return Err(Status::internal("the decoder ended before the last segment")),
            },
            status = stopped(tx, &mut cancel, deadline) => return Err(status),
        }
    }
    timings.total_ms = ms(accepted.elapsed());
    let d = decoded.unwrap_or_default();
    send(ev(pb::generate_event::Event::Completed(pb::Completed {
        timings: Some(timings),
        frames: d.frames,
        segments: d.segments,
    })))
    .await?;
    Ok(())
}

/// Relays one decoder event to the client.
async fn relay_decode<F, Fut>(
    e: pb::DecodeEvent,
    decoded: &mut Option<pb::Decoded>,
    timings: &mut pb::Timings,
    accepted: Instant,
    send: &F,
) -> Result<(), Status>
where
    F: Fn(Result<pb::GenerateEvent, Status>) -> Fut,
    Fut: std::future::Future<Output = Result<(), Status>>,
{
    use pb::decode_event::Event as D;
    use pb::generate_event::Event as G;
    match e.event {
        Some(D::InitSegment(i)) => send(ev(G::InitSegment(i))).await,
        Some(D::MediaSegment(s)) => {
            send(ev(G::MediaSegment(s))).await?;
            if timings.first_segment_ms == 0.0 {
                timings.first_segment_ms = ms(accepted.elapsed());
            }
            Ok(())
        }
        Some(D::Progress(p)) => send(ev(G::Progress(p))).await,
        Some(D::Decoded(d)) => {
            timings.decode_ms = d.decode_ms;
            timings.encode_ms = d.encode_ms;
            *decoded = Some(d);
            Ok(())
        }
        None => Ok(()),
    }
}

/// A gateway running in this process.
pub struct RunningGateway {
    /// Where clients and pools reach it.
    pub addr: SocketAddr,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for RunningGateway {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Serves `VideoService` and `PoolRegistry` on `listen`.
pub async fn start(cfg: &Config, listen: SocketAddr) -> anyhow::Result<RunningGateway> {
    let shared = Arc::new(Shared {
        registry: Mutex::default(),
        changed: Notify::new(),
        waiting: Mutex::new(0),
        running: Mutex::new(0),
        cancels: Mutex::default(),
        next_id: AtomicU64::new(1),
        cfg: cfg.clone(),
        model: model_name(cfg),
        heartbeat_timeout: Duration::from_secs(cfg.pools.heartbeat_timeout_s),
    });
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    let gateway = Gateway(Arc::clone(&shared));
    let serve = tokio::spawn(async move {
        let served = tonic::transport::Server::builder()
            .add_service(
                VideoServiceServer::new(gateway.clone()).max_encoding_message_size(64 << 20),
            )
            .add_service(PoolRegistryServer::new(gateway))
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "gateway gRPC server failed");
        }
    });
    let reaper = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            shared.reap();
        }
    });
    tracing::info!(%addr, "gateway up");
    Ok(RunningGateway {
        addr,
        tasks: vec![serve, reaper],
    })
}
