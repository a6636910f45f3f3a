//! Launch side of the tensor-core attention kernel (`flash.cu`: FlashAttention-2 algorithm with
//! `mma.sync` m16n8k16 bf16, `ldmatrix`, cp.async double-buffered K/V): where it applies, which variant,
//! and the launch. The variants and the automatic choice are in `crate::cuda::attention_kernel`.

use super::cuda::{SOURCE, launch};
use crate::cuda::attention_kernel::default_flash_variant;
use crate::cuda::{CudaBackend, FLASH_VARIANTS, FlashVariant};
use crate::{DType, KernelError, Result, Tensor};

/// Compute capability major of an NVRTC arch name (`sm_90a` → 9).
fn arch_major(arch: &str) -> u32 {
    let digits: String = arch
        .trim_start_matches("sm_")
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse::<u32>().map_or(0, |n| n / 10)
}

/// Why variant `v` cannot run this call, if it cannot.
fn unsupported(
    backend: &CudaBackend,
    dtype: DType,
    [batch, seq_q, _, heads, head_dim]: [usize; 5],
    scale: f32,
    v: &FlashVariant,
) -> Option<String> {
    if dtype != DType::BF16 {
        return Some(format!("it takes bf16, not {dtype:?}"));
    }
    if head_dim != v.head_dim {
        return Some(format!("{} is built for head dim {}", v.name, v.head_dim));
    }
    if arch_major(&backend.arch) < 8 {
        return Some(format!("it needs sm_80 or later, not {}", backend.arch));
    }
    // The running max is taken on raw scores, which is the max of the scaled ones only for scale > 0.
    if !(scale > 0.0 && scale.is_finite()) {
        return Some(format!("it needs a finite scale > 0, not {scale}"));
    }
    if seq_q.div_ceil(v.block_q()) > i32::MAX as usize
        || heads * v.slices() > 65_535
        || batch > 65_535
    {
        return Some("the grid would exceed the launch limits".into());
    }
    None
}

/// The variant `Auto` picks for this call, if the tensor-core kernel applies.
pub(super) fn auto(
    backend: &CudaBackend,
    dtype: DType,
    dims: [usize; 5],
    scale: f32,
) -> Option<usize> {
    let i = default_flash_variant(dims[4])?;
    unsupported(backend, dtype, dims, scale, &FLASH_VARIANTS[i])
        .is_none()
        .then_some(i)
}

/// Variant `i`, or an error saying why it does not apply to this call.
pub(super) fn check(
    op: &'static str,
    backend: &CudaBackend,
    dtype: DType,
    dims: [usize; 5],
    scale: f32,
    i: usize,
) -> Result<usize> {
    let v = FLASH_VARIANTS.get(i).ok_or_else(|| {
        KernelError::arg(
            op,
            "AttentionKernel::Flash",
            i,
            format!("there are {} variants", FLASH_VARIANTS.len()),
        )
    })?;
    match unsupported(backend, dtype, dims, scale, v) {
        Some(why) => Err(KernelError::arg(
            op,
            "AttentionKernel::Flash",
            v.name,
            format!("the tensor-core attention does not apply: {why}"),
        )),
        None => Ok(i),
    }
}

/// q [B, S_q, H, D], k/v [B, S_k, H, D] bf16 → (out bf16, lse [B, H, S_q] f32) with variant `i`.
pub(super) fn attention(
    op: &'static str,
    backend: &CudaBackend,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    [batch, seq_q, seq_k, heads, head_dim]: [usize; 5],
    scale: f32,
    kv_len: usize,
    i: usize,
) -> Result<(Tensor, Tensor)> {
    let variant = &FLASH_VARIANTS[i];
    let f = backend.function(&SOURCE, variant.name)?;
    // Wide-head variants run D/DV blocks per head, one per output slice (flash.cu).
    let grid = (
        seq_q.div_ceil(variant.block_q()) as u32,
        (heads * variant.slices()) as u32,
        batch as u32,
    );
    // SAFETY: flash.cu's kernels take the shared argument list without head_dim; bf16 buffers of the
    // shapes checked by `check` (contiguous [B, S, H, D], allocations 256-byte aligned, rows of D·2
    // bytes with D a multiple of 64 and output slices starting at multiples of 128 columns, so every
    // 16-byte cp.async is aligned); kv_len ≤ S_k; smem is the variant's carve-up (Q, 2 × K, 2 × V
    // slice); the grid's y extent is heads·D/DV as it expects.
    unsafe {
        launch(
            op,
            backend,
            &f,
            (q, k, v),
            [batch, seq_q, seq_k, heads, head_dim],
            (scale, kv_len, false),
            (grid, 32 * variant.warps, variant.shared_bytes()),
            None,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::arch_major;

    #[test]
    fn arch_major_parses() {
        assert_eq!(arch_major("sm_90a"), 9);
        assert_eq!(arch_major("sm_80"), 8);
        assert_eq!(arch_major("sm_100a"), 10);
        assert_eq!(arch_major("sm_75"), 7);
    }
}
