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
//! - a send timeout: a connection whose client has not taken a response's next bytes for that
//!   long (an HTTP/2 window left at 0, a socket left full) is closed, so a client that never
//!   reads cannot hold a connection with a call that never ends (also [`TrackCalls`]);
//! - a request deadline: a call's request body (a gRPC message, an HTTP body) must arrive in
//!   full within `request_timeout_s` of its headers, so a client that trickles it a byte at a
//!   time cannot keep a call, and with it the connection, open (also [`TrackCalls`]);
//! - HTTP/2 keepalive pings, a cap on concurrent streams per connection, a header size cap
//!   ([`server`]); message sizes are capped per service by the caller.
//!
//! With TLS, the peer's verified certificate travels with each call ([`ConnInfo::peer`]).
//!
//! A listener [`Listener::counted_in`] a [`ConnMetrics`] counts its open connections, its
//! refusals and every connection or call those limits ended, for `/metrics`.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
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
    /// The listener's count of request deadlines missed.
    request_timeouts: Counter,
}

impl ConnInfo {
    /// The connection info of `request`, if it came through a [`Listener`].
    pub fn of<T>(request: &tonic::Request<T>) -> Option<&ConnInfo> {
        request.extensions().get::<ConnInfo>()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ListenerLabel {
    /// The listener's config key (`serving.listen`, `pools.registry_listen`, …).
    listener: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClosedLabels {
    listener: &'static str,
    /// `handshake_timeout`, `handshake_failed`, `idle_timeout` or `send_timeout`.
    reason: &'static str,
}

/// The listeners' connection metrics, labelled by listener: open connections, connections
/// refused at the cap, connections the server closed and why, and calls whose request missed
/// its deadline. Clones share the values; [`ConnMetrics::register`] exports them.
#[derive(Clone, Default)]
pub struct ConnMetrics {
    open: Family<ListenerLabel, Gauge>,
    refused: Family<ListenerLabel, Counter>,
    closed: Family<ClosedLabels, Counter>,
    request_timeouts: Family<ListenerLabel, Counter>,
}

impl ConnMetrics {
    /// Adds the metrics to `registry` (names under its prefix).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "connections",
            "Open connections past their handshake, by listener",
            self.open.clone(),
        );
        registry.register(
            "connections_refused",
            "Connections refused at connections.max_connections",
            self.refused.clone(),
        );
        registry.register(
            "connections_closed",
            "Connections the server closed, by reason: handshake_timeout (no TLS handshake \
             and request within connections.handshake_timeout_s), handshake_failed (the TLS \
             handshake failed, e.g. a certificate the listener does not trust), idle_timeout, \
             send_timeout (the client read nothing for connections.send_timeout_s)",
            self.closed.clone(),
        );
        registry.register(
            "request_timeouts",
            "Calls ended because their request did not arrive within \
             connections.request_timeout_s",
            self.request_timeouts.clone(),
        );
    }

    /// `listener`'s handles, its series created at zero (so a scrape shows every one).
    fn of(&self, listener: &'static str) -> Counts {
        let label = ListenerLabel { listener };
        let closed = |reason| {
            self.closed
                .get_or_create(&ClosedLabels { listener, reason })
                .clone()
        };
        Counts {
            open: self.open.get_or_create(&label).clone(),
            refused: self.refused.get_or_create(&label).clone(),
            handshake_timeout: closed("handshake_timeout"),
            handshake_failed: closed("handshake_failed"),
            idle_timeout: closed("idle_timeout"),
            send_timeout: closed("send_timeout"),
            request_timeouts: self.request_timeouts.get_or_create(&label).clone(),
        }
    }
}

/// One listener's series in a [`ConnMetrics`]; unregistered ones (the default) count for no one.
#[derive(Clone, Default)]
struct Counts {
    open: Gauge,
    refused: Counter,
    handshake_timeout: Counter,
    handshake_failed: Counter,
    idle_timeout: Counter,
    send_timeout: Counter,
    request_timeouts: Counter,
}

/// Calls in flight on one connection: when the last one ended (for the idle timeout), and
/// which response bodies wait for the client to read (for the send timeout).
struct Calls(Mutex<CallState>);

struct CallState {
    open: usize,
    last_end: Instant,
    next_body: u64,
    /// Response bodies the server has not asked for a frame since they were returned or
    /// handed it their last one, and since when: the server asks again as soon as the client
    /// has taken that frame (the HTTP/2 window or the socket has room), so a long wait here
    /// is a client that does not read. A body waiting for its own data is not here.
    unread: HashMap<u64, Instant>,
}

/// What a connection is doing, for its timeouts.
enum Activity {
    /// No call in flight, for this long.
    Idle(Duration),
    /// Calls in flight; the longest any of their responses has waited for the client to read.
    Busy(Option<Duration>),
}

impl Calls {
    fn new() -> Calls {
        Calls(Mutex::new(CallState {
            open: 0,
            last_end: Instant::now(),
            next_body: 0,
            unread: HashMap::new(),
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CallState> {
        // Each critical section leaves the state whole: a poisoned lock still holds a valid one.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn activity(&self) -> Activity {
        let s = self.lock();
        if s.open == 0 {
            Activity::Idle(s.last_end.elapsed())
        } else {
            Activity::Busy(s.unread.values().min().map(Instant::elapsed))
        }
    }
}

/// Marks one call in flight until dropped (with the call's response body).
struct CallGuard(Arc<Calls>);

impl CallGuard {
    fn new(calls: &Arc<Calls>) -> CallGuard {
        calls.lock().open += 1;
        CallGuard(Arc::clone(calls))
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        let mut s = self.0.lock();
        s.last_end = Instant::now();
        s.open -= 1;
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
    counts: Counts,
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
            counts: Counts::default(),
        })
    }

    /// The listener, counting its connections into `metrics` under its name.
    pub fn counted_in(self, metrics: &ConnMetrics) -> Listener {
        let counts = metrics.of(self.what);
        Listener { counts, ..self }
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
        counts,
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
            counts.refused.inc();
            if let (Security::Plaintext, Ok(permit)) =
                (&security, Arc::clone(&refusing).try_acquire_owned())
            {
                tokio::spawn(refuse(stream, limits.max_connections, permit));
            }
            continue;
        };
        let (tx, security, limits, counts) =
            (tx.clone(), security.clone(), limits.clone(), counts.clone());
        tokio::spawn(async move {
            match handshake(stream, remote, &security, &limits, &counts, slot).await {
                Ok(conn) => {
                    let _ = tx.send(Ok(conn)).await;
                }
                Err(e) => {
                    let closed = match e.kind() {
                        io::ErrorKind::TimedOut => Some(&counts.handshake_timeout),
                        // The client left before it asked anything: its choice, not a failure.
                        io::ErrorKind::UnexpectedEof => None,
                        _ => Some(&counts.handshake_failed),
                    };
                    if let Some(closed) = closed {
                        closed.inc();
                    }
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
    counts: &Counts,
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
    let (idle, send_timeout) = (secs(limits.idle_timeout_s), secs(limits.send_timeout_s));
    counts.open.inc();
    Ok(Conn {
        io,
        first,
        replayed: 0,
        info: ConnInfo {
            remote,
            peer,
            calls: Arc::new(Calls::new()),
            request_timeouts: counts.request_timeouts.clone(),
        },
        idle,
        send_timeout,
        check: Box::pin(tokio::time::sleep(idle.min(send_timeout))),
        timed_out: None,
        counts: counts.clone(),
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
/// of the listener's connection slots, and ends itself when idle too long or when its client
/// has not read for the send timeout.
pub struct Conn {
    io: Io,
    /// The client's first bytes, read during the handshake.
    first: Vec<u8>,
    /// How many of them the server has read.
    replayed: usize,
    info: ConnInfo,
    idle: Duration,
    send_timeout: Duration,
    /// When to look at the calls next.
    check: Pin<Box<tokio::time::Sleep>>,
    /// Which timeout ended it: every read and write after fails the same way.
    timed_out: Option<&'static str>,
    counts: Counts,
    _slot: OwnedSemaphorePermit,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.counts.open.dec();
    }
}

impl Conn {
    /// Fails the connection's reads and writes once it has had no call in flight for the idle
    /// timeout, or a response has waited for the client to read for the send timeout. The
    /// server always has a read pending (and a write, while the socket is full), so this timer
    /// always has a waker. It looks at least every send timeout (a call may start at any
    /// time), so a client that stops reading is closed after one to two of them.
    fn check(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        while self.timed_out.is_none() && self.check.as_mut().poll(cx).is_ready() {
            let next = match self.info.calls.activity() {
                Activity::Idle(idle) if idle >= self.idle => {
                    self.counts.idle_timeout.inc();
                    self.timed_out = Some("idle for connections.idle_timeout_s");
                    break;
                }
                Activity::Idle(idle) => (self.idle - idle).min(self.send_timeout),
                Activity::Busy(Some(unread)) if unread >= self.send_timeout => {
                    self.counts.send_timeout.inc();
                    self.timed_out = Some("the client read nothing for connections.send_timeout_s");
                    break;
                }
                Activity::Busy(Some(unread)) => self.send_timeout - unread,
                Activity::Busy(None) => self.send_timeout,
            };
            self.check
                .as_mut()
                .reset(tokio::time::Instant::now() + next);
        }
        match self.timed_out {
            Some(why) => Err(io::Error::new(io::ErrorKind::TimedOut, why)),
            None => Ok(()),
        }
    }

    /// A write that could not proceed (the socket is full) checks the timeouts.
    fn blocked<T>(
        &mut self,
        cx: &mut Context<'_>,
        poll: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match poll {
            Poll::Pending => match self.check(cx) {
                Err(e) => Poll::Ready(Err(e)),
                Ok(()) => Poll::Pending,
            },
            ready => ready,
        }
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
        if let Err(e) = this.check(cx) {
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
        let poll = Pin::new(&mut self.io).poll_write(cx, buf);
        self.blocked(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.blocked(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.io).poll_flush(cx);
        self.blocked(cx, poll)
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

/// Every server's layers: call tracking for the idle and send timeouts, and the request
/// deadline.
pub type Layers = tower::layer::util::Stack<TrackCalls, tower::layer::util::Identity>;

/// A server's services, ready for [`spawn`].
pub type Router = tonic::transport::server::Router<Layers>;

/// A tonic server with the HTTP/2 limits of `limits`, call tracking for the idle and send
/// timeouts, and the request deadline; add its services, then [`spawn`] it on a [`Listener`].
pub fn server(limits: &ConnectionLimits) -> tonic::transport::Server<Layers> {
    tonic::transport::Server::builder()
        .max_concurrent_streams(limits.max_streams)
        .http2_keepalive_interval(Some(secs(limits.keepalive_interval_s)))
        .http2_keepalive_timeout(Some(secs(limits.keepalive_timeout_s)))
        .http2_max_header_list_size(MAX_HEADER_BYTES)
        .layer(TrackCalls {
            request_timeout: secs(limits.request_timeout_s),
        })
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
/// body) and notes responses waiting for their client to read, for the idle and send
/// timeouts; gives each call's request body its deadline.
#[derive(Clone, Copy, Debug)]
pub struct TrackCalls {
    request_timeout: Duration,
}

impl<S> tower::Layer<S> for TrackCalls {
    type Service = Tracked<S>;

    fn layer(&self, inner: S) -> Tracked<S> {
        Tracked {
            inner,
            request_timeout: self.request_timeout,
        }
    }
}

/// A service whose calls [`TrackCalls`] counts and times.
#[derive(Clone, Debug)]
pub struct Tracked<S> {
    inner: S,
    request_timeout: Duration,
}

type Body = tonic::body::Body;

impl<S> tower::Service<http::Request<Body>> for Tracked<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let conn = request.extensions().get::<ConnInfo>();
        let guard = conn.map(|c| CallGuard::new(&c.calls));
        let missed = conn.map(|c| c.request_timeouts.clone());
        let timeout = self.request_timeout;
        let request = request.map(|body| {
            if http_body::Body::is_end_stream(&body) {
                body
            } else {
                Body::new(Deadlined {
                    body,
                    deadline: Box::pin(tokio::time::sleep(timeout)),
                    timeout,
                    missed,
                })
            }
        });
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await?;
            Ok(match guard {
                Some(guard) => response.map(|body| Body::new(Guarded::new(body, guard))),
                None => response,
            })
        })
    }
}

/// A request body that fails with DEADLINE_EXCEEDED unless it ends within `timeout` of the
/// call's start: what stops a client that sends its request a byte at a time (a gRPC server
/// reads the whole message, the HTTP API the whole body, before anything else).
struct Deadlined {
    body: Body,
    deadline: Pin<Box<tokio::time::Sleep>>,
    timeout: Duration,
    /// The listener's count, taken when the deadline passes (so counted once).
    missed: Option<Counter>,
}

impl http_body::Body for Deadlined {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, tonic::Status>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.body).poll_frame(cx) {
            return Poll::Ready(frame);
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => {
                if let Some(missed) = self.missed.take() {
                    missed.inc();
                }
                Poll::Ready(Some(Err(crate::status::request_too_slow(self.timeout))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// A response body that keeps its call counted until it is done or dropped, and tells the
/// connection while the server waits for the client to take its next frame.
struct Guarded {
    body: Body,
    id: u64,
    guard: CallGuard,
}

impl Guarded {
    fn new(body: Body, guard: CallGuard) -> Guarded {
        let mut s = guard.0.lock();
        let id = s.next_body;
        s.next_body += 1;
        // Returned, not yet asked for a frame: a client whose HTTP/2 window is 0 leaves it so.
        s.unread.insert(id, Instant::now());
        drop(s);
        Guarded { body, id, guard }
    }
}

impl http_body::Body for Guarded {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, tonic::Status>>> {
        let id = self.id;
        self.guard.0.lock().unread.remove(&id);
        let poll = Pin::new(&mut self.body).poll_frame(cx);
        if let Poll::Ready(Some(Ok(_))) = &poll {
            self.guard.0.lock().unread.insert(id, Instant::now());
        }
        poll
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        self.guard.0.lock().unread.remove(&self.id);
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
