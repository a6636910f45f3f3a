//! A convolution forward through cuDNN's graph (backend) API: the operation graph of one
//! [`DnnConvKey`], the engine configurations cuDNN's heuristics offer for it, one finalized execution
//! plan per configuration, and running a plan on given buffers. Which plan runs (timing these against
//! the legacy algorithm) is decided in [`super::cudnn`]; this file only speaks the backend API.
//!
//! - Why a second API: for the VAE's channels-last bf16 3×3×3 convolutions the legacy algorithms reach
//!   ~300 TFLOP/s on an H200 where PyTorch, which goes through this API, reaches ~350. The legacy enum
//!   maps each algorithm to a fixed kernel choice; the graph API exposes every engine with its knobs
//!   (tile sizes, split-k, stages), of which the heuristics rank the likely-fast ones.
//! - Ownership: every backend object is a [`Desc`], destroyed exactly once on drop. A plan keeps the
//!   configuration and the graph it was built from ([`GraphPlan`]), dropped after it, so nothing the
//!   plan might refer to is freed first.
//! - Enum-valued attributes read back from cuDNN (numerical notes, knob types) are read as raw `u32`:
//!   the library may be newer than cudarc's bindings, and an unknown value in a Rust enum is undefined
//!   behaviour.
//! - bf16 only (the caller checks): engines for f32 data carrying the tensor-core note would compute
//!   in TF32, which the f32 path must never do; f32 stays on the legacy FMA algorithms.

use std::collections::HashSet;
use std::ffi::c_void;
use std::fmt::Write as _;

use cudarc::cudnn::result::CudnnError;
use cudarc::cudnn::sys::{
    self, cudnnBackendAttributeName_t as Attr, cudnnBackendAttributeType_t as Ty,
    cudnnBackendDescriptorType_t as Kind,
};

use super::cudnn::{DnnConvKey, data_type};

/// Unique ids naming x, w and y in the graph and in each variant pack.
const X_UID: i64 = 1;
const W_UID: i64 = 2;
const Y_UID: i64 = 3;

/// The byte alignment declared for x, w and y. Our buffers come whole from the stream-ordered
/// allocator (256-byte aligned, hence also 16), but a plan built for this alignment may use 16-byte
/// vector loads, so [`aligned`] checks every call's pointers before a graph plan runs on them.
const ALIGNMENT: u64 = 16;

/// Engine configurations asked of one heuristics query: the ranking is best-first, and more than
/// this many never get measured (the caller's cap is lower).
const MAX_PER_MODE: usize = 64;

/// Numerical notes that rule a configuration out for bf16 with an f32 compute type: inputs converted
/// to a narrower type, or sums reduced in reduced precision, would fall outside the parity tolerances,
/// which assume bf16 products accumulated in f32 (what the legacy path does).
/// Values of `cudnnBackendNumericalNote_t`: DOWN_CONVERT_INPUTS = 1, REDUCED_PRECISION_REDUCTION = 2.
const REJECTED_NOTES: [u32; 2] = [1, 2];

/// A failed backend call: the function, the attribute it was about (if any) and cuDNN's status.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GraphError {
    pub call: &'static str,
    pub attr: Option<Attr>,
    pub status: CudnnError,
}

impl std::fmt::Display for GraphError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.attr {
            Some(attr) => write!(f, "{}({attr:?}): {:?}", self.call, self.status.0),
            None => write!(f, "{}: {:?}", self.call, self.status.0),
        }
    }
}

type GraphResult<T> = std::result::Result<T, GraphError>;

fn check(status: sys::cudnnStatus_t, call: &'static str, attr: Option<Attr>) -> GraphResult<()> {
    status
        .result()
        .map_err(|status| GraphError { call, attr, status })
}

/// One backend descriptor, destroyed on drop.
pub(crate) struct Desc(sys::cudnnBackendDescriptor_t);

impl Drop for Desc {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: created by cudnnBackendCreateDescriptor in `Desc::new` and destroyed only here;
            // a failure is ignored (nothing to do about it while dropping).
            let _ = unsafe { sys::cudnnBackendDestroyDescriptor(self.0) };
        }
    }
}

impl Desc {
    fn new(kind: Kind) -> GraphResult<Self> {
        let mut raw: sys::cudnnBackendDescriptor_t = std::ptr::null_mut();
        // SAFETY: `raw` is an out-pointer.
        let status = unsafe { sys::cudnnBackendCreateDescriptor(kind, &mut raw) };
        check(status, "cudnnBackendCreateDescriptor", None)?;
        Ok(Desc(raw))
    }

    fn finalize(&self) -> GraphResult<()> {
        // SAFETY: a live descriptor.
        let status = unsafe { sys::cudnnBackendFinalize(self.0) };
        check(status, "cudnnBackendFinalize", None)
    }

    /// Sets `name` to `values`.
    ///
    /// # Safety
    /// `V` must be the C type that `ty` names (`int64_t` for INT64, the enum for an enum type, a
    /// pointer for HANDLE, VOID_PTR and BACKEND_DESCRIPTOR), and pointed-to objects must be live.
    unsafe fn set<V>(&self, name: Attr, ty: Ty, values: &[V]) -> GraphResult<()> {
        // SAFETY: per the caller, `values` holds `values.len()` elements of ty's C type; cuDNN copies
        // them during the call.
        let status = unsafe {
            sys::cudnnBackendSetAttribute(
                self.0,
                name,
                ty,
                values.len() as i64,
                values.as_ptr().cast(),
            )
        };
        check(status, "cudnnBackendSetAttribute", Some(name))
    }

    fn set_i64s(&self, name: Attr, values: &[i64]) -> GraphResult<()> {
        // SAFETY: INT64 is int64_t.
        unsafe { self.set(name, Ty::CUDNN_TYPE_INT64, values) }
    }

    fn set_data_type(&self, name: Attr, dt: sys::cudnnDataType_t) -> GraphResult<()> {
        // SAFETY: DATA_TYPE is cudnnDataType_t (a C enum; the Rust enum is repr(u32) like it).
        unsafe { self.set(name, Ty::CUDNN_TYPE_DATA_TYPE, &[dt]) }
    }

    fn set_descs(&self, name: Attr, descs: &[&Desc]) -> GraphResult<()> {
        let raw: Vec<sys::cudnnBackendDescriptor_t> = descs.iter().map(|d| d.0).collect();
        // SAFETY: BACKEND_DESCRIPTOR is cudnnBackendDescriptor_t; each is live (borrowed here).
        unsafe { self.set(name, Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR, &raw) }
    }

    fn set_handle(&self, name: Attr, handle: sys::cudnnHandle_t) -> GraphResult<()> {
        // SAFETY: HANDLE is cudnnHandle_t; the caller's handle outlives every use of this descriptor
        // (plans live in the `Dnn` that owns the handle and are dropped before it).
        unsafe { self.set(name, Ty::CUDNN_TYPE_HANDLE, &[handle]) }
    }

    fn set_ptrs(&self, name: Attr, ptrs: &[*mut c_void]) -> GraphResult<()> {
        // SAFETY: VOID_PTR is void*; the addresses are only stored (dereferenced on the device by
        // cudnnBackendExecute, whose caller vouches for them).
        unsafe { self.set(name, Ty::CUDNN_TYPE_VOID_PTR, ptrs) }
    }

    /// Up to `out.len()` elements of `name`; how many cuDNN wrote.
    ///
    /// # Safety
    /// `V` must have the size and layout of the C type that `ty` names, and every bit pattern cuDNN
    /// may write must be a valid `V` (so enums are read as `u32`, never as Rust enums).
    unsafe fn get<V>(&self, name: Attr, ty: Ty, out: &mut [V]) -> GraphResult<usize> {
        let mut written: i64 = 0;
        // SAFETY: per the caller; `out` has room for `out.len()` elements.
        let status = unsafe {
            sys::cudnnBackendGetAttribute(
                self.0,
                name,
                ty,
                out.len() as i64,
                &mut written,
                out.as_mut_ptr().cast(),
            )
        };
        check(status, "cudnnBackendGetAttribute", Some(name))?;
        Ok((written.max(0) as usize).min(out.len()))
    }

    fn get_i64(&self, name: Attr) -> GraphResult<i64> {
        let mut value = [0i64];
        // SAFETY: INT64 is int64_t; any bit pattern is a valid i64.
        unsafe { self.get(name, Ty::CUDNN_TYPE_INT64, &mut value) }?;
        Ok(value[0])
    }

    /// Up to `max` enum values of `name` (of enum type `ty`), as raw numbers.
    fn get_enums(&self, name: Attr, ty: Ty, max: usize) -> GraphResult<Vec<u32>> {
        let mut values = vec![0u32; max];
        // SAFETY: C enums are 4 bytes here (cudarc declares them repr(u32)); read as u32, any value
        // cuDNN writes is valid.
        let n = unsafe { self.get(name, ty, &mut values) }?;
        values.truncate(n);
        Ok(values)
    }

    /// How many descriptors array attribute `name` holds, asked with an empty request (as cuDNN's
    /// frontend asks the heuristics' results; refused for one-element attributes).
    fn count_descs(&self, name: Attr) -> GraphResult<usize> {
        let mut available: i64 = 0;
        // SAFETY: a zero-element request writes no element, only the count.
        let status = unsafe {
            sys::cudnnBackendGetAttribute(
                self.0,
                name,
                Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                0,
                &mut available,
                std::ptr::null_mut(),
            )
        };
        check(status, "cudnnBackendGetAttribute", Some(name))?;
        Ok(available.max(0) as usize)
    }

    /// Every descriptor of array attribute `name` (at most `cap`), of `kind`. Should the count query be
    /// refused, `cap` are asked for (for array attributes cuDNN writes those it has; one-element
    /// attributes refuse both ways, so those are read with [`Desc::get_descs`] and an exact count).
    fn get_all_descs(&self, name: Attr, kind: Kind, cap: usize) -> GraphResult<Vec<Desc>> {
        let wanted = self.count_descs(name).map_or(cap, |n| n.min(cap));
        self.get_descs(name, kind, wanted)
    }

    /// Up to `max` descriptors of attribute `name`: cuDNN fills descriptors the caller created, of
    /// `kind`.
    fn get_descs(&self, name: Attr, kind: Kind, max: usize) -> GraphResult<Vec<Desc>> {
        let mut descs = (0..max)
            .map(|_| Desc::new(kind))
            .collect::<GraphResult<Vec<_>>>()?;
        let mut raw: Vec<sys::cudnnBackendDescriptor_t> = descs.iter().map(|d| d.0).collect();
        // SAFETY: BACKEND_DESCRIPTOR elements are descriptors of the attribute's kind, created above
        // and live; cuDNN fills them in place (the pointers themselves are left as they are).
        let n = unsafe { self.get(name, Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR, &mut raw) }?;
        descs.truncate(n);
        Ok(descs)
    }
}

/// The operation graph of one convolution forward, with the operation it holds (fields drop in
/// order: the graph first).
pub(crate) struct ConvGraph {
    graph: Desc,
    _op: ConvOp,
}

impl ConvGraph {
    /// The one-operation graph of `key`'s convolution (see [`ConvOp::new`]) on `handle`.
    pub(crate) fn new(handle: sys::cudnnHandle_t, key: &DnnConvKey) -> GraphResult<Self> {
        let op = ConvOp::new(key)?;
        let graph = Desc::new(Kind::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        graph.set_handle(Attr::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, handle)?;
        graph.set_descs(Attr::CUDNN_ATTR_OPERATIONGRAPH_OPS, &[&op.op])?;
        graph.finalize()?;
        Ok(ConvGraph { graph, _op: op })
    }
}

/// A convolution forward operation with the descriptors it refers to (fields drop in order: the
/// operation first, the tensors last).
struct ConvOp {
    op: Desc,
    _conv: Desc,
    _x: Desc,
    _w: Desc,
    _y: Desc,
}

impl ConvOp {
    /// y = conv(x, w) for `key`: cross-correlation, f32 compute type, symmetric padding, dilation 1,
    /// alpha 1, beta 0; x, w, y described as [N, C, D, H, W] with strides in the key's layout (the
    /// filter as [C_out, C_in, kt, kh, kw], channels-last for NDHWC, as the legacy descriptors say).
    /// Needs libcudnn but no handle or GPU.
    fn new(key: &DnnConvKey) -> GraphResult<Self> {
        let dt = data_type(key.dtype);
        let tensor = |uid: i64, (dims, strides): ([i64; 5], [i64; 5])| -> GraphResult<Desc> {
            let t = Desc::new(Kind::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
            t.set_data_type(Attr::CUDNN_ATTR_TENSOR_DATA_TYPE, dt)?;
            t.set_i64s(Attr::CUDNN_ATTR_TENSOR_DIMENSIONS, &dims)?;
            t.set_i64s(Attr::CUDNN_ATTR_TENSOR_STRIDES, &strides)?;
            t.set_i64s(Attr::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[uid])?;
            t.set_i64s(Attr::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[ALIGNMENT as i64])?;
            t.finalize()?;
            Ok(t)
        };
        let [xs, ws, ys] = key.graph_tensors();
        let (x, w, y) = (tensor(X_UID, xs)?, tensor(W_UID, ws)?, tensor(Y_UID, ys)?);

        let conv = Desc::new(Kind::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR)?;
        let pad = key.pad.map(|v| v as i64);
        conv.set_data_type(
            Attr::CUDNN_ATTR_CONVOLUTION_COMP_TYPE,
            sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
        )?;
        // SAFETY: CONVOLUTION_MODE is cudnnConvolutionMode_t.
        unsafe {
            conv.set(
                Attr::CUDNN_ATTR_CONVOLUTION_CONV_MODE,
                Ty::CUDNN_TYPE_CONVOLUTION_MODE,
                &[sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION],
            )
        }?;
        conv.set_i64s(Attr::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, &[3])?;
        conv.set_i64s(Attr::CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, &pad)?;
        conv.set_i64s(Attr::CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, &pad)?;
        conv.set_i64s(
            Attr::CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES,
            &key.stride.map(|v| v as i64),
        )?;
        conv.set_i64s(Attr::CUDNN_ATTR_CONVOLUTION_DILATIONS, &[1; 3])?;
        conv.finalize()?;

        let op = Desc::new(Kind::CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR)?;
        op.set_descs(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, &[&x])?;
        op.set_descs(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, &[&w])?;
        op.set_descs(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, &[&y])?;
        op.set_descs(
            Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
            &[&conv],
        )?;
        set_scale(
            &op,
            Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
            1.0,
        )?;
        set_scale(
            &op,
            Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA,
            0.0,
        )?;
        op.finalize()?;
        Ok(ConvOp {
            op,
            _conv: conv,
            _x: x,
            _w: w,
            _y: y,
        })
    }
}

/// Sets a scaling factor (alpha or beta) of a convolution operation. The documentation accepts FLOAT
/// or DOUBLE; FLOAT is what cuDNN's own frontend sends for an f32 compute type, and DOUBLE is tried
/// should a library reject it, so the choice cannot cost the graph path.
fn set_scale(op: &Desc, name: Attr, value: f32) -> GraphResult<()> {
    // SAFETY: FLOAT is float.
    let float = unsafe { op.set(name, Ty::CUDNN_TYPE_FLOAT, &[value]) };
    match float {
        Ok(()) => Ok(()),
        // SAFETY: DOUBLE is double.
        Err(_) => unsafe { op.set(name, Ty::CUDNN_TYPE_DOUBLE, &[f64::from(value)]) },
    }
}

/// One engine configuration with its finalized execution plan (fields drop in order: plan first).
pub(crate) struct Candidate {
    /// `eng<global index>_k<knob type>=<value>…`, the tag cuDNN's frontend (and PyTorch's logs) print:
    /// knob types are `cudnnBackendKnobType_t` numbers.
    pub label: String,
    /// Bytes of workspace the plan needs.
    pub workspace: usize,
    plan: Desc,
    _config: Desc,
}

impl Candidate {
    /// Runs the plan on `x`, `w`, `y` with `workspace` (≥ `self.workspace` bytes, or null when that is 0)
    /// on the handle's stream.
    pub(crate) fn execute(
        &self,
        handle: sys::cudnnHandle_t,
        (x, w, y): (u64, u64, u64),
        workspace: u64,
    ) -> GraphResult<()> {
        // A variant pack per call: a handful of host-side calls (µs) beside a convolution of ms, and the
        // pointers change on nearly every call (buffers come from the stream-ordered pool).
        let pack = variant_pack((x, w, y), workspace)?;
        // SAFETY: the plan is finalized for this handle; the caller vouches that x, w, y are device
        // buffers of the key's shapes and dtype, aligned to ALIGNMENT, and that the workspace holds
        // `self.workspace` bytes.
        let status = unsafe { sys::cudnnBackendExecute(handle, self.plan.0, pack.0) };
        check(status, "cudnnBackendExecute", None)
    }
}

/// The finalized variant pack binding x, w, y and the workspace to the graph's tensors. Needs libcudnn
/// but no handle or GPU (the addresses are only stored).
fn variant_pack((x, w, y): (u64, u64, u64), workspace: u64) -> GraphResult<Desc> {
    let pack = Desc::new(Kind::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
    pack.set_i64s(
        Attr::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
        &[X_UID, W_UID, Y_UID],
    )?;
    pack.set_ptrs(
        Attr::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
        &[x, w, y].map(|p| p as *mut c_void),
    )?;
    pack.set_ptrs(
        Attr::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
        &[workspace as *mut c_void],
    )?;
    pack.finalize()?;
    Ok(pack)
}

/// The configuration that runs for a shape, kept with the graph it was planned from.
pub(crate) struct GraphPlan {
    pub candidate: Candidate,
    _graph: ConvGraph,
}

impl GraphPlan {
    pub(crate) fn new(candidate: Candidate, graph: ConvGraph) -> Self {
        GraphPlan {
            candidate,
            _graph: graph,
        }
    }
}

/// Whether every pointer meets the alignment the graph's tensors declare.
pub(crate) fn aligned(ptrs: [u64; 3]) -> bool {
    ptrs.iter().all(|p| p % ALIGNMENT == 0)
}

/// The engine configurations offered for a graph, planned: those that can run, at most `cap`, each
/// within `max_workspace` bytes; and counts of the others, for the plan line.
pub(crate) struct Offer {
    pub candidates: Vec<Candidate>,
    /// Distinct configurations examined, in the heuristics' order, until `cap` were planned (the modes
    /// asked may have offered more).
    pub offered: usize,
    /// Ruled out by their numerical notes ([`REJECTED_NOTES`]).
    pub rejected_notes: usize,
    /// Whose plan did not finalize (not supported for this shape or device).
    pub unplannable: usize,
    /// Needing more workspace than allowed.
    pub over_workspace: usize,
    /// Heuristics modes that failed (name and error).
    pub failed_modes: Vec<String>,
    /// The first error met while describing or planning a configuration, so that a line whose configs
    /// are all unplannable says why.
    pub first_error: Option<GraphError>,
}

impl std::fmt::Display for Offer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} configs planned of {} examined ({} ruled out by numerical notes, {} unplannable, {} \
             over the workspace cap)",
            self.candidates.len(),
            self.offered,
            self.rejected_notes,
            self.unplannable,
            self.over_workspace
        )?;
        if !self.failed_modes.is_empty() {
            write!(f, ", heuristics failed: {}", self.failed_modes.join("; "))?;
        }
        if let Some(e) = &self.first_error {
            write!(f, ", first planning error: {e}")?;
        }
        Ok(())
    }
}

/// Heuristics modes asked, in order, until `cap` configurations are planned: A (the fast ranking
/// PyTorch's `cudnn.benchmark` draws from), B (a costlier, sometimes better ranking), then the
/// fallback list (engines that support the graph at all).
const MODES: [(sys::cudnnBackendHeurMode_t, &str); 3] = [
    (sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A, "A"),
    (sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_B, "B"),
    (
        sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
        "fallback",
    ),
];

/// Plans up to `cap` engine configurations of `graph`, in the heuristics' order, skipping duplicates
/// (the modes overlap), configurations with rejected numerical notes, those that fail to finalize and
/// those needing more than `max_workspace` bytes. A mode that fails is recorded and skipped. With
/// `only`, just the configuration of that label (the plan cache's choice) is planned.
pub(crate) fn candidates(
    handle: sys::cudnnHandle_t,
    graph: &ConvGraph,
    cap: usize,
    max_workspace: usize,
    only: Option<&str>,
) -> Offer {
    let mut offer = Offer {
        candidates: Vec::new(),
        offered: 0,
        rejected_notes: 0,
        unplannable: 0,
        over_workspace: 0,
        failed_modes: Vec::new(),
        first_error: None,
    };
    let mut seen = HashSet::new();
    for (mode, name) in MODES {
        if offer.candidates.len() >= cap {
            break;
        }
        let configs = match heuristics(graph, mode) {
            Ok(configs) => configs,
            Err(e) => {
                offer.failed_modes.push(format!("{name}: {e}"));
                continue;
            }
        };
        for config in configs {
            if offer.candidates.len() >= cap {
                break;
            }
            let (label, notes) = match describe(&config) {
                Ok(described) => described,
                Err(e) => {
                    offer.unplannable += 1;
                    offer.first_error.get_or_insert(e);
                    continue;
                }
            };
            if only.is_some_and(|wanted| wanted != label) || !seen.insert(label.clone()) {
                continue;
            }
            offer.offered += 1;
            if !notes_allowed(&notes) {
                offer.rejected_notes += 1;
                continue;
            }
            match plan(handle, &config) {
                Ok((plan, workspace)) if workspace <= max_workspace => {
                    offer.candidates.push(Candidate {
                        label,
                        workspace,
                        plan,
                        _config: config,
                    })
                }
                Ok(_) => offer.over_workspace += 1,
                Err(e) => {
                    // Expected for some engines (not every engine supports every shape): counted,
                    // the first kept for the line.
                    offer.unplannable += 1;
                    offer.first_error.get_or_insert(e);
                }
            }
        }
    }
    offer
}

/// The engine configurations heuristics `mode` ranks for `graph`, best first (at most
/// [`MAX_PER_MODE`]).
fn heuristics(graph: &ConvGraph, mode: sys::cudnnBackendHeurMode_t) -> GraphResult<Vec<Desc>> {
    let heur = Desc::new(Kind::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
    heur.set_descs(Attr::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[&graph.graph])?;
    // SAFETY: HEUR_MODE is cudnnBackendHeurMode_t.
    unsafe {
        heur.set(
            Attr::CUDNN_ATTR_ENGINEHEUR_MODE,
            Ty::CUDNN_TYPE_HEUR_MODE,
            &[mode],
        )
    }?;
    heur.finalize()?;
    heur.get_all_descs(
        Attr::CUDNN_ATTR_ENGINEHEUR_RESULTS,
        Kind::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR,
        MAX_PER_MODE,
    )
}

/// A configuration's tag (see [`Candidate::label`]) and its engine's numerical notes.
fn describe(config: &Desc) -> GraphResult<(String, Vec<u32>)> {
    let engine = config
        .get_descs(
            Attr::CUDNN_ATTR_ENGINECFG_ENGINE,
            Kind::CUDNN_BACKEND_ENGINE_DESCRIPTOR,
            1,
        )?
        .pop()
        .ok_or(GraphError {
            call: "cudnnBackendGetAttribute (no engine)",
            attr: Some(Attr::CUDNN_ATTR_ENGINECFG_ENGINE),
            status: CudnnError(sys::cudnnStatus_t::CUDNN_STATUS_BAD_PARAM),
        })?;
    let index = engine.get_i64(Attr::CUDNN_ATTR_ENGINE_GLOBAL_INDEX)?;
    // Fewer than 16 notes exist (TYPE_COUNT is 10 in cuDNN 9.21).
    let notes = engine.get_enums(
        Attr::CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
        Ty::CUDNN_TYPE_NUMERICAL_NOTE,
        16,
    )?;
    // Fewer than 64 knob types exist (CUDNN_KNOB_TYPE_COUNTS is 43 in cuDNN 9.1).
    let knobs = config.get_all_descs(
        Attr::CUDNN_ATTR_ENGINECFG_KNOB_CHOICES,
        Kind::CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR,
        64,
    )?;
    let mut label = format!("eng{index}");
    for knob in &knobs {
        let kind = knob.get_enums(
            Attr::CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE,
            Ty::CUDNN_TYPE_KNOB_TYPE,
            1,
        )?;
        let value = knob.get_i64(Attr::CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE)?;
        if let Some(kind) = kind.first() {
            // Writing to a String cannot fail.
            let _ = write!(label, "_k{kind}={value}");
        }
    }
    Ok((label, notes))
}

/// Whether a configuration with these numerical notes may run for bf16 data (see [`REJECTED_NOTES`]).
fn notes_allowed(notes: &[u32]) -> bool {
    !notes.iter().any(|n| REJECTED_NOTES.contains(n))
}

/// The execution plan of `config` on `handle`, finalized, and its workspace bytes.
fn plan(handle: sys::cudnnHandle_t, config: &Desc) -> GraphResult<(Desc, usize)> {
    let plan = Desc::new(Kind::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
    plan.set_handle(Attr::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, handle)?;
    plan.set_descs(Attr::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[config])?;
    plan.finalize()?;
    let workspace = plan.get_i64(Attr::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE)?;
    Ok((plan, workspace.max(0) as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_rule_out_narrowing_only() {
        // TENSOR_CORE (0), FFT (3), NONDETERMINISTIC (4), WINOGRAD (5): the legacy search allows
        // these for bf16 as well.
        assert!(notes_allowed(&[]));
        assert!(notes_allowed(&[0, 3, 4, 5]));
        assert!(!notes_allowed(&[0, 1]));
        assert!(!notes_allowed(&[2]));
    }

    #[test]
    fn alignment_check() {
        assert!(aligned([0, 256, 1 << 20]));
        assert!(!aligned([256, 8, 512]));
    }

    /// The operation (tensors, convolution, alpha/beta) and a variant pack build and finalize with the
    /// attribute types used here, for both layouts and for the VAE's channels-last shape. Needs libcudnn
    /// only (no handle, no GPU); skips with a message where it is absent. What needs a device (the
    /// graph, heuristics, plans, running) is covered by the GPU parity tests, which run whichever plan
    /// was chosen.
    #[test]
    fn operation_and_variant_pack_build_where_the_library_loads() {
        use super::super::cudnn::{DnnLayout, probe};
        use crate::DType;
        if let Err(e) = probe() {
            eprintln!("skipped: {e}");
            return;
        }
        for layout in [DnnLayout::Ncdhw, DnnLayout::Ndhwc] {
            for dtype in [DType::F32, DType::BF16] {
                let key = DnnConvKey {
                    dtype,
                    layout,
                    batch: 1,
                    c_in: 96,
                    c_out: 96,
                    input: [6, 48, 80],
                    kernel: [3, 3, 3],
                    stride: [1, 1, 1],
                    pad: [0, 1, 1],
                };
                let built = super::super::catch("libcudnn", || ConvOp::new(&key).map(|_| ()))
                    .expect("symbols load");
                assert!(
                    built.is_ok(),
                    "{layout:?} {dtype:?}: {}",
                    built.unwrap_err()
                );
            }
        }
        let pack = super::super::catch("libcudnn", || {
            variant_pack((1 << 20, 2 << 20, 3 << 20), 4 << 20).map(|_| ())
        })
        .expect("symbols load");
        assert!(pack.is_ok(), "{}", pack.unwrap_err());

        let key = DnnConvKey {
            dtype: DType::BF16,
            layout: DnnLayout::Ndhwc,
            batch: 1,
            c_in: 8,
            c_out: 16,
            input: [3, 8, 8],
            kernel: [3, 3, 3],
            stride: [1, 1, 1],
            pad: [0, 1, 1],
        };
        // Reading back, as `describe` does: cuDNN fills a descriptor created here (the operation's y,
        // a one-element attribute, asked for exactly; what it writes is the operation's internal form
        // of y, so only the call is checked), and an array attribute asked for more elements than it
        // has writes those it has (the x tensor's dims; `describe` reads the numerical notes and knob
        // choices so, as cuDNN's frontend does). cuDNN 9.26 refuses both the count query and an
        // over-sized request for one-element attributes, so `describe` asks those exactly.
        let read_back = super::super::catch("libcudnn", || -> GraphResult<(usize, Vec<i64>)> {
            let conv = ConvOp::new(&key)?;
            let y = conv.op.get_descs(
                Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
                Kind::CUDNN_BACKEND_TENSOR_DESCRIPTOR,
                1,
            )?;
            let mut dims = vec![0i64; 8];
            // SAFETY: INT64 is int64_t.
            let n = unsafe {
                conv._x.get(
                    Attr::CUDNN_ATTR_TENSOR_DIMENSIONS,
                    Ty::CUDNN_TYPE_INT64,
                    &mut dims,
                )
            }?;
            dims.truncate(n);
            Ok((y.len(), dims))
        })
        .expect("symbols load");
        match read_back {
            Ok((filled, dims)) => {
                assert_eq!(filled, 1);
                assert_eq!(dims, key.graph_tensors()[0].0);
            }
            Err(e) => panic!("reading the operation back: {e}"),
        }
    }

    /// A failure names the call, the attribute and the status: that text is what the plan line shows
    /// when the graph path falls back.
    #[test]
    fn graph_errors_name_the_attribute() {
        let shown = GraphError {
            call: "cudnnBackendSetAttribute",
            attr: Some(Attr::CUDNN_ATTR_TENSOR_STRIDES),
            status: CudnnError(sys::cudnnStatus_t::CUDNN_STATUS_BAD_PARAM),
        }
        .to_string();
        assert!(shown.contains("CUDNN_ATTR_TENSOR_STRIDES"), "{shown}");
        assert!(shown.contains("BAD_PARAM"), "{shown}");
    }
}
