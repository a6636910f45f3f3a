//! GEMMs through cuBLASLt, with the descriptors, layouts and the chosen algorithm cached per shape.
//!
//! cudarc's safe `Matmul` creates descriptors and asks the heuristic on every call; the DiT calls the same
//! few shapes thousands of times, so a [`Plan`] is built once per [`GemmKey`] and reused (only the bias
//! pointer changes between calls). cuBLASLt is column-major: the callers in `ops/matmul/cuda.rs` map
//! row-major `x @ W.T` and `a @ b` onto it (see there).

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;

use cudarc::cublaslt::result::{self as lt, CublasError};
use cudarc::cublaslt::sys::{self as lt_sys, cublasLtMatmulDescAttributes_t as DescAttr};
use cudarc::driver::{CudaSlice, DevicePtr};

use super::{CudaBackend, catch};
use crate::{DType, KernelError, Result};

/// cuBLASLt's workspace: NVIDIA's recommendation for Hopper (32 MiB).
const WORKSPACE_BYTES: usize = 32 << 20;

/// What cuBLASLt applies to the f32 accumulator before it rounds and stores D.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Epilogue {
    /// D = op(A)·B.
    None,
    /// D = op(A)·B plus bias[m] broadcast over n.
    Bias,
    /// The bias, then GELU with the tanh approximation (`CUBLASLT_EPILOGUE_GELU_BIAS`, the same
    /// formula as PyTorch's `approximate="tanh"`), so the FFN's activation costs no pass over
    /// memory of its own.
    GeluBias,
}

/// One GEMM shape, column-major: D [m × n] = op(A) [m × k] · B [k × n] (+ bias [m] broadcast over n,
/// then GELU, per the [`Epilogue`]).
/// A is stored [k × m] (ld k) when `transa`, else [m × k] (ld m); B is [k × n] (ld k); D is [m × n]
/// (ld m). A, B and D all have `dtype`; accumulation and scaling are f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct GemmKey {
    pub dtype: DType,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub transa: bool,
    /// Strided batch: count and element strides of A, B, D (A's stride may be 0: shared).
    pub batch: i32,
    pub stride_a: i64,
    pub stride_b: i64,
    pub stride_d: i64,
    /// The epilogue (a bias is in `dtype`, one value per row of D).
    pub epilogue: Epilogue,
}

/// Descriptors and algorithm for one [`GemmKey`].
struct Plan {
    desc: lt_sys::cublasLtMatmulDesc_t,
    a: lt_sys::cublasLtMatrixLayout_t,
    b: lt_sys::cublasLtMatrixLayout_t,
    d: lt_sys::cublasLtMatrixLayout_t,
    algo: lt_sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created by this plan and is destroyed once; failures are ignored
        // (nothing to do about them while dropping).
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.d);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// A device's cuBLASLt handle, workspace and plan cache; lives in `CudaBackend::blas` behind a mutex.
pub(crate) struct Blas {
    handle: lt_sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    plans: HashMap<GemmKey, Plan>,
}

// SAFETY: the handle and plans are plain cuBLASLt objects with no thread affinity; `Blas` is only used
// under its backend's mutex, so never from two threads at once.
unsafe impl Send for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: the handle was created in `Blas::new` and is destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

fn lt_type(dtype: DType) -> lt_sys::cudaDataType {
    match dtype {
        DType::F32 => lt_sys::cudaDataType_t::CUDA_R_32F,
        DType::BF16 => lt_sys::cudaDataType_t::CUDA_R_16BF,
    }
}

impl Blas {
    fn new(backend: &CudaBackend) -> Result<Self> {
        // SAFETY: is_culib_present only dlopens the candidate names and drops the handles.
        if !unsafe { lt_sys::is_culib_present() } {
            return Err(KernelError::CudaUnavailable {
                library: "libcublasLt",
                detail: format!("tried {:?}", cudarc::get_lib_name_candidates("cublasLt")),
            });
        }
        backend
            .ctx
            .bind_to_thread()
            .map_err(|e| backend.err("gemm", "cuCtxSetCurrent", e))?;
        let handle = catch("libcublasLt", lt::create_handle)?
            .map_err(|e| backend.err("gemm", "cublasLtCreate", e))?;
        // SAFETY: the workspace is only ever handed to cuBLASLt, which needs no initial contents.
        let workspace = unsafe { backend.stream.alloc::<u8>(WORKSPACE_BYTES) }
            .map_err(|e| backend.err("gemm", "cuMemAllocAsync", e))?;
        Ok(Blas {
            handle,
            workspace,
            plans: HashMap::new(),
        })
    }

    fn plan(&mut self, key: GemmKey) -> std::result::Result<&Plan, CublasError> {
        if !self.plans.contains_key(&key) {
            let plan = build_plan(self.handle, key)?;
            self.plans.insert(key, plan);
        }
        // Inserted just above when absent.
        self.plans.get(&key).ok_or(CublasError(
            lt_sys::cublasStatus_t::CUBLAS_STATUS_INTERNAL_ERROR,
        ))
    }
}

fn layout(
    dtype: DType,
    rows: u64,
    cols: u64,
    ld: i64,
    batch: i32,
    stride: i64,
) -> std::result::Result<lt_sys::cublasLtMatrixLayout_t, CublasError> {
    let layout = lt::create_matrix_layout(lt_type(dtype), rows, cols, ld)?;
    if batch > 1 {
        // SAFETY: `layout` is live; the attribute values are an i32 and an i64, as cuBLASLt expects.
        unsafe {
            lt::set_matrix_layout_attribute(
                layout,
                lt_sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                (&batch as *const i32).cast(),
                size_of::<i32>(),
            )?;
            lt::set_matrix_layout_attribute(
                layout,
                lt_sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                (&stride as *const i64).cast(),
                size_of::<i64>(),
            )?;
        }
    }
    Ok(layout)
}

fn set_desc<T>(
    desc: lt_sys::cublasLtMatmulDesc_t,
    attr: DescAttr,
    value: &T,
) -> std::result::Result<(), CublasError> {
    // SAFETY: `desc` is live and `value` is the attribute's C type (callers pass i32/u32/pointers).
    unsafe { lt::set_matmul_desc_attribute(desc, attr, (value as *const T).cast(), size_of::<T>()) }
}

fn build_plan(
    handle: lt_sys::cublasLtHandle_t,
    key: GemmKey,
) -> std::result::Result<Plan, CublasError> {
    let (a_rows, a_cols) = if key.transa {
        (key.k, key.m)
    } else {
        (key.m, key.k)
    };
    let a = layout(
        key.dtype,
        a_rows,
        a_cols,
        a_rows as i64,
        key.batch,
        key.stride_a,
    )?;
    let b = layout(
        key.dtype,
        key.k,
        key.n,
        key.k as i64,
        key.batch,
        key.stride_b,
    )?;
    let d = layout(
        key.dtype,
        key.m,
        key.n,
        key.m as i64,
        key.batch,
        key.stride_d,
    )?;
    // f32 GEMMs stay true f32 (COMPUTE_32F, no TF32): they are the exact path parity relies on.
    let desc = lt::create_matmul_desc(
        lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        lt_sys::cudaDataType_t::CUDA_R_32F,
    )?;
    let plan_so_far = Plan {
        desc,
        a,
        b,
        d,
        // Filled below; dropping `plan_so_far` on an error releases the handles.
        algo: lt_sys::cublasLtMatmulAlgo_t { data: [0; 8] },
    };
    set_desc(
        desc,
        DescAttr::CUBLASLT_MATMUL_DESC_TRANSA,
        &i32::from(key.transa),
    )?;
    set_desc(desc, DescAttr::CUBLASLT_MATMUL_DESC_TRANSB, &0i32)?;
    let epilogue = match key.epilogue {
        Epilogue::None => None,
        Epilogue::Bias => Some(lt_sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS),
        Epilogue::GeluBias => Some(lt_sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS),
    };
    if let Some(epilogue) = epilogue {
        set_desc(desc, DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
    }
    let pref = lt::create_matmul_pref()?;
    let workspace = WORKSPACE_BYTES;
    // Split-K partial sums are reduced in the compute type (f32) only: the in-place and output-type
    // schemes round every partial to a bf16 output's precision, which measured up to ~1e-2 relative
    // on small-m·n, long-k GEMMs (the VAE's convs at small sizes), far beyond one final rounding.
    let reduction =
        lt_sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
    // SAFETY: `pref` is live; the values are a usize (size_t) and a u32, as the attributes expect.
    let heuristic = unsafe {
        lt::set_matmul_pref_attribute(
            pref,
            lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            (&workspace as *const usize).cast(),
            size_of::<usize>(),
        )
        .and_then(|()| {
            lt::set_matmul_pref_attribute(
                pref,
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                (&reduction as *const u32).cast(),
                size_of::<u32>(),
            )
        })
        .and_then(|()| lt::get_matmul_algo_heuristic(handle, desc, a, b, d, d, pref))
    };
    // SAFETY: `pref` was created above and is not used after this.
    let _ = unsafe { lt::destroy_matmul_pref(pref) };
    let mut plan = plan_so_far;
    plan.algo = heuristic?.algo;
    Ok(plan)
}

/// Runs the GEMM `key` on the backend's stream: D = op(A)·B (+ C) (+ bias). `a`, `b`, `d`, `bias`
/// and `c` are device addresses of buffers in `key.dtype` large enough for the key's shape; C has
/// D's layout and, when given, enters the f32 accumulator (beta = 1), so a residual added this way
/// is rounded once, with the product.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    backend: &CudaBackend,
    op: &'static str,
    key: GemmKey,
    a: u64,
    b: u64,
    d: u64,
    bias: Option<u64>,
    c: Option<u64>,
) -> Result<()> {
    let mut guard = backend.blas.lock().unwrap_or_else(|e| e.into_inner());
    let blas = match &mut *guard {
        Some(blas) => blas,
        slot @ None => slot.insert(Blas::new(backend)?),
    };
    let (workspace, _) = blas.workspace.device_ptr(&backend.stream);
    let handle = blas.handle;
    let plan = blas
        .plan(key)
        .map_err(|e| backend.err(op, "cublasLtMatmulAlgoGetHeuristic", (key, e)))?;
    if let Some(bias) = bias {
        set_desc(
            plan.desc,
            DescAttr::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
            &bias,
        )
        .map_err(|e| backend.err(op, "cublasLtMatmulDescSetAttribute", e))?;
    }
    let (alpha, beta) = (1.0f32, if c.is_some() { 1.0f32 } else { 0.0 });
    let c = c.unwrap_or(d);
    backend
        .ctx
        .bind_to_thread()
        .map_err(|e| backend.err(op, "cuCtxSetCurrent", e))?;
    // SAFETY: the plan's layouts describe the buffers the caller passed (checked shapes); alpha/beta are
    // f32 host scalars (scale type 32F); C has D's layout (C = D with beta 0, not read); the
    // workspace is WORKSPACE_BYTES long.
    unsafe {
        lt::matmul(
            handle,
            plan.desc,
            (&alpha as *const f32).cast::<c_void>(),
            (&beta as *const f32).cast::<c_void>(),
            a as *const c_void,
            plan.a,
            b as *const c_void,
            plan.b,
            c as *const c_void,
            plan.d,
            d as *mut c_void,
            plan.d,
            &plan.algo,
            workspace as *mut c_void,
            WORKSPACE_BYTES,
            backend.stream.cu_stream() as _,
        )
    }
    .map_err(|e| backend.err(op, "cublasLtMatmul", (key, e)))
}
