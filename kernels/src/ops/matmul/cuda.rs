//! CUDA twins of `linear` and `matmul`: cuBLASLt GEMMs (`crate::cuda::gemm`), bf16 or f32 storage,
//! f32 accumulation.
//!
//! Row-major onto cuBLASLt's column-major: a row-major [r × c] buffer is a column-major [c × r] one, so
//! - linear: Y [rows × out] = X [rows × in] · Wᵀ becomes Yᵀ [out × rows] = W' · Xᵀ, with W's buffer
//!   read as [in × out] and transposed (transa), Xᵀ as [in × rows]: m = out, n = rows, k = in; the bias
//!   epilogue adds bias[m] to every column, i.e. to every row of Y;
//! - matmul: C [M × N] = A [M × K] · B [K × N] becomes Cᵀ = Bᵀ · Aᵀ with no transposes: m = N, n = M,
//!   k = K, batched with strides (a shared rank-2 B folds the batch into n instead).
//!
//! Operands of different dtypes are promoted to f32 (exact for bf16) and the f32 result cast back, so a
//! bf16 activation times f32 weights computes what the CPU reference computes.

use crate::cuda::{CudaBackend, gemm::Epilogue, gemm::GemmKey, gemm::gemm};
use crate::{DType, Result, Tensor};

/// The operands in one dtype: theirs when they agree, else f32.
fn common_dtype(a: &Tensor, b: &Tensor) -> DType {
    if a.dtype() == b.dtype() {
        a.dtype()
    } else {
        DType::F32
    }
}

/// x [rows, in] · w [out, in]ᵀ + bias [out] → [rows, out] in x's dtype (`out_shape` carries x's batch
/// dims), then GELU(tanh) in the GEMM's epilogue when `gelu` (which needs a bias: the model's FFN has
/// one).
pub(super) fn linear(
    op: &'static str,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    gelu: bool,
    (rows, in_features, out_features): (usize, usize, usize),
    out_shape: &[usize],
) -> Result<Tensor> {
    let dtype = common_dtype(x, w);
    if rows == 0 || out_features == 0 || in_features == 0 {
        // Nothing to multiply: the result is the bias (or zeros) per row.
        let zeros = Tensor::zeros(out_shape, x.dtype(), x.device())?;
        let out = match bias {
            Some(b) => crate::add(&zeros, b)?,
            None => zeros,
        };
        return if gelu {
            crate::gelu_tanh(&out)
        } else {
            Ok(out)
        };
    }
    let epilogue = match (bias.is_some(), gelu) {
        (false, false) => Epilogue::None,
        (true, false) => Epilogue::Bias,
        (true, true) => Epilogue::GeluBias,
        (false, true) => {
            return Err(crate::KernelError::arg(
                op,
                "bias",
                "none",
                "the fused GELU epilogue needs a bias",
            ));
        }
    };
    let (xc, wc) = (x.to_dtype(dtype)?, w.to_dtype(dtype)?);
    // The bias epilogue reads the bias in the output's dtype (rounding an f32 bias to bf16 costs at most
    // half a bf16 ulp of the bias, below the output's own rounding).
    let bias = bias.map(|b| b.to_dtype(dtype)).transpose()?;
    let backend = CudaBackend::get(xc.cuda_storage(op)?.ordinal)?;
    let out = backend.alloc(dtype, rows * out_features)?;
    let key = GemmKey {
        dtype,
        e4m3: false,
        m: out_features as u64,
        n: rows as u64,
        k: in_features as u64,
        transa: true,
        batch: 1,
        stride_a: 0,
        stride_b: 0,
        stride_d: 0,
        epilogue,
    };
    let bias_ptr = bias
        .as_ref()
        .map(|b| b.cuda_storage(op).map(|s| s.ptr()))
        .transpose()?;
    gemm(
        &backend,
        op,
        key,
        wc.cuda_storage(op)?.ptr(),
        xc.cuda_storage(op)?.ptr(),
        out.ptr(),
        bias_ptr,
        None,
    )?;
    Tensor::from_cuda(out, out_shape).to_dtype(x.dtype())
}

/// `groups` runs of rows of x [rows, in], run g: residual + x_g · w_gᵀ + bias_g → residual's shape and
/// dtype, w [groups, out, in] (or [out, in]), bias [groups, out] (or [out]); one GEMM per group with
/// the residual as C (beta 1), each reading and writing its rows in place (no copies).
pub(super) fn linear_residual(
    op: &'static str,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    residual: &Tensor,
    groups: usize,
    (rows, in_features, out_features): (usize, usize, usize),
) -> Result<Tensor> {
    let dtype = if x.dtype() == w.dtype() && x.dtype() == residual.dtype() {
        x.dtype()
    } else {
        DType::F32
    };
    let (xc, wc, rc) = (
        x.to_dtype(dtype)?,
        w.to_dtype(dtype)?,
        residual.to_dtype(dtype)?,
    );
    let bias = bias.map(|b| b.to_dtype(dtype)).transpose()?;
    let backend = CudaBackend::get(xc.cuda_storage(op)?.ordinal)?;
    let out = backend.alloc(dtype, rows * out_features)?;
    let rows_per_group = rows / groups.max(1);
    if rows_per_group > 0 && out_features > 0 {
        let key = GemmKey {
            dtype,
            e4m3: false,
            m: out_features as u64,
            n: rows_per_group as u64,
            k: in_features as u64,
            transa: true,
            batch: 1,
            stride_a: 0,
            stride_b: 0,
            stride_d: 0,
            epilogue: if bias.is_some() {
                Epilogue::Bias
            } else {
                Epilogue::None
            },
        };
        let elem = dtype.size_in_bytes() as u64;
        // Per-group weights and biases are stacked [groups, ..]; a single group's are [out, in], [out].
        let (w_step, b_step) = if groups > 1 {
            (
                (out_features * in_features) as u64 * elem,
                out_features as u64 * elem,
            )
        } else {
            (0, 0)
        };
        let (x_step, d_step) = (
            (rows_per_group * in_features) as u64 * elem,
            (rows_per_group * out_features) as u64 * elem,
        );
        let (wp, xp, rp) = (
            wc.cuda_storage(op)?.ptr(),
            xc.cuda_storage(op)?.ptr(),
            rc.cuda_storage(op)?.ptr(),
        );
        let bp = bias
            .as_ref()
            .map(|b| b.cuda_storage(op).map(|s| s.ptr()))
            .transpose()?;
        for g in 0..groups as u64 {
            gemm(
                &backend,
                op,
                key,
                wp + g * w_step,
                xp + g * x_step,
                out.ptr() + g * d_step,
                bp.map(|b| b + g * b_step),
                Some(rp + g * d_step),
            )?;
        }
    }
    Tensor::from_cuda(out, residual.shape()).to_dtype(residual.dtype())
}

/// a [batch, M, K] @ b [batch or shared, K, N] → [batch, M, N] (`out_shape`) in a's dtype.
pub(super) fn matmul(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
    (batch, shared_b): (usize, bool),
    (m, k, n): (usize, usize, usize),
    out_shape: &[usize],
) -> Result<Tensor> {
    let dtype = common_dtype(a, b);
    if batch == 0 || m == 0 || n == 0 || k == 0 {
        return Tensor::zeros(out_shape, a.dtype(), a.device());
    }
    let (ac, bc) = (a.to_dtype(dtype)?, b.to_dtype(dtype)?);
    let backend = CudaBackend::get(ac.cuda_storage(op)?.ordinal)?;
    let out = backend.alloc(dtype, batch * m * n)?;
    // A shared B: the batch's rows of A are contiguous, so it is one GEMM with n = batch·M.
    let (cols, gemm_batch) = if shared_b { (batch * m, 1) } else { (m, batch) };
    let key = GemmKey {
        dtype,
        e4m3: false,
        m: n as u64,
        n: cols as u64,
        k: k as u64,
        transa: false,
        batch: i32::try_from(gemm_batch).map_err(|_| {
            crate::KernelError::arg(op, "batch", gemm_batch, "cuBLASLt takes at most i32::MAX")
        })?,
        stride_a: (k * n) as i64,
        stride_b: (m * k) as i64,
        stride_d: (m * n) as i64,
        epilogue: Epilogue::None,
    };
    gemm(
        &backend,
        op,
        key,
        bc.cuda_storage(op)?.ptr(),
        ac.cuda_storage(op)?.ptr(),
        out.ptr(),
        None,
        None,
    )?;
    Tensor::from_cuda(out, out_shape).to_dtype(a.dtype())
}
