//! The parallel denoise loop: [`crate::denoise::denoise`] on a mesh. With cfg_size = 2 the
//! conditional branch runs on the half of the mesh with cfg rank 0 and the unconditional one on
//! the other half, each with batch 1 through the sequence-parallel forward; one all-gather of the
//! prediction over the Cfg group per step, then every rank combines and steps the sampler
//! redundantly, so the latents stay identical on every rank without another collective. With
//! cfg_size = 1 both branches are batched, as on one rank.
//!
//! After each step every rank calls the progress callback, and the ranks agree on cancellation
//! (one max-reduction of a byte over the world): if any rank's callback cancels, every rank
//! returns `Cancelled` after the same step. A rank that fails makes the others' next collective
//! fail (the backends poison the group), so no rank hangs.

use std::borrow::{Borrow, BorrowMut};

use ditstream_common::collectives::ReduceOp;
use ditstream_common::collectives::wire::{self, TensorWire};
use ditstream_kernels::{DType, Tensor};

use super::{MeshComms, ParallelError, Result, check_mesh, forward};
use crate::denoise::{Control, DenoiseError, DenoiseParams, Experts, StepProgress, make_sampler};
use crate::model::ModelError;
use crate::sampler::{NUM_TRAIN_TIMESTEPS, cfg_combine};

/// How this rank runs the guidance branches.
enum Branches {
    /// One branch, no guidance: context [1, S, text_dim].
    Single(Tensor),
    /// Both branches batched on this rank: context [2, S, text_dim] (cond first).
    Batched(Tensor),
    /// This rank's branch of a cfg_size = 2 mesh: its context [1, S, text_dim].
    Split(Tensor),
}

/// Runs the loop on one rank of `comms`' mesh: the same contract as
/// [`crate::denoise::denoise`] (latents [1, C, T, H, W] f32, `cond`/`uncond` [1, S, text_dim],
/// → final latent [1, C, T, H, W] f32, identical on every rank). Every rank calls it with the same
/// arguments (the callbacks may differ).
pub fn denoise<C: TensorWire>(
    experts: Experts<'_>,
    comms: &MeshComms<C>,
    params: &DenoiseParams,
    latents: Tensor,
    cond: &Tensor,
    uncond: Option<&Tensor>,
    mut on_step: impl FnMut(StepProgress) -> Control,
) -> Result<Tensor> {
    let world = comms.mesh().world_size();
    check_mesh(comms.mesh(), experts.high.config(), world)?;
    if let Some((low, _)) = experts.low {
        check_mesh(comms.mesh(), low.config(), world)?;
    }
    let mut sampler = make_sampler(params).map_err(DenoiseError::from)?;
    let branches = branches(comms, params, cond, uncond)?;
    // The latent stays on this rank's device between steps (see `crate::denoise`).
    let mut x = latents
        .to_dtype(DType::F32)?
        .to_device(experts.high.device())?;
    let steps = sampler.steps();
    for k in 0..steps {
        let t = sampler.timestep(k);
        let (model, guidance) = match experts.low {
            Some((low, boundary)) if t < boundary * NUM_TRAIN_TIMESTEPS => (
                low,
                params.guidance_scale_2.unwrap_or(params.guidance_scale),
            ),
            _ => (experts.high, params.guidance_scale),
        };
        // The conditional and unconditional predictions, f32, each of the latent's shape.
        let (v_cond, v_uncond) = match &branches {
            Branches::Single(context) => {
                let timestep = Tensor::from_vec(vec![t as f32], &[1])?;
                (forward(model, comms, &x, &timestep, context)?, None)
            }
            Branches::Batched(context) => {
                let input = Tensor::concat(&[&x, &x], 0)?;
                let timestep = Tensor::from_vec(vec![t as f32; 2], &[2])?;
                let v = forward(model, comms, &input, &timestep, context)?;
                (v.narrow(0, 0, 1)?, Some(v.narrow(0, 1, 1)?))
            }
            Branches::Split(context) => {
                let timestep = Tensor::from_vec(vec![t as f32], &[1])?;
                let mine = forward(model, comms, &x, &timestep, context)?;
                let cfg_comm = comms.cfg.as_ref().ok_or_else(|| missing_cfg(comms))?;
                // [2, 1, C, T, H, W]: index 0 is the conditional prediction (cfg rank 0).
                let both = wire::all_gather(cfg_comm, &mine.to_dtype(DType::F32)?)?;
                // (Where the wire gathers off the device, the halves come back to it.)
                let (shape, device) = (x.shape(), x.device());
                let part = |i| {
                    both.narrow(0, i, 1)
                        .and_then(|p| p.reshape(shape))
                        .and_then(|p| p.to_device(device))
                };
                (part(0)?, Some(part(1)?))
            }
        };
        let v_cond = v_cond.to_dtype(DType::F32)?;
        let v = match v_uncond {
            Some(u) => cfg_combine(&v_cond, &u.to_dtype(DType::F32)?, guidance)
                .map_err(DenoiseError::from)?,
            None => v_cond,
        };
        x = sampler.step(&v, &x).map_err(DenoiseError::from)?;
        let verdict = on_step(StepProgress {
            step: k + 1,
            steps,
            timestep: t,
        });
        if agree_on_cancel(comms, verdict)? == Control::Cancel {
            return Err(DenoiseError::Cancelled {
                after_step: k + 1,
                steps,
            }
            .into());
        }
    }
    Ok(x.to_device(latents.device())?)
}

/// Picks this rank's branch layout, checking the text states as the single-rank loop does.
fn branches<C>(
    comms: &MeshComms<C>,
    params: &DenoiseParams,
    cond: &Tensor,
    uncond: Option<&Tensor>,
) -> Result<Branches> {
    if params.guidance_scale <= 1.0 {
        // No guidance: a cfg_size = 2 mesh runs the conditional branch on both halves.
        return Ok(Branches::Single(cond.clone()));
    }
    let uncond = match uncond {
        Some(u) if u.shape() == cond.shape() => u,
        Some(u) => {
            return Err(DenoiseError::Input {
                what: "negative prompt states",
                rule: format!(
                    "shape {:?} must equal the prompt's {:?}",
                    u.shape(),
                    cond.shape()
                ),
            }
            .into());
        }
        None => {
            return Err(DenoiseError::Input {
                what: "negative prompt states",
                rule: format!(
                    "required when guidance_scale = {} > 1",
                    params.guidance_scale
                ),
            }
            .into());
        }
    };
    Ok(match comms.mesh().cfg_size() {
        2 if comms.cfg_rank() == 0 => Branches::Split(cond.clone()),
        2 => Branches::Split(uncond.clone()),
        _ => Branches::Batched(Tensor::concat(&[cond, uncond], 0).map_err(ModelError::from)?),
    })
}

fn missing_cfg<C>(comms: &MeshComms<C>) -> ParallelError {
    ParallelError::Mesh {
        mesh: comms.mesh().to_string(),
        what: "cfg_size",
        value: comms.mesh().cfg_size(),
        rule: "cfg parallelism needs the Cfg group's communicator".into(),
    }
}

/// Cancel if any rank's callback cancelled (max over the world of 0 = continue, 1 = cancel).
fn agree_on_cancel<C: TensorWire>(comms: &MeshComms<C>, mine: Control) -> Result<Control> {
    let Some(world) = &comms.world else {
        return Ok(mine);
    };
    let flag = [u8::from(mine == Control::Cancel)];
    let send = world.upload(&flag)?;
    let mut recv = world.alloc::<u8>(1)?;
    world.all_reduce(
        Borrow::<C::Buf<u8>>::borrow(&send),
        BorrowMut::<C::Buf<u8>>::borrow_mut(&mut recv),
        ReduceOp::Max,
    )?;
    Ok(
        if world.download(Borrow::<C::Buf<u8>>::borrow(&recv))? == [1] {
            Control::Cancel
        } else {
            Control::Continue
        },
    )
}
