//! Tensor type and the ops the Wan DiT and VAE need.
//!
//! - [`Tensor`]: a shape, a [`DType`] (f32 or bf16 storage) and a [`Device`]; always contiguous,
//!   row-major. Layout changes (`permute`, `narrow`, `concat`, `split`) produce contiguous copies;
//!   `reshape` of contiguous data is free.
//! - [`ops`]: every op the models call, one folder each. An op's `mod.rs` checks shapes and dispatches on
//!   the device; its `cpu.rs` is the f32 reference, written to be read. The CUDA backend slots in as a
//!   second arm of each dispatch: with feature `cuda` its `cuda.rs` (and `<op>.cu`), else
//!   [`KernelError::UnsupportedDevice`].
//! - `cuda` (feature `cuda`): the GPU backend's device layer: contexts, the per-device stream, NVRTC
//!   compilation with a CUBIN cache, cuBLASLt plans, device storage.
//! - [`timeline`]: per-op times inside a real run (CUDA events between the ops a model marks).
//! - [`weights`]: checkpoints (safetensors, sharded or not) and seeded random weights, by name.
//! - `testing` (feature `testing`): approximate-equality helpers and the GPU-count gate shared by
//!   the tests here and in the model crates.
//!
//! Dtype rule for every op: maths runs in f32; the output takes the dtype of the op's first (primary)
//! input; secondary inputs (weights, modulation, gates) may be f32 or bf16 independently. LSE is always f32.

#[cfg(feature = "cuda")]
pub mod cuda;
mod device;
mod error;
pub mod ops;
mod rng;
mod tensor;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod timeline;
pub mod weights;

pub use device::{DType, Device};
pub use error::{KernelError, Result};
pub use ops::*;
pub use tensor::Tensor;
