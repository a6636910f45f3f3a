//! Which path CUDA convolutions ([`conv3d`](crate::conv3d), [`causal_conv3d`](crate::causal_conv3d),
//! [`conv2d`](crate::conv2d)) take: our im2col + cuBLASLt GEMM, or cuDNN on our NCDHW tensors, or cuDNN
//! on a channels-last copy (`ops/conv/cuda.rs` has all three). By default [`ConvAlgo::Auto`], which
//! routes each call by its kernel ([`auto_conv_algo`]); tests and `bench/src/bin/conv.rs` force one path
//! for the calls made inside [`with_conv_algo`].

use std::cell::Cell;

/// A CUDA convolution path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ConvAlgo {
    /// [`auto_conv_algo`]'s choice per call; im2col where cuDNN cannot be loaded (warned once per
    /// device) or cannot take the call (sizes beyond its 32-bit descriptors). The default.
    #[default]
    Auto,
    /// im2col + one cuBLASLt GEMM per block of output pixels (any size; no extra library). A 1×1×1
    /// kernel without padding, stride or cache skips im2col: the input already is the GEMM operand.
    Im2col,
    /// cuDNN (`cudnnConvolutionForward`, algorithm measured per shape) on our NCDHW tensors, the causal
    /// frame join done by one copy; an error naming libcudnn where it cannot be loaded.
    Cudnn,
    /// cuDNN on channels-last (NDHWC) data: one kernel writes the frame join (zero frames, cached
    /// frames, x) transposed to NDHWC, cuDNN convolves with a channels-last filter (cached per weight
    /// tensor), and one kernel transposes the result back to NCDHW adding the bias. The tensors stay
    /// NCDHW; an error naming libcudnn where it cannot be loaded.
    CudnnNdhwc,
}

/// What [`ConvAlgo::Auto`] runs for a kernel of more than one tap, or with padding: cuDNN on a
/// channels-last copy. Measured 2026-11-30 on an H200 (`bench/src/bin/conv.rs`, bf16, one steady-state
/// 480p decode chunk of the Wan 2.1 VAE, TFLOP/s; columns: im2col, cuDNN on NCDHW incl. the frame join,
/// cuDNN on NDHWC tensors (the convolution alone, `conv3d_channels_last`), torch `F.conv3d` NCDHW):
/// ```text
/// post_quant 1x1x1 16>16 60x104 T1+0         0.2     0.1     0.0     0.1
/// conv_in 3x3x3 16>384 60x104 T1+2          39.2    16.0    35.0    40.6
/// mid+up0 3x3x3 384>384 60x104 T1+2  (x10)  60.4   305.5   388.9   394.1
/// attn.qkv 1x1x1 384>1152 60x104 T1+0      126.1    24.7    23.6   153.2
/// attn.proj 1x1x1 384>384 60x104 T1+0       84.8    15.3     7.2    51.9
/// up0.time 3x1x1 384>768 60x104 T1+2        88.6    87.0   126.2   136.7
/// up0.resample 1x3x3 384>192 120x208 T2+0   27.5   311.1   416.5   318.8
/// up1.conv1 3x3x3 192>384 120x208 T2+2      49.4   455.0   581.8   486.3
/// up1.shortcut 1x1x1 192>384 120x208 T2+0   76.5    62.2    59.5   103.0
/// up1 3x3x3 384>384 120x208 T2+2  (x5)      36.3   507.9   618.2   568.3
/// up1.time 3x1x1 384>768 120x208 T2+2       94.9   237.8   474.8   230.3
/// up1.resample 1x3x3 384>192 240x416 T4+0   27.9   375.6   538.9   348.4
/// up2 3x3x3 192>192 240x416 T4+2  (x6)      27.3   440.8   565.8   437.0
/// up2.resample 1x3x3 192>96 480x832 T4+0    15.8    20.5   499.7   243.9
/// up3 3x3x3 96>96 480x832 T4+2  (x6)        14.0    20.7   272.6   267.2
/// conv_out 3x3x3 96>3 480x832 T4+2           0.5    14.3    23.4    16.3
/// TOTAL per chunk, ms                     690.56  277.89   35.18   40.03
/// ```
/// cuDNN's legacy NCDHW algorithms collapse at 96 channels at full resolution (20 TFLOP/s, 76 % of a
/// whole 480p decode), while on NDHWC data every kernel with more than one tap is at or above torch.
/// What the routed path pays on top (the two transposes) is the `auto` column of the same bench.
pub const AUTO_CONV_ALGO: ConvAlgo = ConvAlgo::CudnnNdhwc;

/// What [`ConvAlgo::Auto`] runs for a 1×1×1 kernel without padding: im2col, whose direct GEMM (no
/// im2col pass) beats cuDNN in either layout on every pointwise conv of the table at
/// [`AUTO_CONV_ALGO`] (attn.qkv 126 vs 25 TFLOP/s, attn.proj 85 vs 15, up1.shortcut 77 vs 62).
pub const AUTO_POINTWISE_CONV_ALGO: ConvAlgo = ConvAlgo::Im2col;

/// The path [`ConvAlgo::Auto`] asks for, by kernel [kt, kh, kw] and whether any axis is padded:
/// [`AUTO_POINTWISE_CONV_ALGO`] for an unpadded 1×1×1 kernel, else [`AUTO_CONV_ALGO`]. (A cuDNN path
/// still falls back to im2col where cuDNN cannot take the call.)
pub fn auto_conv_algo(kernel: [usize; 3], padded: bool) -> ConvAlgo {
    if kernel == [1, 1, 1] && !padded {
        AUTO_POINTWISE_CONV_ALGO
    } else {
        AUTO_CONV_ALGO
    }
}

thread_local! {
    static CHOICE: Cell<ConvAlgo> = const { Cell::new(ConvAlgo::Auto) };
}

/// The choice in force on this thread.
pub fn conv_algo() -> ConvAlgo {
    CHOICE.with(Cell::get)
}

/// Runs `f` with CUDA convolutions made on this thread forced to `algo`; the previous choice is restored
/// afterwards (also when `f` panics).
pub fn with_conv_algo<T>(algo: ConvAlgo, f: impl FnOnce() -> T) -> T {
    struct Restore(ConvAlgo);
    impl Drop for Restore {
        fn drop(&mut self) {
            CHOICE.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CHOICE.with(|c| c.replace(algo)));
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choice_is_scoped() {
        assert_eq!(conv_algo(), ConvAlgo::Auto);
        let inner = with_conv_algo(ConvAlgo::Im2col, || {
            let nested = with_conv_algo(ConvAlgo::CudnnNdhwc, conv_algo);
            (nested, conv_algo())
        });
        assert_eq!(inner, (ConvAlgo::CudnnNdhwc, ConvAlgo::Im2col));
        assert_eq!(conv_algo(), ConvAlgo::Auto);
        let caught = std::panic::catch_unwind(|| with_conv_algo(ConvAlgo::Im2col, || panic!("x")));
        assert!(caught.is_err());
        assert_eq!(conv_algo(), ConvAlgo::Auto);
    }

    #[test]
    fn auto_routes_by_kernel() {
        // The VAE's kernels: only the unpadded pointwise ones go to im2col.
        assert_eq!(auto_conv_algo([1, 1, 1], false), ConvAlgo::Im2col);
        for kernel in [[3, 3, 3], [3, 1, 1], [1, 3, 3], [1, 2, 2]] {
            assert_eq!(auto_conv_algo(kernel, true), ConvAlgo::CudnnNdhwc);
            assert_eq!(auto_conv_algo(kernel, false), ConvAlgo::CudnnNdhwc);
        }
        assert_eq!(auto_conv_algo([1, 1, 1], true), ConvAlgo::CudnnNdhwc);
    }
}
