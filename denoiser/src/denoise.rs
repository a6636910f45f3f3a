//! The denoise loop on one rank: initial noise from a seed, N sampler steps each evaluating the
//! transformer (both CFG branches batched into one forward), Wan2.2-A14B expert switching, a
//! progress callback after every step that can cancel the request.
//!
//! Latents stay f32 between steps, as in diffusers, and on the model's device: the CFG combine and
//! the sampler update run there too (`sampler`'s element-wise ops), so nothing of the latent
//! crosses to the host inside the loop. The model sees the latent in its own dtype.

use ditstream_common::config::SamplerKind;
use ditstream_kernels::{DType, Device, Tensor};

use crate::model::{ModelError, WanTransformer};
use crate::sampler::{FlowEuler, FlowUniPc, Sampler, SamplerError, cfg_combine};

/// Why a denoise did not finish.
#[derive(Debug, thiserror::Error)]
pub enum DenoiseError {
    /// The model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The sampler refused its parameters.
    #[error(transparent)]
    Sampler(#[from] SamplerError),
    /// The progress callback asked to stop (client gone, `Cancel`, deadline).
    #[error("cancelled after step {after_step} of {steps}")]
    Cancelled {
        /// Steps completed.
        after_step: usize,
        /// Steps planned.
        steps: usize,
    },
    /// Inputs disagree with each other.
    #[error("{what}: {rule}")]
    Input {
        /// Which input.
        what: &'static str,
        /// The rule, with the values.
        rule: String,
    },
}

/// The transformer(s) a request runs: one for Wan 2.1; for Wan2.2-A14B the high-noise expert
/// (t ≥ boundary·1000, `guidance_scale`) and the low-noise expert (below, `guidance_scale_2`).
#[derive(Clone, Copy)]
pub struct Experts<'a> {
    /// `transformer`: every step for Wan 2.1, the high-noise steps for A14B.
    pub high: &'a WanTransformer,
    /// `transformer_2` and its boundary ratio (0.875 for T2V).
    pub low: Option<(&'a WanTransformer, f64)>,
}

/// What one request asks of the loop.
#[derive(Debug, Clone, PartialEq)]
pub struct DenoiseParams {
    /// Scheduler.
    pub sampler: SamplerKind,
    /// Steps.
    pub steps: usize,
    /// Flow shift.
    pub shift: f64,
    /// CFG scale; CFG runs only when it is above 1 (diffusers' rule).
    pub guidance_scale: f64,
    /// CFG scale of the low-noise expert; defaults to `guidance_scale`.
    pub guidance_scale_2: Option<f64>,
}

/// Reported after each step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepProgress {
    /// Steps done (1-based count).
    pub step: usize,
    /// Steps planned.
    pub steps: usize,
    /// The model timestep of the step just taken.
    pub timestep: f64,
}

/// The progress callback's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Go on.
    Continue,
    /// Stop now and release everything.
    Cancel,
}

/// Seeded N(0, 1) initial latent [1, C, T, H, W] in f32. The generator is ditstream's own
/// (counter-based, identical on every device), not torch's, so seeds do not reproduce diffusers'.
pub fn initial_noise(shape: [usize; 5], seed: u64) -> Result<Tensor, DenoiseError> {
    Ok(Tensor::randn(&shape, DType::F32, seed, Device::Cpu).map_err(ModelError::from)?)
}

/// Builds the sampler a request asks for.
pub fn make_sampler(params: &DenoiseParams) -> Result<Box<dyn Sampler>, SamplerError> {
    Ok(match params.sampler {
        SamplerKind::Unipc => Box::new(FlowUniPc::new(params.steps, params.shift)?),
        SamplerKind::Euler => Box::new(FlowEuler::new(params.steps, params.shift)?),
    })
}

/// Runs the loop from `latents` [1, C, T, H, W] (f32) with the prompt's text states `cond`
/// [1, S, text_dim] and the negative prompt's `uncond` (same shape; required when CFG is on),
/// calling `on_step` after every step. Returns the final latent [1, C, T, H, W] in f32, on the
/// device `latents` came on.
pub fn denoise(
    experts: Experts<'_>,
    params: &DenoiseParams,
    latents: Tensor,
    cond: &Tensor,
    uncond: Option<&Tensor>,
    on_step: impl FnMut(StepProgress) -> Control,
) -> Result<Tensor, DenoiseError> {
    denoise_interruptible(experts, params, latents, cond, uncond, &|| false, on_step)
}

/// [`denoise`] that also asks `interrupted` before every transformer block: a request that is
/// cancelled mid-step ends within one block with [`DenoiseError::Cancelled`].
pub fn denoise_interruptible(
    experts: Experts<'_>,
    params: &DenoiseParams,
    latents: Tensor,
    cond: &Tensor,
    uncond: Option<&Tensor>,
    interrupted: &dyn Fn() -> bool,
    mut on_step: impl FnMut(StepProgress) -> Control,
) -> Result<Tensor, DenoiseError> {
    let mut sampler = make_sampler(params)?;
    let cfg = params.guidance_scale > 1.0;
    // Both branches in one batched forward: [cond; uncond] along the batch axis.
    let context = match (cfg, uncond) {
        (false, _) => cond.clone(),
        (true, Some(u)) if u.shape() == cond.shape() => {
            Tensor::concat(&[cond, u], 0).map_err(ModelError::from)?
        }
        (true, Some(u)) => {
            return Err(DenoiseError::Input {
                what: "negative prompt states",
                rule: format!(
                    "shape {:?} must equal the prompt's {:?}",
                    u.shape(),
                    cond.shape()
                ),
            });
        }
        (true, None) => {
            return Err(DenoiseError::Input {
                what: "negative prompt states",
                rule: format!(
                    "required when guidance_scale = {} > 1",
                    params.guidance_scale
                ),
            });
        }
    };
    let batch = context.shape()[0];
    let mut x = latents
        .to_dtype(DType::F32)
        .and_then(|x| x.to_device(experts.high.device()))
        .map_err(ModelError::from)?;
    let steps = sampler.steps();
    for k in 0..steps {
        let t = sampler.timestep(k);
        let (model, guidance) = match experts.low {
            Some((low, boundary)) if t < boundary * crate::sampler::NUM_TRAIN_TIMESTEPS => (
                low,
                params.guidance_scale_2.unwrap_or(params.guidance_scale),
            ),
            _ => (experts.high, params.guidance_scale),
        };
        let input = if batch == 2 {
            Tensor::concat(&[&x, &x], 0).map_err(ModelError::from)?
        } else {
            x.clone()
        };
        let timestep =
            Tensor::from_vec(vec![t as f32; batch], &[batch]).map_err(ModelError::from)?;
        let v = match model.forward_interruptible(&input, &timestep, &context, interrupted) {
            Ok(v) => v.to_dtype(DType::F32).map_err(ModelError::from)?,
            Err(ModelError::Interrupted { .. }) => {
                return Err(DenoiseError::Cancelled {
                    after_step: k,
                    steps,
                });
            }
            Err(e) => return Err(e.into()),
        };
        let v = if cfg {
            let (c, u) = (v.narrow(0, 0, 1), v.narrow(0, 1, 1));
            cfg_combine(
                &c.map_err(ModelError::from)?,
                &u.map_err(ModelError::from)?,
                guidance,
            )?
        } else {
            v
        };
        x = sampler.step(&v, &x)?;
        if on_step(StepProgress {
            step: k + 1,
            steps,
            timestep: t,
        }) == Control::Cancel
        {
            return Err(DenoiseError::Cancelled {
                after_step: k + 1,
                steps,
            });
        }
    }
    Ok(x.to_device(latents.device()).map_err(ModelError::from)?)
}
