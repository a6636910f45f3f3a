//! The reference draw: `rng::normal_at` per element, then the affine map in f32.

use crate::rng::normal_at;

/// `n` values `normal_at(seed, i) · std + mean` (the order of `affine(randn)`'s operations).
pub(crate) fn random_normal(n: usize, mean: f32, std: f32, seed: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| normal_at(seed, i) * std + mean)
        .collect()
}
