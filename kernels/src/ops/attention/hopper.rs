//! Launch side of the Hopper attention kernels (`hopper.cu`: wgmma m64n128k16 with Q/K/V in
//! 128B-swizzled shared memory and P in registers; the implementer's brief is
//! `shared/reference/attention.md`): where they apply and the launch. Two kinds, variants in
//! `crate::cuda::HOPPER_VARIANTS`: cp.async K/V staging by every thread (stage a of the brief), and the
//! warp-specialised kernel (a TMA producer warpgroup and two consumer warpgroups that take turns on the
//! tensor cores and overlap softmax with P·V; stages c–d), which takes Q/K/V as tensor maps encoded
//! here and a work schedule that splits a sparse last wave of tiles along the keys (`schedule`).
//! The FP8 kernel (`attention_fp8` here, namespace `fp8` of hopper.cu) shares the tensor-map
//! encoding, the warp-specialised layout and the schedule; `ops/quant/cuda.rs` quantises its
//! operands and calls it.
//! Anything a kernel cannot run is a `KernelError` naming the rule, never a panic and never a silent
//! empty launch (the bodies are compiled only for sm_90a, so the architecture is checked before the
//! source is even compiled).

use cudarc::driver::sys;
use cudarc::driver::sys::CUtensorMapSwizzle as Swizzle;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, PushKernelArg};

use super::cuda::{int, launch};
use crate::cuda::{CudaBackend, HOPPER_VARIANTS, HopperVariant, KernelSource};
use crate::{DType, KernelError, Result, Tensor};

pub(crate) const SOURCE: KernelSource = KernelSource {
    name: "attention_hopper",
    text: include_str!("hopper.cu"),
};

/// `D` and `BR` of hopper.cu; the block sizes of its two kinds of kernel.
const HEAD_DIM: usize = 128;
const BLOCK_Q: usize = 128;
const THREADS: u32 = 256;
const WS_THREADS: u32 = 384;
/// The only architecture with wgmma (an sm_90a CUBIN loads on sm_90 only; sm_100 has no wgmma).
const ARCH: &str = "sm_90a";

/// Why the Hopper kernel cannot run this call, if it cannot.
fn unsupported(
    arch: &str,
    dtype: DType,
    [batch, _, _, heads, head_dim]: [usize; 5],
    scale: f32,
) -> Option<String> {
    if arch != ARCH {
        return Some(format!("it needs {ARCH} (wgmma), not {arch}"));
    }
    if dtype != DType::BF16 {
        return Some(format!("it takes bf16, not {dtype:?}"));
    }
    if head_dim != HEAD_DIM {
        return Some(format!(
            "it is built for head dim {HEAD_DIM}, not {head_dim}"
        ));
    }
    // The running max is taken on raw scores, which is the max of the scaled ones only for scale > 0.
    if !(scale > 0.0 && scale.is_finite()) {
        return Some(format!("it needs a finite scale > 0, not {scale}"));
    }
    if heads > 65_535 || batch > 65_535 {
        return Some("the grid would exceed the launch limits".into());
    }
    None
}

/// The variant `Auto` runs wherever the Hopper kernel applies (bf16, head dim 128, sm_90a), measured
/// on the H200 (bench/RESULTS.md, 2026-11-30, fourth session): the warp-specialised kernel with K/V
/// blocks of 192 keys (two-stage TMA rings), 656.6–663.8 TFLOP/s at issue 4's two shapes against
/// 648.6–652.6 for 176 keys (FlashAttention-3's tile) in the same process, and ahead of 176 in 9 of
/// the 10 same-process pairs of that session (last session: 3 of 4 shapes, behind at
/// (1,24,27280)); 128-key blocks 627–638, the cp.async kernel 415–470.
const AUTO_VARIANT: (&str, bool) = ("hopper_ws_fwd_d128_br128_bc192_s2", false);

/// Up to this many valid keys (the DiT's cross-attention to 512 text tokens), `Auto` runs
/// `AUTO_SHORT_VARIANT`: a tile's few K/V blocks leave one CTA per tile waiting on its Q and first
/// blocks and on its stores, which a persistent launch overlaps with the neighbouring items.
/// Measured on the H200 (bench/RESULTS.md, 2026-12-04): 0.233 ms at (1,12,32760,128) against 512
/// keys and 1.579 ms at (1,40,75600,128), against 0.286 and 2.034 for `AUTO_VARIANT` (192-key
/// blocks persistent: 0.237, 1.666). Over full-length keys the persistent launch is no faster (192-key
/// blocks at (1,12,32760,128): 9.70 ms against 8.82 one CTA per tile), so `AUTO_VARIANT` stays there.
const SHORT_KEYS: usize = 1024;
const AUTO_SHORT_VARIANT: (&str, bool) = ("hopper_ws_fwd_d128_br128_bc128_s2", true);

/// The variant `Auto` runs for this call (kv_len valid keys), if the Hopper kernel applies to it.
pub(super) fn auto(
    backend: &CudaBackend,
    dtype: DType,
    dims: [usize; 5],
    scale: f32,
    kv_len: usize,
) -> Option<&'static HopperVariant> {
    if unsupported(&backend.arch, dtype, dims, scale).is_some() {
        return None;
    }
    let (name, persistent) = if kv_len <= SHORT_KEYS {
        AUTO_SHORT_VARIANT
    } else {
        AUTO_VARIANT
    };
    HOPPER_VARIANTS
        .iter()
        .find(|v| v.name == name && v.persistent == persistent)
}

/// Variant `i` if the Hopper kernel applies to this call, else an error saying why.
pub(super) fn check(
    op: &'static str,
    backend: &CudaBackend,
    dtype: DType,
    dims: [usize; 5],
    scale: f32,
    i: usize,
) -> Result<&'static HopperVariant> {
    let v = HOPPER_VARIANTS.get(i).ok_or_else(|| {
        KernelError::arg(
            op,
            "AttentionKernel::Hopper",
            i,
            format!("there are {} variants", HOPPER_VARIANTS.len()),
        )
    })?;
    match unsupported(&backend.arch, dtype, dims, scale) {
        Some(why) => Err(KernelError::arg(
            op,
            "AttentionKernel::Hopper",
            v.name,
            format!("the Hopper attention does not apply: {why}"),
        )),
        None => Ok(v),
    }
}

/// The most CTAs a split tile is shared by (`Schedule` below; hopper.cu's merge reads that many
/// chunks).
const MAX_WAYS: usize = 8;

/// The warp-specialised kernels' work schedule (hopper.cu's `ws::Schedule`; bf16 and FP8): `tiles`
/// tiles of 128 query rows, one CTA each, on `sms` SMs (one CTA fits an SM). When the last wave
/// would be at most half full, its tiles are split along their `blocks` K/V blocks over `ways` CTAs
/// each (as many as fill the SMs, at most `MAX_WAYS`, at least 2 blocks per CTA) and merged by the
/// last CTA of each: at (1,12,32760,128), 3,072 tiles leave 36 for a 24th wave, which as 108 thirds
/// takes a third of the time. Returns (n_full, ways): the first n_full tiles whole, the rest split
/// `ways` ways (1: none).
fn schedule(tiles: usize, sms: usize, blocks: usize) -> (usize, usize) {
    let tail = tiles % sms.max(1);
    if tail == 0 || 2 * tail > sms {
        return (tiles, 1);
    }
    let ways = (sms / tail).min(MAX_WAYS).min(blocks / 2);
    if ways < 2 {
        (tiles, 1)
    } else {
        (tiles - tail, ways)
    }
}

/// A launch's work items (hopper.cu's `ws::Schedule`, which the warp-specialised bf16 kernels and the
/// FP8 one take): the split tiles' partial rows and tickets (owned here, so they live until the
/// launch is queued; none when nothing is split) and (tiles per head, n_full, ways, work items).
pub(super) struct Split {
    part: Option<CudaSlice<f32>>,
    tickets: Option<CudaSlice<u32>>,
    pub schedule: [i32; 4],
}

impl Split {
    /// `tiles_x` query tiles per (batch, head), `tiles` in all, the first `n_full` whole and the
    /// rest split `ways` ways (a [`schedule`]), with the buffers of its merge.
    fn new(
        op: &'static str,
        backend: &CudaBackend,
        (tiles_x, tiles): (usize, usize),
        (n_full, ways): (usize, usize),
    ) -> Result<Self> {
        let split = tiles - n_full;
        let alloc_err = |e| backend.err(op, "cuMemAllocAsync", e);
        // Per split chunk and consumer thread: 64 O values and 2 LSEs (hopper.cu's `part_slot`).
        let part = (ways > 1)
            .then(|| {
                // SAFETY: every chunk writes all of its slots before any CTA reads them (tickets).
                unsafe { backend.stream.alloc::<f32>(split * ways * 66 * 256) }
            })
            .transpose()
            .map_err(alloc_err)?;
        let tickets = (ways > 1)
            .then(|| backend.stream.alloc_zeros::<u32>(split))
            .transpose()
            .map_err(alloc_err)?;
        Ok(Self {
            part,
            tickets,
            schedule: [
                int(op, "seq_q / 128", tiles_x)?,
                int(op, "tiles", n_full)?,
                ways as i32,
                int(op, "tiles", n_full + split * ways)?,
            ],
        })
    }

    /// Work items: one CTA each unless the launch is persistent.
    pub fn items(&self) -> u32 {
        self.schedule[3] as u32
    }

    /// The device addresses of the partial rows and the tickets, 0 for none.
    pub fn buffers(&self, stream: &CudaStream) -> [u64; 2] {
        [
            self.part.as_ref().map_or(0, |p| p.device_ptr(stream).0),
            self.tickets.as_ref().map_or(0, |t| t.device_ptr(stream).0),
        ]
    }
}

/// What the warp-specialised kernels take beyond the shared argument list: the tensor maps of q, k
/// and v (in place of their addresses), then the [`Split`].
pub(super) struct WsArgs {
    pub maps: [TensorMap; 3],
    pub split: Split,
}

/// A CUDA tensor map (`CUtensorMap`, 128 opaque bytes), passed by value as hopper.cu's `TmaMap`.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub(super) struct TensorMap(sys::CUtensorMap);

// SAFETY: plain bytes, laid out and aligned as the kernel's `__grid_constant__ TmaMap` parameter.
unsafe impl DeviceRepr for TensorMap {}

/// The tensor map of `rows` rows of the contiguous [B, S, H, 128] bf16 buffer `t` (`[batch, seq,
/// heads]`; S sets the batch stride; `rows` ≤ S, the rows the kernel may read: reads past
/// them are zero-filled), in boxes of 64 columns × `box_rows` rows of one head with the 128-byte
/// swizzle the wgmma operands use (hopper.cu's `tma_tile` loads a tile as two such boxes). Brief §3:
/// dims {128, rows, H, B}, byte strides {H·256, 256, S·H·256}.
fn tensor_map(
    op: &'static str,
    backend: &CudaBackend,
    t: &Tensor,
    [batch, seq, heads]: [usize; 3],
    box_rows: usize,
    rows: usize,
) -> Result<TensorMap> {
    let row_bytes = (heads * HEAD_DIM * 2) as u64;
    // A map may not have an empty dimension; with rows = 0 (kv_len 0) the kernel reads nothing.
    let dims = [
        HEAD_DIM as u64,
        rows.max(1) as u64,
        heads as u64,
        batch as u64,
    ];
    // With S = 0 the batch stride would be 0, which a map may not have; nothing is read then.
    let strides = [
        row_bytes,
        (HEAD_DIM * 2) as u64,
        seq.max(1) as u64 * row_bytes,
    ];
    let map = MapSpec {
        bf16: true,
        dims,
        strides,
        boxes: [64, box_rows as u32],
        swizzle: Swizzle::CU_TENSOR_MAP_SWIZZLE_128B,
    };
    // SAFETY: `t` is a live allocation of B·S·H·128 bf16 (256-byte aligned), which the dims and
    // strides above stay within.
    unsafe { encode(op, backend, t.cuda_storage(op)?.ptr(), map) }
}

/// A 4-D tensor map over a contiguous buffer: element type (bf16 or u8), dims (innermost first),
/// the byte strides of the outer three, and the box of the inner two (the outer two boxed by 1),
/// and the swizzle the wgmma operands' descriptors name (128 bytes; 64 or 32 for boxes whose inner
/// extent is that many bytes).
struct MapSpec {
    bf16: bool,
    dims: [u64; 4],
    strides: [u64; 3],
    boxes: [u32; 2],
    swizzle: Swizzle,
}

/// Encodes `map` over the buffer at `ptr`.
///
/// # Safety
/// `ptr` is the start of a live allocation (256-byte aligned) that every element the dims and
/// strides address lies in; strides are multiples of 16 below 2⁴⁰, no dim is 0, and the box's
/// inner extent is at most the swizzle's span and both are at most 256.
unsafe fn encode(
    op: &'static str,
    backend: &CudaBackend,
    ptr: u64,
    map: MapSpec,
) -> Result<TensorMap> {
    let boxes = [map.boxes[0], map.boxes[1], 1, 1];
    let elem_strides = [1u32; 4];
    let dtype = if map.bf16 {
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    } else {
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8
    };
    let mut out = std::mem::MaybeUninit::<sys::CUtensorMap>::uninit();
    // SAFETY: the arrays outlive the call and have the rank's lengths (rank − 1 strides); the
    // caller vouches for the address, dims, strides and box.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            out.as_mut_ptr(),
            dtype,
            4,
            ptr as *mut std::ffi::c_void,
            map.dims.as_ptr(),
            map.strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            map.swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()
        .map_err(|e| backend.err(op, "cuTensorMapEncodeTiled", e))?;
        Ok(TensorMap(out.assume_init()))
    }
}

/// q [B, S_q, H, 128], k/v [B, S_k, H, 128] bf16 → (out bf16, lse [B, H, S_q] f32) with `variant`, which
/// `check` returned.
pub(super) fn attention(
    op: &'static str,
    backend: &CudaBackend,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    [batch, seq_q, seq_k, heads, _]: [usize; 5],
    scale: f32,
    kv_len: usize,
    variant: &HopperVariant,
) -> Result<(Tensor, Tensor)> {
    let f = backend.function(&SOURCE, variant.name)?;
    let tiles_x = seq_q.div_ceil(BLOCK_Q);
    // An empty output launches nothing (`launch`), and a map may not have an empty batch or head
    // dimension: maps and schedule only where there is work.
    let (grid, threads, ws) = if variant.warp_specialised && batch * heads * seq_q > 0 {
        let (ws, items) = ws_args(
            op,
            backend,
            (q, k, v),
            [batch, seq_q, seq_k, heads],
            kv_len,
            variant,
        )?;
        // Persistent: one CTA per SM (one fits), each taking items in turn.
        let ctas = if variant.persistent {
            items.min(backend.sm_count.max(1) as u32)
        } else {
            items
        };
        ((ctas, 1, 1), WS_THREADS, Some(ws))
    } else {
        let tiles_x = int(op, "seq_q / 128", tiles_x)? as u32;
        ((tiles_x, heads as u32, batch as u32), THREADS, None)
    };
    // SAFETY: hopper.cu's kernels take the shared argument list without head_dim: the cp.async ones
    // the addresses, one CTA of 256 threads per (q-tile, head, batch); the ws ones the tensor maps
    // (encoded by `ws_args` over these buffers) and the schedule after scale, one CTA of 384 threads
    // per work item, `ws` owning the split chunks' slots and zeroed tickets until after the launch is
    // queued (their stream-ordered frees follow it), at most as many CTAs as items (the kernel loops
    // over its share). Contiguous bf16 [B, S, H, 128] buffers of the
    // shapes `check` accepted (allocations 256-byte aligned, rows of 256 bytes, so every 16-byte
    // cp.async is aligned); kv_len ≤ S_k; the dynamic shared memory is the variant's carve-up (Q and
    // its K/V stages + 1 KiB of alignment slack), within the 227 KiB an sm_90 block may opt into
    // (checked by a unit test); the architecture is sm_90a.
    unsafe {
        launch(
            op,
            backend,
            &f,
            (q, k, v),
            [batch, seq_q, seq_k, heads, HEAD_DIM],
            (scale, kv_len, false),
            (grid, threads, variant.shared_bytes()),
            ws.as_ref(),
        )
    }
}

/// The warp-specialised kernel's extra arguments for this call, and its work items: the
/// tensor maps (K and V end at kv_len, so that TMA zero-fills the padded keys of the partial block:
/// their P is 0 and V must be finite there) and the [`schedule`] with its buffers.
fn ws_args(
    op: &'static str,
    backend: &CudaBackend,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    [batch, seq_q, seq_k, heads]: [usize; 4],
    kv_len: usize,
    variant: &HopperVariant,
) -> Result<(WsArgs, u32)> {
    let tiles_x = seq_q.div_ceil(BLOCK_Q);
    let tiles = tiles_x * heads * batch;
    let (n_full, ways) = schedule(tiles, backend.sm_count, kv_len.div_ceil(variant.block_k));
    let split = Split::new(op, backend, (tiles_x, tiles), (n_full, ways))?;
    let kv_map = |t| {
        tensor_map(
            op,
            backend,
            t,
            [batch, seq_k, heads],
            variant.block_k,
            kv_len,
        )
    };
    let items = split.items();
    let ws = WsArgs {
        maps: [
            tensor_map(op, backend, q, [batch, seq_q, heads], BLOCK_Q, seq_q)?,
            kv_map(k)?,
            kv_map(v)?,
        ],
        split,
    };
    Ok((ws, items))
}

/// Why the FP8 Hopper kernel cannot run on this GPU and head dim, if it cannot (the dtype and
/// scale rules are the bf16 kernel's).
pub(crate) fn fp8_unsupported(
    backend: &CudaBackend,
    dims: [usize; 5],
    scale: f32,
) -> Option<String> {
    unsupported(&backend.arch, DType::BF16, dims, scale)
}

/// How the FP8 kernel's launch of `variant` shares out the keys of a call of `[batch, seq_q,
/// heads]` and kv_len on this GPU: the bf16 kernel's [`schedule`] of its tiles over the SMs, or
/// nothing split for a `_whole` launch.
pub(crate) fn fp8_key_split(
    backend: &CudaBackend,
    variant: &crate::cuda::HopperFp8Variant,
    [batch, seq_q, heads]: [usize; 3],
    kv_len: usize,
) -> crate::Fp8KeySplit {
    let tiles = seq_q.div_ceil(BLOCK_Q) * heads * batch;
    let blocks = kv_len.div_ceil(crate::cuda::HOPPER_FP8_KEYS);
    match schedule(tiles, backend.sm_count, blocks) {
        (first, ways) if variant.split && ways > 1 => crate::Fp8KeySplit { first, ways },
        _ => crate::Fp8KeySplit::NONE,
    }
}

/// The quantised operands of one FP8 attention call (ops/quant/cuda.rs makes them): device
/// addresses of the e4m3 codes of q and k ([B, S, H, 128]; k's valid to kv_len) and of vᵀ ([B, H,
/// 128, s_pad]), and of their f32 scales (q [B, H, ⌈S_q/128⌉], k [B, H, ⌈kv_len/128⌉], v [B, H,
/// 128]).
pub(crate) struct Fp8Operands {
    pub q: u64,
    pub k: u64,
    pub vt: u64,
    pub s_pad: usize,
    pub scales: [u64; 3],
}

/// The FP8 forward (hopper.cu, namespace `fp8`) over `ops` → (out bf16 [B, S_q, H, 128], lse [B,
/// H, S_q] f32), with variant `variant`; `fp8_unsupported` returned None for this call.
///
/// # Safety
/// `ops` holds live buffers of the shapes its docs give for these dims and kv_len (≥ 1, ≤ S_k),
/// with vᵀ zero from kv_len to s_pad, a multiple of 128 ≥ kv_len, and every code and scale written.
pub(crate) unsafe fn attention_fp8(
    op: &'static str,
    backend: &CudaBackend,
    ops: &Fp8Operands,
    [batch, seq_q, seq_k, heads]: [usize; 4],
    (scale, kv_len): (f32, usize),
    variant: &crate::cuda::HopperFp8Variant,
) -> Result<(Tensor, Tensor)> {
    let out = backend.alloc(DType::BF16, batch * seq_q * heads * HEAD_DIM)?;
    let lse = backend.alloc(DType::F32, batch * heads * seq_q)?;
    let tensors = |out, lse| {
        (
            Tensor::from_cuda(out, &[batch, seq_q, heads, HEAD_DIM]),
            Tensor::from_cuda(lse, &[batch, heads, seq_q]),
        )
    };
    let tiles_x = seq_q.div_ceil(BLOCK_Q);
    let tiles = tiles_x * heads * batch;
    if tiles == 0 {
        return Ok(tensors(out, lse));
    }
    let row = (heads * HEAD_DIM) as u64;
    let qk_map = |ptr: u64, seq: usize, rows: usize, box_rows: usize| {
        let map = MapSpec {
            bf16: false,
            dims: [
                HEAD_DIM as u64,
                rows.max(1) as u64,
                heads as u64,
                batch as u64,
            ],
            strides: [row, HEAD_DIM as u64, seq.max(1) as u64 * row],
            boxes: [128, box_rows as u32],
            swizzle: Swizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        };
        // SAFETY: the caller's contract: [B, seq, H, 128] bytes at ptr, rows ≤ seq.
        unsafe { encode(op, backend, ptr, map) }
    };
    let s_pad = ops.s_pad as u64;
    let keys = crate::cuda::HOPPER_FP8_KEYS;
    // Vᵀ by blocks of 128 keys × 128 channels; boxes past s_pad read zeros.
    let vt_map = MapSpec {
        bf16: false,
        dims: [s_pad, HEAD_DIM as u64, heads as u64, batch as u64],
        strides: [
            s_pad,
            HEAD_DIM as u64 * s_pad,
            (heads * HEAD_DIM) as u64 * s_pad,
        ],
        boxes: [keys as u32, HEAD_DIM as u32],
        swizzle: Swizzle::CU_TENSOR_MAP_SWIZZLE_128B,
    };
    let maps = [
        qk_map(ops.q, seq_q, seq_q, BLOCK_Q)?,
        qk_map(ops.k, seq_k, kv_len, keys)?,
        // SAFETY: the caller's contract: [B, H, 128, s_pad] bytes at vt; the box's inner extent
        // (128 bytes) is its swizzle's span.
        unsafe { encode(op, backend, ops.vt, vt_map) }?,
    ];
    let f = backend.function(&SOURCE, variant.name)?;
    let smem = variant.shared_bytes();
    f.set_attribute(
        sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .map_err(|e| backend.err(op, "cuFuncSetAttribute", e))?;
    let ints = [
        int(op, "seq_q", seq_q)?,
        int(op, "heads", heads)?,
        int(op, "kv_len", kv_len)?,
    ];
    let key_split = fp8_key_split(backend, variant, [batch, seq_q, heads], kv_len);
    let split = Split::new(
        op,
        backend,
        (tiles_x, tiles),
        (key_split.first.min(tiles), key_split.ways),
    )?;
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (split.items(), 1, 1),
        block_dim: (WS_THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let (op_ptr, lp) = (out.ptr(), lse.ptr());
    let mut launch = backend.stream.launch_builder(&f);
    for map in &maps {
        launch.arg(map);
    }
    for s in &ops.scales {
        launch.arg(s);
    }
    launch.arg(&op_ptr).arg(&lp);
    for i in &ints {
        launch.arg(i);
    }
    launch.arg(&scale);
    let [part, tickets] = split.buffers(&backend.stream);
    launch.arg(&part).arg(&tickets);
    for i in &split.schedule {
        launch.arg(i);
    }
    // SAFETY: hopper_fp8_fwd_* takes (tq, tk, tv, q_scales, k_scales, v_scales, out, lse, seq_q,
    // heads, kv_len, scale, part, tickets, tiles_x, n_full, ways, items), one CTA of 384 threads per
    // work item (`Split` allocated the merge's buffers for its schedule), the variant's dynamic shared
    // memory (opted into above, ≤ 227 KiB: a unit test); the maps and scales cover the buffers the
    // caller vouched for; out and lse were allocated here with the sizes the kernel writes.
    unsafe { launch.launch(cfg) }.map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    Ok(tensors(out, lse))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIMS: [usize; 5] = [1, 300, 257, 2, 128];

    #[test]
    fn schedule_splits_only_a_sparse_last_wave() {
        // Issue 4's shapes on 132 SMs (1 CTA each): 3,072 tiles leave 36 for a last wave, split in
        // 3 (108 CTAs); 23,640 leave 12, split 8 ways (the cap); 5,136 leave 120 (over half full).
        assert_eq!(schedule(3072, 132, 171), (3036, 3));
        assert_eq!(schedule(23_640, 132, 394), (23_628, 8));
        assert_eq!(schedule(5136, 132, 143), (5136, 1));
        assert_eq!(schedule(2 * 132, 132, 100), (264, 1)); // whole waves
        // Small calls: fewer tiles than SMs are all a sparse "last wave".
        assert_eq!(schedule(12, 132, 4), (0, 2)); // at least 2 K/V blocks per CTA
        assert_eq!(schedule(2, 132, 6), (0, 3));
        assert_eq!(schedule(4, 132, 2), (4, 1)); // too few blocks to share
        assert_eq!(schedule(0, 132, 10), (0, 1));
    }

    #[test]
    fn applies_only_where_it_can_run() {
        assert_eq!(unsupported("sm_90a", DType::BF16, DIMS, 0.1), None);
        for arch in ["sm_80", "sm_90", "sm_100a", "sm_120a"] {
            let why = unsupported(arch, DType::BF16, DIMS, 0.1).unwrap();
            assert!(why.contains("sm_90a"), "{why}");
        }
        assert!(unsupported("sm_90a", DType::F32, DIMS, 0.1).is_some());
        assert!(unsupported("sm_90a", DType::BF16, [1, 300, 257, 2, 64], 0.1).is_some());
        for scale in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            assert!(unsupported("sm_90a", DType::BF16, DIMS, scale).is_some());
        }
        assert!(unsupported("sm_90a", DType::BF16, [1, 300, 257, 70_000, 128], 0.1).is_some());
    }
}
