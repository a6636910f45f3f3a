//! The sequence-parallel forward: every rank of a sequence group embeds the whole input (patch
//! embedding and conditioning are cheap), keeps its [`SeqShard`] of the tokens with the matching
//! RoPE rows and per-token modulation rows (zero-padded to the shard length), runs the blocks
//! with the attention wrapper the mesh calls for, all-gathers the sequence, drops the padding
//! and runs the head. The text for cross-attention is replicated, so cross-attention needs no
//! collective.

use ditstream_common::collectives::wire::{self, TensorWire};
use ditstream_common::mesh::{CpLayout, SeqShard};
use ditstream_kernels::Tensor;

use super::attention::{ChunkAttention, LocalChunk, ModelAttention};
use super::{
    Attention2d, MeshComms, ParallelError, Result, RingAttention, UlyssesAttention, padded_rows,
};
use crate::model::WanTransformer;

/// The attention wrapper for `comms`' mesh, for a sequence of `tokens` real tokens: Ring or
/// Attention2D over the cp axis (or the local attention), inside Ulysses when ulysses_size > 1
/// (async when `comms` says so); with FP8 attention wherever it attends when `fp8`.
pub fn seq_attention<'c, C: TensorWire>(
    comms: &'c MeshComms<C>,
    tokens: usize,
    fp8: bool,
) -> Box<dyn ChunkAttention + 'c> {
    let cp: Box<dyn ChunkAttention + 'c> = match (comms.mesh().cp(), &comms.ring) {
        (CpLayout::Ring(_), Some(ring)) => Box::new(RingAttention::new(ring, tokens).with_fp8(fp8)),
        (CpLayout::Attn2d { .. }, _) => {
            Box::new(Attention2d::new(comms.row.as_ref(), comms.col.as_ref(), tokens).with_fp8(fp8))
        }
        // No cp axis (or a ring of one rank).
        _ => Box::new(LocalChunk { tokens, fp8 }),
    };
    match &comms.ulysses {
        Some(uly) => Box::new(UlyssesAttention::new(uly, cp).with_async(comms.async_ulysses())),
        None => cp,
    }
}

/// The sequence-parallel forward on one rank: x [B, C_in, T, H, W], timestep `[B]` (or [B, L] per
/// token), context [B, S_txt, text_dim] → velocity [B, C_out, T, H, W], the same on every rank of
/// the sequence group and equal to `model.forward` on one rank. Every rank of the group calls it
/// with the same inputs.
pub fn forward<C: TensorWire>(
    model: &WanTransformer,
    comms: &MeshComms<C>,
    x: &Tensor,
    timestep: &Tensor,
    context: &Tensor,
) -> Result<Tensor> {
    forward_with(model, comms, x, timestep, context, |tokens| {
        seq_attention(comms, tokens, model.fp8_attention())
    })
}

/// [`forward`] with the attention wrapper chosen by the caller: `attention(L)` builds it for a
/// sequence of L real tokens (benchmarks of one wrapper, tests).
pub fn forward_with<'c, C: TensorWire>(
    model: &WanTransformer,
    comms: &MeshComms<C>,
    x: &Tensor,
    timestep: &Tensor,
    context: &Tensor,
    attention: impl FnOnce(usize) -> Box<dyn ChunkAttention + 'c>,
) -> Result<Tensor> {
    let (tokens, cond) = model.embed(x, timestep, context)?;
    let &[b, l, d] = tokens.shape() else {
        return Err(ParallelError::Shape {
            what: "embedded tokens",
            shape: tokens.shape().to_vec(),
            rule: "must be [B, L, D]",
        });
    };
    let shard = comms.shard(l);
    let rows = |t: &Tensor, axis| padded_rows(t, axis, shard.start, shard.valid, shard.shard_len);
    let mut h = rows(&tokens, 1)?;
    let rope_cos = rows(&cond.rope_cos, 0)?;
    let rope_sin = rows(&cond.rope_sin, 0)?;
    let timestep_proj = if cond.timestep_proj.rank() == 4 {
        rows(&cond.timestep_proj, 1)? // per-token [B, L, 6, D]
    } else {
        cond.timestep_proj.clone()
    };

    let wrapper = attention(l);
    let attn = ModelAttention::new(wrapper.as_ref());
    for i in 0..model.num_blocks() {
        h = model
            .block(i, &h, &cond, &rope_cos, &rope_sin, &timestep_proj, &attn)
            .map_err(|e| attn.take_error(e))?;
    }

    let all = gather_sequence(comms, &h, shard, [b, l, d])?;
    Ok(model.head(&all, &cond.temb, cond.grid)?)
}

/// This rank's shard [B, shard_len, D] → the real tokens of every shard in order [B, L, D].
fn gather_sequence<C: TensorWire>(
    comms: &MeshComms<C>,
    h: &Tensor,
    shard: SeqShard,
    [b, l, d]: [usize; 3],
) -> Result<Tensor> {
    let Some(seq) = &comms.seq else {
        return Ok(h.narrow(1, 0, l)?);
    };
    let gathered = wire::all_gather(seq, h)?; // [P, B, shard_len, D]
    let p = seq.size();
    let padded = if b == 1 {
        gathered.reshape(&[1, p * shard.shard_len, d])?
    } else {
        gathered
            .permute(&[1, 0, 2, 3])?
            .reshape(&[b, p * shard.shard_len, d])?
    };
    if p * shard.shard_len < l {
        return Err(ParallelError::Mesh {
            mesh: comms.mesh().to_string(),
            what: "seq_size",
            value: p,
            rule: format!("the sequence group does not cover {l} tokens"),
        });
    }
    Ok(padded.narrow(1, 0, l)?)
}
