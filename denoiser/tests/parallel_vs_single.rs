//! The parity harness of sequence and CFG parallelism on the CPU thread backend: every mesh of
//! at most 8 ranks that validation accepts (cfg ∈ {1, 2}; Ulysses over the divisors of the head
//! count; ring ∈ {2, 3, 4}; attn2d ∈ {1×2, 2×1, 2×2, 1×4, 4×1}; their compositions), for the
//! head-dim-128 mini model (2 heads) and an 8-head random model, against the single-rank run
//! with the same weights: the full model output (batch 2), a 2-step CFG denoise, token counts
//! that no degree divides (105 = 3·5·7 tokens; 9 tokens on 8 ranks, where whole shards are
//! padding; 63 tokens, an 81-frame-style 21 latent frames), per-token timesteps, expert
//! switching; and the failure paths (a failing or panicking rank, cancellation, a mesh the model
//! cannot use).
//!
//! Tolerance (fp32). The parallel run computes the same sums in another order. Ulysses,
//! Attention2D R×1 and padding change only which rank computes a row: bitwise equal (measured 0).
//! Ring and Attention2D with C > 1 merge per-chunk softmax partials through their LSE, a few f32
//! roundings per merge (~1e-7 relative each); over 2 blocks with residuals the measured worst is
//! 4.5e-7 of the output's largest magnitude. CFG multiplies differences by the guidance scale
//! g = 5 and UniPC's 2 steps add a little: measured worst 1.2e-6. We assert the 1e-5 of
//! the output's largest magnitude for the forward and g·1e-5 for the denoise: 20-40× above what
//! reordering produces, 10× below diffusers' context-parallel fp32 tolerance (1e-4), and 70×
//! below what one unmasked padded key does (6.9e-4, `a_mask_bug_would_be_caught`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ditstream_common::collectives::cpu::{CpuComm, CpuWorld};
use ditstream_common::config::SamplerKind;
use ditstream_common::mesh::{CpLayout, Mesh};
use ditstream_denoiser::denoise::{self, Control, DenoiseError, DenoiseParams, Experts};
use ditstream_denoiser::model::{WanConfig, WanTransformer};
use ditstream_denoiser::parallel::{self, MeshComms, ParallelError};
use ditstream_kernels::weights::RandomWeights;
use ditstream_kernels::{DType, Device, Tensor};

/// Forward: max |parallel − single| ≤ FORWARD_TOL · max |single|.
const FORWARD_TOL: f32 = 1e-5;
/// Guidance scale of the denoise tests.
const GUIDANCE: f64 = 5.0;
/// Denoise: max |parallel − single| ≤ DENOISE_TOL · max |single| (g · FORWARD_TOL).
const DENOISE_TOL: f32 = GUIDANCE as f32 * FORWARD_TOL;
/// Generous for a loaded 2-core box: the whole harness runs many 8-thread worlds.
const TIMEOUT: Duration = Duration::from_secs(60);

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The head-dim-128 mini model (2 heads, 2 layers, in_channels 16, text_dim 64).
fn mini128() -> WanTransformer {
    WanTransformer::from_dir(&fixture("dit_mini128/transformer"), DType::F32, Device::Cpu).unwrap()
}

/// 8 heads of dim 16, 2 layers, random weights: Ulysses up to 8.
fn eight_heads(seed: u64) -> WanTransformer {
    let mut cfg = WanConfig::preset(ditstream_common::config::Preset::Tiny);
    cfg.num_attention_heads = 8;
    cfg.attention_head_dim = 16;
    cfg.in_channels = 4;
    cfg.out_channels = 4;
    cfg.text_dim = 32;
    cfg.ffn_dim = 192;
    WanTransformer::new(cfg, &RandomWeights::new(seed), DType::F32, Device::Cpu).unwrap()
}

/// Every mesh of 2..=8 ranks for a model of `heads` heads.
fn meshes(heads: usize) -> Vec<Mesh> {
    let cps = [
        CpLayout::None,
        CpLayout::Ring(2),
        CpLayout::Ring(3),
        CpLayout::Ring(4),
        CpLayout::Attn2d { rows: 1, cols: 2 },
        CpLayout::Attn2d { rows: 2, cols: 1 },
        CpLayout::Attn2d { rows: 2, cols: 2 },
        CpLayout::Attn2d { rows: 1, cols: 4 },
        CpLayout::Attn2d { rows: 4, cols: 1 },
    ];
    let mut out = Vec::new();
    for cfg in [1, 2] {
        for uly in (1..=heads).filter(|u| heads.is_multiple_of(*u)) {
            for cp in cps {
                let m = Mesh::new(cfg, 1, cp, uly);
                if (2..=8).contains(&m.world_size()) {
                    out.push(m);
                }
            }
        }
    }
    out
}

/// Runs `f` on every rank of `mesh` (threads) and returns each rank's value; panics naming the
/// rank on any error.
fn run<R: Send>(
    mesh: Mesh,
    f: impl Fn(&MeshComms<CpuComm>) -> Result<R, ParallelError> + Sync,
) -> Vec<R> {
    run_with(mesh, false, f)
}

/// [`run`] with async Ulysses on or off.
fn run_with<R: Send>(
    mesh: Mesh,
    async_ulysses: bool,
    f: impl Fn(&MeshComms<CpuComm>) -> Result<R, ParallelError> + Sync,
) -> Vec<R> {
    let world = CpuWorld::new(mesh.world_size()).with_timeout(TIMEOUT);
    let out = world.run(|rank| {
        let comms = MeshComms::new(&rank, mesh)?.with_async_ulysses(async_ulysses);
        f(&comms)
    });
    out.into_iter()
        .enumerate()
        .map(|(r, res)| match res {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => panic!("{mesh}: rank {r} failed: {e}"),
            Err(p) => panic!("{mesh}: rank {r} panicked: {p}"),
        })
        .collect()
}

/// max |got − want| / max |want|.
fn rel_err(got: &Tensor, want: &Tensor) -> f32 {
    assert_eq!(got.shape(), want.shape());
    let (g, w) = (got.to_vec_f32().unwrap(), want.to_vec_f32().unwrap());
    let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = g.iter().zip(&w).fold(0f32, |m, (a, b)| {
        if (a - b).is_nan() {
            f32::NAN
        } else {
            m.max((a - b).abs())
        }
    });
    diff / scale
}

/// Inputs of one forward: x [B, C, T, H, W], timestep [B] or [B, L], context [B, 7, text_dim].
struct Inputs {
    x: Tensor,
    t: Tensor,
    ctx: Tensor,
}

fn inputs(model: &WanTransformer, b: usize, grid: [usize; 3], per_token: bool) -> Inputs {
    let cfg = model.config();
    let [f, h, w] = grid;
    let x = Tensor::randn(
        &[b, cfg.in_channels, f, 2 * h, 2 * w],
        DType::F32,
        11,
        Device::Cpu,
    )
    .unwrap();
    let l = f * h * w;
    let t = if per_token {
        // A ramp over tokens, different per sample (Wan 2.2 TI2V style).
        let v = (0..b * l)
            .map(|i| 100.0 + 800.0 * (i % l) as f32 / l as f32 + 50.0 * (i / l) as f32)
            .collect();
        Tensor::from_vec(v, &[b, l]).unwrap()
    } else {
        Tensor::from_vec((0..b).map(|i| 900.0 - 300.0 * i as f32).collect(), &[b]).unwrap()
    };
    let ctx = Tensor::randn(&[b, 7, cfg.text_dim], DType::F32, 12, Device::Cpu).unwrap();
    Inputs { x, t, ctx }
}

/// The parallel forward on every rank of `mesh` equals the single-rank forward; returns the
/// worst relative error.
fn check_forward(model: &WanTransformer, mesh: Mesh, inp: &Inputs) -> f32 {
    let want = model.forward(&inp.x, &inp.t, &inp.ctx).unwrap();
    let outs = run(mesh, |comms| {
        parallel::forward(model, comms, &inp.x, &inp.t, &inp.ctx)
    });
    let mut worst = 0f32;
    for (r, got) in outs.iter().enumerate() {
        let err = rel_err(got, &want);
        assert!(
            err <= FORWARD_TOL,
            "{mesh}, {:?} tokens: rank {r} forward differs by {err:e} of the output scale",
            inp.x.shape()
        );
        worst = worst.max(err);
    }
    worst
}

fn params(steps: usize, guidance: f64) -> DenoiseParams {
    DenoiseParams {
        sampler: SamplerKind::Unipc,
        steps,
        shift: 3.0,
        guidance_scale: guidance,
        guidance_scale_2: Some(3.0),
    }
}

/// Text states for the denoise tests: (cond, uncond), [1, 7, text_dim] each.
fn prompts(model: &WanTransformer) -> (Tensor, Tensor) {
    let td = model.config().text_dim;
    (
        Tensor::randn(&[1, 7, td], DType::F32, 21, Device::Cpu).unwrap(),
        Tensor::randn(&[1, 7, td], DType::F32, 22, Device::Cpu).unwrap(),
    )
}

/// The parallel denoise on every rank equals the single-rank loop; returns the worst error.
fn check_denoise(experts: Experts<'_>, mesh: Mesh, grid: [usize; 3], steps: usize) -> f32 {
    check_denoise_with(experts, mesh, false, grid, steps).0
}

/// [`check_denoise`] with async Ulysses on or off; also returns every rank's latent.
fn check_denoise_with(
    experts: Experts<'_>,
    mesh: Mesh,
    async_ulysses: bool,
    grid: [usize; 3],
    steps: usize,
) -> (f32, Vec<Tensor>) {
    let cfg = experts.high.config();
    let [f, h, w] = grid;
    let shape = [1, cfg.in_channels, f, 2 * h, 2 * w];
    let latents = denoise::initial_noise(shape, 5).unwrap();
    let (cond, uncond) = prompts(experts.high);
    let p = params(steps, GUIDANCE);
    let want = denoise::denoise(experts, &p, latents.clone(), &cond, Some(&uncond), |_| {
        Control::Continue
    })
    .unwrap();
    let outs = run_with(mesh, async_ulysses, |comms| {
        parallel::denoise(
            experts,
            comms,
            &p,
            latents.clone(),
            &cond,
            Some(&uncond),
            |_| Control::Continue,
        )
    });
    let mut worst = 0f32;
    for (r, got) in outs.iter().enumerate() {
        let err = rel_err(got, &want);
        assert!(
            err <= DENOISE_TOL,
            "{mesh}: rank {r} denoise differs by {err:e} of the latent scale"
        );
        // Every rank steps the sampler itself: the latents must agree exactly.
        assert_eq!(
            got.to_vec_f32().unwrap(),
            outs[0].to_vec_f32().unwrap(),
            "{mesh}: ranks 0 and {r} disagree"
        );
        worst = worst.max(err);
    }
    (worst, outs)
}

/// 105 tokens (3·5·7): divisible by 3, 5 and 7 only, so most degrees pad.
const GRID_105: [usize; 3] = [3, 5, 7];

fn harness(name: &str, model: &WanTransformer) {
    let heads = model.config().num_attention_heads;
    let started = Instant::now();
    let inp = inputs(model, 2, GRID_105, false);
    let mut worst = (0f32, 0f32);
    let all = meshes(heads);
    for &mesh in &all {
        let t0 = Instant::now();
        let fwd = check_forward(model, mesh, &inp);
        let experts = Experts {
            high: model,
            low: None,
        };
        let den = check_denoise(experts, mesh, GRID_105, 2);
        eprintln!(
            "{name} {mesh}: forward {fwd:.1e}, denoise {den:.1e} ({:.2}s)",
            t0.elapsed().as_secs_f32()
        );
        worst = (worst.0.max(fwd), worst.1.max(den));
    }
    eprintln!(
        "{name}: {} meshes, worst forward {:.1e}, worst denoise {:.1e}, {:.1}s",
        all.len(),
        worst.0,
        worst.1,
        started.elapsed().as_secs_f32()
    );
}

#[test]
fn every_mesh_matches_single_rank_mini128() {
    harness("mini128", &mini128());
}

#[test]
fn every_mesh_matches_single_rank_eight_heads() {
    harness("8 heads", &eight_heads(3));
}

#[test]
fn whole_shards_of_padding() {
    // 9 tokens on 8 sequence ranks: shards of 2, the last three hold no real token (and Ring and
    // Attention2D see key chunks with none).
    let model = eight_heads(4);
    let inp = inputs(&model, 2, [1, 3, 3], false);
    for mesh in [
        Mesh::new(1, 1, CpLayout::None, 8),
        Mesh::new(1, 1, CpLayout::Ring(8), 1),
        Mesh::new(1, 1, CpLayout::Attn2d { rows: 2, cols: 4 }, 1),
        Mesh::new(1, 1, CpLayout::Attn2d { rows: 4, cols: 2 }, 1),
        Mesh::new(1, 1, CpLayout::Ring(4), 2),
        Mesh::new(1, 1, CpLayout::Attn2d { rows: 2, cols: 2 }, 2),
        Mesh::new(1, 1, CpLayout::Ring(7), 1),
    ] {
        let err = check_forward(&model, mesh, &inp);
        eprintln!("9 tokens {mesh}: {err:.1e}");
    }
}

#[test]
fn odd_frame_counts_and_per_token_timesteps() {
    // 81 frames → 21 latent frames; 21·1·3 = 63 tokens, odd.
    let model = eight_heads(5);
    let grid = [21, 1, 3];
    let inp = inputs(&model, 1, grid, false);
    let per_token = inputs(&model, 2, GRID_105, true);
    for mesh in [
        Mesh::new(1, 1, CpLayout::Ring(4), 2),
        Mesh::new(1, 1, CpLayout::Attn2d { rows: 2, cols: 2 }, 2),
        Mesh::new(1, 1, CpLayout::Ring(3), 2),
        Mesh::new(1, 1, CpLayout::None, 8),
    ] {
        let a = check_forward(&model, mesh, &inp);
        let b = check_forward(&model, mesh, &per_token);
        eprintln!("63 tokens {mesh}: {a:.1e}; per-token timesteps: {b:.1e}");
    }
}

#[test]
fn expert_switching_on_a_cfg_mesh() {
    // Wan2.2-A14B: the high-noise expert above t = 875, the low-noise one below, each with its
    // own guidance scale; 3 steps with shift 3 cross the boundary.
    let (high, low) = (eight_heads(6), eight_heads(7));
    let experts = Experts {
        high: &high,
        low: Some((&low, 0.875)),
    };
    for mesh in [
        Mesh::new(2, 1, CpLayout::None, 2),
        Mesh::new(2, 1, CpLayout::Attn2d { rows: 1, cols: 2 }, 1),
    ] {
        let err = check_denoise(experts, mesh, GRID_105, 3);
        eprintln!("experts {mesh}: {err:.1e}");
    }
}

#[test]
fn a_mask_bug_would_be_caught() {
    // The tolerance must see one padded key let through: Ulysses 2 on 105 tokens (shards of 53,
    // one padded token) with an inner attention that believes the sequence has 106 tokens.
    let model = eight_heads(8);
    let inp = inputs(&model, 1, GRID_105, false);
    let want = model.forward(&inp.x, &inp.t, &inp.ctx).unwrap();
    let mesh = Mesh::new(1, 1, CpLayout::None, 2);
    let outs = run(mesh, |comms| {
        parallel::forward_with(&model, comms, &inp.x, &inp.t, &inp.ctx, |tokens| {
            let uly = comms.ulysses.as_ref().expect("a Ulysses group of 2");
            let unmasked = parallel::LocalChunk {
                tokens: tokens + 1,
                fp8: false,
            };
            Box::new(parallel::UlyssesAttention::new(uly, unmasked))
        })
    });
    let err = rel_err(&outs[0], &want);
    eprintln!("one unmasked padded key: {err:.1e}");
    assert!(
        err > 10.0 * FORWARD_TOL,
        "an unmasked padded key moved the output by only {err:e}"
    );
}

#[test]
fn async_ulysses_is_the_same_computation() {
    // Async Ulysses only reorders the host's work (V projected and sent, then Q under V's
    // transfer, then K under Q's): on every mesh with a Ulysses group, its forward must be bitwise
    // the synchronous one, which is itself within FORWARD_TOL of the single rank (0 measured for
    // Ulysses alone). 105 tokens pad on every degree here but 3, 5 and 7; batch 2 takes the
    // exchange's unpack path, and the 63-token batch-1 case its direct path.
    let model = eight_heads(11);
    let batch2 = inputs(&model, 2, GRID_105, false);
    let batch1 = inputs(&model, 1, [21, 1, 3], false);
    let uly_meshes: Vec<Mesh> = meshes(8)
        .into_iter()
        .filter(|m| m.ulysses_size() > 1)
        .collect();
    assert!(
        uly_meshes.len() >= 10,
        "{} Ulysses meshes",
        uly_meshes.len()
    );
    for mesh in uly_meshes {
        for inp in [&batch2, &batch1] {
            let forward = |async_ulysses| {
                run_with(mesh, async_ulysses, |comms| {
                    parallel::forward(&model, comms, &inp.x, &inp.t, &inp.ctx)
                })
            };
            let (sync, overlapped) = (forward(false), forward(true));
            for (r, (a, b)) in sync.iter().zip(&overlapped).enumerate() {
                assert_eq!(
                    a.to_vec_f32().unwrap(),
                    b.to_vec_f32().unwrap(),
                    "{mesh}, {:?}: rank {r}'s async forward differs from the synchronous one",
                    inp.x.shape()
                );
            }
            let want = model.forward(&inp.x, &inp.t, &inp.ctx).unwrap();
            let err = rel_err(&overlapped[0], &want);
            assert!(err <= FORWARD_TOL, "{mesh}: async forward off by {err:e}");
        }
    }
    // And through the CFG denoise loop, on a mesh of both branches and a Ring inside Ulysses:
    // within the bound of the single rank, and bitwise the synchronous schedule on every rank.
    let experts = Experts {
        high: &model,
        low: None,
    };
    let mesh = Mesh::new(2, 1, CpLayout::Ring(2), 2);
    let (_, sync) = check_denoise_with(experts, mesh, false, GRID_105, 2);
    let (_, overlapped) = check_denoise_with(experts, mesh, true, GRID_105, 2);
    for (r, (a, b)) in sync.iter().zip(&overlapped).enumerate() {
        assert_eq!(
            a.to_vec_f32().unwrap(),
            b.to_vec_f32().unwrap(),
            "{mesh}: rank {r}'s async denoise differs from the synchronous one"
        );
    }
}

/// An attention whose operand Q fails on one rank (after the exchanges of V, or of K and V,
/// were posted).
struct FailsAtQ<A> {
    inner: A,
    fail: bool,
}

impl<A: parallel::ChunkAttention> parallel::ChunkAttention for FailsAtQ<A> {
    fn attend_chunk(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor, ParallelError> {
        self.inner.attend_chunk(q, k, v)
    }
    fn attend_chunk_staged(
        &self,
        operand: &mut parallel::attention::StagedOperand<'_>,
    ) -> Result<Tensor, ParallelError> {
        self.inner.attend_chunk_staged(&mut |which| {
            if self.fail && which == ditstream_denoiser::model::Operand::Q {
                return Err(ParallelError::Shape {
                    what: "test operand",
                    shape: vec![],
                    rule: "rank 1 fails while V travels",
                });
            }
            operand(which)
        })
    }
}

#[test]
fn a_rank_failing_between_posted_exchanges_fails_every_rank_without_hanging() {
    // Rank 1's Q fails after it posted V's all-to-all (async Ulysses 4) or the K/V gather over
    // its column (Attention2D 2×1): every rank must fail, and none may hang on the posted transfer.
    let model = eight_heads(12);
    let inp = inputs(&model, 1, GRID_105, false);
    let ulysses = Mesh::new(1, 1, CpLayout::None, 4);
    let attn2d = Mesh::new(1, 1, CpLayout::Attn2d { rows: 2, cols: 1 }, 1);
    for mesh in [ulysses, attn2d] {
        let (out, took) = run_raw(mesh, Duration::from_secs(30), |comms| {
            parallel::forward_with(&model, comms, &inp.x, &inp.t, &inp.ctx, |tokens| {
                let fail = comms.rank() == 1;
                let inner: Box<dyn parallel::ChunkAttention + '_> = match &comms.ulysses {
                    Some(uly) => {
                        let local = parallel::LocalChunk { tokens, fp8: false };
                        Box::new(parallel::UlyssesAttention::new(uly, local).with_async(true))
                    }
                    None => Box::new(parallel::Attention2d::new(
                        comms.row.as_ref(),
                        comms.col.as_ref(),
                        tokens,
                    )),
                };
                Box::new(FailsAtQ { inner, fail })
            })
        });
        assert!(took < Duration::from_secs(20), "{mesh}: took {took:?}");
        for (r, res) in out.iter().enumerate() {
            match res {
                Ok(Err(e)) => eprintln!("{mesh}: rank {r}: {e}"),
                other => panic!(
                    "{mesh}: rank {r} should have failed: {:?}",
                    other.as_ref().map(|r| r.is_ok())
                ),
            }
        }
        assert!(
            matches!(
                &out[1],
                Ok(Err(ParallelError::Shape {
                    what: "test operand",
                    ..
                }))
            ),
            "{mesh}: rank 1 must report its own failure"
        );
    }
}

/// Each rank's outcome in the failure tests.
type Outcomes = Vec<Result<Result<Tensor, ParallelError>, String>>;

fn run_raw(
    mesh: Mesh,
    timeout: Duration,
    f: impl Fn(&MeshComms<CpuComm>) -> Result<Tensor, ParallelError> + Sync,
) -> (Outcomes, Duration) {
    let started = Instant::now();
    let out = CpuWorld::new(mesh.world_size())
        .with_timeout(timeout)
        .run(|rank| {
            let comms = MeshComms::new(&rank, mesh)?;
            f(&comms)
        });
    (out, started.elapsed())
}

#[test]
fn a_failing_rank_fails_every_rank_without_hanging() {
    let model = mini128();
    let inp = inputs(&model, 1, GRID_105, false);
    // Rank 2 gets a latent with 3 channels instead of 16: it fails in embed, before any
    // collective, and drops its communicators; the others must fail at their next collective.
    let bad_x = Tensor::zeros(&[1, 3, 3, 10, 14], DType::F32, Device::Cpu).unwrap();
    let mesh = Mesh::new(1, 1, CpLayout::Ring(2), 2);
    // The timeout is long: the others must fail because rank 2 failed, not because they waited.
    let (out, took) = run_raw(mesh, Duration::from_secs(30), |comms| {
        let x = if comms.rank() == 2 { &bad_x } else { &inp.x };
        parallel::forward(&model, comms, x, &inp.t, &inp.ctx)
    });
    assert!(took < Duration::from_secs(20), "took {took:?}");
    for (r, res) in out.iter().enumerate() {
        match res {
            Ok(Err(e)) => eprintln!("rank {r}: {e}"),
            other => panic!(
                "rank {r} should have failed: {:?}",
                other.as_ref().map(|r| r.is_ok())
            ),
        }
    }
}

#[test]
fn a_panicking_rank_fails_every_rank_without_hanging() {
    let model = eight_heads(9);
    let (cond, uncond) = prompts(&model);
    let latents = denoise::initial_noise([1, 4, 3, 10, 14], 5).unwrap();
    let experts = Experts {
        high: &model,
        low: None,
    };
    let mesh = Mesh::new(2, 1, CpLayout::Ring(2), 1);
    let (out, took) = run_raw(mesh, Duration::from_secs(30), |comms| {
        let me = comms.rank();
        parallel::denoise(
            experts,
            comms,
            &params(3, GUIDANCE),
            latents.clone(),
            &cond,
            Some(&uncond),
            |p| {
                assert!(
                    !(me == 3 && p.step == 1),
                    "rank 3's callback panics after step 1"
                );
                Control::Continue
            },
        )
    });
    assert!(took < Duration::from_secs(20), "took {took:?}");
    assert!(
        matches!(&out[3], Err(msg) if msg.contains("panics")),
        "{:?}",
        out[3].as_ref().err()
    );
    for (r, res) in out.iter().enumerate().take(3) {
        assert!(matches!(res, Ok(Err(_))), "rank {r} should have failed");
    }
}

#[test]
fn one_rank_cancelling_cancels_every_rank() {
    let model = eight_heads(10);
    let (cond, uncond) = prompts(&model);
    let latents = denoise::initial_noise([1, 4, 3, 10, 14], 5).unwrap();
    let experts = Experts {
        high: &model,
        low: None,
    };
    let mesh = Mesh::new(2, 1, CpLayout::None, 2);
    let (out, _) = run_raw(mesh, TIMEOUT, |comms| {
        let me = comms.rank();
        parallel::denoise(
            experts,
            comms,
            &params(3, GUIDANCE),
            latents.clone(),
            &cond,
            Some(&uncond),
            |p| {
                if me == 1 && p.step == 1 {
                    Control::Cancel
                } else {
                    Control::Continue
                }
            },
        )
    });
    for (r, res) in out.iter().enumerate() {
        assert!(
            matches!(
                res,
                Ok(Err(ParallelError::Denoise(DenoiseError::Cancelled {
                    after_step: 1,
                    steps: 3
                })))
            ),
            "rank {r}: {:?}",
            res.as_ref()
                .map(|r| r.as_ref().err().map(ToString::to_string))
        );
    }
}

#[test]
fn a_mesh_the_model_cannot_use_is_refused_before_any_collective() {
    let model = mini128(); // 2 heads
    let (cond, uncond) = prompts(&model);
    let latents = denoise::initial_noise([1, 16, 3, 10, 14], 5).unwrap();
    let experts = Experts {
        high: &model,
        low: None,
    };
    let mesh = Mesh::new(1, 1, CpLayout::None, 4);
    let (out, took) = run_raw(mesh, TIMEOUT, |comms| {
        parallel::denoise(
            experts,
            comms,
            &params(2, GUIDANCE),
            latents.clone(),
            &cond,
            Some(&uncond),
            |_| Control::Continue,
        )
    });
    assert!(took < Duration::from_secs(5), "took {took:?}");
    for res in &out {
        assert!(
            matches!(
                res,
                Ok(Err(ParallelError::Mesh {
                    what: "ulysses_size",
                    value: 4,
                    ..
                }))
            ),
            "{:?}",
            res.as_ref()
                .map(|r| r.as_ref().err().map(ToString::to_string))
        );
    }
}

#[test]
fn bf16_model_on_every_two_rank_mesh() {
    // The 2-GPU meshes in the dtype they run in on GPUs: collectives move bf16, the Ring
    // accumulator and every LSE stay f32. bf16 keeps 8 significant bits (unit roundoff 2^-9 ≈
    // 2e-3); a reordered merge rounds an attention output differently by up to one bf16 ulp
    // (2^-8 ≈ 4e-3 of the value), and the next ops re-round. Ulysses and CFG are bitwise equal
    // (they only move data); Ring and Attention2D 1×2 measure 3.5e-3, one ulp of the output's
    // scale: 2e-2 (five ulps).
    const BF16_TOL: f32 = 2e-2;
    let model = WanTransformer::from_dir(
        &fixture("dit_mini128/transformer"),
        DType::BF16,
        Device::Cpu,
    )
    .unwrap();
    let inp = inputs(&model, 1, GRID_105, false);
    let want = model.forward(&inp.x, &inp.t, &inp.ctx).unwrap();
    for mesh in [
        Mesh::new(2, 1, CpLayout::None, 1),
        Mesh::new(1, 1, CpLayout::None, 2),
        Mesh::new(1, 1, CpLayout::Ring(2), 1),
        Mesh::new(1, 1, CpLayout::Attn2d { rows: 1, cols: 2 }, 1),
        Mesh::new(1, 1, CpLayout::Attn2d { rows: 2, cols: 1 }, 1),
    ] {
        let outs = run(mesh, |comms| {
            parallel::forward(&model, comms, &inp.x, &inp.t, &inp.ctx)
        });
        for (r, got) in outs.iter().enumerate() {
            assert_eq!(got.dtype(), DType::BF16);
            let err = rel_err(got, &want);
            eprintln!("bf16 {mesh}: rank {r}: {err:.1e}");
            assert!(err <= BF16_TOL, "{mesh}: rank {r}: {err:e}");
        }
    }
}

/// FP8 self-attention (`model.dtype: fp8` runs it inside every wrapper) on every two-rank mesh,
/// on the CPU's reference of the recipe. Parallel FP8 is not the single rank's bit for bit: a Ring
/// or Attention2D rank quantises each key chunk it attends to with that chunk's own scales (V per
/// channel over the chunk, K per 128 keys from the chunk's start), and a padded shard's rows enter
/// a Q block's scale. Each such choice is another rounding of the same values, of the same size as
/// the single rank's, so the parallel forward's distance to the dense (f32-attention) forward is
/// held to twice the single rank's FP8 distance, and to at least a third of it: a wrapper that
/// dropped the FP8 flag (bf16/f32 attention) would land at ~0 and fail, one that merged FP8
/// partials wrongly would land far above. CFG only splits the batch, whose quantisation is per
/// sample: it must equal the single rank exactly. (Ulysses, which gathers each head's whole
/// sequence, measured exactly equal too here; padding could move a Q block's scale, so only the
/// bound is asserted for it.)
#[test]
fn fp8_attention_on_every_two_rank_mesh() {
    let dense = mini128();
    let fp8 = dense.clone().with_fp8_attention();
    let inp = inputs(&dense, 1, GRID_105, false);
    let want = dense.forward(&inp.x, &inp.t, &inp.ctx).unwrap();
    let single = fp8.forward(&inp.x, &inp.t, &inp.ctx).unwrap();
    let quant = rel_err(&single, &want);
    assert!(
        quant > 1e-4,
        "FP8 attention moved the forward by only {quant:e}"
    );
    for mesh in [
        Mesh::new(2, 1, CpLayout::None, 1),
        Mesh::new(1, 1, CpLayout::None, 2),
        Mesh::new(1, 1, CpLayout::Ring(2), 1),
        Mesh::new(1, 1, CpLayout::Attn2d { rows: 1, cols: 2 }, 1),
        Mesh::new(1, 1, CpLayout::Attn2d { rows: 2, cols: 1 }, 1),
    ] {
        let outs = run(mesh, |comms| {
            parallel::forward(&fp8, comms, &inp.x, &inp.t, &inp.ctx)
        });
        for (r, got) in outs.iter().enumerate() {
            let (vs_dense, vs_single) = (rel_err(got, &want), rel_err(got, &single));
            eprintln!(
                "fp8 {mesh}: rank {r}: {vs_dense:.2e} from dense (single rank {quant:.2e}), {vs_single:.2e} from the single rank's FP8"
            );
            if mesh.world_size() == 2 && mesh.cfg_size() == 2 {
                assert!(vs_single <= FORWARD_TOL, "{mesh}: rank {r}: {vs_single:e}");
            }
            assert!(
                (quant / 3.0..=2.0 * quant).contains(&vs_dense),
                "{mesh}: rank {r}: {vs_dense:e} from dense, single rank {quant:e}"
            );
        }
    }
}

/// Each rank's thread records its own timeline of a parallel forward (`kernels::timeline`): the
/// model's ops and the collectives of its schedule (Ulysses: all-to-all; Ring: send/recv; the
/// final sequence gather: all-gather), intervals that add up to the recorded time, and the same
/// output as the unrecorded single rank.
#[test]
fn each_rank_records_its_timeline_with_the_collectives() {
    use ditstream_kernels::timeline;
    let model = mini128();
    let inp = inputs(&model, 1, [2, 4, 4], false);
    let want = model.forward(&inp.x, &inp.t, &inp.ctx).unwrap();
    for (mesh, collective) in [
        (Mesh::new(1, 1, CpLayout::None, 2), "all-to-all"),
        (Mesh::new(1, 1, CpLayout::Ring(2), 1), "send/recv"),
    ] {
        let outs = run(mesh, |comms| {
            let t0 = Instant::now();
            let (out, intervals) = timeline::record(Device::Cpu, || {
                parallel::forward(&model, comms, &inp.x, &inp.t, &inp.ctx)
            })?;
            Ok((out, intervals, t0.elapsed().as_secs_f64()))
        });
        for (r, (out, intervals, wall)) in outs.iter().enumerate() {
            assert!(rel_err(out, &want) <= FORWARD_TOL, "{mesh}: rank {r}");
            let labels: Vec<&str> = intervals.iter().map(|(l, _)| *l).collect();
            for label in [
                collective,
                "all-gather",
                "self-attention",
                "linears",
                "embed",
            ] {
                assert!(
                    labels.contains(&label),
                    "{mesh}: rank {r} has no {label:?}: {labels:?}"
                );
            }
            let sum: f64 = intervals.iter().map(|(_, s)| s).sum();
            assert!(
                sum <= *wall,
                "{mesh}: rank {r}: {sum} s of intervals in {wall} s"
            );
        }
    }
}
