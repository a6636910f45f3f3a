//! Which path CUDA convolutions ([`conv3d`](crate::conv3d), [`causal_conv3d`](crate::causal_conv3d),
//! [`conv2d`](crate::conv2d)) take: cuDNN or our im2col + cuBLASLt GEMM (`ops/conv/cuda.rs`). By default
//! [`ConvAlgo::Auto`], which runs [`AUTO_CONV_ALGO`] where it applies; tests and `bench/src/bin/conv.rs`
//! force one path for the calls made inside [`with_conv_algo`].

use std::cell::Cell;

/// A CUDA convolution path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ConvAlgo {
    /// [`AUTO_CONV_ALGO`] where it applies; im2col where cuDNN cannot be loaded (warned once per device)
    /// or cannot take the call (sizes beyond its 32-bit descriptors). The default.
    #[default]
    Auto,
    /// im2col + one cuBLASLt GEMM per block of output pixels (any size; no extra library).
    Im2col,
    /// cuDNN (`cudnnConvolutionForward`, algorithm measured per shape); an error naming libcudnn where it
    /// cannot be loaded.
    Cudnn,
}

/// What [`ConvAlgo::Auto`] runs. cuDNN until `scripts/gpu-conv.sh` has measured both paths on the VAE's
/// shapes (bench/RESULTS.md); set it to the faster one then (`Im2col` or `Cudnn`; `Auto` reads as `Cudnn`).
pub const AUTO_CONV_ALGO: ConvAlgo = ConvAlgo::Cudnn;

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
            let nested = with_conv_algo(ConvAlgo::Cudnn, conv_algo);
            (nested, conv_algo())
        });
        assert_eq!(inner, (ConvAlgo::Cudnn, ConvAlgo::Im2col));
        assert_eq!(conv_algo(), ConvAlgo::Auto);
        let caught = std::panic::catch_unwind(|| with_conv_algo(ConvAlgo::Im2col, || panic!("x")));
        assert!(caught.is_err());
        assert_eq!(conv_algo(), ConvAlgo::Auto);
    }
}
