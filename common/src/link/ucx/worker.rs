//! The UCX side of the link: safe owners of the UCP handles (context, worker, listener, endpoint)
//! and the progress thread that alone touches them.
//!
//! Why a thread: a UCP worker created with `UCS_THREAD_MODE_SINGLE` must only be used by one
//! thread, and UCX makes progress only when someone calls `ucp_worker_progress`. So every node
//! (one listener with its accepted connections, or one outgoing connection) runs one thread that
//! owns the worker; async callers talk to it through a command channel and tokio channels come
//! back. When idle it sleeps in `poll(2)` on the worker's event fd (armed with `ucp_worker_arm`)
//! and on a wake-up socket the callers write to, so an idle link costs no CPU.
//!
//! UCX callbacks (connection requests, active messages, completions, endpoint errors) only push an
//! [`Event`] onto a thread-local list; the loop handles the list after `ucp_worker_progress`
//! returns, so no callback re-enters UCX or the loop's state.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{CStr, CString, c_void};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::ptr;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use super::sys;
use super::wire::{Kind, WireHeader};
use super::{MemoryType, SendBuffer, UcxConfig};
use crate::link::{ChunkHeader, LatentChunk, LinkError};

/// The one active-message id the link registers; the wire header says what a message is.
const AM_ID: u32 = 0x4453; // "DS"
/// How long closing endpoints may take at shutdown before the worker is destroyed anyway.
const CLOSE_DEADLINE: Duration = Duration::from_secs(2);
/// Upper bound on one `poll(2)` sleep: a safety net only, the event fd wakes the thread.
const IDLE_POLL_MS: i32 = 1000;

/// `ucs_status_string(status)`.
pub(super) fn status_string(status: sys::ucs_status_t) -> String {
    // SAFETY: ucs_status_string returns a pointer to a static NUL-terminated string for any
    // status value (unknown ones map to a static "Unknown error").
    let s = unsafe { CStr::from_ptr(sys::ucs_status_string(status)) };
    s.to_string_lossy().into_owned()
}

fn check(what: impl FnOnce() -> String, status: sys::ucs_status_t) -> Result<(), LinkError> {
    if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(LinkError::Ucx {
            what: what(),
            status: status_string(status),
        })
    }
}

fn ucx_error(what: impl Into<String>, status: sys::ucs_status_t) -> LinkError {
    LinkError::Ucx {
        what: what.into(),
        status: status_string(status),
    }
}

// ---------------------------------------------------------------------------------------------
// Owners of the UCP handles.

/// A UCP context (`ucp_init`), cleaned up on drop. Must outlive its workers.
struct Context {
    handle: sys::ucp_context_h,
    /// Bitmap of `ucs_memory_type` values this UCX build can move (`UCP_ATTR_FIELD_MEMORY_TYPES`).
    memory_types: u64,
}

impl Context {
    fn new(config: &UcxConfig) -> Result<Context, LinkError> {
        let mut ucp_config: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: NULL prefix and file mean "UCX_ environment, default file"; the out pointer is
        // valid for one write.
        check(|| "ucp_config_read".into(), unsafe {
            sys::ucp_config_read(ptr::null(), ptr::null(), &mut ucp_config)
        })?;
        let result = Self::with_config(config, ucp_config);
        // SAFETY: ucp_config was returned by ucp_config_read above and is released exactly once;
        // ucp_init_version copied what it needs.
        unsafe { sys::ucp_config_release(ucp_config) };
        result
    }

    fn with_config(
        config: &UcxConfig,
        ucp_config: *mut sys::ucp_config_t,
    ) -> Result<Context, LinkError> {
        if let Some(tls) = &config.transports {
            let value = CString::new(tls.as_str())
                .map_err(|_| LinkError::Unsupported(format!("transports {tls:?} hold a NUL")))?;
            // SAFETY: ucp_config is a live config; both strings are NUL-terminated and only read.
            check(|| format!("ucp_config_modify TLS={tls}"), unsafe {
                sys::ucp_config_modify(ucp_config, c"TLS".as_ptr(), value.as_ptr())
            })?;
        }
        let params = sys::ucp_params_t {
            field_mask: (sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_NAME) as u64,
            features: (sys::UCP_FEATURE_AM | sys::UCP_FEATURE_WAKEUP) as u64,
            name: c"ditstream-latent-link".as_ptr(),
            ..Default::default()
        };
        let mut handle: sys::ucp_context_h = ptr::null_mut();
        // SAFETY: `ucp_init` is a static inline over ucp_init_version with the header's API
        // version; params and config are valid for the call, the out pointer for one write.
        check(|| "ucp_init".into(), unsafe {
            sys::ucp_init_version(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &params,
                ucp_config,
                &mut handle,
            )
        })?;
        let mut context = Context {
            handle,
            memory_types: 1 << sys::UCS_MEMORY_TYPE_HOST,
        };
        let mut attr = sys::ucp_context_attr_t {
            field_mask: sys::UCP_ATTR_FIELD_MEMORY_TYPES as u64,
            ..Default::default()
        };
        // SAFETY: the context is live; attr is a valid out struct with its field mask set.
        check(|| "ucp_context_query".into(), unsafe {
            sys::ucp_context_query(context.handle, &mut attr)
        })?;
        context.memory_types = attr.memory_types;
        Ok(context)
    }

    fn supports(&self, memory: MemoryType) -> bool {
        self.memory_types & (1 << memory.ucs()) != 0
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the handle came from ucp_init_version; every worker made from it was destroyed
        // before (the loop drops the worker first) and it is cleaned up once.
        unsafe { sys::ucp_cleanup(self.handle) };
    }
}

/// A UCP worker in single-thread mode with the link's active-message handler, destroyed on drop.
/// Lives on the progress thread only.
struct Worker {
    handle: sys::ucp_worker_h,
    event_fd: i32,
    max_am_header: usize,
}

impl Worker {
    fn new(context: &Context) -> Result<Worker, LinkError> {
        let params = sys::ucp_worker_params_t {
            field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut handle: sys::ucp_worker_h = ptr::null_mut();
        // SAFETY: the context is live; params valid for the call; out pointer valid.
        check(|| "ucp_worker_create".into(), unsafe {
            sys::ucp_worker_create(context.handle, &params, &mut handle)
        })?;
        let mut worker = Worker {
            handle,
            event_fd: -1,
            max_am_header: 0,
        };
        // SAFETY: the worker is live; the out pointer is valid. The fd stays owned by UCX.
        check(|| "ucp_worker_get_efd".into(), unsafe {
            sys::ucp_worker_get_efd(worker.handle, &mut worker.event_fd)
        })?;
        let mut attr = sys::ucp_worker_attr_t {
            field_mask: sys::UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER as u64,
            ..Default::default()
        };
        // SAFETY: live worker, valid out struct with its field mask set.
        check(|| "ucp_worker_query".into(), unsafe {
            sys::ucp_worker_query(worker.handle, &mut attr)
        })?;
        worker.max_am_header = attr.max_am_header;
        let handler = sys::ucp_am_handler_param_t {
            field_mask: (sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG) as u64,
            id: AM_ID,
            cb: Some(on_active_message),
            arg: ptr::null_mut(),
            ..Default::default()
        };
        // SAFETY: live worker; the callback is a plain function that only touches the
        // thread-local event list, valid for the worker's whole life.
        check(|| "ucp_worker_set_am_recv_handler".into(), unsafe {
            sys::ucp_worker_set_am_recv_handler(worker.handle, &handler)
        })?;
        Ok(worker)
    }

    /// One `ucp_worker_progress`; the number of events it handled.
    fn progress(&self) -> u32 {
        // SAFETY: live worker, called from its only thread and never from a callback.
        unsafe { sys::ucp_worker_progress(self.handle) }
    }

    /// Arms the event fd; false when there is more to progress first (`UCS_ERR_BUSY`).
    fn arm(&self) -> Result<bool, LinkError> {
        // SAFETY: live worker, its own thread.
        match unsafe { sys::ucp_worker_arm(self.handle) } {
            sys::UCS_OK => Ok(true),
            sys::UCS_ERR_BUSY => Ok(false),
            status => Err(ucx_error("ucp_worker_arm", status)),
        }
    }
}

/// Progresses `worker` until `request` completes or `deadline` passes, then frees it. For closes
/// only: it polls every 200 µs, fine for a bounded close, not for the data path.
fn wait_request(
    worker: sys::ucp_worker_h,
    request: sys::ucs_status_ptr_t,
    deadline: Instant,
) -> sys::ucs_status_t {
    if request.is_null() {
        return sys::UCS_OK;
    }
    if sys::ptr_is_err(request) {
        return sys::ptr_status(request);
    }
    let status = loop {
        // SAFETY: the worker is live (the endpoint being closed belongs to it) and this runs on
        // its thread, outside any callback.
        unsafe { sys::ucp_worker_progress(worker) };
        // SAFETY: request is a live request handle returned by a ucp_*_nbx call.
        let status = unsafe { sys::ucp_request_check_status(request) };
        if status != sys::UCS_INPROGRESS {
            break status;
        }
        if Instant::now() > deadline {
            break sys::UCS_ERR_TIMED_OUT;
        }
        std::thread::sleep(Duration::from_micros(200));
    };
    // SAFETY: the request is ours to release, once; UCX frees it when (if) it completes.
    unsafe { sys::ucp_request_free(request) };
    status
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: the handle came from ucp_worker_create; its listener and endpoints were
        // released before (the loop drops them first) and it is destroyed once.
        unsafe { sys::ucp_worker_destroy(self.handle) };
    }
}

/// A UCP listener accepting connection requests on a socket address; destroyed on drop.
struct Listener {
    handle: sys::ucp_listener_h,
    addr: SocketAddr,
}

impl Listener {
    fn new(worker: &Worker, addr: SocketAddr) -> Result<Listener, LinkError> {
        let (storage, len) = SockAddr::from(addr);
        let params = sys::ucp_listener_params_t {
            field_mask: (sys::UCP_LISTENER_PARAM_FIELD_SOCK_ADDR
                | sys::UCP_LISTENER_PARAM_FIELD_CONN_HANDLER) as u64,
            sockaddr: sys::ucs_sock_addr_t {
                addr: storage.as_ptr(),
                addrlen: len,
            },
            conn_handler: sys::ucp_listener_conn_handler_t {
                cb: Some(on_connection_request),
                arg: ptr::null_mut(),
            },
            ..Default::default()
        };
        let mut handle: sys::ucp_listener_h = ptr::null_mut();
        // SAFETY: live worker; params (and the sockaddr they point to) valid for the call.
        check(|| format!("ucp_listener_create on {addr}"), unsafe {
            sys::ucp_listener_create(worker.handle, &params, &mut handle)
        })?;
        let mut listener = Listener { handle, addr };
        let mut attr = sys::ucp_listener_attr_t {
            field_mask: sys::UCP_LISTENER_ATTR_FIELD_SOCKADDR as u64,
            ..Default::default()
        };
        // SAFETY: live listener; valid out struct with its field mask set.
        check(|| "ucp_listener_query".into(), unsafe {
            sys::ucp_listener_query(listener.handle, &mut attr)
        })?;
        listener.addr = SockAddr::parse(&attr.sockaddr).unwrap_or(addr);
        Ok(listener)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // SAFETY: the handle came from ucp_listener_create and is destroyed once, before its
        // worker.
        unsafe { sys::ucp_listener_destroy(self.handle) };
    }
}

/// A UCP endpoint: one side of a connection. Dropping it closes it — flushing outstanding sends
/// when the connection is healthy, forcibly once it failed (`failed`), with a bounded wait.
struct Endpoint {
    handle: sys::ucp_ep_h,
    worker: sys::ucp_worker_h,
    failed: bool,
}

impl Endpoint {
    /// A client endpoint to a listener at `addr` (`UCP_EP_PARAMS_FLAGS_CLIENT_SERVER`); the
    /// connection completes asynchronously, and failures arrive as [`Event::EndpointError`].
    fn connect(worker: &Worker, addr: SocketAddr, conn: u64) -> Result<Endpoint, LinkError> {
        let (storage, len) = SockAddr::from(addr);
        let params = sys::ucp_ep_params_t {
            field_mask: (sys::UCP_EP_PARAM_FIELD_FLAGS
                | sys::UCP_EP_PARAM_FIELD_SOCK_ADDR
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE) as u64,
            flags: sys::UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
            sockaddr: sys::ucs_sock_addr_t {
                addr: storage.as_ptr(),
                addrlen: len,
            },
            err_mode: sys::UCP_ERR_HANDLING_MODE_PEER,
            err_handler: error_handler(conn),
            ..Default::default()
        };
        Self::create(worker, &params, || format!("ucp_ep_create to {addr}"))
    }

    /// The server side of a connection request.
    fn accept(
        worker: &Worker,
        request: sys::ucp_conn_request_h,
        conn: u64,
    ) -> Result<Endpoint, LinkError> {
        let params = sys::ucp_ep_params_t {
            field_mask: (sys::UCP_EP_PARAM_FIELD_CONN_REQUEST
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE) as u64,
            conn_request: request,
            err_mode: sys::UCP_ERR_HANDLING_MODE_PEER,
            err_handler: error_handler(conn),
            ..Default::default()
        };
        Self::create(worker, &params, || {
            "ucp_ep_create for a connection request".into()
        })
    }

    fn create(
        worker: &Worker,
        params: &sys::ucp_ep_params_t,
        what: impl FnOnce() -> String,
    ) -> Result<Endpoint, LinkError> {
        let mut handle: sys::ucp_ep_h = ptr::null_mut();
        // SAFETY: live worker; params (and any sockaddr they point to) valid for the call; a
        // connection request is consumed by this call whether it succeeds or not.
        check(what, unsafe {
            sys::ucp_ep_create(worker.handle, params, &mut handle)
        })?;
        Ok(Endpoint {
            handle,
            worker: worker.handle,
            failed: false,
        })
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // A forced close is only valid in error mode PEER (ours); on a healthy endpoint flush so
        // the last sends reach the peer.
        let params = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: if self.failed {
                sys::UCP_EP_CLOSE_FLAG_FORCE
            } else {
                0
            },
            ..Default::default()
        };
        // SAFETY: the endpoint is live (closed once, here) and its worker outlives it.
        let request = unsafe { sys::ucp_ep_close_nbx(self.handle, &params) };
        let status = wait_request(self.worker, request, Instant::now() + CLOSE_DEADLINE);
        if status != sys::UCS_OK && !self.failed {
            tracing::debug!(status = %status_string(status), "UCX endpoint close");
        }
    }
}

fn error_handler(conn: u64) -> sys::ucp_err_handler_t {
    sys::ucp_err_handler_t {
        cb: Some(on_endpoint_error),
        arg: conn as usize as *mut c_void,
    }
}

/// A socket address in the C layout UCX reads.
struct SockAddr(libc::sockaddr_storage);

impl SockAddr {
    fn from(addr: SocketAddr) -> (SockAddr, u32) {
        // SAFETY: sockaddr_storage is plain old data; all-zero is a valid (unspecified) value.
        let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let len = match addr {
            SocketAddr::V4(a) => {
                let sin = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: a.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from_ne_bytes(a.ip().octets()),
                    },
                    sin_zero: [0; 8],
                };
                // SAFETY: sockaddr_storage is larger than and aligned for every sockaddr_*.
                unsafe { ptr::write(ptr::from_mut(&mut storage).cast(), sin) };
                size_of::<libc::sockaddr_in>()
            }
            SocketAddr::V6(a) => {
                let sin6 = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: a.port().to_be(),
                    sin6_flowinfo: a.flowinfo(),
                    sin6_addr: libc::in6_addr {
                        s6_addr: a.ip().octets(),
                    },
                    sin6_scope_id: a.scope_id(),
                };
                // SAFETY: as above.
                unsafe { ptr::write(ptr::from_mut(&mut storage).cast(), sin6) };
                size_of::<libc::sockaddr_in6>()
            }
        };
        (SockAddr(storage), len as u32)
    }

    fn as_ptr(&self) -> *const sys::sockaddr {
        ptr::from_ref(&self.0).cast()
    }

    /// The address UCX wrote into a `sockaddr_storage` (IPv4 or IPv6 only).
    fn parse(storage: &sys::sockaddr_storage) -> Option<SocketAddr> {
        let raw: *const libc::sockaddr_storage = ptr::from_ref(storage).cast();
        // SAFETY: bindgen's and libc's sockaddr_storage are the same C struct (128 bytes, same
        // alignment); the family field says which sockaddr_* UCX wrote.
        unsafe {
            match (*raw).ss_family as i32 {
                libc::AF_INET => {
                    let sin = &*raw.cast::<libc::sockaddr_in>();
                    let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
                    Some(SocketAddrV4::new(ip, u16::from_be(sin.sin_port)).into())
                }
                libc::AF_INET6 => {
                    let sin6 = &*raw.cast::<libc::sockaddr_in6>();
                    let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                    Some(
                        SocketAddrV6::new(
                            ip,
                            u16::from_be(sin6.sin6_port),
                            sin6.sin6_flowinfo,
                            sin6.sin6_scope_id,
                        )
                        .into(),
                    )
                }
                _ => None,
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Callbacks: they record, the loop acts.

/// What a callback saw.
enum Event {
    ConnectionRequest(sys::ucp_conn_request_h),
    ActiveMessage {
        reply_ep: sys::ucp_ep_h,
        header: Vec<u8>,
        data: AmData,
    },
    OpDone {
        op: u64,
        status: sys::ucs_status_t,
    },
    EndpointError {
        conn: u64,
        status: sys::ucs_status_t,
    },
}

/// An active message's payload: copied when it came eagerly, a descriptor to fetch with
/// `ucp_am_recv_data_nbx` when it comes by rendezvous (large payloads).
enum AmData {
    Eager(Vec<u8>),
    Rendezvous { desc: *mut c_void, len: usize },
}

thread_local! {
    /// Events recorded by callbacks on this progress thread since the loop last looked.
    static EVENTS: RefCell<Vec<Event>> = const { RefCell::new(Vec::new()) };
}

fn record(event: Event) {
    EVENTS.with(|events| events.borrow_mut().push(event));
}

fn take_events() -> Vec<Event> {
    EVENTS.with(|events| std::mem::take(&mut *events.borrow_mut()))
}

unsafe extern "C" fn on_connection_request(request: sys::ucp_conn_request_h, _arg: *mut c_void) {
    record(Event::ConnectionRequest(request));
}

unsafe extern "C" fn on_endpoint_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: i8) {
    record(Event::EndpointError {
        conn: arg as usize as u64,
        status,
    });
}

unsafe extern "C" fn on_active_message(
    _arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: UCX passes a valid param for the duration of the callback.
    let param = unsafe { &*param };
    let header = if header_length == 0 {
        Vec::new()
    } else {
        // SAFETY: UCX guarantees `header_length` readable bytes at `header` during the callback.
        unsafe { std::slice::from_raw_parts(header.cast::<u8>(), header_length) }.to_vec()
    };
    let reply_ep = if param.recv_attr & sys::UCP_AM_RECV_ATTR_FIELD_REPLY_EP as u64 != 0 {
        param.reply_ep
    } else {
        ptr::null_mut()
    };
    let rendezvous = param.recv_attr & sys::UCP_AM_RECV_ATTR_FLAG_RNDV as u64 != 0;
    let (data, status) = if rendezvous {
        // Keep the descriptor past the callback: the loop posts ucp_am_recv_data_nbx for it.
        (
            AmData::Rendezvous {
                desc: data,
                len: length,
            },
            sys::UCS_INPROGRESS,
        )
    } else if length == 0 {
        (AmData::Eager(Vec::new()), sys::UCS_OK)
    } else {
        // SAFETY: eager data: `length` readable bytes at `data` during the callback.
        let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length) }.to_vec();
        (AmData::Eager(bytes), sys::UCS_OK)
    };
    record(Event::ActiveMessage {
        reply_ep,
        header,
        data,
    });
    status
}

unsafe extern "C" fn on_send_done(request: *mut c_void, status: i8, user_data: *mut c_void) {
    record(Event::OpDone {
        op: user_data as usize as u64,
        status,
    });
    // SAFETY: the request completed (this is its completion callback) and is released once.
    unsafe { sys::ucp_request_free(request) };
}

unsafe extern "C" fn on_recv_done(
    request: *mut c_void,
    status: i8,
    _length: usize,
    user_data: *mut c_void,
) {
    record(Event::OpDone {
        op: user_data as usize as u64,
        status,
    });
    // SAFETY: as in on_send_done.
    unsafe { sys::ucp_request_free(request) };
}

// ---------------------------------------------------------------------------------------------
// What callers send to the thread and get back.

/// One item of a request stream as the receiver sees it.
pub(super) enum StreamItem {
    Chunk(Result<LatentChunk, LinkError>),
    /// The sender finished the stream; nothing follows.
    End,
}

/// A request stream the peer opened.
pub(super) struct IncomingStream {
    pub(super) id: u32,
    pub(super) items: mpsc::UnboundedReceiver<StreamItem>,
}

/// A connection the thread set up: its id and where its incoming request streams arrive
/// (`Err` once it failed; closed after the peer said goodbye).
pub(super) struct ConnHandle {
    pub(super) id: u64,
    pub(super) peer: SocketAddr,
    pub(super) incoming: mpsc::UnboundedReceiver<Result<IncomingStream, LinkError>>,
}

type Done = oneshot::Sender<Result<(), LinkError>>;

pub(super) enum Command {
    Listen {
        addr: SocketAddr,
        reply: std_mpsc::SyncSender<Result<SocketAddr, LinkError>>,
        accepted: mpsc::UnboundedSender<Result<ConnHandle, LinkError>>,
    },
    Connect {
        addr: SocketAddr,
        reply: oneshot::Sender<Result<ConnHandle, LinkError>>,
    },
    Send {
        conn: u64,
        header: WireHeader,
        payload: Option<Box<dyn SendBuffer>>,
        done: Option<Done>,
    },
    Close {
        conn: u64,
        done: Option<Done>,
    },
}

/// The caller's end of a progress thread; the thread shuts down (closing its endpoints) when
/// the last `Node` is dropped.
pub(super) struct Node {
    commands: std_mpsc::Sender<Command>,
    wake: UnixStream,
    memory_types: u64,
}

impl Node {
    /// Starts a progress thread with a fresh context and worker.
    pub(super) fn start(config: &UcxConfig) -> Result<Node, LinkError> {
        let (commands, command_rx) = std_mpsc::channel();
        let (wake, wake_rx) = UnixStream::pair()?;
        wake.set_nonblocking(true)?;
        wake_rx.set_nonblocking(true)?;
        let (ready_tx, ready_rx) = std_mpsc::sync_channel(1);
        let config = config.clone();
        std::thread::Builder::new()
            .name("ucx-link".into())
            .spawn(move || {
                let state = Context::new(&config).and_then(|context| {
                    let worker = Worker::new(&context)?;
                    Ok((context, worker))
                });
                match state {
                    Ok((context, worker)) => {
                        let _ = ready_tx.send(Ok(context.memory_types));
                        Loop::new(context, worker, command_rx, wake_rx).run();
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })?;
        let memory_types = ready_rx
            .recv()
            .map_err(|_| LinkError::Transport("the UCX progress thread died at start".into()))??;
        Ok(Node {
            commands,
            wake,
            memory_types,
        })
    }

    pub(super) fn submit(&self, command: Command) -> Result<(), LinkError> {
        self.commands
            .send(command)
            .map_err(|_| LinkError::Transport("the UCX progress thread is gone".into()))?;
        // A full socket means a wake-up is already pending.
        let _ = (&self.wake).write(&[1]);
        Ok(())
    }

    pub(super) fn supports(&self, memory: MemoryType) -> bool {
        self.memory_types & (1 << memory.ucs()) != 0
    }
}

// ---------------------------------------------------------------------------------------------
// The progress loop.

/// A request stream arriving from the peer.
struct InStream {
    items: mpsc::UnboundedSender<StreamItem>,
    /// Next chunk index to hand over; later ones wait in `pending`.
    next: u32,
    pending: BTreeMap<u32, Result<LatentChunk, LinkError>>,
    /// Number of chunks, once the FIN arrived.
    end: Option<u32>,
}

struct Conn {
    /// Dropped (closing the UCX endpoint) when the connection is closed.
    ep: Option<Endpoint>,
    peer: SocketAddr,
    incoming: Option<mpsc::UnboundedSender<Result<IncomingStream, LinkError>>>,
    streams: HashMap<u32, InStream>,
    finished: HashSet<u32>,
    /// The connecting side's answer, sent when the server's HELLO_ACK arrives.
    connecting: Option<(oneshot::Sender<Result<ConnHandle, LinkError>>, ConnHandle)>,
    /// Why sends fail from now on.
    dead: Option<LinkError>,
    /// The peer said goodbye: its endpoint error that follows is the close, not a failure.
    peer_closed: bool,
}

enum Op {
    Send {
        // Both stay alive until UCX is done reading them.
        _header: Vec<u8>,
        _payload: Option<Box<dyn SendBuffer>>,
        done: Option<Done>,
        then_close: Option<u64>,
    },
    Recv {
        conn: u64,
        stream: u32,
        seq: u32,
        header: ChunkHeader,
        /// Capacity `len`, length 0 until the receive completed.
        buf: Vec<u8>,
        len: usize,
    },
}

struct Loop {
    // Field order is drop order: endpoints, listener, worker, context, then the buffers UCX may
    // still have been using.
    conns: HashMap<u64, Conn>,
    listener: Option<Listener>,
    worker: Worker,
    context: Context,
    ops: HashMap<u64, Op>,
    ep_conn: HashMap<usize, u64>,
    accepted: Option<mpsc::UnboundedSender<Result<ConnHandle, LinkError>>>,
    commands: std_mpsc::Receiver<Command>,
    wake: UnixStream,
    next_op: u64,
    next_conn: u64,
}

impl Loop {
    fn new(
        context: Context,
        worker: Worker,
        commands: std_mpsc::Receiver<Command>,
        wake: UnixStream,
    ) -> Loop {
        Loop {
            conns: HashMap::new(),
            listener: None,
            worker,
            context,
            ops: HashMap::new(),
            ep_conn: HashMap::new(),
            accepted: None,
            commands,
            wake,
            next_op: 1,
            next_conn: 1,
        }
    }

    fn run(mut self) {
        loop {
            loop {
                match self.commands.try_recv() {
                    Ok(command) => self.command(command),
                    Err(std_mpsc::TryRecvError::Empty) => break,
                    Err(std_mpsc::TryRecvError::Disconnected) => return self.shutdown(),
                }
            }
            while self.worker.progress() > 0 {}
            let events = take_events();
            if !events.is_empty() {
                for event in events {
                    self.event(event);
                }
                continue;
            }
            match self.worker.arm() {
                Ok(true) => self.sleep(),
                Ok(false) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "UCX link: cannot arm the worker; polling");
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }

    /// Sleeps until the worker has events or a caller sent a command.
    fn sleep(&mut self) {
        let mut fds = [
            libc::pollfd {
                fd: self.worker.event_fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: fds is a valid array of two pollfd for the duration of the call.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, IDLE_POLL_MS) };
        let mut sink = [0u8; 64];
        while matches!((&self.wake).read(&mut sink), Ok(n) if n > 0) {}
    }

    fn shutdown(mut self) {
        self.listener = None;
        // Closing flushes (or forces) each endpoint with a bounded wait (Endpoint's Drop).
        for (_, conn) in self.conns.drain() {
            drop(conn);
        }
        take_events();
        // The remaining fields drop in declaration order: worker, context, then the buffers of
        // operations that never completed (UCX no longer touches them once the worker is gone).
    }

    fn op_id(&mut self) -> u64 {
        let id = self.next_op;
        self.next_op += 1;
        id
    }

    fn command(&mut self, command: Command) {
        match command {
            Command::Listen {
                addr,
                reply,
                accepted,
            } => {
                let result = Listener::new(&self.worker, addr).map(|listener| {
                    let bound = listener.addr;
                    self.listener = Some(listener);
                    self.accepted = Some(accepted);
                    bound
                });
                let _ = reply.send(result);
            }
            Command::Connect { addr, reply } => {
                let id = self.next_conn;
                self.next_conn += 1;
                match Endpoint::connect(&self.worker, addr, id) {
                    Ok(ep) => {
                        let (incoming_tx, incoming) = mpsc::unbounded_channel();
                        self.ep_conn.insert(ep.handle as usize, id);
                        let handle = ConnHandle {
                            id,
                            peer: addr,
                            incoming,
                        };
                        self.conns.insert(id, Conn::new(ep, addr, incoming_tx));
                        if let Some(conn) = self.conns.get_mut(&id) {
                            conn.connecting = Some((reply, handle));
                        }
                        self.send(id, WireHeader::new(Kind::Hello, 0, 0), None, None, None);
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                }
            }
            Command::Send {
                conn,
                header,
                payload,
                done,
            } => self.send(conn, header, payload, done, None),
            Command::Close { conn, done } => {
                let healthy = self
                    .conns
                    .get(&conn)
                    .is_some_and(|c| c.dead.is_none() && c.connecting.is_none());
                if healthy {
                    // Say goodbye first so the peer tells a close from a crash; close after.
                    self.send(
                        conn,
                        WireHeader::new(Kind::Bye, 0, 0),
                        None,
                        done,
                        Some(conn),
                    );
                } else {
                    self.close(conn);
                    if let Some(done) = done {
                        let _ = done.send(Ok(()));
                    }
                }
            }
        }
    }

    /// Posts one active message on `conn`; `done` learns the outcome; `then_close` closes the
    /// connection once it completed.
    fn send(
        &mut self,
        conn: u64,
        header: WireHeader,
        payload: Option<Box<dyn SendBuffer>>,
        done: Option<Done>,
        then_close: Option<u64>,
    ) {
        let fail = |done: Option<Done>, e: LinkError| {
            if let Some(done) = done {
                let _ = done.send(Err(e));
            }
        };
        let Some(c) = self.conns.get(&conn) else {
            return fail(
                done,
                LinkError::Transport("the connection is closed".into()),
            );
        };
        if let Some(e) = &c.dead {
            return fail(done, LinkError::Transport(e.to_string()));
        }
        let Some(ep) = c.ep.as_ref().map(|ep| ep.handle) else {
            return fail(
                done,
                LinkError::Transport("the connection is closed".into()),
            );
        };
        let header = header.encode();
        if header.len() > self.worker.max_am_header {
            return fail(
                done,
                LinkError::Unsupported(format!(
                    "a {}-byte chunk header exceeds UCX's active-message header limit of {} bytes",
                    header.len(),
                    self.worker.max_am_header
                )),
            );
        }
        let memory = payload
            .as_ref()
            .map_or(MemoryType::Host, |p| p.memory_type());
        if !self.context.supports(memory) {
            return fail(
                done,
                LinkError::Unsupported(format!(
                    "{memory:?} memory: this UCX build has no transport for it (Debian's libucx is built without CUDA)"
                )),
            );
        }
        let op = self.op_id();
        let (ptr, len) = payload
            .as_ref()
            .map_or((ptr::null(), 0), |p| (p.as_ptr(), p.len()));
        let params = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK
                | sys::UCP_OP_ATTR_FIELD_USER_DATA
                | sys::UCP_OP_ATTR_FIELD_FLAGS
                | sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE,
            // The receiver maps messages to connections through the reply endpoint.
            flags: sys::UCP_AM_SEND_FLAG_REPLY,
            cb: sys::ucp_request_param_t__bindgen_ty_1 {
                send: Some(on_send_done),
            },
            user_data: op as usize as *mut c_void,
            memory_type: memory.ucs(),
            ..Default::default()
        };
        // SAFETY: the endpoint is live; header and payload are kept alive in `self.ops` until
        // the completion (or the worker's destruction); params valid for the call.
        let request = unsafe {
            sys::ucp_am_send_nbx(
                ep,
                AM_ID,
                header.as_ptr().cast(),
                header.len(),
                ptr.cast(),
                len,
                &params,
            )
        };
        self.ops.insert(
            op,
            Op::Send {
                _header: header,
                _payload: payload,
                done,
                then_close,
            },
        );
        self.posted(op, request);
    }

    /// Handles what a `ucp_*_nbx` call returned: done now, failed now, or later by callback.
    fn posted(&mut self, op: u64, request: sys::ucs_status_ptr_t) {
        if request.is_null() {
            self.op_done(op, sys::UCS_OK);
        } else if sys::ptr_is_err(request) {
            self.op_done(op, sys::ptr_status(request));
        }
    }

    fn op_done(&mut self, op: u64, status: sys::ucs_status_t) {
        match self.ops.remove(&op) {
            Some(Op::Send {
                done, then_close, ..
            }) => {
                if let Some(done) = done {
                    let _ = done.send(check(|| "ucp_am_send_nbx".into(), status));
                }
                if let Some(conn) = then_close {
                    self.close(conn);
                }
            }
            Some(Op::Recv {
                conn,
                stream,
                seq,
                header,
                buf,
                len,
            }) => {
                let chunk = if status == sys::UCS_OK {
                    let mut buf = buf;
                    // SAFETY: the capacity is at least `len`, and the receive completed
                    // successfully, so UCX wrote all `len` bytes (the announced length).
                    unsafe { buf.set_len(len) };
                    let chunk = LatentChunk {
                        header,
                        payload: buf,
                    };
                    chunk.verify().map(|()| chunk)
                } else {
                    Err(ucx_error(
                        format!("ucp_am_recv_data_nbx for chunk {seq} of stream {stream}"),
                        status,
                    ))
                };
                self.deliver(conn, stream, seq, chunk);
            }
            None => {}
        }
    }

    fn close(&mut self, conn: u64) {
        if let Some(c) = self.conns.remove(&conn) {
            if let Some(ep) = &c.ep {
                self.ep_conn.remove(&(ep.handle as usize));
            }
            drop(c);
        }
    }

    fn event(&mut self, event: Event) {
        match event {
            Event::ConnectionRequest(request) => self.accept(request),
            Event::ActiveMessage {
                reply_ep,
                header,
                data,
            } => self.message(reply_ep, &header, data),
            Event::OpDone { op, status } => self.op_done(op, status),
            Event::EndpointError { conn, status } => self.endpoint_error(conn, status),
        }
    }

    fn accept(&mut self, request: sys::ucp_conn_request_h) {
        let Some(accepted) = self.accepted.clone() else {
            return;
        };
        let mut attr = sys::ucp_conn_request_attr_t {
            field_mask: sys::UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR as u64,
            ..Default::default()
        };
        // SAFETY: a live connection request from the listener callback, queried before use.
        let peer = if unsafe { sys::ucp_conn_request_query(request, &mut attr) } == sys::UCS_OK {
            SockAddr::parse(&attr.client_address)
        } else {
            None
        }
        .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        let id = self.next_conn;
        self.next_conn += 1;
        match Endpoint::accept(&self.worker, request, id) {
            Ok(ep) => {
                let (incoming_tx, incoming) = mpsc::unbounded_channel();
                self.ep_conn.insert(ep.handle as usize, id);
                self.conns.insert(id, Conn::new(ep, peer, incoming_tx));
                let _ = accepted.send(Ok(ConnHandle { id, peer, incoming }));
            }
            Err(e) => {
                let _ = accepted.send(Err(e));
            }
        }
    }

    fn endpoint_error(&mut self, conn: u64, status: sys::ucs_status_t) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if let Some(ep) = c.ep.as_mut() {
            ep.failed = true;
        }
        let error = if c.peer_closed {
            LinkError::Transport(format!("the peer at {} closed the connection", c.peer))
        } else {
            ucx_error(format!("connection to {}", c.peer), status)
        };
        c.fail(&error);
        c.dead = Some(error);
    }

    fn message(&mut self, reply_ep: sys::ucp_ep_h, header: &[u8], data: AmData) {
        let conn = self.ep_conn.get(&(reply_ep as usize)).copied();
        let wire = match (conn, WireHeader::decode(header)) {
            (Some(conn), Ok(wire)) => (conn, wire),
            (conn, parsed) => {
                // Not ours or not parseable: drop the payload and, where the connection is
                // known, fail it (a peer speaking garbage cannot be trusted with later chunks).
                self.release(data);
                let reason = parsed.err().unwrap_or_else(|| {
                    LinkError::Malformed("a message on an unknown endpoint".into())
                });
                tracing::warn!(error = %reason, "UCX link: dropped a message");
                if let Some(c) = conn.and_then(|id| self.conns.get_mut(&id)) {
                    c.fail(&reason);
                    c.dead = Some(reason);
                }
                return;
            }
        };
        let (conn, wire) = wire;
        match wire.kind {
            Kind::Hello => {
                self.release(data);
                self.send(
                    conn,
                    WireHeader::new(Kind::HelloAck, 0, 0),
                    None,
                    None,
                    None,
                );
            }
            Kind::HelloAck => {
                self.release(data);
                if let Some((reply, handle)) =
                    self.conns.get_mut(&conn).and_then(|c| c.connecting.take())
                {
                    let _ = reply.send(Ok(handle));
                }
            }
            Kind::Bye => {
                self.release(data);
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.peer_closed = true;
                    let error = LinkError::Transport(format!(
                        "the peer at {} closed the connection before the request's last chunk",
                        c.peer
                    ));
                    for (_, s) in c.streams.drain() {
                        let _ = s.items.send(StreamItem::Chunk(Err(error.copy())));
                    }
                    c.incoming = None;
                }
            }
            Kind::Fin => {
                self.release(data);
                if let Some(s) = self.stream(conn, wire.stream) {
                    s.end = Some(wire.seq);
                }
                self.deliver_ready(conn, wire.stream);
            }
            Kind::Abort => {
                self.release(data);
                let error = LinkError::Transport(format!(
                    "the sender abandoned request stream {} after {} chunks",
                    wire.stream, wire.seq
                ));
                self.deliver(conn, wire.stream, u32::MAX, Err(error));
            }
            Kind::Chunk => {
                let header = match ChunkHeader::decode(&wire.rest) {
                    Ok(h) => h,
                    Err(e) => {
                        self.release(data);
                        return self.deliver(conn, wire.stream, wire.seq, Err(e));
                    }
                };
                match data {
                    AmData::Eager(payload) => {
                        let chunk = LatentChunk { header, payload };
                        let chunk = chunk.verify().map(|()| chunk);
                        self.deliver(conn, wire.stream, wire.seq, chunk);
                    }
                    AmData::Rendezvous { desc, len } => {
                        self.fetch(conn, wire.stream, wire.seq, header, desc, len)
                    }
                }
            }
        }
    }

    /// Lets go of a message's payload the loop does not want.
    fn release(&self, data: AmData) {
        if let AmData::Rendezvous { desc, .. } = data {
            // SAFETY: the descriptor was kept for us (the callback returned UCS_INPROGRESS) and
            // is released once; the sender's send completes.
            unsafe { sys::ucp_am_data_release(self.worker.handle, desc) };
        }
    }

    /// Posts the rendezvous receive of a chunk's payload into a fresh host buffer.
    fn fetch(
        &mut self,
        conn: u64,
        stream: u32,
        seq: u32,
        header: ChunkHeader,
        desc: *mut c_void,
        len: usize,
    ) {
        if len as u64 > crate::link::MAX_PAYLOAD_BYTES {
            self.release(AmData::Rendezvous { desc, len });
            let e = LinkError::Malformed(format!(
                "payload of {len} bytes exceeds {}",
                crate::link::MAX_PAYLOAD_BYTES
            ));
            return self.deliver(conn, stream, seq, Err(e));
        }
        // Not zeroed: UCX writes every byte before the buffer is read (see op_done), and zeroing
        // 16 MiB costs as much as receiving it.
        let mut buf = Vec::<u8>::with_capacity(len);
        let op = self.op_id();
        let params = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK
                | sys::UCP_OP_ATTR_FIELD_USER_DATA
                | sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE,
            cb: sys::ucp_request_param_t__bindgen_ty_1 {
                recv_am: Some(on_recv_done),
            },
            user_data: op as usize as *mut c_void,
            memory_type: MemoryType::Host.ucs(),
            ..Default::default()
        };
        // SAFETY: desc is a rendezvous descriptor we kept (UCX owns it from here, even on
        // failure); buf holds `len` writable bytes and lives in `self.ops` (its heap storage
        // does not move) until completion or the worker's destruction.
        let request = unsafe {
            sys::ucp_am_recv_data_nbx(
                self.worker.handle,
                desc,
                buf.as_mut_ptr().cast(),
                len,
                &params,
            )
        };
        self.ops.insert(
            op,
            Op::Recv {
                conn,
                stream,
                seq,
                header,
                buf,
                len,
            },
        );
        self.posted(op, request);
    }

    /// The stream `id` of `conn`, created (and announced to the receiver) on first sight.
    fn stream(&mut self, conn: u64, id: u32) -> Option<&mut InStream> {
        let c = self.conns.get_mut(&conn)?;
        if c.finished.contains(&id) {
            return None;
        }
        if !c.streams.contains_key(&id) {
            let incoming = c.incoming.as_ref()?;
            let (items, rx) = mpsc::unbounded_channel();
            let _ = incoming.send(Ok(IncomingStream { id, items: rx }));
            c.streams.insert(
                id,
                InStream {
                    items,
                    next: 0,
                    pending: BTreeMap::new(),
                    end: None,
                },
            );
        }
        c.streams.get_mut(&id)
    }

    /// Places chunk `seq` of a stream and hands over what is now in order. An error with
    /// `seq == u32::MAX` ends the stream at once.
    fn deliver(&mut self, conn: u64, stream: u32, seq: u32, chunk: Result<LatentChunk, LinkError>) {
        let Some(s) = self.stream(conn, stream) else {
            return;
        };
        if seq == u32::MAX {
            let _ = s.items.send(StreamItem::Chunk(chunk));
            if let Some(c) = self.conns.get_mut(&conn) {
                c.streams.remove(&stream);
                c.finished.insert(stream);
            }
            return;
        }
        s.pending.insert(seq, chunk);
        self.deliver_ready(conn, stream);
    }

    fn deliver_ready(&mut self, conn: u64, stream: u32) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let Some(s) = c.streams.get_mut(&stream) else {
            return;
        };
        while let Some(chunk) = s.pending.remove(&s.next) {
            let _ = s.items.send(StreamItem::Chunk(chunk));
            s.next += 1;
        }
        if s.end == Some(s.next) {
            let _ = s.items.send(StreamItem::End);
            c.streams.remove(&stream);
            c.finished.insert(stream);
        }
    }
}

impl Conn {
    fn new(
        ep: Endpoint,
        peer: SocketAddr,
        incoming: mpsc::UnboundedSender<Result<IncomingStream, LinkError>>,
    ) -> Conn {
        Conn {
            ep: Some(ep),
            peer,
            incoming: Some(incoming),
            streams: HashMap::new(),
            finished: HashSet::new(),
            connecting: None,
            dead: None,
            peer_closed: false,
        }
    }

    /// Ends everything waiting on this connection with `error`.
    fn fail(&mut self, error: &LinkError) {
        if let Some((reply, _)) = self.connecting.take() {
            let _ = reply.send(Err(error.copy()));
        }
        for (_, s) in self.streams.drain() {
            let _ = s.items.send(StreamItem::Chunk(Err(error.copy())));
        }
        if let Some(incoming) = self.incoming.take()
            && !self.peer_closed
        {
            let _ = incoming.send(Err(error.copy()));
        }
    }
}

/// The same error again, for a second listener (`LinkError` holds text, not sources).
trait CopyError {
    fn copy(&self) -> LinkError;
}

impl CopyError for LinkError {
    fn copy(&self) -> LinkError {
        match self {
            LinkError::Ucx { what, status } => LinkError::Ucx {
                what: what.clone(),
                status: status.clone(),
            },
            LinkError::Malformed(m) => LinkError::Malformed(m.clone()),
            LinkError::Unsupported(m) => LinkError::Unsupported(m.clone()),
            other => LinkError::Transport(
                other
                    .to_string()
                    .trim_start_matches("latent link: ")
                    .to_string(),
            ),
        }
    }
}
