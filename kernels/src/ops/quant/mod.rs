//! FP8 (e4m3) quantisation as issue 24's FP8 path will use it, as the CPU reference first: the GPU
//! kernels and cuBLASLt FP8 GEMMs that follow are to be checked against these functions.
//!
//! Format: `e4m3fn` (OCP FP8, CUDA's `__nv_fp8_e4m3`): 1 sign, 4 exponent bits (bias 7), 3 mantissa
//! bits; no infinities; largest finite 448, smallest normal 2⁻⁶, subnormals in steps of 2⁻⁹.
//! [`e4m3`] rounds to nearest, ties to even, saturating to ±448 (CUDA's `__NV_SATFINITE`, which
//! serving wants: an outlier clips instead of becoming NaN); NaN stays NaN.
//!
//! Scales, one per row (a weight's output channel, an activation's token): s = max|row| / 448 (1 for
//! an all-zero row) and q = e4m3(x / s), so every row spans the format's range and x ≈ q·s with a
//! relative error ≤ 2⁻⁴ (3 mantissa bits) down to |x/s| = 2⁻⁶, an absolute one ≤ 2⁻¹⁰·s below.
//! The FP8 linear is then y = (Σₖ qxₖ·qwₖ)·s_x·s_w + bias with the products summed in f32: what a
//! GEMM on e4m3 operands with per-row A and B scales applied in its epilogue computes (cuBLASLt's
//! outer-vector scaling on Hopper), so the GPU path can be compared with this one term for term.

mod cpu;
#[cfg(test)]
mod tests;

use super::{same_device, unsupported};
use crate::{DType, Device, KernelError, Result, Tensor};

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// `v` rounded to the nearest e4m3 value (ties to even), saturated to ±[`E4M3_MAX`]; NaN stays NaN.
pub fn e4m3(v: f32) -> f32 {
    cpu::e4m3(v)
}

/// Per-row e4m3 quantisation of x [.., K] → (q [.., K], the e4m3 values held in f32; scales [..],
/// f32, one per row of K, with q·scale ≈ x). CPU only for now.
pub fn quantize_rows_e4m3(x: &Tensor) -> Result<(Tensor, Tensor)> {
    const OP: &str = "quantize_rows_e4m3";
    let k = row_len(OP, x)?;
    match same_device(OP, &[x])? {
        Device::Cpu => {
            let (q, scales) = cpu::quantize_rows(&x.cpu_f32(OP)?, k);
            let lead = &x.shape()[..x.rank() - 1];
            Ok((
                Tensor::from_f32_cpu(q, x.shape(), DType::F32)?,
                Tensor::from_f32_cpu(scales, lead, DType::F32)?,
            ))
        }
        device @ Device::Cuda(_) => unsupported(OP, device),
    }
}

/// The FP8 linear of the module docs: x [.., in] quantised per token, W [out, in] per output
/// channel, the e4m3 products summed in f32, then × s_x·s_w + bias `[out]` → [.., out] in x's
/// dtype. CPU only for now: the reference the FP8 GEMM will be held to.
pub fn linear_fp8_reference(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    const OP: &str = "linear_fp8_reference";
    let k = row_len(OP, x)?;
    let ws = w.shape();
    if ws.len() != 2 || ws[1] != k || bias.is_some_and(|b| b.shape() != [ws[0]]) {
        let b = bias.map_or(&[][..], |b| b.shape());
        return Err(KernelError::shape(
            OP,
            "x [.., in], w [out, in], bias [out]",
            &[x.shape(), ws, b],
        ));
    }
    let mut operands = vec![x, w];
    operands.extend(bias);
    match same_device(OP, &operands)? {
        Device::Cpu => {
            let bias = bias.map(|b| b.cpu_f32(OP)).transpose()?;
            let out = cpu::linear_fp8(&x.cpu_f32(OP)?, &w.cpu_f32(OP)?, bias.as_deref(), k, ws[0]);
            let mut shape = x.shape()[..x.rank() - 1].to_vec();
            shape.push(ws[0]);
            Tensor::from_f32_cpu(out, &shape, x.dtype())
        }
        device @ Device::Cuda(_) => unsupported(OP, device),
    }
}

/// The length of x's rows (its last dim), which must exist and be non-zero.
fn row_len(op: &'static str, x: &Tensor) -> Result<usize> {
    match x.shape().last() {
        Some(&k) if k > 0 => Ok(k),
        _ => Err(KernelError::shape(
            op,
            "x must have rank ≥ 1 and a non-empty last dim",
            &[x.shape()],
        )),
    }
}
