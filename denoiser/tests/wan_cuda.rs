//! The Wan transformer on a GPU (feature `cuda`) against diffusers 0.42.1 `WanTransformer3DModel`:
//! the fixtures of `wan_vs_diffusers.rs` (diffusers run on the CPU in f32; `scripts/make_fixtures.py
//! dit`), loaded onto `cuda:0` in f32 and in bf16; the conditioning, every block's output and the
//! final velocity are compared with diffusers' f32 values, for a scalar timestep (500, 999) and for
//! per-token timesteps.
//!
//! Skips (with a message) where no GPU or CUDA library is found, but fails when the environment sets
//! `DITSTREAM_REQUIRE_GPUS` (≥ 1), as `scripts/gpu-dit.sh` does on the GPU machine, so a skip never
//! hides a failure. Each comparison prints a `WANPARITY` line (fixture, dtype, case, tensor, the two
//! error measures below, the tolerance) that the script summarises.
//!
//! ## Tolerances
//! - **f32 on the GPU**: the same bound as the CPU test, |got − want| ≤ 1e-4·(1 + |want|). The GPU
//!   computes in true f32 (cuBLASLt `COMPUTE_32F`, no TF32) and differs from diffusers' CPU run only
//!   in summation order and in `expf`/`tanhf` (≤ 2 ulp): ~√K·2⁻²⁴ relative per op, ~1e-5 after the
//!   ~30 ops of two blocks (see `wan_vs_diffusers.rs`). This run is the op-for-op correctness check.
//! - **bf16**: every stored activation and weight is rounded to 8 significant bits (maths between
//!   stores is f32): a relative error of at most u = 2⁻⁸ ≈ 3.9e-3 per rounding, uniform within ±u at
//!   worst, so of RMS ≤ u/√3 ≈ 2.3e-3. Along the path from the latent to the output there are N ≈ 70
//!   roundings: the input, patch weight and output (3); per block ~32 (LN·modulation 1; q/k/v weights
//!   and outputs 2 each, q/k RMSNorm and RoPE 2 each; attention 1; out projection 2; gated residual 1;
//!   norm2 1; cross q 3; the text path feeding cross k/v, i.e. two text-embedder GEMMs, GELU, k/v
//!   projections and RMSNorm, ~8; attention 1; out projection 2; residual 1; LN·modulation 1; FFN in
//!   2, GELU 1, FFN out 2, gated residual 1); the head 3. Errors of independent roundings are
//!   independent, and GEMMs, norms and attention average them rather than line them up, so they add
//!   in quadrature: the error's RMS relative to the tensor's RMS is about (u/√3)·√N ≈ 0.019 after two
//!   blocks (the conditioning, 2–5 roundings deep, ≈ 0.005). Norms do not amplify relative error
//!   (they divide by the RMS they measure); the softmax turns a relative logit error ε into a relative
//!   weight error ε·|logit|, with |logit| = O(1) at these scales. Hence, against the RMS of diffusers'
//!   tensor, the bound on the error's RMS is 2·(u/√3)·√N ≈ 0.038 (a factor 2 for amplification the
//!   estimate does not count, e.g. residual sums that partly cancel), and on the largest single error
//!   5 × that ≈ 0.19 (a Gaussian's largest of ≤ 1e5 draws is < 4.5σ). One bound for every tensor:
//!   it is the deepest one's. A structural bug (a swapped RoPE band, a wrong modulation row, a
//!   mis-ordered patch) moves the RMS error to 0.1–1; the f32 run above pins every op far tighter.
//!   On the CPU, bf16 storage measures RMS ≤ 5.7e-3 and max ≤ 4.4e-2 on these fixtures.

#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test

use std::path::{Path, PathBuf};

use ditstream_common::config::SamplerKind;
use ditstream_denoiser::denoise::{Control, DenoiseParams, Experts, denoise, make_sampler};
use ditstream_denoiser::model::{LocalAttention, WanTransformer};
use ditstream_denoiser::sampler::cfg_combine;
use ditstream_kernels::weights::Checkpoint;
use ditstream_kernels::{DType, Device, Tensor};

/// u = 2⁻⁸: the relative rounding error of one bf16 store.
const BF16_U: f64 = 1.0 / 256.0;
/// Roundings along the latent → output path of a two-block model (see the module docs).
const BF16_ROUNDINGS: f64 = 70.0;

/// Bound on RMS(got − want) / RMS(want) in bf16: 2·(u/√3)·√N ≈ 0.038.
fn bf16_rms_bound() -> f64 {
    2.0 * BF16_U / 3f64.sqrt() * BF16_ROUNDINGS.sqrt()
}

/// Bound on max|got − want| / RMS(want) in bf16: 5 × the RMS bound ≈ 0.19.
fn bf16_max_bound() -> f64 {
    5.0 * bf16_rms_bound()
}
/// Bound on |got − want| / (1 + |want|) in f32 (the CPU test's).
const F32_SCALED: f64 = 1e-4;

/// The GPU to test on (the shared gate: skips without one unless DITSTREAM_REQUIRE_GPUS is set).
fn gpu() -> Option<Device> {
    ditstream_kernels::testing::test_gpu()
}

/// The fixture folder: under this crate's source when it is where the test was built, else under
/// the working directory (the GPU machine runs the prebuilt test from `denoiser/`, as cargo would).
fn fixture(name: &str) -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let root = if built.is_dir() {
        built
    } else {
        PathBuf::from("tests/fixtures")
    };
    root.join(name)
}

fn io(ck: &Checkpoint, name: &str) -> Tensor {
    ck.stored(name, DType::F32)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Error measures of `got` against diffusers' `want`.
struct Errors {
    /// max |got − want| / (1 + |want|): the CPU test's measure.
    scaled: f64,
    /// max |got − want| / RMS(want).
    max_rel_rms: f64,
    /// RMS(got − want) / RMS(want).
    rms_rel_rms: f64,
}

fn errors(got: &[f32], want: &[f32]) -> Errors {
    let n = want.len().max(1) as f64;
    let rms_want = (want.iter().map(|&w| f64::from(w).powi(2)).sum::<f64>() / n)
        .sqrt()
        .max(f64::MIN_POSITIVE);
    let (mut scaled, mut max_abs, mut sum_sq) = (0.0f64, 0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        let d = (f64::from(g) - f64::from(w)).abs();
        scaled = scaled.max(d / (1.0 + f64::from(w).abs()));
        max_abs = max_abs.max(d);
        sum_sq += d * d;
    }
    Errors {
        scaled,
        max_rel_rms: max_abs / rms_want,
        rms_rel_rms: (sum_sq / n).sqrt() / rms_want,
    }
}

/// Compares one tensor from the GPU with diffusers', prints the `WANPARITY` line, and asserts the
/// tolerance of `dtype`.
fn check(label: &str, dtype: DType, got: &Tensor, want: &Tensor) {
    assert_eq!(got.numel(), want.numel(), "{label}: element count");
    assert!(
        matches!(got.device(), Device::Cuda(_)),
        "{label}: computed on {}",
        got.device()
    );
    let (g, w) = (got.to_vec_f32().unwrap(), want.to_vec_f32().unwrap());
    assert!(
        g.iter().all(|v| v.is_finite()),
        "{label}: non-finite values"
    );
    let e = errors(&g, &w);
    let (name, tol, ok) = match dtype {
        DType::F32 => (
            "f32",
            format!("scaled ≤ {F32_SCALED:.0e}"),
            e.scaled <= F32_SCALED,
        ),
        DType::BF16 => (
            "bf16",
            format!(
                "rms ≤ {:.3}, max ≤ {:.3}",
                bf16_rms_bound(),
                bf16_max_bound()
            ),
            e.rms_rel_rms <= bf16_rms_bound() && e.max_rel_rms <= bf16_max_bound(),
        ),
    };
    println!(
        "WANPARITY\t{label}\t{name}\tscaled {:.3e}\tmax/rms {:.3e}\trms/rms {:.3e}\t{tol}",
        e.scaled, e.max_rel_rms, e.rms_rel_rms
    );
    assert!(
        ok,
        "{label} {name}: scaled {:.3e}, max/rms {:.3e}, rms/rms {:.3e} (tolerance {tol})",
        e.scaled, e.max_rel_rms, e.rms_rel_rms
    );
}

/// Loads fixture `name` onto `dev` in `dtype` and checks every stage of every case.
fn compare(name: &str, dev: Device, dtype: DType) {
    let dir = fixture(name);
    let model = WanTransformer::from_dir(&dir.join("transformer"), dtype, dev).unwrap();
    assert_eq!((model.device(), model.dtype()), (dev, dtype));
    let ck = Checkpoint::open_dir(&dir, "io").unwrap();
    // Inputs start on the host, as a caller's would; the model moves them.
    let x = io(&ck, "hidden_states");
    let ctx = io(&ck, "encoder_hidden_states");
    for case in ["t500", "t999", "per_token"] {
        let label = |what: &str| format!("{name}\t{case}\t{what}");
        let t = io(&ck, &format!("{case}.timestep"));
        let (tokens, cond) = model.embed(&x, &t, &ctx).unwrap();
        check(
            &label("temb"),
            dtype,
            &cond.temb,
            &io(&ck, &format!("{case}.temb")),
        );
        check(
            &label("timestep_proj"),
            dtype,
            &cond.timestep_proj,
            &io(&ck, &format!("{case}.timestep_proj")),
        );
        check(
            &label("context"),
            dtype,
            &cond.context,
            &io(&ck, &format!("{case}.context")),
        );
        let mut h = tokens;
        for i in 0..model.num_blocks() {
            h = model
                .block(
                    i,
                    &h,
                    &cond,
                    &cond.rope_cos,
                    &cond.rope_sin,
                    &cond.timestep_proj,
                    &LocalAttention::default(),
                )
                .unwrap();
            check(
                &label(&format!("block{i}")),
                dtype,
                &h,
                &io(&ck, &format!("{case}.block{i}")),
            );
        }
        let want = io(&ck, &format!("{case}.output"));
        let staged = model.head(&h, &cond.temb, cond.grid).unwrap();
        assert_eq!(staged.shape(), want.shape(), "{name} {case}: output shape");
        // The one-call forward is what callers use; it must meet the same bound.
        let out = model.forward(&x, &t, &ctx).unwrap();
        assert_eq!(out.dtype(), dtype);
        check(&label("output"), dtype, &out, &want);
    }
}

#[test]
fn diffusers_test_config_f32_on_gpu() {
    let Some(dev) = gpu() else { return };
    compare("dit_diffusers_test", dev, DType::F32);
}

#[test]
fn mini128_f32_on_gpu() {
    let Some(dev) = gpu() else { return };
    compare("dit_mini128", dev, DType::F32);
}

#[test]
fn diffusers_test_config_bf16_on_gpu() {
    let Some(dev) = gpu() else { return };
    compare("dit_diffusers_test", dev, DType::BF16);
}

#[test]
fn mini128_bf16_on_gpu() {
    let Some(dev) = gpu() else { return };
    compare("dit_mini128", dev, DType::BF16);
}

/// The weights really live on the GPU, and a host tensor is refused by the ops rather than silently
/// copied per call: the model moves its inputs once, in `embed`.
#[test]
fn weights_are_on_the_gpu() {
    let Some(dev) = gpu() else { return };
    let dir = fixture("dit_mini128");
    let model = WanTransformer::from_dir(&dir.join("transformer"), DType::BF16, dev).unwrap();
    let ck = Checkpoint::open_dir(&dir, "io").unwrap();
    let (tokens, cond) = model
        .embed(
            &io(&ck, "hidden_states"),
            &io(&ck, "t500.timestep"),
            &io(&ck, "encoder_hidden_states"),
        )
        .unwrap();
    for t in [&tokens, &cond.context, &cond.rope_cos, &cond.timestep_proj] {
        assert_eq!(t.device(), dev);
    }
    assert_eq!(tokens.dtype(), DType::BF16);
    let host_tokens = tokens.to_device(Device::Cpu).unwrap();
    assert!(
        model
            .block(
                0,
                &host_tokens,
                &cond,
                &cond.rope_cos,
                &cond.rope_sin,
                &cond.timestep_proj,
                &LocalAttention::default()
            )
            .is_err(),
        "a host activation against device weights must be a device-mismatch error"
    );
}

/// A 20-step request on the GPU (UniPC, CFG 5, shift 5: the Wan2.1 defaults) through `denoise`,
/// with the fused kernels, against the same loop in f32 on the CPU, where each op is its own CPU
/// twin (the unfused reference). Fixture: `loop` (`denoise_vs_diffusers.rs`; two blocks).
///
/// ## Bound
/// Per forward the GPU's roundings leave an error of relative RMS ε in each branch's velocity
/// (module docs: bf16 (u/√3)·√N ≈ 0.019 for N = 70 roundings; f32 ~1e-5). CFG weighs the two
/// branches' errors by g and 1 − g, and the multistep sampler carries every step's error into the
/// later steps through the model, which no closed form bounds for a random model. So the bound is
/// derived by running that error model: the CPU loop again, with independent Gaussian noise of
/// relative RMS ε added to each branch's velocity at every step (three seeds), gives the spread
/// those roundings cause after 20 steps; the GPU's RMS error against the clean CPU loop must stay
/// within 2× the largest spread (the factor 2 of the module docs, for correlations between
/// roundings the model leaves out). A fused op that changed the maths (a wrong gate, a dropped
/// bias, a mis-scaled RoPE) moves the latent by far more than rounding does.
#[test]
fn twenty_steps_stay_within_the_rounding_bound_of_the_f32_loop() {
    let Some(dev) = gpu() else { return };
    let dir = fixture("loop");
    let ck = Checkpoint::open_dir(&dir, "io").unwrap();
    let (latents, cond, uncond) = (
        io(&ck, "latents"),
        io(&ck, "prompt_embeds"),
        io(&ck, "negative_prompt_embeds"),
    );
    let p = DenoiseParams {
        sampler: SamplerKind::Unipc,
        steps: 20,
        shift: 5.0,
        guidance_scale: 5.0,
        guidance_scale_2: None,
    };
    let run = |model: &WanTransformer| -> Vec<f32> {
        let experts = Experts {
            high: model,
            low: None,
        };
        denoise(experts, &p, latents.clone(), &cond, Some(&uncond), |_| {
            Control::Continue
        })
        .unwrap()
        .to_vec_f32()
        .unwrap()
    };
    let cpu = WanTransformer::from_dir(&dir.join("transformer"), DType::F32, Device::Cpu).unwrap();
    // `denoise`'s loop by hand, with noise of relative RMS `eps` on each branch's velocity.
    let context = Tensor::concat(&[&cond, &uncond], 0).unwrap();
    let noisy_loop = |eps: f64, seed: u64| -> Vec<f32> {
        let mut sampler = make_sampler(&p).unwrap();
        let mut x = latents.clone();
        let n = x.numel();
        let host = |v: &[f32]| Tensor::from_vec(v.to_vec(), latents.shape()).unwrap();
        for k in 0..sampler.steps() {
            let t = sampler.timestep(k) as f32;
            let input = Tensor::concat(&[&x, &x], 0).unwrap();
            let timestep = Tensor::from_vec(vec![t; 2], &[2]).unwrap();
            let mut v = cpu
                .forward(&input, &timestep, &context)
                .unwrap()
                .to_vec_f32()
                .unwrap();
            if eps > 0.0 {
                for (branch, part) in v.chunks_mut(n).enumerate() {
                    let rms =
                        (part.iter().map(|&a| f64::from(a).powi(2)).sum::<f64>() / n as f64).sqrt();
                    let noise_seed = seed * 1000 + 2 * k as u64 + branch as u64;
                    let noise = Tensor::randn(&[n], DType::F32, noise_seed, Device::Cpu)
                        .unwrap()
                        .to_vec_f32()
                        .unwrap();
                    for (a, z) in part.iter_mut().zip(noise) {
                        *a += (eps * rms) as f32 * z;
                    }
                }
            }
            let (v_cond, v_uncond) = v.split_at(n);
            let v = cfg_combine(&host(v_cond), &host(v_uncond), p.guidance_scale).unwrap();
            x = sampler.step(&v, &x).unwrap();
        }
        x.to_vec_f32().unwrap()
    };
    let reference = noisy_loop(0.0, 0);
    assert_eq!(
        reference,
        run(&cpu),
        "the hand loop is `denoise`'s (the same f32 maths on the CPU)"
    );
    let bf16_eps = BF16_U / 3f64.sqrt() * BF16_ROUNDINGS.sqrt();
    for (dtype, eps) in [(DType::F32, 1e-5), (DType::BF16, bf16_eps)] {
        let model = WanTransformer::from_dir(&dir.join("transformer"), dtype, dev).unwrap();
        let got = run(&model);
        assert!(
            got.iter().all(|v| v.is_finite()),
            "{dtype:?}: non-finite latent"
        );
        let spread = (1..=3)
            .map(|seed| errors(&noisy_loop(eps, seed), &reference).rms_rel_rms)
            .fold(0.0f64, f64::max);
        let bound = 2.0 * spread;
        let e = errors(&got, &reference);
        println!(
            "WANLOOP\t20 steps unipc cfg5\t{dtype:?}\trms/rms {:.3e}\tmax/rms {:.3e}\tnoise spread {spread:.3e} (eps {eps:.1e})\tbound {bound:.3e}",
            e.rms_rel_rms, e.max_rel_rms
        );
        assert!(
            e.rms_rel_rms <= bound,
            "{dtype:?}: 20-step latent rms/rms {:.3e} against the f32 CPU loop, bound {bound:.3e}",
            e.rms_rel_rms
        );
    }
}

/// `model.dtype: fp8` on the GPU: mini128 with its blocks' linears and self-attention in e4m3,
/// against the same quantisation on the CPU (`ditstream_kernels::linear_fp8`'s and
/// `attention_fp8`'s references) and against diffusers' f32 output. The attention's own GPU/CPU
/// distance is ~5e-3 relative RMS (`fp8_attention_matches_cpu`), well inside the bound below.
///
/// The weights' codes and scales are the CPU's bit for bit (the kernel's parity test); the
/// activations' codes can differ where a bf16 rounding of the GPU and the CPU differ (one bf16
/// ulp, 2⁻⁸ relative): a value that close to an e4m3 rounding boundary (1 in 16 or so) then
/// rounds one e4m3 ulp (2⁻³) the other way. That leaves the two FP8 forwards well inside one FP8
/// linear's own error, ~0.05 relative RMS (`fp8_linears_move_the_forward_by_the_quantisation_error`
/// in the model's CPU tests derives it): 0.1 is allowed. Against diffusers, the CPU test's bound
/// on the quantisation's effect, 0.25, plus bf16's.
#[test]
fn mini128_fp8_on_gpu_matches_the_cpu_fp8_model() {
    let Some(dev) = gpu() else { return };
    if !ditstream_kernels::cuda::supports_fp8(0).unwrap() {
        eprintln!("skipped: this GPU has no FP8 tensor cores");
        return;
    }
    let dir = fixture("dit_mini128");
    let load = |device| {
        WanTransformer::from_dir(&dir.join("transformer"), DType::BF16, device)
            .unwrap()
            .with_fp8_linears()
            .unwrap()
            .with_fp8_attention()
    };
    let (gpu_model, cpu_model) = (load(dev), load(Device::Cpu));
    let ck = Checkpoint::open_dir(&dir, "io").unwrap();
    let (x, ctx) = (io(&ck, "hidden_states"), io(&ck, "encoder_hidden_states"));
    for case in ["t500", "t999"] {
        let t = io(&ck, &format!("{case}.timestep"));
        let got = gpu_model
            .forward(&x, &t, &ctx)
            .unwrap()
            .to_vec_f32()
            .unwrap();
        let cpu = cpu_model
            .forward(&x, &t, &ctx)
            .unwrap()
            .to_vec_f32()
            .unwrap();
        let want = io(&ck, &format!("{case}.output")).to_vec_f32().unwrap();
        let (vs_cpu, vs_diffusers) = (errors(&got, &cpu), errors(&got, &want));
        println!(
            "FP8PARITY\tmini128\t{case}\trms/rms vs the CPU's FP8 {:.3e} (bound 0.1)\tvs diffusers f32 {:.3e} (bound {:.3})",
            vs_cpu.rms_rel_rms,
            vs_diffusers.rms_rel_rms,
            0.25 + bf16_rms_bound()
        );
        assert!(
            vs_cpu.rms_rel_rms <= 0.1,
            "{case}: {:.3e}",
            vs_cpu.rms_rel_rms
        );
        assert!(
            vs_diffusers.rms_rel_rms <= 0.25 + bf16_rms_bound(),
            "{case}: {:.3e}",
            vs_diffusers.rms_rel_rms
        );
    }
}
