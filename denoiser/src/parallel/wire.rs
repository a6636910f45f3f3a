//! Tensors through a [`Communicator`]: the one place that turns a [`Tensor`] into the backend's
//! buffers and back. Collectives move the tensor's own dtype (bf16 halves the traffic), LSE
//! moves as f32.
//!
//! Today tensors live on the host, so a buffer is an `upload` of the tensor's values and the
//! result a `download` (a copy on the CPU backend; a host round trip on NCCL). When tensors get
//! device storage, only this file changes: the buffer becomes the tensor's own storage.

use std::borrow::{Borrow, BorrowMut};

use ditstream_common::collectives::{Communicator, Element, UlyssesExt, UlyssesShape};
use ditstream_kernels::{DType, Tensor};
use half::bf16;

use super::{ParallelError, Result};

/// An element type a tensor travels in.
pub(crate) trait WireElement: Element {
    /// The tensor's values in this type (the tensor has this dtype).
    fn host(t: &Tensor) -> Result<Vec<Self>>;
    /// A tensor of this dtype from values.
    fn tensor(values: Vec<Self>, shape: &[usize]) -> Result<Tensor>;
}

impl WireElement for f32 {
    fn host(t: &Tensor) -> Result<Vec<f32>> {
        Ok(t.to_vec_f32()?)
    }
    fn tensor(values: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
        Ok(Tensor::from_vec(values, shape)?)
    }
}

impl WireElement for bf16 {
    fn host(t: &Tensor) -> Result<Vec<bf16>> {
        Ok(t.to_vec_bf16()?)
    }
    fn tensor(values: Vec<bf16>, shape: &[usize]) -> Result<Tensor> {
        Ok(Tensor::from_bf16_vec(values, shape)?)
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

/// The borrowed view of an owned buffer.
pub(crate) fn view<C: Communicator, T: Element>(owned: &C::Owned<T>) -> &C::Buf<T> {
    owned.borrow()
}

/// The mutable view of an owned buffer.
pub(crate) fn view_mut<C: Communicator, T: Element>(owned: &mut C::Owned<T>) -> &mut C::Buf<T> {
    owned.borrow_mut()
}

/// A buffer holding `t`'s values.
pub(crate) fn upload<C: Communicator, T: WireElement>(comm: &C, t: &Tensor) -> Result<C::Owned<T>> {
    Ok(comm.upload(&T::host(t)?)?)
}

/// A tensor of `shape` from a buffer.
pub(crate) fn download<C: Communicator, T: WireElement>(
    comm: &C,
    buf: &C::Owned<T>,
    shape: &[usize],
) -> Result<Tensor> {
    T::tensor(comm.download(view::<C, T>(buf))?, shape)
}

/// `[P]` prepended to a shape.
fn stacked(p: usize, shape: &[usize]) -> Vec<usize> {
    std::iter::once(p).chain(shape.iter().copied()).collect()
}

/// all_gather: t [..] on every rank → [P, ..], entry i from group rank i.
pub(crate) fn all_gather<C: Communicator>(comm: &C, t: &Tensor) -> Result<Tensor> {
    by_dtype!(t, all_gather_as::<C>(comm, t))
}

fn all_gather_as<C: Communicator, T: WireElement>(comm: &C, t: &Tensor) -> Result<Tensor> {
    let send = upload::<C, T>(comm, t)?;
    let mut recv = comm.alloc::<T>(t.numel() * comm.size())?;
    comm.all_gather(view::<C, T>(&send), view_mut::<C, T>(&mut recv))?;
    download::<C, T>(comm, &recv, &stacked(comm.size(), t.shape()))
}

/// all_to_all: t [P, ..] (entry j goes to group rank j) → [P, ..] (entry i came from rank i).
pub(crate) fn all_to_all<C: Communicator>(comm: &C, t: &Tensor) -> Result<Tensor> {
    by_dtype!(t, all_to_all_as::<C>(comm, t))
}

fn all_to_all_as<C: Communicator, T: WireElement>(comm: &C, t: &Tensor) -> Result<Tensor> {
    let send = upload::<C, T>(comm, t)?;
    let mut recv = comm.alloc::<T>(t.numel())?;
    comm.all_to_all(view::<C, T>(&send), view_mut::<C, T>(&mut recv))?;
    download::<C, T>(comm, &recv, t.shape())
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
pub(crate) fn ulysses<C: Communicator>(comm: &C, way: UlyssesWay, t: &Tensor) -> Result<Tensor> {
    by_dtype!(t, ulysses_as::<C>(comm, way, t))
}

fn ulysses_as<C: Communicator, T: WireElement>(
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
    let input = upload::<C, T>(comm, t)?;
    let mut output = comm.alloc::<T>(t.numel())?;
    let mut scratch = comm.alloc::<T>(t.numel())?;
    match way {
        UlyssesWay::SeqToHeads => comm.seq_to_heads(
            view::<C, T>(&input),
            view_mut::<C, T>(&mut output),
            view_mut::<C, T>(&mut scratch),
            shape,
        )?,
        UlyssesWay::HeadsToSeq => comm.heads_to_seq(
            view::<C, T>(&input),
            view_mut::<C, T>(&mut output),
            view_mut::<C, T>(&mut scratch),
            shape,
        )?,
    }
    download::<C, T>(comm, &output, &out_shape)
}
