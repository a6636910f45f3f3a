//! Flow-matching samplers, diffusers-exact: the schedule of sigmas and model timesteps, and the
//! per-step update of the latent from the model's velocity prediction. Also the CFG combine.
//!
//! Every update is a linear combination of a few latent-sized buffers with scalar coefficients.
//! The scalars are computed here once per step in f64; the element-wise work is [`lincomb`], which
//! a device backend can replace with one fused kernel given the same coefficients.

mod euler;
mod unipc;

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
    /// Buffers of different lengths.
    #[error("latent has {latent} values but the model output has {output}")]
    Length {
        /// Latent length.
        latent: usize,
        /// Model output length.
        output: usize,
    },
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
    /// Advances `latent` in place by one step, given the model's velocity `v` at the current step.
    fn step(&mut self, v: &[f32], latent: &mut [f32]) -> Result<(), SamplerError>;
}

/// `out[i] = Σ_j coef_j · src_j[i]`, accumulated in f32 in the order given. All sources and `out`
/// have the same length (checked by the callers).
pub fn lincomb(out: &mut [f32], terms: &[(f64, &[f32])]) {
    for (i, o) in out.iter_mut().enumerate() {
        let mut acc = 0.0f32;
        for (coef, src) in terms {
            acc += *coef as f32 * src[i];
        }
        *o = acc;
    }
}

/// Classifier-free guidance, in place on the conditional prediction:
/// `cond ← uncond + g·(cond − uncond)`. Diffusers skips the unconditional pass when g ≤ 1, so
/// callers only combine when g > 1.
pub fn cfg_combine(cond: &mut [f32], uncond: &[f32], guidance_scale: f64) {
    let g = guidance_scale as f32;
    for (c, u) in cond.iter_mut().zip(uncond) {
        *c = u + g * (*c - u);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cfg_combine_matches_the_formula() {
        let mut c = vec![1.0, -2.0, 0.5];
        cfg_combine(&mut c, &[0.0, 1.0, 0.5], 5.0);
        assert_eq!(c, vec![5.0, -14.0, 0.5]);
    }

    #[test]
    fn lincomb_sums_terms() {
        let mut out = vec![0.0; 2];
        lincomb(&mut out, &[(2.0, &[1.0, 2.0]), (-1.0, &[0.5, 4.0])]);
        assert_eq!(out, vec![1.5, 0.0]);
    }
}
