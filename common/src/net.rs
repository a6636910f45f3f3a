//! Every listener's front door: the public API, the gateway's registry and each pool's service
//! all accept connections here, so each is as hard to wedge as the others (`connections:` in
//! the config):
//!
//! - a cap on open connections: beyond it a new one is refused at once, with an HTTP/2 GOAWAY
//!   (`ENHANCE_YOUR_CALM`) naming the limit on plaintext listeners (closed on TLS ones, where
//!   saying so would cost a handshake);
//! - one deadline for the TLS handshake and the client's first bytes (the whole HTTP/2 preface,
//!   or the start of an HTTP/1.1 request, whose headers hyper then times itself), so a
//!   connection that never speaks is closed instead of holding a descriptor (handshakes run
//!   concurrently, off the accept loop);
//! - an idle timeout: a connection with no call in flight for that long is closed (counted by
//!   [`TrackCalls`], a layer on the server);
//! - HTTP/2 keepalive pings, a cap on concurrent streams per connection, a header size cap
//!   ([`server`]); message sizes are capped per service by the caller.
//!
//! With TLS, the peer's verified certificate travels with each call ([`ConnInfo::peer`]).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use rustls::pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;

use crate::config::ConnectionLimits;

/// What every HTTP/2 client sends first (RFC 9113 §3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Largest request header block a server here accepts.
const MAX_HEADER_BYTES: u32 = 16 << 10;

/// Refusals (GOAWAY then close) in progress at once; beyond it an over-limit connection is
/// closed without one.
const MAX_REFUSING: usize = 64;

/// How a listener secures its connections.
#[derive(Clone)]
pub enum Security {
    /// No TLS (the public API on loopback, or with `serving.insecure`).
    Plaintext,
    /// TLS with this config (client certificates required when it says so).
    Tls(Arc<rustls::ServerConfig>),
}

/// What a call knows about its connection (in the request's extensions).
#[derive(Clone)]
pub struct ConnInfo {
    /// The peer's address.
    pub remote: SocketAddr,
    /// The peer's certificate, verified during the handshake (mutual TLS only).
    pub peer: Option<CertificateDer<'static>>,
    calls: Arc<Calls>,
}

impl ConnInfo {
    /// The connection info of `request`, if it came through a [`Listener`].
    pub fn of<T>(request: &tonic::Request<T>) -> Option<&ConnInfo> {
        request.extensions().get::<ConnInfo>()
    }
}

/// Calls in flight on one connection, and when the last one ended.
struct Calls {
    open: AtomicUsize,
    last_end: Mutex<Instant>,
}

impl Calls {
    fn lock(&self) -> std::sync::MutexGuard<'_, Instant> {
        // One Instant per critical section: a poisoned lock still holds a valid one.
        self.last_end
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How long the connection has had no call in flight (`None` while one is).
    fn idle_for(&self) -> Option<Duration> {
        (self.open.load(Ordering::SeqCst) == 0).then(|| self.lock().elapsed())
    }
}

/// Marks one call in flight until dropped (with the call's response body).
struct CallGuard(Arc<Calls>);

impl CallGuard {
    fn new(calls: &Arc<Calls>) -> CallGuard {
        calls.open.fetch_add(1, Ordering::SeqCst);
        CallGuard(Arc::clone(calls))
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        *self.0.lock() = Instant::now();
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A listener could not bind its address.
#[derive(Debug, thiserror::Error)]
#[error("{what}: cannot listen on {addr}: {source}")]
pub struct ListenError {
    /// The listener (its config key).
    pub what: &'static str,
    /// The address.
    pub addr: SocketAddr,
    /// What the OS said.
    pub source: io::Error,
}

/// A bound listener with its security and limits.
pub struct Listener {
    tcp: TcpListener,
    security: Security,
    limits: ConnectionLimits,
    what: &'static str,
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

impl Listener {
    /// Binds `addr` for `what` (named in logs and errors).
    pub async fn bind(
        what: &'static str,
        addr: SocketAddr,
        security: Security,
        limits: &ConnectionLimits,
    ) -> Result<Listener, ListenError> {
        let tcp = TcpListener::bind(addr)
            .await
            .map_err(|source| ListenError { what, addr, source })?;
        Ok(Listener {
            tcp,
            security,
            limits: limits.clone(),
            what,
        })
    }

    /// Where it listens (the real port when bound to port 0).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// The connections that passed the handshake, for `serve_with_incoming*`. Accepting stops
    /// (and the port closes) when the stream is dropped.
    pub fn incoming(self) -> ReceiverStream<io::Result<Conn>> {
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(accept_loop(self, tx));
        ReceiverStream::new(rx)
    }
}

async fn accept_loop(listener: Listener, tx: mpsc::Sender<io::Result<Conn>>) {
    let Listener {
        tcp,
        security,
        limits,
        what,
    } = listener;
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    loop {
        let accepted = tokio::select! {
            _ = tx.closed() => return,
            accepted = tcp.accept() => accepted,
        };
        let (stream, remote) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors, or a connection reset before it was accepted: the
                // listener itself is fine; pause so a descriptor shortage does not spin.
                tracing::warn!(what, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            tracing::warn!(what, %remote, limit = limits.max_connections, "connection refused: at connections.max_connections");
            if let (Security::Plaintext, Ok(permit)) =
                (&security, Arc::clone(&refusing).try_acquire_owned())
            {
                tokio::spawn(refuse(stream, limits.max_connections, permit));
            }
            continue;
        };
        let (tx, security, limits) = (tx.clone(), security.clone(), limits.clone());
        tokio::spawn(async move {
            match handshake(stream, remote, &security, &limits, slot).await {
                Ok(conn) => {
                    let _ = tx.send(Ok(conn)).await;
                }
                Err(e) => {
                    tracing::debug!(what, %remote, error = %e, "connection closed in its handshake")
                }
            }
        });
    }
}

/// Tells an over-limit HTTP/2 client why it is refused (SETTINGS, then GOAWAY with
/// ENHANCE_YOUR_CALM and the reason as debug data), then closes after it has read that.
async fn refuse(mut stream: TcpStream, limit: usize, _permit: OwnedSemaphorePermit) {
    use tokio::io::AsyncWriteExt;
    let reason =
        format!("connection limit reached (connections.max_connections = {limit}); retry later");
    let mut frames = vec![0, 0, 0, 4, 0, 0, 0, 0, 0]; // an empty SETTINGS frame
    let len = 8 + reason.len();
    frames.extend_from_slice(&[
        (len >> 16) as u8,
        (len >> 8) as u8,
        len as u8,
        7,
        0,
        0,
        0,
        0,
        0,
    ]);
    frames.extend_from_slice(&0u32.to_be_bytes()); // last stream id: none was processed
    frames.extend_from_slice(&0xbu32.to_be_bytes()); // ENHANCE_YOUR_CALM
    frames.extend_from_slice(reason.as_bytes());
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        stream.write_all(&frames).await?;
        stream.shutdown().await?;
        // Drain what the client sent, so closing does not reset the connection before it has
        // read the GOAWAY.
        let mut sink = [0u8; 1024];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<_, io::Error>(())
    })
    .await;
}

async fn handshake(
    stream: TcpStream,
    remote: SocketAddr,
    security: &Security,
    limits: &ConnectionLimits,
    slot: OwnedSemaphorePermit,
) -> io::Result<Conn> {
    let timeout = secs(limits.handshake_timeout_s);
    let handshake = async {
        let (mut io, peer) = match security {
            Security::Plaintext => (Io::Plain(stream), None),
            Security::Tls(config) => {
                let tls = tokio_rustls::TlsAcceptor::from(Arc::clone(config))
                    .accept(stream)
                    .await?;
                let peer = tls
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .map(|c| c.clone().into_owned());
                (Io::Tls(Box::new(tls)), peer)
            }
        };
        // The whole HTTP/2 preface, or the first bytes of anything else (HTTP/1.1).
        let mut first = Vec::with_capacity(PREFACE.len());
        while first.len() < PREFACE.len() && PREFACE.starts_with(&first) {
            let mut buf = [0u8; PREFACE.len()];
            let n = io.read(&mut buf[..PREFACE.len() - first.len()]).await?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "closed before a request",
                ));
            }
            first.extend_from_slice(&buf[..n]);
        }
        Ok((io, peer, first))
    };
    let (io, peer, first) = tokio::time::timeout(timeout, handshake)
        .await
        .map_err(|_| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "no handshake and request within {timeout:?} (connections.handshake_timeout_s)"
                ),
            )
        })??;
    let calls = Arc::new(Calls {
        open: AtomicUsize::new(0),
        last_end: Mutex::new(Instant::now()),
    });
    let idle = secs(limits.idle_timeout_s);
    Ok(Conn {
        io,
        first,
        replayed: 0,
        info: ConnInfo {
            remote,
            peer,
            calls,
        },
        idle,
        idle_check: Box::pin(tokio::time::sleep(idle)),
        _slot: slot,
    })
}

enum Io {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// An accepted connection past its handshake: replays the first bytes it consumed, holds one
/// of the listener's connection slots, and ends itself when idle too long.
pub struct Conn {
    io: Io,
    /// The client's first bytes, read during the handshake.
    first: Vec<u8>,
    /// How many of them the server has read.
    replayed: usize,
    info: ConnInfo,
    idle: Duration,
    idle_check: Pin<Box<tokio::time::Sleep>>,
    _slot: OwnedSemaphorePermit,
}

impl Conn {
    /// Fails the connection's reads once it has had no call in flight for the idle timeout.
    /// The server always has a read pending, so this timer always has a waker.
    fn check_idle(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        while self.idle_check.as_mut().poll(cx).is_ready() {
            let next = match self.info.calls.idle_for() {
                Some(idle) if idle >= self.idle => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "idle for connections.idle_timeout_s",
                    ));
                }
                Some(idle) => self.idle - idle,
                None => self.idle,
            };
            self.idle_check
                .as_mut()
                .reset(tokio::time::Instant::now() + next);
        }
        Ok(())
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.replayed < this.first.len() {
            let n = (this.first.len() - this.replayed).min(buf.remaining());
            buf.put_slice(&this.first[this.replayed..this.replayed + n]);
            this.replayed += n;
            return Poll::Ready(Ok(()));
        }
        if let Err(e) = this.check_idle(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        self.info.clone()
    }
}

/// Every server's layers: call tracking for the idle timeout.
pub type Layers = tower::layer::util::Stack<TrackCalls, tower::layer::util::Identity>;

/// A server's services, ready for [`spawn`].
pub type Router = tonic::transport::server::Router<Layers>;

/// A tonic server with the HTTP/2 limits of `limits` and call tracking for the idle timeout;
/// add its services, then [`spawn`] it on a [`Listener`].
pub fn server(limits: &ConnectionLimits) -> tonic::transport::Server<Layers> {
    tonic::transport::Server::builder()
        .max_concurrent_streams(limits.max_streams)
        .http2_keepalive_interval(Some(secs(limits.keepalive_interval_s)))
        .http2_keepalive_timeout(Some(secs(limits.keepalive_timeout_s)))
        .http2_max_header_list_size(MAX_HEADER_BYTES)
        .layer(TrackCalls)
}

/// Serves `router` on `listener` until `shutdown` resolves (then lets open calls finish);
/// `what` names it in the log if it fails.
pub fn spawn(
    what: &'static str,
    router: Router,
    listener: Listener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if let Err(e) = router
            .serve_with_incoming_shutdown(listener.incoming(), shutdown)
            .await
        {
            tracing::error!(error = %e, "{what} failed");
        }
    })
}

/// Counts each connection's calls in flight (from a call's start to the end of its response
/// body), for the idle timeout.
#[derive(Clone, Copy, Debug)]
pub struct TrackCalls;

impl<S> tower::Layer<S> for TrackCalls {
    type Service = Tracked<S>;

    fn layer(&self, inner: S) -> Tracked<S> {
        Tracked(inner)
    }
}

/// A service whose calls [`TrackCalls`] counts.
#[derive(Clone, Debug)]
pub struct Tracked<S>(S);

type Body = tonic::body::Body;

impl<S, B> tower::Service<http::Request<B>> for Tracked<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let guard = request
            .extensions()
            .get::<ConnInfo>()
            .map(|c| CallGuard::new(&c.calls));
        let response = self.0.call(request);
        Box::pin(async move {
            let response = response.await?;
            Ok(match guard {
                Some(guard) => response.map(|body| {
                    Body::new(Guarded {
                        body,
                        _guard: guard,
                    })
                }),
                None => response,
            })
        })
    }
}

/// A response body that keeps its call counted until it is done or dropped.
struct Guarded {
    body: Body,
    _guard: CallGuard,
}

impl http_body::Body for Guarded {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, tonic::Status>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[tokio::test]
    async fn a_taken_address_names_the_listener_and_the_address() {
        let limits = ConnectionLimits::default();
        let first = Listener::bind(
            "a.listen",
            "127.0.0.1:0".parse().unwrap(),
            Security::Plaintext,
            &limits,
        )
        .await
        .unwrap();
        let addr = first.local_addr().unwrap();
        let e = Listener::bind("b.listen", addr, Security::Plaintext, &limits)
            .await
            .err()
            .unwrap();
        assert!(
            e.to_string()
                .starts_with(&format!("b.listen: cannot listen on {addr}: ")),
            "{e}"
        );
    }
}
