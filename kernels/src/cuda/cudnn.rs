//! Convolutions through cuDNN (cudarc feature `cudnn`): one handle per device on the backend's stream, a
//! `Plan` per convolution shape (the legacy N-d API's descriptors, the algorithm cuDNN measured fastest
//! and its math type; for bf16 possibly a graph-API execution plan that measured faster still, see
//! `cudnn_graph.rs`), and one workspace grown to the largest plan's need.
//!
//! - Why the `result`/`sys` layers and not cudarc's safe `Cudnn`/`ConvForward`: those hold an
//!   `Arc<Cudnn>`, which is neither `Send` nor `Sync`, so they cannot live in the shared
//!   `CudaBackend`; they also unwrap when binding the context and when dropping descriptors, and their
//!   `pick_algorithm` is the heuristic only. The `result` layer is the same legacy API returning Results.
//! - Loading: cudarc panics when libcudnn (or one of its symbols) cannot be loaded. `DnnSlot` probes
//!   the library before the first call, and every cuDNN call runs under `catch`, so absence is
//!   `KernelError::CudaUnavailable { library: "libcudnn" }`, remembered per device. `ConvAlgo::Auto`
//!   then falls back to im2col (with one warning); `ConvAlgo::Cudnn` and `CudnnNdhwc` return the error.
//! - Algorithm: `cudnnFindConvolutionForwardAlgorithmEx` on the first call's own buffers (each candidate
//!   run and timed, as torch's `cudnn.benchmark = True` does), with up to `FIND_WORKSPACE_BYTES` of
//!   workspace; the fastest that succeeded is kept. Should Find fail, the heuristic ranking
//!   (`cudnnGetConvolutionForwardAlgorithm_v7`) picks instead. Find writes the output buffer, which
//!   the caller is about to overwrite anyway. Find costs time once per shape (the `PLAN` lines of
//!   `bench/src/bin/conv.rs` show it), which a first decode pays; `cuda.cudnn_search: heuristic`
//!   in the config (a benchmark run: `DITSTREAM_CUDNN_SEARCH=heuristic`) ranks without running
//!   instead (µs), `find` (the default) measures.
//! - Plan cache: every choice Find (and the graph search) made is written to
//!   `<kernel cache dir>/cudnn-plans.tsv`, keyed by GPU model, cuDNN version and shape
//!   (`plan_cache.rs`); a later process with `find` builds a cached shape's plan directly from its
//!   choice (no Find, no timing: the plan line says `cached`), so only the first start on a GPU
//!   model and cuDNN version pays the search. A cached graph configuration that the heuristics no
//!   longer offer, or that fails to plan, sends the shape back to the search.
//! - Graph API (bf16, `find` only): after Find, the graph API's heuristics offer engine configurations
//!   (up to `GRAPH_CONFIGS`), each planned and timed on the same buffers with CUDA events, the legacy
//!   winner timed the same way beside them (a candidate whose warm-up run is twice as slow as the
//!   fastest so far is not timed further); a graph plan replaces the legacy algorithm only when it is
//!   faster by more than `GRAPH_MARGIN`. The search is paid once per shape and process: at 480p
//!   it made the Wan VAE decode about 1.15× faster on an H200 (983 → 848–868 ms) and cost ~19 s
//!   of the first decodes on one GPU (40 shapes of a 1- and 2-GPU run; planning 4.3 s of it, the
//!   rest the timing runs). Any graph failure (building, planning, running) leaves the
//!   legacy algorithm in place and is written in the plan line (`cudnn_conv_plans`), never returned.
//! - Numerics: bf16 data with an f32 compute type (f32 accumulation) and tensor-op maths; f32 data with
//!   FMA maths only (no TF32), so the f32 path stays as exact as the f32 GEMMs (`gemm.rs`) for parity.
//! - Sizes: the legacy descriptors take 32-bit dims and strides: `DnnConvKey::fits` says whether a
//!   call can go here at all.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::time::Instant;

use cudarc::cudnn::result::{self as dnn, CudnnError};
use cudarc::cudnn::sys;
use cudarc::driver::{CudaSlice, DevicePtr};

use super::cudnn_graph::{self, Candidate, ConvGraph, GraphPlan};
use super::plan_cache::{self, Choice, PlanCache};
// How a plan's algorithm is chosen: the process's `CudaConfig` (the deployment's
// `cuda.cudnn_search`; a test or benchmark run's `DITSTREAM_CUDNN_SEARCH`).
use super::nvrtc::AlgoSearch as Search;
use super::{CudaBackend, catch};
use crate::{DType, KernelError, Result};

/// Most workspace the algorithm search may hand cuDNN (and so the most a chosen algorithm, or graph
/// plan, may need).
const FIND_WORKSPACE_BYTES: usize = 512 << 20;

/// Most graph-API engine configurations planned and timed per shape. PyTorch's `cudnn.benchmark`
/// times 10 by default (`benchmark_limit`); a few more cost ~3 ms each for the VAE's largest shapes,
/// paid once per shape.
const GRAPH_CONFIGS: usize = 16;

/// Timed runs per candidate (after one untimed warm-up run, which also loads the kernel); the median
/// is kept.
const TIMED_RUNS: usize = 3;

/// How much faster (as a fraction) a graph plan must measure than the legacy algorithm to replace it:
/// the spread of event-timed medians of one ms-scale kernel is below 1%, and within noise the legacy
/// algorithm, which the parity tests have always covered, stays.
const GRAPH_MARGIN: f32 = 0.01;

/// The memory order of a convolution's activations (filters follow it: [C_out, C_in, kt, kh, kw] or
/// [C_out, kt, kh, kw, C_in]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum DnnLayout {
    /// [B, C, T, H, W], our tensors' layout.
    Ncdhw,
    /// [B, T, H, W, C], channels last.
    Ndhwc,
}

/// One convolution shape: input [B, C_in, T, H, W] (in `layout`'s memory order), filter
/// [C_out, C_in, kt, kh, kw], symmetric zero padding `pad`, stride `stride`, dilation 1, no groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct DnnConvKey {
    pub dtype: DType,
    pub layout: DnnLayout,
    pub batch: usize,
    pub c_in: usize,
    pub c_out: usize,
    /// [T, H, W] of the input.
    pub input: [usize; 3],
    pub kernel: [usize; 3],
    pub stride: [usize; 3],
    pub pad: [usize; 3],
}

impl DnnConvKey {
    /// [T_out, H_out, W_out] (the caller checked that every padded axis holds the kernel).
    pub fn output(&self) -> [usize; 3] {
        std::array::from_fn(|a| {
            (self.input[a] + 2 * self.pad[a] - self.kernel[a]) / self.stride[a] + 1
        })
    }

    /// Whether every element count (hence every dim and stride) fits cuDNN's 32-bit descriptors.
    pub fn fits(&self) -> bool {
        let [t, h, w] = self.input;
        let [to, ho, wo] = self.output();
        let [kt, kh, kw] = self.kernel;
        let limit = i32::MAX as u128;
        let counts = [
            self.batch * self.c_in * t * h * w,
            self.batch * self.c_out * to * ho * wo,
            self.c_out * self.c_in * kt * kh * kw,
        ];
        counts.iter().all(|&n| (n as u128) <= limit)
            && self
                .pad
                .iter()
                .chain(&self.stride)
                .all(|&v| v as u128 <= limit)
    }

    /// [B, C, T, H, W] dims and their element strides in `layout`.
    fn tensor(&self, channels: usize, spatial: [usize; 3]) -> ([c_int; 5], [c_int; 5]) {
        let (dims, strides) = dims_and_strides(self.layout, self.batch, channels, spatial);
        (dims.map(|d| d as c_int), strides.map(|s| s as c_int))
    }

    /// The graph API's x, w and y: [N, C, D, H, W] dims and element strides in the key's layout; the
    /// filter is [C_out, C_in, kt, kh, kw] stored as the legacy filter descriptor says (channels last,
    /// [C_out, kt, kh, kw, C_in] in memory, for NDHWC).
    pub(crate) fn graph_tensors(&self) -> [([i64; 5], [i64; 5]); 3] {
        let to_i64 = |(dims, strides): ([usize; 5], [usize; 5])| {
            (dims.map(|d| d as i64), strides.map(|s| s as i64))
        };
        [
            dims_and_strides(self.layout, self.batch, self.c_in, self.input),
            dims_and_strides(self.layout, self.c_out, self.c_in, self.kernel),
            dims_and_strides(self.layout, self.batch, self.c_out, self.output()),
        ]
        .map(to_i64)
    }
}

/// The dims [N, C, D, H, W] of a dense tensor and their element strides in `layout` (a filter is
/// N = C_out, C = C_in).
fn dims_and_strides(
    layout: DnnLayout,
    n: usize,
    c: usize,
    [t, h, w]: [usize; 3],
) -> ([usize; 5], [usize; 5]) {
    let strides = match layout {
        DnnLayout::Ncdhw => [c * t * h * w, t * h * w, h * w, w, 1],
        DnnLayout::Ndhwc => [t * h * w * c, 1, h * w * c, w * c, c],
    };
    ([n, c, t, h, w], strides)
}

pub(crate) fn data_type(dtype: DType) -> sys::cudnnDataType_t {
    match dtype {
        DType::F32 => sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
        DType::BF16 => sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
    }
}

/// The math type asked for: tensor cores for bf16, plain FMA (no TF32) for f32.
fn math_type(dtype: DType) -> sys::cudnnMathType_t {
    match dtype {
        DType::F32 => sys::cudnnMathType_t::CUDNN_FMA_MATH,
        DType::BF16 => sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
    }
}

/// A failed cuDNN call: its name and status.
type CallError = (&'static str, CudnnError);

fn call(name: &'static str) -> impl Fn(CudnnError) -> CallError {
    move |e| (name, e)
}

/// The four descriptors of one convolution; destroyed on drop.
struct Descriptors {
    x: sys::cudnnTensorDescriptor_t,
    w: sys::cudnnFilterDescriptor_t,
    conv: sys::cudnnConvolutionDescriptor_t,
    y: sys::cudnnTensorDescriptor_t,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each non-null descriptor was created by `Descriptors::new` and is destroyed once;
        // failures are ignored (nothing to do about them while dropping).
        unsafe {
            if !self.x.is_null() {
                let _ = dnn::destroy_tensor_descriptor(self.x);
            }
            if !self.w.is_null() {
                let _ = dnn::destroy_filter_descriptor(self.w);
            }
            if !self.conv.is_null() {
                let _ = dnn::destroy_convolution_descriptor(self.conv);
            }
            if !self.y.is_null() {
                let _ = dnn::destroy_tensor_descriptor(self.y);
            }
        }
    }
}

impl Descriptors {
    /// The descriptors of `key`, with cuDNN's own output size checked against ours. Needs libcudnn but
    /// no handle or GPU.
    fn new(key: &DnnConvKey) -> std::result::Result<Self, CallError> {
        let mut d = Descriptors {
            x: std::ptr::null_mut(),
            w: std::ptr::null_mut(),
            conv: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
        };
        let dt = data_type(key.dtype);
        d.x = dnn::create_tensor_descriptor().map_err(call("cudnnCreateTensorDescriptor"))?;
        d.w = dnn::create_filter_descriptor().map_err(call("cudnnCreateFilterDescriptor"))?;
        d.conv = dnn::create_convolution_descriptor()
            .map_err(call("cudnnCreateConvolutionDescriptor"))?;
        d.y = dnn::create_tensor_descriptor().map_err(call("cudnnCreateTensorDescriptor"))?;
        let (x_dims, x_strides) = key.tensor(key.c_in, key.input);
        let output = key.output();
        let (y_dims, y_strides) = key.tensor(key.c_out, output);
        let filter = [
            key.c_out,
            key.c_in,
            key.kernel[0],
            key.kernel[1],
            key.kernel[2],
        ]
        .map(|v| v as c_int);
        let format = match key.layout {
            DnnLayout::Ncdhw => sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
            DnnLayout::Ndhwc => sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
        };
        let pad = key.pad.map(|v| v as c_int);
        let stride = key.stride.map(|v| v as c_int);
        let dilation: [c_int; 3] = [1; 3];
        let mut cudnn_out = [0 as c_int; 5];
        // SAFETY: the descriptors were created above; every array outlives its call and holds the
        // count passed (5 tensor dims, 5 filter dims, 3 spatial pads/strides/dilations).
        unsafe {
            dnn::set_tensornd_descriptor(d.x, dt, 5, x_dims.as_ptr(), x_strides.as_ptr())
                .map_err(call("cudnnSetTensorNdDescriptor"))?;
            dnn::set_filternd_descriptor(d.w, dt, format, 5, filter.as_ptr())
                .map_err(call("cudnnSetFilterNdDescriptor"))?;
            // Cross-correlation (PyTorch's "convolution"), f32 compute type for both dtypes.
            dnn::set_convolutionnd_descriptor(
                d.conv,
                3,
                pad.as_ptr(),
                stride.as_ptr(),
                dilation.as_ptr(),
                sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
            )
            .map_err(call("cudnnSetConvolutionNdDescriptor"))?;
            dnn::set_convolution_math_type(d.conv, math_type(key.dtype))
                .map_err(call("cudnnSetConvolutionMathType"))?;
            sys::cudnnGetConvolutionNdForwardOutputDim(d.conv, d.x, d.w, 5, cudnn_out.as_mut_ptr())
                .result()
                .map_err(call("cudnnGetConvolutionNdForwardOutputDim"))?;
            dnn::set_tensornd_descriptor(d.y, dt, 5, y_dims.as_ptr(), y_strides.as_ptr())
                .map_err(call("cudnnSetTensorNdDescriptor"))?;
        }
        if cudnn_out != y_dims {
            // Our geometry and cuDNN's disagree: a bug here, reported rather than run.
            return Err((
                "cudnnGetConvolutionNdForwardOutputDim",
                CudnnError(sys::cudnnStatus_t::CUDNN_STATUS_BAD_PARAM),
            ));
        }
        Ok(d)
    }
}

/// A convolution ready to run: the legacy descriptors and algorithm (with the math type it was measured
/// with), the graph plan that runs instead when one measured faster, and the workspace they need.
struct Plan {
    desc: Descriptors,
    algo: sys::cudnnConvolutionFwdAlgo_t,
    math: sys::cudnnMathType_t,
    /// Bytes of workspace: the most either path needs (a graph plan can fall back to the algorithm).
    workspace: usize,
    /// How the algorithm was chosen ("find": measured; "heuristic": ranked), its measured time, and how
    /// long the whole choice (graph search included) took.
    how: &'static str,
    measured_ms: f32,
    search_ms: f64,
    /// The graph-API plan that runs instead of `algo` (it measured faster), if any.
    graph: Option<GraphPlan>,
    /// What the graph search found, for the plan line: the best configuration's time against the
    /// legacy algorithm's, or why the graph API is not used for this shape.
    graph_note: String,
    /// Calls that ran `algo` although `graph` is set, because their buffers were not aligned as the
    /// graph's tensors declare (none expected: buffers come whole from the allocator).
    unaligned_calls: usize,
}

/// A device's cuDNN handle, plans and workspace; lives in `CudaBackend::dnn` behind a mutex.
pub(crate) struct Dnn {
    handle: sys::cudnnHandle_t,
    version: usize,
    search: Search,
    /// The GPU model as the plan cache keys it: name, NVRTC architecture, SM count.
    device: String,
    /// The plan cache file and its choices as read when this handle was made.
    cache_path: std::path::PathBuf,
    cache: PlanCache<Choice>,
    plans: HashMap<DnnConvKey, Plan>,
    workspace: Option<CudaSlice<u8>>,
}

// SAFETY: the handle and descriptors are plain cuDNN objects used only under the backend's mutex (never
// from two threads at once), with the backend's context bound before each use.
unsafe impl Send for Dnn {}

impl Drop for Dnn {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: the handle was created in `Dnn::new` and is destroyed once.
        let _ = unsafe { dnn::destroy_handle(self.handle) };
    }
}

/// The state of a device's cuDNN: not tried yet, ready, or unusable (the error is kept and returned on
/// every later attempt, so a missing library is probed once).
#[derive(Default)]
pub(crate) enum DnnSlot {
    #[default]
    Untried,
    Ready(Box<Dnn>),
    Unavailable(KernelError),
}

/// libcudnn present (dlopen-able under one of cudarc's candidate names), or `CudaUnavailable`.
pub(crate) fn probe() -> Result<()> {
    // SAFETY: is_culib_present only dlopens the candidate names and drops the handles.
    if !unsafe { sys::is_culib_present() } {
        return Err(KernelError::CudaUnavailable {
            library: "libcudnn",
            detail: format!(
                "tried {:?} (convolutions fall back to im2col + cuBLASLt unless cuDNN is forced)",
                cudarc::get_lib_name_candidates("cudnn")
            ),
        });
    }
    Ok(())
}

/// cuDNN's version as `major·10000 + minor·100 + patch` (9.19.0 → 91900); needs the library only.
fn library_version() -> Result<usize> {
    probe()?;
    // SAFETY: cudnnGetVersion takes no arguments and only reads a constant.
    catch("libcudnn", || unsafe { sys::cudnnGetVersion() })
}

impl Dnn {
    fn new(backend: &CudaBackend) -> Result<Self> {
        let config = super::cuda_config();
        let search = config.cudnn_search;
        let version = library_version()?;
        let unavailable = |call: &str, e: CudnnError| KernelError::CudaUnavailable {
            library: "libcudnn",
            detail: format!("{call}: {e:?} (cuDNN {version})"),
        };
        backend
            .ctx
            .bind_to_thread()
            .map_err(|e| backend.err("cudnn", "cuCtxSetCurrent", e))?;
        let handle =
            catch("libcudnn", dnn::create_handle)?.map_err(|e| unavailable("cudnnCreate", e))?;
        let cache_path = config.cache_dir.join("cudnn-plans.tsv");
        let device = backend.model();
        let dnn = Dnn {
            handle,
            version,
            search,
            cache: PlanCache::load(&cache_path),
            cache_path,
            device,
            plans: HashMap::new(),
            workspace: None,
        };
        // SAFETY: `handle` is live; the stream is the backend's, alive as long as the backend (which
        // owns this `Dnn`).
        catch("libcudnn", || unsafe {
            dnn::set_stream(dnn.handle, backend.stream.cu_stream() as sys::cudaStream_t)
        })?
        .map_err(|e| unavailable("cudnnSetStream", e))?;
        tracing::debug!(ordinal = backend.ordinal, version, "cuDNN ready");
        Ok(dnn)
    }

    /// The plan of `key`, measured on the buffers `x`, `w`, `y` if not built yet.
    fn plan(
        &mut self,
        backend: &CudaBackend,
        key: &DnnConvKey,
        (x, w, y): (u64, u64, u64),
    ) -> std::result::Result<&Plan, CallError> {
        if !self.plans.contains_key(key) {
            let shape = plan_cache::shape_text(key);
            let cached = match self.search {
                Search::Find => self.cache.get(&self.device, self.version, &shape).cloned(),
                Search::Heuristic => None,
            };
            let from_cache = cached.and_then(|choice| {
                plan_from_choice(self.handle, key, &choice)
                    .inspect_err(|e| {
                        tracing::info!(?key, error = ?e, "cached cuDNN plan unusable: searching again")
                    })
                    .ok()
            });
            let plan = match from_cache {
                Some(plan) => plan,
                None => {
                    let plan = build_plan(self.handle, self.search, backend, key, (x, w, y))?;
                    if plan.how == "find" {
                        self.remember(&shape, &plan);
                    }
                    plan
                }
            };
            tracing::debug!(
                ?key,
                algo = ?plan.algo,
                math = ?plan.math,
                workspace = plan.workspace,
                how = plan.how,
                graph = plan.graph.as_ref().map(|g| g.candidate.label.as_str()),
                graph_note = %plan.graph_note,
                "cuDNN convolution plan"
            );
            self.plans.insert(*key, plan);
        }
        // Inserted just above when absent.
        self.plans.get(key).ok_or((
            "plan cache",
            CudnnError(sys::cudnnStatus_t::CUDNN_STATUS_INTERNAL_ERROR),
        ))
    }
}

impl Dnn {
    /// Writes a measured plan's choice to the cache file (a failure to write costs a search at the
    /// next start, so it is logged, not returned).
    fn remember(&mut self, shape: &str, plan: &Plan) {
        let choice = Choice {
            algo: plan.algo as i32,
            math: plan.math as i32,
            graph: plan.graph.as_ref().map(|g| g.candidate.label.clone()),
            ms: plan.measured_ms,
        };
        self.cache
            .insert(&self.device, self.version, shape, choice.clone());
        if let Err(e) =
            PlanCache::store(&self.cache_path, &self.device, self.version, shape, choice)
        {
            tracing::warn!(path = %self.cache_path.display(), error = %e, "cannot write the cuDNN plan cache");
        }
    }
}

const ALGOS: [sys::cudnnConvolutionFwdAlgo_t; 8] = {
    use sys::cudnnConvolutionFwdAlgo_t::*;
    [
        CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
        CUDNN_CONVOLUTION_FWD_ALGO_FFT,
        CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
        CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
    ]
};

const MATHS: [sys::cudnnMathType_t; 4] = {
    use sys::cudnnMathType_t::*;
    [
        CUDNN_DEFAULT_MATH,
        CUDNN_TENSOR_OP_MATH,
        CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION,
        CUDNN_FMA_MATH,
    ]
};

/// The plan of a cached choice, built without searching: the legacy algorithm and math type as
/// recorded, and the recorded graph configuration planned alone. Any failure (an unknown
/// number, a configuration no longer offered) is an error, and the caller searches instead.
fn plan_from_choice(
    handle: sys::cudnnHandle_t,
    key: &DnnConvKey,
    choice: &Choice,
) -> std::result::Result<Plan, CallError> {
    let started = Instant::now();
    let bad = |what| (what, CudnnError(sys::cudnnStatus_t::CUDNN_STATUS_BAD_PARAM));
    let algo = *ALGOS
        .iter()
        .find(|a| **a as i32 == choice.algo)
        .ok_or(bad("plan cache (unknown algorithm number)"))?;
    let math = match key.dtype {
        DType::BF16 => *MATHS
            .iter()
            .find(|m| **m as i32 == choice.math)
            .ok_or(bad("plan cache (unknown math type number)"))?,
        // f32 keeps FMA whatever is recorded (see `build_plan`).
        DType::F32 => math_type(DType::F32),
    };
    let desc = Descriptors::new(key)?;
    // SAFETY: `desc.conv` is live; the math type is a valid enum value.
    unsafe { dnn::set_convolution_math_type(desc.conv, math) }
        .map_err(call("cudnnSetConvolutionMathType"))?;
    // SAFETY: live handle and descriptors.
    let mut workspace = unsafe {
        dnn::get_convolution_forward_workspace_size(handle, desc.x, desc.w, desc.conv, desc.y, algo)
    }
    .map_err(call("cudnnGetConvolutionForwardWorkspaceSize"))?;
    let graph = match &choice.graph {
        None => None,
        Some(label) => {
            let graph = catch("libcudnn", || ConvGraph::new(handle, key))
                .map_err(|_| bad("plan cache (graph API unavailable)"))?
                .map_err(|_| bad("plan cache (graph not built)"))?;
            let mut offer = catch("libcudnn", || {
                cudnn_graph::candidates(handle, &graph, 1, FIND_WORKSPACE_BYTES, Some(label))
            })
            .map_err(|_| bad("plan cache (graph API unavailable)"))?;
            let candidate = offer.candidates.pop().ok_or(bad(
                "plan cache (the cached graph configuration is not offered)",
            ))?;
            workspace = workspace.max(candidate.workspace);
            Some(GraphPlan::new(candidate, graph))
        }
    };
    Ok(Plan {
        desc,
        algo,
        math,
        workspace,
        how: "cached",
        measured_ms: choice.ms,
        search_ms: started.elapsed().as_secs_f64() * 1e3,
        graph_note: match &choice.graph {
            Some(label) => format!("cached {label}"),
            None => "cached: legacy algorithm".into(),
        },
        graph,
        unaligned_calls: 0,
    })
}

/// Measures (or, with `Search::Heuristic` or when Find fails, ranks) the algorithms for `key` and keeps
/// the fastest.
fn build_plan(
    handle: sys::cudnnHandle_t,
    search: Search,
    backend: &CudaBackend,
    key: &DnnConvKey,
    (x, w, y): (u64, u64, u64),
) -> std::result::Result<Plan, CallError> {
    let started = Instant::now();
    let desc = Descriptors::new(key)?;
    let mut max_count: c_int = 0;
    // SAFETY: `handle` is live; `max_count` is an out-parameter.
    unsafe { sys::cudnnGetConvolutionForwardAlgorithmMaxCount(handle, &mut max_count) }
        .result()
        .map_err(call("cudnnGetConvolutionForwardAlgorithmMaxCount"))?;
    let max_count = max_count.max(1);
    // SAFETY: the perf struct is plain data whose all-zero pattern is valid (algo 0, status SUCCESS,
    // time 0, memory 0, NON_DETERMINISTIC, DEFAULT_MATH); cuDNN overwrites the entries it returns.
    let mut perf: Vec<sys::cudnnConvolutionFwdAlgoPerf_t> =
        vec![unsafe { std::mem::zeroed() }; max_count as usize];
    let mut returned: c_int = 0;
    let found = (search == Search::Find).then(|| {
        // The search's workspace: freed (stream-ordered) when this closure returns; none if it cannot
        // be had, which only narrows the search to algorithms that need none.
        // SAFETY: handed to cuDNN only, which needs no initial contents.
        let scratch = unsafe { backend.stream.alloc::<u8>(FIND_WORKSPACE_BYTES) }.ok();
        let (scratch_ptr, scratch_len) = match &scratch {
            Some(s) => (s.device_ptr(&backend.stream).0, FIND_WORKSPACE_BYTES),
            None => (0, 0),
        };
        // SAFETY: the descriptors describe the caller's buffers x, w, y (checked shapes); the workspace
        // holds scratch_len bytes; `perf` holds max_count entries.
        unsafe {
            sys::cudnnFindConvolutionForwardAlgorithmEx(
                handle,
                desc.x,
                x as *const c_void,
                desc.w,
                w as *const c_void,
                desc.conv,
                desc.y,
                y as *mut c_void,
                max_count,
                &mut returned,
                perf.as_mut_ptr(),
                scratch_ptr as *mut c_void,
                scratch_len,
            )
        }
        .result()
    });
    let how = if let Some(Ok(())) = found {
        "find"
    } else {
        // Ranked without running: the heuristic's order.
        // SAFETY: as above, without buffers.
        unsafe {
            dnn::get_convolution_forward_algorithm(
                handle,
                desc.x,
                desc.w,
                desc.conv,
                desc.y,
                max_count,
                &mut returned,
                perf.as_mut_ptr(),
            )
        }
        .map_err(call("cudnnGetConvolutionForwardAlgorithm_v7"))?;
        if found.is_some() {
            "heuristic (find failed)"
        } else {
            "heuristic"
        }
    };
    let candidates = &perf[..(returned.max(0) as usize).min(perf.len())];
    // The fastest that ran (both calls return their results fastest first), within the workspace cap.
    let usable = |p: &&sys::cudnnConvolutionFwdAlgoPerf_t| {
        p.status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS && p.memory <= FIND_WORKSPACE_BYTES
    };
    let best = candidates.iter().find(usable).ok_or((
        "algorithm search (no candidate succeeded within the workspace cap)",
        found
            .and_then(|f| f.err())
            .unwrap_or(CudnnError(sys::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED)),
    ))?;
    // bf16 runs with the math type cuDNN reported for the algorithm (as NVIDIA advises after Find); f32
    // keeps FMA whatever was reported, so that no TF32 path is ever enabled for it.
    let math = match key.dtype {
        DType::BF16 => best.mathType,
        DType::F32 => math_type(DType::F32),
    };
    // SAFETY: `desc.conv` is live; the math type is a valid enum value.
    unsafe { dnn::set_convolution_math_type(desc.conv, math) }
        .map_err(call("cudnnSetConvolutionMathType"))?;
    // SAFETY: live handle and descriptors.
    let needed = unsafe {
        dnn::get_convolution_forward_workspace_size(
            handle, desc.x, desc.w, desc.conv, desc.y, best.algo,
        )
    }
    .map_err(call("cudnnGetConvolutionForwardWorkspaceSize"))?;
    let mut plan = Plan {
        algo: best.algo,
        math,
        workspace: needed.max(best.memory),
        how,
        measured_ms: best.time,
        search_ms: 0.0,
        desc,
        graph: None,
        graph_note: String::new(),
        unaligned_calls: 0,
    };
    plan.graph_note = match (search, key.dtype) {
        (Search::Heuristic, _) => "not searched (heuristic search times nothing)".into(),
        // Engines for f32 data may compute in TF32 (their notes say so); rather than trust a filter,
        // f32 keeps the legacy FMA algorithms, whose math type is forced above.
        (Search::Find, DType::F32) => "not used for f32 (legacy FMA keeps TF32 out)".into(),
        (Search::Find, DType::BF16) => {
            // A symbol missing from an old libcudnn panics inside cudarc: caught here, so that it
            // leaves the legacy plan in place rather than failing the convolution.
            let searched = catch("libcudnn", || {
                graph_search(handle, backend, key, &plan, (x, w, y))
            });
            let (graph, note) =
                searched.unwrap_or_else(|e| (None, format!("graph API unavailable: {e}")));
            if let Some(g) = &graph {
                plan.workspace = plan.workspace.max(g.candidate.workspace);
            }
            plan.graph = graph;
            note
        }
    };
    plan.search_ms = started.elapsed().as_secs_f64() * 1e3;
    Ok(plan)
}

/// y = conv(x, w) by the legacy algorithm `algo` on `desc` (alpha 1, beta 0).
///
/// # Safety
/// `desc` describes the device buffers `x`, `w`, `y`; the workspace holds `ws_len` bytes, at least what
/// `algo` needs with `desc`'s math type.
unsafe fn legacy_forward(
    handle: sys::cudnnHandle_t,
    desc: &Descriptors,
    algo: sys::cudnnConvolutionFwdAlgo_t,
    (x, w, y): (u64, u64, u64),
    (ws_ptr, ws_len): (u64, usize),
) -> std::result::Result<(), CudnnError> {
    let (alpha, beta) = (1.0f32, 0.0f32);
    // SAFETY: per the caller; alpha/beta are f32 host scalars (the scaling type of f32 and bf16 data).
    unsafe {
        dnn::convolution_forward(
            handle,
            (&alpha as *const f32).cast(),
            desc.x,
            x as *const c_void,
            desc.w,
            w as *const c_void,
            desc.conv,
            algo,
            ws_ptr as *mut c_void,
            ws_len,
            (&beta as *const f32).cast(),
            desc.y,
            y as *mut c_void,
        )
    }
}

/// The graph API's best plan for `key` if it beats the legacy algorithm of `legacy` (both timed the same
/// way on the caller's buffers), and a note of what was found. Never an error: any failure leaves the
/// legacy algorithm in place and is described in the note.
fn graph_search(
    handle: sys::cudnnHandle_t,
    backend: &CudaBackend,
    key: &DnnConvKey,
    legacy: &Plan,
    (x, w, y): (u64, u64, u64),
) -> (Option<GraphPlan>, String) {
    if !cudnn_graph::aligned([x, w, y]) {
        return (None, "not searched (buffers not 16-byte aligned)".into());
    }
    let graph = match ConvGraph::new(handle, key) {
        Ok(graph) => graph,
        Err(e) => return (None, format!("graph not built: {e}")),
    };
    let planning = Instant::now();
    let mut offer =
        cudnn_graph::candidates(handle, &graph, GRAPH_CONFIGS, FIND_WORKSPACE_BYTES, None);
    let planned_ms = planning.elapsed().as_secs_f64() * 1e3;
    if offer.candidates.is_empty() {
        return (None, format!("nothing to time: {offer}"));
    }
    let scratch_len = offer
        .candidates
        .iter()
        .map(|c| c.workspace)
        .fold(legacy.workspace, usize::max)
        .max(1);
    // The timing workspace, freed (stream-ordered) when this function returns.
    // SAFETY: handed to cuDNN only, which needs no initial contents.
    let scratch = match unsafe { backend.stream.alloc::<u8>(scratch_len) } {
        Ok(scratch) => scratch,
        Err(e) => {
            return (
                None,
                format!("no {scratch_len}-byte workspace to time in: {e:?}"),
            );
        }
    };
    let ws = scratch.device_ptr(&backend.stream).0;
    let legacy_timed = time_ms(backend, f32::INFINITY, || {
        // SAFETY: `legacy.desc` describes x, w, y (the buffers its plan is being built for); the
        // scratch holds at least the algorithm's workspace.
        unsafe {
            legacy_forward(
                handle,
                &legacy.desc,
                legacy.algo,
                (x, w, y),
                (ws, scratch_len),
            )
        }
        .map_err(|e| format!("cudnnConvolutionForward: {e:?}"))
    });
    // The legacy time to beat: timed here like the candidates; Find's own measurement if that failed.
    let (legacy_ms, legacy_source) = match (&legacy_timed, legacy.how) {
        (Ok(ms), _) => (*ms, "timed"),
        (Err(_), "find") => (legacy.measured_ms, "find"),
        (Err(_), _) => (f32::INFINITY, "not timed"),
    };
    let (mut timed, mut failures) = (Vec::new(), Vec::new());
    let mut fastest = legacy_ms;
    for (i, candidate) in offer.candidates.iter().enumerate() {
        // A warm-up twice as slow as the fastest so far is not timed further.
        match time_ms(backend, 2.0 * fastest, || {
            run_candidate(handle, candidate, (x, w, y), ws)
        }) {
            Ok(ms) => {
                fastest = fastest.min(ms);
                timed.push((i, ms));
            }
            Err(e) => failures.push(format!("{}: {e}", candidate.label)),
        }
    }
    let best = timed.iter().copied().min_by(|a, b| a.1.total_cmp(&b.1));
    let mut note = match best {
        Some((i, ms)) => format!(
            "best {} {ms:.3} ms vs legacy {legacy_ms:.3} ms ({legacy_source}), {} timed",
            offer.candidates[i].label,
            timed.len()
        ),
        None => "no config ran".to_string(),
    };
    if let Err(e) = &legacy_timed {
        note.push_str(&format!(", legacy not timed ({e})"));
    }
    if let Some(first) = failures.first() {
        note.push_str(&format!(
            ", {} failed to run (first: {first})",
            failures.len()
        ));
    }
    note.push_str(&format!("; {offer}, planned in {planned_ms:.0} ms"));
    drop(scratch);
    match best {
        Some((i, ms)) if graph_wins(ms, legacy_ms) => {
            let candidate = offer.candidates.swap_remove(i);
            (Some(GraphPlan::new(candidate, graph)), note)
        }
        _ => (None, note),
    }
}

/// One run of a graph candidate, its error as text (for the note).
fn run_candidate(
    handle: sys::cudnnHandle_t,
    candidate: &Candidate,
    ptrs: (u64, u64, u64),
    ws: u64,
) -> std::result::Result<(), String> {
    candidate
        .execute(handle, ptrs, ws)
        .map_err(|e| e.to_string())
}

/// Whether a graph plan measured at `graph_ms` replaces the legacy algorithm measured at `legacy_ms`:
/// only when faster by more than [`GRAPH_MARGIN`] (a NaN never wins; an untimed legacy always loses).
fn graph_wins(graph_ms: f32, legacy_ms: f32) -> bool {
    graph_ms < legacy_ms * (1.0 - GRAPH_MARGIN)
}

/// The median of `TIMED_RUNS` runs of `run` in milliseconds, after one warm-up run: CUDA events
/// recorded on the backend's stream around each run (each read synchronises the stream). A warm-up
/// slower than `give_up_ms` is returned as the time without further runs: that candidate cannot win,
/// and some configurations run tens of times slower than the best at the VAE's full-size shapes, so
/// timing them in full made the first decode's search take ~40 s (2026-11-30, H200, 480p).
fn time_ms(
    backend: &CudaBackend,
    give_up_ms: f32,
    mut run: impl FnMut() -> std::result::Result<(), String>,
) -> std::result::Result<f32, String> {
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut timed = || -> std::result::Result<f32, String> {
        let start = backend
            .stream
            .record_event(flags)
            .map_err(|e| format!("cuEventRecord: {e:?}"))?;
        run()?;
        let end = backend
            .stream
            .record_event(flags)
            .map_err(|e| format!("cuEventRecord: {e:?}"))?;
        start
            .elapsed_ms(&end)
            .map_err(|e| format!("cuEventElapsedTime: {e:?}"))
    };
    let warm_up = timed()?;
    if warm_up > give_up_ms {
        return Ok(warm_up);
    }
    let mut times = Vec::with_capacity(TIMED_RUNS);
    for _ in 0..TIMED_RUNS {
        times.push(timed()?);
    }
    Ok(median(&mut times))
}

/// The middle value (the upper one of an even count); infinite for none.
fn median(values: &mut [f32]) -> f32 {
    values.sort_by(f32::total_cmp);
    values
        .get(values.len() / 2)
        .copied()
        .unwrap_or(f32::INFINITY)
}

/// Runs `f` on the device's cuDNN, creating it on first use; `CudaUnavailable` when libcudnn cannot be
/// used on this device (decided once).
fn with_dnn<T>(backend: &CudaBackend, f: impl FnOnce(&mut Dnn) -> Result<T>) -> Result<T> {
    let mut slot = backend.dnn.lock().unwrap_or_else(|e| e.into_inner());
    if matches!(*slot, DnnSlot::Untried) {
        *slot = match Dnn::new(backend) {
            Ok(dnn) => DnnSlot::Ready(Box::new(dnn)),
            Err(e) => {
                tracing::warn!(
                    ordinal = backend.ordinal,
                    error = %e,
                    "cuDNN unavailable: convolutions use im2col + cuBLASLt unless cuDNN is forced"
                );
                DnnSlot::Unavailable(e)
            }
        };
    }
    match &mut *slot {
        DnnSlot::Ready(dnn) => f(dnn),
        DnnSlot::Unavailable(e) => Err(e.clone()),
        // Set just above; kept as an error rather than a panic.
        DnnSlot::Untried => Err(KernelError::CudaUnavailable {
            library: "libcudnn",
            detail: "not initialised".into(),
        }),
    }
}

/// Ok if cuDNN can be used on this device (loading it on the first call), else why not.
pub(crate) fn ensure(backend: &CudaBackend) -> Result<()> {
    with_dnn(backend, |_| Ok(()))
}

/// Whether cuDNN can be used on this device (loading it on the first call).
pub(crate) fn available(backend: &CudaBackend) -> bool {
    ensure(backend).is_ok()
}

/// y = conv(x, w) for `key` on the backend's stream (no bias): `x`, `w`, `y` are device addresses of
/// buffers in `key.dtype` and `key.layout`, sized for the key's shape. Builds the key's plan on first use
/// (which runs the convolution a few times to measure it).
pub(crate) fn conv_forward(
    backend: &CudaBackend,
    op: &'static str,
    key: &DnnConvKey,
    x: u64,
    w: u64,
    y: u64,
) -> Result<()> {
    with_dnn(backend, |d| {
        backend
            .ctx
            .bind_to_thread()
            .map_err(|e| backend.err(op, "cuCtxSetCurrent", e))?;
        let handle = d.handle;
        catch("libcudnn", || {
            let needed = d
                .plan(backend, key, (x, w, y))
                .map_err(|(name, e)| backend.err(op, "cuDNN plan", (name, key, e)))?
                .workspace;
            if d.workspace.as_ref().is_none_or(|ws| ws.len() < needed) {
                d.workspace = None; // freed (stream-ordered) before the larger one is taken
                // SAFETY: handed to cuDNN only, which needs no initial contents.
                let ws = unsafe { backend.stream.alloc::<u8>(needed.max(1)) }
                    .map_err(|e| backend.err(op, "cuMemAllocAsync", (needed, e)))?;
                d.workspace = Some(ws);
            }
            let (ws_ptr, ws_len) = match &d.workspace {
                Some(ws) => (ws.device_ptr(&backend.stream).0, ws.len()),
                None => (0, 0),
            };
            // Built just above when absent.
            let plan = d.plans.get_mut(key).ok_or_else(|| {
                backend.err(op, "cuDNN plan", (key, "missing from the plan cache"))
            })?;
            if let Some(graph) = &plan.graph {
                if !cudnn_graph::aligned([x, w, y]) {
                    plan.unaligned_calls += 1;
                } else {
                    // The workspace holds ws_len ≥ plan.workspace ≥ the graph plan's need.
                    match graph.candidate.execute(handle, (x, w, y), ws_ptr) {
                        Ok(()) => return Ok(()),
                        Err(e) => {
                            // It ran while being timed, so this is unexpected; the algorithm it beat
                            // is still there and known to work.
                            tracing::warn!(
                                ?key,
                                config = %graph.candidate.label,
                                error = %e,
                                "cuDNN graph plan failed; this shape uses the legacy algorithm from now on"
                            );
                            let failed = format!(
                                "; {} failed at run ({e}), legacy algorithm used since",
                                graph.candidate.label
                            );
                            plan.graph_note.push_str(&failed);
                            plan.graph = None;
                        }
                    }
                }
            }
            let algo = plan.algo;
            // SAFETY: the plan's descriptors describe the caller's buffers; the workspace holds
            // ws_len ≥ plan.workspace bytes, at least what the algorithm needs.
            unsafe { legacy_forward(handle, &plan.desc, algo, (x, w, y), (ws_ptr, ws_len)) }
                .map_err(|e| backend.err(op, "cudnnConvolutionForward", (key, algo, e)))
        })?
    })
}

/// The cuDNN version loaded for GPU `ordinal` (`major·10000 + minor·100 + patch`), or why it cannot be
/// used there.
pub fn cudnn_version(ordinal: usize) -> Result<usize> {
    let backend = CudaBackend::get(ordinal)?;
    with_dnn(&backend, |d| Ok(d.version))
}

/// One line per convolution plan cuDNN holds on GPU `ordinal`: the shape; which path runs (`runs graph
/// eng<global index>_k<knob>=<value>…` or `runs legacy`); the legacy algorithm and math type, how it
/// was chosen (measured or ranked) and Find's time for it; what the graph search found (the best
/// configuration's time against the legacy algorithm timed the same way, how many configurations were
/// offered and planned, or why the graph API is not used); the workspace, and the search's own time.
/// For benchmarks and logs.
pub fn cudnn_conv_plans(ordinal: usize) -> Result<Vec<String>> {
    let backend = CudaBackend::get(ordinal)?;
    with_dnn(&backend, |d| {
        let mut lines: Vec<String> = d
            .plans
            .iter()
            .map(|(k, p)| {
                let runs = match &p.graph {
                    Some(g) => format!("graph {}", g.candidate.label),
                    None => "legacy".to_string(),
                };
                let unaligned = match p.unaligned_calls {
                    0 => String::new(),
                    n => format!(" ({n} calls ran legacy: buffers not 16-byte aligned)"),
                };
                format!(
                    "{:?} {:?} B{} {}→{} in {:?} k {:?} s {:?} p {:?}: runs {runs}; legacy {:?} {:?} \
                     ({} {:.3} ms); graph: {}{unaligned}; workspace {} MiB, search {:.0} ms",
                    k.dtype,
                    k.layout,
                    k.batch,
                    k.c_in,
                    k.c_out,
                    k.input,
                    k.kernel,
                    k.stride,
                    k.pad,
                    p.algo,
                    p.math,
                    p.how,
                    p.measured_ms,
                    p.graph_note,
                    p.workspace.div_ceil(1 << 20),
                    p.search_ms,
                )
            })
            .collect();
        lines.sort();
        Ok(lines)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(layout: DnnLayout) -> DnnConvKey {
        DnnConvKey {
            dtype: DType::BF16,
            layout,
            batch: 1,
            c_in: 4,
            c_out: 6,
            input: [5, 7, 9],
            kernel: [3, 3, 3],
            stride: [1, 2, 2],
            pad: [0, 1, 1],
        }
    }

    #[test]
    fn key_geometry() {
        let k = key(DnnLayout::Ncdhw);
        assert_eq!(k.output(), [3, 4, 5]);
        assert!(k.fits());
        assert_eq!(
            k.tensor(4, [5, 7, 9]).1,
            [4 * 5 * 7 * 9, 5 * 7 * 9, 7 * 9, 9, 1]
        );
        assert_eq!(
            key(DnnLayout::Ndhwc).tensor(4, [5, 7, 9]).1,
            [5 * 7 * 9 * 4, 1, 7 * 9 * 4, 9 * 4, 4]
        );
        let big = DnnConvKey {
            c_in: 96,
            input: [64, 1080, 1920],
            ..k
        };
        assert!(!big.fits());
    }

    /// The graph API's tensors: x and y as the legacy descriptors say, and the filter's strides in the
    /// key's layout ([C_out, kt, kh, kw, C_in] in memory for NDHWC, as `ndhwc_filter` writes it).
    #[test]
    fn graph_tensors_in_both_layouts() {
        let (c_in, k) = (4, 3 * 3 * 3);
        let [x, w, y] = key(DnnLayout::Ncdhw).graph_tensors();
        assert_eq!(x.0, [1, 4, 5, 7, 9]);
        assert_eq!(x.1, [4 * 5 * 7 * 9, 5 * 7 * 9, 7 * 9, 9, 1]);
        assert_eq!(w.0, [6, 4, 3, 3, 3]);
        assert_eq!(w.1, [c_in * k, k, 9, 3, 1]);
        assert_eq!(y.0, [1, 6, 3, 4, 5]);
        assert_eq!(y.1, [6 * 3 * 4 * 5, 3 * 4 * 5, 4 * 5, 5, 1]);
        let [x, w, y] = key(DnnLayout::Ndhwc).graph_tensors();
        assert_eq!(x.0, [1, 4, 5, 7, 9]);
        assert_eq!(x.1, [5 * 7 * 9 * 4, 1, 7 * 9 * 4, 9 * 4, 4]);
        assert_eq!(w.0, [6, 4, 3, 3, 3]);
        assert_eq!(w.1, [k * c_in, 1, 9 * c_in, 3 * c_in, c_in]);
        assert_eq!(y.0, [1, 6, 3, 4, 5]);
        assert_eq!(y.1, [3 * 4 * 5 * 6, 1, 4 * 5 * 6, 5 * 6, 6]);
        // The legacy descriptors' strides are the same numbers.
        let k = key(DnnLayout::Ndhwc);
        assert_eq!(k.tensor(4, k.input).1.map(i64::from), x.1);
    }

    #[test]
    fn graph_replaces_legacy_only_when_clearly_faster() {
        assert!(graph_wins(2.30, 2.65));
        assert!(!graph_wins(2.64, 2.65)); // within the margin: the legacy algorithm stays
        assert!(!graph_wins(2.70, 2.65));
        assert!(graph_wins(2.70, f32::INFINITY)); // the legacy algorithm could not be timed
        assert!(!graph_wins(f32::NAN, 2.65));
    }

    #[test]
    fn median_of_runs() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0]), 4.0);
        assert_eq!(median(&mut []), f32::INFINITY);
    }

    /// Descriptors build, and cuDNN's output size agrees with ours, in both layouts and dtypes. Needs
    /// libcudnn only (no GPU); skips with a message where it is absent. A missing library is an error,
    /// never a panic.
    #[test]
    fn descriptors_agree_with_cudnn_where_the_library_loads() {
        if let Err(e) = probe() {
            assert!(
                matches!(
                    e,
                    KernelError::CudaUnavailable {
                        library: "libcudnn",
                        ..
                    }
                ),
                "{e}"
            );
            eprintln!("skipped: {e}");
            return;
        }
        let version = library_version().expect("cudnnGetVersion");
        assert!(version >= 8000, "cuDNN {version}");
        for layout in [DnnLayout::Ncdhw, DnnLayout::Ndhwc] {
            for dtype in [DType::F32, DType::BF16] {
                let k = DnnConvKey {
                    dtype,
                    ..key(layout)
                };
                let built = catch("libcudnn", || Descriptors::new(&k)).expect("symbols load");
                assert!(built.is_ok(), "{layout:?} {dtype:?}: {:?}", built.err());
                // The VAE's 3×3×3 at 60×104 with two leading frames joined in, no time padding.
                let vae = DnnConvKey {
                    c_in: 384,
                    c_out: 384,
                    input: [3, 60, 104],
                    stride: [1, 1, 1],
                    pad: [0, 1, 1],
                    ..k
                };
                assert_eq!(vae.output(), [1, 60, 104]);
                let built = catch("libcudnn", || Descriptors::new(&vae)).expect("symbols load");
                assert!(built.is_ok(), "{:?}", built.err());
            }
        }
    }
}
