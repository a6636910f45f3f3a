//! Launch side of the Hopper attention kernel (`hopper.cu`: wgmma m64n128k16 with Q/K/V in 128B-swizzled
//! shared memory, P in registers, cp.async double-buffered K/V; stage a of the implementer's brief
//! `shared/reference/attention.md`): where it applies and the launch. The variants are
//! `crate::cuda::HOPPER_VARIANTS`. It runs only when forced with
//! [`AttentionKernel::Hopper`](crate::cuda::AttentionKernel::Hopper); anything it cannot run is a
//! `KernelError` naming the rule, never a panic and never a silent empty launch (its body is compiled only
//! for sm_90a, so the architecture is checked before the source is even compiled).

use super::cuda::{int, launch};
use crate::cuda::{CudaBackend, HOPPER_VARIANTS, HopperVariant, KernelSource};
use crate::{DType, KernelError, Result, Tensor};

pub(crate) const SOURCE: KernelSource = KernelSource {
    name: "attention_hopper",
    text: include_str!("hopper.cu"),
};

/// `D`, `BR`, `THREADS` of hopper.cu.
const HEAD_DIM: usize = 128;
const BLOCK_Q: usize = 128;
const THREADS: u32 = 256;
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
/// on the H200 (bench/RESULTS.md, 2026-11-30): three K/V stages, 470–484 TFLOP/s at the DiT shapes,
/// against 403–431 for two stages and 350–377 for the best mma.sync variant of `flash.cu`.
const AUTO_VARIANT: &str = "hopper_fwd_d128_br128_bc128_s3";

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
    // SAFETY: hopper.cu's kernels take the shared argument list without head_dim; contiguous bf16
    // [B, S, H, 128] buffers of the shapes `check` accepted (allocations 256-byte aligned, rows of 256
    // bytes, so every 16-byte cp.async is aligned); kv_len ≤ S_k; the dynamic shared memory is the
    // variant's carve-up (Q and its K/V stages, 32 KiB tiles, + 1 KiB of alignment slack), within the
    // 227 KiB an sm_90 block may opt into (checked by a unit test); the architecture is sm_90a.
    unsafe {
        launch(
            op,
            backend,
            &f,
            (q, k, v),
            [batch, seq_q, seq_k, heads, HEAD_DIM],
            (scale, kv_len, false),
            (grid, THREADS, variant.shared_bytes()),
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
