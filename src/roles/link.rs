//! The pools' side of the latent link, over either transport: the decoder's listener that hands
//! every arriving chunk to its request, and the denoiser's connections that send a latent one
//! latent frame per chunk. The transport is the decoder's choice (`pools.link`); it registers
//! it with the gateway, which passes it to the denoiser with the address.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use anyhow::bail;
use ditstream_common::config::{Config, LinkKind};
use ditstream_common::link::{LatentChunk, LinkError, quic};
use ditstream_kernels::Tensor;
use tokio::sync::mpsc;

use crate::roles::addr;

/// Requests with an open Decode call, by id: where their chunks go.
pub type Pending = Arc<Mutex<HashMap<String, mpsc::Sender<LatentChunk>>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Each critical section is one map operation: a poisoned lock still holds a consistent map.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The wire name of a link kind, as registered with the gateway.
pub fn kind_name(kind: LinkKind) -> &'static str {
    match kind {
        LinkKind::Quic => "quic",
        LinkKind::Ucx => "ucx",
    }
}

/// Hands one chunk to its request; false when the request is gone (its stream should stop).
async fn deliver(pending: &Pending, chunk: LatentChunk) -> bool {
    let target = lock(pending).get(&chunk.header.request_id).cloned();
    match target {
        Some(tx) => tx.send(chunk).await.is_ok(),
        None => {
            tracing::warn!(id = %chunk.header.request_id, "chunk for a request with no Decode call; dropped");
            false
        }
    }
}

/// One request's stream of chunks, whatever the transport.
trait ChunkStream: Send {
    /// The next verified chunk; `None` after the last.
    fn next(
        &mut self,
    ) -> impl std::future::Future<Output = Result<Option<LatentChunk>, LinkError>> + Send;
}

impl ChunkStream for quic::ChunkReceiver {
    async fn next(&mut self) -> Result<Option<LatentChunk>, LinkError> {
        quic::ChunkReceiver::next(self).await
    }
}

#[cfg(feature = "ucx")]
impl ChunkStream for ditstream_common::link::ucx::ChunkReceiver {
    async fn next(&mut self) -> Result<Option<LatentChunk>, LinkError> {
        ditstream_common::link::ucx::ChunkReceiver::next(self).await
    }
}

/// Hands every chunk of one request stream to its request, until the stream or the request ends.
async fn pump(mut rx: impl ChunkStream, pending: Pending) {
    loop {
        match rx.next().await {
            Ok(Some(chunk)) => {
                if !deliver(&pending, chunk).await {
                    return;
                }
            }
            Ok(None) => return,
            Err(e) => return tracing::warn!(error = %e, "latent stream failed"),
        }
    }
}

/// A decoder's listening link: binds `pools.link_listen` and serves every connection in the
/// background. Returns the bound address and the accept task.
pub async fn listen(
    cfg: &Config,
    identity: &quic::Identity,
    pending: Pending,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let at = addr("pools.link_listen", &cfg.pools.link_listen)?;
    match cfg.pools.link {
        LinkKind::Quic => {
            let endpoint = quic::listen(at, identity)?;
            let bound = endpoint.local_addr()?;
            let task = tokio::spawn(async move {
                while let Some(incoming) = endpoint.accept().await {
                    let pending = Arc::clone(&pending);
                    tokio::spawn(async move {
                        let conn = match incoming.await {
                            Ok(c) => c,
                            Err(e) => {
                                return tracing::warn!(error = %e, "latent link handshake failed");
                            }
                        };
                        while let Ok(Some(rx)) = quic::ChunkReceiver::accept(&conn).await {
                            let pending = Arc::clone(&pending);
                            tokio::spawn(pump(rx, pending));
                        }
                    });
                }
            });
            Ok((bound, task))
        }
        LinkKind::Ucx => listen_ucx(at, pending),
    }
}

#[cfg(feature = "ucx")]
fn listen_ucx(
    at: SocketAddr,
    pending: Pending,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    use ditstream_common::link::ucx;
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
    /// QUIC.
    Quic(quic::Connection),
    /// UCX.
    #[cfg(feature = "ucx")]
    Ucx(ditstream_common::link::ucx::Connection),
}

impl Connection {
    /// Connects to the decoder at `address` with the transport it registered.
    pub async fn connect(
        kind: &str,
        address: SocketAddr,
        host: &str,
        identity: &quic::Identity,
    ) -> anyhow::Result<Connection> {
        match kind {
            "quic" | "" => Ok(Connection::Quic(
                quic::connect(address, host, identity).await?,
            )),
            #[cfg(feature = "ucx")]
            "ucx" => {
                use ditstream_common::link::ucx;
                Ok(Connection::Ucx(
                    ucx::connect(address, &ucx::UcxConfig::default()).await?,
                ))
            }
            other => bail!(
                "decoder link kind {other:?}: this binary speaks quic{}",
                if cfg!(feature = "ucx") {
                    " and ucx"
                } else {
                    ""
                }
            ),
        }
    }

    /// Whether the connection can still carry requests.
    pub fn is_open(&self) -> bool {
        match self {
            Connection::Quic(c) => c.close_reason().is_none(),
            // A UCX endpoint reports failure on the next send; the caller reconnects then.
            #[cfg(feature = "ucx")]
            Connection::Ucx(_) => true,
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
            Connection::Quic(conn) => {
                let mut sender = quic::ChunkSender::open(conn).await?;
                for t in 0..frames {
                    sender.send(&chunk(t)?).await?;
                }
                sender.finish()?;
            }
            #[cfg(feature = "ucx")]
            Connection::Ucx(conn) => {
                let mut sender = ditstream_common::link::ucx::ChunkSender::open(conn);
                for t in 0..frames {
                    sender.send(chunk(t)?).await?;
                }
                sender.finish().await?;
            }
        }
        Ok(frames as u32)
    }
}
