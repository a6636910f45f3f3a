//! Tensors through a communicator: the one place that turns a kernels [`Tensor`] into a backend's
//! buffers and back ([`TensorWire`], with its point-to-point [`TensorWire::transfer`]), and the
//! tensor-level operations built on it ([`all_gather`], [`all_gather_during`], [`all_gather_v`],
//! [`all_to_all`], [`send_recv`], [`send`], [`recv`]). The denoiser's parallel
//! attention and CFG loop, the parallel VAE's halos and gathers, and the NCCL latent link all move
//! tensors through here. A tensor travels in its own dtype: bf16 halves the traffic and adds no
//! rounding a bf16 model would not do anyway (the denoiser moves its LSE as f32 tensors).
//!
//! - CPU backend, and any tensor in host memory: a buffer is an `upload` of the tensor's values and
//!   the result a `download` (host copies), moved back to the input's device.
//! - NCCL backend (feature `cuda`), tensors on the communicator's GPU: no host round trip and no
//!   copy. The buffer handed to NCCL *is* the tensor's device storage: a `CudaSlice` view built over
//!   the tensor's address ([`ditstream_kernels::cuda::tensor_device_ptr`]) that never frees it,
//!   holding a clone of the tensor so the storage outlives the transfer. Results are received
//!   straight into a fresh, unfilled device tensor ([`ditstream_kernels::cuda::uninit_tensor`]) that
//!   becomes the output; no existing tensor is ever written.
//!
//! Stream ordering (NCCL). Two streams per GPU: the kernels' stream (`cuda_stream`, every op of the
//! model) and the communicator's own stream (`NcclComm::stream`, every NCCL call of the rank but
//! the stream-ordered transfers below, one stream for all its communicators). We keep them
//! separate, ordered by events, rather than run NCCL on the kernels' stream, so a posted Ring
//! send/recv overlaps the attention queued after it (on one stream the attention would wait for
//! the transfer).
//! - compute → communication: before NCCL touches a tensor's storage (a staged input, or a receive
//!   tensor whose allocation is stream-ordered on the kernels' stream), an event is recorded on the
//!   kernels' stream and the communicator's stream waits on it (`cuStreamWaitEvent`; the host does
//!   not block). Everything queued on the kernels' stream before the staging, i.e. the producers of
//!   the tensor, runs before the collective.
//! - communication → compute: every collective of the backend returns only when its stream has
//!   drained (and `send_recv` when its handle is waited), so any kernel queued afterwards reads
//!   complete data; no event is needed that way. The host waits anyway for the collective's result,
//!   as the [`Communicator`] contract says.
//! - frees: a staged tensor (or the receive tensor, if dropped) frees its storage on the kernels'
//!   stream when its last clone goes, which is after the collective has completed on the host's
//!   clock, so the pool never hands the memory to a kernel while NCCL still uses it.
//!
//! Timing: the tensor-level collectives end in a [`mark`] (`"all-gather"`, `"all-to-all"`,
//! `"send/recv"`), so a rank's recorded timeline ([`ditstream_kernels::timeline::record`] on its
//! thread) shows each collective beside the model's ops: the interval runs from the previous mark
//! to the collective's return, the kernels it waited for included.
//!
//! Stream-ordered transfers ([`TensorWire::transfer`] with `ordered`, NCCL only). The transfers
//! that do not wait on the host: the parallel VAE swaps a halo before every 3×3 convolution (~30
//! per latent frame) and gathers the frame attention's keys and values once, and a host wait there
//! drains the GPU each time and stops the host from queueing the kernels after it. Instead the
//! grouped send/recv is queued (`NcclComm::post_p2p`) on the kernels' stream itself, between the
//! tensors' producers and their consumers, with no event in between (a halo is on the critical
//! path: nothing can overlap it, and each event hop between the streams costs microseconds, ~700
//! times per 480p decode); the frees of the sent and received tensors, queued there later, come
//! after the transfers too. The communicator's stream then waits on an event recorded after them,
//! so the communicator's later operations run after them (one communicator's operations must run
//! in order) and its timed waits cover them. What the host gives up: it learns of a failure or a
//! vanished peer only at the communicator's next waiting operation (`synchronize`, any
//! collective), whose timeout aborts the communicator and so ends the stuck transfer (and every
//! kernel queued behind it). A caller must therefore reach such an operation before it waits on
//! the kernels' stream itself (a host read, a cuDNN algorithm search): a host wait on the kernels'
//! stream behind a transfer whose peer is gone has no timeout.
//!
//! Failures are [`WireError`]s; the model crates fold them into their own errors (a collective
//! failure stays a collective failure there), so their call sites use `?`.

use std::borrow::{Borrow, BorrowMut};

use ditstream_kernels::timeline::mark;
use ditstream_kernels::{DType as TensorDType, Device, KernelError, Tensor};
use half::bf16;

use super::cpu::CpuComm;
use super::{CollectiveError, Communicator, Element, Pending};

/// Why a tensor could not cross a communicator.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The collective failed: this rank's own error, or another rank of the group failed, left or
    /// timed out (`Poisoned`, `Timeout`).
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// A tensor op around the transfer failed (host copy, reshape, device move, allocation).
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// A tensor was staged as an element type other than its own dtype (a bug in the caller).
    #[error(
        "tensor {shape:?} is {got:?} but was staged to travel as {expected:?}: a tensor travels \
         as its own dtype"
    )]
    DTypeMismatch {
        /// The tensor's shape.
        shape: Vec<usize>,
        /// The element type it was staged as.
        expected: TensorDType,
        /// Its dtype.
        got: TensorDType,
    },
    /// A transfer step named a peer twice on one side (a bug in the caller).
    #[error(
        "group rank {peer} appears twice among one step's sends or receives: a transfer step has \
         at most one send to and one receive from each peer"
    )]
    RepeatedPeer {
        /// The repeated peer.
        peer: usize,
    },
    /// A tensor (or a result's destination) lives on a GPU other than the communicator's.
    #[error(
        "a tensor on {device:?} reached a communicator on cuda:{comm_ordinal}: a rank's tensors \
         live on its communicator's GPU or the host"
    )]
    WrongDevice {
        /// Where the tensor is (or the result should go).
        device: Device,
        /// The communicator's GPU.
        comm_ordinal: usize,
    },
}

type Result<T> = std::result::Result<T, WireError>;

/// An element type a tensor travels in (f32 or bf16, one per tensor dtype).
pub trait WireElement: Element {
    /// The tensor dtype of this element type.
    const TENSOR_DTYPE: TensorDType;
    /// The tensor's values in this type (the tensor has this dtype).
    fn host(t: &Tensor) -> Result<Vec<Self>>;
    /// A host tensor of this dtype from values.
    fn tensor(values: Vec<Self>, shape: &[usize]) -> Result<Tensor>;
}

impl WireElement for f32 {
    const TENSOR_DTYPE: TensorDType = TensorDType::F32;
    fn host(t: &Tensor) -> Result<Vec<f32>> {
        Ok(t.to_vec_f32()?)
    }
    fn tensor(values: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
        Ok(Tensor::from_vec(values, shape)?)
    }
}

impl WireElement for bf16 {
    const TENSOR_DTYPE: TensorDType = TensorDType::BF16;
    fn host(t: &Tensor) -> Result<Vec<bf16>> {
        Ok(t.to_vec_bf16()?)
    }
    fn tensor(values: Vec<bf16>, shape: &[usize]) -> Result<Tensor> {
        Ok(Tensor::from_bf16_vec(values, shape)?)
    }
}

/// A communicator that tensors can cross: how a [`Tensor`] becomes the backend's buffer and a
/// received buffer a tensor. Implemented for the CPU backend (host copies) and, with feature
/// `cuda`, the NCCL backend (device tensors as device buffers, no copy; see the module docs).
/// Every parallel wrapper, loop and link that moves tensors is generic over it.
pub trait TensorWire: Communicator + Sized {
    /// A buffer holding a tensor's values (a staged input or a receive buffer).
    type Held<T: Element>: BorrowMut<Self::Buf<T>>;
    /// `t`'s values as a buffer to send; `T` must be t's dtype ([`WireError::DTypeMismatch`]).
    fn stage<T: WireElement>(&self, t: &Tensor) -> Result<Self::Held<T>>;
    /// A buffer of `numel` elements to receive into, for a result that goes to `device`.
    fn receive<T: WireElement>(&self, numel: usize, device: Device) -> Result<Self::Held<T>>;
    /// The tensor of `shape` on `device` a buffer holds, once the operation that wrote it returned
    /// (or its `send_recv` was waited).
    fn tensor<T: WireElement>(
        &self,
        buf: &Self::Held<T>,
        shape: &[usize],
        device: Device,
    ) -> Result<Tensor>;

    /// Point-to-point transfers with several peers in one step: `sends[i] = (peer, t)` sends `t` to
    /// group rank `peer`, `recvs[j] = (peer, shape)` receives a tensor of `shape` from `peer`, in
    /// `dtype` on `device`; the received tensors come back in the order of `recvs`. At most one send
    /// to and one receive from each peer; each peer makes the matching call (its send to this rank
    /// has the shape this rank receives). The parallel VAE's halo swaps and its key/value gather
    /// for the frame attention (uneven bands: the shapes differ per peer).
    ///
    /// The default, and every call with `ordered` false: one waited [`send_recv`] per peer (the
    /// send to it, or nothing, and the receive from it, or nothing), peers in the order they first
    /// appear in `sends`, then `recvs` (a backend whose `send_recv` blocks on its peer needs a
    /// deadlock-free order from the caller), complete on return. The NCCL backend with `ordered`
    /// true and non-empty device tensors instead *queues* the transfers (module docs,
    /// "stream-ordered transfers") and returns at once: the received tensors are complete for
    /// every op queued afterwards on the kernels' stream, and the host learns about a failure or a
    /// timeout only at the communicator's next waiting operation ([`Communicator::synchronize`], a
    /// collective), which the caller must reach before reading results on the host.
    fn transfer(
        &self,
        sends: &[(usize, &Tensor)],
        recvs: &[(usize, &[usize])],
        dtype: TensorDType,
        device: Device,
        ordered: bool,
    ) -> Result<Vec<Tensor>> {
        let _ = ordered; // no stream ordering here: every transfer completes before the next
        transfer_waited(self, sends, recvs, dtype, device)
    }
}

/// [`TensorWire::transfer`], one waited [`send_recv`] per peer, in the order of first appearance.
fn transfer_waited<C: TensorWire>(
    comm: &C,
    sends: &[(usize, &Tensor)],
    recvs: &[(usize, &[usize])],
    dtype: TensorDType,
    device: Device,
) -> Result<Vec<Tensor>> {
    check_peers(sends.iter().map(|s| s.0), recvs.iter().map(|r| r.0))?;
    let mut peers: Vec<usize> = Vec::new();
    for peer in sends.iter().map(|s| s.0).chain(recvs.iter().map(|r| r.0)) {
        if !peers.contains(&peer) {
            peers.push(peer);
        }
    }
    let mut received: Vec<Option<Tensor>> = vec![None; recvs.len()];
    for peer in peers {
        let send = sends.iter().find(|s| s.0 == peer).map(|s| s.1);
        let recv = recvs.iter().position(|r| r.0 == peer);
        let shape = recv.map(|j| recvs[j].1);
        let got = crate::by_dtype!(dtype, swap_as::<C>(comm, send, peer, shape, device))?;
        if let (Some(j), Some(t)) = (recv, got) {
            received[j] = Some(t);
        }
    }
    Ok(received.into_iter().flatten().collect())
}

/// At most one send to and one receive from each peer (a repeated peer is the caller's bug).
fn check_peers(
    sends: impl Iterator<Item = usize>,
    recvs: impl Iterator<Item = usize>,
) -> Result<()> {
    for peers in [sends.collect::<Vec<_>>(), recvs.collect()] {
        for (i, p) in peers.iter().enumerate() {
            if peers[..i].contains(p) {
                return Err(WireError::RepeatedPeer { peer: *p });
            }
        }
    }
    Ok(())
}

/// One waited `send_recv` with `peer`: `send` (or nothing) to it, a tensor of `shape` (or nothing)
/// from it, in T on `device`.
fn swap_as<C: TensorWire, T: WireElement>(
    comm: &C,
    send: Option<&Tensor>,
    peer: usize,
    shape: Option<&[usize]>,
    device: Device,
) -> Result<Option<Tensor>> {
    let staged = send.map(|t| comm.stage::<T>(t)).transpose()?;
    let nothing = comm.alloc::<T>(0)?;
    let mut recv = match shape {
        Some(shape) => Some(comm.receive::<T>(shape.iter().product(), device)?),
        None => None,
    };
    let mut empty = comm.alloc::<T>(0)?;
    let send_buf = staged.as_ref().map_or(nothing.borrow(), |s| s.borrow());
    let recv_buf = recv.as_mut().map_or(empty.borrow_mut(), |r| r.borrow_mut());
    comm.send_recv(send_buf, peer, recv_buf, peer)?.wait()?;
    match (shape, recv) {
        (Some(shape), Some(recv)) => Ok(Some(comm.tensor::<T>(&recv, shape, device)?)),
        _ => Ok(None),
    }
}

/// `t` travels as `T` only if that is its dtype: a bf16 tensor staged as f32 would silently
/// change its values' rounding on the host path and reinterpret its bytes on the device path.
fn check_dtype<T: WireElement>(t: &Tensor) -> Result<()> {
    if t.dtype() == T::TENSOR_DTYPE {
        Ok(())
    } else {
        Err(WireError::DTypeMismatch {
            shape: t.shape().to_vec(),
            expected: T::TENSOR_DTYPE,
            got: t.dtype(),
        })
    }
}

/// The host path: values uploaded into a backend buffer, results downloaded and moved to `device`.
fn host_stage<C: Communicator, T: WireElement>(comm: &C, t: &Tensor) -> Result<C::Owned<T>> {
    check_dtype::<T>(t)?;
    Ok(comm.upload(&T::host(t)?)?)
}

fn host_receive<C: Communicator, T: WireElement>(comm: &C, numel: usize) -> Result<C::Owned<T>> {
    Ok(comm.alloc::<T>(numel)?)
}

fn host_tensor<C: Communicator, T: WireElement>(
    comm: &C,
    buf: &C::Owned<T>,
    shape: &[usize],
    device: Device,
) -> Result<Tensor> {
    Ok(T::tensor(comm.download(buf.borrow())?, shape)?.to_device(device)?)
}

impl TensorWire for CpuComm {
    type Held<T: Element> = Vec<T>;
    fn stage<T: WireElement>(&self, t: &Tensor) -> Result<Vec<T>> {
        host_stage(self, t)
    }
    fn receive<T: WireElement>(&self, numel: usize, _device: Device) -> Result<Vec<T>> {
        host_receive(self, numel)
    }
    fn tensor<T: WireElement>(
        &self,
        buf: &Vec<T>,
        shape: &[usize],
        device: Device,
    ) -> Result<Tensor> {
        host_tensor(self, buf, shape, device)
    }
}

#[cfg(feature = "cuda")]
mod device {
    use std::borrow::{Borrow, BorrowMut};
    use std::mem::ManuallyDrop;

    use cudarc::driver::CudaSlice;
    use ditstream_kernels::cuda::{cuda_stream, tensor_device_ptr, uninit_tensor};
    use ditstream_kernels::{Device, Tensor};

    use super::super::nccl::NcclComm;
    use super::super::{CollectiveError, Communicator, Element};
    use super::{
        Result, TensorWire, WireElement, WireError, check_dtype, check_peers, host_receive,
        host_stage, host_tensor, transfer_waited,
    };
    use ditstream_kernels::DType as TensorDType;
    use half::bf16;

    /// A buffer of the NCCL backend: its own allocation (host-path tensors, empty buffers), or a
    /// view of a device tensor's storage.
    #[derive(Debug)]
    pub enum DeviceBuf<T> {
        /// A buffer the communicator allocated (freed on drop).
        Owned(CudaSlice<T>),
        /// A tensor's storage, borrowed for the transfer (never freed through the slice).
        View(TensorView<T>),
    }

    /// A `CudaSlice` over a tensor's device storage, and a clone of the tensor keeping it alive.
    #[derive(Debug)]
    pub struct TensorView<T> {
        slice: ManuallyDrop<CudaSlice<T>>,
        tensor: Tensor,
    }

    impl<T> Drop for TensorView<T> {
        fn drop(&mut self) {
            // SAFETY: `slice` is taken exactly once, here, and never used again. It was built over
            // the tensor's storage (`upgrade_device_ptr`), so it must not free it: `leak` gives the
            // address up without freeing (event tracking is off on the communicator's context, so
            // there are no events to wait on or destroy); the tensor clone frees it when it goes.
            let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
            let _ = slice.leak();
        }
    }

    impl<T> Borrow<CudaSlice<T>> for DeviceBuf<T> {
        fn borrow(&self) -> &CudaSlice<T> {
            match self {
                DeviceBuf::Owned(s) => s,
                DeviceBuf::View(v) => &v.slice,
            }
        }
    }

    impl<T> BorrowMut<CudaSlice<T>> for DeviceBuf<T> {
        fn borrow_mut(&mut self) -> &mut CudaSlice<T> {
            match self {
                DeviceBuf::Owned(s) => s,
                DeviceBuf::View(v) => &mut v.slice,
            }
        }
    }

    fn cuda_error(call: &'static str, detail: impl std::fmt::Debug) -> WireError {
        WireError::Collective(CollectiveError::Cuda {
            call,
            detail: format!("{detail:?}"),
        })
    }

    /// `Some(ordinal)` when `device` is this communicator's GPU, `None` for the host, an error for
    /// another GPU (a rank's tensors live where its communicator does).
    fn gpu_of(comm: &NcclComm, device: Device) -> Result<Option<usize>> {
        let mine = comm.stream().context().ordinal();
        match device {
            Device::Cpu => Ok(None),
            Device::Cuda(o) if o == mine => Ok(Some(o)),
            Device::Cuda(_) => Err(WireError::WrongDevice {
                device,
                comm_ordinal: mine,
            }),
        }
    }

    /// The communicator's stream waits (on the GPU; the host does not block) for everything queued
    /// so far on the kernels' stream of GPU `ordinal`.
    fn after_compute(comm: &NcclComm, ordinal: usize) -> Result<()> {
        let kernels = cuda_stream(ordinal)?;
        let event = kernels
            .record_event(None)
            .map_err(|e| cuda_error("cuEventRecord", e))?;
        comm.stream()
            .wait(&event)
            .map_err(|e| cuda_error("cuStreamWaitEvent", e))
        // Dropping the event is fine: the wait captured it, and CUDA frees it once it completes.
    }

    /// A view of `t`'s storage as a `CudaSlice<T>` on the communicator's stream, ordered after the
    /// kernels that produced it.
    fn view<T: WireElement>(comm: &NcclComm, t: &Tensor, ordinal: usize) -> Result<DeviceBuf<T>> {
        check_dtype::<T>(t)?;
        if t.numel() == 0 {
            return Ok(DeviceBuf::Owned(comm.alloc::<T>(0)?));
        }
        let view = raw_view(comm, t)?;
        after_compute(comm, ordinal)?;
        Ok(DeviceBuf::View(view))
    }

    /// A view of `t`'s storage (non-empty, dtype T checked) as a `CudaSlice<T>`, not yet ordered
    /// after anything: the caller records [`after_compute`] before NCCL touches it.
    fn raw_view<T: WireElement>(comm: &NcclComm, t: &Tensor) -> Result<TensorView<T>> {
        check_dtype::<T>(t)?;
        let ptr = tensor_device_ptr(t)?;
        // SAFETY: `ptr` is the start of `t`'s live device storage on this communicator's GPU (the
        // same primary context), holding numel elements of T (dtype checked above); the view keeps
        // a clone of `t` so the storage outlives the slice, and the slice is leaked, never freed
        // (TensorView::drop). The context has event tracking off, so no events are created.
        let slice = unsafe { comm.stream().upgrade_device_ptr::<T>(ptr, t.numel()) };
        Ok(TensorView {
            slice: ManuallyDrop::new(slice),
            tensor: t.clone(),
        })
    }

    /// The stream-ordered [`TensorWire::transfer`] (module docs) of non-empty tensors of dtype T on
    /// GPU `ordinal`.
    fn transfer_ordered<T: WireElement>(
        comm: &NcclComm,
        sends: &[(usize, &Tensor)],
        recvs: &[(usize, &[usize])],
        ordinal: usize,
    ) -> Result<Vec<Tensor>> {
        let sent = sends
            .iter()
            .map(|&(_, t)| raw_view::<T>(comm, t))
            .collect::<Result<Vec<_>>>()?;
        let mut received = recvs
            .iter()
            .map(|&(_, shape)| {
                // Allocated (stream-ordered) on the kernels' stream, before the event below.
                let into = uninit_tensor(shape, T::TENSOR_DTYPE, ordinal)?;
                raw_view::<T>(comm, &into)
            })
            .collect::<Result<Vec<_>>>()?;
        let send_bufs: Vec<_> = sent
            .iter()
            .zip(sends)
            .map(|(v, &(peer, _))| (&*v.slice, peer))
            .collect();
        let mut recv_bufs: Vec<_> = received
            .iter_mut()
            .zip(recvs)
            .map(|(v, &(peer, _))| (&mut *v.slice, peer))
            .collect();
        // On the kernels' stream: after the sent tensors' producers and the receive allocations,
        // before every consumer, with no event in between.
        let kernels = cuda_stream(ordinal)?;
        let posted = comm.post_p2p(&kernels, &send_bufs, &mut recv_bufs);
        // The communicator's stream waits for the transfers: its later operations come after them
        // (NCCL runs one communicator's operations in order) and its timed waits cover them.
        let tracked = after_compute(comm, ordinal);
        posted?;
        tracked?;
        let out = received
            .iter()
            .zip(recvs)
            .map(|(v, &(_, shape))| Ok(v.tensor.reshape(shape)?))
            .collect();
        // Dropping the views now frees (stream-ordered, on the kernels' stream) behind the
        // transfers, whatever the host does next.
        drop(sent);
        out
    }

    impl TensorWire for NcclComm {
        type Held<T: Element> = DeviceBuf<T>;

        fn stage<T: WireElement>(&self, t: &Tensor) -> Result<DeviceBuf<T>> {
            match gpu_of(self, t.device())? {
                Some(ordinal) => view(self, t, ordinal),
                None => Ok(DeviceBuf::Owned(host_stage(self, t)?)),
            }
        }

        fn receive<T: WireElement>(&self, numel: usize, device: Device) -> Result<DeviceBuf<T>> {
            match gpu_of(self, device)? {
                Some(ordinal) => {
                    let t = uninit_tensor(&[numel], T::TENSOR_DTYPE, ordinal)?;
                    view(self, &t, ordinal)
                }
                None => Ok(DeviceBuf::Owned(host_receive(self, numel)?)),
            }
        }

        fn tensor<T: WireElement>(
            &self,
            buf: &DeviceBuf<T>,
            shape: &[usize],
            device: Device,
        ) -> Result<Tensor> {
            match buf {
                DeviceBuf::View(v) => Ok(v.tensor.reshape(shape)?.to_device(device)?),
                DeviceBuf::Owned(s) => host_tensor(self, s, shape, device),
            }
        }

        /// Stream-ordered when `ordered`, `device` is this communicator's GPU and every tensor
        /// sent and received is a non-empty tensor of `dtype` there; otherwise the waited default.
        fn transfer(
            &self,
            sends: &[(usize, &Tensor)],
            recvs: &[(usize, &[usize])],
            dtype: TensorDType,
            device: Device,
            ordered: bool,
        ) -> Result<Vec<Tensor>> {
            let ordinal = gpu_of(self, device)?;
            let alike = sends
                .iter()
                .all(|(_, t)| t.device() == device && t.dtype() == dtype && t.numel() > 0)
                && recvs
                    .iter()
                    .all(|(_, shape)| shape.iter().product::<usize>() > 0);
            match ordinal {
                Some(ordinal) if ordered && alike => {
                    check_peers(sends.iter().map(|s| s.0), recvs.iter().map(|r| r.0))?;
                    match dtype {
                        TensorDType::F32 => transfer_ordered::<f32>(self, sends, recvs, ordinal),
                        TensorDType::BF16 => transfer_ordered::<bf16>(self, sends, recvs, ordinal),
                    }
                }
                _ => transfer_waited(self, sends, recvs, dtype, device),
            }
        }
    }
}

/// What [`by_dtype!`](crate::by_dtype) expands to names (a macro's paths must resolve in the
/// caller's crate too).
#[doc(hidden)]
pub mod __by_dtype {
    pub use ditstream_kernels::DType;
    pub use half::bf16;
}

/// `by_dtype!(dtype, f::<C>(args…))` calls `f::<C, T>(args…)` with T the [`WireElement`] of the
/// tensor dtype `dtype`: the one dispatch from a run-time dtype to a typed transfer.
#[macro_export]
macro_rules! by_dtype {
    ($dtype:expr, $f:ident :: <$c:ty> ($($arg:expr),* $(,)?)) => {
        match $dtype {
            $crate::collectives::wire::__by_dtype::DType::F32 => $f::<$c, f32>($($arg),*),
            $crate::collectives::wire::__by_dtype::DType::BF16 => {
                $f::<$c, $crate::collectives::wire::__by_dtype::bf16>($($arg),*)
            }
        }
    };
}

/// `[P]` prepended to a shape.
fn stacked(p: usize, shape: &[usize]) -> Vec<usize> {
    std::iter::once(p).chain(shape.iter().copied()).collect()
}

/// all_gather: t [..] on every rank → [P, ..], entry i from group rank i (t's dtype and device).
pub fn all_gather<C: TensorWire>(comm: &C, t: &Tensor) -> Result<Tensor> {
    let out = by_dtype!(t.dtype(), all_gather_as::<C>(comm, t))?;
    mark("all-gather");
    Ok(out)
}

fn all_gather_as<C: TensorWire, T: WireElement>(comm: &C, t: &Tensor) -> Result<Tensor> {
    let send = comm.stage::<T>(t)?;
    let mut recv = comm.receive::<T>(t.numel() * comm.size(), t.device())?;
    comm.all_gather(send.borrow(), recv.borrow_mut())?;
    comm.tensor::<T>(&recv, &stacked(comm.size(), t.shape()), t.device())
}

/// [`all_gather`] with work under it: the gather of `t` is posted
/// ([`Communicator::all_gather_posted`]), `meanwhile` runs while it travels (whatever it queues
/// overlaps the transfer), and the gather is waited: (gathered `[P, ..]`, `meanwhile`'s value).
/// Attention2D projects and gathers Q under the column's K/V gather this way.
pub fn all_gather_during<C: TensorWire, R, E: From<WireError>>(
    comm: &C,
    t: &Tensor,
    meanwhile: impl FnOnce() -> std::result::Result<R, E>,
) -> std::result::Result<(Tensor, R), E> {
    let out = match t.dtype() {
        TensorDType::F32 => all_gather_during_as::<C, f32, R, E>(comm, t, meanwhile),
        TensorDType::BF16 => all_gather_during_as::<C, bf16, R, E>(comm, t, meanwhile),
    }?;
    mark("all-gather");
    Ok(out)
}

fn all_gather_during_as<C: TensorWire, T: WireElement, R, E: From<WireError>>(
    comm: &C,
    t: &Tensor,
    meanwhile: impl FnOnce() -> std::result::Result<R, E>,
) -> std::result::Result<(Tensor, R), E> {
    let send = comm.stage::<T>(t)?;
    let mut recv = comm.receive::<T>(t.numel() * comm.size(), t.device())?;
    let posted = comm
        .all_gather_posted(send.borrow(), recv.borrow_mut())
        .map_err(WireError::from)?;
    let done = meanwhile();
    // Waited whether or not `meanwhile` succeeded, before the buffers go.
    posted.wait().map_err(WireError::from)?;
    let value = done?;
    let gathered = comm.tensor::<T>(&recv, &stacked(comm.size(), t.shape()), t.device())?;
    Ok((gathered, value))
}

/// Uneven all-gather: `t` (this rank's `counts[rank]` elements, any shape) → `[Σ counts]` flat, rank
/// i's values at offset `Σ_{j<i} counts[j]`, in t's dtype on t's device.
pub fn all_gather_v<C: TensorWire>(comm: &C, t: &Tensor, counts: &[usize]) -> Result<Tensor> {
    let out = by_dtype!(t.dtype(), all_gather_v_as::<C>(comm, t, counts))?;
    mark("all-gather");
    Ok(out)
}

fn all_gather_v_as<C: TensorWire, T: WireElement>(
    comm: &C,
    t: &Tensor,
    counts: &[usize],
) -> Result<Tensor> {
    let total = counts.iter().sum();
    let send = comm.stage::<T>(t)?;
    let mut recv = comm.receive::<T>(total, t.device())?;
    comm.all_gather_v(send.borrow(), recv.borrow_mut(), counts)?;
    comm.tensor::<T>(&recv, &[total], t.device())
}

/// all_to_all: t [P, ..] (entry j goes to group rank j) → [P, ..] (entry i came from rank i).
pub fn all_to_all<C: TensorWire>(comm: &C, t: &Tensor) -> Result<Tensor> {
    let out = by_dtype!(t.dtype(), all_to_all_as::<C>(comm, t))?;
    mark("all-to-all");
    Ok(out)
}

fn all_to_all_as<C: TensorWire, T: WireElement>(comm: &C, t: &Tensor) -> Result<Tensor> {
    let send = comm.stage::<T>(t)?;
    let mut recv = comm.receive::<T>(t.numel(), t.device())?;
    comm.all_to_all(send.borrow(), recv.borrow_mut())?;
    comm.tensor::<T>(&recv, t.shape(), t.device())
}

/// Sends `t` to group rank `to` and receives a tensor of `shape` (t's dtype, on t's device) from
/// group rank `from`, in one `send_recv`, waited before returning.
pub fn send_recv<C: TensorWire>(
    comm: &C,
    t: &Tensor,
    to: usize,
    shape: &[usize],
    from: usize,
) -> Result<Tensor> {
    let out = by_dtype!(t.dtype(), send_recv_as::<C>(comm, t, to, shape, from))?;
    mark("send/recv");
    Ok(out)
}

fn send_recv_as<C: TensorWire, T: WireElement>(
    comm: &C,
    t: &Tensor,
    to: usize,
    shape: &[usize],
    from: usize,
) -> Result<Tensor> {
    let send = comm.stage::<T>(t)?;
    let mut recv = comm.receive::<T>(shape.iter().product(), t.device())?;
    comm.send_recv(send.borrow(), to, recv.borrow_mut(), from)?
        .wait()?;
    comm.tensor::<T>(&recv, shape, t.device())
}

/// Sends `t` to group rank `to`, receiving nothing (the peer calls [`recv`] with t's shape and
/// dtype): a `send_recv` with an empty receive from the same peer, so it pairs on every backend.
pub fn send<C: TensorWire>(comm: &C, t: &Tensor, to: usize) -> Result<()> {
    by_dtype!(t.dtype(), send_as::<C>(comm, t, to))
}

fn send_as<C: TensorWire, T: WireElement>(comm: &C, t: &Tensor, to: usize) -> Result<()> {
    let send = comm.stage::<T>(t)?;
    let mut nothing = comm.alloc::<T>(0)?;
    comm.send_recv(send.borrow(), to, nothing.borrow_mut(), to)?
        .wait()?;
    Ok(())
}

/// Receives a tensor of `shape` and `dtype` on `device` from group rank `from` (which calls
/// [`send`]), sending nothing.
pub fn recv<C: TensorWire>(
    comm: &C,
    shape: &[usize],
    dtype: TensorDType,
    device: Device,
    from: usize,
) -> Result<Tensor> {
    by_dtype!(dtype, recv_as::<C>(comm, shape, device, from))
}

fn recv_as<C: TensorWire, T: WireElement>(
    comm: &C,
    shape: &[usize],
    device: Device,
    from: usize,
) -> Result<Tensor> {
    let nothing = comm.alloc::<T>(0)?;
    let mut recv = comm.receive::<T>(shape.iter().product(), device)?;
    comm.send_recv(nothing.borrow(), from, recv.borrow_mut(), from)?
        .wait()?;
    comm.tensor::<T>(&recv, shape, device)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::cpu::CpuWorld;
    use super::*;

    type TestResult<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

    /// Runs `f` on two thread ranks over one group and returns both ranks' results, or why a rank
    /// failed.
    fn on_two_ranks<R: Send>(f: impl Fn(&CpuComm) -> TestResult<R> + Sync) -> TestResult<Vec<R>> {
        let world = CpuWorld::new(2).with_timeout(Duration::from_secs(30));
        let out = world.run(|rank| -> TestResult<R> {
            let comm = rank.group(&[0, 1])?;
            let r = f(&comm)?;
            // No rank leaves (drops its communicator) while the other may still be transferring.
            comm.barrier()?;
            Ok(r)
        });
        out.into_iter()
            .map(|r| match r {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => Err(e),
                Err(panic) => Err(panic.into()),
            })
            .collect()
    }

    /// Through the thread backend a tensor keeps its dtype and values (bf16 stays bf16, exactly),
    /// in every operation: each rank's values land where the operation's contract puts them.
    #[test]
    fn transfers_keep_dtype_and_values() -> TestResult<()> {
        let out = on_two_ranks(|comm| {
            let r = comm.rank();
            let mine = Tensor::randn(&[2, 3], TensorDType::BF16, r as u64, Device::Cpu)?;
            let theirs = send_recv(comm, &mine, 1 - r, &[2, 3], 1 - r)?;
            let counts = [6, 3];
            let part = mine.reshape(&[6])?.narrow(0, 0, counts[r])?;
            let gathered_v = all_gather_v(comm, &part, &counts)?;
            let gathered = all_gather(comm, &mine)?;
            let exchanged = all_to_all(comm, &mine)?; // [2, 3]: row j goes to rank j
            // One-way: rank 1 sends its tensor to rank 0.
            let one_way = if r == 1 {
                send(comm, &mine, 0)?;
                None
            } else {
                Some(recv(comm, &[2, 3], TensorDType::BF16, Device::Cpu, 1)?)
            };
            Ok([mine, theirs, gathered_v, gathered, exchanged]
                .into_iter()
                .chain(one_way)
                .collect::<Vec<_>>())
        })?;
        let (rank0, rank1) = (&out[0], &out[1]);
        for t in rank0.iter().chain(rank1) {
            assert_eq!(t.dtype(), TensorDType::BF16);
        }
        let values = |t: &Tensor| t.to_vec_f32();
        let (m0, m1) = (values(&rank0[0])?, values(&rank1[0])?);
        // send_recv swaps.
        assert_eq!(values(&rank0[1])?, m1);
        assert_eq!(values(&rank1[1])?, m0);
        // all_gather_v: all 6 of rank 0, then rank 1's first 3.
        let expected_v: Vec<f32> = m0.iter().chain(&m1[..3]).copied().collect();
        assert_eq!(values(&rank0[2])?, expected_v);
        assert_eq!(values(&rank1[2])?, expected_v);
        // all_gather: [2, 2, 3], rank 0's tensor first.
        let both: Vec<f32> = m0.iter().chain(&m1).copied().collect();
        for rank in [rank0, rank1] {
            assert_eq!(rank[3].shape(), &[2, 2, 3]);
            assert_eq!(values(&rank[3])?, both);
        }
        // all_to_all: rank r gets row r of every rank, rank 0's first.
        let row = |m: &[f32], j: usize| m[3 * j..3 * j + 3].to_vec();
        assert_eq!(values(&rank0[4])?, [row(&m0, 0), row(&m1, 0)].concat());
        assert_eq!(values(&rank1[4])?, [row(&m0, 1), row(&m1, 1)].concat());
        // One-way: rank 0 received rank 1's tensor.
        assert_eq!(rank0.len(), 6);
        assert_eq!(values(&rank0[5])?, m1);
        Ok(())
    }

    /// `transfer` over three thread ranks, as the parallel VAE's key/value gather uses it: every
    /// rank sends its own tensor (a different size per rank) to both peers in ascending order and
    /// receives theirs, in the order of its receives; a rank that only receives (rank 0 of a gather
    /// to it) and one that only sends pair too. A peer named twice is refused, naming it.
    #[test]
    fn transfer_moves_uneven_tensors_between_three_ranks() -> TestResult<()> {
        let world = CpuWorld::new(3).with_timeout(Duration::from_secs(30));
        let size = |r: usize| [r + 1, 2];
        let out = world.run(|rank| -> TestResult<Vec<Vec<f32>>> {
            let comm = rank.group(&[0, 1, 2])?;
            let me = comm.rank();
            let mine = Tensor::randn(&size(me), TensorDType::BF16, me as u64, Device::Cpu)?;
            let peers: Vec<usize> = (0..3).filter(|&p| p != me).collect();
            let shapes: Vec<[usize; 2]> = (0..3).map(size).collect();
            let sends: Vec<(usize, &Tensor)> = peers.iter().map(|&p| (p, &mine)).collect();
            // Receives in descending order: the results follow `recvs`, not the peers' order.
            let recvs: Vec<(usize, &[usize])> =
                peers.iter().rev().map(|&p| (p, &shapes[p][..])).collect();
            let got = comm.transfer(&sends, &recvs, TensorDType::BF16, Device::Cpu, true)?;
            // Then a gather to rank 0: ranks 1 and 2 only send, rank 0 only receives.
            let gathered = if me == 0 {
                let from: Vec<(usize, &[usize])> = vec![(1, &shapes[1][..]), (2, &shapes[2][..])];
                comm.transfer(&[], &from, TensorDType::BF16, Device::Cpu, true)?
            } else {
                comm.transfer(&[(0, &mine)], &[], TensorDType::BF16, Device::Cpu, true)?
            };
            let twice = comm.transfer(
                &[(peers[0], &mine), (peers[0], &mine)],
                &[],
                TensorDType::BF16,
                Device::Cpu,
                true,
            );
            match twice {
                Err(WireError::RepeatedPeer { peer }) if peer == peers[0] => {}
                other => return Err(format!("expected RepeatedPeer, got {other:?}").into()),
            }
            comm.barrier()?;
            [mine]
                .iter()
                .chain(&got)
                .chain(&gathered)
                .map(|t| Ok(t.to_vec_f32()?))
                .collect()
        });
        let out: Vec<Vec<Vec<f32>>> = out
            .into_iter()
            .map(|r| match r {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => Err(e),
                Err(panic) => Err(panic.into()),
            })
            .collect::<TestResult<_>>()?;
        let own = |r: usize| &out[r][0];
        for (me, values) in out.iter().enumerate() {
            let peers: Vec<usize> = (0..3).rev().filter(|&p| p != me).collect();
            for (i, &p) in peers.iter().enumerate() {
                assert_eq!(&values[1 + i], own(p), "rank {me}: from rank {p}");
            }
        }
        assert_eq!(out[0].len(), 5);
        assert_eq!((&out[0][3], &out[0][4]), (own(1), own(2)));
        Ok(())
    }

    /// Staging a tensor as another element type is refused with both dtypes named, before any
    /// communication (a single-rank group: no peer is involved).
    #[test]
    fn staging_as_another_dtype_is_refused() -> TestResult<()> {
        let world = CpuWorld::new(1);
        let out = world.run(|rank| -> TestResult<String> {
            let comm = rank.group(&[0])?;
            let t = Tensor::zeros(&[4], TensorDType::BF16, Device::Cpu)?;
            match comm.stage::<f32>(&t) {
                Err(e @ WireError::DTypeMismatch { .. }) => Ok(e.to_string()),
                other => Err(format!("expected a dtype mismatch, got {other:?}").into()),
            }
        });
        let [Ok(Ok(message))] = out.as_slice() else {
            return Err(format!("the rank failed: {out:?}").into());
        };
        assert!(
            message.contains("BF16") && message.contains("F32"),
            "{message}"
        );
        Ok(())
    }
}
