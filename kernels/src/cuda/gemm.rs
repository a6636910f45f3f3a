//! GEMMs through cuBLASLt, with the descriptors, layouts and the chosen algorithm cached per shape.
//!
//! cudarc's safe `Matmul` creates descriptors and asks the heuristic on every call; the DiT calls the same
//! few shapes thousands of times, so a [`Plan`] is built once per [`GemmKey`] and reused (only the bias
//! pointer changes between calls). cuBLASLt is column-major: the callers in `ops/matmul/cuda.rs` map
//! row-major `x @ W.T` and `a @ b` onto it (see there).
//!
//! The algorithm: cuBLASLt's heuristic ranks its algorithms for a shape from a model of the GPU,
//! and its first is not always the fastest (on the 14B DiT's linears its choice ran at ~89 % of the
//! GEMM ceiling). With `cuda.gemm_search: find` (the default) the first call of a large shape
//! ([`SEARCH_MIN_FLOPS`]) times the heuristic's first [`CANDIDATES`] algorithms on the call's own
//! buffers, in interleaved rounds, and keeps the fastest if it is clearly faster than the first
//! ([`SWITCH_MARGIN`]); the choice, as its rank in the heuristic's list (deterministic
//! for one GPU model, cuBLASLt version and shape), goes to `cublaslt-algos.tsv` in the kernel cache
//! (`plan_cache.rs`), so a restart takes it without timing, and two processes with one cache run
//! the same algorithm, hence the same rounding. `heuristic` takes the first, nothing timed.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;

use cudarc::cublaslt::result::{self as lt, CublasError};
use cudarc::cublaslt::sys::{self as lt_sys, cublasLtMatmulDescAttributes_t as DescAttr};
use cudarc::driver::{CudaSlice, DevicePtr};

use super::nvrtc::AlgoSearch;
use super::plan_cache::{Entry, PlanCache};
use super::{CudaBackend, catch};
use crate::{DType, KernelError, Result};

/// cuBLASLt's workspace: NVIDIA's recommendation for Hopper (32 MiB).
const WORKSPACE_BYTES: usize = 32 << 20;

/// GEMMs of at least this many FLOPs (2·m·n·k·batch) have their algorithm chosen by timing: from
/// ~0.15 ms each on an H200, so a search (CANDIDATES × (1 + ROUNDS·RUNS_PER_ROUND) calls) costs
/// 15 ms to 1.5 s per shape (the 14B FFN), once per GPU model and cuBLASLt version. Smaller ones
/// take the heuristic's first (what a search would gain there is below the timing's noise).
const SEARCH_MIN_FLOPS: f64 = 1e11;
/// How many of the heuristic's algorithms a search times.
const CANDIDATES: usize = 8;
/// Timed rounds: each round times every candidate once, so a drift of the clocks (an H200 under
/// load runs 1.5–1.7 GHz, idle 1.98) shifts every candidate alike instead of favouring the first.
const ROUNDS: usize = 5;
/// Calls between the two events of one timing.
const RUNS_PER_ROUND: usize = 2;
/// Another algorithm replaces the heuristic's first only when its median is this much faster:
/// timings of one algorithm on an H200 spread by a few percent between rounds, and a switch on noise
/// would make the choice depend on the run that made it.
const SWITCH_MARGIN: f32 = 0.97;

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
/// (ld m). A, B and D all have `dtype`, unless `e4m3`; accumulation and scaling are f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct GemmKey {
    pub dtype: DType,
    /// A and B hold e4m3 codes, each with one f32 scale per row of op(A) and per column of B
    /// (cuBLASLt's outer-vector scaling, applied to the f32 accumulator with alpha): D =
    /// diag(scale_a)·(op(A)·B)·diag(scale_b). C, D and the bias stay in `dtype`. cuBLASLt takes
    /// FP8 operands only transposed-A ("TN") with k and m multiples of 16.
    pub e4m3: bool,
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

impl GemmKey {
    /// 2·m·n·k per batch entry.
    fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64 * f64::from(self.batch.max(1))
    }

    /// The key's text in the algorithm cache: every field, e.g.
    /// `bf16 m1536 n32760 k1536 ta b1 s0,0,0 bias` (`e4m3fast>bf16 …` for FP8 operands, which
    /// accumulate fast: a cache written before they did, keyed `e4m3>`, is not taken for them).
    fn text(&self) -> String {
        let dtype = match self.dtype {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
        };
        let epilogue = match self.epilogue {
            Epilogue::None => "none",
            Epilogue::Bias => "bias",
            Epilogue::GeluBias => "gelu_bias",
        };
        format!(
            "{}{dtype} m{} n{} k{} {} b{} s{},{},{} {epilogue}",
            if self.e4m3 { "e4m3fast>" } else { "" },
            self.m,
            self.n,
            self.k,
            if self.transa { "ta" } else { "na" },
            self.batch,
            self.stride_a,
            self.stride_b,
            self.stride_d
        )
    }
}

/// A search's choice for one shape: which of the heuristic's algorithms, and its time.
#[derive(Debug, Clone, PartialEq)]
struct AlgoChoice {
    /// The algorithm's rank in the heuristic's list (0: its first).
    rank: usize,
    /// Its measured time per call, for the log.
    ms: f32,
}

impl Entry for AlgoChoice {
    fn fields(&self) -> Vec<String> {
        vec![self.rank.to_string(), self.ms.to_string()]
    }

    fn parse(fields: &[&str]) -> Option<Self> {
        let [rank, ms] = fields[..] else {
            return None;
        };
        Some(AlgoChoice {
            rank: rank.parse().ok()?,
            ms: ms.parse().ok()?,
        })
    }
}

/// Descriptors and algorithm for one [`GemmKey`].
struct Plan {
    desc: lt_sys::cublasLtMatmulDesc_t,
    a: lt_sys::cublasLtMatrixLayout_t,
    b: lt_sys::cublasLtMatrixLayout_t,
    d: lt_sys::cublasLtMatrixLayout_t,
    /// The heuristic's algorithms, best-ranked first (at most [`CANDIDATES`]).
    candidates: Vec<lt_sys::cublasLtMatmulAlgo_t>,
    /// The one that runs: an index into `candidates`.
    chosen: usize,
    /// Whether a search is still owed (the first call able to time runs it).
    search_pending: bool,
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
    search: AlgoSearch,
    /// `cublasLtGetVersion()`, part of each cached choice's key.
    version: usize,
    /// The GPU model as the algorithm cache keys it (see `CudaBackend::model`).
    device: String,
    /// The algorithm cache file and its choices as read when this handle was made.
    cache_path: std::path::PathBuf,
    cache: PlanCache<AlgoChoice>,
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
        let config = super::cuda_config();
        // SAFETY: cublasLtGetVersion takes no arguments and only reads a constant.
        let version = unsafe { lt_sys::cublasLtGetVersion() };
        let cache_path = config.cache_dir.join("cublaslt-algos.tsv");
        Ok(Blas {
            handle,
            workspace,
            plans: HashMap::new(),
            search: config.gemm_search,
            version,
            device: backend.model(),
            cache: PlanCache::load(&cache_path),
            cache_path,
        })
    }

    /// The plan of `key`, built on first use: with its cached choice if there is one, else the
    /// heuristic's first and a search pending when the shape is large enough.
    /// `scales`: an e4m3 key's scale pointers for the heuristic (see `build_plan`).
    fn plan(
        &mut self,
        key: GemmKey,
        scales: Option<(u64, u64)>,
    ) -> std::result::Result<&mut Plan, CublasError> {
        if !self.plans.contains_key(&key) {
            let mut plan = build_plan(self.handle, key, scales)?;
            let wants_search = self.search == AlgoSearch::Find && key.flops() >= SEARCH_MIN_FLOPS;
            if wants_search {
                match self.cache.get(&self.device, self.version, &key.text()) {
                    Some(c) if c.rank < plan.candidates.len() => plan.chosen = c.rank,
                    _ => plan.search_pending = plan.candidates.len() > 1,
                }
            }
            self.plans.insert(key, plan);
        }
        // Inserted just above when absent.
        self.plans.get_mut(&key).ok_or(CublasError(
            lt_sys::cublasStatus_t::CUBLAS_STATUS_INTERNAL_ERROR,
        ))
    }

    /// Writes a search's choice to the cache file (a failure to write costs a search at the next
    /// start, so it is logged, not returned).
    fn remember(&mut self, key: GemmKey, choice: AlgoChoice) {
        let text = key.text();
        self.cache
            .insert(&self.device, self.version, &text, choice.clone());
        if let Err(e) =
            PlanCache::store(&self.cache_path, &self.device, self.version, &text, choice)
        {
            tracing::warn!(path = %self.cache_path.display(), error = %e, "cannot write the cuBLASLt algorithm cache");
        }
    }
}

/// What a matrix holds: elements of a tensor dtype, or e4m3 codes.
#[derive(Debug, Clone, Copy)]
enum Operand {
    Of(DType),
    E4m3,
}

fn layout(
    operand: Operand,
    rows: u64,
    cols: u64,
    ld: i64,
    batch: i32,
    stride: i64,
) -> std::result::Result<lt_sys::cublasLtMatrixLayout_t, CublasError> {
    let ty = match operand {
        Operand::Of(dtype) => lt_type(dtype),
        Operand::E4m3 => lt_sys::cudaDataType_t::CUDA_R_8F_E4M3,
    };
    let layout = lt::create_matrix_layout(ty, rows, cols, ld)?;
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
    scales: Option<(u64, u64)>,
) -> std::result::Result<Plan, CublasError> {
    let (a_rows, a_cols) = if key.transa {
        (key.k, key.m)
    } else {
        (key.m, key.k)
    };
    let operand = if key.e4m3 {
        Operand::E4m3
    } else {
        Operand::Of(key.dtype)
    };
    let a = layout(
        operand,
        a_rows,
        a_cols,
        a_rows as i64,
        key.batch,
        key.stride_a,
    )?;
    let b = layout(operand, key.k, key.n, key.k as i64, key.batch, key.stride_b)?;
    let d = layout(
        Operand::Of(key.dtype),
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
        candidates: Vec::new(),
        chosen: 0,
        search_pending: false,
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
    if key.e4m3 {
        // Fast accumulation: the whole k is summed in the tensor cores' own adder (about 14 bits
        // kept, DeepSeek-V3) instead of being promoted to f32 every few k-steps, as the forward
        // GEMMs of Transformer Engine, torchao's float8 and vLLM's FP8 kernels run. Its error
        // (bounded in `fp8_linears_match_cpu`) is far below the e4m3 rounding of the operands
        // (2⁻⁴), and it is faster (bench/RESULTS.md, 2026-12-04).
        set_desc(desc, DescAttr::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &1i8)?;
        let outer = lt_sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
        set_desc(desc, DescAttr::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer)?;
        set_desc(desc, DescAttr::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer)?;
        // The heuristic checks the vector scales' pointers (cuBLASLt 13.1 on the H200 answered
        // unset ones with CUBLAS_STATUS_INVALID_VALUE): it sees the first call's, and every call
        // sets its own.
        if let Some((scale_a, scale_b)) = scales {
            set_desc(
                desc,
                DescAttr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                &scale_a,
            )?;
            set_desc(
                desc,
                DescAttr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                &scale_b,
            )?;
        }
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
        .and_then(|()| heuristic_algos(handle, desc, (a, b, d), pref))
    };
    // SAFETY: `pref` was created above and is not used after this.
    let _ = unsafe { lt::destroy_matmul_pref(pref) };
    let mut plan = plan_so_far;
    plan.candidates = heuristic?;
    Ok(plan)
}

/// The heuristic's first [`CANDIDATES`] algorithms for the descriptors (C has D's layout), best
/// first; an error if it has none.
///
/// # Safety
/// Every handle must be live.
unsafe fn heuristic_algos(
    handle: lt_sys::cublasLtHandle_t,
    desc: lt_sys::cublasLtMatmulDesc_t,
    (a, b, d): (
        lt_sys::cublasLtMatrixLayout_t,
        lt_sys::cublasLtMatrixLayout_t,
        lt_sys::cublasLtMatrixLayout_t,
    ),
    pref: lt_sys::cublasLtMatmulPreference_t,
) -> std::result::Result<Vec<lt_sys::cublasLtMatmulAlgo_t>, CublasError> {
    // SAFETY: a zeroed result is a valid bit pattern (plain integers and arrays), and is only read
    // for the entries cuBLASLt reports having written.
    let mut results: Vec<lt_sys::cublasLtMatmulHeuristicResult_t> =
        vec![unsafe { std::mem::zeroed() }; CANDIDATES];
    let mut count = 0;
    // SAFETY: the handles are live (the caller's promise); `results` holds CANDIDATES entries.
    unsafe {
        lt_sys::cublasLtMatmulAlgoGetHeuristic(
            handle,
            desc,
            a,
            b,
            d,
            d,
            pref,
            CANDIDATES as i32,
            results.as_mut_ptr(),
            &mut count,
        )
    }
    .result()?;
    let algos: Vec<_> = results
        .iter()
        .take(count.max(0) as usize)
        .filter(|r| r.state == lt_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
        .map(|r| r.algo)
        .collect();
    if algos.is_empty() {
        return Err(CublasError(
            lt_sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED,
        ));
    }
    Ok(algos)
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
    run_gemm(backend, op, key, a, b, d, bias, c, None)
}

/// [`gemm`] for an `e4m3` key: A and B hold e4m3 codes, `scales` = (A's per-row scales [m], B's
/// per-column scales [n]), f32 device buffers.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_e4m3(
    backend: &CudaBackend,
    op: &'static str,
    key: GemmKey,
    a: u64,
    b: u64,
    d: u64,
    bias: Option<u64>,
    c: Option<u64>,
    scales: (u64, u64),
) -> Result<()> {
    run_gemm(backend, op, key, a, b, d, bias, c, Some(scales))
}

#[allow(clippy::too_many_arguments)]
fn run_gemm(
    backend: &CudaBackend,
    op: &'static str,
    key: GemmKey,
    a: u64,
    b: u64,
    d: u64,
    bias: Option<u64>,
    c: Option<u64>,
    scales: Option<(u64, u64)>,
) -> Result<()> {
    if key.e4m3 != scales.is_some() {
        return Err(KernelError::arg(
            op,
            "scales",
            format!("{scales:?}"),
            "e4m3 operands need their scales, other operands none",
        ));
    }
    let mut guard = backend.blas.lock().unwrap_or_else(|e| e.into_inner());
    let blas = match &mut *guard {
        Some(blas) => blas,
        slot @ None => slot.insert(Blas::new(backend)?),
    };
    let (workspace, _) = blas.workspace.device_ptr(&backend.stream);
    let handle = blas.handle;
    let plan = blas
        .plan(key, scales)
        .map_err(|e| backend.err(op, "cublasLtMatmulAlgoGetHeuristic", (key, e)))?;
    if let Some(bias) = bias {
        set_desc(
            plan.desc,
            DescAttr::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
            &bias,
        )
        .map_err(|e| backend.err(op, "cublasLtMatmulDescSetAttribute", e))?;
    }
    if let Some((scale_a, scale_b)) = scales {
        set_desc(
            plan.desc,
            DescAttr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
            &scale_a,
        )
        .and_then(|()| {
            set_desc(
                plan.desc,
                DescAttr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                &scale_b,
            )
        })
        .map_err(|e| backend.err(op, "cublasLtMatmulDescSetAttribute", e))?;
    }
    backend
        .ctx
        .bind_to_thread()
        .map_err(|e| backend.err(op, "cuCtxSetCurrent", e))?;
    let call = Call {
        handle,
        a,
        b,
        d,
        c,
        workspace,
        stream: backend.stream.cu_stream() as _,
    };
    // A search runs the GEMM several times, so D must not also be its input C (then each run would
    // add C again); such a call runs the heuristic's first and leaves the search to a later call.
    if plan.search_pending && c != Some(d) {
        plan.search_pending = false;
        if let Some(choice) = search(backend, plan, &call) {
            plan.chosen = choice.rank;
            tracing::debug!(
                ?key,
                rank = choice.rank,
                ms = choice.ms,
                "cuBLASLt algorithm searched"
            );
            blas.remember(key, choice);
        }
    }
    let plan = blas
        .plan(key, scales)
        .map_err(|e| backend.err(op, "cublasLtMatmulAlgoGetHeuristic", (key, e)))?;
    let algo = plan.candidates[plan.chosen];
    // SAFETY: see `Call::run`; the algorithm is one the heuristic returned for this plan.
    unsafe { call.run(plan, &algo) }.map_err(|e| backend.err(op, "cublasLtMatmul", (key, e)))
}

/// One GEMM call's operands: device addresses, workspace and stream.
struct Call {
    handle: lt_sys::cublasLtHandle_t,
    a: u64,
    b: u64,
    d: u64,
    c: Option<u64>,
    workspace: u64,
    stream: lt_sys::cudaStream_t,
}

impl Call {
    /// Queues D = op(A)·B (+ C) (+ bias) with `algo`.
    ///
    /// # Safety
    /// The plan's layouts describe the buffers (checked shapes), C (when given) has D's layout,
    /// the workspace is WORKSPACE_BYTES long, and `algo` came from the heuristic for this plan.
    unsafe fn run(
        &self,
        plan: &Plan,
        algo: &lt_sys::cublasLtMatmulAlgo_t,
    ) -> std::result::Result<(), CublasError> {
        let (alpha, beta) = (1.0f32, if self.c.is_some() { 1.0f32 } else { 0.0 });
        let c = self.c.unwrap_or(self.d);
        // SAFETY: the caller's promise; alpha/beta are f32 host scalars (scale type 32F); with beta
        // 0, C = D is not read.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                (&alpha as *const f32).cast::<c_void>(),
                (&beta as *const f32).cast::<c_void>(),
                self.a as *const c_void,
                plan.a,
                self.b as *const c_void,
                plan.b,
                c as *const c_void,
                plan.d,
                self.d as *mut c_void,
                plan.d,
                algo,
                self.workspace as *mut c_void,
                WORKSPACE_BYTES,
                self.stream,
            )
        }
    }
}

/// Times the plan's candidates on the call's buffers and returns [`choose`]'s pick: one untimed
/// call each, then [`ROUNDS`] rounds that time every candidate over [`RUNS_PER_ROUND`] calls. A
/// candidate that fails to launch is dropped. Every run writes the same D (C is not D), which the
/// caller's own run then writes once more.
fn search(backend: &CudaBackend, plan: &Plan, call: &Call) -> Option<AlgoChoice> {
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let time =
        |algo: &lt_sys::cublasLtMatmulAlgo_t, runs: usize| -> std::result::Result<f32, String> {
            let start = backend
                .stream
                .record_event(flags)
                .map_err(|e| format!("{e:?}"))?;
            for _ in 0..runs {
                // SAFETY: see `Call::run`; every candidate came from the heuristic for this plan.
                unsafe { call.run(plan, algo) }.map_err(|e| format!("{e:?}"))?;
            }
            let end = backend
                .stream
                .record_event(flags)
                .map_err(|e| format!("{e:?}"))?;
            let ms = start.elapsed_ms(&end).map_err(|e| format!("{e:?}"))?;
            Ok(ms / runs as f32)
        };
    let mut times: Vec<Option<Vec<f32>>> = plan
        .candidates
        .iter()
        .enumerate()
        .map(|(rank, algo)| match time(algo, 1) {
            Ok(_) => Some(Vec::with_capacity(ROUNDS)),
            Err(e) => {
                tracing::debug!(rank, error = %e, "cuBLASLt candidate skipped");
                None
            }
        })
        .collect();
    for _ in 0..ROUNDS {
        for (algo, slot) in plan.candidates.iter().zip(&mut times) {
            if let Some(list) = slot {
                match time(algo, RUNS_PER_ROUND) {
                    Ok(ms) => list.push(ms),
                    Err(_) => *slot = None,
                }
            }
        }
    }
    choose(&times)
}

/// The search's pick from each candidate's timings (`None`: it could not run): the candidate of
/// the lowest median, unless that is less than [`SWITCH_MARGIN`] below the heuristic's first (rank
/// 0), which then stays; `None` if nothing ran.
fn choose(times: &[Option<Vec<f32>>]) -> Option<AlgoChoice> {
    let median = |t: &[f32]| {
        let mut t = t.to_vec();
        t.sort_by(f32::total_cmp);
        t.get(t.len() / 2).copied()
    };
    let medians: Vec<Option<f32>> = times
        .iter()
        .map(|t| t.as_deref().and_then(median))
        .collect();
    let (rank, ms) = medians
        .iter()
        .enumerate()
        .filter_map(|(rank, ms)| ms.map(|ms| (rank, ms)))
        .min_by(|a, b| a.1.total_cmp(&b.1))?;
    match medians.first().copied().flatten() {
        Some(first) if rank != 0 && ms > SWITCH_MARGIN * first => {
            Some(AlgoChoice { rank: 0, ms: first })
        }
        _ => Some(AlgoChoice { rank, ms }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> GemmKey {
        GemmKey {
            dtype: DType::BF16,
            e4m3: false,
            m: 1536,
            n: 32760,
            k: 1536,
            transa: true,
            batch: 1,
            stride_a: 0,
            stride_b: 0,
            stride_d: 0,
            epilogue: Epilogue::Bias,
        }
    }

    /// The algorithm cache keys a choice by the key's text, so every field must be in it.
    #[test]
    fn every_field_of_the_key_is_in_its_text() {
        let base = key();
        assert_eq!(base.text(), "bf16 m1536 n32760 k1536 ta b1 s0,0,0 bias");
        let variants = [
            GemmKey {
                dtype: DType::F32,
                ..base
            },
            GemmKey { e4m3: true, ..base },
            GemmKey { m: 1537, ..base },
            GemmKey { n: 32761, ..base },
            GemmKey { k: 1537, ..base },
            GemmKey {
                transa: false,
                ..base
            },
            GemmKey { batch: 2, ..base },
            GemmKey {
                stride_a: 1,
                ..base
            },
            GemmKey {
                stride_b: 1,
                ..base
            },
            GemmKey {
                stride_d: 1,
                ..base
            },
            GemmKey {
                epilogue: Epilogue::None,
                ..base
            },
            GemmKey {
                epilogue: Epilogue::GeluBias,
                ..base
            },
        ];
        let mut seen = std::collections::HashSet::from([base.text()]);
        for v in &variants {
            assert!(seen.insert(v.text()), "{v:?} collides");
        }
    }

    /// The DiT's linears are searched; the small GEMMs of tests and the VAE's tails are not.
    #[test]
    fn only_large_gemms_are_searched() {
        assert!(key().flops() >= SEARCH_MIN_FLOPS, "1.3B q/k/v/o at 480p");
        let small = GemmKey { n: 4096, ..key() };
        assert!(small.flops() < SEARCH_MIN_FLOPS);
        let batched = GemmKey {
            n: 4096,
            batch: 16,
            ..key()
        };
        assert!(batched.flops() >= SEARCH_MIN_FLOPS, "batch counts");
    }

    /// The fastest median wins, but only by a clear margin over the heuristic's first.
    #[test]
    fn the_search_switches_only_for_a_clear_gain() {
        let t = |v: &[f32]| Some(v.to_vec());
        let pick = |times: &[Option<Vec<f32>>]| choose(times).map(|c| c.rank);
        // Rank 1's median (0.90) is 10 % below rank 0's (1.00): switch. Its one slow round does
        // not count; rank 2 failed.
        assert_eq!(
            pick(&[t(&[1.0, 1.0, 1.01]), t(&[0.9, 5.0, 0.9]), None]),
            Some(1)
        );
        // 1 % faster is within the noise: the heuristic's first stays.
        assert_eq!(
            pick(&[t(&[1.0, 1.0, 1.0]), t(&[0.99, 0.99, 0.99])]),
            Some(0)
        );
        // The first cannot run: the fastest that can.
        assert_eq!(pick(&[None, t(&[2.0]), t(&[1.5])]), Some(2));
        assert_eq!(pick(&[None, None]), None);
        let c = choose(&[t(&[1.0, 1.2, 0.8]), t(&[0.5])]).unwrap();
        assert_eq!((c.rank, c.ms), (1, 0.5));
    }

    #[test]
    fn choices_round_trip_through_the_cache_file() {
        let mut cache = PlanCache::<AlgoChoice>::default();
        let choice = AlgoChoice { rank: 3, ms: 0.25 };
        cache.insert(
            "NVIDIA H200 sm_90a 132",
            130100,
            &key().text(),
            choice.clone(),
        );
        let text = cache.render();
        assert_eq!(
            text,
            "v1\tNVIDIA H200 sm_90a 132\t130100\tbf16 m1536 n32760 k1536 ta b1 s0,0,0 bias\t3\t0.25\n"
        );
        let read = PlanCache::<AlgoChoice>::parse(&text);
        assert_eq!(
            read.get("NVIDIA H200 sm_90a 132", 130100, &key().text()),
            Some(&choice)
        );
        assert!(
            read.get("NVIDIA H200 sm_90a 132", 130200, &key().text())
                .is_none()
        );
        // A cuDNN line (four choice fields) is not a GEMM choice.
        let cudnn = "v1\tgpu\t91900\tbf16 ndhwc b1\t1\t1\t-\t1.5\n";
        assert_eq!(PlanCache::<AlgoChoice>::parse(cudnn), PlanCache::default());
    }
}
