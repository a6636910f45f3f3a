//! The pools' side of the latent link, over any transport. Two traits carry one chunk type
//! ([`Arrived`]: a [`ChunkHeader`] and its latent frames): a denoiser sends each latent through a
//! [`LatentLink`], one latent frame per chunk, and a decoder reads each request's chunks from a
//! [`ChunkStream`] and hands them to that request ([`Pending`]). The backends: in process
//! ([`InProcess`], `ditstream serve`, where both pools share one process and the tensor itself is
//! handed over), QUIC, UCX (feature `ucx`) and NCCL (feature `cuda`). The transport is the
//! decoder's choice (`pools.link`); it registers it with the gateway, which passes it to the
//! denoiser with the address ([`connect`]).

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use crate::config::{Config, LinkKind};
use crate::link::{ChunkHeader, LatentChunk, LinkDType, LinkError, quic};
use ditstream_kernels::Tensor;
use ditstream_proto::v1 as pb;
use tokio::sync::mpsc;

/// A verified chunk as the decoder consumes it: its header and its latent frames, on the host
/// (QUIC, UCX) or already on the decoder's GPU (NCCL).
#[derive(Debug)]
pub struct Arrived {
    /// What the chunk is (request, index, frames, shape).
    pub header: ChunkHeader,
    /// Its latent frames [1, C, n, H, W].
    pub latent: Tensor,
}

/// What a request's Decode call receives: the next chunk, or why its stream failed (a corrupted
/// chunk, a lost connection), so the request ends with that reason instead of waiting.
pub type Delivery = Result<Arrived, LinkError>;

/// Requests with an open Decode call, by id: where their chunks go.
pub type Pending = Arc<Mutex<HashMap<String, mpsc::Sender<Delivery>>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Each critical section is one map operation: a poisoned lock still holds a consistent map.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// This member's TLS identity for every internal hop (registry, pool services, latent link),
/// from the config's PEM files (relative paths start at the config file's folder).
pub fn identity(cfg: &Config) -> Result<crate::tls::Identity, LinkError> {
    let p = &cfg.pools;
    crate::tls::Identity::from_pem_files(
        &cfg.path(&p.tls_cert),
        &cfg.path(&p.tls_key),
        &cfg.path(&p.tls_ca),
    )
    .map_err(|e| {
        LinkError::Identity(format!(
            "pools.tls_*: {e} (run `ditstream certs --out certs` to make a development set)"
        ))
    })
}

/// A configured link kind as the pools announce it on the wire.
pub fn wire_kind(kind: LinkKind) -> pb::LinkKind {
    match kind {
        LinkKind::Quic => pb::LinkKind::Quic,
        LinkKind::Ucx => pb::LinkKind::Ucx,
        LinkKind::Nccl => pb::LinkKind::Nccl,
    }
}

/// Hands one delivery to request `id`; false when the request is gone (its stream should stop).
async fn deliver(pending: &Pending, id: &str, item: Delivery) -> bool {
    let target = lock(pending).get(id).cloned();
    match target {
        Some(tx) => tx.send(item).await.is_ok(),
        None => {
            tracing::warn!(%id, "chunk for a request with no Decode call; dropped");
            false
        }
    }
}

/// A host chunk's payload as a latent tensor.
fn host_arrived(chunk: LatentChunk) -> Result<Arrived, LinkError> {
    let shape: Vec<usize> = chunk.header.shape.iter().map(|&d| d as usize).collect();
    let latent = match chunk.header.dtype {
        LinkDType::F32 => Tensor::from_vec(chunk.to_f32()?, &shape),
        LinkDType::Bf16 => Tensor::from_bf16_vec(
            bytemuck::pod_collect_to_vec::<u8, half::bf16>(&chunk.payload),
            &shape,
        ),
    }
    .map_err(|e| LinkError::Malformed(format!("chunk {}: {e}", chunk.header.chunk_index)))?;
    Ok(Arrived {
        header: chunk.header,
        latent,
    })
}

/// The receiving end of a latent link: one request's chunks, in order, verified, whatever the
/// transport (each backend's receiver implements it; the pool end drains it into [`Pending`]).
pub trait ChunkStream: Send {
    /// The next verified chunk; `None` after the last.
    fn next(&mut self) -> impl Future<Output = Result<Option<Arrived>, LinkError>> + Send;
}

/// What [`LatentLink::send_latent`] returns: the trait is used as `dyn LatentLink` (the
/// transport is chosen at run time), so its future is boxed.
pub type SendFuture<'a> = Pin<Box<dyn Future<Output = Result<u32, LinkError>> + Send + 'a>>;

/// The sending end of a latent link: one denoiser's live connection to one decoder instance.
pub trait LatentLink: Send + Sync {
    /// Sends `latent` [1, C, T, H, W] one latent frame per chunk (chunk t = latent frame t, the
    /// last one flagged) on a new request stream, so the decoder starts on the first frame
    /// while the rest are in flight. Returns the chunk count.
    fn send_latent<'a>(&'a self, id: &'a str, latent: &'a Tensor) -> SendFuture<'a>;

    /// Whether the connection can still carry requests (a closed one is replaced).
    fn is_open(&self) -> bool;
}

/// A live link, shared by the requests that use it.
pub type Link = Arc<dyn LatentLink>;

/// The header of latent frame `t` of a `frames`-frame latent, sent as chunk `t`.
pub(crate) fn frame_header(
    id: &str,
    t: usize,
    frames: usize,
    part: &Tensor,
    dtype: LinkDType,
    checksum: u32,
) -> ChunkHeader {
    ChunkHeader {
        request_id: id.to_string(),
        chunk_index: t as u32,
        first_frame: t as u32,
        last: t + 1 == frames,
        shape: part.shape().iter().map(|&d| d as u64).collect(),
        dtype,
        checksum,
    }
}

fn frames_of(latent: &Tensor) -> Result<usize, LinkError> {
    match latent.shape() {
        [1, _, t, _, _] => Ok(*t),
        other => Err(LinkError::Malformed(format!(
            "a latent to send is [1, C, T, H, W], not {other:?}"
        ))),
    }
}

fn frame(latent: &Tensor, t: usize) -> Result<Tensor, LinkError> {
    latent
        .narrow(2, t, 1)
        .map_err(|e| LinkError::Malformed(format!("latent frame {t}: {e}")))
}

/// Latent frame `t` as host bytes (the QUIC and UCX links carry f32 host chunks).
fn host_chunk(
    id: &str,
    latent: &Tensor,
    t: usize,
    frames: usize,
) -> Result<LatentChunk, LinkError> {
    let part = frame(latent, t)?;
    let values = part
        .to_vec_f32()
        .map_err(|e| LinkError::Malformed(format!("latent frame {t} to the host: {e}")))?;
    let payload = values
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect::<Vec<u8>>();
    let header = frame_header(
        id,
        t,
        frames,
        &part,
        LinkDType::F32,
        crc32fast::hash(&payload),
    );
    Ok(LatentChunk { header, payload })
}

/// The decoder in this process (`ditstream serve`): each frame goes straight to its request's
/// channel; no bytes travel, so there is nothing to checksum.
pub struct InProcess(pub Pending);

impl LatentLink for InProcess {
    fn send_latent<'a>(&'a self, id: &'a str, latent: &'a Tensor) -> SendFuture<'a> {
        Box::pin(async move {
            let frames = frames_of(latent)?;
            for t in 0..frames {
                let latent = frame(latent, t)?;
                let header = frame_header(id, t, frames, &latent, LinkDType::F32, 0);
                if !deliver(&self.0, id, Ok(Arrived { header, latent })).await {
                    return Err(LinkError::Transport(format!(
                        "request {id} is no longer decoding"
                    )));
                }
            }
            Ok(frames as u32)
        })
    }

    fn is_open(&self) -> bool {
        true
    }
}

impl LatentLink for quic::Connection {
    fn send_latent<'a>(&'a self, id: &'a str, latent: &'a Tensor) -> SendFuture<'a> {
        Box::pin(async move {
            let frames = frames_of(latent)?;
            let mut sender = quic::ChunkSender::open(self).await?;
            for t in 0..frames {
                sender.send(&host_chunk(id, latent, t, frames)?).await?;
            }
            sender.finish()?;
            Ok(frames as u32)
        })
    }

    fn is_open(&self) -> bool {
        self.close_reason().is_none()
    }
}

#[cfg(feature = "ucx")]
impl LatentLink for crate::link::ucx::Connection {
    fn send_latent<'a>(&'a self, id: &'a str, latent: &'a Tensor) -> SendFuture<'a> {
        Box::pin(async move {
            let frames = frames_of(latent)?;
            let mut sender = crate::link::ucx::ChunkSender::open(self);
            for t in 0..frames {
                sender.send(host_chunk(id, latent, t, frames)?).await?;
            }
            sender.finish().await?;
            Ok(frames as u32)
        })
    }

    fn is_open(&self) -> bool {
        // A UCX endpoint reports failure on the next send; the caller reconnects then.
        true
    }
}

#[cfg(feature = "cuda")]
impl LatentLink for super::nccl::NcclConnection {
    fn send_latent<'a>(&'a self, id: &'a str, latent: &'a Tensor) -> SendFuture<'a> {
        Box::pin(super::nccl::NcclConnection::send_latent(self, id, latent))
    }

    fn is_open(&self) -> bool {
        super::nccl::NcclConnection::is_open(self)
    }
}

impl ChunkStream for quic::ChunkReceiver {
    async fn next(&mut self) -> Result<Option<Arrived>, LinkError> {
        quic::ChunkReceiver::next(self)
            .await?
            .map(host_arrived)
            .transpose()
    }
}

#[cfg(feature = "ucx")]
impl ChunkStream for crate::link::ucx::ChunkReceiver {
    async fn next(&mut self) -> Result<Option<Arrived>, LinkError> {
        crate::link::ucx::ChunkReceiver::next(self)
            .await?
            .map(host_arrived)
            .transpose()
    }
}

/// Hands every chunk of one request stream to its request, until the stream or the request ends.
/// A failed stream fails its request: the one named by a checksum error, or the one whose chunks
/// the stream was carrying.
pub(crate) async fn pump(mut rx: impl ChunkStream, pending: Pending) {
    let mut request: Option<String> = None;
    loop {
        match rx.next().await {
            Ok(Some(arrived)) => {
                let id = arrived.header.request_id.clone();
                if !deliver(&pending, &id, Ok(arrived)).await {
                    return;
                }
                request = Some(id);
            }
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(error = %e, "latent stream failed");
                let id = match &e {
                    LinkError::Checksum { request_id, .. } => Some(request_id.clone()),
                    _ => request,
                };
                if let Some(id) = id {
                    deliver(&pending, &id, Err(e)).await;
                }
                return;
            }
        }
    }
}

/// A decoder's listening link: binds `pools.link_listen` and serves every connection in the
/// background; an NCCL link receives onto GPU `gpu`. Returns the bound address and the accept
/// task.
pub async fn listen(
    cfg: &Config,
    identity: &crate::tls::Identity,
    pending: Pending,
    gpu: usize,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), LinkError> {
    let at = crate::config::socket_addr("pools.link_listen", &cfg.pools.link_listen)?;
    let nccl = match cfg.pools.link {
        LinkKind::Ucx => return listen_ucx(at, pending),
        LinkKind::Quic => false,
        LinkKind::Nccl if cfg!(feature = "cuda") => true,
        LinkKind::Nccl => {
            return Err(LinkError::Unsupported(
                "pools.link = nccl: this binary was built without CUDA (build with \
                 `--features cuda`)"
                    .into(),
            ));
        }
    };
    // QUIC carries the chunks, or (NCCL) their headers beside the GPU-to-GPU transfers.
    let endpoint = quic::listen(at, identity)?;
    let bound = endpoint.local_addr()?;
    let task = tokio::spawn(async move {
        while let Some(incoming) = endpoint.accept().await {
            let pending = Arc::clone(&pending);
            tokio::spawn(async move {
                let conn = match incoming.await {
                    Ok(c) => c,
                    Err(e) => return tracing::warn!(error = %e, "latent link handshake failed"),
                };
                if nccl {
                    return serve_nccl(conn, gpu, pending).await;
                }
                while let Ok(Some(rx)) = quic::ChunkReceiver::accept(&conn).await {
                    tokio::spawn(pump(rx, Arc::clone(&pending)));
                }
            });
        }
    });
    Ok((bound, task))
}

#[cfg(feature = "cuda")]
async fn serve_nccl(conn: quinn::Connection, gpu: usize, pending: Pending) {
    super::nccl::serve(conn, gpu, pending).await;
}

#[cfg(not(feature = "cuda"))]
async fn serve_nccl(conn: quinn::Connection, _: usize, _: Pending) {
    // `listen` refuses pools.link = nccl in this build, so no connection gets here.
    conn.close(0u32.into(), b"built without CUDA");
}

#[cfg(feature = "ucx")]
fn listen_ucx(
    at: SocketAddr,
    pending: Pending,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), LinkError> {
    use crate::link::ucx;
    let listener = ucx::listen(at, &ucx::UcxConfig::default())?;
    let bound = listener.local_addr();
    let task = tokio::spawn(async move {
        while let Ok(conn) = listener.accept().await {
            let pending = Arc::clone(&pending);
            tokio::spawn(async move {
                while let Ok(Some(rx)) = ucx::ChunkReceiver::accept(&conn).await {
                    let pending = Arc::clone(&pending);
                    tokio::spawn(pump(rx, pending));
                }
            });
        }
    });
    Ok((bound, task))
}

#[cfg(not(feature = "ucx"))]
fn listen_ucx(
    _: SocketAddr,
    _: Pending,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), LinkError> {
    Err(LinkError::Unsupported(
        "pools.link = ucx: this binary was built without UCX (build with `--features ucx`)".into(),
    ))
}

/// Connects to the decoder at `address` over the transport it registered (the in-process
/// link is not reached by address: the denoiser builds [`InProcess`] itself); an NCCL link sends
/// from GPU `gpu` (where the denoiser's latents are).
pub async fn connect(
    kind: pb::LinkKind,
    address: SocketAddr,
    host: &str,
    identity: &crate::tls::Identity,
    gpu: usize,
) -> Result<Link, LinkError> {
    let _ = gpu; // only an NCCL link uses it
    match kind {
        pb::LinkKind::Quic => Ok(Arc::new(quic::connect(address, host, identity).await?)),
        #[cfg(feature = "ucx")]
        pb::LinkKind::Ucx => {
            use crate::link::ucx;
            Ok(Arc::new(
                ucx::connect(address, &ucx::UcxConfig::default()).await?,
            ))
        }
        #[cfg(feature = "cuda")]
        pb::LinkKind::Nccl => Ok(Arc::new(
            super::nccl::NcclConnection::connect(address, host, identity, gpu).await?,
        )),
        other => Err(LinkError::Unsupported(format!(
            "decoder link kind {}: this binary speaks quic{}{} across processes",
            other.as_str_name(),
            if cfg!(feature = "ucx") { ", ucx" } else { "" },
            if cfg!(feature = "cuda") { ", nccl" } else { "" },
        ))),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::Duration;

    use crate::link::write_chunk;
    use crate::tls::PoolCa;

    use super::*;

    /// A chunk whose payload was damaged on the way ends its request with the checksum error (the
    /// Decode call reports it at once), over a real QUIC connection on loopback.
    #[tokio::test]
    async fn a_corrupted_chunk_fails_its_request_with_the_checksum_error() {
        let ca = PoolCa::generate("pools").unwrap();
        let identity = ca.issue("localhost").unwrap();
        let cfg = Config::parse("model: {preset: tiny}\n", "test").unwrap();
        let pending: Pending = Arc::default();
        let (tx, mut rx) = mpsc::channel(4);
        lock(&pending).insert("req-1".to_string(), tx);
        let (at, _task) = listen(&cfg, &identity, Arc::clone(&pending), 0)
            .await
            .unwrap();

        let conn = quic::connect(at, "localhost", &identity).await.unwrap();
        let values = vec![0.25f32; 16 * 2 * 3];
        let mut chunk =
            LatentChunk::from_f32("req-1", 0, 0, true, &[1, 16, 1, 2, 3], &values).unwrap();
        chunk.payload[5] ^= 0x10;
        let mut stream = conn.open_uni().await.unwrap();
        write_chunk(&mut stream, &chunk).await.unwrap();
        stream.finish().unwrap();

        let got = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("the request hears about its chunk")
            .expect("the sender stays registered");
        let e = got.unwrap_err().to_string();
        assert!(
            e.starts_with("latent link: chunk 0 of request req-1: checksum"),
            "{e}"
        );
    }
}
