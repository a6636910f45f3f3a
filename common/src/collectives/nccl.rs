//! The NCCL collective backend (feature `cuda`), through cudarc's `nccl` and `driver` layers:
//! one thread per GPU, one rank per thread.
//!
//! Start-up: one rank makes an [`NcclId`] and shares it (in-process: [`NcclWorld::run_local`]
//! does it all; across processes: through [`crate::rendezvous`]); each rank calls
//! [`NcclWorld::init`] (`ncclCommInitRank`) with its device; [`CommWorld::split`]
//! (`ncclCommSplit`, collective over the world) makes one [`NcclComm`] per mesh group.
//!
//! Streams: every communicator of a rank runs on that rank's single communication stream
//! ([`NcclWorld::stream`]); one stream per rank keeps the ranks' NCCL calls in one order, which
//! is what avoids cross-communicator deadlocks, and makes buffers from [`Communicator::alloc`]
//! safe to use on any communicator of the rank. Event tracking is off on the context
//! (`disable_event_tracking`): buffers written on *another* stream must be complete (or ordered
//! by an event) before they are passed here.
//!
//! No hangs: after enqueueing, every operation polls `cuStreamQuery` and
//! `ncclCommGetAsyncError` until the stream is done, an error appears, or the timeout passes;
//! then it calls `ncclCommAbort` and returns an error (the communicator is unusable afterwards,
//! and the peers' own operations time out or fail the same way). Initialisation and splits,
//! which block inside NCCL until every rank arrives, run on a helper thread that is abandoned
//! on timeout. A missing `libcuda`/`libnccl` is an error ([`probe`]), not a panic. The one
//! exception is [`NcclComm::post_p2p`], which only queues (the parallel VAE's stream-ordered halos):
//! its wait, and so its timeout, comes at the communicator's next operation.
//!
//! Memory: buffers come from each device's default memory pool (`cuMemAllocAsync`), which
//! [`NcclWorld::init`] shares with the peer GPUs (`cuMemPoolSetAccess`): ranks of one process
//! use NCCL's P2P "direct pointer" transport, where the peer GPU accesses our buffers itself.

use std::cell::RefCell;
use std::ffi::{CStr, c_void};
use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self as cu, CUresult};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::result as nccl_result;
use cudarc::nccl::sys::{self as nccl, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t};

use super::{
    CollectiveError, CommWorld, Communicator, DEFAULT_TIMEOUT, DType, Element, Pending, ReduceOp,
    Result, check, locate_in_groups, prefix_offsets,
};

/// [`NcclComm`]'s waits: queries of the stream back to back before pacing starts.
const FAST_POLLS: u32 = 32;
/// [`NcclComm`]'s waits: the host's pause between two paced queries of the stream.
const POLL_GAP: Duration = Duration::from_micros(5);
/// [`NcclComm`]'s waits: how long a wait polls (paced) before it sleeps between queries.
const SPIN_PHASE: Duration = Duration::from_millis(20);

/// `NCCL_SPLIT_NOCOLOR` from nccl.h: the rank joins no new communicator.
const NCCL_SPLIT_NOCOLOR: i32 = -1;

/// Checks that the CUDA driver library and NCCL can be loaded (cudarc would panic on first use
/// otherwise). Cheap; call it before anything else CUDA.
pub fn probe() -> Result<()> {
    // SAFETY: is_culib_present only tries to dlopen the candidate names and drops the handles.
    if !unsafe { cu::is_culib_present() } {
        return Err(CollectiveError::LibraryMissing {
            library: "libcuda.so",
            detail: format!("tried {:?}", cudarc::get_lib_name_candidates("cuda")),
        });
    }
    // SAFETY: as above.
    if !unsafe { nccl::is_culib_present() } {
        return Err(CollectiveError::LibraryMissing {
            library: "libnccl.so",
            detail: format!(
                "tried {:?}; cudarc never tries libnccl.so.2, symlink it as libnccl.so",
                cudarc::get_lib_name_candidates("nccl")
            ),
        });
    }
    Ok(())
}

/// Number of visible CUDA devices (0 when the driver loads but sees none).
pub fn device_count() -> Result<usize> {
    probe()?;
    let n = catch("cuDeviceGetCount", CudaContext::device_count)?
        .map_err(|e| cuda_err("cuDeviceGetCount", e))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Runs `f`, turning a panic inside cudarc (a missing symbol in an old library) into an error.
fn catch<R>(call: &'static str, f: impl FnOnce() -> R) -> Result<R> {
    std::panic::catch_unwind(AssertUnwindSafe(f)).map_err(|p| CollectiveError::Cuda {
        call,
        detail: format!(
            "panicked in cudarc: {}",
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_string()))
                .unwrap_or_default()
        ),
    })
}

fn cuda_err(call: &'static str, e: impl std::fmt::Debug) -> CollectiveError {
    CollectiveError::Cuda {
        call,
        detail: format!("{e:?}"),
    }
}

/// NCCL's name and message for a result code, plus the communicator's last error text.
fn nccl_detail(code: ncclResult_t, comm: Option<ncclComm_t>) -> String {
    // SAFETY: ncclGetErrorString returns a static C string for any code.
    let what = unsafe { CStr::from_ptr(nccl::ncclGetErrorString(code)) }.to_string_lossy();
    // SAFETY: ncclGetLastError accepts any communicator (or null) and returns a C string owned
    // by NCCL, valid until the next NCCL call on this thread; we copy it at once.
    let last = unsafe {
        let p = nccl::ncclGetLastError(comm.unwrap_or(std::ptr::null_mut()));
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    if last.is_empty() {
        format!("{code:?} ({what})")
    } else {
        format!("{code:?} ({what}): {last}")
    }
}

fn dtype(d: DType) -> ncclDataType_t {
    match d {
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::Bf16 => ncclDataType_t::ncclBfloat16,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::F64 => ncclDataType_t::ncclFloat64,
        DType::I32 => ncclDataType_t::ncclInt32,
        DType::I64 => ncclDataType_t::ncclInt64,
        DType::U8 => ncclDataType_t::ncclUint8,
    }
}

fn red_op(op: ReduceOp) -> ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
    }
}

/// The 128-byte NCCL unique id rank 0 makes and every rank needs.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId([u8; 128]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclId({:02x?}…)", &self.0[..8])
    }
}

impl NcclId {
    /// A fresh id (`ncclGetUniqueId`); call on one rank only.
    pub fn new() -> Result<Self> {
        probe()?;
        let id = catch("ncclGetUniqueId", nccl_result::get_uniqueid)?.map_err(|e| {
            CollectiveError::Nccl {
                call: "ncclGetUniqueId",
                ranks: vec![],
                detail: nccl_detail(e.0, None),
            }
        })?;
        Ok(Self(id.internal.map(|c| c as u8)))
    }

    /// The id's bytes, to send to the other ranks.
    pub fn as_bytes(&self) -> &[u8; 128] {
        &self.0
    }

    /// An id received from rank 0; `bytes` must be exactly 128 bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let arr: [u8; 128] = bytes
            .try_into()
            .map_err(|_| CollectiveError::LengthMismatch {
                op: "NcclId::from_bytes",
                what: "id",
                expected: 128,
                actual: bytes.len(),
            })?;
        Ok(Self(arr))
    }

    fn raw(&self) -> nccl::ncclUniqueId {
        nccl::ncclUniqueId {
            internal: self.0.map(|b| b as std::ffi::c_char),
        }
    }
}

/// A raw communicator handle that may cross to the helper thread running a blocking NCCL call.
struct SendComm(ncclComm_t);
// SAFETY: NCCL communicators are not tied to a thread; the handle is used by one thread at a
// time (the owner waits while the helper runs).
unsafe impl Send for SendComm {}

/// Runs a blocking NCCL start-up call on a helper thread bound to `ctx`, waiting at most
/// `timeout`. On timeout the helper is abandoned (it stays blocked inside NCCL).
fn blocking_with_timeout(
    call: &'static str,
    ranks: &[usize],
    ctx: &Arc<CudaContext>,
    timeout: Duration,
    f: impl FnOnce() -> std::result::Result<SendComm, String> + Send + 'static,
) -> Result<ncclComm_t> {
    let (tx, rx) = std::sync::mpsc::channel();
    let ctx = ctx.clone();
    std::thread::Builder::new()
        .name(format!("nccl-{call}"))
        .spawn(move || {
            let out = match ctx.bind_to_thread() {
                Ok(()) => std::panic::catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
                    Err("panicked inside cudarc/NCCL (missing symbol?)".into())
                }),
                Err(e) => Err(format!("binding the CUDA context: {e:?}")),
            };
            // The receiver may have given up (timeout); nothing to do then.
            let _ = tx.send(out);
        })
        .map_err(|e| cuda_err(call, e))?;
    match rx.recv_timeout(timeout) {
        Ok(Ok(comm)) => Ok(comm.0),
        Ok(Err(detail)) => Err(CollectiveError::Nccl {
            call,
            ranks: ranks.to_vec(),
            detail,
        }),
        Err(_) => Err(CollectiveError::Timeout {
            op: call,
            ranks: ranks.to_vec(),
            group_rank: usize::MAX,
            after: timeout,
        }),
    }
}

/// Lets every peer-capable GPU read and write this device's default memory pool.
///
/// cudarc allocates with `cuMemAllocAsync`, i.e. from the device's default pool, and pool memory
/// is *not* made peer-accessible by `cuCtxEnablePeerAccess` (which NCCL calls): a pool grants
/// access per device with `cuMemPoolSetAccess`. Ranks of one process are NCCL peers of the same
/// pid, and NCCL then uses its "P2P/direct pointer" transport: the peer GPU's kernels read and
/// write our user buffers directly (`NCCL_DIRECT_WRITE`/`_READ`; confirmed on 2× H200 with
/// NCCL 2.28.9: `isAllDirectP2p 1 directMode 1`). Pool memory without this grant is not
/// mapped on the peer (NCCL documents `NCCL_P2P_DIRECT_DISABLE` for exactly such buffers).
/// Idempotent; cheap (no allocation).
fn grant_peer_pool_access(ctx: &Arc<CudaContext>) -> Result<()> {
    let me = ctx.cu_device();
    let n = catch("cuDeviceGetCount", CudaContext::device_count)?
        .map_err(|e| cuda_err("cuDeviceGetCount", e))?;
    let mut descs = Vec::new();
    for ordinal in 0..n {
        if ordinal as usize == ctx.ordinal() {
            continue;
        }
        let mut peer: cu::CUdevice = 0;
        // SAFETY: valid out-pointer; `ordinal` < device count.
        let code = unsafe { cu::cuDeviceGet(&mut peer, ordinal) };
        if code != CUresult::CUDA_SUCCESS {
            return Err(cuda_err("cuDeviceGet", code));
        }
        let mut can: std::ffi::c_int = 0;
        // SAFETY: valid out-pointer and device handles. Asks whether `peer` can access `me`.
        let code = unsafe { cu::cuDeviceCanAccessPeer(&mut can, peer, me) };
        if code != CUresult::CUDA_SUCCESS {
            return Err(cuda_err("cuDeviceCanAccessPeer", code));
        }
        if can != 0 {
            descs.push(cu::CUmemAccessDesc {
                location: cu::CUmemLocation {
                    type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: ordinal,
                },
                flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            });
        }
    }
    if descs.is_empty() || !ctx.has_async_alloc() {
        return Ok(()); // no peers over P2P (NCCL then stages through its own buffers), or no pools
    }
    let mut pool: cu::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: valid out-pointer and device handle.
    let code = unsafe { cu::cuDeviceGetDefaultMemPool(&mut pool, me) };
    if code != CUresult::CUDA_SUCCESS {
        return Err(cuda_err("cuDeviceGetDefaultMemPool", code));
    }
    // SAFETY: `pool` is this device's default pool; `descs` holds descs.len() valid entries.
    let code = unsafe { cu::cuMemPoolSetAccess(pool, descs.as_ptr(), descs.len()) };
    if code != CUresult::CUDA_SUCCESS {
        return Err(cuda_err("cuMemPoolSetAccess", code));
    }
    tracing::debug!(
        device = ctx.ordinal(),
        peers = descs.len(),
        "default memory pool shared with peer GPUs"
    );
    Ok(())
}

/// A rank's handle on the NCCL world: its device context, its communication stream and the
/// world communicator that groups are split from.
#[derive(Debug)]
pub struct NcclWorld {
    rank: usize,
    world_size: usize,
    stream: Arc<CudaStream>,
    comm: ncclComm_t,
    timeout: Duration,
    /// Set when a blocking call on `comm` was abandoned: the handle may still be in use by the
    /// abandoned helper thread, so it is neither used nor aborted again.
    abandoned: RefCell<Option<String>>,
}

impl NcclWorld {
    /// Joins the world as `rank` of `world_size` on CUDA device `device` (`ncclCommInitRank`,
    /// ~0.5 s; blocks until every rank has joined or `timeout` passes).
    pub fn init(
        device: usize,
        rank: usize,
        world_size: usize,
        id: &NcclId,
        timeout: Duration,
    ) -> Result<Self> {
        probe()?;
        if rank >= world_size {
            return Err(CollectiveError::RankOutOfRange {
                rank,
                ranks: (0..world_size).collect(),
                world_size,
            });
        }
        let ctx = catch("cuCtxCreate", || CudaContext::new(device))?
            .map_err(|e| cuda_err("CudaContext::new", e))?;
        // SAFETY: this backend orders its own work on one stream per rank and every operation
        // completes before returning; the module docs tell callers to order foreign streams.
        unsafe { ctx.disable_event_tracking() };
        grant_peer_pool_access(&ctx)?;
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_err("cuStreamCreate", e))?;
        let raw_id = id.raw();
        let (n, r) = (world_size as i32, rank as i32);
        let world: Vec<usize> = (0..world_size).collect();
        let comm = blocking_with_timeout("ncclCommInitRank", &world, &ctx, timeout, move || {
            let mut comm = std::mem::MaybeUninit::<ncclComm_t>::uninit();
            // SAFETY: `comm` is a valid out-pointer; NCCL writes the handle on success.
            match unsafe { nccl_result::comm_init_rank(comm.as_mut_ptr(), n, raw_id, r) } {
                // SAFETY: success means NCCL initialised `comm`.
                Ok(_) => Ok(SendComm(unsafe { comm.assume_init() })),
                Err(e) => Err(nccl_detail(e.0, None)),
            }
        })?;
        tracing::info!(rank, world_size, device, "NCCL world communicator ready");
        Ok(Self {
            rank,
            world_size,
            stream,
            comm,
            timeout,
            abandoned: RefCell::new(None),
        })
    }

    /// Runs `f` on `n_gpus` local GPUs, one thread per GPU (rank = device index), each with its
    /// own [`NcclWorld`]; results in rank order, `Err(message)` for a rank whose start-up failed
    /// or that panicked. Fails early if NCCL/CUDA are missing or fewer GPUs are visible.
    pub fn run_local<R, F>(
        n_gpus: usize,
        timeout: Duration,
        f: F,
    ) -> Result<Vec<std::result::Result<R, String>>>
    where
        R: Send,
        F: Fn(NcclWorld) -> R + Sync,
    {
        let found = device_count()?;
        if found < n_gpus {
            return Err(CollectiveError::NotEnoughDevices {
                wanted: n_gpus,
                found,
            });
        }
        let id = NcclId::new()?;
        let f = &f;
        Ok(std::thread::scope(|s| {
            let handles: Vec<_> = (0..n_gpus)
                .map(|rank| {
                    std::thread::Builder::new()
                        .name(format!("gpu-rank-{rank}"))
                        .spawn_scoped(s, move || {
                            NcclWorld::init(rank, rank, n_gpus, &id, timeout)
                                .map(f)
                                .map_err(|e| e.to_string())
                        })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| match h {
                    Ok(h) => h
                        .join()
                        .unwrap_or_else(|_| Err("rank thread panicked".into())),
                    Err(e) => Err(format!("could not spawn rank thread: {e}")),
                })
                .collect()
        }))
    }

    /// The default timeout, for callers of [`NcclWorld::init`].
    pub fn default_timeout() -> Duration {
        DEFAULT_TIMEOUT
    }

    /// This rank's communication stream (every communicator of this rank uses it; only
    /// [`NcclComm::post_p2p`] queues on a stream the caller names).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// This rank's CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.stream.context()
    }
}

impl Drop for NcclWorld {
    fn drop(&mut self) {
        if self.abandoned.borrow().is_some() {
            return; // an abandoned helper thread may still be inside NCCL with this handle
        }
        release(self.comm, self.context(), self.timeout, &[]);
    }
}

/// Frees a healthy communicator: `ncclCommDestroy` (which finalizes, so peers still using
/// shared buffers are not cut off) on a helper thread, waited for at most `timeout`; a peer
/// that has vanished can make it block, and then it is abandoned with a warning.
fn release(comm: ncclComm_t, ctx: &Arc<CudaContext>, timeout: Duration, ranks: &[usize]) {
    let handle = SendComm(comm);
    let out = blocking_with_timeout("ncclCommDestroy", ranks, ctx, timeout, move || {
        let handle = handle;
        // SAFETY: the owner is being dropped and never touches the handle again.
        match unsafe { nccl_result::comm_destroy(handle.0) } {
            Ok(_) => Ok(SendComm(std::ptr::null_mut())),
            Err(e) => Err(nccl_detail(e.0, None)),
        }
    });
    if let Err(e) = out {
        tracing::warn!(error = %e, "releasing an NCCL communicator failed");
    }
}

impl CommWorld for NcclWorld {
    type Comm = NcclComm;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn split(&self, groups: &[Vec<usize>]) -> Result<Option<NcclComm>> {
        let world: Vec<usize> = (0..self.world_size).collect();
        if let Some(reason) = self.abandoned.borrow().as_ref() {
            return Err(CollectiveError::Poisoned {
                ranks: world,
                reason: reason.clone(),
            });
        }
        let place = locate_in_groups(groups, self.rank, self.world_size)?;
        let (color, key) = match place {
            Some((gi, pos)) => (gi as i32, pos as i32),
            None => (NCCL_SPLIT_NOCOLOR, 0),
        };
        let parent = SendComm(self.comm);
        let result = blocking_with_timeout(
            "ncclCommSplit",
            &world,
            self.context(),
            self.timeout,
            move || {
                let parent = parent;
                let mut child: ncclComm_t = std::ptr::null_mut();
                // SAFETY: `parent` is a live communicator (the owner waits for us); `child` is a valid
                // out-pointer; a null config inherits the parent's (no struct-version mismatch
                // between cudarc's bindings and the loaded NCCL).
                let code = unsafe {
                    nccl::ncclCommSplit(parent.0, color, key, &mut child, std::ptr::null_mut())
                };
                match code {
                    ncclResult_t::ncclSuccess => Ok(SendComm(child)),
                    e => Err(nccl_detail(e, Some(parent.0))),
                }
            },
        );
        let child = match result {
            Ok(c) => c,
            Err(e) => {
                if matches!(e, CollectiveError::Timeout { .. }) {
                    *self.abandoned.borrow_mut() = Some(format!("ncclCommSplit timed out: {e}"));
                }
                return Err(e);
            }
        };
        let Some((gi, pos)) = place else {
            return Ok(None);
        };
        let barrier = self
            .stream
            .alloc_zeros::<f32>(1)
            .map_err(|e| cuda_err("cuMemAlloc", e))?;
        tracing::debug!(rank = self.rank, ranks = ?groups[gi], group_rank = pos, "NCCL group communicator ready");
        Ok(Some(NcclComm {
            comm: child,
            ranks: groups[gi].clone(),
            rank: pos,
            stream: self.stream.clone(),
            timeout: self.timeout,
            broken: RefCell::new(None),
            barrier_buf: RefCell::new(barrier),
        }))
    }
}

/// A communicator of the NCCL backend over one group. `Buf<T>` is `CudaSlice<T>` (allocate it
/// with [`Communicator::alloc`] or on [`NcclComm::stream`]).
#[derive(Debug)]
pub struct NcclComm {
    comm: ncclComm_t,
    ranks: Vec<usize>,
    rank: usize,
    stream: Arc<CudaStream>,
    timeout: Duration,
    /// Why the communicator was aborted, once it has been.
    broken: RefCell<Option<String>>,
    barrier_buf: RefCell<CudaSlice<f32>>,
}

// SAFETY: NCCL lets a communicator be used from any thread as long as no two calls on it run at
// once. `NcclComm` is `Send` but not `Sync` (its `RefCell`s forbid shared use), so whoever owns it
// calls it from one thread at a time; moving it to another thread (a rank's worker, a decoder
// instance's thread) is the same as the `SendComm` hand-off above. The raw handle is the only
// field that is not `Send` by itself.
unsafe impl Send for NcclComm {}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.broken.borrow().is_some() {
            return; // already aborted
        }
        if let Err(e) = self.sync("drop") {
            self.abort(format!(
                "work still pending when the communicator was dropped: {e}"
            ));
            return;
        }
        release(self.comm, self.stream.context(), self.timeout, &self.ranks);
    }
}

impl NcclComm {
    /// The stream this communicator's work runs on (but [`NcclComm::post_p2p`]'s, on the caller's
    /// stream, which this one then waits for).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The raw NCCL communicator, for calling NCCL directly (the collective benchmark times
    /// `ncclAllGather` on it as a reference). The communicator keeps owning it: enqueue only on
    /// [`Self::stream`], finish with [`Communicator::synchronize`], and never destroy or abort
    /// it.
    pub fn as_raw(&self) -> ncclComm_t {
        self.comm
    }

    /// Sends `buf` to group rank `to` (`ncclSend`) and returns once the transfer is complete, i.e.
    /// the peer has received it. One-sided point-to-point, for links between pools (the NCCL
    /// latent link); the ranks of a mesh use the collectives and `send_recv`.
    pub fn send<T: Element>(&self, buf: &CudaSlice<T>, to: usize) -> Result<()> {
        self.guarded("send", || {
            check::peer("send", "to", to, self.size())?;
            let (s, _gs) = buf.device_ptr(&self.stream);
            self.grouped_p2p(dtype(T::DTYPE), &[(s, buf.len(), to)], &[])?;
            self.sync("send")
        })
    }

    /// Receives into `buf` from group rank `from` (`ncclRecv`, exactly `buf.len()` elements) and
    /// returns once it holds the data. The counterpart of [`NcclComm::send`].
    pub fn recv<T: Element>(&self, buf: &mut CudaSlice<T>, from: usize) -> Result<()> {
        self.guarded("recv", || {
            check::peer("recv", "from", from, self.size())?;
            let len = buf.len();
            let (r, _gr) = buf.device_ptr_mut(&self.stream);
            self.grouped_p2p(dtype(T::DTYPE), &[], &[(r, len, from)])?;
            self.sync("recv")
        })
    }

    /// Posts grouped point-to-point transfers, every `(send, to)` and every `(recv, from)` in one NCCL
    /// group, on `stream` (of this communicator's GPU: the buffers' producers and consumers' own,
    /// so no event lies between them and the transfers) and returns **without waiting**: the
    /// stream-ordered transfers of [`TensorWire::transfer`](super::wire::TensorWire::transfer). It
    /// is the one operation that breaks the "returns when complete" contract, on purpose, so the
    /// caller takes over what the other operations do: it keeps every buffer alive and unreused
    /// until `stream` has passed the transfers, makes [`Self::stream`] wait for an event recorded
    /// on `stream` after this call (so that this communicator's later operations come after the
    /// transfers, as NCCL needs, and its waits cover them), and bounds the wait later with
    /// [`Communicator::synchronize`] (or any other operation), whose timeout aborts the
    /// communicator and so unblocks a transfer whose peer never came. NCCL errors already reported
    /// are checked here (no wait), so a broken group fails at the next post.
    pub fn post_p2p<T: Element>(
        &self,
        stream: &CudaStream,
        sends: &[(&CudaSlice<T>, usize)],
        recvs: &mut [(&mut CudaSlice<T>, usize)],
    ) -> Result<()> {
        self.guarded("post_p2p", || {
            for &(_, to) in sends {
                check::peer("post_p2p", "to", to, self.size())?;
            }
            for (_, from) in recvs.iter() {
                check::peer("post_p2p", "from", *from, self.size())?;
            }
            // The guards record nothing (event tracking is off on the context); the caller's borrows
            // keep the buffers alive, and its events order them (see above).
            let send_ptrs: Vec<_> = sends
                .iter()
                .map(|&(buf, to)| (buf.device_ptr(&self.stream).0, buf.len(), to))
                .collect();
            let recv_ptrs: Vec<_> = recvs
                .iter_mut()
                .map(|(buf, from)| {
                    let len = buf.len();
                    (buf.device_ptr_mut(&self.stream).0, len, *from)
                })
                .collect();
            let on = stream.cu_stream() as nccl::cudaStream_t;
            self.grouped_p2p_on(on, dtype(T::DTYPE), &send_ptrs, &recv_ptrs)?;
            self.async_error()
        })
    }

    /// An error NCCL has reported for this communicator (a failed peer connection, an abort), if
    /// any; no wait.
    fn async_error(&self) -> Result<()> {
        let mut async_err = ncclResult_t::ncclSuccess;
        // SAFETY: `comm` is live; `async_err` is a valid out-pointer.
        let code = unsafe { nccl::ncclCommGetAsyncError(self.comm, &mut async_err) };
        let bad = [code, async_err]
            .into_iter()
            .find(|c| !matches!(c, ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress));
        match bad {
            Some(c) => Err(CollectiveError::Nccl {
                call: "ncclCommGetAsyncError",
                ranks: self.ranks.clone(),
                detail: nccl_detail(c, Some(self.comm)),
            }),
            None => Ok(()),
        }
    }

    fn ensure_usable(&self) -> Result<()> {
        match self.broken.borrow().as_ref() {
            Some(reason) => Err(CollectiveError::Poisoned {
                ranks: self.ranks.clone(),
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Aborts the communicator (unblocking any kernel waiting on a peer) and remembers why.
    fn abort(&self, reason: String) {
        if self.broken.borrow().is_some() {
            return;
        }
        tracing::error!(ranks = ?self.ranks, group_rank = self.rank, %reason, "aborting NCCL communicator");
        // SAFETY: `comm` is live (not yet aborted, checked above).
        if let Err(e) = unsafe { nccl_result::comm_abort(self.comm) } {
            tracing::warn!(detail = nccl_detail(e.0, None), "ncclCommAbort failed");
        }
        *self.broken.borrow_mut() = Some(reason);
    }

    /// Runs an operation: refuses on an aborted communicator, aborts on any failure.
    fn guarded(&self, op: &'static str, f: impl FnOnce() -> Result<()>) -> Result<()> {
        self.ensure_usable()?;
        let out = f();
        if let Err(e) = &out {
            self.abort(format!("group rank {} failed in {op}: {e}", self.rank));
        }
        out
    }

    fn nccl(
        &self,
        call: &'static str,
        r: std::result::Result<nccl_result::NcclStatus, nccl_result::NcclError>,
    ) -> Result<()> {
        r.map(|_| ()).map_err(|e| CollectiveError::Nccl {
            call,
            ranks: self.ranks.clone(),
            detail: nccl_detail(e.0, Some(self.comm)),
        })
    }

    fn cu(&self, call: &'static str, code: CUresult) -> Result<()> {
        match code {
            CUresult::CUDA_SUCCESS => Ok(()),
            e => Err(cuda_err(call, e)),
        }
    }

    fn raw_stream(&self) -> nccl::cudaStream_t {
        self.stream.cu_stream() as nccl::cudaStream_t
    }

    /// Waits until everything enqueued on the stream is done, polling for NCCL errors and the
    /// deadline. Queries back to back at first (collectives take ~1 ms or less; a sleep would distort
    /// them), then paced: between queries the host spins on its own clock for [`POLL_GAP`] without
    /// calling the driver, and after [`SPIN_PHASE`] it sleeps briefly instead. Why paced: the ranks of
    /// one host are threads of one process sharing one CUDA driver, and a wait often overlaps a peer
    /// still queueing its part (a gather, the parallel VAE's agreement and end-of-chunk waits); a
    /// back-to-back `cuStreamQuery` loop there competes with the peer's launches inside the driver.
    /// The pacing adds at most one gap (µs) to a wait.
    fn sync(&self, op: &'static str) -> Result<()> {
        let started = Instant::now();
        let deadline = started + self.timeout;
        let mut polls: u32 = 0;
        loop {
            // SAFETY: the stream handle is valid while `self.stream` lives.
            match unsafe { cu::cuStreamQuery(self.stream.cu_stream()) } {
                CUresult::CUDA_SUCCESS => return Ok(()),
                CUresult::CUDA_ERROR_NOT_READY => {}
                e => return Err(cuda_err("cuStreamQuery", e)),
            }
            if polls & 63 == 0 {
                self.async_error()?;
                if Instant::now() >= deadline {
                    return Err(CollectiveError::Timeout {
                        op,
                        ranks: self.ranks.clone(),
                        group_rank: self.rank,
                        after: self.timeout,
                    });
                }
            }
            polls = polls.wrapping_add(1);
            if polls < FAST_POLLS {
                std::hint::spin_loop();
            } else if started.elapsed() < SPIN_PHASE {
                let next = Instant::now() + POLL_GAP;
                while Instant::now() < next {
                    std::hint::spin_loop();
                }
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Grouped point-to-point transfers: (send ptr, count, peer) and (recv ptr, count, peer).
    fn grouped_p2p(
        &self,
        dt: ncclDataType_t,
        sends: &[(u64, usize, usize)],
        recvs: &[(u64, usize, usize)],
    ) -> Result<()> {
        self.grouped_p2p_on(self.raw_stream(), dt, sends, recvs)
    }

    /// [`Self::grouped_p2p`] queued on `stream`.
    fn grouped_p2p_on(
        &self,
        stream: nccl::cudaStream_t,
        dt: ncclDataType_t,
        sends: &[(u64, usize, usize)],
        recvs: &[(u64, usize, usize)],
    ) -> Result<()> {
        self.nccl("ncclGroupStart", nccl_result::group_start())?;
        let mut first_err = Ok(());
        for &(ptr, count, peer) in sends {
            if count == 0 {
                continue;
            }
            // SAFETY: `ptr` points at `count` live elements of type `dt` on this rank's device,
            // kept alive by the caller's borrow until the operation completes (synced or waited).
            let r = unsafe {
                nccl_result::send(
                    ptr as *const c_void,
                    count,
                    dt,
                    peer as i32,
                    self.comm,
                    stream,
                )
            };
            if first_err.is_ok() {
                first_err = self.nccl("ncclSend", r);
            }
        }
        for &(ptr, count, peer) in recvs {
            if count == 0 {
                continue;
            }
            // SAFETY: as above, for a buffer the caller borrows mutably.
            let r = unsafe {
                nccl_result::recv(
                    ptr as *mut c_void,
                    count,
                    dt,
                    peer as i32,
                    self.comm,
                    stream,
                )
            };
            if first_err.is_ok() {
                first_err = self.nccl("ncclRecv", r);
            }
        }
        // The group must be closed even after an error, or NCCL's group state leaks into the
        // next call on this thread.
        let end = self.nccl("ncclGroupEnd", nccl_result::group_end());
        first_err.and(end)
    }

    /// The transfer of [`Communicator::all_gather_v`] (and so of `all_gather`), lengths already
    /// checked by the caller (`op` names it in errors): one grouped send/recv in which every
    /// rank sends its part to every rank, itself included. The own part goes through NCCL's
    /// self send/recv inside the group, as in `all_to_all`, so the local copy overlaps the
    /// peer transfers instead of running before them on the stream.
    fn gather_v<T: Element>(
        &self,
        op: &'static str,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        counts: &[usize],
    ) -> Result<()> {
        self.queue_gather_v(send, recv, counts)?;
        self.sync(op)
    }

    /// The grouped send/recv of [`Self::gather_v`], queued on the communicator's stream.
    fn queue_gather_v<T: Element>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        counts: &[usize],
    ) -> Result<()> {
        let p = self.size();
        let off = prefix_offsets(counts);
        let (s, _gs) = send.device_ptr(&self.stream);
        let (r, _gr) = recv.device_ptr_mut(&self.stream);
        let el = bytes_of::<T>(1) as u64;
        let sends: Vec<_> = (0..p).map(|i| (s, counts[self.rank], i)).collect();
        let recvs: Vec<_> = (0..p)
            .map(|i| (r + off[i] as u64 * el, counts[i], i))
            .collect();
        self.grouped_p2p(dtype(T::DTYPE), &sends, &recvs)
    }

    /// The transfer of [`Communicator::all_to_all`], lengths checked here (`op` names it in
    /// errors), queued on the communicator's stream: one grouped send/recv, chunk j of `send` to
    /// rank j and chunk i of `recv` from rank i, the own chunk included (NCCL's self send/recv).
    fn queue_all_to_all<T: Element>(
        &self,
        op: &'static str,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
    ) -> Result<()> {
        let p = self.size();
        let n = check::chunk(op, "send", send.len(), p)?;
        check::len(op, "recv", send.len(), recv.len())?;
        let (s, _gs) = send.device_ptr(&self.stream);
        let (r, _gr) = recv.device_ptr_mut(&self.stream);
        let chunk = bytes_of::<T>(n) as u64;
        let sends: Vec<_> = (0..p).map(|j| (s + j as u64 * chunk, n, j)).collect();
        let recvs: Vec<_> = (0..p).map(|i| (r + i as u64 * chunk, n, i)).collect();
        self.grouped_p2p(dtype(T::DTYPE), &sends, &recvs)
    }

    /// A zero-length buffer (an uneven last shard can be empty). The driver refuses 0-byte
    /// allocations, so this allocates one element and hands it out with length 0; dropping the
    /// slice frees it as usual.
    fn empty<T: Element>(&self) -> Result<CudaSlice<T>> {
        let one = self
            .stream
            .alloc_zeros::<T>(1)
            .map_err(|e| cuda_err("cuMemAllocAsync", e))?;
        let ptr = one.leak();
        // SAFETY: `ptr` was just allocated on this stream for one T and leaked, so the new slice
        // is its only owner; with length 0 nothing is ever read or written through it.
        Ok(unsafe { self.stream.upgrade_device_ptr(ptr, 0) })
    }

    /// Device-to-device copy of `bytes` bytes, stream-ordered.
    fn copy_bytes(&self, src: u64, dst: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges lie inside live device buffers (bounds checked by the callers).
        self.cu("cuMemcpyDtoDAsync", unsafe {
            cu::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.stream.cu_stream())
        })
    }
}

fn bytes_of<T>(n: usize) -> usize {
    n * std::mem::size_of::<T>()
}

impl Communicator for NcclComm {
    type Buf<T: Element> = CudaSlice<T>;
    type Owned<T: Element> = CudaSlice<T>;
    type Pending<'a> = NcclPending<'a>;

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.ranks.len()
    }

    fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    fn len<T: Element>(&self, buf: &CudaSlice<T>) -> usize {
        buf.len()
    }

    fn alloc<T: Element>(&self, len: usize) -> Result<CudaSlice<T>> {
        if len == 0 {
            return self.empty();
        }
        self.stream
            .alloc_zeros::<T>(len)
            .map_err(|e| cuda_err("cuMemAllocAsync", e))
    }

    fn upload<T: Element>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        if host.is_empty() {
            return self.empty();
        }
        self.stream
            .clone_htod(host)
            .map_err(|e| cuda_err("cuMemcpyHtoDAsync", e))
    }

    fn download<T: Element>(&self, buf: &CudaSlice<T>) -> Result<Vec<T>> {
        self.guarded("download", || self.sync("download"))?;
        if buf.is_empty() {
            return Ok(Vec::new());
        }
        self.stream
            .clone_dtoh(buf)
            .map_err(|e| cuda_err("cuMemcpyDtoH", e))
    }

    /// Done as [`Communicator::all_gather_v`] with every count `n` (one grouped send/recv), not
    /// `ncclAllGather`. Our ranks share one process, so NCCL's send/recv runs on its P2P
    /// "direct pointer" transport (the peer GPU reads and writes our buffers, over 32 p2p
    /// channels), and at the sizes we move that beats NCCL's ring all-gather (24 collective
    /// channels on the same machine). On 2× H200, 256 MiB per rank, this reached 272 GB/s bus
    /// bandwidth against 237 GB/s for `ncclAllGather` in the same run. At P = 2 it moves the
    /// bytes of all-to-all, and all-to-all reached 273 GB/s in that run. The numbers are in
    /// bench/RESULTS.md; the collective benchmark prints both.
    fn all_gather<T: Element>(&self, send: &CudaSlice<T>, recv: &mut CudaSlice<T>) -> Result<()> {
        self.guarded("all_gather", || {
            let n = send.len();
            check::len("all_gather", "recv", n * self.size(), recv.len())?;
            self.gather_v("all_gather", send, recv, &vec![n; self.size()])
        })
    }

    /// Queued as [`Communicator::all_gather`] is, not waited (see `all_to_all_posted`).
    fn all_gather_posted<'a, T: Element>(
        &'a self,
        send: &'a CudaSlice<T>,
        recv: &'a mut CudaSlice<T>,
    ) -> Result<NcclPending<'a>> {
        self.guarded("all_gather_posted", || {
            let n = send.len();
            check::len("all_gather_posted", "recv", n * self.size(), recv.len())?;
            self.queue_gather_v(send, recv, &vec![n; self.size()])
        })?;
        Ok(NcclPending {
            comm: self,
            op: "all_gather_posted",
            done: false,
            _buffers: PhantomData,
        })
    }

    fn all_gather_v<T: Element>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        counts: &[usize],
    ) -> Result<()> {
        self.guarded("all_gather_v", || {
            let p = self.size();
            check::counts("all_gather_v", "counts", counts, p)?;
            check::len("all_gather_v", "send", counts[self.rank], send.len())?;
            check::len(
                "all_gather_v",
                "recv",
                prefix_offsets(counts)[p],
                recv.len(),
            )?;
            self.gather_v("all_gather_v", send, recv, counts)
        })
    }

    fn all_to_all<T: Element>(&self, send: &CudaSlice<T>, recv: &mut CudaSlice<T>) -> Result<()> {
        self.guarded("all_to_all", || {
            self.queue_all_to_all("all_to_all", send, recv)?;
            self.sync("all_to_all")
        })
    }

    /// Queued on the communicator's stream like every collective, not waited: the host goes on
    /// queueing kernels on its own stream, which the transfer overlaps; [`Pending::wait`] is the
    /// collective's timed wait.
    fn all_to_all_posted<'a, T: Element>(
        &'a self,
        send: &'a CudaSlice<T>,
        recv: &'a mut CudaSlice<T>,
    ) -> Result<NcclPending<'a>> {
        self.guarded("all_to_all_posted", || {
            self.queue_all_to_all("all_to_all_posted", send, recv)
        })?;
        Ok(NcclPending {
            comm: self,
            op: "all_to_all_posted",
            done: false,
            _buffers: PhantomData,
        })
    }

    fn all_to_all_v<T: Element>(
        &self,
        send: &CudaSlice<T>,
        send_counts: &[usize],
        recv: &mut CudaSlice<T>,
        recv_counts: &[usize],
    ) -> Result<()> {
        self.guarded("all_to_all_v", || {
            let p = self.size();
            check::counts("all_to_all_v", "send_counts", send_counts, p)?;
            check::counts("all_to_all_v", "recv_counts", recv_counts, p)?;
            let so = prefix_offsets(send_counts);
            let ro = prefix_offsets(recv_counts);
            check::len("all_to_all_v", "send", so[p], send.len())?;
            check::len("all_to_all_v", "recv", ro[p], recv.len())?;
            let (s, _gs) = send.device_ptr(&self.stream);
            let (r, _gr) = recv.device_ptr_mut(&self.stream);
            let el = bytes_of::<T>(1) as u64;
            let sends: Vec<_> = (0..p)
                .map(|j| (s + so[j] as u64 * el, send_counts[j], j))
                .collect();
            let recvs: Vec<_> = (0..p)
                .map(|i| (r + ro[i] as u64 * el, recv_counts[i], i))
                .collect();
            self.grouped_p2p(dtype(T::DTYPE), &sends, &recvs)?;
            self.sync("all_to_all_v")
        })
    }

    fn all_reduce<T: Element>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.guarded("all_reduce", || {
            check::len("all_reduce", "recv", send.len(), recv.len())?;
            let (s, _gs) = send.device_ptr(&self.stream);
            let (r, _gr) = recv.device_ptr_mut(&self.stream);
            // SAFETY: both buffers hold send.len() elements of T, alive for the call + sync.
            let res = unsafe {
                nccl_result::all_reduce(
                    s as *const c_void,
                    r as *mut c_void,
                    send.len(),
                    dtype(T::DTYPE),
                    red_op(op),
                    self.comm,
                    self.raw_stream(),
                )
            };
            self.nccl("ncclAllReduce", res)?;
            self.sync("all_reduce")
        })
    }

    fn all_reduce_in_place<T: Element>(&self, buf: &mut CudaSlice<T>, op: ReduceOp) -> Result<()> {
        self.guarded("all_reduce_in_place", || {
            let n = buf.len();
            let (b, _g) = buf.device_ptr_mut(&self.stream);
            // SAFETY: in-place all-reduce is allowed by NCCL (send == recv); n elements of T.
            let res = unsafe {
                nccl_result::all_reduce(
                    b as *const c_void,
                    b as *mut c_void,
                    n,
                    dtype(T::DTYPE),
                    red_op(op),
                    self.comm,
                    self.raw_stream(),
                )
            };
            self.nccl("ncclAllReduce", res)?;
            self.sync("all_reduce_in_place")
        })
    }

    fn reduce_scatter<T: Element>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.guarded("reduce_scatter", || {
            let n = recv.len();
            check::len("reduce_scatter", "send", n * self.size(), send.len())?;
            let (s, _gs) = send.device_ptr(&self.stream);
            let (r, _gr) = recv.device_ptr_mut(&self.stream);
            // SAFETY: send holds P·n and recv n elements of T (checked), alive for call + sync.
            let res = unsafe {
                nccl_result::reduce_scatter(
                    s as *const c_void,
                    r as *mut c_void,
                    n,
                    dtype(T::DTYPE),
                    red_op(op),
                    self.comm,
                    self.raw_stream(),
                )
            };
            self.nccl("ncclReduceScatter", res)?;
            self.sync("reduce_scatter")
        })
    }

    fn broadcast<T: Element>(&self, buf: &mut CudaSlice<T>, root: usize) -> Result<()> {
        self.guarded("broadcast", || {
            check::peer("broadcast", "root", root, self.size())?;
            let n = buf.len();
            let (b, _g) = buf.device_ptr_mut(&self.stream);
            // SAFETY: in-place broadcast (send == recv) of n elements of T.
            let res = unsafe {
                nccl_result::broadcast(
                    b as *const c_void,
                    b as *mut c_void,
                    n,
                    dtype(T::DTYPE),
                    root as i32,
                    self.comm,
                    self.raw_stream(),
                )
            };
            self.nccl("ncclBroadcast", res)?;
            self.sync("broadcast")
        })
    }

    fn barrier(&self) -> Result<()> {
        self.guarded("barrier", || {
            let mut buf = self.barrier_buf.borrow_mut();
            let (b, _g) = buf.device_ptr_mut(&self.stream);
            // SAFETY: one f32 owned by this communicator; an all-reduce is a barrier.
            let res = unsafe {
                nccl_result::all_reduce(
                    b as *const c_void,
                    b as *mut c_void,
                    1,
                    ncclDataType_t::ncclFloat32,
                    ncclRedOp_t::ncclSum,
                    self.comm,
                    self.raw_stream(),
                )
            };
            self.nccl("ncclAllReduce", res)?;
            self.sync("barrier")
        })
    }

    fn send_recv<'a, T: Element>(
        &'a self,
        send: &'a CudaSlice<T>,
        to: usize,
        recv: &'a mut CudaSlice<T>,
        from: usize,
    ) -> Result<NcclPending<'a>> {
        self.guarded("send_recv", || {
            check::peer("send_recv", "to", to, self.size())?;
            check::peer("send_recv", "from", from, self.size())?;
            let recv_len = recv.len();
            let (s, _gs) = send.device_ptr(&self.stream);
            let (r, _gr) = recv.device_ptr_mut(&self.stream);
            self.grouped_p2p(
                dtype(T::DTYPE),
                &[(s, send.len(), to)],
                &[(r, recv_len, from)],
            )
        })?;
        Ok(NcclPending {
            comm: self,
            op: "send_recv",
            done: false,
            _buffers: PhantomData,
        })
    }

    fn copy_2d<T: Element>(
        &self,
        src: &CudaSlice<T>,
        src_offset: usize,
        src_pitch: usize,
        dst: &mut CudaSlice<T>,
        dst_offset: usize,
        dst_pitch: usize,
        width: usize,
        height: usize,
    ) -> Result<()> {
        self.guarded("copy_2d", || {
            check::copy_bounds("src", src_offset, src_pitch, width, height, src.len())?;
            check::copy_bounds("dst", dst_offset, dst_pitch, width, height, dst.len())?;
            if width == 0 || height == 0 {
                return Ok(());
            }
            let el = bytes_of::<T>(1);
            let (s, _gs) = src.device_ptr(&self.stream);
            let (d, _gd) = dst.device_ptr_mut(&self.stream);
            let s = s + (src_offset * el) as u64;
            let d = d + (dst_offset * el) as u64;
            if height == 1 || (width == src_pitch && width == dst_pitch) {
                return self.copy_bytes(s, d, width * height * el);
            }
            // cuMemcpy2D limits pitches to CU_DEVICE_ATTRIBUTE_MAX_PITCH (2^31 − 1 bytes on
            // current GPUs); few tall rows go row by row instead.
            let max_pitch = (1usize << 31) - 1;
            if src_pitch * el > max_pitch || dst_pitch * el > max_pitch || height <= 4 {
                for y in 0..height {
                    self.copy_bytes(
                        s + (y * src_pitch * el) as u64,
                        d + (y * dst_pitch * el) as u64,
                        width * el,
                    )?;
                }
                return Ok(());
            }
            let copy = cu::CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: cu::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                srcHost: std::ptr::null(),
                srcDevice: s,
                srcArray: std::ptr::null_mut(),
                srcPitch: src_pitch * el,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: cu::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                dstHost: std::ptr::null_mut(),
                dstDevice: d,
                dstArray: std::ptr::null_mut(),
                dstPitch: dst_pitch * el,
                WidthInBytes: width * el,
                Height: height,
            };
            // SAFETY: both regions were bounds-checked above; the descriptor lives across the call.
            self.cu("cuMemcpy2DAsync", unsafe {
                cu::cuMemcpy2DAsync_v2(&copy, self.stream.cu_stream())
            })
        })
    }

    fn synchronize(&self) -> Result<()> {
        self.guarded("synchronize", || self.sync("synchronize"))
    }
}

/// A posted operation of the NCCL backend ([`Communicator::send_recv`],
/// [`Communicator::all_gather_posted`], [`Communicator::all_to_all_posted`]), queued on the
/// communicator's stream; its buffers stay borrowed until it completes. Waiting is the stream's
/// timed wait, so it also waits for everything queued on that stream before it.
#[derive(Debug)]
pub struct NcclPending<'a> {
    comm: &'a NcclComm,
    op: &'static str,
    done: bool,
    _buffers: PhantomData<&'a mut ()>,
}

impl NcclPending<'_> {
    fn finish(&mut self) -> Result<()> {
        if std::mem::replace(&mut self.done, true) {
            return Ok(());
        }
        let op = self.op;
        self.comm.guarded(op, || self.comm.sync(op))
    }
}

impl Pending for NcclPending<'_> {
    fn wait(mut self) -> Result<()> {
        self.finish()
    }
}

impl Drop for NcclPending<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            tracing::error!(error = %e, op = self.op, "posted operation dropped without wait, and it failed");
        }
    }
}

/// `NcclComm` moves between threads: parallel wrappers own it inside their rank's worker.
const _: () = {
    const fn assert_send<T: Send>() {}
    assert_send::<NcclComm>();
};
