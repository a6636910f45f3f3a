//! Ulysses attention: the sequence is sharded everywhere but here. Each of q, k and v of this
//! rank's sequence shard `[B, S/P, H, D]` crosses one all-to-all that turns it into the whole
//! chunk of the Ulysses group for H/P heads `[B, S, H/P, D]`; the inner attention runs on that;
//! one all-to-all brings the output back to `[B, S/P, H, D]`. P must divide H.
//!
//! The model applies the q/k RMSNorm (across all heads) and RoPE on the local shard before this
//! is called, as the all-to-all only moves heads.
//!
//! The inner attention is [`LocalChunk`](super::LocalChunk) without context parallelism, or a
//! Ring / Attention2D wrapper over the cp group (Ulysses outer): the Ulysses group's ranks hold
//! consecutive shards (`seq_rank = cp_rank·U + uly`), so after the exchange each holds chunk
//! `cp_rank` of length U·S/P, which is what the inner wrapper expects.
//!
//! The three exchanges are posted ([`UlyssesExt::seq_to_heads_posted`]) in the order V, Q, K and
//! waited once, before the inner attention. Each operand travels on its own, so nothing is
//! stacked before the all-to-all or cut apart after it (the only copy is the all-to-all's own
//! pack, and with B > 1 its unpack). With async Ulysses (`parallel_config.async_ulysses`) the
//! model's projections run between the posts ([`ChunkAttention::attend_chunk_staged`]): V is
//! projected and posted, then Q is projected while V travels, then K while Q travels, as the
//! seed's design (TensorRT-LLM VisualGen) schedules it. Without it, the three projections run
//! first and the three exchanges follow. Both schedules compute the same values: the
//! projections and the exchanges are the same operations, only their order on the host differs.
//!
//! On NCCL the exchanges run on the communicator's stream, ordered after the kernels that
//! produced each operand by an event (common's `wire`), so V's all-to-all overlaps Q's GEMM on the
//! GPU; before it queues the attention, the host waits for the exchanges (the first wait covers
//! all three), queues the unpacks (batch > 1) and synchronises once more.

use std::borrow::{Borrow, BorrowMut};

use ditstream_common::by_dtype;
use ditstream_common::collectives::wire::{TensorWire, WireElement};
use ditstream_common::collectives::{Pending, UlyssesExt, UlyssesShape};
use ditstream_kernels::Tensor;

use super::attention::{ChunkAttention, StagedOperand, given};
use super::{ParallelError, Result};
use crate::model::Operand;

/// Ulysses over `comm` (the Ulysses group) around `inner`.
pub struct UlyssesAttention<'c, C, I> {
    comm: &'c C,
    inner: I,
    overlap: bool,
}

impl<'c, C: TensorWire, I: ChunkAttention> UlyssesAttention<'c, C, I> {
    /// Ulysses over `comm` around `inner`, projections first, then the exchanges.
    pub fn new(comm: &'c C, inner: I) -> Self {
        Self {
            comm,
            inner,
            overlap: false,
        }
    }

    /// The same with async Ulysses on or off: each exchange posted as soon as its projection is
    /// done, under the next projection (module docs).
    pub fn with_async(mut self, on: bool) -> Self {
        self.overlap = on;
        self
    }

    /// out [B, S, H/P, D] → [B, S/P, H, D] through one all-to-all.
    pub fn gather_out(&self, out: &Tensor) -> Result<Tensor> {
        let &[b, s, h, d] = out.shape() else {
            return Err(shape_error(out));
        };
        let p = self.comm.size();
        let back = heads_to_seq(self.comm, &out.reshape(&[b, s, 1, h, d])?)?;
        Ok(back.reshape(&[b, s / p, h * p, d])?)
    }
}

fn shape_error(t: &Tensor) -> ParallelError {
    ParallelError::Shape {
        what: "ulysses attention input",
        shape: t.shape().to_vec(),
        rule: "must be [B, S, H, D]",
    }
}

impl<C: TensorWire, I: ChunkAttention> ChunkAttention for UlyssesAttention<'_, C, I> {
    fn attend_chunk(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        self.attend_chunk_staged(&mut given(q, k, v))
    }

    fn attend_chunk_staged(&self, operand: &mut StagedOperand<'_>) -> Result<Tensor> {
        let [q, k, v] = if self.overlap {
            let v = operand(Operand::V)?;
            by_dtype!(v.dtype(), scatter_posted::<C>(self.comm, v, operand))?
        } else {
            let (q, k, v) = (
                operand(Operand::Q)?,
                operand(Operand::K)?,
                operand(Operand::V)?,
            );
            by_dtype!(
                v.dtype(),
                scatter_posted::<C>(self.comm, v.clone(), &mut given(&q, &k, &v))
            )?
        };
        // The exchanges on a rank's timeline, as the collectives of `wire` mark theirs: with async
        // Ulysses this interval is what the projections did not hide.
        ditstream_kernels::timeline::mark("all-to-all");
        let out = self.inner.attend_chunk(&q, &k, &v)?;
        self.gather_out(&out)
    }
}

/// The three sequence → heads exchanges, posted in the order V, Q, K: `v` [B, S/P, H, D] is
/// posted first, then `next(Q)` and `next(K)` are asked for (they must have v's shape) and each
/// posted as soon as it is there; all are waited at the end. Returns [q, k, v], each
/// [B, S, H/P, D].
fn scatter_posted<C: TensorWire, T: WireElement>(
    comm: &C,
    v: Tensor,
    next: &mut StagedOperand<'_>,
) -> Result<[Tensor; 3]> {
    let &[b, s, h, d] = v.shape() else {
        return Err(shape_error(&v));
    };
    let p = comm.size();
    let shape = UlyssesShape::bshd(b, s, h, d);
    let (n, device) = (v.numel(), v.device());
    // Every buffer first: the pending exchanges borrow them until the wait.
    let mut outputs = [
        comm.receive::<T>(n, device)?,
        comm.receive::<T>(n, device)?,
        comm.receive::<T>(n, device)?,
    ];
    let mut scratch = [
        comm.alloc::<T>(n)?,
        comm.alloc::<T>(n)?,
        comm.alloc::<T>(n)?,
    ];
    // The staged inputs live until the end, after the wait (on NCCL they hold the operands'
    // storage, which the communicator's stream reads until the exchange is done).
    let mut staged: [Option<C::Held<T>>; 3] = [None, None, None];
    let mut first = Some(v.clone());
    let mut sent = Vec::with_capacity(3);
    let slots = staged
        .iter_mut()
        .zip(outputs.iter_mut())
        .zip(scratch.iter_mut());
    for (((slot, out), scratch), which) in slots.zip([Operand::V, Operand::Q, Operand::K]) {
        let t = match first.take() {
            Some(v) => v,
            None => next(which)?,
        };
        if t.shape() != v.shape() {
            return Err(shape_error(&t));
        }
        let input = slot.insert(comm.stage::<T>(&t)?);
        sent.push(comm.seq_to_heads_posted(
            (*input).borrow(),
            out.borrow_mut(),
            scratch.borrow_mut(),
            shape,
        )?);
    }
    // Waited in the order posted, as the contract asks (on NCCL the first wait already covers
    // all three: the communicator's stream runs them in order).
    for posted in sent {
        posted.wait()?;
    }

    // The three unpacks (batch > 1) queued, then one synchronisation for all of them.
    for (out, scratch) in outputs.iter_mut().zip(scratch.iter_mut()) {
        comm.seq_to_heads_finish(out.borrow_mut(), scratch.borrow_mut(), shape)?;
    }
    comm.synchronize()?;
    let by_heads = [b, s * p, h / p, d];
    let [v, q, k] = &outputs;
    Ok([
        comm.tensor::<T>(q, &by_heads, device)?,
        comm.tensor::<T>(k, &by_heads, device)?,
        comm.tensor::<T>(v, &by_heads, device)?,
    ])
}

/// The heads → sequence exchange of a 5-D tensor (see [`UlyssesExt`]) in its own dtype:
/// `t` [B, S, G, H/P, D] → [B, S/P, G, H, D]. The tensor crosses the communicator as every other
/// does ([`TensorWire`]: on NCCL its device storage, in place).
fn heads_to_seq<C: TensorWire>(comm: &C, t: &Tensor) -> Result<Tensor> {
    let out = by_dtype!(t.dtype(), heads_to_seq_as::<C>(comm, t))?;
    // The Ulysses all-to-all on a rank's timeline, as the collectives of `wire` mark theirs.
    ditstream_kernels::timeline::mark("all-to-all");
    Ok(out)
}

fn heads_to_seq_as<C: TensorWire, T: WireElement>(comm: &C, t: &Tensor) -> Result<Tensor> {
    let p = comm.size();
    let &[b, s, g, h, d] = t.shape() else {
        return Err(ParallelError::Shape {
            what: "ulysses exchange",
            shape: t.shape().to_vec(),
            rule: "must be [B, S, G, H, D]",
        });
    };
    // UlyssesShape speaks in the sequence-sharded layout: s_local = S/P and all H heads.
    let shape = UlyssesShape {
        b,
        s_local: s / p,
        stack: g,
        h: h * p,
        d,
    };
    let input = comm.stage::<T>(t)?;
    let mut output = comm.receive::<T>(t.numel(), t.device())?;
    let mut scratch = comm.alloc::<T>(t.numel())?;
    comm.heads_to_seq(
        input.borrow(),
        output.borrow_mut(),
        scratch.borrow_mut(),
        shape,
    )?;
    Ok(comm.tensor::<T>(&output, &[b, s / p, g, h * p, d], t.device())?)
}
