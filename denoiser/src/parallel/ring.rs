//! Ring attention over the cp group: Q stays, K and V (packed in one buffer) travel around the
//! ring, one hop per step, for P steps. Before attending to the block it holds, a rank posts the
//! send of that block to rank+1 and the receive of the next one from rank−1 into a second
//! buffer (double buffer), so the transfer overlaps the attention; the partial (out, LSE) of
//! each block is merged into the accumulator with the online-softmax update in f32.
//!
//! At step i rank r holds the K/V of chunk (r − i) mod P; its real keys are a prefix of the
//! chunk (padding sits at the end of the sequence), masked with `kv_len`, and a chunk with no
//! real key is skipped (it still travels on).

use std::borrow::{Borrow, BorrowMut};

use ditstream_common::by_dtype;
use ditstream_common::collectives::Pending;
use ditstream_common::collectives::wire::{TensorWire, WireElement};
use ditstream_kernels::timeline::mark;
use ditstream_kernels::{AttentionOptions, DType, Tensor, lse_merge_pair};

use super::attention::{ChunkAttention, local_attention};
use super::{Result, valid_in_chunk};

/// Ring attention over `comm` (the cp group, group rank = chunk index).
pub struct RingAttention<'c, C> {
    comm: &'c C,
    tokens: usize,
    fp8: bool,
}

impl<'c, C: TensorWire> RingAttention<'c, C> {
    /// Ring over `comm` for a sequence of `tokens` real tokens.
    pub fn new(comm: &'c C, tokens: usize) -> Self {
        Self {
            comm,
            tokens,
            fp8: false,
        }
    }

    /// The same ring with FP8 attention on each block of keys (`model.dtype: fp8`).
    pub fn with_fp8(self, fp8: bool) -> Self {
        Self { fp8, ..self }
    }
}

impl<C: TensorWire> ChunkAttention for RingAttention<'_, C> {
    fn attend_chunk(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        // K and V travel as one [2, B, S_c, H, D] buffer: one send/recv per step.
        let kv = Tensor::concat(
            &[&k.reshape(&one(k.shape()))?, &v.reshape(&one(v.shape()))?],
            0,
        )?;
        by_dtype!(
            kv.dtype(),
            ring_as::<C>(self.comm, self.tokens, self.fp8, q, &kv)
        )
    }
}

/// `[1]` prepended to a shape.
fn one(shape: &[usize]) -> Vec<usize> {
    std::iter::once(1).chain(shape.iter().copied()).collect()
}

fn ring_as<C: TensorWire, T: WireElement>(
    comm: &C,
    tokens: usize,
    fp8: bool,
    q: &Tensor,
    kv: &Tensor,
) -> Result<Tensor> {
    let (p, r) = (comm.size(), comm.rank());
    let chunk_len = kv.shape()[2];
    let (next_rank, prev_rank) = ((r + 1) % p, (r + p - 1) % p);
    // `current` holds the block we attend to and send on; each hop lands in a fresh buffer (on
    // NCCL a fresh device tensor), so no tensor is ever overwritten.
    let mut current = comm.stage::<T>(kv)?;
    let mut block = kv.clone();
    let mut acc: Option<(Tensor, Tensor)> = None;
    for step in 0..p {
        let last = step + 1 == p;
        let mut incoming = if last {
            None
        } else {
            Some(comm.receive::<T>(kv.numel(), kv.device())?)
        };
        {
            // Post the hop of the block we hold before attending to it; the handle borrows both
            // buffers until it is waited on, at the end of this scope.
            let pending = match incoming.as_mut() {
                None => None,
                Some(incoming) => Some(comm.send_recv(
                    current.borrow(),
                    next_rank,
                    incoming.borrow_mut(),
                    prev_rank,
                )?),
            };
            let chunk = (r + p - step) % p;
            let kv_len = valid_in_chunk(tokens, chunk, chunk_len);
            if kv_len > 0 {
                let shape = &kv.shape()[1..];
                let k = block.narrow(0, 0, 1)?.reshape(shape)?;
                let v = block.narrow(0, 1, 1)?.reshape(shape)?;
                let options = AttentionOptions {
                    scale: None,
                    kv_len: Some(kv_len),
                };
                let (out, lse) = local_attention(fp8, q, &k, &v, options)?;
                // The accumulator stays f32 whatever the model's dtype.
                let out = out.to_dtype(DType::F32)?;
                acc = Some(match acc {
                    None => (out, lse),
                    Some((acc_out, acc_lse)) => lse_merge_pair(&acc_out, &acc_lse, &out, &lse)?,
                });
                mark("self-attention");
            }
            // On a rank's timeline the wait is the part of the hop the attention did not hide.
            if let Some(pending) = pending {
                pending.wait()?;
                mark("send/recv");
            }
        }
        if let Some(incoming) = incoming {
            current = incoming;
            block = comm.tensor::<T>(&current, kv.shape(), kv.device())?;
        }
    }
    match acc {
        Some((out, _)) => Ok(out.to_dtype(q.dtype())?),
        // No chunk held a real key: only possible for an empty sequence.
        None => Ok(Tensor::zeros(q.shape(), q.dtype(), q.device())?),
    }
}
