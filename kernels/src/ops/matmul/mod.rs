//! GEMM ops: batched `matmul` and `linear` with PyTorch's `x @ W.T + b` layout.

pub(crate) mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(test)]
mod tests;

use super::same_device;
#[cfg(not(feature = "cuda"))]
use super::unsupported;
use crate::{Device, KernelError, Result, Tensor};

/// a [.., M, K] @ b [.., K, N] → [.., M, N] in a's dtype, f32 accumulation.
///
/// The leading (batch) dims of `a` and `b` must be equal, or `b` may be rank 2 and is then shared by every
/// batch entry.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "matmul";
    let contract = "a [.., M, K] @ b [.., K, N] with equal batch dims, or b [K, N]";
    if a.rank() < 2 || b.rank() < 2 {
        return Err(KernelError::shape(OP, contract, &[a.shape(), b.shape()]));
    }
    let (a_batch, a_mat) = a.shape().split_at(a.rank() - 2);
    let (b_batch, b_mat) = b.shape().split_at(b.rank() - 2);
    let (m, k, n) = (a_mat[0], a_mat[1], b_mat[1]);
    if b_mat[0] != k || !(b_batch.is_empty() || b_batch == a_batch) {
        return Err(KernelError::shape(OP, contract, &[a.shape(), b.shape()]));
    }
    let mut out_shape = a_batch.to_vec();
    out_shape.extend([m, n]);
    match same_device(OP, &[a, b])? {
        Device::Cpu => {
            let batch: usize = a_batch.iter().product();
            let out = cpu::batched_matmul(
                &a.cpu_f32(OP)?,
                &b.cpu_f32(OP)?,
                batch,
                b_batch.is_empty(),
                m,
                k,
                n,
            );
            Tensor::from_f32_cpu(out, &out_shape, a.dtype())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let batch: usize = a_batch.iter().product();
            cuda::matmul(OP, a, b, (batch, b_batch.is_empty()), (m, k, n), &out_shape)
        }
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => unsupported(OP, device),
    }
}

/// x [.., in] · W [out, in]ᵀ + bias `[out]` → [.., out] in x's dtype (PyTorch `nn.Linear`), f32
/// accumulation.
pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    linear_then("linear", x, w, bias, false)
}

/// GELU(tanh)(x [.., in] · W [out, in]ᵀ + bias `[out]`) → [.., out] in x's dtype: the Wan FFN's
/// up-projection and activation in one op. The activation is applied to the f32 sum before the
/// one rounding to x's dtype (on CUDA in cuBLASLt's epilogue, so it costs no pass of its own);
/// `gelu_tanh(linear(..))` rounds twice, so in bf16 the two differ by up to one bf16 ulp.
pub fn linear_gelu_tanh(x: &Tensor, w: &Tensor, bias: &Tensor) -> Result<Tensor> {
    linear_then("linear_gelu_tanh", x, w, Some(bias), true)
}

/// A DiT block's residual branch in one GEMM: `residual + (x · Wᵀ + bias) ⊙ gate` → residual's shape
/// and dtype, with the residual added in the GEMM's f32 accumulator (cuBLASLt's C with beta 1) and
/// the sum rounded once, so neither the projection nor the residual costs a pass over memory.
///
/// x `[.., in]`, w `[out, in]`, bias `[out]`, residual x's shape with `out` last. `gate` (any dtype)
/// is per output feature and either shared (`[out]`, `[1, out]`, `[1, 1, out]`) or per sample
/// (`[B, 1, out]` for x `[B, L, in]`); a per-token gate is refused (use `linear` then
/// `gated_residual`). It is folded into the weights: sample b multiplies by W_b = g_b ⊙ W (row o
/// scaled by `g_b[o]`) and adds
/// g_b ⊙ bias, each product rounded to w's (bias') dtype, on the CPU and the GPU alike — so
/// against the unfused `gated_residual(residual, linear(x, w, bias), gate)` in bf16 the projection's
/// rounding moves from its output to its weights (about one bf16 ulp of each either way), and the
/// f32 path differs from it by f32 rounding only. x, w and residual in one dtype run as they are;
/// mixed dtypes run in f32.
pub fn linear_residual(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    residual: &Tensor,
    gate: Option<&Tensor>,
) -> Result<Tensor> {
    const OP: &str = "linear_residual";
    let (rows, groups) = residual_groups(OP, x.shape(), w.shape(), bias, residual, gate)?;
    let (out_features, in_features) = (w.shape()[0], w.shape()[1]);
    let (w, bias) = match gate {
        None => (w.clone(), bias.cloned()),
        Some(g) => {
            let g = g.reshape(&[groups, out_features])?;
            let w = crate::mul(w, &g.reshape(&[groups, out_features, 1])?)?;
            (w, bias.map(|b| crate::mul(b, &g)).transpose()?)
        }
    };
    let mut operands = vec![x, &w, residual];
    operands.extend(bias.as_ref());
    let dims = (rows, in_features, out_features);
    match same_device(OP, &operands)? {
        Device::Cpu => {
            let bias = bias.as_ref().map(|b| b.cpu_f32(OP)).transpose()?;
            let out = cpu::linear_residual(
                &x.cpu_f32(OP)?,
                &w.cpu_f32(OP)?,
                bias.as_deref(),
                residual.cpu_f32(OP)?.into_owned(),
                groups,
                dims,
            );
            Tensor::from_f32_cpu(out, residual.shape(), residual.dtype())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::linear_residual(OP, x, &w, bias.as_ref(), residual, groups, dims),
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => unsupported(OP, device),
    }
}

/// The shape rules of a linear with a residual and an optional gate (see [`linear_residual`]), for
/// a weight of `w_shape`: → (rows of x, gate groups: 1 for a shared gate or none, else one per
/// sample of x's first dim, each over a contiguous run of rows).
pub(crate) fn residual_groups(
    op: &'static str,
    x_shape: &[usize],
    w_shape: &[usize],
    bias: Option<&Tensor>,
    residual: &Tensor,
    gate: Option<&Tensor>,
) -> Result<(usize, usize)> {
    let contract = "x [.., in], w [out, in], bias [out], residual [.., out] (x's leading dims), \
                    gate [out], [1, 1, out] or [B, 1, out] (x [B, L, in])";
    let rank = x_shape.len();
    let shapes_ok = rank >= 1
        && w_shape.len() == 2
        && x_shape[rank - 1] == w_shape[1]
        && bias.is_none_or(|b| b.shape() == [w_shape[0]])
        && residual.rank() == rank
        && residual.shape()[..rank - 1] == x_shape[..rank - 1]
        && residual.shape()[rank - 1] == w_shape[0];
    let bad = || {
        let mut shapes = vec![x_shape, w_shape, residual.shape()];
        shapes.extend(bias.map(|b| b.shape()));
        shapes.extend(gate.map(|g| g.shape()));
        KernelError::shape(op, contract, &shapes)
    };
    if !shapes_ok {
        return Err(bad());
    }
    let (out_features, in_features) = (w_shape[0], w_shape[1]);
    if in_features == 0 {
        return Err(KernelError::arg(op, "in", 0, "it must be at least 1"));
    }
    let rows: usize = x_shape[..rank - 1].iter().product();
    let groups = match gate {
        None => 1,
        Some(g) if g.numel() == out_features => 1,
        Some(g) if rank == 3 && g.shape() == [x_shape[0], 1, out_features] => x_shape[0],
        Some(_) => return Err(bad()),
    };
    Ok((rows, groups))
}

fn linear_then(
    op: &'static str,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    gelu: bool,
) -> Result<Tensor> {
    let contract = "x [.., in], w [out, in], bias [out]";
    let shapes_ok = x.rank() >= 1
        && w.rank() == 2
        && x.shape()[x.rank() - 1] == w.shape()[1]
        && bias.is_none_or(|b| b.shape() == [w.shape()[0]]);
    if !shapes_ok {
        let mut shapes = vec![x.shape(), w.shape()];
        shapes.extend(bias.map(|b| b.shape()));
        return Err(KernelError::shape(op, contract, &shapes));
    }
    let (out_features, in_features) = (w.shape()[0], w.shape()[1]);
    let rows: usize = x.shape()[..x.rank() - 1].iter().product();
    let mut out_shape = x.shape().to_vec();
    let last = out_shape.len() - 1; // rank ≥ 1 checked above
    out_shape[last] = out_features;
    let mut operands = vec![x, w];
    operands.extend(bias);
    match same_device(op, &operands)? {
        Device::Cpu => {
            let bias = bias.map(|b| b.cpu_f32(op)).transpose()?;
            let mut out = cpu::linear(
                &x.cpu_f32(op)?,
                &w.cpu_f32(op)?,
                bias.as_deref(),
                rows,
                in_features,
                out_features,
            );
            if gelu {
                for v in &mut out {
                    *v = crate::ops::elementwise::cpu::gelu_tanh(*v);
                }
            }
            Tensor::from_f32_cpu(out, &out_shape, x.dtype())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::linear(
            op,
            x,
            w,
            bias,
            gelu,
            (rows, in_features, out_features),
            &out_shape,
        ),
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => unsupported(op, device),
    }
}
