//! Elementwise ops: broadcasting add/sub/mul, scalar affine and clamp, the activations (SiLU, GELU-tanh),
//! AdaLN modulation `x·(1+scale)+shift` and the gated residual `x + y·gate`.

pub(crate) mod cpu;
#[cfg(feature = "cuda")]
pub(super) mod cuda;
#[cfg(test)]
mod tests;

#[cfg(not(feature = "cuda"))]
use super::unsupported;
use super::{broadcast_shape, expect_broadcasts_to, same_device};
use crate::{Device, KernelError, Result, Tensor};

/// Op codes of `elementwise.cu`: the selector each op passes to its CUDA kernel.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the ternary codes are read by the CUDA arm only
mod code {
    pub const AFFINE: i32 = 0;
    pub const CLAMP: i32 = 1;
    pub const SILU: i32 = 2;
    pub const GELU_TANH: i32 = 3;
    pub const ADD: i32 = 0;
    pub const SUB: i32 = 1;
    pub const MUL: i32 = 2;
    pub const MODULATE: i32 = 0;
    pub const GATED: i32 = 1;
}

/// Shared body of add/sub/mul: NumPy broadcasting of both operands, output in a's dtype.
fn binary(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
    f: fn(f32, f32) -> f32,
    code: i32,
) -> Result<Tensor> {
    let out_shape = broadcast_shape(op, a.shape(), b.shape())?;
    match same_device(op, &[a, b])? {
        Device::Cpu => {
            let out = cpu::broadcast_binary(
                &a.cpu_f32(op)?,
                a.shape(),
                &b.cpu_f32(op)?,
                b.shape(),
                &out_shape,
                f,
            );
            Tensor::from_f32_cpu(out, &out_shape, a.dtype())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::binary(op, a, b, &out_shape, code),
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => {
            let _ = code;
            unsupported(op, device)
        }
    }
}

/// a + b with NumPy broadcasting → broadcast shape, a's dtype.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    binary("add", a, b, |x, y| x + y, code::ADD)
}

/// a − b with NumPy broadcasting → broadcast shape, a's dtype.
pub fn sub(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    binary("sub", a, b, |x, y| x - y, code::SUB)
}

/// a · b with NumPy broadcasting → broadcast shape, a's dtype.
pub fn mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    binary("mul", a, b, |x, y| x * y, code::MUL)
}

/// Shared body of the one-input ops: `f` per element, same shape and dtype. On the GPU the op is
/// `code` of `elementwise.cu` with scalar parameters `params`.
fn unary(
    op: &'static str,
    x: &Tensor,
    f: impl Fn(f32) -> f32,
    (code, params): (i32, [f32; 2]),
) -> Result<Tensor> {
    match x.device() {
        Device::Cpu => {
            let out = x.cpu_f32(op)?.iter().map(|&v| f(v)).collect();
            Tensor::from_f32_cpu(out, x.shape(), x.dtype())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::unary(op, x, code, params[0], params[1]),
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => {
            let _ = (code, params);
            unsupported(op, device)
        }
    }
}

/// x · mul + add per element (scalar affine; e.g. the CFG combine or a scheduler step) → x's shape.
pub fn affine(x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
    unary("affine", x, |v| v * mul + add, (code::AFFINE, [mul, add]))
}

/// x · s per element → x's shape.
pub fn scale(x: &Tensor, s: f32) -> Result<Tensor> {
    unary("scale", x, |v| v * s, (code::AFFINE, [s, 0.0]))
}

/// min(max(x, lo), hi) per element → x's shape (the VAE's final clamp to [−1, 1]). Needs lo ≤ hi.
pub fn clamp(x: &Tensor, lo: f32, hi: f32) -> Result<Tensor> {
    if lo.is_nan() || hi.is_nan() || lo > hi {
        return Err(KernelError::arg(
            "clamp",
            "lo, hi",
            format!("{lo}, {hi}"),
            "lo ≤ hi is required",
        ));
    }
    unary("clamp", x, |v| v.clamp(lo, hi), (code::CLAMP, [lo, hi]))
}

/// SiLU x·σ(x) per element → x's shape.
pub fn silu(x: &Tensor) -> Result<Tensor> {
    unary("silu", x, cpu::silu, (code::SILU, [0.0; 2]))
}

/// GELU, tanh approximation (PyTorch `approximate="tanh"`), per element → x's shape.
pub fn gelu_tanh(x: &Tensor) -> Result<Tensor> {
    unary("gelu_tanh", x, cpu::gelu_tanh, (code::GELU_TANH, [0.0; 2]))
}

/// AdaLN modulation: x [.., D] · (1 + scale) + shift → x's shape and dtype.
///
/// `shift` and `scale` broadcast to x (e.g. [B, 1, D] against x [B, L, D], or [B, L, D] for per-token
/// timesteps).
pub fn modulate(x: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
    const OP: &str = "modulate";
    expect_broadcasts_to(OP, "shift", shift, x.shape())?;
    expect_broadcasts_to(OP, "scale", scale, x.shape())?;
    match same_device(OP, &[x, shift, scale])? {
        Device::Cpu => {
            let out = cpu::broadcast_ternary(
                &x.cpu_f32(OP)?,
                x.shape(),
                (&shift.cpu_f32(OP)?, shift.shape()),
                (&scale.cpu_f32(OP)?, scale.shape()),
                |x, shift, scale| x * (1.0 + scale) + shift,
            );
            Tensor::from_f32_cpu(out, x.shape(), x.dtype())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::ternary(OP, x, shift, scale, code::MODULATE),
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => unsupported(OP, device),
    }
}

/// Gated residual: x + y · gate → x's shape and dtype. `y` has x's shape; `gate` broadcasts to it
/// (e.g. [B, 1, D]).
pub fn gated_residual(x: &Tensor, y: &Tensor, gate: &Tensor) -> Result<Tensor> {
    const OP: &str = "gated_residual";
    if x.shape() != y.shape() {
        return Err(KernelError::shape(
            OP,
            "x and y must have the same shape",
            &[x.shape(), y.shape()],
        ));
    }
    expect_broadcasts_to(OP, "gate", gate, x.shape())?;
    match same_device(OP, &[x, y, gate])? {
        Device::Cpu => {
            let out = cpu::broadcast_ternary(
                &x.cpu_f32(OP)?,
                x.shape(),
                (&y.cpu_f32(OP)?, y.shape()),
                (&gate.cpu_f32(OP)?, gate.shape()),
                |x, y, gate| x + y * gate,
            );
            Tensor::from_f32_cpu(out, x.shape(), x.dtype())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::ternary(OP, x, y, gate, code::GATED),
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => unsupported(OP, device),
    }
}
