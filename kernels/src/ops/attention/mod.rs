//! Attention forward with log-sum-exp, and the two ways of merging partial attentions over disjoint key
//! sets: the k-way LSE combine (Attention2D) and Ring's two-partial online-softmax update.

pub(crate) mod cpu;
#[cfg(feature = "cuda")]
pub(super) mod cuda;
#[cfg(feature = "cuda")]
mod flash;
#[cfg(feature = "cuda")]
pub(crate) mod hopper;
#[cfg(test)]
mod tests;

#[cfg(not(feature = "cuda"))]
use super::unsupported;
use super::{dims, expect_rank, same_device};
use crate::{DType, Device, KernelError, Result, Tensor};

/// Options of [`attention`]; `Default` is Wan's self-attention (scale 1/√D, every key valid).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AttentionOptions {
    /// Softmax scale applied to q·k; `None` means 1/√D.
    pub scale: Option<f32>,
    /// Number of valid keys: keys at index ≥ `kv_len` are masked out (padding). `None` means all S_k.
    pub kv_len: Option<usize>,
}

/// Non-causal scaled-dot-product attention that also returns the log-sum-exp.
///
/// q [B, S_q, H, D], k and v [B, S_k, H, D] (one dtype, f32 or bf16) → out [B, S_q, H, D] in q's dtype,
/// lse [B, H, S_q] f32 with lse = ln Σ_j exp(scale·q·k_j) (natural log) over the valid keys; f32
/// accumulation throughout. With no valid key (`kv_len = 0`) out is 0 and lse is −∞.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    options: AttentionOptions,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "attention";
    let [batch, seq_q, heads, head_dim] = dims(OP, "q [B, S_q, H, D]", q)?;
    let [_, seq_k, _, _] = dims(OP, "k [B, S_k, H, D]", k)?;
    if k.shape() != [batch, seq_k, heads, head_dim] || v.shape() != k.shape() {
        return Err(KernelError::shape(
            OP,
            "q [B, S_q, H, D], k and v [B, S_k, H, D]",
            &[q.shape(), k.shape(), v.shape()],
        ));
    }
    for (name, t) in [("k", k), ("v", v)] {
        if t.dtype() != q.dtype() {
            return Err(KernelError::DTypeMismatch {
                op: OP,
                name,
                expected: q.dtype(),
                got: t.dtype(),
            });
        }
    }
    let kv_len = options.kv_len.unwrap_or(seq_k);
    if kv_len > seq_k {
        return Err(KernelError::arg(
            OP,
            "kv_len",
            kv_len,
            format!("it must not exceed S_k = {seq_k}"),
        ));
    }
    let scale = options.scale.unwrap_or(1.0 / (head_dim as f32).sqrt());
    match same_device(OP, &[q, k, v])? {
        Device::Cpu => {
            let (out, lse) = cpu::attention(
                &q.cpu_f32(OP)?,
                &k.cpu_f32(OP)?,
                &v.cpu_f32(OP)?,
                cpu::AttentionDims {
                    batch,
                    seq_q,
                    seq_k,
                    heads,
                    head_dim,
                },
                scale,
                kv_len,
            );
            Ok((
                Tensor::from_f32_cpu(out, q.shape(), q.dtype())?,
                Tensor::from_f32_cpu(lse, &[batch, heads, seq_q], DType::F32)?,
            ))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::attention(
            OP,
            (q, k, v),
            [batch, seq_q, seq_k, heads, head_dim],
            scale,
            kv_len,
        ),
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => unsupported(OP, device),
    }
}

/// Checks one (out [B, S, H, D], lse [B, H, S] f32) partial against the first partial's shape.
fn check_partial(op: &'static str, first_out: &Tensor, out: &Tensor, lse: &Tensor) -> Result<()> {
    expect_rank(op, "out [B, S, H, D]", first_out, 4)?;
    let s = first_out.shape();
    if out.shape() != s || lse.shape() != [s[0], s[2], s[1]] {
        return Err(KernelError::shape(
            op,
            "every partial must be out [B, S, H, D] with lse [B, H, S], all of one shape",
            &[first_out.shape(), out.shape(), lse.shape()],
        ));
    }
    if lse.dtype() != DType::F32 {
        return Err(KernelError::DTypeMismatch {
            op,
            name: "lse",
            expected: DType::F32,
            got: lse.dtype(),
        });
    }
    Ok(())
}

/// Combines k partial attentions of the same queries over disjoint key sets (Attention2D):
/// lse = ln Σ_i exp(lse_i), out = Σ_i exp(lse_i − lse)·out_i.
///
/// parts: k ≥ 1 pairs (out_i [B, S, H, D], lse_i [B, H, S] f32) → (out [B, S, H, D] in the first out's
/// dtype, lse [B, H, S] f32). Partials with lse = −∞ (no valid key) contribute nothing.
pub fn lse_combine(parts: &[(&Tensor, &Tensor)]) -> Result<(Tensor, Tensor)> {
    const OP: &str = "lse_combine";
    let Some(&(first_out, first_lse)) = parts.first() else {
        return Err(KernelError::arg(
            OP,
            "parts",
            "[]",
            "at least one partial is needed",
        ));
    };
    let mut operands = Vec::with_capacity(2 * parts.len());
    for &(out, lse) in parts {
        check_partial(OP, first_out, out, lse)?;
        operands.extend([out, lse]);
    }
    let s = first_out.shape();
    match same_device(OP, &operands)? {
        Device::Cpu => {
            let outs = parts
                .iter()
                .map(|(o, _)| o.cpu_f32(OP))
                .collect::<Result<Vec<_>>>()?;
            let lses = parts
                .iter()
                .map(|(_, l)| l.cpu_f32(OP))
                .collect::<Result<Vec<_>>>()?;
            let outs: Vec<&[f32]> = outs.iter().map(|o| o.as_ref()).collect();
            let lses: Vec<&[f32]> = lses.iter().map(|l| l.as_ref()).collect();
            let (out, lse) = cpu::lse_combine(&outs, &lses, [s[0], s[1], s[2], s[3]]);
            Ok((
                Tensor::from_f32_cpu(out, s, first_out.dtype())?,
                Tensor::from_f32_cpu(lse, first_lse.shape(), DType::F32)?,
            ))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::lse_combine(OP, parts, [s[0], s[1], s[2], s[3]]),
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => unsupported(OP, device),
    }
}

/// Ring's online-softmax update of an accumulated partial (out, lse) with one more block's partial over
/// new keys: c = σ(lse_blk − lse), out ← out − c·(out − out_blk), lse ← lse − log σ(lse − lse_blk).
///
/// out, out_blk [B, S, H, D]; lse, lse_blk [B, H, S] f32 → (out [B, S, H, D] in out's dtype, lse
/// [B, H, S] f32). Mathematically the 2-way [`lse_combine`]; a side with lse = −∞ contributes nothing, so
/// an accumulator can start at (0, −∞).
pub fn lse_merge_pair(
    out: &Tensor,
    lse: &Tensor,
    out_blk: &Tensor,
    lse_blk: &Tensor,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "lse_merge_pair";
    check_partial(OP, out, out, lse)?;
    check_partial(OP, out, out_blk, lse_blk)?;
    let s = out.shape();
    match same_device(OP, &[out, lse, out_blk, lse_blk])? {
        Device::Cpu => {
            let (merged, merged_lse) = cpu::lse_merge_pair(
                &out.cpu_f32(OP)?,
                &lse.cpu_f32(OP)?,
                &out_blk.cpu_f32(OP)?,
                &lse_blk.cpu_f32(OP)?,
                [s[0], s[1], s[2], s[3]],
            );
            Ok((
                Tensor::from_f32_cpu(merged, s, out.dtype())?,
                Tensor::from_f32_cpu(merged_lse, lse.shape(), DType::F32)?,
            ))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            cuda::lse_merge_pair(OP, (out, lse), (out_blk, lse_blk), [s[0], s[1], s[2], s[3]])
        }
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => unsupported(OP, device),
    }
}
