//! Softmax of attention logits with T5's additive relative-position bias and a key-padding mask, fused
//! into one pass: what T5/umT5 self-attention does between its two GEMMs (`scores += position_bias +
//! mask; softmax(scores.float())`). The kernels' fused [`attention`](crate::attention) takes neither a
//! bias nor a mask, so T5 attention is `matmul` → this → `matmul`.

pub(crate) mod cpu;
#[cfg(feature = "cuda")]
pub(super) mod cuda;
#[cfg(test)]
mod tests;

#[cfg(not(feature = "cuda"))]
use super::unsupported;
use super::{dims, same_device};
use crate::{Device, Indices, KernelError, Result, Tensor};

/// What a masked key gets added to its logit: transformers' mask value (`torch.finfo(float32).min`),
/// so that a row with no valid key comes out uniform as there, and any other row gives masked keys
/// exactly zero weight.
pub(crate) const MASKED: f32 = f32::MIN;

/// Softmax over the keys of `logits + position bias + padding mask`, maths in f32:
///
/// - logits [B, H, S_q, S_k] (f32 or bf16; T5 does not scale them by 1/√d);
/// - table [NB, H] (`relative_attention_bias.weight`, f32 or bf16);
/// - buckets [S_q + S_k − 1]: the bucket of relative position r = k − q at index r + S_q − 1, each < NB
///   (the host computes them: transformers' bucket formula is an f32 logarithm whose value lands exactly
///   on bucket edges at some distances, so it is evaluated once, bit for bit, not per element);
/// - valid_lens `[B]`, each ≤ S_k: keys k ≥ `valid_lens[b]` get `MASKED` (`f32::MIN`) added;
///
/// → weights [B, H, S_q, S_k] in logits' dtype,
/// `softmax_k(logits[b, h, q, k] + (table[buckets[k − q + S_q − 1], h] + mask[b, k]))`.
pub fn position_bias_softmax(
    logits: &Tensor,
    table: &Tensor,
    buckets: &Indices,
    valid_lens: &Indices,
) -> Result<Tensor> {
    const OP: &str = "position_bias_softmax";
    let [batch, heads, seq_q, seq_k] = dims(OP, "logits [B, H, S_q, S_k]", logits)?;
    let [num_buckets, table_heads] = dims(OP, "table [NB, H]", table)?;
    if table_heads != heads {
        return Err(KernelError::shape(
            OP,
            "table [NB, H] must have one column per head of logits [B, H, S_q, S_k]",
            &[logits.shape(), table.shape()],
        ));
    }
    let rel_positions = (seq_q + seq_k).saturating_sub(1);
    let checks = [
        (
            "buckets",
            buckets,
            rel_positions,
            num_buckets,
            "S_q + S_k − 1",
            "NB",
        ),
        ("valid_lens", valid_lens, batch, seq_k + 1, "B", "S_k + 1"),
    ];
    for (name, idx, len, bound, len_rule, bound_rule) in checks {
        if idx.len() != len || idx.bound() > bound {
            return Err(KernelError::arg(
                OP,
                name,
                format!("{} values < {}", idx.len(), idx.bound()),
                format!(
                    "logits {:?} and table {:?} need {len_rule} = {len} values, each < {bound_rule} = {bound}",
                    logits.shape(),
                    table.shape()
                ),
            ));
        }
        if idx.device() != logits.device() {
            return Err(KernelError::DeviceMismatch {
                op: OP,
                first: logits.device(),
                other: idx.device(),
            });
        }
    }
    let dims = cpu::Dims {
        batch,
        heads,
        seq_q,
        seq_k,
    };
    match same_device(OP, &[logits, table])? {
        Device::Cpu => {
            let out = cpu::position_bias_softmax(
                &logits.cpu_f32(OP)?,
                &table.cpu_f32(OP)?,
                buckets.cpu(OP)?,
                valid_lens.cpu(OP)?,
                dims,
            );
            Tensor::from_f32_cpu(out, logits.shape(), logits.dtype())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            cuda::position_bias_softmax(OP, logits, table, buckets, valid_lens, dims)
        }
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => unsupported(OP, device),
    }
}
