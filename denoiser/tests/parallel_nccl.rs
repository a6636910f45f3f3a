//! Sequence and CFG parallelism on two GPUs over NCCL (feature `cuda`), in bf16, against the
//! 1-GPU bf16 run with the same weights: for every 2-GPU mesh (cfg2, ulysses2 with async Ulysses
//! off and on, ring2, attn2d 1×2 and 2×1), the full model output (batch 2; 105 tokens, which 2
//! does not divide, so every sequence-parallel mesh pads, and 48 tokens, which it does) and a
//! 2-step CFG denoise (UniPC, guidance 5, 105 tokens), for the head-dim-128 mini fixture (2 heads)
//! and a 4-head random model (4 heads × 128, 2 layers). Device tensors cross NCCL in place
//! (`common/src/collectives/wire.rs`).
//!
//! Skips (with a message) with fewer than 2 GPUs or without libcuda/libnccl, but fails when the
//! environment sets `DITSTREAM_REQUIRE_GPUS` ≥ 2, as `scripts/gpu-parallel.sh` does. Each
//! comparison prints an `NCCLPARITY` line that the script summarises.
//!
//! ## Tolerances (bf16)
//! The 2-GPU run computes the same function as the 1-GPU run; what differs is f32 summation order:
//! the LSE merges of Ring and Attention2D, and, on every mesh, cuBLASLt's choice of algorithm (and
//! split-K) for GEMMs of another M (half the tokens per GPU, or batch 1 instead of 2 under CFG). A
//! reordered f32 sum differs by ~√K·2⁻²⁴ relative; rounded to bf16 (u = 2⁻⁸ relative per store) the
//! two runs agree except where a value falls within that distance of a rounding boundary, and then
//! differ by one bf16 ulp, after which the difference propagates through the remaining ops as a
//! rounding error does. So the gap between the runs is at most that of two *independent* bf16
//! rounding chains over the model: with N ≈ 70 roundings on the latent → output path of a 2-block
//! model (counted in `wan_cuda.rs`), each uniform within ±u (RMS u/√3), in quadrature, two chains
//! give RMS(diff)/RMS(want) ≤ √2·(u/√3)·√N ≈ 0.027. As in `wan_cuda.rs`, a factor 2 covers
//! amplification the estimate does not count (partly cancelling residual sums, softmax with
//! |logit| = O(1)): **forward RMS bound 2·√2·(u/√3)·√N ≈ 0.053** of the output's RMS, and the
//! largest single error **5 × that ≈ 0.27** (a Gaussian's largest of ≤ 1e5 draws is < 4.5σ).
//! The denoise combines the branches as u + g·(c − u): a branch error is amplified by up to g = 5
//! before the sampler moves the latent by Σ dt·v (Σ dt = 1 over the schedule), so the **denoise
//! bounds are g × the forward ones** relative to the final latent's RMS (the CPU harness scales
//! its f32 bound the same way). Most ops see identical inputs on both paths, so measured errors sit
//! far below the bounds; the bounds are for "same maths", and what they catch here is what the
//! device path can break: a race between the kernels' and NCCL's streams, a wrong view or length,
//! stale or unwritten receive buffers — garbage of RMS error ≳ 0.3–1. Masking and layout bugs are
//! pinned at 1e-5 (f32) by the CPU harness `parallel_vs_single.rs`, which runs the same wrappers.
//!
//! Ranks of one sequence group gather the same sequence and run the same head on it; ranks of a
//! CFG group all-gather the same predictions and step the sampler on the host: their results must
//! agree within the same bounds (and are reported as bitwise equal or not).

#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ditstream_common::collectives::nccl::NcclWorld;
use ditstream_common::config::{Preset, SamplerKind};
use ditstream_common::mesh::{CpLayout, Mesh};
use ditstream_denoiser::denoise::{self, Control, DenoiseParams, Experts};
use ditstream_denoiser::model::{WanConfig, WanTransformer};
use ditstream_denoiser::parallel::{self, MeshComms};
use ditstream_kernels::weights::RandomWeights;
use ditstream_kernels::{DType, Device, Tensor};

/// u = 2⁻⁸: the relative rounding error of one bf16 store.
const BF16_U: f64 = 1.0 / 256.0;
/// Roundings along the latent → output path of a two-block model (see `wan_cuda.rs`).
const BF16_ROUNDINGS: f64 = 70.0;
/// Guidance scale of the denoise.
const GUIDANCE: f64 = 5.0;
/// Per-collective timeout (first steps compile kernels on both GPUs).
const TIMEOUT: Duration = Duration::from_secs(120);

/// Forward bound on RMS(diff)/RMS(want): 2·√2·(u/√3)·√N ≈ 0.053.
fn forward_rms_bound() -> f64 {
    2.0 * 2f64.sqrt() * BF16_U / 3f64.sqrt() * BF16_ROUNDINGS.sqrt()
}

/// (rms, max) bounds of a comparison kind.
fn bounds(kind: &str) -> (f64, f64) {
    let rms = forward_rms_bound() * if kind == "denoise" { GUIDANCE } else { 1.0 };
    (rms, 5.0 * rms)
}

fn fixture(name: &str) -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let root = if built.is_dir() {
        built
    } else {
        PathBuf::from("tests/fixtures") // the GPU machine runs the prebuilt test from denoiser/
    };
    root.join(name)
}

/// Which model a run uses; each rank builds its own copy on its GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Which {
    /// The head-dim-128 mini fixture: 2 heads, 2 layers, in_channels 16, text_dim 64.
    Mini128,
    /// Random weights: 4 heads × 128, 2 layers.
    FourHeads,
}

impl Which {
    fn name(self) -> &'static str {
        match self {
            Which::Mini128 => "mini128",
            Which::FourHeads => "4heads",
        }
    }

    fn load(self, device: Device) -> WanTransformer {
        match self {
            Which::Mini128 => {
                WanTransformer::from_dir(&fixture("dit_mini128/transformer"), DType::BF16, device)
                    .unwrap()
            }
            Which::FourHeads => {
                let mut cfg = WanConfig::preset(Preset::Tiny);
                cfg.num_attention_heads = 4;
                cfg.attention_head_dim = 128;
                cfg.num_layers = 2;
                cfg.in_channels = 16;
                cfg.out_channels = 16;
                cfg.text_dim = 64;
                cfg.ffn_dim = 1024;
                WanTransformer::new(cfg, &RandomWeights::new(7), DType::BF16, device).unwrap()
            }
        }
    }
}

/// The 2-GPU meshes, each with async Ulysses off or on (ulysses2 both ways).
fn meshes() -> Vec<(Mesh, bool)> {
    vec![
        (Mesh::new(2, 1, CpLayout::None, 1), false),
        (Mesh::new(1, 1, CpLayout::None, 2), false),
        (Mesh::new(1, 1, CpLayout::None, 2), true),
        (Mesh::new(1, 1, CpLayout::Ring(2), 1), false),
        (
            Mesh::new(1, 1, CpLayout::Attn2d { rows: 1, cols: 2 }, 1),
            false,
        ),
        (
            Mesh::new(1, 1, CpLayout::Attn2d { rows: 2, cols: 1 }, 1),
            false,
        ),
    ]
}

/// A mesh and its Ulysses schedule, as the parity lines print them.
fn label((mesh, async_ulysses): (Mesh, bool)) -> String {
    if async_ulysses {
        format!("{mesh}, async ulysses")
    } else {
        mesh.to_string()
    }
}

/// 105 tokens: odd, so sequence degree 2 pads. 48 tokens: even.
const GRIDS: [[usize; 3]; 2] = [[3, 5, 7], [2, 4, 6]];

/// Inputs of one forward (host tensors; the model moves them to its GPU).
struct Inputs {
    x: Tensor,
    t: Tensor,
    ctx: Tensor,
}

fn inputs(cfg: &WanConfig, grid: [usize; 3]) -> Inputs {
    let [f, h, w] = grid;
    let b = 2;
    Inputs {
        x: Tensor::randn(
            &[b, cfg.in_channels, f, 2 * h, 2 * w],
            DType::F32,
            11,
            Device::Cpu,
        )
        .unwrap(),
        t: Tensor::from_vec(vec![900.0, 600.0], &[b]).unwrap(),
        ctx: Tensor::randn(&[b, 7, cfg.text_dim], DType::F32, 12, Device::Cpu).unwrap(),
    }
}

fn params() -> DenoiseParams {
    DenoiseParams {
        sampler: SamplerKind::Unipc,
        steps: 2,
        shift: 3.0,
        guidance_scale: GUIDANCE,
        guidance_scale_2: None,
    }
}

/// Denoise inputs: latents [1, C, 3, 10, 14] (105 tokens), cond and uncond [1, 7, text_dim].
fn denoise_inputs(cfg: &WanConfig) -> (Tensor, Tensor, Tensor) {
    let latents = denoise::initial_noise([1, cfg.in_channels, 3, 10, 14], 5).unwrap();
    let cond = Tensor::randn(&[1, 7, cfg.text_dim], DType::F32, 21, Device::Cpu).unwrap();
    let uncond = Tensor::randn(&[1, 7, cfg.text_dim], DType::F32, 22, Device::Cpu).unwrap();
    (latents, cond, uncond)
}

/// The 1-GPU results on cuda:0: the forward per grid, then the denoise.
fn single_gpu(which: Which) -> (Vec<Vec<f32>>, Vec<f32>) {
    let model = which.load(Device::Cuda(0));
    let cfg = model.config().clone();
    let forwards = GRIDS
        .iter()
        .map(|&g| {
            let inp = inputs(&cfg, g);
            let out = model.forward(&inp.x, &inp.t, &inp.ctx).unwrap();
            assert_eq!(out.dtype(), DType::BF16);
            out.to_vec_f32().unwrap()
        })
        .collect();
    let (latents, cond, uncond) = denoise_inputs(&cfg);
    let experts = Experts {
        high: &model,
        low: None,
    };
    let den = denoise::denoise(experts, &params(), latents, &cond, Some(&uncond), |_| {
        Control::Continue
    })
    .unwrap();
    (forwards, den.to_vec_f32().unwrap())
}

/// One rank's results for every mesh: (forwards per grid, denoise).
type RankResults = Vec<(Vec<Vec<f32>>, Vec<f32>)>;

/// Every mesh on both GPUs, one NCCL world; each rank's results, or the first rank error.
fn two_gpu(which: Which) -> Vec<RankResults> {
    let out = NcclWorld::run_local(2, TIMEOUT, |world| -> Result<RankResults, String> {
        let rank = ditstream_common::collectives::CommWorld::rank(&world);
        let model = which.load(Device::Cuda(rank));
        let cfg = model.config().clone();
        let mut results = Vec::new();
        for (mesh, async_ulysses) in meshes() {
            let comms = MeshComms::new(&world, mesh)
                .map_err(|e| format!("{mesh}: {e}"))?
                .with_async_ulysses(async_ulysses);
            let mut forwards = Vec::new();
            for &g in &GRIDS {
                let inp = inputs(&cfg, g);
                let out = parallel::forward(&model, &comms, &inp.x, &inp.t, &inp.ctx)
                    .map_err(|e| format!("{mesh} forward {g:?}: {e}"))?;
                if out.device() != Device::Cuda(rank) || out.dtype() != DType::BF16 {
                    return Err(format!(
                        "{mesh}: output on {} as {:?}",
                        out.device(),
                        out.dtype()
                    ));
                }
                forwards.push(out.to_vec_f32().map_err(|e| e.to_string())?);
            }
            let (latents, cond, uncond) = denoise_inputs(&cfg);
            let experts = Experts {
                high: &model,
                low: None,
            };
            let den = parallel::denoise(
                experts,
                &comms,
                &params(),
                latents,
                &cond,
                Some(&uncond),
                |_| Control::Continue,
            )
            .map_err(|e| format!("{mesh} denoise: {e}"))?;
            results.push((forwards, den.to_vec_f32().map_err(|e| e.to_string())?));
        }
        Ok(results)
    })
    .unwrap_or_else(|e| panic!("NCCL world: {e}"));
    out.into_iter()
        .enumerate()
        .map(|(r, res)| match res {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => panic!("{}: rank {r} failed: {e}", which.name()),
            Err(e) => panic!("{}: rank {r} did not start: {e}", which.name()),
        })
        .collect()
}

/// (RMS(got − want), max|got − want|) over RMS(want).
fn errors(got: &[f32], want: &[f32]) -> (f64, f64) {
    assert_eq!(got.len(), want.len());
    let n = want.len().max(1) as f64;
    let rms_want = (want.iter().map(|&w| f64::from(w).powi(2)).sum::<f64>() / n)
        .sqrt()
        .max(f64::MIN_POSITIVE);
    let (mut max_abs, mut sum_sq) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let d = (f64::from(g) - f64::from(w)).abs();
        if d.is_nan() {
            return (f64::NAN, f64::NAN);
        }
        max_abs = max_abs.max(d);
        sum_sq += d * d;
    }
    ((sum_sq / n).sqrt() / rms_want, max_abs / rms_want)
}

/// Compares, prints the `NCCLPARITY` line, and returns a failure message if out of bounds.
fn compare(
    which: Which,
    mesh: &str,
    kind: &str,
    rank: usize,
    got: &[f32],
    want: &[f32],
    same_as_rank0: bool,
) -> Option<String> {
    let (rms, max) = errors(got, want);
    let (rms_bound, max_bound) = bounds(kind);
    let ok = rms <= rms_bound && max <= max_bound;
    println!(
        "NCCLPARITY\t{}\t{mesh}\t{kind}\trank {rank}\trms/rms {rms:.2e}\tmax/rms {max:.2e}\t\
         bounds {rms_bound:.3} {max_bound:.3}\tranks bitwise {same_as_rank0}\t{}",
        which.name(),
        if ok { "ok" } else { "FAIL" }
    );
    (!ok).then(|| {
        format!(
            "{} {mesh} {kind} rank {rank}: rms {rms:e} (≤ {rms_bound}), max {max:e} (≤ {max_bound})",
            which.name()
        )
    })
}

fn parity(which: Which) {
    if !ditstream_kernels::testing::test_gpus(2) {
        return;
    }
    let started = Instant::now();
    let (want_fwd, want_den) = single_gpu(which);
    let ranks = two_gpu(which);
    let mut failures = Vec::new();
    for (m, entry) in meshes().into_iter().enumerate() {
        let mesh = &label(entry);
        for (rank, results) in ranks.iter().enumerate() {
            let (fwd, den) = &results[m];
            let (fwd0, den0) = &ranks[0][m];
            for (g, grid) in GRIDS.iter().enumerate() {
                let tokens: usize = grid.iter().product();
                let kind = format!("forward {tokens} tokens");
                failures.extend(compare(
                    which,
                    mesh,
                    &kind,
                    rank,
                    &fwd[g],
                    &want_fwd[g],
                    fwd[g] == fwd0[g],
                ));
                // Ranks must agree with each other within the same bounds.
                failures.extend(compare(
                    which,
                    mesh,
                    &format!("{kind} vs rank 0"),
                    rank,
                    &fwd[g],
                    &fwd0[g],
                    fwd[g] == fwd0[g],
                ));
            }
            failures.extend(compare(
                which,
                mesh,
                "denoise",
                rank,
                den,
                &want_den,
                den == den0,
            ));
        }
    }
    eprintln!(
        "{}: {} meshes on 2 GPUs in {:.1}s",
        which.name(),
        meshes().len(),
        started.elapsed().as_secs_f32()
    );
    assert!(
        failures.is_empty(),
        "out of bounds:\n{}",
        failures.join("\n")
    );
}

#[test]
fn two_gpu_meshes_match_one_gpu_mini128() {
    parity(Which::Mini128);
}

#[test]
fn two_gpu_meshes_match_one_gpu_four_heads() {
    parity(Which::FourHeads);
}

#[test]
fn async_ulysses_orders_its_streams_on_one_gpu() {
    // One GPU, a Ulysses group of one rank over NCCL: each exchange is the pack and a self
    // send/recv on the communicator's stream, posted while the next projection runs on the
    // kernels' stream. The values are the single-rank ones, bitwise, only if every exchange waits
    // for its operand's producers and the attention for the exchanges; a missing event reads a
    // half-written projection or receive buffer. 4,096 tokens make the projections long enough
    // to race, batch 2 takes the unpack path and batch 1 the direct one.
    if !ditstream_kernels::testing::test_gpus(1) {
        return;
    }
    let out = NcclWorld::run_local(1, TIMEOUT, |world| -> Result<(), String> {
        let model = Which::FourHeads.load(Device::Cuda(0));
        let cfg = model.config().clone();
        let group = ditstream_common::collectives::CommWorld::split(&world, &[vec![0]])
            .map_err(|e| e.to_string())?
            .ok_or("rank 0 is not in its own group")?;
        let comms = MeshComms::new(&world, Mesh::new(1, 1, CpLayout::None, 1))
            .map_err(|e| e.to_string())?;
        for (b, grid) in [(2, [4, 32, 32]), (1, [3, 5, 7])] {
            let [f, h, w] = grid;
            let x = Tensor::randn(&[b, cfg.in_channels, f, 2 * h, 2 * w], DType::F32, 11, Device::Cpu)
                .map_err(|e| e.to_string())?;
            let t = Tensor::from_vec(vec![900.0; b], &[b]).map_err(|e| e.to_string())?;
            let ctx = Tensor::randn(&[b, 7, cfg.text_dim], DType::F32, 12, Device::Cpu)
                .map_err(|e| e.to_string())?;
            let want = model.forward(&x, &t, &ctx).map_err(|e| e.to_string())?;
            for overlap in [false, true] {
                let got = parallel::forward_with(&model, &comms, &x, &t, &ctx, |tokens| {
                    let local = parallel::LocalChunk { tokens, fp8: false };
                    Box::new(parallel::UlyssesAttention::new(&group, local).with_async(overlap))
                })
                .map_err(|e| e.to_string())?;
                let (got, want) = (got.to_vec_f32().map_err(|e| e.to_string())?, want.to_vec_f32().map_err(|e| e.to_string())?);
                let differing = got.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                println!("NCCLASYNC\tbatch {b}\t{grid:?}\tasync {overlap}\t{differing} of {} values differ", want.len());
                if differing != 0 {
                    return Err(format!("batch {b}, async {overlap}: {differing} values differ from the single-rank forward"));
                }
            }
        }
        Ok(())
    })
    .unwrap_or_else(|e| panic!("NCCL world: {e}"));
    for res in out {
        res.unwrap_or_else(|e| panic!("rank 0 did not start: {e}"))
            .unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn bounds_are_the_derived_ones() {
    let (rms, max) = bounds("forward 105 tokens");
    assert!((rms - 0.0534).abs() < 1e-3, "{rms}");
    assert!((max - 0.267).abs() < 2e-3, "{max}");
    assert!((bounds("denoise").0 - 5.0 * rms).abs() < 1e-12);
}
