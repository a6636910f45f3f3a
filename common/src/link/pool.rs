//! The pools' side of the latent link, over any transport: the decoder's listener that hands
//! every arriving chunk to its request, and the denoiser's connections that send a latent one
//! latent frame per chunk. The transport is the decoder's choice (`pools.link`); it registers
//! it with the gateway, which passes it to the denoiser with the address. In `ditstream serve`
//! both pools live in one process and the chunks are handed over in memory
//! ([`Connection::InProcess`]): the same requests, the same per-request chunk channels.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use crate::config::{Config, LinkKind};
use crate::link::{ChunkHeader, LatentChunk, LinkDType, LinkError, quic};
use anyhow::bail;
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
pub fn identity(cfg: &Config) -> anyhow::Result<crate::tls::Identity> {
    use anyhow::Context;
    let p = &cfg.pools;
    crate::tls::Identity::from_pem_files(
        &cfg.path(&p.tls_cert),
        &cfg.path(&p.tls_key),
        &cfg.path(&p.tls_ca),
    )
    .context("pools.tls_*: run `ditstream certs --out certs` to make a development set")
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

/// One request's stream of chunks, whatever the transport.
pub(crate) trait ChunkStream: Send {
    /// The next verified chunk; `None` after the last.
    fn next(
        &mut self,
    ) -> impl std::future::Future<Output = Result<Option<Arrived>, LinkError>> + Send;
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
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let at = crate::config::socket_addr("pools.link_listen", &cfg.pools.link_listen)?;
    let nccl = match cfg.pools.link {
        LinkKind::Ucx => return listen_ucx(at, pending),
        LinkKind::Quic => false,
        LinkKind::Nccl if cfg!(feature = "cuda") => true,
        LinkKind::Nccl => bail!(
            "pools.link = nccl: this binary was built without CUDA (build with `--features cuda`)"
        ),
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
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
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
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    bail!("pools.link = ucx: this binary was built without UCX (build with `--features ucx`)")
}

/// One live connection from a denoiser to a decoder.
#[derive(Clone)]
pub enum Connection {
    /// The decoder in this process: chunks go straight to its requests' channels.
    InProcess(Pending),
    /// QUIC.
    Quic(quic::Connection),
    /// UCX.
    #[cfg(feature = "ucx")]
    Ucx(crate::link::ucx::Connection),
    /// NCCL, with QUIC beside it for headers.
    #[cfg(feature = "cuda")]
    Nccl(super::nccl::NcclConnection),
}

impl Connection {
    /// Connects to the decoder at `address` with the transport it registered; an NCCL link
    /// sends from GPU `gpu` (where the denoiser's latents are).
    pub async fn connect(
        kind: pb::LinkKind,
        address: SocketAddr,
        host: &str,
        identity: &crate::tls::Identity,
        gpu: usize,
    ) -> anyhow::Result<Connection> {
        let _ = gpu; // only an NCCL link uses it
        match kind {
            pb::LinkKind::Quic => Ok(Connection::Quic(
                quic::connect(address, host, identity).await?,
            )),
            #[cfg(feature = "ucx")]
            pb::LinkKind::Ucx => {
                use crate::link::ucx;
                Ok(Connection::Ucx(
                    ucx::connect(address, &ucx::UcxConfig::default()).await?,
                ))
            }
            #[cfg(feature = "cuda")]
            pb::LinkKind::Nccl => Ok(Connection::Nccl(
                super::nccl::NcclConnection::connect(address, host, identity, gpu).await?,
            )),
            other => bail!(
                "decoder link kind {}: this binary speaks quic{}{} across processes",
                other.as_str_name(),
                if cfg!(feature = "ucx") { ", ucx" } else { "" },
                if cfg!(feature = "cuda") { ", nccl" } else { "" },
            ),
        }
    }

    /// Whether the connection can still carry requests.
    pub fn is_open(&self) -> bool {
        match self {
            Connection::InProcess(_) => true,
            Connection::Quic(c) => c.close_reason().is_none(),
            // A UCX endpoint reports failure on the next send; the caller reconnects then.
            #[cfg(feature = "ucx")]
            Connection::Ucx(_) => true,
            #[cfg(feature = "cuda")]
            Connection::Nccl(c) => c.is_open(),
        }
    }

    /// Sends `latent` [1, C, T, H, W] one latent frame per chunk on a new request stream, so the
    /// decoder starts on the first frame while the rest are in flight. Returns the chunk count.
    pub async fn send_latent(&self, id: &str, latent: &Tensor) -> anyhow::Result<u32> {
        let frames = latent.shape()[2];
        let chunk = |t: usize| -> anyhow::Result<LatentChunk> {
            let part = latent.narrow(2, t, 1)?;
            let shape: Vec<u64> = part.shape().iter().map(|&d| d as u64).collect();
            Ok(LatentChunk::from_f32(
                id,
                t as u32,
                t as u32,
                t + 1 == frames,
                &shape,
                &part.to_vec_f32()?,
            )?)
        };
        match self {
            Connection::InProcess(pending) => {
                for t in 0..frames {
                    let part = latent.narrow(2, t, 1)?;
                    let header = ChunkHeader {
                        request_id: id.to_string(),
                        chunk_index: t as u32,
                        first_frame: t as u32,
                        last: t + 1 == frames,
                        shape: part.shape().iter().map(|&d| d as u64).collect(),
                        dtype: LinkDType::F32,
                        // No bytes travel: the tensor itself is handed over, nothing to check.
                        checksum: 0,
                    };
                    if !deliver(
                        pending,
                        id,
                        Ok(Arrived {
                            header,
                            latent: part,
                        }),
                    )
                    .await
                    {
                        bail!("request {id} is no longer decoding");
                    }
                }
            }
            Connection::Quic(conn) => {
                let mut sender = quic::ChunkSender::open(conn).await?;
                for t in 0..frames {
                    sender.send(&chunk(t)?).await?;
                }
                sender.finish()?;
            }
            #[cfg(feature = "ucx")]
            Connection::Ucx(conn) => {
                let mut sender = crate::link::ucx::ChunkSender::open(conn);
                for t in 0..frames {
                    sender.send(chunk(t)?).await?;
                }
                sender.finish().await?;
            }
            #[cfg(feature = "cuda")]
            Connection::Nccl(conn) => {
                conn.send_latent(id, latent).await?;
            }
        }
        Ok(frames as u32)
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
