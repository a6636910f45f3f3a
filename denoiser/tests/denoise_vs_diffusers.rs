//! The denoise loop against diffusers' `WanPipeline` given the same initial latents and prompt
//! states (fixtures from `scripts/make_fixtures.py loop`): CFG with UniPC and with Euler, no CFG,
//! and Wan2.2-A14B expert switching with two guidance scales. Also cancellation.
//!
//! Tolerance: per forward the model matches diffusers to ~2e-7 (see wan_vs_diffusers.rs); CFG
//! multiplies differences by up to g (6) and UniPC's multistep feedback over 6 steps by a few
//! more, so ~1e-5·(1 + |x|) is the expected worst case; 1e-4·(1 + |x|) leaves margin while a
//! wrong expert, guidance scale or order shows up at 1e-2.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test

use std::path::{Path, PathBuf};

use ditstream_common::config::SamplerKind;
use ditstream_denoiser::denoise::{Control, DenoiseError, DenoiseParams, Experts, denoise};
use ditstream_denoiser::model::WanTransformer;
use ditstream_kernels::weights::Checkpoint;
use ditstream_kernels::{DType, Device, Tensor};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/loop")
}

struct Fixture {
    high: WanTransformer,
    low: WanTransformer,
    io: Checkpoint,
}

impl Fixture {
    fn load() -> Fixture {
        Fixture {
            high: WanTransformer::from_dir(&dir().join("transformer"), DType::F32, Device::Cpu)
                .unwrap(),
            low: WanTransformer::from_dir(&dir().join("transformer_2"), DType::F32, Device::Cpu)
                .unwrap(),
            io: Checkpoint::open_dir(&dir(), "io").unwrap(),
        }
    }

    fn get(&self, name: &str) -> Tensor {
        self.io.stored(name, DType::F32).unwrap()
    }
}

fn params(
    sampler: SamplerKind,
    steps: usize,
    shift: f64,
    g: f64,
    g2: Option<f64>,
) -> DenoiseParams {
    DenoiseParams {
        sampler,
        steps,
        shift,
        guidance_scale: g,
        guidance_scale_2: g2,
    }
}

fn assert_close(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{what}");
    for (i, (a, b)) in got
        .to_vec_f32()
        .unwrap()
        .iter()
        .zip(want.to_vec_f32().unwrap())
        .enumerate()
    {
        assert!(
            (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
            "{what}: element {i}: got {a}, diffusers {b}"
        );
    }
}

#[test]
fn loop_matches_the_diffusers_pipeline() {
    let f = Fixture::load();
    let (cond, uncond) = (f.get("prompt_embeds"), f.get("negative_prompt_embeds"));
    let single = Experts {
        high: &f.high,
        low: None,
    };
    let cases = [
        (
            "unipc_cfg",
            single,
            params(SamplerKind::Unipc, 4, 3.0, 5.0, None),
        ),
        (
            "euler_cfg",
            single,
            params(SamplerKind::Euler, 3, 7.0, 6.0, None),
        ),
        (
            "unipc_nocfg",
            single,
            params(SamplerKind::Unipc, 3, 3.0, 1.0, None),
        ),
        (
            "experts",
            Experts {
                high: &f.high,
                low: Some((&f.low, 0.875)),
            },
            params(SamplerKind::Unipc, 6, 12.0, 4.0, Some(3.0)),
        ),
    ];
    for (name, experts, p) in cases {
        let mut seen = Vec::new();
        let out = denoise(experts, &p, f.get("latents"), &cond, Some(&uncond), |s| {
            seen.push(s.step);
            Control::Continue
        })
        .unwrap();
        assert_eq!(seen, (1..=p.steps).collect::<Vec<_>>(), "{name}: progress");
        assert_close(name, &out, &f.get(&format!("{name}.output")));
    }
}

#[test]
fn expert_switch_matters() {
    // Running A14B's schedule with the high expert only must NOT match: the fixture exercises
    // both experts, so the test above would catch a wrong boundary.
    let f = Fixture::load();
    let p = params(SamplerKind::Unipc, 6, 12.0, 4.0, Some(3.0));
    let (cond, uncond) = (f.get("prompt_embeds"), f.get("negative_prompt_embeds"));
    let out = denoise(
        Experts {
            high: &f.high,
            low: None,
        },
        &p,
        f.get("latents"),
        &cond,
        Some(&uncond),
        |_| Control::Continue,
    )
    .unwrap();
    let want = f.get("experts.output").to_vec_f32().unwrap();
    let worst = out
        .to_vec_f32()
        .unwrap()
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(
        worst > 1e-2,
        "one expert reproduced the two-expert run (worst diff {worst})"
    );
}

#[test]
fn cancel_stops_at_the_next_step() {
    let f = Fixture::load();
    let p = params(SamplerKind::Unipc, 4, 3.0, 5.0, None);
    let (cond, uncond) = (f.get("prompt_embeds"), f.get("negative_prompt_embeds"));
    let mut calls = 0;
    let err = denoise(
        Experts {
            high: &f.high,
            low: None,
        },
        &p,
        f.get("latents"),
        &cond,
        Some(&uncond),
        |s| {
            calls += 1;
            if s.step == 2 {
                Control::Cancel
            } else {
                Control::Continue
            }
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            DenoiseError::Cancelled {
                after_step: 2,
                steps: 4
            }
        ),
        "{err}"
    );
    assert_eq!(calls, 2);
}

#[test]
fn cfg_needs_the_negative_prompt() {
    let f = Fixture::load();
    let p = params(SamplerKind::Unipc, 2, 3.0, 5.0, None);
    let err = denoise(
        Experts {
            high: &f.high,
            low: None,
        },
        &p,
        f.get("latents"),
        &f.get("prompt_embeds"),
        None,
        |_| Control::Continue,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "negative prompt states: required when guidance_scale = 5 > 1"
    );
}
