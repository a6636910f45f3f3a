//! The UCX latent link (feature `ucx`), for pools joined by a fabric UCX drives (InfiniBand,
//! RoCE, shared memory on one node, TCP anywhere). Same shape as [`quic`](super::quic): a decoder
//! pool [`listen`]s on a socket address, a denoiser [`connect`]s, and each request's chunks
//! travel in order on their own stream ([`ChunkSender`] → [`ChunkReceiver`]), requests side by
//! side on one connection.
//!
//! How it maps onto UCX (our own bindgen bindings over the system's libucx, `sys`):
//! - **Connection**: a UCP listener with a connection-request handler on the decoder side, a
//!   client-server endpoint (`UCP_EP_PARAMS_FLAGS_CLIENT_SERVER`) on the denoiser side, both in
//!   error mode PEER; [`connect`] returns once the server answered a hello, and fails at the
//!   configured timeout (or earlier, on a refused connection) instead of hanging.
//! - **Messages**: active messages (`ucp_am_send_nbx`), one per chunk: our small header plus the
//!   encoded [`ChunkHeader`] as the AM header, the payload as the AM data. UCX sends small payloads
//!   eagerly and large ones by rendezvous, which the receiver fetches straight into the chunk's
//!   buffer (no framing copy). Each chunk carries its stream and position, so the receiver
//!   restores order itself and does not rely on UCX's delivery order; payloads are verified
//!   against their CRC-32 before they are handed over.
//! - **Progress**: one thread per node owns the UCP worker (see `worker`); it sleeps in `poll(2)` on
//!   the worker's event fd when idle, so an idle link costs no CPU. Async callers talk to it over
//!   channels.
//! - **Memory**: the payload is sent from wherever [`SendBuffer::memory_type`] says it lives, and
//!   the memory type is passed through to UCX. Moving CUDA memory needs a UCX built with CUDA
//!   transports (`cuda_copy`, `cuda_ipc`, `gdr_copy`); Debian's libucx is not, so there only host
//!   memory works and asking for CUDA is an [`LinkError::Unsupported`] error. The receiver always
//!   gets host bytes.
//! - **Transports** are chosen in code ([`UcxConfig::transports`], UCX's `TLS` setting applied
//!   through `ucp_config_modify`); `UCX_*` environment variables still override for experiments.
//!
//! Backpressure: `send` returns when UCX is done with the payload (for a rendezvous payload, once
//! the receiver fetched it). The receiver fetches at once and queues chunks until they are read;
//! the bound on that memory is the pools' bound on requests in flight.

mod sys;
mod wire;
mod worker;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tokio::sync::{Mutex, mpsc, oneshot};

use super::{ChunkHeader, LatentChunk, LinkError};
use wire::{Kind, WireHeader};
use worker::{Command, ConnHandle, IncomingStream, Node, StreamItem};

/// How a node sets up UCX.
#[derive(Debug, Clone)]
pub struct UcxConfig {
    /// UCX transports to use (its `TLS` setting), e.g. `"tcp"`, `"rc,sm,self"`, `"all"`; `None`
    /// leaves UCX's default (every transport it finds). The default, `"tcp,sm,self"`, works on
    /// any host without RDMA hardware.
    pub transports: Option<String>,
    /// How long [`connect`] waits for the listener's answer.
    pub connect_timeout: Duration,
}

impl Default for UcxConfig {
    fn default() -> UcxConfig {
        UcxConfig {
            transports: Some("tcp,sm,self".into()),
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// Where a payload's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryType {
    /// Ordinary host memory.
    Host,
    /// CUDA device memory (needs a UCX built with CUDA transports).
    Cuda,
}

impl MemoryType {
    fn ucs(self) -> sys::ucs_memory_type_t {
        match self {
            MemoryType::Host => sys::UCS_MEMORY_TYPE_HOST,
            MemoryType::Cuda => sys::UCS_MEMORY_TYPE_CUDA,
        }
    }
}

/// A payload the link may read from until UCX is done with it: the link takes ownership, so the
/// bytes outlive the transfer even when the sending future is dropped.
///
/// # Safety
/// `as_ptr()` must point at `len()` bytes of `memory_type()` memory that stay valid and
/// unmodified for as long as the value lives.
pub unsafe trait SendBuffer: Send + 'static {
    /// The first byte.
    fn as_ptr(&self) -> *const u8;
    /// Number of bytes.
    fn len(&self) -> usize;
    /// Whether it holds no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Where the bytes live.
    fn memory_type(&self) -> MemoryType;
}

// SAFETY: a Vec's heap buffer does not move while the Vec is alive and not mutated; the link
// owns it (no one else can mutate it).
unsafe impl SendBuffer for Vec<u8> {
    fn as_ptr(&self) -> *const u8 {
        self.as_slice().as_ptr()
    }
    fn len(&self) -> usize {
        self.as_slice().len()
    }
    fn memory_type(&self) -> MemoryType {
        MemoryType::Host
    }
}

// SAFETY: Bytes are immutable and their storage lives as long as the handle.
unsafe impl SendBuffer for bytes::Bytes {
    fn as_ptr(&self) -> *const u8 {
        self.as_ref().as_ptr()
    }
    fn len(&self) -> usize {
        self.as_ref().len()
    }
    fn memory_type(&self) -> MemoryType {
        MemoryType::Host
    }
}

/// A decoder pool's listening node: accepts denoiser connections.
pub struct Listener {
    node: Arc<Node>,
    addr: SocketAddr,
    accepted: Mutex<mpsc::UnboundedReceiver<Result<ConnHandle, LinkError>>>,
}

/// Starts a UCX node listening on `addr` (port 0 picks a free one; see [`Listener::local_addr`]).
pub fn listen(addr: SocketAddr, config: &UcxConfig) -> Result<Listener, LinkError> {
    let node = Arc::new(Node::start(config)?);
    let (reply, reply_rx) = std::sync::mpsc::sync_channel(1);
    let (accepted_tx, accepted) = mpsc::unbounded_channel();
    node.submit(Command::Listen {
        addr,
        reply,
        accepted: accepted_tx,
    })?;
    let addr = reply_rx
        .recv()
        .map_err(|_| LinkError::Transport("the UCX progress thread died".into()))??;
    tracing::debug!(%addr, "UCX latent link listening");
    Ok(Listener {
        node,
        addr,
        accepted: Mutex::new(accepted),
    })
}

impl Listener {
    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The next denoiser connection.
    pub async fn accept(&self) -> Result<Connection, LinkError> {
        let handle = self
            .accepted
            .lock()
            .await
            .recv()
            .await
            .ok_or_else(|| LinkError::Transport("the UCX listener is closed".into()))??;
        Ok(Connection::new(self.node.clone(), handle))
    }

    /// Whether this UCX build can send payloads in `memory`.
    pub fn supports(&self, memory: MemoryType) -> bool {
        self.node.supports(memory)
    }
}

/// A denoiser's connection to the decoder pool listening at `addr`: its own UCX context, worker
/// and progress thread. Fails when nobody answers within [`UcxConfig::connect_timeout`].
pub async fn connect(addr: SocketAddr, config: &UcxConfig) -> Result<Connection, LinkError> {
    let node = Arc::new(Node::start(config)?);
    let (reply, reply_rx) = oneshot::channel();
    node.submit(Command::Connect { addr, reply })?;
    let handle = match tokio::time::timeout(config.connect_timeout, reply_rx).await {
        Ok(Ok(result)) => result?,
        Ok(Err(_)) => return Err(LinkError::Transport("the UCX progress thread died".into())),
        Err(_) => {
            return Err(LinkError::Transport(format!(
                "connect to {addr}: no answer within {:?}",
                config.connect_timeout
            )));
        }
    };
    Ok(Connection::new(node, handle))
}

/// One connection, either side; cheap to clone. Request streams go both ways. Dropping the last
/// clone (and every sender on it) closes it.
#[derive(Clone)]
pub struct Connection {
    shared: Arc<ConnShared>,
}

struct ConnShared {
    node: Arc<Node>,
    id: u64,
    peer: SocketAddr,
    next_stream: AtomicU32,
    incoming: Mutex<mpsc::UnboundedReceiver<Result<IncomingStream, LinkError>>>,
}

impl Drop for ConnShared {
    fn drop(&mut self) {
        // Fails only when the thread is gone, and then the connection is gone too.
        let _ = self.node.submit(Command::Close {
            conn: self.id,
            done: None,
        });
    }
}

impl Connection {
    fn new(node: Arc<Node>, handle: ConnHandle) -> Connection {
        Connection {
            shared: Arc::new(ConnShared {
                node,
                id: handle.id,
                peer: handle.peer,
                next_stream: AtomicU32::new(0),
                incoming: Mutex::new(handle.incoming),
            }),
        }
    }

    /// The peer's socket address (as the listener saw it, on the accepting side).
    pub fn peer_addr(&self) -> SocketAddr {
        self.shared.peer
    }

    /// Whether this UCX build can send payloads in `memory`.
    pub fn supports(&self, memory: MemoryType) -> bool {
        self.shared.node.supports(memory)
    }

    /// Says goodbye to the peer (its receivers end cleanly, unfinished streams with an error)
    /// and closes the endpoint, flushing what was sent.
    pub async fn close(self) -> Result<(), LinkError> {
        let (done, done_rx) = oneshot::channel();
        self.shared.node.submit(Command::Close {
            conn: self.shared.id,
            done: Some(done),
        })?;
        done_rx
            .await
            .map_err(|_| LinkError::Transport("the UCX progress thread died".into()))?
    }

    async fn post(
        &self,
        header: WireHeader,
        payload: Option<Box<dyn SendBuffer>>,
    ) -> Result<(), LinkError> {
        let (done, done_rx) = oneshot::channel();
        self.shared.node.submit(Command::Send {
            conn: self.shared.id,
            header,
            payload,
            done: Some(done),
        })?;
        done_rx
            .await
            .map_err(|_| LinkError::Transport("the UCX progress thread died".into()))?
    }
}

/// Sends one request's chunks, in order.
pub struct ChunkSender {
    conn: Connection,
    stream: u32,
    sent: u32,
    finished: bool,
}

impl ChunkSender {
    /// Opens a request stream on `conn` (no message until the first chunk).
    pub fn open(conn: &Connection) -> ChunkSender {
        ChunkSender {
            conn: conn.clone(),
            stream: conn.shared.next_stream.fetch_add(1, Ordering::Relaxed),
            sent: 0,
            finished: false,
        }
    }

    /// Sends one host chunk; returns when UCX is done with its payload. The chunk moves into the
    /// link (no copy): the transfer may outlive this future if it is dropped.
    pub async fn send(&mut self, chunk: LatentChunk) -> Result<(), LinkError> {
        let LatentChunk { header, payload } = chunk;
        self.send_buffer(&header, Box::new(payload)).await
    }

    /// Sends a chunk whose payload is any [`SendBuffer`] (CUDA memory on a CUDA-enabled UCX);
    /// `header` must describe it (shape, dtype and checksum of its bytes).
    pub async fn send_buffer(
        &mut self,
        header: &ChunkHeader,
        payload: Box<dyn SendBuffer>,
    ) -> Result<(), LinkError> {
        let mut wire = WireHeader::new(Kind::Chunk, self.stream, self.sent);
        wire.rest = header.encode();
        self.sent += 1;
        self.conn.post(wire, Some(payload)).await
    }

    /// Ends the request's stream after its last chunk; returns once the end marker is sent.
    pub async fn finish(mut self) -> Result<(), LinkError> {
        self.finished = true;
        let wire = WireHeader::new(Kind::Fin, self.stream, self.sent);
        self.conn.post(wire, None).await
    }
}

impl Drop for ChunkSender {
    /// A stream dropped before `finish` (a cancelled request) ends with an error at the receiver.
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.conn.shared.node.submit(Command::Send {
                conn: self.conn.shared.id,
                header: WireHeader::new(Kind::Abort, self.stream, self.sent),
                payload: None,
                done: None,
            });
        }
    }
}

/// Receives one request's chunks, in order.
pub struct ChunkReceiver {
    stream: u32,
    items: mpsc::UnboundedReceiver<StreamItem>,
    ended: bool,
}

impl ChunkReceiver {
    /// The next request stream the peer opened on `conn`; `None` once the peer closed the
    /// connection cleanly, an error when it failed.
    pub async fn accept(conn: &Connection) -> Result<Option<ChunkReceiver>, LinkError> {
        match conn.shared.incoming.lock().await.recv().await {
            Some(Ok(s)) => Ok(Some(ChunkReceiver {
                stream: s.id,
                items: s.items,
                ended: false,
            })),
            Some(Err(e)) => Err(e),
            None => Ok(None),
        }
    }

    /// The next chunk, verified against its checksum; `None` after the last. A chunk that fails
    /// verification is returned as its error, and the stream goes on with the next one.
    pub async fn next(&mut self) -> Result<Option<LatentChunk>, LinkError> {
        if self.ended {
            return Ok(None);
        }
        match self.items.recv().await {
            Some(StreamItem::Chunk(chunk)) => chunk.map(Some),
            Some(StreamItem::End) => {
                self.ended = true;
                Ok(None)
            }
            None => {
                self.ended = true;
                Err(LinkError::Transport(format!(
                    "request stream {} ended without its end marker",
                    self.stream
                )))
            }
        }
    }
}
