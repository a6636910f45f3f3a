//! Ulysses attention: the sequence is sharded everywhere but here. q, k and v of this rank's
//! sequence shard are stacked `[B, S/P, 3, H, D]` and one all-to-all turns them into the whole
//! chunk of the Ulysses group for H/P heads `[B, S, 3, H/P, D]`; the inner attention runs on
//! that; one all-to-all brings the output back to `[B, S/P, H, D]`. P must divide H.
//!
//! The model applies the q/k RMSNorm (across all heads) and RoPE on the local shard before this
//! is called, as the all-to-all only moves heads.
//!
//! The inner attention is [`LocalChunk`](super::LocalChunk) without context parallelism, or a
//! Ring / Attention2D wrapper over the cp group (Ulysses outer): the Ulysses group's ranks hold
//! consecutive shards (`seq_rank = cp_rank·U + uly`), so after the exchange each holds chunk
//! `cp_rank` of length U·S/P, which is what the inner wrapper expects.
//!
//! Shaped for async Ulysses later: [`UlyssesAttention::scatter_qkv`] and
//! [`UlyssesAttention::gather_out`] are the two exchanges; an async variant pushes V, Q and K
//! separately as the projections produce them and joins before the inner attention.

use std::borrow::{Borrow, BorrowMut};

use ditstream_common::by_dtype;
use ditstream_common::collectives::wire::{TensorWire, WireElement};
use ditstream_common::collectives::{UlyssesExt, UlyssesShape};
use ditstream_kernels::Tensor;

use super::attention::ChunkAttention;
use super::{ParallelError, Result};

/// Ulysses over `comm` (the Ulysses group) around `inner`.
pub struct UlyssesAttention<'c, C, I> {
    comm: &'c C,
    inner: I,
}

impl<'c, C: TensorWire, I: ChunkAttention> UlyssesAttention<'c, C, I> {
    /// Ulysses over `comm` around `inner`.
    pub fn new(comm: &'c C, inner: I) -> Self {
        Self { comm, inner }
    }

    /// q, k, v [B, S/P, H, D] → (q, k, v) [B, S, H/P, D] (this rank's head group over the
    /// group's whole chunk) through one all-to-all of the stacked [B, S/P, 3, H, D].
    pub fn scatter_qkv(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let &[b, s, h, d] = q.shape() else {
            return Err(shape_error(q));
        };
        let p = self.comm.size();
        if !h.is_multiple_of(p) {
            return Err(ParallelError::Collective(
                ditstream_common::collectives::CollectiveError::HeadsNotDivisible {
                    heads: h,
                    size: p,
                },
            ));
        }
        let stack = |t: &Tensor| t.reshape(&[b, s, 1, h, d]);
        let qkv = Tensor::concat(&[&stack(q)?, &stack(k)?, &stack(v)?], 2)?;
        let by_heads = exchange(self.comm, UlyssesWay::SeqToHeads, &qkv)?;
        let part =
            |i| -> Result<Tensor> { Ok(by_heads.narrow(2, i, 1)?.reshape(&[b, s * p, h / p, d])?) };
        Ok((part(0)?, part(1)?, part(2)?))
    }

    /// out [B, S, H/P, D] → [B, S/P, H, D] through one all-to-all.
    pub fn gather_out(&self, out: &Tensor) -> Result<Tensor> {
        let &[b, s, h, d] = out.shape() else {
            return Err(shape_error(out));
        };
        let p = self.comm.size();
        let back = exchange(
            self.comm,
            UlyssesWay::HeadsToSeq,
            &out.reshape(&[b, s, 1, h, d])?,
        )?;
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
        let (q, k, v) = self.scatter_qkv(q, k, v)?;
        let out = self.inner.attend_chunk(&q, &k, &v)?;
        self.gather_out(&out)
    }
}

/// Which way a Ulysses exchange goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum UlyssesWay {
    /// [B, S/P, G, H, D] → [B, S, G, H/P, D].
    SeqToHeads,
    /// [B, S, G, H/P, D] → [B, S/P, G, H, D].
    HeadsToSeq,
}

/// One Ulysses exchange of a 5-D tensor (see [`UlyssesExt`]) in its own dtype; `t` is in the input
/// layout of `way`. The tensor crosses the communicator as every other does ([`TensorWire`]: on
/// NCCL its device storage, in place).
fn exchange<C: TensorWire>(comm: &C, way: UlyssesWay, t: &Tensor) -> Result<Tensor> {
    let out = by_dtype!(t.dtype(), exchange_as::<C>(comm, way, t))?;
    // The Ulysses all-to-all on a rank's timeline, as the collectives of `wire` mark theirs.
    ditstream_kernels::timeline::mark("all-to-all");
    Ok(out)
}

fn exchange_as<C: TensorWire, T: WireElement>(
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
            input.borrow(),
            output.borrow_mut(),
            scratch.borrow_mut(),
            shape,
        )?,
        UlyssesWay::HeadsToSeq => comm.heads_to_seq(
            input.borrow(),
            output.borrow_mut(),
            scratch.borrow_mut(),
            shape,
        )?,
    }
    Ok(comm.tensor::<T>(&output, &out_shape, t.device())?)
}
