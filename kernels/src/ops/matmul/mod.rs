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
