//! The NCCL latent link (feature `cuda`): each latent frame goes from the denoiser's GPU to the
//! decoder's GPU with `ncclSend`/`ncclRecv` (NVLink or PCIe P2P on one node, NCCL's network
//! transports across nodes), never through host memory on the way. NCCL moves bytes but has no
//! messages and no connection set-up of its own, so QUIC (the same mutual-TLS endpoint as the QUIC
//! link) runs beside it and carries the bootstrap and every chunk's header.
//!
//! **Bootstrap.** The denoiser connects over QUIC, opens a bidirectional stream and writes
//! `b"NCCL"` and a fresh `ncclUniqueId`; both ends then join a two-rank communicator (denoiser
//! rank 0, decoder rank 1), each on its own GPU, and the decoder answers `OK` (or `ER` and why, so
//! a decoder that cannot join fails the denoiser's connect at once instead of at NCCL's timeout).
//! One communicator per connection, owned by a `Peer` thread on each side: NCCL calls block, so
//! they never run on the async runtime.
//!
//! **Chunks.** Per request the denoiser opens a QUIC stream, as the QUIC link does. For each chunk
//! it writes the framed header there ([`write_frame_head`], whose payload length is the bytes that
//! follow over NCCL) and then sends the frames straight from the tensor's storage. The decoder
//! reads the header, receives into a fresh tensor on its GPU and hands that tensor on. NCCL pairs
//! sends with receives by order alone, so a connection has one chunk in flight at a time: the
//! sender holds the connection's lock from writing a header until its send has completed (which
//! means the decoder has received it), and the decoder posts receives from its one `Peer`
//! thread. So the n-th header read is always the n-th transfer.
//!
//! **Integrity.** The header's CRC-32 is computed over a host copy of the frames sent and checked
//! against a host copy of the frames received: the same end-to-end check as the other links (a
//! wrong request, shape or payload is caught), for two copies of ~0.4 MB per 480p latent frame;
//! the latency bench includes them.
//!
//! **Faults.** A peer that stops mid-transfer makes the NCCL call time out (the collectives' 60 s),
//! abort the communicator and fail the chunk; the connection is closed and the next request
//! reconnects. A decoder whose request queue is full reads its next header late, so the sender's
//! transfer waits (bounded by the same timeout): backpressure, never unbounded memory.

use std::borrow::{Borrow, BorrowMut};
use std::net::SocketAddr;
use std::sync::Arc;

use crate::collectives::CommWorld;
use crate::collectives::nccl::{NcclComm, NcclId, NcclWorld};
use crate::collectives::wire::TensorWire;
use crate::link::quic;
use crate::link::{ChunkHeader, LinkDType, LinkError, read_frame_head, write_frame_head};
use crate::tls::Identity;
use ditstream_kernels::{DType, Device, Tensor};
use tokio::sync::{Mutex, oneshot};

use super::pool::{Arrived, ChunkStream, Pending, frame_header, pump};

const HELLO: &[u8; 4] = b"NCCL";
const DENOISER_RANK: usize = 0;
const DECODER_RANK: usize = 1;

fn transport(what: &str, e: impl std::fmt::Display) -> LinkError {
    LinkError::Transport(format!("NCCL link: {what}: {e}"))
}

/// One end of a link's two-rank communicator: a thread that owns it and runs transfers.
struct Peer {
    jobs: std::sync::mpsc::Sender<Job>,
    device: usize,
}

enum Job {
    Send(Tensor, oneshot::Sender<Result<(), LinkError>>),
    Recv(
        Vec<usize>,
        DType,
        oneshot::Sender<Result<Tensor, LinkError>>,
    ),
}

impl Peer {
    /// Joins the communicator of `id` as `rank` on GPU `device`; returns once both ends have
    /// joined (NCCL's start-up blocks until then, bounded by the collectives' timeout).
    async fn join(device: usize, rank: usize, id: NcclId) -> Result<Peer, LinkError> {
        let (ready_tx, ready_rx) = oneshot::channel();
        let (jobs, inbox) = std::sync::mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name(format!("nccl-link-cuda{device}"))
            .spawn(move || {
                let joined = NcclWorld::init(device, rank, 2, &id, NcclWorld::default_timeout())
                    .and_then(|world| Ok((world.split(&[vec![0, 1]])?, world)));
                let (comm, _world) = match joined {
                    Ok((Some(comm), world)) => (comm, world),
                    Ok((None, _)) => {
                        let _ = ready_tx.send(Err(transport("join", "rank outside the link")));
                        return;
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(transport("join", e)));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                let peer = 1 - rank;
                // Until the connection (every sender of jobs) is gone.
                for job in inbox {
                    match job {
                        Job::Send(t, reply) => {
                            let _ = reply.send(send(&comm, &t, peer));
                        }
                        Job::Recv(shape, dtype, reply) => {
                            let _ = reply.send(recv(&comm, &shape, dtype, device, peer));
                        }
                    }
                }
            })
            .map_err(|e| transport("spawning the link thread", e))?;
        ready_rx
            .await
            .map_err(|_| transport("join", "the link thread ended"))??;
        Ok(Peer { jobs, device })
    }

    async fn send(&self, frames: Tensor) -> Result<(), LinkError> {
        let (tx, rx) = oneshot::channel();
        self.jobs
            .send(Job::Send(frames, tx))
            .map_err(|_| transport("send", "the link thread ended"))?;
        rx.await
            .map_err(|_| transport("send", "the link thread ended"))?
    }

    async fn recv(&self, shape: Vec<usize>, dtype: DType) -> Result<Tensor, LinkError> {
        let (tx, rx) = oneshot::channel();
        self.jobs
            .send(Job::Recv(shape, dtype, tx))
            .map_err(|_| transport("receive", "the link thread ended"))?;
        rx.await
            .map_err(|_| transport("receive", "the link thread ended"))?
    }
}

/// Sends `t`'s storage to `peer` (a host tensor is uploaded first).
fn send(comm: &NcclComm, t: &Tensor, peer: usize) -> Result<(), LinkError> {
    match t.dtype() {
        DType::F32 => {
            let buf = comm.stage::<f32>(t).map_err(|e| transport("staging", e))?;
            comm.send(buf.borrow(), peer)
        }
        DType::BF16 => {
            let buf = comm
                .stage::<half::bf16>(t)
                .map_err(|e| transport("staging", e))?;
            comm.send(buf.borrow(), peer)
        }
    }
    .map_err(|e| transport("send", e))
}

/// Receives a `shape` tensor of `dtype` from `peer` into fresh storage on GPU `device`.
fn recv(
    comm: &NcclComm,
    shape: &[usize],
    dtype: DType,
    device: usize,
    peer: usize,
) -> Result<Tensor, LinkError> {
    let numel = shape.iter().product();
    let on = Device::Cuda(device);
    match dtype {
        DType::F32 => {
            let mut buf = comm
                .receive::<f32>(numel, on)
                .map_err(|e| transport("receive buffer", e))?;
            comm.recv(buf.borrow_mut(), peer)
                .map_err(|e| transport("receive", e))?;
            comm.tensor(&buf, shape, on)
                .map_err(|e| transport("receive", e))
        }
        DType::BF16 => {
            let mut buf = comm
                .receive::<half::bf16>(numel, on)
                .map_err(|e| transport("receive buffer", e))?;
            comm.recv(buf.borrow_mut(), peer)
                .map_err(|e| transport("receive", e))?;
            comm.tensor(&buf, shape, on)
                .map_err(|e| transport("receive", e))
        }
    }
}

/// The link dtype of a tensor and the CRC-32 of its little-endian bytes (host copy).
fn checksum(t: &Tensor) -> Result<(LinkDType, u32), LinkError> {
    let bad = |e| transport("checksum copy", e);
    Ok(match t.dtype() {
        DType::F32 => {
            let v = t.to_vec_f32().map_err(bad)?;
            (LinkDType::F32, crc32fast::hash(bytemuck::cast_slice(&v)))
        }
        DType::BF16 => {
            let v = t.to_vec_bf16().map_err(bad)?;
            (LinkDType::Bf16, crc32fast::hash(bytemuck::cast_slice(&v)))
        }
    })
}

/// A denoiser's NCCL link to one decoder instance.
#[derive(Clone)]
pub struct NcclConnection {
    quic: quinn::Connection,
    /// Held from a chunk's header to the end of its transfer (module docs: one chunk in flight).
    peer: Arc<Mutex<Peer>>,
}

impl NcclConnection {
    /// Connects to the decoder's link endpoint at `address` and joins the link's communicator on
    /// GPU `device` (where the denoiser's latents live).
    pub async fn connect(
        address: SocketAddr,
        host: &str,
        identity: &Identity,
        device: usize,
    ) -> Result<NcclConnection, LinkError> {
        let conn = quic::connect(address, host, identity).await?;
        let (mut tx, mut rx) = conn
            .open_bi()
            .await
            .map_err(|e| transport("bootstrap stream", e))?;
        let id = NcclId::new().map_err(|e| transport("ncclGetUniqueId", e))?;
        let hello = [HELLO.as_slice(), id.as_bytes()].concat();
        tx.write_all(&hello)
            .await
            .map_err(|e| transport("bootstrap hello", e))?;
        tx.finish().map_err(|e| transport("bootstrap stream", e))?;
        // The answer is short: "OK", or "ER" and a one-line reason.
        let answer = async {
            rx.read_to_end(4096)
                .await
                .map_err(|e| transport("bootstrap answer", e))
        };
        let (joined, reply) = tokio::join!(Peer::join(device, DENOISER_RANK, id), answer);
        let reply = reply?;
        if reply.as_slice() != b"OK" {
            let why = String::from_utf8_lossy(reply.get(2..).unwrap_or_default());
            return Err(transport(&format!("decoder at {address}"), why));
        }
        Ok(NcclConnection {
            quic: conn,
            peer: Arc::new(Mutex::new(joined?)),
        })
    }

    /// Whether the connection can still carry requests.
    pub fn is_open(&self) -> bool {
        self.quic.close_reason().is_none()
    }

    /// Sends `latent` [1, C, T, H, W] one latent frame per chunk on a new request stream. Returns
    /// the chunk count.
    pub async fn send_latent(&self, id: &str, latent: &Tensor) -> Result<u32, LinkError> {
        let frames = latent.shape().get(2).copied().unwrap_or(0);
        let mut stream = self.open_request_stream().await?;
        for t in 0..frames {
            let part = latent
                .narrow(2, t, 1)
                .map_err(|e| transport("latent frame", e))?;
            let (dtype, crc) = checksum(&part)?;
            let header = frame_header(id, t, frames, &part, dtype, crc);
            self.send_chunk(&mut stream, &header, part).await?;
        }
        stream
            .finish()
            .map_err(|e| transport("request stream", e))?;
        Ok(frames as u32)
    }

    /// A new request stream (the headers of one request's chunks).
    pub async fn open_request_stream(&self) -> Result<quinn::SendStream, LinkError> {
        self.quic
            .open_uni()
            .await
            .map_err(|e| transport("request stream", e))
    }

    /// Sends one chunk: `header` on the request's stream, then `frames` over NCCL. The header is
    /// taken as given (a test sends a wrong checksum through here).
    pub async fn send_chunk(
        &self,
        stream: &mut quinn::SendStream,
        header: &ChunkHeader,
        frames: Tensor,
    ) -> Result<(), LinkError> {
        let peer = self.peer.lock().await;
        if frames.device() != Device::Cuda(peer.device) && frames.device() != Device::Cpu {
            return Err(transport(
                "latent placement",
                format!(
                    "the latent is on {:?}; this link sends from cuda:{}",
                    frames.device(),
                    peer.device
                ),
            ));
        }
        write_frame_head(stream, header, header.payload_bytes()).await?;
        peer.send(frames).await
    }
}

/// Serves one decoder-side connection: the bootstrap, then every request stream.
pub async fn serve(conn: quinn::Connection, device: usize, pending: Pending) {
    let peer = match bootstrap(&conn, device).await {
        Ok(p) => Arc::new(p),
        Err(e) => return tracing::warn!(error = %e, "NCCL link bootstrap failed"),
    };
    loop {
        let stream = match conn.accept_uni().await {
            Ok(s) => s,
            Err(
                quinn::ConnectionError::ApplicationClosed(_)
                | quinn::ConnectionError::LocallyClosed,
            ) => return,
            Err(e) => return tracing::warn!(error = %e, "NCCL link connection lost"),
        };
        let rx = NcclReceiver {
            stream,
            peer: Arc::clone(&peer),
        };
        tokio::spawn(pump(rx, Arc::clone(&pending)));
    }
}

/// Reads the denoiser's hello and joins the communicator, answering `OK` or `ER` and why.
async fn bootstrap(conn: &quinn::Connection, device: usize) -> Result<Peer, LinkError> {
    let (mut tx, mut rx) = conn
        .accept_bi()
        .await
        .map_err(|e| transport("bootstrap stream", e))?;
    let mut hello = [0u8; 4 + 128];
    rx.read_exact(&mut hello)
        .await
        .map_err(|e| transport("bootstrap hello", e))?;
    if &hello[..4] != HELLO {
        return Err(LinkError::Malformed(format!(
            "NCCL link hello starts with {:02x?}, not \"NCCL\"",
            &hello[..4]
        )));
    }
    let id = NcclId::from_bytes(&hello[4..]).map_err(|e| transport("bootstrap id", e))?;
    let joined = Peer::join(device, DECODER_RANK, id).await;
    let reply = match &joined {
        Ok(_) => b"OK".to_vec(),
        Err(e) => [b"ER".as_slice(), e.to_string().as_bytes()].concat(),
    };
    tx.write_all(&reply)
        .await
        .map_err(|e| transport("bootstrap answer", e))?;
    tx.finish().map_err(|e| transport("bootstrap stream", e))?;
    joined
}

/// One request stream of an NCCL link: headers from QUIC, frames from NCCL.
struct NcclReceiver {
    stream: quinn::RecvStream,
    peer: Arc<Peer>,
}

impl ChunkStream for NcclReceiver {
    async fn next(&mut self) -> Result<Option<Arrived>, LinkError> {
        let Some((header, payload_len)) = read_frame_head(&mut self.stream).await? else {
            return Ok(None);
        };
        if payload_len != header.payload_bytes() {
            return Err(LinkError::Malformed(format!(
                "chunk {} of {}: {payload_len} payload bytes announced for shape {:?} ({} expected)",
                header.chunk_index,
                header.request_id,
                header.shape,
                header.payload_bytes()
            )));
        }
        let dtype = match header.dtype {
            LinkDType::F32 => DType::F32,
            LinkDType::Bf16 => DType::BF16,
        };
        let shape: Vec<usize> = header.shape.iter().map(|&d| d as usize).collect();
        let latent = self.peer.recv(shape, dtype).await?;
        let (_, actual) = checksum(&latent)?;
        if actual != header.checksum {
            return Err(LinkError::Checksum {
                request_id: header.request_id,
                chunk_index: header.chunk_index,
                expected: header.checksum,
                actual,
            });
        }
        Ok(Some(Arrived { header, latent }))
    }
}
