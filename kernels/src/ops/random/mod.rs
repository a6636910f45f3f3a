//! Seeded normal samples drawn where the tensor lives: the same counter-based stream as
//! [`Tensor::randn`] (element i depends only on (seed, i), see `rng.rs`), scaled and shifted, generated
//! by a kernel on a GPU. `Tensor::randn` draws on the host and uploads, ~20 ns an element on one core:
//! fine for inputs, minutes for the 5.7 B parameters of a random-weight umT5-XXL, which this draws in
//! well under a second on an H200.

pub(crate) mod cpu;
#[cfg(feature = "cuda")]
pub(super) mod cuda;
#[cfg(test)]
mod tests;

#[cfg(not(feature = "cuda"))]
use super::unsupported;
use crate::{DType, Device, Result, Tensor};

/// `mean + std · n_i` per element, n_i the i-th standard normal of stream `seed` (the values of
/// `Tensor::randn(shape, F32, seed, _)`), computed in f32 and stored in `dtype` on `device`: on the CPU
/// bit for bit `affine(&Tensor::randn(shape, F32, seed, Cpu), std, mean)` cast to `dtype`; on a GPU
/// the same up to the last bit of the f64 logarithm and cosine (see `tests.rs`).
pub fn random_normal(
    shape: &[usize],
    mean: f32,
    std: f32,
    dtype: DType,
    seed: u64,
    device: Device,
) -> Result<Tensor> {
    match device {
        Device::Cpu => {
            let numel = shape.iter().product();
            Tensor::from_f32_cpu(cpu::random_normal(numel, mean, std, seed), shape, dtype)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => cuda::random_normal(shape, mean, std, dtype, seed, ordinal),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => unsupported("random_normal", device),
    }
}
