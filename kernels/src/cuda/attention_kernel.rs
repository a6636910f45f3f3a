//! Which kernel CUDA [`attention`](crate::attention) runs: by default chosen automatically (the Hopper
//! wgmma kernel of `ops/attention/hopper.cu` for bf16 at head dim 128 with scale > 0 on sm_90a; else
//! the tensor-core FlashAttention-2-class kernel of `ops/attention/flash.cu` for bf16 at head dim 64,
//! 128, 256, 384 or 512 with scale > 0 on sm_80+; else the portable f32 CUDA-core kernel); tests and
//! benchmarks can force one for the calls made inside [`with_attention_kernel`].

use std::cell::Cell;

/// A CUDA attention kernel choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionKernel {
    /// The fastest applicable kernel (the default).
    #[default]
    Auto,
    /// The portable kernel (any dtype and head dim ≤ 512; f32 CUDA-core maths).
    Portable,
    /// The tensor-core kernel, variant `FLASH_VARIANTS[i]` (an error if it does not apply to the call).
    Flash(usize),
    /// The Hopper kernel, variant `HOPPER_VARIANTS[i]` (wgmma, bf16, head dim 128, sm_90a only; an
    /// error if it does not apply to the call).
    Hopper(usize),
    /// For [`attention_fp8`](crate::attention_fp8) calls: the FP8 Hopper kernel, variant
    /// `HOPPER_FP8_VARIANTS[i]` (`attention` calls ignore it and run `Auto`'s choice; every other
    /// choice leaves `attention_fp8` on its default variant).
    HopperFp8(usize),
}

/// One compiled configuration of the Hopper kernel (`hopper_fwd_d128_br128_bc128_s{STAGES}` or
/// `hopper_ws_fwd_d128_br128_bc128_s{STAGES}` in `ops/attention/hopper.cu`): 2 consumer warpgroups × 64
/// query rows, 128 keys per K/V block, `stages` K/V buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HopperVariant {
    /// Kernel name in hopper.cu (also its label in tests and benchmarks).
    pub name: &'static str,
    /// K/V stages. cp.async kernels: 2 waits for P·V in its own iteration, 3 leaves it in flight into
    /// the next one. Warp-specialised kernels: the depth of the TMA rings.
    pub stages: usize,
    /// The warp-specialised kernel (`hopper_ws_*`: a TMA producer warpgroup, two consumer warpgroups
    /// taking turns, 384 threads, Q/K/V as tensor maps) rather than the cp.async one (256 threads).
    pub warp_specialised: bool,
    /// Keys per K/V block: 128, or 176 (FlashAttention-3's choice at head dim 128) or 192
    /// (warp-specialised only).
    pub block_k: usize,
    /// Warp-specialised only: launched persistent, one CTA per SM taking work items in turn (its
    /// producer loads the next item's Q and K/V under the current one's last blocks), rather than one
    /// CTA per item. The same kernel either way; this is the launch.
    pub persistent: bool,
}

impl HopperVariant {
    /// Its label in tests and benchmarks: the kernel's name, with `_persistent` for that launch.
    pub fn label(&self) -> String {
        let launch = if self.persistent { "_persistent" } else { "" };
        format!("{}{launch}", self.name)
    }

    /// Dynamic shared memory: Q [128 × 128] and `stages` × (K, V) [block_k × 128], bf16, plus 1 KiB the
    /// kernel uses to round its base up to the 1024-byte boundary the swizzled wgmma operands need.
    pub fn shared_bytes(&self) -> usize {
        (128 + 2 * self.stages * self.block_k) * 128 * 2 + 1024
    }
}

/// Every compiled Hopper variant (keep in step with the `HOPPER_KERNEL(...)` list at the end of
/// hopper.cu).
pub const HOPPER_VARIANTS: &[HopperVariant] = &[
    HopperVariant {
        name: "hopper_fwd_d128_br128_bc128_s2",
        stages: 2,
        warp_specialised: false,
        block_k: 128,
        persistent: false,
    },
    HopperVariant {
        name: "hopper_fwd_d128_br128_bc128_s3",
        stages: 3,
        warp_specialised: false,
        block_k: 128,
        persistent: false,
    },
    HopperVariant {
        name: "hopper_ws_fwd_d128_br128_bc128_s2",
        stages: 2,
        warp_specialised: true,
        block_k: 128,
        persistent: false,
    },
    HopperVariant {
        name: "hopper_ws_fwd_d128_br128_bc128_s3",
        stages: 3,
        warp_specialised: true,
        block_k: 128,
        persistent: false,
    },
    HopperVariant {
        name: "hopper_ws_fwd_d128_br128_bc176_s2",
        stages: 2,
        warp_specialised: true,
        block_k: 176,
        persistent: false,
    },
    HopperVariant {
        name: "hopper_ws_fwd_d128_br128_bc192_s2",
        stages: 2,
        warp_specialised: true,
        block_k: 192,
        persistent: false,
    },
    HopperVariant {
        name: "hopper_ws_fwd_d128_br128_bc128_s2",
        stages: 2,
        warp_specialised: true,
        block_k: 128,
        persistent: true,
    },
    HopperVariant {
        name: "hopper_ws_fwd_d128_br128_bc128_s3",
        stages: 3,
        warp_specialised: true,
        block_k: 128,
        persistent: true,
    },
    HopperVariant {
        name: "hopper_ws_fwd_d128_br128_bc192_s2",
        stages: 2,
        warp_specialised: true,
        block_k: 192,
        persistent: true,
    },
];

/// Keys per K/V block of every FP8 Hopper variant: also the online softmax's step, which the CPU
/// reference takes the same (`crate::attention_fp8_reference`), and K's scale block.
pub const HOPPER_FP8_KEYS: usize = 128;

/// One compiled configuration of the FP8 Hopper kernel
/// (`hopper_fp8_fwd_d128_br128_bc128_s{STAGES}_win{WINDOW}`, namespace `fp8` of
/// `ops/attention/hopper.cu`): the warp-specialised layout with e4m3 Q tiles of [128 × 128] bytes,
/// K/V blocks of `HOPPER_FP8_KEYS`, `stages` deep K and Vᵀ rings, and two-level accumulation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HopperFp8Variant {
    /// Kernel name in hopper.cu.
    pub name: &'static str,
    /// K and Vᵀ stages.
    pub stages: usize,
    /// Blocks whose P·V and row sums the tensor cores accumulate from zero before the ALU adds
    /// them into an f32 O, so that no tensor-core accumulator grows over the key run (hopper.cu's
    /// namespace `fp8` says why).
    pub window: usize,
    /// Each block's exponentials taken at the offsets as they stand, before its row max, and a
    /// warp's rows put right alone when a score passed its offset (`_spec`; hopper.cu's
    /// `spec_softmax` says why that is rare, `fix_rows` how).
    pub speculative: bool,
    /// A sparse last wave split along the keys as the bf16 kernel splits it (hopper.rs's
    /// `schedule`: each chunk its own softmax, merged by LSE; the reference takes the same chunks,
    /// [`crate::Fp8KeySplit`]), rather than every tile whole (`_whole`). The same kernel either way;
    /// this is the launch.
    pub split: bool,
}

impl HopperFp8Variant {
    /// Its label in tests and benchmarks: the kernel's name, with `_whole` for that launch.
    pub fn label(&self) -> String {
        let launch = if self.split { "" } else { "_whole" };
        format!("{}{launch}", self.name)
    }

    /// Dynamic shared memory: Q (16 KiB), `stages` K stages of 16 KiB and as many Vᵀ stages of 17
    /// (the block, then 8 rows of ones: hopper.cu's `VSTAGE`), with `_spec` 64 KiB of scratch for
    /// `fix_rows`' S (64 words per consumer thread), plus 1 KiB of alignment slack.
    pub fn shared_bytes(&self) -> usize {
        let tile = HOPPER_FP8_KEYS * 128;
        let scratch = if self.speculative { 64 * 1024 } else { 0 };
        tile + self.stages * (2 * tile + 1024) + scratch + 1024
    }
}

/// Every compiled FP8 Hopper variant (keep in step with `HOPPER_FP8_KERNEL(...)` in hopper.cu), the
/// default first (`ops/quant/cuda.rs` says why it is).
pub const HOPPER_FP8_VARIANTS: &[HopperFp8Variant] = &[
    HopperFp8Variant {
        name: "hopper_fp8_fwd_d128_br128_bc128_s3_win3_spec",
        stages: 3,
        window: 3,
        speculative: true,
        split: true,
    },
    HopperFp8Variant {
        name: "hopper_fp8_fwd_d128_br128_bc128_s3_win3_spec",
        stages: 3,
        window: 3,
        speculative: true,
        split: false,
    },
    HopperFp8Variant {
        name: "hopper_fp8_fwd_d128_br128_bc128_s3_win2_spec",
        stages: 3,
        window: 2,
        speculative: true,
        split: true,
    },
    HopperFp8Variant {
        name: "hopper_fp8_fwd_d128_br128_bc128_s3_win2",
        stages: 3,
        window: 2,
        speculative: false,
        split: true,
    },
    HopperFp8Variant {
        name: "hopper_fp8_fwd_d128_br128_bc128_s3_win1",
        stages: 3,
        window: 1,
        speculative: false,
        split: true,
    },
];

/// One compiled tile configuration of the tensor-core kernel
/// (`flash_fwd_d{D}_w{W}_m{MT}_bc{BC}_q{QREG}_mb{MIN_BLOCKS}`, or `flash_fwd_d{D}_v{DV}_w…` when a block
/// computes only DV of the D output columns).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlashVariant {
    /// Kernel name in flash.cu.
    pub name: &'static str,
    /// Head dim it is built for.
    pub head_dim: usize,
    /// Output columns per block (DV): `head_dim`, or a slice of it for wide heads, whose D/DV blocks
    /// per head each recompute Q·Kᵀ (flash.cu's header says why).
    pub value_cols: usize,
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

    /// Blocks per (batch, head) along the head dim: D / DV.
    pub fn slices(&self) -> usize {
        self.head_dim / self.value_cols
    }

    /// Dynamic shared memory: Q [BR × D], two stages of K [BC × D] and of V's slice [BC × DV], bf16.
    pub fn shared_bytes(&self) -> usize {
        (self.block_q() + 2 * self.block_k) * self.head_dim * 2
            + 2 * self.block_k * self.value_cols * 2
    }
}

const fn variant(
    name: &'static str,
    head_dim: usize,
    warps: u32,
    m_tiles: usize,
    block_k: usize,
) -> FlashVariant {
    sliced(name, head_dim, head_dim, warps, m_tiles, block_k)
}

const fn sliced(
    name: &'static str,
    head_dim: usize,
    value_cols: usize,
    warps: u32,
    m_tiles: usize,
    block_k: usize,
) -> FlashVariant {
    FlashVariant {
        name,
        head_dim,
        value_cols,
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
    sliced("flash_fwd_d256_v128_w4_m2_bc32_q0_mb1", 256, 128, 4, 2, 32),
    sliced("flash_fwd_d384_v128_w4_m2_bc32_q0_mb1", 384, 128, 4, 2, 32),
    sliced("flash_fwd_d384_v128_w8_m1_bc64_q0_mb1", 384, 128, 8, 1, 64),
    sliced("flash_fwd_d512_v128_w8_m1_bc32_q0_mb1", 512, 128, 8, 1, 32),
];

/// The variant `Auto` runs at `head_dim`, if any: the fastest measured on the H200 (bench/RESULTS.md,
/// 2026-11-30): at D = 128, 8 warps × 32 rows (Br 256), Bc 64, Q reloaded from shared memory
/// (361–376 TFLOP/s at the DiT shapes, vs 281–352 for the others); at D = 64, 4 warps × 32 rows, Bc 64,
/// Q in registers. At D = 256, 384, 512 output-sliced variants, 128 output columns per block, Q
/// reloaded from shared memory. At 384 (the Wan VAE's mid-block head) the measured choice: 8 warps × 16
/// rows, Bc 64, 80.4 TFLOP/s on a 480p frame (6,240 tokens) against 62.5 for 4 warps × 32 rows, Bc 32
/// (bench/RESULTS.md, VAE section). At 256 and 512 (not timed yet) the ones with no register spills
/// (ptxas) and the fewest shared-memory loads per MMA: 4 warps × 32 rows, Bc 32 at 256; 8 warps × 16
/// rows, Bc 32 at 512, the only one that compiles without spills.
pub fn default_flash_variant(head_dim: usize) -> Option<usize> {
    let name = match head_dim {
        128 => "flash_fwd_d128_w8_m2_bc64_q0_mb1",
        64 => "flash_fwd_d64_w4_m2_bc64_q1_mb2",
        256 => "flash_fwd_d256_v128_w4_m2_bc32_q0_mb1",
        384 => "flash_fwd_d384_v128_w8_m1_bc64_q0_mb1",
        512 => "flash_fwd_d512_v128_w8_m1_bc32_q0_mb1",
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
            let slice = if v.value_cols == v.head_dim {
                String::new()
            } else {
                format!("_v{}", v.value_cols)
            };
            let expect = format!(
                "_d{}{slice}_w{}_m{}_bc{}_",
                v.head_dim, v.warps, v.m_tiles, v.block_k
            );
            assert!(v.name.contains(&expect), "{}", v.name);
            assert!(v.shared_bytes() <= 227 * 1024, "{}", v.name);
            assert_eq!(v.slices() * v.value_cols, v.head_dim, "{}", v.name);
        }
        for d in [64, 128, 256, 384, 512] {
            let v = default_flash_variant(d).map(|i| FLASH_VARIANTS[i].head_dim);
            assert_eq!(v, Some(d));
        }
        assert!(default_flash_variant(96).is_none());
        for v in HOPPER_FP8_VARIANTS {
            let spec = if v.speculative { "_spec" } else { "" };
            let tail = format!("_bc{HOPPER_FP8_KEYS}_s{}_win{}{spec}", v.stages, v.window);
            assert!(v.name.ends_with(&tail), "{}", v.name);
            assert!((1..=4).contains(&v.window), "{}", v.name);
            assert!(v.shared_bytes() <= 227 * 1024, "{}", v.name);
        }
        for v in HOPPER_VARIANTS {
            assert!(v.name.ends_with(&format!("_s{}", v.stages)), "{}", v.name);
            assert!(v.name.contains(&format!("_bc{}_", v.block_k)), "{}", v.name);
            assert!(v.block_k == 128 || v.warp_specialised, "{}", v.name);
            assert!(!v.persistent || v.warp_specialised, "{}", v.name);
            assert_eq!(
                v.name.starts_with("hopper_ws_"),
                v.warp_specialised,
                "{}",
                v.name
            );
            // 227 KiB is the most dynamic shared memory an sm_90 block may opt into.
            assert!(v.shared_bytes() <= 227 * 1024, "{}", v.name);
        }
    }

    #[test]
    fn choice_is_scoped() {
        assert_eq!(attention_kernel(), AttentionKernel::Auto);
        let inner = with_attention_kernel(AttentionKernel::Portable, attention_kernel);
        assert_eq!(inner, AttentionKernel::Portable);
        assert_eq!(attention_kernel(), AttentionKernel::Auto);
    }
}
