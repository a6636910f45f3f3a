//! Flow-matching UniPC multistep (diffusers `UniPCMultistepScheduler` with
//! `prediction_type=flow_prediction, use_flow_sigmas=True`, solver order 2, predict-x0, bh2,
//! lower order at the end, final sigma 0): a predictor per step and, from the second step on, a
//! corrector that refines the previous prediction with the new model output.
//!
//! With σ the noise level, α = 1 − σ and λ = ln α − ln σ, each step k:
//! 1. m_k = x − σ_k·v, the model output turned into a clean-sample estimate;
//! 2. corrector (k > 0): recompute x from the sample before the previous predictor using m_k;
//! 3. predictor: x_{k+1} from x, m_k and (order 2) m_{k−1}.
//!
//! Coefficients are computed in f64 from the f32 sigmas; diffusers computes them in f32. The
//! difference is a few f32 ulps of the coefficients, which the fixture test bounds.

use ditstream_kernels::{Tensor, scale, sub};

use super::{NUM_TRAIN_TIMESTEPS, Sampler, SamplerError, lincomb, shift_sigma, velocity};

/// Flow-matching UniPC sampler (order 2, bh2).
#[derive(Debug, Clone)]
pub struct FlowUniPc {
    /// σ_0..σ_N in f32 as diffusers stores them (σ_N = 0).
    sigmas: Vec<f32>,
    /// Model timesteps: ⌊σ_k·1000⌋ computed in f64 before the f32 cast, as diffusers does.
    timesteps: Vec<i64>,
    /// m_{k−1}, m_k: the last two clean-sample estimates (diffusers' `model_outputs`).
    history: [Option<Tensor>; 2],
    /// The sample before the last predictor (diffusers' `last_sample`), for the corrector.
    last_sample: Option<Tensor>,
    /// Order of the last predictor (diffusers' `this_order`).
    last_order: usize,
    /// Steps done, capped at the solver order (diffusers' `lower_order_nums`).
    lower_order_nums: usize,
    step: usize,
}

/// Solver order: 2, diffusers' default for Wan.
const SOLVER_ORDER: usize = 2;

/// λ = ln α − ln σ with α = 1 − σ; +∞ at σ = 0.
fn lambda(sigma: f64) -> f64 {
    (1.0 - sigma).ln() - sigma.ln()
}

impl FlowUniPc {
    /// The schedule for `steps` steps at flow shift `shift`: s_k = 1 − k·0.999/N,
    /// σ_k = S·s_k/(1 + (S−1)s_k), σ_0 nudged below 1 by 1e-6, σ_N = 0.
    pub fn new(steps: usize, shift: f64) -> Result<FlowUniPc, SamplerError> {
        if steps == 0 || steps > 1000 {
            return Err(SamplerError::Steps(steps));
        }
        if !(shift.is_finite() && shift > 0.0) {
            return Err(SamplerError::Shift(shift));
        }
        // np.linspace(1, 1/1000, steps + 1)[:-1], shifted, in f64.
        let last = 1.0 / NUM_TRAIN_TIMESTEPS;
        let mut sigmas64: Vec<f64> = (0..steps)
            .map(|k| shift_sigma(shift, 1.0 + (last - 1.0) * k as f64 / steps as f64))
            .collect();
        // Keeps ln(σ) and ln(1−σ) finite at the first step.
        if (sigmas64[0] - 1.0).abs() < 1e-6 {
            sigmas64[0] -= 1e-6;
        }
        let timesteps = sigmas64
            .iter()
            .map(|s| (s * NUM_TRAIN_TIMESTEPS) as i64)
            .collect();
        let mut sigmas: Vec<f32> = sigmas64.iter().map(|&s| s as f32).collect();
        sigmas.push(0.0);
        Ok(FlowUniPc {
            sigmas,
            timesteps,
            history: [None, None],
            last_sample: None,
            last_order: 0,
            lower_order_nums: 0,
            step: 0,
        })
    }

    fn sigma64(&self, k: usize) -> f64 {
        f64::from(self.sigmas[k])
    }

    /// UniC: the corrected sample at step k from `last_sample` (the sample before the previous
    /// predictor), the history m_{k−2}, m_{k−1} and the new estimate `m_k`, at the previous
    /// predictor's `order`.
    fn correct(&self, m_k: &Tensor) -> Result<Tensor, SamplerError> {
        let k = self.step;
        let (Some(x), Some(m0)) = (&self.last_sample, &self.history[1]) else {
            unreachable!("the corrector runs from the second step on, after the history is filled")
        };
        let (sigma_t, sigma_s0) = (self.sigma64(k), self.sigma64(k - 1));
        let alpha_t = 1.0 - sigma_t;
        let h = lambda(sigma_t) - lambda(sigma_s0);
        let hh = -h;
        let phi = hh.exp_m1();
        let b_h = phi; // bh2
        let a = sigma_t / sigma_s0;
        // Coefficients of D1 = (m_{k−2} − m_{k−1})/r and of (m_k − m_{k−1}).
        let (rho_d, rho_t, r) = if self.last_order == 2 {
            let r = (lambda(self.sigma64(k - 2)) - lambda(sigma_s0)) / h;
            let h_phi_1 = phi / hh - 1.0;
            let b1 = h_phi_1 / b_h;
            let b2 = (h_phi_1 / hh - 0.5) * 2.0 / b_h;
            // Solve [[1, 1], [r, 1]]·ρ = b.
            let rho0 = (b1 - b2) / (1.0 - r);
            (rho0, b1 - rho0, r)
        } else {
            (0.0, 0.5, 1.0)
        };
        let c_corr = -alpha_t * b_h;
        match (&self.history[0], self.last_order) {
            (Some(m_prev), 2) => lincomb(
                (a, x),
                &[
                    (-alpha_t * phi - c_corr * rho_d / r + c_corr * -rho_t, m0),
                    (c_corr * rho_d / r, m_prev),
                    (c_corr * rho_t, m_k),
                ],
            ),
            _ => lincomb(
                (a, x),
                &[(-alpha_t * phi - c_corr * rho_t, m0), (c_corr * rho_t, m_k)],
            ),
        }
    }

    /// UniP: x_{k+1} from the (corrected) sample `x` and the history, at `order`.
    fn predict(&self, x: &Tensor, order: usize) -> Result<Tensor, SamplerError> {
        let k = self.step;
        let Some(m0) = &self.history[1] else {
            unreachable!("the predictor runs after m_k is pushed")
        };
        let (sigma_t, sigma_s0) = (self.sigma64(k + 1), self.sigma64(k));
        let alpha_t = 1.0 - sigma_t;
        let h = lambda(sigma_t) - lambda(sigma_s0);
        // At the final step σ_t = 0: λ_t = ∞, expm1(−∞) = −1 and x_{k+1} = m_k.
        let phi = (-h).exp_m1();
        let b_h = phi; // bh2
        let a = sigma_t / sigma_s0;
        match (&self.history[0], order) {
            (Some(m1), 2) => {
                // D1 = (m_{k−1} − m_k)/r with r = (λ_{k−1} − λ_k)/h; the order-2 predictor's
                // ρ is 0.5.
                let r = (lambda(self.sigma64(k - 1)) - lambda(sigma_s0)) / h;
                let c = -alpha_t * b_h * 0.5 / r;
                lincomb((a, x), &[(-alpha_t * phi - c, m0), (c, m1)])
            }
            _ => lincomb((a, x), &[(-alpha_t * phi, m0)]),
        }
    }
}

impl Sampler for FlowUniPc {
    fn steps(&self) -> usize {
        self.timesteps.len()
    }

    fn timestep(&self, k: usize) -> f64 {
        self.timesteps[k] as f64
    }

    fn sigma(&self, k: usize) -> f64 {
        self.sigma64(k)
    }

    fn step_index(&self) -> usize {
        self.step
    }

    fn step(&mut self, v: &Tensor, latent: &Tensor) -> Result<Tensor, SamplerError> {
        let (k, n) = (self.step, self.steps());
        if k >= n {
            return Err(SamplerError::Finished { step: k, steps: n });
        }
        let v = velocity(v, latent)?;
        // m_k = x − σ_k·v.
        let m_k = sub(latent, &scale(&v, self.sigmas[k])?)?;
        let x = if k > 0 {
            self.correct(&m_k)?
        } else {
            latent.clone()
        };
        self.history.swap(0, 1);
        self.history[1] = Some(m_k);
        // Lower order at the end, and while the history is filling.
        let order = SOLVER_ORDER.min(n - k).min(self.lower_order_nums + 1);
        let next = self.predict(&x, order)?;
        self.last_sample = Some(x);
        self.last_order = order;
        self.lower_order_nums = (self.lower_order_nums + 1).min(SOLVER_ORDER);
        self.step += 1;
        Ok(next)
    }
}
