//! A cancelled request frees the device within one transformer block: the forward asks its
//! interrupt before every block and stops at the first "yes", and the loop reports that as a
//! cancel after the steps already taken, not an error.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

use std::cell::Cell;

use ditstream_common::config::{Preset, SamplerKind};
use ditstream_denoiser::denoise::{self, Control, DenoiseError, DenoiseParams, Experts};
use ditstream_denoiser::model::{ModelError, WanConfig, WanTransformer};
use ditstream_kernels::weights::RandomWeights;
use ditstream_kernels::{DType, Device, Tensor};

/// The built-in tiny preset with four blocks, random weights.
fn model() -> WanTransformer {
    let mut cfg = WanConfig::preset(Preset::Tiny);
    cfg.num_layers = 4;
    WanTransformer::new(cfg, &RandomWeights::new(3), DType::F32, Device::Cpu).unwrap()
}

fn inputs(m: &WanTransformer) -> (Tensor, Tensor, Tensor) {
    let c = m.config();
    let x = Tensor::randn(&[1, c.in_channels, 1, 4, 4], DType::F32, 1, Device::Cpu).unwrap();
    let t = Tensor::from_vec(vec![500.0], &[1]).unwrap();
    let ctx = Tensor::randn(&[1, 8, c.text_dim], DType::F32, 2, Device::Cpu).unwrap();
    (x, t, ctx)
}

#[test]
fn the_forward_asks_before_every_block_and_stops_at_the_first_yes() {
    let m = model();
    let (x, t, ctx) = inputs(&m);
    let asked = Cell::new(0);
    let out = m.forward_interruptible(&x, &t, &ctx, &|| {
        asked.set(asked.get() + 1);
        false
    });
    assert!(out.is_ok());
    assert_eq!(asked.get(), 4, "once per block");
    assert_eq!(
        out.unwrap().to_vec_f32().unwrap(),
        m.forward(&x, &t, &ctx).unwrap().to_vec_f32().unwrap(),
        "asking changes nothing"
    );

    let asked = Cell::new(0);
    let stopped = m.forward_interruptible(&x, &t, &ctx, &|| {
        asked.set(asked.get() + 1);
        asked.get() == 3
    });
    assert!(
        matches!(stopped, Err(ModelError::Interrupted { block: 2 })),
        "{stopped:?}"
    );
    assert_eq!(asked.get(), 3, "nothing runs after the yes");
}

#[test]
fn an_interrupt_mid_step_is_a_cancel_after_the_steps_taken() {
    let m = model();
    let (x, _, ctx) = inputs(&m);
    let params = DenoiseParams {
        sampler: SamplerKind::Unipc,
        steps: 3,
        shift: 3.0,
        guidance_scale: 1.0,
        guidance_scale_2: None,
    };
    let experts = Experts {
        high: &m,
        low: None,
    };
    // Blocks asked: 4 per step; say yes in the second step's third block.
    let asked = Cell::new(0);
    let steps_seen = Cell::new(0);
    let out = denoise::denoise_interruptible(
        experts,
        &params,
        x,
        &ctx,
        None,
        &|| {
            asked.set(asked.get() + 1);
            asked.get() == 4 + 3
        },
        |_| {
            steps_seen.set(steps_seen.get() + 1);
            Control::Continue
        },
    );
    assert!(
        matches!(
            out,
            Err(DenoiseError::Cancelled {
                after_step: 1,
                steps: 3
            })
        ),
        "{out:?}"
    );
    assert_eq!(steps_seen.get(), 1, "the interrupted step is not reported");
}
