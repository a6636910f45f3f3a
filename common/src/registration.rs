//! A pool's side of the gateway protocol: register with the gateway, then send a heartbeat every second,
//! registering again if the gateway forgot the pool (it restarted, or dropped the pool after a
//! pause). A pool that can serve nothing more (a rank thread of its stage is gone) stops its
//! heartbeats, so the gateway drops it and routes elsewhere; a pool that shuts down deregisters,
//! so the gateway routes nothing more to it at once.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ditstream_proto::v1 as pb;
use ditstream_proto::v1::pool_registry_client::PoolRegistryClient;

use crate::config::{Config, ConfigError, socket_addr};
use crate::net::{self, ListenError};
use crate::tls::{Identity, TlsError};

/// Why a pool's gRPC service could not start serving.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The listen address is not an address.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The control plane's TLS server config could not be built.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The address could not be bound.
    #[error(transparent)]
    Listen(#[from] ListenError),
    /// The bound socket could not report its address.
    #[error("{source}")]
    LocalAddr {
        /// The listener's config key.
        key: &'static str,
        /// What the OS said.
        source: std::io::Error,
    },
}

type Client = PoolRegistryClient<tonic::transport::Channel>;

/// A registry client over mutual TLS (this pool's certificate, the gateway's checked against
/// the pool CA and the host of `gateway`).
async fn connect(
    gateway: &str,
    identity: &Identity,
) -> Result<Client, Box<dyn std::error::Error + Send + Sync>> {
    let channel = identity
        .endpoint(gateway)?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await?;
    Ok(PoolRegistryClient::new(channel))
}

/// The id the gateway put in a pool call's metadata (`x-request-id`), or `fallback` (the request's
/// own field), for the pool's logs.
pub fn request_id_of<T>(request: &tonic::Request<T>, fallback: &str) -> String {
    request
        .metadata()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or(fallback)
        .to_string()
}

/// Serves a pool's gRPC service on `listen` (the config key `key`) behind the control plane's
/// mutual TLS and the connection limits: only peers with a pool-CA certificate (the gateway)
/// reach it. Returns the address (the real port for port 0) and the serving task.
pub async fn serve<S>(
    cfg: &Config,
    key: &'static str,
    listen: &str,
    identity: &Identity,
    service: S,
) -> Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>), ServeError>
where
    S: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let security = net::Security::Tls(identity.mtls_server()?);
    let listener =
        net::Listener::bind(key, socket_addr(key, listen)?, security, &cfg.connections).await?;
    let addr = listener
        .local_addr()
        .map_err(|source| ServeError::LocalAddr { key, source })?;
    let router = net::server(&cfg.connections).add_service(service);
    Ok((
        addr,
        net::spawn(S::NAME, router, listener, std::future::pending()),
    ))
}

/// Why a pool is out of service, if it is (checked before every heartbeat).
pub type Health = Arc<dyn Fn() -> Option<String> + Send + Sync>;

/// A pool serving in this process behind its own listener(s) and registered with a gateway:
/// what `ditstream denoiser` and `ditstream decoder` run until Ctrl-C.
pub struct RunningPool {
    /// Its gRPC address.
    pub addr: std::net::SocketAddr,
    /// A decoder instance's latent-link address (`None` for a denoiser pool).
    pub link_addr: Option<std::net::SocketAddr>,
    registration: Registered,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl RunningPool {
    /// A pool at `addr` (and `link_addr`) kept registered by `registration`, serving in `tasks`.
    pub fn new(
        addr: std::net::SocketAddr,
        link_addr: Option<std::net::SocketAddr>,
        registration: Registered,
        tasks: Vec<tokio::task::JoinHandle<()>>,
    ) -> RunningPool {
        RunningPool {
            addr,
            link_addr,
            registration,
            tasks,
        }
    }

    /// Leaves the gateway (nothing more is routed here), then stops serving.
    pub async fn stop(mut self) {
        self.registration.deregister().await;
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }
}

impl Drop for RunningPool {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// A pool's registration, kept alive in the background until [`Registered::deregister`].
pub struct Registered {
    gateway: String,
    identity: Arc<Identity>,
    pool_id: Arc<Mutex<Option<String>>>,
    task: tokio::task::JoinHandle<()>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A single Option assignment per critical section: a poisoned lock is still consistent.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Registered {
    /// Registers with `gateway` (over mutual TLS, as `identity`) and keeps the registration;
    /// `active` is the pool's current request count; `health` says when it can serve nothing
    /// more (then it stops, for good).
    pub fn start(
        gateway: String,
        identity: Arc<Identity>,
        registration: pb::RegisterRequest,
        active: Arc<AtomicU32>,
        health: Health,
    ) -> Registered {
        let pool_id = Arc::new(Mutex::new(None));
        let task = tokio::spawn(keep_registered(
            gateway.clone(),
            Arc::clone(&identity),
            registration,
            active,
            health,
            Arc::clone(&pool_id),
        ));
        Registered {
            gateway,
            identity,
            pool_id,
            task,
        }
    }

    /// Stops the heartbeats and tells the gateway the pool is leaving.
    pub async fn deregister(&mut self) {
        self.task.abort();
        let Some(id) = lock(&self.pool_id).take() else {
            return;
        };
        let left = async {
            let mut c = connect(&self.gateway, &self.identity).await?;
            c.deregister(pb::DeregisterRequest {
                pool_id: id.clone(),
            })
            .await?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        };
        match tokio::time::timeout(Duration::from_secs(5), left).await {
            Ok(Ok(())) => tracing::info!(gateway = %self.gateway, pool_id = %id, "deregistered"),
            Ok(Err(e)) => {
                tracing::warn!(gateway = %self.gateway, error = %e, "deregistering failed")
            }
            Err(_) => tracing::warn!(gateway = %self.gateway, "deregistering timed out"),
        }
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn keep_registered(
    gateway: String,
    identity: Arc<Identity>,
    registration: pb::RegisterRequest,
    active: Arc<AtomicU32>,
    health: Health,
    shared_id: Arc<Mutex<Option<String>>>,
) {
    let mut pool_id: Option<String> = None;
    let mut client: Option<Client> = None;
    loop {
        if let Some(why) = health() {
            tracing::error!(%gateway, %why, "out of service: no more heartbeats");
            return;
        }
        if client.is_none() {
            client = match connect(&gateway, &identity).await {
                Ok(c) => Some(c),
                Err(e) => {
                    tracing::warn!(%gateway, error = %e, "gateway unreachable");
                    None
                }
            };
        }
        if let Some(c) = client.as_mut() {
            let result = match &pool_id {
                None => c.register(registration.clone()).await.map(|r| {
                    let id = r.into_inner().pool_id;
                    tracing::info!(%gateway, pool_id = %id, "registered");
                    pool_id = Some(id);
                }),
                Some(id) => {
                    let beat = pb::HeartbeatRequest {
                        pool_id: id.clone(),
                        active: active.load(Ordering::Relaxed),
                    };
                    c.heartbeat(beat).await.map(|r| {
                        if !r.into_inner().known {
                            tracing::warn!(%gateway, "the gateway forgot this pool; registering again");
                            pool_id = None;
                        }
                    })
                }
            };
            if let Err(status) = result {
                tracing::warn!(%gateway, error = %status.message(), "gateway unreachable");
                client = None;
                pool_id = None;
            }
        }
        lock(&shared_id).clone_from(&pool_id);
        tokio::time::sleep(Duration::from_millis(if pool_id.is_some() {
            1000
        } else {
            250
        }))
        .await;
    }
}
