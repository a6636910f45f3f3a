//! Tensors through the parallel VAE's communicator: the one place in the decoder that turns a
//! [`Tensor`] into the backend's buffers and back ([`TensorWire`]). Halos, gathered keys/values and
//! decoded bands move in the tensor's own dtype (bf16 halos stay bf16: half the bytes, and no
//! rounding a bf16 decode would not do anyway).
//!
//! - CPU thread backend, and any tensor in host memory: a buffer is an `upload` of the tensor's values
//!   and the result a `download` (host copies), moved back to the input's device.
//! - NCCL backend with tensors on the communicator's GPU: no host round trip and no copy. The buffer
//!   handed to NCCL *is* the tensor's device storage (a `CudaSlice` view over its address that never
//!   frees it, holding a clone of the tensor so the storage outlives the transfer); results are
//!   received straight into a fresh, unfilled device tensor that becomes the output. Before NCCL
//!   touches a storage, the communicator's stream waits on an event recorded on the kernels' stream
//!   (the producers of a staged tensor, and the stream-ordered allocation of a receive tensor, come
//!   first); NCCL operations return only once their stream has drained (a `send_recv` once waited),
//!   so kernels queued afterwards read complete data; a staged tensor's storage is freed on the
//!   kernels' stream after the transfer completed on the host's clock.
//!
//! This mirrors the denoiser's `parallel/wire.rs` (same names, same stream contract), which the
//! decoder cannot import: neither model crate depends on the other, and the trait needs both the
//! kernels' [`Tensor`] and common's [`Communicator`]. One shared home for both is a follow-up.

use std::borrow::{Borrow, BorrowMut};

use ditstream_common::collectives::cpu::CpuComm;
use ditstream_common::collectives::{Communicator, Element, Pending};
use ditstream_kernels::{DType, Device, Tensor};
use half::bf16;

use crate::vae::Result;

/// An element type a tensor travels in (f32 or bf16).
pub trait WireElement: Element {
    /// The tensor dtype of this element type.
    const TENSOR_DTYPE: DType;
    /// The tensor's values in this type (the tensor has this dtype).
    fn host(t: &Tensor) -> Result<Vec<Self>>;
    /// A host tensor of this dtype from values.
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
/// received buffer a tensor. Implemented for the CPU thread backend (host copies) and, with feature
/// `cuda`, the NCCL backend (device tensors as device buffers, no copy; module docs).
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
    use ditstream_kernels::{Device, KernelError, Tensor};

    use super::{TensorWire, WireElement, host_receive, host_stage, host_tensor};
    use crate::vae::{Result, VaeError};

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

    fn cuda_error(call: &'static str, detail: impl std::fmt::Debug) -> VaeError {
        VaeError::Collective(CollectiveError::Cuda {
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
            Device::Cuda(o) => Err(cuda_error(
                "tensor placement",
                format!("a tensor on cuda:{o} reached a communicator on cuda:{mine}"),
            )),
        }
    }

    /// The communicator's stream waits (on the GPU, the host does not block) for everything queued
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
        if t.numel() == 0 {
            return Ok(DeviceBuf::Owned(comm.alloc::<T>(0)?));
        }
        if t.dtype() != T::TENSOR_DTYPE {
            return Err(KernelError::DTypeMismatch {
                op: "parallel VAE transfer",
                name: "tensor",
                expected: T::TENSOR_DTYPE,
                got: t.dtype(),
            }
            .into());
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
            DType::BF16 => $f::<$c, bf16>($($arg),*),
        }
    };
}

/// Sends `t` to group rank `to` and receives a tensor of `shape` (t's dtype, on t's device) from
/// group rank `from`, in one `send_recv`.
pub(crate) fn send_recv<C: TensorWire>(
    comm: &C,
    t: &Tensor,
    to: usize,
    shape: &[usize],
    from: usize,
) -> Result<Tensor> {
    by_dtype!(t, send_recv_as::<C>(comm, t, to, shape, from))
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

/// Sends `t` to group rank `to`, receiving nothing (the peer calls [`recv`] with t's shape and dtype).
pub(crate) fn send<C: TensorWire>(comm: &C, t: &Tensor, to: usize) -> Result<()> {
    by_dtype!(t, send_as::<C>(comm, t, to))
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
pub(crate) fn recv<C: TensorWire>(
    comm: &C,
    shape: &[usize],
    dtype: DType,
    device: Device,
    from: usize,
) -> Result<Tensor> {
    match dtype {
        DType::F32 => recv_as::<C, f32>(comm, shape, device, from),
        DType::BF16 => recv_as::<C, bf16>(comm, shape, device, from),
    }
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

/// Uneven all-gather: `t` (this rank's `counts[rank]` elements) → [Σ counts] flat, rank i's values at
/// offset Σ_{j<i} counts[j], in t's dtype on t's device.
pub(crate) fn all_gather_v<C: TensorWire>(
    comm: &C,
    t: &Tensor,
    counts: &[usize],
) -> Result<Tensor> {
    by_dtype!(t, all_gather_v_as::<C>(comm, t, counts))
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use ditstream_common::collectives::cpu::CpuWorld;

    use super::*;

    /// What rank `r` expects after the one-way transfer: rank 1's tensor (its own on rank 1).
    fn theirs_or_mine(r: usize, theirs: &Tensor, mine: &Tensor) -> anyhow::Result<Vec<f32>> {
        Ok(if r == 0 { theirs } else { mine }.to_vec_f32()?)
    }

    /// Through the thread backend a tensor keeps its dtype and values (bf16 stays bf16, exactly).
    #[test]
    fn transfers_keep_dtype_and_values() -> anyhow::Result<()> {
        let world = CpuWorld::new(2).with_timeout(Duration::from_secs(30));
        let out = world.run(|rank| -> anyhow::Result<(Tensor, Tensor, Tensor)> {
            let comm = rank.group(&[0, 1])?;
            let r = comm.rank();
            let mine = Tensor::randn(&[2, 3], DType::BF16, r as u64, Device::Cpu)?;
            let theirs = send_recv(&comm, &mine, 1 - r, &[2, 3], 1 - r)?;
            let counts = [6, 3];
            let part = mine.reshape(&[6])?.narrow(0, 0, counts[r])?;
            let all = all_gather_v(&comm, &part, &counts)?;
            // One-way: rank 1 sends its tensor to rank 0.
            let one_way = if r == 1 {
                send(&comm, &mine, 0)?;
                mine.clone()
            } else {
                recv(&comm, &[2, 3], DType::BF16, Device::Cpu, 1)?
            };
            anyhow::ensure!(one_way.to_vec_f32()? == theirs_or_mine(r, &theirs, &mine)?);
            // No rank leaves (drops its communicator) while the other may still be gathering.
            comm.barrier()?;
            Ok((mine, theirs, all))
        });
        let [Ok(Ok((m0, t0, a0))), Ok(Ok((m1, t1, a1)))] = out.as_slice() else {
            let why: Vec<String> = out
                .iter()
                .map(|r| match r {
                    Ok(Ok(_)) => "ok".into(),
                    Ok(Err(e)) => format!("{e:#}"),
                    Err(panic) => panic.clone(),
                })
                .collect();
            anyhow::bail!("a rank failed: {why:?}");
        };
        for t in [t0, t1, a0, a1] {
            assert_eq!(t.dtype(), DType::BF16);
        }
        assert_eq!(t0.to_vec_f32()?, m1.to_vec_f32()?);
        assert_eq!(t1.to_vec_f32()?, m0.to_vec_f32()?);
        let mut expected = m0.to_vec_f32()?;
        expected.extend(&m1.to_vec_f32()?[..3]);
        assert_eq!(a0.to_vec_f32()?, expected);
        assert_eq!(a1.to_vec_f32()?, expected);
        Ok(())
    }
}
