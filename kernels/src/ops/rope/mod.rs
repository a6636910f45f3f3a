//! 3-D rotary position embedding (Wan / diffusers `WanRotaryPosEmbed`): the cos/sin tables for an
//! (F, H, W) token grid and their application to q/k in the interleaved (GPT-J, complex-pair) layout.

pub(crate) mod cpu;
#[cfg(feature = "cuda")]
pub(super) mod cuda;
#[cfg(test)]
mod tests;

#[cfg(not(feature = "cuda"))]
use super::unsupported;
use super::{dims, same_device};
use crate::{DType, Device, KernelError, Result, Tensor};

/// Head-dim split into the (time, height, width) bands: d_h = d_w = 2⌊d/6⌋, d_t = d − 2·d_h.
/// head_dim 128 → [44, 42, 42]; 12 → [4, 4, 4]. head_dim must be even and ≥ 6.
pub fn rope_band_dims(head_dim: usize) -> Result<[usize; 3]> {
    if head_dim % 2 == 1 || head_dim < 6 {
        return Err(KernelError::arg(
            "rope_band_dims",
            "head_dim",
            head_dim,
            "it must be even and at least 6",
        ));
    }
    let d_hw = 2 * (head_dim / 6);
    Ok([head_dim - 2 * d_hw, d_hw, d_hw])
}

/// cos and sin tables for a `[frames, height, width]` token grid → each [F·H·W, head_dim/2] f32.
///
/// Row `(f·H + h)·W + w` holds the angles `[f·ω_t ‖ h·ω_h ‖ w·ω_w]` with ω_{b,i} = theta^(−2i/d_b),
/// i < d_b/2, for the bands of [`rope_band_dims`]; angles are computed in f64, stored f32. Positions are
/// raw grid indices (a sequence-parallel rank narrows the rows it owns). Wan uses theta = 1e4.
pub fn rope_tables_3d(
    grid: [usize; 3],
    head_dim: usize,
    theta: f64,
    device: Device,
) -> Result<(Tensor, Tensor)> {
    let bands = rope_band_dims(head_dim)?;
    let (cos, sin) = cpu::rope_tables_3d(grid, bands, theta);
    let shape = [grid.iter().product(), head_dim / 2];
    let cos = Tensor::from_f32_cpu(cos, &shape, DType::F32)?;
    let sin = Tensor::from_f32_cpu(sin, &shape, DType::F32)?;
    Ok((cos.to_device(device)?, sin.to_device(device)?))
}

/// Rotates adjacent pairs of each head: x [B, S, H, D], cos/sin [S, D/2] → [B, S, H, D] in x's dtype,
/// y₂ₖ = x₂ₖ·cos − x₂ₖ₊₁·sin, y₂ₖ₊₁ = x₂ₖ·sin + x₂ₖ₊₁·cos (complex multiplication by e^{iφ}); all heads
/// share the angles.
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    const OP: &str = "apply_rope";
    let [batch, seq, heads, head_dim] = dims(OP, "x [B, S, H, D]", x)?;
    let table = [seq, head_dim / 2];
    if head_dim % 2 == 1 || cos.shape() != table || sin.shape() != table {
        return Err(KernelError::shape(
            OP,
            "x [B, S, H, D] with D even, cos and sin [S, D/2]",
            &[x.shape(), cos.shape(), sin.shape()],
        ));
    }
    match same_device(OP, &[x, cos, sin])? {
        Device::Cpu => {
            let out = cpu::apply_rope(
                &x.cpu_f32(OP)?,
                [batch, seq, heads, head_dim],
                &cos.cpu_f32(OP)?,
                &sin.cpu_f32(OP)?,
            );
            Tensor::from_f32_cpu(out, x.shape(), x.dtype())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::apply_rope(OP, x, cos, sin, [batch, seq, heads, head_dim]),
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => unsupported(OP, device),
    }
}
