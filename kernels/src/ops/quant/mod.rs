//! FP8 (e4m3) linear layers: weights quantised per output channel once ([`Fp8Tensor::quantize`]),
//! activations per token before every call (by the caller: one quantisation can feed several
//! linears, and a norm can write its output quantised, [`crate::layer_norm_e4m3`]), the GEMM on
//! e4m3 operands with both scales applied to its f32 accumulator. The CPU path is the reference;
//! the CUDA path (a quantisation kernel, `quant.cu`, and cuBLASLt's FP8 GEMM with outer-vector
//! scales, `cuda.rs`) is held to it.
//!
//! Format: `e4m3fn` (OCP FP8, CUDA's `__nv_fp8_e4m3`): 1 sign, 4 exponent bits (bias 7), 3 mantissa
//! bits; no infinities; largest finite 448, smallest normal 2⁻⁶, subnormals in steps of 2⁻⁹.
//! [`e4m3`] rounds to nearest, ties to even, saturating to ±448 (CUDA's `__NV_SATFINITE`, which
//! serving wants: an outlier clips instead of becoming NaN); NaN stays NaN.
//!
//! Scales, one per row (a weight's output channel, an activation's token): s = max|row| / 448 (1 for
//! an all-zero row) and q = e4m3(x · (1/s)) (the reciprocal rounded once), so every row spans the format's range and x ≈ q·s with a
//! relative error ≤ 2⁻⁴ (3 mantissa bits) down to |x/s| = 2⁻⁶, an absolute one ≤ 2⁻¹⁰·s below.
//! The FP8 linear is then y = (Σₖ qxₖ·qwₖ)·s_x·s_w + bias with the products (exact in f32: 4 × 4
//! significant bits) summed in f32, rounded once to the output's dtype.
//!
//! On the GPU the quantisation is the CPU's bit for bit (same reciprocals, products and rounding); the GEMM
//! differs from the reference only in its summation order and in how the tensor cores accumulate
//! (`fp8_linears_match_cpu` in `kernels/tests/cuda_parity.rs` derives the bound), and needs bf16
//! activations, `in` and `out` multiples of 16, and compute capability 8.9 or later
//! ([`crate::cuda::supports_fp8`]). [`attention_fp8`] is the FP8 attention (its CPU reference and
//! the GPU kernel held to it).

mod attention;
mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(test)]
mod tests;

use std::sync::Arc;

pub use attention::{
    BLOCK as FP8_ATTENTION_BLOCK, KeySplit as Fp8KeySplit, attention_fp8, attention_fp8_reference,
};

use super::same_device;
#[cfg(not(feature = "cuda"))]
use super::unsupported;
use crate::{DType, Device, KernelError, Result, Tensor};

/// The [`crate::timeline`] marks that end the GPU's FP8 attention's two quantisation kernels, in
/// order: Q's and K's codes with V's largest magnitudes per channel, then Vᵀ's codes (the
/// attention kernel itself runs after the second).
pub const FP8_ATTENTION_QUANTIZE_MARKS: [&str; 2] = [
    "fp8 attention: quantize q, k (and v's amax)",
    "fp8 attention: quantize v",
];

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// `v` rounded to the nearest e4m3 value (ties to even), saturated to ±[`E4M3_MAX`]; NaN stays NaN.
pub fn e4m3(v: f32) -> f32 {
    cpu::e4m3(v)
}

/// The value of e4m3 code `code` (sign, exponent, mantissa bits; 0x7f and 0xff are NaN).
pub fn e4m3_value(code: u8) -> f32 {
    cpu::e4m3_value(code)
}

/// The e4m3 codes of a tensor's rows, where they live.
#[derive(Clone)]
enum Codes {
    Cpu(Arc<Vec<u8>>),
    #[cfg(feature = "cuda")]
    Cuda(Arc<cuda::Codes>),
}

/// A tensor [.., K] quantised per row (its last dim): e4m3 codes and one f32 scale per row, with
/// value ≈ e4m3_value(code)·scale. An FP8 linear's weight is one of these, [out, in]: a scale per
/// output channel; its input another, [.., in]: a scale per token. Cloning shares the codes.
#[derive(Clone)]
pub struct Fp8Tensor {
    shape: Vec<usize>,
    codes: Codes,
    /// f32, x's leading dims, on the codes' device.
    scales: Tensor,
    /// The dtype of the tensor quantised: what an FP8 linear of these activations returns.
    dtype: DType,
}

impl std::fmt::Debug for Fp8Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fp8Tensor({:?}, e4m3, {})", self.shape, self.device())
    }
}

impl Fp8Tensor {
    /// Quantises x [.., K] (K ≥ 1) per row, on x's device, as the module docs say.
    pub fn quantize(x: &Tensor) -> Result<Fp8Tensor> {
        const OP: &str = "quantize_e4m3";
        let k = row_len(OP, x)?;
        let lead = &x.shape()[..x.rank() - 1];
        let (codes, scales) = match x.device() {
            Device::Cpu => {
                let (q, s) = cpu::quantize_rows(&x.cpu_f32(OP)?, k);
                let codes = q.iter().map(|&v| cpu::e4m3_code(v)).collect();
                (
                    Codes::Cpu(Arc::new(codes)),
                    Tensor::from_f32_cpu(s, lead, DType::F32)?,
                )
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => {
                // bf16 rows that fit the registers: read once (the same codes and scales).
                if let Some(q) = crate::ops::norm::cuda::quantize_e4m3(OP, x, k)? {
                    return Ok(q);
                }
                let (codes, scales) = cuda::quantize(OP, x, k)?;
                (Codes::Cuda(codes), Tensor::from_cuda(scales, lead))
            }
            #[cfg(not(feature = "cuda"))]
            device @ Device::Cuda(_) => return unsupported(OP, device),
        };
        Ok(Fp8Tensor {
            shape: x.shape().to_vec(),
            codes,
            scales,
            dtype: x.dtype(),
        })
    }

    /// Codes and scales a CUDA kernel wrote for a tensor of `shape` and `dtype` (a fused norm's).
    #[cfg(feature = "cuda")]
    pub(crate) fn from_cuda(
        shape: &[usize],
        codes: cuda::Codes,
        scales: crate::cuda::CudaStorage,
        dtype: DType,
    ) -> Fp8Tensor {
        Fp8Tensor {
            shape: shape.to_vec(),
            codes: Codes::Cuda(Arc::new(codes)),
            scales: Tensor::from_cuda(scales, &shape[..shape.len() - 1]),
            dtype,
        }
    }

    /// The quantised tensor's shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Where the codes and scales live.
    pub fn device(&self) -> Device {
        self.scales.device()
    }

    /// The dtype of the tensor that was quantised (an FP8 linear of these activations returns it).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The per-row scales, f32, shaped as the leading dims.
    pub fn scales(&self) -> &Tensor {
        &self.scales
    }

    /// The codes, row-major, copied to the host.
    pub fn codes(&self) -> Result<Vec<u8>> {
        match &self.codes {
            Codes::Cpu(c) => Ok(c.to_vec()),
            #[cfg(feature = "cuda")]
            Codes::Cuda(c) => c.download(),
        }
    }

    /// The values the codes and scales stand for, as an f32 tensor on the host.
    pub fn dequantize(&self) -> Result<Tensor> {
        let k = self.shape.last().copied().unwrap_or(1);
        let scales = self.scales.to_vec_f32()?;
        let values = self
            .codes()?
            .chunks_exact(k)
            .zip(&scales)
            .flat_map(|(row, &s)| row.iter().map(move |&c| cpu::e4m3_value(c) * s))
            .collect();
        Tensor::from_vec(values, &self.shape)
    }

    /// The codes' values (unscaled) and the scales, on the host: what the CPU linear multiplies.
    fn host_values(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        let values = self.codes()?.iter().map(|&c| cpu::e4m3_value(c)).collect();
        Ok((values, self.scales.to_vec_f32()?))
    }

    /// [out, in] of a weight, or a shape error for `op`.
    fn weight_dims(&self, op: &'static str, x: &Fp8Tensor) -> Result<(usize, usize)> {
        match self.shape[..] {
            [out, inp] if x.shape().last() == Some(&inp) && inp > 0 => Ok((out, inp)),
            _ => Err(KernelError::shape(
                op,
                "x [.., in], w [out, in] (in ≥ 1)",
                &[x.shape(), &self.shape],
            )),
        }
    }
}

/// The FP8 linear of the module docs: x [.., in] quantised per token and w [out, in] per output
/// channel (both [`Fp8Tensor`]s), the e4m3 products summed in f32, then × s_x·s_w + bias `[out]`
/// → [.., out] in x's dtype (the dtype it was quantised from).
pub fn linear_fp8(x: &Fp8Tensor, w: &Fp8Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    linear_fp8_then("linear_fp8", x, w, bias, false)
}

/// GELU(tanh) of [`linear_fp8`], applied to the f32 sum before its one rounding (on the GPU in the
/// GEMM's epilogue, as `linear_gelu_tanh`).
pub fn linear_fp8_gelu_tanh(x: &Fp8Tensor, w: &Fp8Tensor, bias: &Tensor) -> Result<Tensor> {
    linear_fp8_then("linear_fp8_gelu_tanh", x, w, Some(bias), true)
}

fn linear_fp8_then(
    op: &'static str,
    x: &Fp8Tensor,
    w: &Fp8Tensor,
    bias: Option<&Tensor>,
    gelu: bool,
) -> Result<Tensor> {
    let (out, inp) = w.weight_dims(op, x)?;
    if bias.is_some_and(|b| b.shape() != [out]) {
        let b = bias.map_or(&[][..], |b| b.shape());
        return Err(KernelError::shape(
            op,
            "x [.., in], w [out, in], bias [out]",
            &[x.shape(), w.shape(), b],
        ));
    }
    let mut shape = x.shape()[..x.shape().len() - 1].to_vec();
    shape.push(out);
    let mut operands = vec![x.scales(), w.scales()];
    operands.extend(bias);
    match same_device(op, &operands)? {
        Device::Cpu => {
            let bias = bias.map(|b| b.cpu_f32(op)).transpose()?;
            let (qx, sx) = x.host_values()?;
            let (qw, sw) = w.host_values()?;
            let y = cpu::linear_fp8((&qx, &sx), (&qw, &sw), bias.as_deref(), None, 1, (inp, out));
            let y = Tensor::from_f32_cpu(y, &shape, DType::F32)?;
            let y = if gelu { crate::gelu_tanh(&y)? } else { y };
            y.to_dtype(x.dtype)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::linear(op, x, w, bias, gelu, None, &shape),
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => unsupported(op, device),
    }
}

/// `residual + linear_fp8(x, w, bias) ⊙ gate` with the residual summed in the GEMM's f32
/// accumulator, as [`crate::linear_residual`] (same shapes, same gate forms). The gate folds into
/// the weight's scales (f32: s_w ⊙ g_b, no rounding of the weight) and the bias (g_b ⊙ bias,
/// rounded to the bias' dtype, as the bf16 path does).
pub fn linear_fp8_residual(
    x: &Fp8Tensor,
    w: &Fp8Tensor,
    bias: Option<&Tensor>,
    residual: &Tensor,
    gate: Option<&Tensor>,
) -> Result<Tensor> {
    const OP: &str = "linear_fp8_residual";
    let (out, inp) = w.weight_dims(OP, x)?;
    let (_, groups) =
        crate::ops::matmul::residual_groups(OP, x.shape(), w.shape(), bias, residual, gate)?;
    let (scales, bias) = match gate {
        None => (w.scales().clone(), bias.cloned()),
        Some(g) => {
            let g = g.reshape(&[groups, out])?;
            let scales = crate::mul(&g.to_dtype(DType::F32)?, w.scales())?;
            (scales, bias.map(|b| crate::mul(b, &g)).transpose()?)
        }
    };
    let mut operands = vec![x.scales(), &scales, residual];
    operands.extend(bias.as_ref());
    match same_device(OP, &operands)? {
        Device::Cpu => {
            let bias = bias.as_ref().map(|b| b.cpu_f32(OP)).transpose()?;
            let (qx, sx) = x.host_values()?;
            let (qw, _) = w.host_values()?;
            let y = cpu::linear_fp8(
                (&qx, &sx),
                (&qw, &scales.to_vec_f32()?),
                bias.as_deref(),
                Some(&residual.cpu_f32(OP)?),
                groups,
                (inp, out),
            );
            Tensor::from_f32_cpu(y, residual.shape(), residual.dtype())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::linear(
            OP,
            x,
            w,
            bias.as_ref(),
            false,
            Some((residual, &scales, groups)),
            residual.shape(),
        ),
        #[cfg(not(feature = "cuda"))]
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
