//! Normalisations: LayerNorm (with or without affine), RMSNorm over the full last dim (DiT q/k), and the
//! VAE's channel-first L2 RMS norm (diffusers `WanRMS_norm`).

pub(crate) mod cpu;
#[cfg(feature = "cuda")]
pub(super) mod cuda;
#[cfg(test)]
mod tests;

use super::same_device;
#[cfg(not(feature = "cuda"))]
use super::unsupported;
use crate::{Device, KernelError, Result, Tensor};

/// Checks that an optional per-channel parameter holds exactly `len` values (any shape, so that
/// checkpoint shapes like [C, 1, 1, 1] pass as they are).
fn expect_len(
    op: &'static str,
    name: &str,
    x: &Tensor,
    param: Option<&Tensor>,
    len: usize,
) -> Result<()> {
    match param {
        Some(p) if p.numel() != len => Err(KernelError::shape(
            op,
            format!("{name} must hold {len} values (one per normalised channel)"),
            &[x.shape(), p.shape()],
        )),
        _ => Ok(()),
    }
}

/// LayerNorm over the last dim: x [.., D] → (x − mean) / sqrt(var + eps) · weight [D] + bias [D], in x's
/// dtype. `var` is the biased variance (PyTorch). `weight`/`bias` are optional (DiT norm1/norm3 have
/// neither; norm2 has both).
pub fn layer_norm(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
) -> Result<Tensor> {
    const OP: &str = "layer_norm";
    let d = *x
        .shape()
        .last()
        .ok_or_else(|| KernelError::shape(OP, "x must have rank ≥ 1", &[x.shape()]))?;
    expect_len(OP, "weight", x, weight, d)?;
    expect_len(OP, "bias", x, bias, d)?;
    let mut operands = vec![x];
    operands.extend(weight);
    operands.extend(bias);
    match same_device(OP, &operands)? {
        Device::Cpu => {
            let weight = weight.map(|w| w.cpu_f32(OP)).transpose()?;
            let bias = bias.map(|b| b.cpu_f32(OP)).transpose()?;
            let out = cpu::layer_norm(&x.cpu_f32(OP)?, d, weight.as_deref(), bias.as_deref(), eps);
            Tensor::from_f32_cpu(out, x.shape(), x.dtype())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::layer_norm(OP, x, weight, bias, d, eps),
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => unsupported(OP, device),
    }
}

/// RMSNorm over the whole last dim: x [.., D] → x · rsqrt(mean(x²) + eps) · weight [D], in x's dtype.
/// For the DiT's q/k norm D is the full model width ("across heads"), eps 1e-6.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    const OP: &str = "rms_norm";
    let d = *x
        .shape()
        .last()
        .ok_or_else(|| KernelError::shape(OP, "x must have rank ≥ 1", &[x.shape()]))?;
    expect_len(OP, "weight", x, Some(weight), d)?;
    match same_device(OP, &[x, weight])? {
        Device::Cpu => {
            let out = cpu::rms_norm(&x.cpu_f32(OP)?, d, &weight.cpu_f32(OP)?, eps);
            Tensor::from_f32_cpu(out, x.shape(), x.dtype())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::rms_norm(OP, x, weight, d, eps),
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => unsupported(OP, device),
    }
}

/// The VAE's channel-first RMS norm (diffusers `WanRMS_norm`, `F.normalize` over dim 1):
/// x [B, C, ..] → x / max(‖x‖₂ over C, 1e-12) · √C · gamma + bias, per position, in x's dtype.
/// `gamma` and `bias` hold C values in any shape ([C, 1, 1, 1] as in the checkpoint, or [C]).
pub fn rms_norm_channels(x: &Tensor, gamma: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    const OP: &str = "rms_norm_channels";
    if x.rank() < 2 {
        return Err(KernelError::shape(
            OP,
            "x must be [B, C, ..] (rank ≥ 2)",
            &[x.shape()],
        ));
    }
    let (batch, channels) = (x.shape()[0], x.shape()[1]);
    let positions: usize = x.shape()[2..].iter().product();
    expect_len(OP, "gamma", x, Some(gamma), channels)?;
    expect_len(OP, "bias", x, bias, channels)?;
    let mut operands = vec![x, gamma];
    operands.extend(bias);
    match same_device(OP, &operands)? {
        Device::Cpu => {
            let bias = bias.map(|b| b.cpu_f32(OP)).transpose()?;
            let out = cpu::rms_norm_channels(
                &x.cpu_f32(OP)?,
                batch,
                channels,
                positions,
                &gamma.cpu_f32(OP)?,
                bias.as_deref(),
            );
            Tensor::from_f32_cpu(out, x.shape(), x.dtype())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            cuda::rms_norm_channels(OP, x, gamma, bias, (batch, channels, positions))
        }
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => unsupported(OP, device),
    }
}
