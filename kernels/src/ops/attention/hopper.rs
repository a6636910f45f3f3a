//! Launch side of the Hopper attention kernels (`hopper.cu`: wgmma m64n128k16 with Q/K/V in
//! 128B-swizzled shared memory and P in registers; the implementer's brief is
//! `shared/reference/attention.md`): where they apply and the launch. Two kinds, variants in
//! `crate::cuda::HOPPER_VARIANTS`: cp.async K/V staging by every thread (stage a of the brief), and the
//! warp-specialised kernel (a TMA producer warpgroup and two consumer warpgroups that take turns on the
//! tensor cores and overlap softmax with P·V; stages c–d), which takes Q/K/V as tensor maps encoded here.
//! Anything a kernel cannot run is a `KernelError` naming the rule, never a panic and never a silent
//! empty launch (the bodies are compiled only for sm_90a, so the architecture is checked before the
//! source is even compiled).

use cudarc::driver::DeviceRepr;
use cudarc::driver::sys;

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
/// on the H200 (bench/RESULTS.md, 2026-11-30, third session): the warp-specialised kernel with K/V
/// blocks of 176 keys (two-stage TMA rings), 651–723 TFLOP/s at the DiT shapes, 1.14–1.24× torch's
/// SDPA in the same call; the 128-key blocks ran at 619–683, the cp.async kernel at 468–479.
const AUTO_VARIANT: &str = "hopper_ws_fwd_d128_br128_bc176_s2";

/// The variant `Auto` runs for this call, if the Hopper kernel applies to it.
pub(super) fn auto(
    backend: &CudaBackend,
    dtype: DType,
    dims: [usize; 5],
    scale: f32,
) -> Option<&'static HopperVariant> {
    if unsupported(&backend.arch, dtype, dims, scale).is_some() {
        return None;
    }
    HOPPER_VARIANTS.iter().find(|v| v.name == AUTO_VARIANT)
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
    let boxes = [64u32, box_rows as u32, 1, 1];
    let elem_strides = [1u32; 4];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::uninit();
    // SAFETY: the arrays outlive the call and have the rank's lengths (rank − 1 strides); the address
    // is the start of a live allocation of B·S·H·128 bf16, 256-byte aligned; strides are multiples of
    // 16 below 2⁴⁰ and the box is within the 128-byte swizzle span (64 bf16) and 256 rows.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            4,
            t.cuda_storage(op)?.ptr() as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()
        .map_err(|e| backend.err(op, "cuTensorMapEncodeTiled", e))?;
        Ok(TensorMap(map.assume_init()))
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
    let grid = (
        int(op, "seq_q / 128", seq_q.div_ceil(BLOCK_Q))? as u32,
        heads as u32,
        batch as u32,
    );
    // The warp-specialised kernel reads K and V through maps that end at kv_len, so that TMA zero-fills
    // the padded keys of the partial block (their P is 0 and V must be finite there).
    // An empty output launches nothing (`launch`), and a map may not have an empty batch or head
    // dimension: maps only where there is work.
    let (maps, threads) = if variant.warp_specialised && batch * heads * seq_q > 0 {
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
        let maps = [
            tensor_map(op, backend, q, [batch, seq_q, heads], BLOCK_Q, seq_q)?,
            kv_map(k)?,
            kv_map(v)?,
        ];
        (Some(maps), WS_THREADS)
    } else {
        (None, THREADS)
    };
    // SAFETY: hopper.cu's kernels take the shared argument list without head_dim (the
    // warp-specialised ones with the tensor maps, encoded above over these buffers, for the
    // addresses); contiguous bf16 [B, S, H, 128] buffers of the shapes `check` accepted (allocations
    // 256-byte aligned, rows of 256 bytes, so every 16-byte cp.async is aligned); kv_len ≤ S_k; the
    // dynamic shared memory is the variant's carve-up (Q and its K/V stages, 32 KiB tiles, + 1 KiB of
    // alignment slack), within the 227 KiB an sm_90 block may opt into (checked by a unit test); the
    // block size is the variant's; the architecture is sm_90a.
    unsafe {
        launch(
            op,
            backend,
            &f,
            (q, k, v),
            [batch, seq_q, seq_k, heads, HEAD_DIM],
            (scale, kv_len, false),
            (grid, threads, variant.shared_bytes()),
            maps.as_ref(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIMS: [usize; 5] = [1, 300, 257, 2, 128];

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
