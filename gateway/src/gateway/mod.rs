//! The gateway: the only public service and the only admission queue, in every deployment.
//! `ditstream gateway` runs it in front of pools in other processes (which register through
//! `PoolRegistry`); `ditstream serve` runs it in front of one denoiser pool and one decoder
//! instance in the same process ([`Gateway::add_local`]). Either way a request takes the same
//! path (`route.rs`): admission here, a free denoiser and the least-loaded decoder, both streams
//! relayed to the client, and the denoiser freed for the next request as soon as its latent is
//! handed over, so decode(N) overlaps denoise(N+1).
//!
//! Clients reach `VideoService` on the public listener (TLS and API keys when configured; see
//! `keys.rs`); pools reach `PoolRegistry` on a listener of its own, over mutual TLS with the
//! pool CA, and the gateway reaches them the same way.
//!
//! - `pools.rs`: the registry, how the gateway reaches a pool, leases;
//! - `route.rs`: one request's life: waiting, routing, relaying, stopping;
//! - `keys.rs`: API keys and who a call acts for;
//! - this file: the gRPC services (`VideoService`, `PoolRegistry`), admission, listeners and
//!   shutdown.

pub mod keys;
mod pools;
mod route;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use ditstream_common::config::Config;
use ditstream_proto::v1 as pb;
use ditstream_proto::v1::pool_registry_server::{PoolRegistry, PoolRegistryServer};
use ditstream_proto::v1::video_service_server::{VideoService, VideoServiceServer};
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::cost::CostModel;
use crate::request::{GenerateParams, RawRequest};
use ditstream_common::config::PerKeyLimits;
use ditstream_common::net::{self, ConnInfo, Listener, Security};
use ditstream_common::tls::{Certificate, Identity};
use ditstream_common::{link, status, tls};
use ditstream_decoder::service::DecoderService;
use ditstream_denoiser::service::DenoiserService;

pub use pools::Reach;
use pools::Registry;

/// Events buffered for a client that has not read them yet.
const CLIENT_BUFFER: usize = 16;

/// Events a client's stream carries.
type EventStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateEvent, Status>> + Send>>;

/// What ends a request from the gateway's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Nothing: it runs.
    No,
    /// `Cancel` named it.
    Cancelled,
    /// The server is shutting down and the grace is over.
    ShuttingDown,
}

/// A request known to the gateway, queued or running.
struct Entry {
    stop: watch::Sender<Stop>,
    /// Claimed a place to run (routing or running).
    running: bool,
    /// The principal (API key name) that made it.
    owner: String,
}

/// What the services share.
struct Shared {
    cfg: Config,
    model: String,
    cost: CostModel,
    keys: keys::Keys,
    metrics: crate::metrics::Metrics,
    /// The control plane's identity (the registry's listener, calls to remote pools); `None`
    /// in `serve`, which has no remote pools.
    control: Option<Arc<Identity>>,
    per_key: PerKeyLimits,
    registry: Mutex<Registry>,
    /// Woken when a pool registers, frees or leaves.
    changed: Notify,
    /// Queued and running requests by id.
    requests: Mutex<HashMap<String, Entry>>,
    /// Set by shutdown: nothing more is admitted.
    draining: AtomicBool,
    /// Woken when a request ends (shutdown waits on it).
    ended: Notify,
    client_send_timeout: Duration,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Each critical section is a few map or field updates: a poisoned lock still holds
    // consistent data.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shared {
    /// (queued, running).
    fn load(&self) -> (u32, u32) {
        let requests = lock(&self.requests);
        let running = requests.values().filter(|e| e.running).count() as u32;
        (requests.len() as u32 - running, running)
    }

    /// Claims a place to run for request `id` unless its key already runs
    /// `serving.per_key.max_running` requests; false means wait.
    fn claim(&self, id: &str) -> bool {
        let mut requests = lock(&self.requests);
        let Some(owner) = requests.get(id).map(|e| e.owner.clone()) else {
            return false;
        };
        if let Some(max) = self.per_key.max_running {
            let running = requests
                .iter()
                .filter(|(other, e)| e.running && e.owner == owner && other.as_str() != id)
                .count();
            if running >= max {
                return false;
            }
        }
        if let Some(e) = requests.get_mut(id) {
            e.running = true;
        }
        true
    }

    /// Gives back a claim that found no pools.
    fn unclaim(&self, id: &str) {
        if let Some(e) = lock(&self.requests).get_mut(id) {
            e.running = false;
        }
    }

    fn forget_request(&self, id: &str) {
        lock(&self.requests).remove(id);
        self.ended.notify_waiters();
        // A request of the same key may have waited for this one's place.
        self.changed.notify_waiters();
    }
}

/// The gateway's gRPC services, cheap to clone.
#[derive(Clone)]
pub struct Gateway(Arc<Shared>);

impl Gateway {
    /// `/metrics`: the counters and histograms, and the queue and the pools as they are now.
    pub fn metrics_text(&self) -> String {
        let (queued, running) = self.0.load();
        let pools = lock(&self.0.registry).samples();
        self.0.metrics.render(queued, running, &pools)
    }

    /// Counts an HTTP answer ([`crate::metrics::Metrics::http_response`]).
    pub fn http_response(&self, route: &str, code: u16) {
        self.0.metrics.http_response(route, code);
    }

    /// Who a call with `metadata` acts for (its API key's name); UNAUTHENTICATED without a
    /// valid key when the server has keys (counted at `/metrics`). Every gRPC method and HTTP
    /// route that needs a key asks here.
    pub fn authenticate(&self, metadata: &tonic::metadata::MetadataMap) -> Result<String, Status> {
        self.0
            .keys
            .authenticate(metadata)
            .inspect_err(|_| self.0.metrics.auth_failed())
    }

    /// The model it serves.
    pub fn model(&self) -> &str {
        &self.0.model
    }

    /// The frame rate of videos that do not ask for one.
    pub fn default_fps(&self) -> u32 {
        self.0.cfg.serving.fps
    }

    /// Whether requests can be served now (not draining; a denoiser and a decoder registered).
    pub fn serving(&self) -> bool {
        !self.0.draining.load(Ordering::SeqCst) && lock(&self.0.registry).can_serve()
    }

    /// A gateway for the model `cfg` serves, with no pools yet; `control` is its identity on
    /// the control plane (for pools in other processes).
    pub fn new(cfg: &Config, control: Option<Identity>) -> anyhow::Result<Gateway> {
        let cost = CostModel::new(
            cfg,
            ditstream_denoiser::models::transformer_config(cfg)
                .context("the admission cost model")?,
            &ditstream_decoder::models::vae_config(cfg).context("the admission cost model")?,
        );
        Ok(Gateway(Arc::new(Shared {
            cfg: cfg.clone(),
            model: cfg.model_name(),
            cost,
            keys: keys::Keys::load(cfg.serving.api_keys.as_deref().map(|p| cfg.path(p)))?,
            per_key: cfg.serving.per_key.clone(),
            metrics: crate::metrics::Metrics::new(),
            control: control.map(Arc::new),
            registry: Mutex::new(Registry::new(Duration::from_secs(
                cfg.pools.heartbeat_timeout_s,
            ))),
            changed: Notify::new(),
            requests: Mutex::default(),
            draining: AtomicBool::new(false),
            ended: Notify::new(),
            client_send_timeout: Duration::from_secs_f64(cfg.serving.client_send_timeout_s),
        })))
    }

    /// Routes to a denoiser pool and a decoder instance in this process (`ditstream serve`):
    /// never reaped, reached by direct calls, the latent handed over in memory.
    pub fn add_local(&self, denoiser: Arc<DenoiserService>, decoder: Arc<DecoderService>) {
        let mut registry = lock(&self.0.registry);
        registry.add_local(Reach::LocalDenoiser(denoiser));
        registry.add_local(Reach::LocalDecoder(decoder));
        drop(registry);
        self.0.changed.notify_waiters();
    }

    /// Stops admitting, lets running and queued requests finish for up to `grace`, then cancels
    /// the rest and waits (briefly) for them to end.
    pub async fn drain(&self, grace: Duration) {
        self.0.draining.store(true, Ordering::SeqCst);
        let (queued, running) = self.0.load();
        tracing::info!(queued, running, grace_s = grace.as_secs_f64(), "draining");
        if tokio::time::timeout(grace, self.idle()).await.is_err() {
            let requests = lock(&self.0.requests);
            tracing::warn!(left = requests.len(), "grace over: cancelling");
            for e in requests.values() {
                let _ = e.stop.send(Stop::ShuttingDown);
            }
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), self.idle()).await;
    }

    /// Resolves once no request is queued or running.
    async fn idle(&self) {
        loop {
            let ended = self.0.ended.notified();
            if lock(&self.0.requests).is_empty() {
                return;
            }
            ended.await;
        }
    }

    /// Admission for `owner`: validation, the cost model, the queue bounds (the server's and
    /// the key's). Returns the request's id, its queue position, its cancel switch and its
    /// validated parameters.
    fn admit(
        &self,
        raw: RawRequest,
        owner: String,
    ) -> Result<(String, u32, watch::Receiver<Stop>, GenerateParams), Status> {
        let shared = &self.0;
        if shared.draining.load(Ordering::SeqCst) {
            return Err(status::shutting_down());
        }
        let params = raw
            .validate(&shared.cfg, &shared.model)
            .map_err(|e| status::invalid(&e))?;
        shared
            .cost
            .admit(&params)
            .map_err(|e| status::over_budget(&e))?;
        let mut requests = lock(&shared.requests);
        let queued = requests.values().filter(|e| !e.running).count();
        if queued >= shared.cfg.serving.queue_depth {
            return Err(status::queue_full(shared.cfg.serving.queue_depth));
        }
        if let Some(max) = shared.per_key.max_queued {
            let mine = requests
                .values()
                .filter(|e| !e.running && e.owner == owner)
                .count();
            if mine >= max {
                return Err(status::key_queue_full(&owner, max));
            }
        }
        let id = request_id();
        let (stop, stopped) = watch::channel(Stop::No);
        let position = requests.len() as u32;
        requests.insert(
            id.clone(),
            Entry {
                stop,
                running: false,
                owner,
            },
        );
        Ok((id, position, stopped, params))
    }
}

impl From<pb::GenerateRequest> for RawRequest {
    /// The public request in domain terms (the service's one wire → domain conversion).
    fn from(r: pb::GenerateRequest) -> RawRequest {
        RawRequest {
            prompt: r.prompt,
            negative_prompt: r.negative_prompt,
            width: r.width,
            height: r.height,
            num_frames: r.num_frames,
            fps: r.fps,
            steps: r.steps,
            guidance_scale: r.guidance_scale,
            guidance_scale_2: r.guidance_scale_2,
            seed: r.seed,
            model: r.model,
            segment_frames: r.segment_frames,
        }
    }
}

/// A fresh request id: 128 random bits, so ids can be neither guessed nor foreseen.
fn request_id() -> String {
    format!("req-{:032x}", rand::random::<u128>())
}

/// The `grpc-timeout` header (e.g. `30S`, `500m`) as a duration, clamped to `max`; `None` when
/// absent or malformed. Huge values (`18446744073709551615S`) clamp instead of overflowing.
pub fn grpc_timeout(metadata: &tonic::metadata::MetadataMap, max: Duration) -> Option<Duration> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    let n: u64 = digits.parse().ok()?;
    let d = match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    };
    Some(d.min(max))
}

#[tonic::async_trait]
impl VideoService for Gateway {
    type GenerateStream = EventStream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let owner = self.authenticate(request.metadata())?;
        let max = Duration::from_secs(self.0.cfg.serving.max_deadline_s);
        let deadline = grpc_timeout(request.metadata(), max).map(|d| Instant::now() + d);
        let raw = RawRequest::from(request.into_inner());
        let (id, position, stop, params) = self.admit(raw, owner).inspect_err(|e| {
            self.0.metrics.ended(&status::code_name(e.code()));
        })?;
        tracing::info!(
            id,
            position,
            width = params.width,
            height = params.height,
            frames = params.num_frames,
            steps = params.steps,
            "accepted"
        );
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
        // A few events of slack for a client that reads: progress is small, and segments are
        // bounded in count here and in bytes by HTTP/2 flow control below; a client that stops
        // reading fills this quickly and then loses its request after the send timeout.
        let (tx, mut rx) = mpsc::channel(CLIENT_BUFFER);
        let (end_tx, end_rx) = oneshot::channel();
        let client = route::Client::new(tx, end_tx, self.0.client_send_timeout);
        // The stream's last item is the failure status, after everything already queued for the
        // client: nothing delivered is lost, and the end is never mistaken for success.
        let stream = async_stream::stream! {
            while let Some(event) = rx.recv().await {
                yield Ok(event);
            }
            if let Ok(status) = end_rx.await {
                yield Err(status);
            }
        };
        let shared = Arc::clone(&self.0);
        let span = tracing::info_span!("request", id = %id);
        tokio::spawn(
            route::run(
                shared,
                route::Admitted {
                    id,
                    params,
                    deadline,
                    stop,
                    accepted,
                },
                client,
            )
            .instrument(span),
        );
        Ok(Response::new(Box::pin(stream)))
    }

    async fn cancel(
        &self,
        request: Request<pb::CancelRequest>,
    ) -> Result<Response<pb::CancelResponse>, Status> {
        let owner = self.authenticate(request.metadata())?;
        let id = request.into_inner().request_id;
        let cancelled = match lock(&self.0.requests).get(&id) {
            Some(e) if e.owner == owner => e.stop.send(Stop::Cancelled).is_ok(),
            _ => return Err(status::no_such_request(&id)),
        };
        tracing::info!(id, cancelled, "cancel");
        Ok(Response::new(pb::CancelResponse { cancelled }))
    }

    async fn health(
        &self,
        _: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthResponse>, Status> {
        let (queued, running) = self.0.load();
        let serving = self.serving();
        Ok(Response::new(pb::HealthResponse {
            serving,
            queued,
            running,
        }))
    }

    async fn list_models(
        &self,
        request: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        self.authenticate(request.metadata())?;
        let description = lock(&self.0.registry).describe();
        Ok(Response::new(pb::ListModelsResponse {
            models: vec![pb::ModelInfo {
                name: self.0.model.clone(),
                description,
            }],
        }))
    }
}

/// The certificate the registry's caller presented (its listener requires one; a call that
/// reached the service some other way has none and is refused).
fn peer_certificate<T>(request: &Request<T>) -> Result<Certificate, Status> {
    ConnInfo::of(request)
        .and_then(|c| c.peer.clone())
        .ok_or_else(|| {
            status::unauthenticated("the pool registry needs a pool-CA client certificate")
        })
}

#[tonic::async_trait]
impl PoolRegistry for Gateway {
    async fn register(
        &self,
        request: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterResponse>, Status> {
        let certificate = peer_certificate(&request)?;
        let Some(tls) = self.0.control.clone() else {
            return Err(status::internal(
                "registry",
                "the gateway has no control-plane identity",
            ));
        };
        let r = request.into_inner();
        let role = pb::PoolRole::try_from(r.role).unwrap_or(pb::PoolRole::Unspecified);
        if role == pb::PoolRole::Unspecified {
            return Err(status::invalid_field(
                "role",
                r.role,
                "must be DENOISER or DECODER",
            ));
        }
        if r.model != self.0.model {
            return Err(status::wrong_model(&r.model, &self.0.model));
        }
        let id = lock(&self.0.registry).register(role, r, tls, certificate)?;
        self.0.changed.notify_waiters();
        Ok(Response::new(pb::RegisterResponse { pool_id: id }))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let certificate = peer_certificate(&request)?;
        let known =
            lock(&self.0.registry).heartbeat(&request.into_inner().pool_id, &certificate)?;
        Ok(Response::new(pb::HeartbeatResponse { known }))
    }

    async fn deregister(
        &self,
        request: Request<pb::DeregisterRequest>,
    ) -> Result<Response<pb::DeregisterResponse>, Status> {
        let certificate = peer_certificate(&request)?;
        let id = request.into_inner().pool_id;
        lock(&self.0.registry).deregister(&id, &certificate)?;
        self.0.changed.notify_waiters();
        Ok(Response::new(pb::DeregisterResponse {}))
    }
}

/// A gateway serving on a socket in this process.
pub struct RunningGateway {
    /// Where clients reach it.
    pub addr: SocketAddr,
    /// Where pools register (`ditstream gateway` only).
    pub registry_addr: Option<SocketAddr>,
    gateway: Gateway,
    /// The Videos API's jobs, whose relays `stop` lets persist.
    store: Arc<crate::http::videos::Store>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl RunningGateway {
    /// The services, for adding pools.
    pub fn gateway(&self) -> &Gateway {
        &self.gateway
    }

    /// Stops admitting, drains for up to `grace`, cancels the rest, lets the Videos API's jobs
    /// write their last state (so nothing writes into `serving.videos.dir` once this returns,
    /// and a restart finds each job as it ended), then closes the listeners.
    pub async fn stop(mut self, grace: Duration) {
        self.gateway.drain(grace).await;
        self.store.settle(Duration::from_secs(5)).await;
        let _ = self.shutdown.send(true);
        let mut tasks = self.tasks.drain(..);
        // The server ends once its connections close; a client that never reads keeps its
        // connection, so the wait is bounded.
        if let Some(server) = tasks.next() {
            let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
        }
        for t in tasks {
            t.abort();
        }
    }
}

impl Drop for RunningGateway {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Resolves once `shutdown` turns true (or its sender is gone).
async fn until(mut shutdown: watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|s| *s).await;
}

/// Serves `gateway`'s public API on `listen` — `VideoService`, `grpc.health.v1`, reflection,
/// and on the same port the HTTP API (`crate::http`) — with TLS from `serving.tls` and API
/// keys from `serving.api_keys` (a non-loopback address needs both unless `serving.insecure`),
/// and with
/// `registry` the `PoolRegistry` on that address over mutual TLS (the gateway must have been
/// made with its control-plane identity), with the reaper that drops pools whose heartbeats
/// stop. SIGHUP reloads the API keys.
pub async fn serve(
    gateway: Gateway,
    listen: SocketAddr,
    registry: Option<SocketAddr>,
) -> anyhow::Result<RunningGateway> {
    let shared = Arc::clone(&gateway.0);
    let cfg = &shared.cfg;
    cfg.serving.check_exposure(listen)?;
    let security = match &cfg.serving.tls {
        Some(files) => Security::Tls(tls::public_server(
            &cfg.path(&files.cert),
            &cfg.path(&files.key),
        )?),
        None => Security::Plaintext,
    };
    let public = Listener::bind("serving.listen", listen, security, &cfg.connections)
        .await?
        .counted_in(shared.metrics.connections());
    let addr = public.local_addr()?;
    let secured = cfg.serving.tls.is_some() && shared.keys.required();
    if !addr.ip().is_loopback() && !secured {
        tracing::warn!(%addr, "serving.insecure: the public API is unencrypted or unauthenticated on a non-loopback address");
    }
    let (shutdown, stopped) = watch::channel(false);
    // One listener for gRPC and HTTP: the Videos API, the page and /metrics are axum routes
    // beside the gRPC services (tonic serves both; HTTP/1.1 accepted).
    let store_dir = cfg.path(&cfg.serving.videos.dir);
    let store = Arc::new(crate::http::videos::Store::open(
        &cfg.serving.videos,
        store_dir,
    ));
    let (health, health_service) = tonic_health::server::health_reporter();
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(ditstream_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .with_service_name("ditstream.v1.VideoService")
        .with_service_name("grpc.health.v1.Health")
        .build_v1()
        .context("gRPC reflection")?;
    let http = crate::http::router(
        gateway.clone(),
        Arc::clone(&store),
        cfg.connections.max_request_bytes,
    );
    let routes = tonic::service::Routes::from(http)
        .add_service(
            VideoServiceServer::new(gateway.clone())
                .max_decoding_message_size(cfg.connections.max_request_bytes)
                .max_encoding_message_size(64 << 20),
        )
        .add_service(health_service)
        .add_service(reflection);
    let router = net::server(&cfg.connections)
        .accept_http1(true)
        .add_routes(routes);
    let mut tasks = vec![net::spawn(
        "the public gRPC server",
        router,
        public,
        until(stopped.clone()),
    )];
    let mut registry_addr = None;
    if let Some(registry_listen) = registry {
        let identity = shared
            .control
            .as_ref()
            .context("the pool registry needs the gateway's control-plane identity")?;
        let listener = Listener::bind(
            "pools.registry_listen",
            registry_listen,
            Security::Tls(identity.mtls_server()?),
            &cfg.connections,
        )
        .await?
        .counted_in(shared.metrics.connections());
        registry_addr = Some(listener.local_addr()?);
        let router = net::server(&cfg.connections).add_service(
            PoolRegistryServer::new(gateway.clone())
                .max_decoding_message_size(cfg.connections.max_request_bytes),
        );
        tasks.push(net::spawn(
            "the pool registry",
            router,
            listener,
            until(stopped),
        ));
        let reaper = Arc::clone(&shared);
        tasks.push(tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                if lock(&reaper.registry).reap() {
                    reaper.changed.notify_waiters();
                }
            }
        }));
    }
    if shared.keys.required() {
        tasks.push(tokio::spawn(reload_keys_on_sighup(Arc::clone(&shared))));
    }
    // The first answer is right from the start; then it follows the pools.
    let serving = gateway.serving();
    set_health(&health, serving).await;
    tasks.push(tokio::spawn(follow_health(
        gateway.clone(),
        health,
        serving,
    )));
    tasks.push(tokio::spawn(
        Arc::clone(&store).expire_every(Duration::from_secs(60)),
    ));
    tracing::info!(%addr, registry = ?registry_addr, tls = cfg.serving.tls.is_some(), api_keys = shared.keys.required(), "gateway serving ditstream.v1.VideoService");
    Ok(RunningGateway {
        addr,
        registry_addr,
        gateway,
        store,
        shutdown,
        tasks,
    })
}

/// Keeps `grpc.health.v1` in step with the gateway: SERVING (overall and for
/// `ditstream.v1.VideoService`) while a denoiser and a decoder are registered and it is not
/// draining, NOT_SERVING otherwise.
async fn follow_health(
    gateway: Gateway,
    reporter: tonic_health::server::HealthReporter,
    mut last: bool,
) {
    loop {
        let changed = gateway.0.changed.notified();
        let serving = gateway.serving();
        if last != serving {
            set_health(&reporter, serving).await;
            last = serving;
        }
        // Pools come and go with a wake-up; draining and reaping are caught by the tick.
        tokio::select! {
            _ = changed => {}
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    }
}

async fn set_health(reporter: &tonic_health::server::HealthReporter, serving: bool) {
    use tonic_health::ServingStatus;
    let status = if serving {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    };
    for name in ["", "ditstream.v1.VideoService"] {
        reporter.set_service_status(name, status).await;
    }
}

/// Reloads the API keys file on every SIGHUP; a file that does not parse keeps the old keys.
async fn reload_keys_on_sighup(shared: Arc<Shared>) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let Ok(mut hangups) = signal(SignalKind::hangup()) else {
            tracing::warn!("cannot watch SIGHUP: API keys reload only on restart");
            return;
        };
        while hangups.recv().await.is_some() {
            match shared.keys.reload() {
                Ok(n) => tracing::info!(keys = n, "API keys reloaded"),
                Err(e) => tracing::error!(error = %e, "API keys not reloaded; the old keys stay"),
            }
        }
    }
    #[cfg(not(unix))]
    let _ = shared;
}

/// `ditstream gateway`'s start: a gateway with its control-plane identity (`pools.tls_*`),
/// the public API on `listen` and the pool registry on `pools.registry_listen` (or
/// `registry_listen`).
pub async fn start(
    cfg: &Config,
    listen: SocketAddr,
    registry_listen: Option<SocketAddr>,
) -> anyhow::Result<RunningGateway> {
    let registry = match registry_listen {
        Some(a) => a,
        None => ditstream_common::config::socket_addr(
            "pools.registry_listen",
            &cfg.pools.registry_listen,
        )?,
    };
    let gateway = Gateway::new(cfg, Some(link::pool::identity(cfg)?))?;
    serve(gateway, listen, Some(registry)).await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn gateway(per_key: &str) -> Gateway {
        let yaml = format!(
            "model: {{preset: tiny}}\nserving: {{width: 64, height: 48, num_frames: 9, per_key: {per_key}}}\n"
        );
        let cfg = Config::parse(&yaml, "<t>").unwrap();
        cfg.validate(Some(1)).unwrap();
        Gateway::new(&cfg, None).unwrap()
    }

    fn admit(g: &Gateway, owner: &str) -> Result<String, Status> {
        let raw = RawRequest {
            prompt: "p".into(),
            ..Default::default()
        };
        g.admit(raw, owner.to_string()).map(|(id, ..)| id)
    }

    #[test]
    fn a_key_runs_at_most_max_running_and_others_pass_it() {
        let g = gateway("{max_running: 1}");
        let (a1, a2, b1) = (
            admit(&g, "alice").unwrap(),
            admit(&g, "alice").unwrap(),
            admit(&g, "bob").unwrap(),
        );
        assert!(g.0.claim(&a1));
        assert!(!g.0.claim(&a2), "alice's second ran beside her first");
        assert!(g.0.claim(&b1), "bob waited behind alice's limit");
        g.0.forget_request(&a1);
        assert!(g.0.claim(&a2));
    }

    #[test]
    fn a_key_queues_at_most_max_queued() {
        let g = gateway("{max_queued: 2}");
        admit(&g, "alice").unwrap();
        let running = admit(&g, "alice").unwrap();
        assert!(g.0.claim(&running));
        admit(&g, "alice").unwrap();
        let e = admit(&g, "alice").unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(
            e.message()
                .starts_with("serving.per_key.max_queued = 2: API key \"alice\"")
        );
        admit(&g, "bob").unwrap();
    }
}
