//! Which kernel CUDA [`attention`](crate::attention) runs: by default chosen automatically (the
//! tensor-core FlashAttention-2-class kernel of `ops/attention/flash.cu` for bf16 at head dim 64 or 128
//! with scale > 0 on sm_80+, the portable f32 CUDA-core kernel otherwise); tests and benchmarks can force
//! one for the calls made inside [`with_attention_kernel`].

use std::cell::Cell;

/// A CUDA attention kernel choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionKernel {
    /// The fastest applicable kernel (the default).
    #[default]
    Auto,
    /// The portable kernel (any dtype and head dim ≤ 256; f32 CUDA-core maths).
    Portable,
    /// The tensor-core kernel, variant `FLASH_VARIANTS[i]` (an error if it does not apply to the call).
    Flash(usize),
}

/// One compiled tile configuration of the tensor-core kernel
/// (`flash_fwd_d{D}_w{W}_m{MT}_bc{BC}_q{QREG}_mb{MIN_BLOCKS}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlashVariant {
    /// Kernel name in flash.cu.
    pub name: &'static str,
    /// Head dim it is built for.
    pub head_dim: usize,
    /// Warps per block.
    pub warps: u32,
    /// m16 tiles per warp: each warp owns 16·m_tiles query rows.
    pub m_tiles: usize,
    /// Keys per K/V block.
    pub block_k: usize,
}

impl FlashVariant {
    /// Query rows per block.
    pub fn block_q(&self) -> usize {
        16 * self.m_tiles * self.warps as usize
    }

    /// Dynamic shared memory: Q [BR × D] plus two stages of K and V [BC × D], bf16.
    pub fn shared_bytes(&self) -> usize {
        (self.block_q() + 4 * self.block_k) * self.head_dim * 2
    }
}

const fn variant(
    name: &'static str,
    head_dim: usize,
    warps: u32,
    m_tiles: usize,
    block_k: usize,
) -> FlashVariant {
    FlashVariant {
        name,
        head_dim,
        warps,
        m_tiles,
        block_k,
    }
}

/// Every compiled variant (keep in step with the `FLASH(...)` list at the end of flash.cu).
pub const FLASH_VARIANTS: &[FlashVariant] = &[
    variant("flash_fwd_d128_w8_m2_bc64_q0_mb1", 128, 8, 2, 64),
    variant("flash_fwd_d128_w4_m2_bc64_q0_mb2", 128, 4, 2, 64),
    variant("flash_fwd_d128_w8_m2_bc32_q0_mb1", 128, 8, 2, 32),
    variant("flash_fwd_d128_w4_m2_bc32_q0_mb2", 128, 4, 2, 32),
    variant("flash_fwd_d128_w8_m2_bc32_q1_mb1", 128, 8, 2, 32),
    variant("flash_fwd_d128_w8_m1_bc128_q1_mb1", 128, 8, 1, 128),
    variant("flash_fwd_d128_w8_m1_bc64_q1_mb1", 128, 8, 1, 64),
    variant("flash_fwd_d64_w4_m2_bc64_q1_mb2", 64, 4, 2, 64),
    variant("flash_fwd_d64_w8_m2_bc64_q1_mb1", 64, 8, 2, 64),
    variant("flash_fwd_d64_w4_m1_bc64_q1_mb2", 64, 4, 1, 64),
];

/// The variant `Auto` runs at `head_dim`, if any: the fastest measured on the H200 (bench/RESULTS.md,
/// 2026-11-30): at D = 128, 8 warps × 32 rows (Br 256), Bc 64, Q reloaded from shared memory
/// (361–376 TFLOP/s at the DiT shapes, vs 281–352 for the others); at D = 64, 4 warps × 32 rows, Bc 64,
/// Q in registers.
pub fn default_flash_variant(head_dim: usize) -> Option<usize> {
    let name = match head_dim {
        128 => "flash_fwd_d128_w8_m2_bc64_q0_mb1",
        64 => "flash_fwd_d64_w4_m2_bc64_q1_mb2",
        _ => return None,
    };
    FLASH_VARIANTS.iter().position(|v| v.name == name)
}

thread_local! {
    static CHOICE: Cell<AttentionKernel> = const { Cell::new(AttentionKernel::Auto) };
}

/// The choice in force on this thread.
pub fn attention_kernel() -> AttentionKernel {
    CHOICE.with(Cell::get)
}

/// Runs `f` with CUDA attention calls made on this thread forced to `kernel`; the previous choice is
/// restored afterwards (also when `f` panics).
pub fn with_attention_kernel<T>(kernel: AttentionKernel, f: impl FnOnce() -> T) -> T {
    struct Restore(AttentionKernel);
    impl Drop for Restore {
        fn drop(&mut self) {
            CHOICE.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CHOICE.with(|c| c.replace(kernel)));
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_are_consistent() {
        for v in FLASH_VARIANTS {
            let expect = format!(
                "_d{}_w{}_m{}_bc{}_",
                v.head_dim, v.warps, v.m_tiles, v.block_k
            );
            assert!(v.name.contains(&expect), "{}", v.name);
            assert!(v.shared_bytes() <= 227 * 1024);
        }
        assert!(default_flash_variant(128).is_some());
        assert!(default_flash_variant(64).is_some());
        assert!(default_flash_variant(96).is_none());
    }

    #[test]
    fn choice_is_scoped() {
        assert_eq!(attention_kernel(), AttentionKernel::Auto);
        let inner = with_attention_kernel(AttentionKernel::Portable, attention_kernel);
        assert_eq!(inner, AttentionKernel::Portable);
        assert_eq!(attention_kernel(), AttentionKernel::Auto);
    }
}
