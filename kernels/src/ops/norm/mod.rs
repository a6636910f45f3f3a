//! Normalisations: LayerNorm (with or without affine), RMSNorm over the full last dim (DiT q/k), and the
//! VAE's channel-first L2 RMS norm (diffusers `WanRMS_norm`).

pub(crate) mod cpu;
#[cfg(feature = "cuda")]
pub(super) mod cuda;
#[cfg(test)]
mod tests;

use super::elementwise::cpu as elementwise_cpu;
use super::same_device;
#[cfg(not(feature = "cuda"))]
use super::unsupported;
use crate::{DType, Device, Fp8Tensor, KernelError, Result, Tensor};

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

/// LayerNorm over the last dim: x [.., D] → (x − mean) / sqrt(var + eps) · weight `[D]` + bias `[D]`,
/// in x's dtype. `var` is the biased variance (PyTorch). `weight`/`bias` are optional (DiT
/// norm1/norm3 have neither; norm2 has both).
pub fn layer_norm(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
) -> Result<Tensor> {
    const OP: &str = "layer_norm";
    let d = layer_norm_dim(OP, x, weight, bias)?;
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

/// [`layer_norm`] quantised for FP8 linears: `Fp8Tensor::quantize(&layer_norm(x, weight, bias,
/// eps)?)`, bit for bit. On a GPU with FP8, for bf16 rows that norm.cu holds in registers (the
/// DiT's), one kernel writes the codes and scales, without the bf16 rows between: the norm before
/// the FP8 cross-attention's q projection.
pub fn layer_norm_e4m3(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
) -> Result<Fp8Tensor> {
    const OP: &str = "layer_norm_e4m3";
    // Checked here, so that a bad shape is reported as this op's, fused or not.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    let d = layer_norm_dim(OP, x, weight, bias)?;
    let mut operands = vec![x];
    operands.extend(weight);
    operands.extend(bias);
    same_device(OP, &operands)?;
    #[cfg(feature = "cuda")]
    if matches!(x.device(), Device::Cuda(_))
        && let Some(q) = cuda::layer_norm_e4m3(OP, x, weight, bias, d, eps)?
    {
        return Ok(q);
    }
    Fp8Tensor::quantize(&layer_norm(x, weight, bias, eps)?)
}

/// x's last dim D, with the optional weight and bias checked to hold D values each.
fn layer_norm_dim(
    op: &'static str,
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
) -> Result<usize> {
    let d = *x
        .shape()
        .last()
        .ok_or_else(|| KernelError::shape(op, "x must have rank ≥ 1", &[x.shape()]))?;
    expect_len(op, "weight", x, weight, d)?;
    expect_len(op, "bias", x, bias, d)?;
    Ok(d)
}

/// The DiT's pre-attention and pre-FFN step in one pass: `LN(x)·(1 + scale) + shift`, LayerNorm
/// without affine over the last dim D, computed in f32 and stored once in `out_dtype` (diffusers'
/// `(norm(x.float()) * (1 + scale) + shift).type_as(x)`). Fusing it reads x once and writes the
/// result once, where the three ops (cast, norm, modulate, cast) made four f32 round trips.
///
/// `shift` and `scale` hold f32 rows of D that broadcast over x's leading dims in one pattern: a
/// prefix of x's leading dims is kept, the rest are 1 — [B, 1, D] (per sample) or x's own shape
/// (per token) for x [B, L, D]. Row r of x uses their row r / (x rows / their rows).
pub fn layer_norm_modulate(
    x: &Tensor,
    shift: &Tensor,
    scale: &Tensor,
    eps: f32,
    out_dtype: DType,
) -> Result<Tensor> {
    const OP: &str = "layer_norm_modulate";
    let (d, rows_per_mod) = modulate_dims(OP, x, shift, scale)?;
    match same_device(OP, &[x, shift, scale])? {
        Device::Cpu => {
            let out = cpu::layer_norm_modulate(
                &x.cpu_f32(OP)?,
                d,
                &shift.cpu_f32(OP)?,
                &scale.cpu_f32(OP)?,
                rows_per_mod,
                eps,
            );
            Tensor::from_f32_cpu(out, x.shape(), out_dtype)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            cuda::layer_norm_modulate(OP, x, shift, scale, d, rows_per_mod, eps, out_dtype)
        }
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => unsupported(OP, device),
    }
}

/// [`layer_norm_modulate`] quantised for FP8 linears: `Fp8Tensor::quantize(&layer_norm_modulate(x,
/// shift, scale, eps, out_dtype)?)`, bit for bit. On a GPU with FP8, for bf16 x and `out_dtype`
/// in rows that norm.cu holds in registers (the DiT's), one kernel writes the codes and scales,
/// without the bf16 rows between: the norms before the FP8 self-attention's q/k/v projections
/// (one quantisation for the three) and the FFN's up-projection.
pub fn layer_norm_modulate_e4m3(
    x: &Tensor,
    shift: &Tensor,
    scale: &Tensor,
    eps: f32,
    out_dtype: DType,
) -> Result<Fp8Tensor> {
    const OP: &str = "layer_norm_modulate_e4m3";
    // Checked here, so that a bad shape is reported as this op's, fused or not.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    let (d, rows_per_mod) = modulate_dims(OP, x, shift, scale)?;
    same_device(OP, &[x, shift, scale])?;
    #[cfg(feature = "cuda")]
    if out_dtype == DType::BF16
        && matches!(x.device(), Device::Cuda(_))
        && let Some(q) = cuda::layer_norm_modulate_e4m3(OP, x, shift, scale, d, rows_per_mod, eps)?
    {
        return Ok(q);
    }
    Fp8Tensor::quantize(&layer_norm_modulate(x, shift, scale, eps, out_dtype)?)
}

/// x's last dim D and how many rows of x share a row of the modulation, with shift and scale
/// checked (f32, [`modulation_rows`]' broadcast).
fn modulate_dims(
    op: &'static str,
    x: &Tensor,
    shift: &Tensor,
    scale: &Tensor,
) -> Result<(usize, usize)> {
    let d = *x
        .shape()
        .last()
        .ok_or_else(|| KernelError::shape(op, "x must have rank ≥ 1", &[x.shape()]))?;
    let rows = x.numel().checked_div(d).unwrap_or(0);
    let mod_rows = modulation_rows(op, x, shift, scale)?;
    for (name, t) in [("shift", shift), ("scale", scale)] {
        if t.dtype() != DType::F32 {
            return Err(KernelError::arg(
                op,
                name,
                format!("{:?}", t.dtype()),
                "the modulation rows are f32 (the DiT keeps them in f32)",
            ));
        }
    }
    Ok((d, rows.checked_div(mod_rows).unwrap_or(1).max(1)))
}

/// The rows of D that `shift` and `scale` hold, checked against the broadcast pattern of
/// [`layer_norm_modulate`] (both must have the same shape).
fn modulation_rows(op: &'static str, x: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<usize> {
    let bad = |why: &str| {
        KernelError::shape(
            op,
            why.to_string(),
            &[x.shape(), shift.shape(), scale.shape()],
        )
    };
    if shift.shape() != scale.shape() {
        return Err(bad("shift and scale must have the same shape"));
    }
    let (xs, ss) = (x.shape(), shift.shape());
    if ss.len() > xs.len() || ss.last() != xs.last() {
        return Err(bad(
            "shift/scale must end in x's last dim and have no more dims than x",
        ));
    }
    // Left-pad with 1s to x's rank (NumPy alignment), then: x's dims for a prefix, 1s after it.
    let padded: Vec<usize> = std::iter::repeat_n(1, xs.len() - ss.len())
        .chain(ss.iter().copied())
        .collect();
    let lead = xs.len() - 1;
    let kept = (0..lead).take_while(|&i| padded[i] == xs[i]).count();
    if padded[kept..lead].iter().any(|&p| p != 1) {
        return Err(bad(
            "shift/scale must keep a prefix of x's leading dims and be 1 in the others ([B, 1, D] or [B, L, D])",
        ));
    }
    Ok(xs[..kept].iter().product())
}

/// RMSNorm over the whole last dim: x [.., D] → x · rsqrt(mean(x²) + eps) · weight `[D]`, in x's
/// dtype. For the DiT's q/k norm D is the full model width ("across heads"), eps 1e-6.
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

/// The DiT's q/k preparation in one pass: [`rms_norm`] over the whole last dim of x `[B, S, H·hd]`
/// (eps, weight `[H·hd]`), its result rounded to x's dtype as `rms_norm` stores it, then
/// [`apply_rope`](crate::apply_rope) per head with cos/sin `[S, hd/2]` → `[B, S, H, hd]` in x's
/// dtype. On the CPU it is that composition; on CUDA one kernel reads x once and writes the result once (the two ops moved the
/// tensor twice each), the same maths per element, so the two agree to the norm's reduction order.
pub fn rms_norm_rope(
    x: &Tensor,
    weight: &Tensor,
    eps: f32,
    cos: &Tensor,
    sin: &Tensor,
    heads: usize,
) -> Result<Tensor> {
    const OP: &str = "rms_norm_rope";
    let [batch, seq, d] = super::dims(OP, "x [B, S, H·hd]", x)?;
    let head_dim = d.checked_div(heads).unwrap_or(0);
    let table = [seq, head_dim / 2];
    if heads == 0
        || head_dim * heads != d
        || head_dim % 2 == 1
        || cos.shape() != table
        || sin.shape() != table
    {
        return Err(KernelError::shape(
            OP,
            format!(
                "x [B, S, H·hd] with H = {heads} dividing the last dim into an even hd, cos and sin [S, hd/2]"
            ),
            &[x.shape(), cos.shape(), sin.shape()],
        ));
    }
    expect_len(OP, "weight", x, Some(weight), d)?;
    let out_shape = [batch, seq, heads, head_dim];
    match same_device(OP, &[x, weight, cos, sin])? {
        Device::Cpu => crate::apply_rope(&rms_norm(x, weight, eps)?.reshape(&out_shape)?, cos, sin),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::rms_norm_rope(
            OP,
            x,
            weight,
            eps,
            cos,
            sin,
            (batch * seq, seq, d, head_dim),
            &out_shape,
        ),
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => unsupported(OP, device),
    }
}

/// The VAE's channel-first RMS norm (diffusers `WanRMS_norm`, `F.normalize` over dim 1):
/// x [B, C, ..] → x / max(‖x‖₂ over C, 1e-12) · √C · gamma + bias, per position, in x's dtype.
/// `gamma` and `bias` hold C values in any shape ([C, 1, 1, 1] as in the checkpoint, or `[C]`).
pub fn rms_norm_channels(x: &Tensor, gamma: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    channel_norm("rms_norm_channels", x, gamma, bias, false)
}

/// `silu(rms_norm_channels(x, gamma, bias))` in one pass, bit-identical to the two ops: the norm is
/// rounded to x's dtype exactly where the unfused norm stores it, then SiLU is applied and rounded
/// again. What it saves is memory traffic: the normalised tensor is never written and read back
/// (in bf16, 10 → 6 bytes moved per element). The VAE's residual blocks and its output head run
/// norm then SiLU.
pub fn rms_norm_channels_silu(x: &Tensor, gamma: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    channel_norm("rms_norm_channels_silu", x, gamma, bias, true)
}

/// Shared body of the channel-first norm, with or without the SiLU after it.
fn channel_norm(
    op: &'static str,
    x: &Tensor,
    gamma: &Tensor,
    bias: Option<&Tensor>,
    silu: bool,
) -> Result<Tensor> {
    if x.rank() < 2 {
        return Err(KernelError::shape(
            op,
            "x must be [B, C, ..] (rank ≥ 2)",
            &[x.shape()],
        ));
    }
    let (batch, channels) = (x.shape()[0], x.shape()[1]);
    let positions: usize = x.shape()[2..].iter().product();
    expect_len(op, "gamma", x, Some(gamma), channels)?;
    expect_len(op, "bias", x, bias, channels)?;
    let mut operands = vec![x, gamma];
    operands.extend(bias);
    match same_device(op, &operands)? {
        Device::Cpu => {
            let bias = bias.map(|b| b.cpu_f32(op)).transpose()?;
            let mut out = cpu::rms_norm_channels(
                &x.cpu_f32(op)?,
                batch,
                channels,
                positions,
                &gamma.cpu_f32(op)?,
                bias.as_deref(),
            );
            if silu {
                // Round to x's dtype where the unfused norm stores its result, as the kernel does.
                let round: fn(f32) -> f32 = match x.dtype() {
                    DType::F32 => |v| v,
                    DType::BF16 => |v| half::bf16::from_f32(v).to_f32(),
                };
                for v in &mut out {
                    *v = elementwise_cpu::silu(round(*v));
                }
            }
            Tensor::from_f32_cpu(out, x.shape(), x.dtype())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            cuda::rms_norm_channels(op, x, gamma, bias, (batch, channels, positions), silu)
        }
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => {
            let _ = silu;
            unsupported(op, device)
        }
    }
}
