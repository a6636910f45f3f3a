//! Tensors through a communicator: the one place that turns a [`Tensor`] into the backend's
//! buffers and back ([`TensorWire`]). Collectives move the tensor's own dtype (bf16 halves the
//! traffic), LSE moves as f32.
//!
//! - CPU backend, and any tensor in host memory: a buffer is an `upload` of the tensor's values and
//!   the result a `download` (host copies), moved back to the input's device.
//! - NCCL backend, tensors on the communicator's GPU: no host round trip and no copy. The buffer
//!   handed to NCCL *is* the tensor's device storage: a `CudaSlice` view built over the tensor's
//!   address ([`ditstream_kernels::cuda::tensor_device_ptr`]) that never frees it, holding a clone
//!   of the tensor so the storage outlives the collective. Results are received straight into a
//!   fresh, unfilled device tensor ([`ditstream_kernels::cuda::uninit_tensor`]) that becomes the
//!   output; no existing tensor is ever written.
//!
//! Stream ordering (NCCL). Two streams per GPU: the kernels' stream ([`cuda_stream`], every op of
//! the model) and the communicator's own stream ([`NcclComm::stream`], every NCCL call of the rank,
//! one stream for all its communicators). We keep them separate, ordered by events, rather than run
//! NCCL on the kernels' stream, so a posted Ring send/recv overlaps the attention queued after it
//! (on one stream the attention would wait for the transfer).
//! - compute → communication: before NCCL touches a tensor's storage (a staged input, or a receive
//!   tensor whose allocation is stream-ordered on the kernels' stream), an event is recorded on the
//!   kernels' stream and the communicator's stream waits on it (`cuStreamWaitEvent`; the host does
//!   not block). Everything queued on the kernels' stream before the staging, i.e. the producers of
//!   the tensor, runs before the collective.
//! - communication → compute: every collective of the backend returns only when its stream has
//!   drained (and `send_recv` when its handle is waited), so any kernel queued afterwards reads
//!   complete data; no event is needed that way. The host waits anyway for the collective's result,
//!   as the `Communicator` contract says.
//! - frees: a staged tensor (or the receive tensor, if dropped) frees its storage on the kernels'
//!   stream when its last clone goes, which is after the collective has completed on the host's
//!   clock, so the pool never hands the memory to a kernel while NCCL still uses it.
//!
//! [`cuda_stream`]: ditstream_kernels::cuda::cuda_stream
//! [`NcclComm::stream`]: ditstream_common::collectives::nccl::NcclComm::stream

use std::borrow::{Borrow, BorrowMut};

use ditstream_common::collectives::cpu::CpuComm;
use ditstream_common::collectives::{Communicator, Element, UlyssesExt, UlyssesShape};
use ditstream_kernels::{DType, Device, Tensor};
use half::bf16;

use super::{ParallelError, Result};

/// An element type a tensor travels in (f32 or bf16; sealed: the module is private).
pub trait WireElement: Element {
    /// The tensor dtype of this element type.
    const TENSOR_DTYPE: DType;
    /// The tensor's values in this type (the tensor has this dtype).
    fn host(t: &Tensor) -> Result<Vec<Self>>;
    /// A tensor of this dtype from values.
    fn tensor(values: Vec<Self>, shape: &[usize]) -> Result<Tensor>;
}

impl WireElement for f32 {
    const TENSOR_DTYPE: DType = DType::F32;
    fn host(t: &Tensor) -> Result<Vec<f32>> {
        Ok(t.to_vec_f32()?)
    }
    fn tensor(values: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
        Ok(Tensor::from_vec(values, shape)?)
    }
}

impl WireElement for bf16 {
    const TENSOR_DTYPE: DType = DType::BF16;
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
/// Every parallel wrapper and loop is generic over it.
pub trait TensorWire: Communicator + Sized {
    /// A buffer holding a tensor's values (a staged input or a receive buffer).
    type Held<T: Element>: BorrowMut<Self::Buf<T>>;
    /// `t`'s values as a buffer to send (t has T's dtype).
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
}

/// The host path: values uploaded into a backend buffer, results downloaded and moved to `device`.
fn host_stage<C: Communicator, T: WireElement>(comm: &C, t: &Tensor) -> Result<C::Owned<T>> {
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
    use ditstream_common::collectives::nccl::NcclComm;
    use ditstream_common::collectives::{CollectiveError, Communicator, Element};
    use ditstream_kernels::cuda::{cuda_stream, tensor_device_ptr, uninit_tensor};
    use ditstream_kernels::{Device, Tensor};

    use super::{
        ParallelError, Result, TensorWire, WireElement, host_receive, host_stage, host_tensor,
    };

    /// A buffer of the NCCL backend: its own allocation (host-path tensors, empty buffers), or a
    /// view of a device tensor's storage.
    #[derive(Debug)]
    pub enum DeviceBuf<T> {
        /// A buffer the communicator allocated (freed on drop).
        Owned(CudaSlice<T>),
        /// A tensor's storage, borrowed for the collective (never freed through the slice).
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

    fn cuda_error(call: &'static str, detail: impl std::fmt::Debug) -> ParallelError {
        ParallelError::Collective(CollectiveError::Cuda {
            call,
            detail: format!("{detail:?}"),
        })
    }

    /// `Some(ordinal)` when `device` is this communicator's GPU, `None` for the host, an error for
    /// another GPU (a tensor must live where its rank's communicator does).
    fn gpu_of(comm: &NcclComm, device: Device) -> Result<Option<usize>> {
        let mine = comm.stream().context().ordinal();
        match device {
            Device::Cpu => Ok(None),
            Device::Cuda(o) if o == mine => Ok(Some(o)),
            Device::Cuda(o) => Err(cuda_error(
                "tensor placement",
                format!("a tensor on cuda:{o} reached a communicator on cuda:{mine}"),
            )),
        }
    }

    /// The communicator's stream waits (on the GPU) for everything queued so far on the kernels'
    /// stream of GPU `ordinal`.
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
        if t.numel() == 0 {
            return Ok(DeviceBuf::Owned(comm.alloc::<T>(0)?));
        }
        if t.dtype() != T::TENSOR_DTYPE {
            return Err(ParallelError::Shape {
                what: "tensor on the wire",
                shape: t.shape().to_vec(),
                rule: "its dtype must be the element type it travels in",
            });
        }
        let ptr = tensor_device_ptr(t)?;
        after_compute(comm, ordinal)?;
        // SAFETY: `ptr` is the start of `t`'s live device storage on this communicator's GPU (the
        // same primary context), holding at least numel elements of T (dtype checked above); the
        // view keeps a clone of `t` so the storage outlives the slice, and the slice is leaked, never
        // freed (TensorView::drop). The context has event tracking off, so no events are created.
        let slice = unsafe { comm.stream().upgrade_device_ptr::<T>(ptr, t.numel()) };
        Ok(DeviceBuf::View(TensorView {
            slice: ManuallyDrop::new(slice),
            tensor: t.clone(),
        }))
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
    }
}

/// Calls `$f::<C, T>(args…)` with T the element type of `$t`'s dtype.
macro_rules! by_dtype {
    ($t:expr, $f:ident :: <$c:ty> ($($arg:expr),* $(,)?)) => {
        match $t.dtype() {
            DType::F32 => $f::<$c, f32>($($arg),*),
            DType::BF16 => $f::<$c, ::half::bf16>($($arg),*),
        }
    };
}
pub(crate) use by_dtype;

/// The borrowed view of a held buffer.
pub(crate) fn view<C: TensorWire, T: Element>(held: &C::Held<T>) -> &C::Buf<T> {
    held.borrow()
}

/// The mutable view of a held buffer.
pub(crate) fn view_mut<C: TensorWire, T: Element>(held: &mut C::Held<T>) -> &mut C::Buf<T> {
    held.borrow_mut()
}

/// `[P]` prepended to a shape.
fn stacked(p: usize, shape: &[usize]) -> Vec<usize> {
    std::iter::once(p).chain(shape.iter().copied()).collect()
}

/// all_gather: t [..] on every rank → [P, ..], entry i from group rank i.
pub(crate) fn all_gather<C: TensorWire>(comm: &C, t: &Tensor) -> Result<Tensor> {
    by_dtype!(t, all_gather_as::<C>(comm, t))
}

fn all_gather_as<C: TensorWire, T: WireElement>(comm: &C, t: &Tensor) -> Result<Tensor> {
    let send = comm.stage::<T>(t)?;
    let mut recv = comm.receive::<T>(t.numel() * comm.size(), t.device())?;
    comm.all_gather(view::<C, T>(&send), view_mut::<C, T>(&mut recv))?;
    comm.tensor::<T>(&recv, &stacked(comm.size(), t.shape()), t.device())
}

/// all_to_all: t [P, ..] (entry j goes to group rank j) → [P, ..] (entry i came from rank i).
pub(crate) fn all_to_all<C: TensorWire>(comm: &C, t: &Tensor) -> Result<Tensor> {
    by_dtype!(t, all_to_all_as::<C>(comm, t))
}

fn all_to_all_as<C: TensorWire, T: WireElement>(comm: &C, t: &Tensor) -> Result<Tensor> {
    let send = comm.stage::<T>(t)?;
    let mut recv = comm.receive::<T>(t.numel(), t.device())?;
    comm.all_to_all(view::<C, T>(&send), view_mut::<C, T>(&mut recv))?;
    comm.tensor::<T>(&recv, t.shape(), t.device())
}

/// Which way a Ulysses exchange goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UlyssesWay {
    /// [B, S/P, G, H, D] → [B, S, G, H/P, D].
    SeqToHeads,
    /// [B, S, G, H/P, D] → [B, S/P, G, H, D].
    HeadsToSeq,
}

/// One Ulysses exchange of a 5-D tensor (see [`UlyssesExt`]); `t` is in the input layout of `way`.
pub(crate) fn ulysses<C: TensorWire>(comm: &C, way: UlyssesWay, t: &Tensor) -> Result<Tensor> {
    by_dtype!(t, ulysses_as::<C>(comm, way, t))
}

fn ulysses_as<C: TensorWire, T: WireElement>(
    comm: &C,
    way: UlyssesWay,
    t: &Tensor,
) -> Result<Tensor> {
    let p = comm.size();
    let &[b, s, g, h, d] = t.shape() else {
        return Err(ParallelError::Shape {
            what: "ulysses exchange",
            shape: t.shape().to_vec(),
            rule: "must be [B, S, G, H, D]",
        });
    };
    // UlyssesShape speaks in the sequence-sharded layout: s_local = S/P and all H heads.
    let (shape, out_shape) = match way {
        UlyssesWay::SeqToHeads => (
            UlyssesShape {
                b,
                s_local: s,
                stack: g,
                h,
                d,
            },
            [b, s * p, g, h / p.max(1), d],
        ),
        UlyssesWay::HeadsToSeq => (
            UlyssesShape {
                b,
                s_local: s / p.max(1),
                stack: g,
                h: h * p,
                d,
            },
            [b, s / p.max(1), g, h * p, d],
        ),
    };
    let input = comm.stage::<T>(t)?;
    let mut output = comm.receive::<T>(t.numel(), t.device())?;
    let mut scratch = comm.alloc::<T>(t.numel())?;
    match way {
        UlyssesWay::SeqToHeads => comm.seq_to_heads(
            view::<C, T>(&input),
            view_mut::<C, T>(&mut output),
            BorrowMut::<C::Buf<T>>::borrow_mut(&mut scratch),
            shape,
        )?,
        UlyssesWay::HeadsToSeq => comm.heads_to_seq(
            view::<C, T>(&input),
            view_mut::<C, T>(&mut output),
            BorrowMut::<C::Buf<T>>::borrow_mut(&mut scratch),
            shape,
        )?,
    }
    comm.tensor::<T>(&output, &out_shape, t.device())
}
