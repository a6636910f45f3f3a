//! The gateway's registry of pools: who they are, how to reach them, how busy they are. A
//! denoiser pool runs one request at a time; a decoder instance any number (the least loaded is
//! chosen). Pools in other processes register and send heartbeats, and are dropped when those
//! stop or when they cannot be reached; pools in this process (`serve`) stay. A remote pool is
//! bound to the certificate it registered with: its addresses must be names on it, and only it
//! may send the pool's heartbeats or deregister it.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ditstream_proto::v1 as pb;
use ditstream_proto::v1::decoder_pool_client::DecoderPoolClient;
use ditstream_proto::v1::decoder_pool_server::DecoderPool;
use ditstream_proto::v1::denoiser_pool_client::DenoiserPoolClient;
use ditstream_proto::v1::denoiser_pool_server::DenoiserPool;
use tokio_stream::Stream;
use tonic::{Request, Status};

use ditstream_common::status;
use ditstream_common::tls::{self, Certificate, Identity};
use ditstream_decoder::service::DecoderService;
use ditstream_denoiser::service::DenoiserService;

/// A pool's stream of events.
pub type PoolStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// How long the gateway waits to connect to a pool before it counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A pool in another process: its gRPC address and the gateway's identity for reaching it.
#[derive(Clone)]
pub struct Remote {
    /// host:port; the host is a name on the pool's certificate.
    pub address: String,
    tls: Arc<Identity>,
}

/// How the gateway reaches a pool.
#[derive(Clone)]
pub enum Reach {
    /// Over gRPC with mutual TLS.
    Remote(Remote),
    /// The denoiser pool in this process.
    LocalDenoiser(Arc<DenoiserService>),
    /// The decoder instance in this process.
    LocalDecoder(Arc<DecoderService>),
}

/// The request id in the metadata the pools log it under.
fn with_id<T>(message: T, id: &str) -> Request<T> {
    let mut request = Request::new(message);
    if let Ok(value) = id.parse() {
        request.metadata_mut().insert("x-request-id", value);
    }
    request
}

async fn channel(what: &str, remote: &Remote) -> Result<tonic::transport::Channel, Status> {
    let address = &remote.address;
    remote
        .tls
        .endpoint(address)
        .map_err(|e| status::unreachable(what, address, e))?
        .connect_timeout(CONNECT_TIMEOUT)
        .connect()
        .await
        .map_err(|e| status::unreachable(what, address, e))
}

impl Reach {
    /// Where the pool is, for logs and messages.
    pub fn address(&self) -> &str {
        match self {
            Reach::Remote(r) => &r.address,
            Reach::LocalDenoiser(_) | Reach::LocalDecoder(_) => "this process",
        }
    }

    /// Opens the request's `Denoise` stream.
    pub async fn denoise(
        &self,
        id: &str,
        r: pb::DenoiseRequest,
    ) -> Result<PoolStream<pb::DenoiseEvent>, Status> {
        match self {
            Reach::Remote(remote) => {
                let channel = channel("denoiser pool", remote).await?;
                let stream = DenoiserPoolClient::new(channel)
                    .denoise(with_id(r, id))
                    .await?;
                Ok(Box::pin(stream.into_inner()))
            }
            Reach::LocalDenoiser(service) => {
                Ok(service.denoise(with_id(r, id)).await?.into_inner())
            }
            Reach::LocalDecoder(_) => {
                Err(status::internal("routing", "a decoder asked to denoise"))
            }
        }
    }

    /// Opens the request's `Decode` stream.
    pub async fn decode(
        &self,
        id: &str,
        r: pb::DecodeRequest,
    ) -> Result<PoolStream<pb::DecodeEvent>, Status> {
        match self {
            Reach::Remote(remote) => {
                let channel = channel("decoder instance", remote).await?;
                let stream = DecoderPoolClient::new(channel)
                    .max_decoding_message_size(64 << 20)
                    .decode(with_id(r, id))
                    .await?;
                Ok(Box::pin(stream.into_inner()))
            }
            Reach::LocalDecoder(service) => Ok(service.decode(with_id(r, id)).await?.into_inner()),
            Reach::LocalDenoiser(_) => {
                Err(status::internal("routing", "a denoiser asked to decode"))
            }
        }
    }
}

/// Where a decoder instance takes latent chunks.
#[derive(Debug, Clone)]
pub struct LinkTarget {
    /// Transport.
    pub kind: pb::LinkKind,
    /// host:port (empty in process).
    pub address: String,
    /// The name its certificate carries.
    pub host: String,
}

/// A registered pool.
#[derive(Clone)]
pub struct Pool {
    /// Its id in the registry.
    pub id: String,
    /// Denoiser or decoder.
    pub role: pb::PoolRole,
    /// How to reach it.
    pub reach: Reach,
    /// Decoders: the latent link.
    pub link: LinkTarget,
    /// Heartbeats keep it; `None` for pools in this process.
    last_seen: Option<Instant>,
    /// The certificate it registered with (remote pools).
    certificate: Option<Certificate>,
    /// Requests routed to it and not finished.
    inflight: u32,
}

impl Pool {
    /// "denoiser pool" or "decoder instance", for messages.
    pub fn what(&self) -> &'static str {
        match self.role {
            pb::PoolRole::Denoiser => "denoiser pool",
            _ => "decoder instance",
        }
    }
}

/// Every pool the gateway knows.
pub struct Registry {
    pools: HashMap<String, Pool>,
    next_id: u64,
    heartbeat_timeout: Duration,
}

impl Registry {
    /// An empty registry that drops a remote pool after `heartbeat_timeout` of silence.
    pub fn new(heartbeat_timeout: Duration) -> Registry {
        Registry {
            pools: HashMap::new(),
            next_id: 1,
            heartbeat_timeout,
        }
    }

    fn insert(
        &mut self,
        role: pb::PoolRole,
        reach: Reach,
        link: LinkTarget,
        certificate: Option<Certificate>,
    ) -> String {
        let name = if role == pb::PoolRole::Denoiser {
            "denoiser"
        } else {
            "decoder"
        };
        let id = format!("{name}-{}", self.next_id);
        self.next_id += 1;
        let pool = Pool {
            id: id.clone(),
            role,
            reach,
            link,
            last_seen: certificate.is_some().then(Instant::now),
            certificate,
            inflight: 0,
        };
        self.pools.insert(id.clone(), pool);
        id
    }

    /// A pool in this process.
    pub fn add_local(&mut self, reach: Reach) {
        let role = match reach {
            Reach::LocalDecoder(_) => pb::PoolRole::Decoder,
            _ => pb::PoolRole::Denoiser,
        };
        let link = LinkTarget {
            kind: pb::LinkKind::InProcess,
            address: String::new(),
            host: String::new(),
        };
        let id = self.insert(role, reach, link, None);
        tracing::info!(pool_id = %id, "in-process pool ready");
    }

    /// A pool in another process announced itself over a connection that presented
    /// `certificate`; returns its id. PERMISSION_DENIED when an address it registers is not a
    /// name on that certificate.
    pub fn register(
        &mut self,
        role: pb::PoolRole,
        r: pb::RegisterRequest,
        tls: Arc<Identity>,
        certificate: Certificate,
    ) -> Result<String, Status> {
        let mut hosts = vec![("address", tls::host_of(&r.address))];
        if !r.link_host.is_empty() {
            hosts.push(("link_host", r.link_host.as_str()));
        }
        for (field, host) in hosts {
            if !tls::names(&certificate, host) {
                return Err(status::permission_denied(format!(
                    "{field} {host:?} is not a name on this pool's certificate: a pool registers \
                     only addresses its certificate covers (`ditstream certs --host {host}`)"
                )));
            }
        }
        let link = LinkTarget {
            kind: pb::LinkKind::try_from(r.link_kind).unwrap_or(pb::LinkKind::Unspecified),
            address: r.link_address,
            host: r.link_host,
        };
        let address = r.address;
        let reach = Reach::Remote(Remote {
            address: address.clone(),
            tls,
        });
        let id = self.insert(role, reach, link, Some(certificate));
        tracing::info!(pool_id = %id, %address, "pool registered");
        Ok(id)
    }

    /// The pool `id` if the caller, presenting `certificate`, is the one that registered it.
    fn owned(&mut self, id: &str, certificate: &Certificate) -> Result<Option<&mut Pool>, Status> {
        match self.pools.get_mut(id) {
            Some(p) if p.certificate.as_ref().is_some_and(|c| c == certificate) => Ok(Some(p)),
            Some(_) => Err(status::permission_denied(format!(
                "pool {id} was registered with another certificate"
            ))),
            None => Ok(None),
        }
    }

    /// A heartbeat from `certificate`; false when the pool is not known (it should register
    /// again).
    pub fn heartbeat(&mut self, id: &str, certificate: &Certificate) -> Result<bool, Status> {
        Ok(self
            .owned(id, certificate)?
            .map(|p| p.last_seen = Some(Instant::now()))
            .is_some())
    }

    /// A pool leaving, asked by `certificate`.
    pub fn deregister(&mut self, id: &str, certificate: &Certificate) -> Result<(), Status> {
        if self.owned(id, certificate)?.is_some() {
            self.forget(id, "deregistered");
        }
        Ok(())
    }

    /// Drops a pool (unreachable, lost, or leaving).
    pub fn forget(&mut self, id: &str, why: &str) {
        if let Some(p) = self.pools.get(id)
            && p.last_seen.is_some()
        {
            tracing::warn!(pool_id = %id, address = p.reach.address(), %why, "pool dropped");
            self.pools.remove(id);
        }
    }

    /// Drops remote pools whose heartbeats stopped; true if any went.
    pub fn reap(&mut self) -> bool {
        let timeout = self.heartbeat_timeout;
        let before = self.pools.len();
        self.pools.retain(|id, p| {
            let alive = p.last_seen.is_none_or(|t| t.elapsed() <= timeout);
            if !alive {
                tracing::warn!(pool_id = %id, address = p.reach.address(), "pool missed its heartbeats; dropped");
            }
            alive
        });
        self.pools.len() != before
    }

    /// Takes a free denoiser and the least-loaded decoder, if both exist.
    pub fn acquire(&mut self) -> Option<(Pool, Pool)> {
        let pick = |role: pb::PoolRole, free_only: bool| {
            self.pools
                .values()
                .filter(|p| p.role == role && (!free_only || p.inflight == 0))
                .min_by_key(|p| (p.inflight, p.id.clone()))
                .map(|p| p.id.clone())
        };
        let denoiser = pick(pb::PoolRole::Denoiser, true)?;
        let decoder = pick(pb::PoolRole::Decoder, false)?;
        let mut take = |id: &str| {
            let p = self.pools.get_mut(id)?;
            p.inflight += 1;
            Some(p.clone())
        };
        Some((take(&denoiser)?, take(&decoder)?))
    }

    /// Returns a pool acquired for a request.
    pub fn release(&mut self, id: &str) {
        if let Some(p) = self.pools.get_mut(id) {
            p.inflight = p.inflight.saturating_sub(1);
        }
    }

    /// Every pool and its load, for `/metrics`.
    pub fn samples(&self) -> Vec<crate::metrics::PoolSample> {
        self.pools
            .values()
            .map(|p| crate::metrics::PoolSample {
                id: p.id.clone(),
                role: if p.role == pb::PoolRole::Denoiser {
                    "denoiser"
                } else {
                    "decoder"
                },
                inflight: p.inflight,
            })
            .collect()
    }

    /// Whether a request could be routed now (a denoiser and a decoder are registered).
    pub fn can_serve(&self) -> bool {
        let has = |role| self.pools.values().any(|p| p.role == role);
        has(pb::PoolRole::Denoiser) && has(pb::PoolRole::Decoder)
    }

    /// What the gateway serves on, for ListModels: each pool in this process by its mesh and
    /// devices; pools elsewhere by count.
    pub fn describe(&self) -> String {
        let mut pools: Vec<&Pool> = self.pools.values().collect();
        pools.sort_by(|a, b| a.id.cmp(&b.id));
        let mut parts: Vec<String> = pools
            .iter()
            .filter_map(|p| match &p.reach {
                Reach::LocalDenoiser(s) => Some(format!("denoiser {}", s.description())),
                Reach::LocalDecoder(s) => Some(format!("decoder {}", s.description())),
                Reach::Remote(_) => None,
            })
            .collect();
        let remote = |role| {
            pools
                .iter()
                .filter(|p| p.role == role && matches!(p.reach, Reach::Remote(_)))
                .count()
        };
        let (denoisers, decoders) = (
            remote(pb::PoolRole::Denoiser),
            remote(pb::PoolRole::Decoder),
        );
        if denoisers + decoders > 0 || parts.is_empty() {
            parts.push(format!(
                "{denoisers} denoiser pool(s), {decoders} decoder instance(s) registered"
            ));
        }
        parts.join("; ")
    }
}
