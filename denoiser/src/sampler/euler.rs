//! Flow-matching Euler (diffusers `FlowMatchEulerDiscreteScheduler` with a static shift):
//! `x ← x + (σ_{k+1} − σ_k)·v`.

use ditstream_kernels::{Tensor, add, scale};

use super::{NUM_TRAIN_TIMESTEPS, Sampler, SamplerError, shift_sigma, velocity};

/// Flow-matching Euler sampler.
#[derive(Debug, Clone)]
pub struct FlowEuler {
    /// σ_0..σ_N in f32 as diffusers stores them (σ_N = 0).
    sigmas: Vec<f32>,
    step: usize,
}

impl FlowEuler {
    /// The schedule for `steps` steps at flow shift `shift`.
    ///
    /// Diffusers builds σ_min from its 1000-step training table (already shifted, in f32), spaces
    /// the timesteps linearly from σ_max·1000 to σ_min·1000, and shifts again: the endpoint is
    /// shifted twice. Timesteps are σ·1000 in f32, not truncated.
    pub fn new(steps: usize, shift: f64) -> Result<FlowEuler, SamplerError> {
        if steps == 0 || steps > 1000 {
            return Err(SamplerError::Steps(steps));
        }
        if !(shift.is_finite() && shift > 0.0) {
            return Err(SamplerError::Shift(shift));
        }
        // The training table in f32: t = 1..1000 reversed, σ = t/1000, shifted in f32.
        let shift32 = shift as f32;
        let shift_f32 = |s: f32| shift32 * s / (1.0 + (shift32 - 1.0) * s);
        let sigma_max = f64::from(shift_f32(1.0));
        let sigma_min = f64::from(shift_f32(1.0 / 1000.0));
        let (t_max, t_min) = (
            sigma_max * NUM_TRAIN_TIMESTEPS,
            sigma_min * NUM_TRAIN_TIMESTEPS,
        );
        let mut sigmas: Vec<f32> = (0..steps)
            .map(|k| {
                // np.linspace(t_max, t_min, steps) in f64.
                let t = if steps == 1 {
                    t_max
                } else {
                    t_max + (t_min - t_max) * k as f64 / (steps - 1) as f64
                };
                shift_sigma(shift, t / NUM_TRAIN_TIMESTEPS) as f32
            })
            .collect();
        sigmas.push(0.0);
        Ok(FlowEuler { sigmas, step: 0 })
    }
}

impl Sampler for FlowEuler {
    fn steps(&self) -> usize {
        self.sigmas.len() - 1
    }

    fn timestep(&self, k: usize) -> f64 {
        f64::from(self.sigmas[k] * NUM_TRAIN_TIMESTEPS as f32)
    }

    fn sigma(&self, k: usize) -> f64 {
        f64::from(self.sigmas[k])
    }

    fn step_index(&self) -> usize {
        self.step
    }

    fn step(&mut self, v: &Tensor, latent: &Tensor) -> Result<Tensor, SamplerError> {
        let k = self.step;
        if k >= self.steps() {
            return Err(SamplerError::Finished {
                step: k,
                steps: self.steps(),
            });
        }
        let v = velocity(v, latent)?;
        // Diffusers subtracts the f32 sigmas, then multiplies in f32: x + dt·v.
        let dt = self.sigmas[k + 1] - self.sigmas[k];
        let next = add(latent, &scale(&v, dt)?)?;
        self.step += 1;
        Ok(next)
    }
}
