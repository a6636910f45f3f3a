//! The flow-matching samplers against diffusers 0.42.1 (fixtures from
//! `scripts/make_fixtures.py schedulers`): the same sigmas and timesteps, and the same latent after
//! every step given the same model outputs.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test

use ditstream_denoiser::sampler::{FlowEuler, FlowUniPc, Sampler};
use ditstream_kernels::Tensor;
use safetensors::SafeTensors;

const FIXTURE: &[u8] = include_bytes!("fixtures/schedulers.safetensors");

fn tensor<T: bytemuck::Pod>(st: &SafeTensors, name: &str) -> Vec<T> {
    let view = st
        .tensor(name)
        .unwrap_or_else(|e| panic!("fixture tensor {name}: {e}"));
    bytemuck::pod_collect_to_vec(view.data())
}

fn check(name: &str, mut sampler: Box<dyn Sampler>) {
    let st = SafeTensors::deserialize(FIXTURE).expect("fixture parses");
    let sigmas: Vec<f32> = tensor(&st, &format!("{name}.sigmas"));
    let timesteps: Vec<f64> = tensor(&st, &format!("{name}.timesteps"));
    let xs: Vec<f32> = tensor(&st, &format!("{name}.x"));
    let vs: Vec<f32> = tensor(&st, &format!("{name}.v"));
    let n = sampler.steps();
    assert_eq!(timesteps.len(), n, "{name}: step count");
    // The schedule is computed the same way in the same precision: exact.
    for (k, &want) in sigmas.iter().enumerate().take(n + 1) {
        assert_eq!(sampler.sigma(k) as f32, want, "{name}: sigma {k}");
    }
    for (k, &t) in timesteps.iter().enumerate() {
        assert_eq!(sampler.timestep(k), t, "{name}: timestep {k}");
    }
    let len = xs.len() / (n + 1);
    let t = |v: &[f32]| Tensor::from_vec(v.to_vec(), &[len]).unwrap();
    let mut x = t(&xs[..len]);
    for k in 0..n {
        x = sampler.step(&t(&vs[k * len..(k + 1) * len]), &x).unwrap();
        let want = &xs[(k + 1) * len..(k + 2) * len];
        // Tolerance: diffusers forms the step coefficients in f32 (ours in f64) and sums the
        // terms in another order. Each coefficient is off by a few ulps (~1e-7 relative), and
        // values are O(1–10), so per-step differences are ~1e-6; UniPC's multistep feedback over
        // 50 steps amplifies them by at most ~10×. 1e-5·(1 + |x|) bounds that with margin and
        // still catches any wrong coefficient (those show up at 1e-2 or more).
        for (i, (&got, &w)) in x.to_vec_f32().unwrap().iter().zip(want).enumerate() {
            assert!(
                (got - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{name}: step {k} element {i}: got {got}, diffusers {w}"
            );
        }
    }
    assert!(
        sampler.step(&t(&vs[..len]), &x).is_err(),
        "{name}: step past the end must fail"
    );
}

#[test]
fn unipc_matches_diffusers() {
    for (name, steps, shift) in [
        ("unipc_n1_s5", 1, 5.0),
        ("unipc_n2_s3", 2, 3.0),
        ("unipc_n3_s3", 3, 3.0),
        ("unipc_n10_s3", 10, 3.0),
        ("unipc_n50_s5", 50, 5.0),
        ("unipc_n40_s12", 40, 12.0),
    ] {
        check(name, Box::new(FlowUniPc::new(steps, shift).unwrap()));
    }
}

#[test]
fn euler_matches_diffusers() {
    for (name, steps, shift) in [
        ("euler_n1_s7", 1, 7.0),
        ("euler_n10_s7", 10, 7.0),
        ("euler_n50_s5", 50, 5.0),
    ] {
        check(name, Box::new(FlowEuler::new(steps, shift).unwrap()));
    }
}

#[test]
fn wan_timesteps_truncate() {
    // reference/wan.md §3: 999, 995, 991, … for 50 steps at shift 5.
    let s = FlowUniPc::new(50, 5.0).unwrap();
    assert_eq!(
        [s.timestep(0), s.timestep(1), s.timestep(2)],
        [999.0, 995.0, 991.0]
    );
}

#[test]
fn bad_schedules_are_refused() {
    assert_eq!(
        FlowUniPc::new(0, 5.0).unwrap_err().to_string(),
        "steps = 0: must be in 1..=1000"
    );
    assert_eq!(
        FlowEuler::new(10, -1.0).unwrap_err().to_string(),
        "shift = -1: must be a positive number"
    );
    let mut s = FlowEuler::new(2, 3.0).unwrap();
    let x = Tensor::from_vec(vec![0.0; 3], &[3]).unwrap();
    let v = Tensor::from_vec(vec![0.0; 2], &[2]).unwrap();
    assert_eq!(
        s.step(&v, &x).unwrap_err().to_string(),
        "latent has shape [3] but the model output has shape [2]"
    );
}
