//! Flow-matching samplers, diffusers-exact: the schedule of sigmas and model timesteps, and the
//! per-step update of the latent from the model's velocity prediction. Also the CFG combine.
//!
//! Every update is a linear combination of a few latent-sized tensors with scalar coefficients.
//! The scalars are computed here once per step in f64; the element-wise work is [`lincomb`] on
//! f32 tensors where the latent lives, so on a GPU the latent never leaves it between steps.
//! Each product and each sum rounds once in f32 (no fused multiply-add: separate `scale`, `add`
//! and `sub` ops), on every device, so a GPU takes the CPU's steps with the CPU's roundings (up to
//! the sign of a zero).

mod euler;
mod unipc;

use ditstream_kernels::{DType, KernelError, Tensor, add, scale, sub};

pub use euler::FlowEuler;
pub use unipc::FlowUniPc;

/// A sampler's errors.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SamplerError {
    /// Zero steps, or more than the training horizon.
    #[error("steps = {0}: must be in 1..=1000")]
    Steps(usize),
    /// The flow shift must be positive and finite.
    #[error("shift = {0}: must be a positive number")]
    Shift(f64),
    /// `step` was called after the last step.
    #[error("step {step} of {steps}: the schedule is finished")]
    Finished {
        /// The step asked for.
        step: usize,
        /// Steps in the schedule.
        steps: usize,
    },
    /// The model output's shape is not the latent's.
    #[error("latent has shape {latent:?} but the model output has shape {output:?}")]
    Shape {
        /// Latent shape.
        latent: Vec<usize>,
        /// Model output shape.
        output: Vec<usize>,
    },
    /// An element-wise op failed (e.g. the tensors are on different devices).
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

/// Diffusers' training horizon: model timesteps are σ·1000.
pub const NUM_TRAIN_TIMESTEPS: f64 = 1000.0;

/// The shifted flow sigma `S·s / (1 + (S−1)·s)`.
pub fn shift_sigma(shift: f64, s: f64) -> f64 {
    shift * s / (1.0 + (shift - 1.0) * s)
}

/// A flow-matching sampler: the schedule, then one `step` per model evaluation.
pub trait Sampler: Send {
    /// Steps in the schedule.
    fn steps(&self) -> usize;
    /// The timestep the model is conditioned on at step `k` (diffusers' `scheduler.timesteps[k]`).
    fn timestep(&self, k: usize) -> f64;
    /// σ at step `k` (`k = steps()` gives the final 0).
    fn sigma(&self, k: usize) -> f64;
    /// Steps done so far.
    fn step_index(&self) -> usize;
    /// The latent one step on (f32, on the latent's device), given the model's velocity `v` at
    /// the current step (the latent's shape and device; converted to f32 if it is not).
    fn step(&mut self, v: &Tensor, latent: &Tensor) -> Result<Tensor, SamplerError>;
}

/// The sampler's checks on a step's operands: `v` in f32, of the latent's shape.
fn velocity(v: &Tensor, latent: &Tensor) -> Result<Tensor, SamplerError> {
    if v.shape() != latent.shape() {
        return Err(SamplerError::Shape {
            latent: latent.shape().to_vec(),
            output: v.shape().to_vec(),
        });
    }
    Ok(v.to_dtype(DType::F32)?)
}

/// `Σ_j coef_j · src_j` element-wise over `first` then `rest`, accumulated in f32 in that order
/// (the coefficients rounded to f32 first), on the sources' device. All sources are f32 of one
/// shape.
pub fn lincomb(first: (f64, &Tensor), rest: &[(f64, &Tensor)]) -> Result<Tensor, SamplerError> {
    let mut acc = scale(first.1, first.0 as f32)?;
    for (coef, src) in rest {
        acc = add(&acc, &scale(src, *coef as f32)?)?;
    }
    Ok(acc)
}

/// Classifier-free guidance: `uncond + g·(cond − uncond)` (diffusers' order of operations), f32
/// tensors of one shape. Diffusers skips the unconditional pass when g ≤ 1, so callers only
/// combine when g > 1.
pub fn cfg_combine(
    cond: &Tensor,
    uncond: &Tensor,
    guidance_scale: f64,
) -> Result<Tensor, SamplerError> {
    Ok(add(
        uncond,
        &scale(&sub(cond, uncond)?, guidance_scale as f32)?,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f32]) -> Tensor {
        Tensor::from_vec(v.to_vec(), &[v.len()]).unwrap()
    }

    #[test]
    fn cfg_combine_matches_the_formula() {
        let c = cfg_combine(&t(&[1.0, -2.0, 0.5]), &t(&[0.0, 1.0, 0.5]), 5.0).unwrap();
        assert_eq!(c.to_vec_f32().unwrap(), vec![5.0, -14.0, 0.5]);
    }

    #[test]
    fn lincomb_sums_terms_in_order_rounding_each_step() {
        let out = lincomb((2.0, &t(&[1.0, 2.0])), &[(-1.0, &t(&[0.5, 4.0]))]).unwrap();
        assert_eq!(out.to_vec_f32().unwrap(), vec![1.5, 0.0]);
        // 1 + 2⁻²⁴ rounds to 1 before −1 is added: the host loop's order and roundings, not a
        // fused or reordered sum (which would give 2⁻²⁴).
        let tiny = 2f32.powi(-24);
        let out = lincomb((1.0, &t(&[1.0])), &[(1.0, &t(&[tiny])), (-1.0, &t(&[1.0]))]).unwrap();
        assert_eq!(out.to_vec_f32().unwrap(), vec![0.0]);
    }
}
