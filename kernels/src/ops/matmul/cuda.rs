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
    )?;
    Tensor::from_cuda(out, out_shape).to_dtype(x.dtype())
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
    )?;
    Tensor::from_cuda(out, out_shape).to_dtype(a.dtype())
}
