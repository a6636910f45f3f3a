//! Convolutions through cuDNN (cudarc feature `cudnn`, the legacy N-d API): one handle per device on the
//! backend's stream, a `Plan` per convolution shape (descriptors, the algorithm cuDNN measured fastest,
//! its math type and workspace size), and one workspace grown to the largest plan's need.
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
//!   `bench/src/bin/conv.rs` show it), which a first decode pays; `DITSTREAM_CUDNN_SEARCH=heuristic`
//!   ranks without running instead (µs), `find` (the default) measures.
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

use super::{CudaBackend, catch};
use crate::{DType, KernelError, Result};

/// Most workspace the algorithm search may hand cuDNN (and so the most a chosen algorithm may need).
const FIND_WORKSPACE_BYTES: usize = 512 << 20;

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
    fn tensor(&self, channels: usize, [t, h, w]: [usize; 3]) -> ([c_int; 5], [c_int; 5]) {
        let dims = [self.batch, channels, t, h, w].map(|d| d as c_int);
        let strides = match self.layout {
            DnnLayout::Ncdhw => [channels * t * h * w, t * h * w, h * w, w, 1],
            DnnLayout::Ndhwc => [
                t * h * w * channels,
                1,
                h * w * channels,
                w * channels,
                channels,
            ],
        };
        (dims, strides.map(|s| s as c_int))
    }
}

fn data_type(dtype: DType) -> sys::cudnnDataType_t {
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

/// A convolution ready to run: descriptors, algorithm (with the math type it was measured with) and the
/// workspace it needs.
struct Plan {
    desc: Descriptors,
    algo: sys::cudnnConvolutionFwdAlgo_t,
    math: sys::cudnnMathType_t,
    workspace: usize,
    /// How the algorithm was chosen ("find": measured; "heuristic": ranked), its measured time, and how
    /// long the choice took.
    how: &'static str,
    measured_ms: f32,
    search_ms: f64,
}

/// How a plan's algorithm is chosen (`DITSTREAM_CUDNN_SEARCH`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Search {
    /// Run and time every candidate on the call's buffers (`find`, the default).
    Find,
    /// cuDNN's heuristic ranking, nothing run (`heuristic`).
    Heuristic,
}

impl Search {
    fn from_env() -> Result<Self> {
        match std::env::var("DITSTREAM_CUDNN_SEARCH") {
            Err(_) => Ok(Search::Find),
            Ok(v) => match v.as_str() {
                "" | "find" => Ok(Search::Find),
                "heuristic" => Ok(Search::Heuristic),
                other => Err(KernelError::arg(
                    "cudnn",
                    "DITSTREAM_CUDNN_SEARCH",
                    other,
                    "expected `find` (measure each algorithm) or `heuristic` (rank without running)",
                )),
            },
        }
    }
}

/// A device's cuDNN handle, plans and workspace; lives in `CudaBackend::dnn` behind a mutex.
pub(crate) struct Dnn {
    handle: sys::cudnnHandle_t,
    version: usize,
    search: Search,
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
        let search = Search::from_env()?;
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
        let dnn = Dnn {
            handle,
            version,
            search,
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
            let plan = build_plan(self.handle, self.search, backend, key, (x, w, y))?;
            tracing::debug!(
                ?key,
                algo = ?plan.algo,
                math = ?plan.math,
                workspace = plan.workspace,
                how = plan.how,
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
    Ok(Plan {
        algo: best.algo,
        math,
        workspace: needed.max(best.memory),
        how,
        measured_ms: best.time,
        search_ms: started.elapsed().as_secs_f64() * 1e3,
        desc,
    })
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
            let plan = d
                .plan(backend, key, (x, w, y))
                .map_err(|(name, e)| backend.err(op, "cuDNN plan", (name, key, e)))?;
            let (algo, needed) = (plan.algo, plan.workspace);
            let (xd, wd, cd, yd) = (plan.desc.x, plan.desc.w, plan.desc.conv, plan.desc.y);
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
            let (alpha, beta) = (1.0f32, 0.0f32);
            // SAFETY: the plan's descriptors describe the caller's buffers; alpha/beta are f32 host
            // scalars (the scaling type of f32 and bf16 data); the workspace holds ws_len ≥ needed bytes.
            unsafe {
                dnn::convolution_forward(
                    handle,
                    (&alpha as *const f32).cast(),
                    xd,
                    x as *const c_void,
                    wd,
                    w as *const c_void,
                    cd,
                    algo,
                    ws_ptr as *mut c_void,
                    ws_len,
                    (&beta as *const f32).cast(),
                    yd,
                    y as *mut c_void,
                )
            }
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

/// One line per convolution plan cuDNN holds on GPU `ordinal`: the shape, the algorithm and math type
/// chosen, how (measured or ranked), its measured time, the workspace, and the search's own time.
/// For benchmarks and logs.
pub fn cudnn_conv_plans(ordinal: usize) -> Result<Vec<String>> {
    let backend = CudaBackend::get(ordinal)?;
    with_dnn(&backend, |d| {
        let mut lines: Vec<String> = d
            .plans
            .iter()
            .map(|(k, p)| {
                format!(
                    "{:?} {:?} B{} {}→{} in {:?} k {:?} s {:?} p {:?}: {:?} {:?} ({} {:.3} ms), \
                     workspace {} MiB, search {:.0} ms",
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
