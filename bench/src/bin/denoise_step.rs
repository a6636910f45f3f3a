//! One CFG denoise step (both guidance branches, then the sampler) of a Wan DiT with seeded random
//! weights in bf16: on one GPU (`denoise::denoise`, the branches batched) and on two GPUs over
//! NCCL for every 2-GPU mesh (`parallel::denoise`: cfg2, ulysses2 with async Ulysses off and on,
//! ring2, attn2d 1×2 and 2×1), with the speedups, and the collectives of one step timed alone at
//! the step's shapes, so the report says where the time goes (communication vs the rest).
//!
//! Timing follows GPU.md: warm-up steps first (kernel compiles, GEMM plans, NCCL connections),
//! then the median of `--iters` steps. A step is timed with CUDA events on each rank's kernel
//! stream (the step ends with the prediction read back to the host, so the events span it) and
//! with the wall clock; on two GPUs the ranks start each step together (a barrier) and a step
//! takes as long as its slower rank. Inputs are seeded normals. The collectives alone run on the
//! same communicators with buffers of the step's sizes, every collective one step issues (per
//! block × blocks, plus the final sequence gather, or the CFG prediction gather), timed by the
//! wall clock (each NCCL call returns when its stream is done).
//!
//! Default size: Wan2.1-1.3B dims (12 heads × 128, 30 blocks), 480p 17 frames = 5 latent frames
//! = 7,800 tokens (the portable attention makes 81 frames take ~35 s per forward on one GPU).
//! Prints `RESULT` lines that `scripts/gpu-parallel.sh` tabulates, and per rank the timeline of one
//! more recorded step (`TIMELINE\t<mesh>\trank <r>\t<label>\t<ms>\tms\t<intervals>\t<run>`:
//! the model's ops and the collectives' exposed waits, measured inside the step;
//! `kernels::timeline`).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use cudarc::driver::CudaSlice;
use ditstream_bench::{median, time_on};
use ditstream_common::collectives::nccl::{NcclComm, NcclWorld};
use ditstream_common::collectives::{CommWorld, Communicator, Pending, UlyssesExt, UlyssesShape};
use ditstream_common::config::{Preset, SamplerKind};
use ditstream_common::mesh::{CpLayout, Mesh};
use ditstream_denoiser::denoise::{self, Control, DenoiseParams, Experts};
use ditstream_denoiser::model::{WanConfig, WanTransformer};
use ditstream_denoiser::parallel::{self, MeshComms};
use ditstream_kernels::weights::DrawnWeights;
use ditstream_kernels::{DType, Device, Tensor};
use half::bf16;

#[derive(Parser, Debug)]
#[command(about = "Time one CFG denoise step on 1 GPU and on every 2-GPU mesh over NCCL (bf16)")]
struct Args {
    /// Model dimensions (a built-in preset name).
    #[arg(long, default_value = "wan2.1-t2v-1.3b")]
    preset: String,
    /// Video height in pixels.
    #[arg(long, default_value_t = 480)]
    height: usize,
    /// Video width in pixels.
    #[arg(long, default_value_t = 832)]
    width: usize,
    /// Video frames (4k + 1).
    #[arg(long, default_value_t = 17)]
    frames: usize,
    /// Text tokens of the prompt embedding.
    #[arg(long, default_value_t = 512)]
    text_len: usize,
    /// Untimed warm-up steps per configuration.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Timed steps per configuration (the median is reported).
    #[arg(long, default_value_t = 3)]
    iters: usize,
    /// Override the block count (`--layers 0`: the step without blocks, i.e. embedding, text
    /// projection, head, sampler and host traffic: the part sequence parallelism does not split).
    #[arg(long)]
    layers: Option<usize>,
    /// Label of this run in the `RESULT` lines (default `<frames>f`, `+ <n> blocks` with --layers).
    #[arg(long)]
    label: Option<String>,
    /// Meshes to run on 2 GPUs (comma-separated from cfg2, ulysses2, ulysses2_async, ring2,
    /// attn2d_1x2, attn2d_2x1).
    #[arg(
        long,
        default_value = "cfg2,ulysses2,ulysses2_async,ring2,attn2d_1x2,attn2d_2x1"
    )]
    meshes: String,
}

fn preset(name: &str) -> Result<Preset> {
    Preset::ALL
        .into_iter()
        .find(|p| p.name() == name)
        .with_context(|| format!("--preset {name:?}: unknown"))
}

/// One sampler step with guidance (UniPC, 1 step: the loop body once).
fn params() -> DenoiseParams {
    DenoiseParams {
        sampler: SamplerKind::Unipc,
        steps: 1,
        shift: 3.0,
        guidance_scale: 5.0,
        guidance_scale_2: None,
    }
}

/// The step's inputs on `device`: latents (host f32, as the loop keeps them), cond and uncond
/// text states in bf16 on the device.
struct StepInputs {
    latents: Tensor,
    cond: Tensor,
    uncond: Tensor,
}

fn step_inputs(
    cfg: &WanConfig,
    latent: [usize; 5],
    s: usize,
    device: Device,
) -> Result<StepInputs> {
    Ok(StepInputs {
        latents: denoise::initial_noise(latent, 1)?,
        cond: Tensor::randn(&[1, s, cfg.text_dim], DType::BF16, 2, device)?,
        uncond: Tensor::randn(&[1, s, cfg.text_dim], DType::BF16, 3, device)?,
    })
}

/// (event seconds, wall seconds) of `f` on GPU `ordinal`'s kernel stream.
fn timed(ordinal: usize, f: impl FnOnce() -> Result<()>) -> Result<(f64, f64)> {
    let t0 = Instant::now();
    let events = time_on(Device::Cuda(ordinal), f)?;
    Ok((events, t0.elapsed().as_secs_f64()))
}

/// A mesh name of `--meshes`: the mesh, and whether async Ulysses is on.
fn mesh_of(name: &str) -> Result<(Mesh, bool)> {
    Ok(match name {
        "cfg2" => (Mesh::new(2, 1, CpLayout::None, 1), false),
        "ulysses2" => (Mesh::new(1, 1, CpLayout::None, 2), false),
        "ulysses2_async" => (Mesh::new(1, 1, CpLayout::None, 2), true),
        "ring2" => (Mesh::new(1, 1, CpLayout::Ring(2), 1), false),
        "attn2d_1x2" => (
            Mesh::new(1, 1, CpLayout::Attn2d { rows: 1, cols: 2 }, 1),
            false,
        ),
        "attn2d_2x1" => (
            Mesh::new(1, 1, CpLayout::Attn2d { rows: 2, cols: 1 }, 1),
            false,
        ),
        other => bail!("--meshes: unknown mesh {other:?}"),
    })
}

/// Shapes of one step, for the collectives-alone timing.
#[derive(Debug, Clone, Copy)]
struct Dims {
    /// Real tokens L.
    tokens: usize,
    heads: usize,
    head_dim: usize,
    dim: usize,
    layers: usize,
    /// Elements of the latent (the CFG prediction gather moves it as f32).
    latent: usize,
}

fn alloc<T: ditstream_common::collectives::Element>(
    c: &NcclComm,
    n: usize,
) -> Result<CudaSlice<T>> {
    Ok(c.alloc::<T>(n)?)
}

/// Every collective one step of `mesh` issues on this rank, in order (seconds, wall clock).
/// Sequence-parallel meshes batch both branches (B = 2) and shard L over 2 ranks (ceil(L/2)).
fn collectives_alone(comms: &MeshComms<NcclComm>, d: Dims) -> Result<f64> {
    let b = 2;
    let sc = d.tokens.div_ceil(2);
    let (h, hd) = (d.heads, d.head_dim);
    let t0 = Instant::now();
    if let Some(cfg) = &comms.cfg {
        let send = alloc::<f32>(cfg, d.latent)?;
        let mut recv = alloc::<f32>(cfg, 2 * d.latent)?;
        cfg.synchronize()?;
        let t0 = Instant::now();
        cfg.all_gather(&send, &mut recv)?;
        return Ok(t0.elapsed().as_secs_f64());
    }
    if let Some(u) = &comms.ulysses {
        // Per block: q, k and v sequence → heads (one all-to-all each), the output back.
        let shape = UlyssesShape::bshd(b, sc, h, hd);
        let input = alloc::<bf16>(u, shape.numel())?;
        let mut output = alloc::<bf16>(u, shape.numel())?;
        let mut scratch = alloc::<bf16>(u, shape.numel())?;
        u.synchronize()?;
        let t0 = Instant::now();
        for _ in 0..d.layers {
            for _ in 0..3 {
                u.seq_to_heads(&input, &mut output, &mut scratch, shape)?;
            }
            u.heads_to_seq(&input, &mut output, &mut scratch, shape)?;
        }
        return finish_with_gather(comms, d, t0);
    }
    if let Some(r) = &comms.ring {
        let n = 2 * b * sc * h * hd;
        let send = alloc::<bf16>(r, n)?;
        let mut recv = alloc::<bf16>(r, n)?;
        r.synchronize()?;
        let t0 = Instant::now();
        for _ in 0..d.layers {
            r.send_recv(&send, (r.rank() + 1) % 2, &mut recv, (r.rank() + 1) % 2)?
                .wait()?;
        }
        return finish_with_gather(comms, d, t0);
    }
    if comms.row.is_some() || comms.col.is_some() {
        let q_n = b * sc * h * hd;
        // Q gather, then the output (bf16) and LSE (f32) all-to-alls over the row group.
        let row_bufs = match &comms.row {
            Some(row) => Some((
                row,
                alloc::<bf16>(row, q_n)?,
                alloc::<bf16>(row, 2 * q_n)?,
                alloc::<bf16>(row, 2 * q_n)?,
                alloc::<bf16>(row, 2 * q_n)?,
                alloc::<f32>(row, 2 * b * h * sc)?,
                alloc::<f32>(row, 2 * b * h * sc)?,
            )),
            None => None,
        };
        // The packed K/V gather over the column group.
        let col_bufs = match &comms.col {
            Some(col) => Some((
                col,
                alloc::<bf16>(col, 2 * q_n)?,
                alloc::<bf16>(col, 4 * q_n)?,
            )),
            None => None,
        };
        let mut row_bufs = row_bufs;
        let mut col_bufs = col_bufs;
        if let Some(c) = comms.row.as_ref().or(comms.col.as_ref()) {
            c.synchronize()?;
        }
        let t0 = Instant::now();
        for _ in 0..d.layers {
            if let Some((row, q, qs, out, outs, lse, lses)) = row_bufs.as_mut() {
                row.all_gather(q, qs)?;
                row.all_to_all(out, outs)?;
                row.all_to_all(lse, lses)?;
            }
            if let Some((col, kv, kvs)) = col_bufs.as_mut() {
                col.all_gather(kv, kvs)?;
            }
        }
        return finish_with_gather(comms, d, t0);
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// Adds the final sequence all-gather [B, ceil(L/2), dim] (its buffers allocated outside the
/// timing) to the seconds since `t0`.
fn finish_with_gather(comms: &MeshComms<NcclComm>, d: Dims, t0: Instant) -> Result<f64> {
    let blocks = t0.elapsed().as_secs_f64();
    let Some(seq) = &comms.seq else {
        return Ok(blocks);
    };
    let n = 2 * d.tokens.div_ceil(2) * d.dim;
    let send = alloc::<bf16>(seq, n)?;
    let mut recv = alloc::<bf16>(seq, 2 * n)?;
    seq.synchronize()?;
    let t1 = Instant::now();
    seq.all_gather(&send, &mut recv)?;
    Ok(blocks + t1.elapsed().as_secs_f64())
}

/// Per-iteration (event s, wall s) of one rank for one mesh, and the collectives-alone medians.
type RankTimes = (Vec<(f64, f64)>, f64, Vec<(&'static str, f64, usize)>);

/// One more `step` recorded on this thread's timeline (`kernels::timeline`): seconds and
/// intervals per label, the collectives' among them (the waits the step could not hide).
fn timeline_of(
    device: Device,
    step: impl FnOnce() -> Result<()>,
) -> Result<Vec<(&'static str, f64, usize)>> {
    let (_, intervals) = ditstream_kernels::timeline::record(device, step)?;
    Ok(ditstream_kernels::timeline::totals(&intervals))
}

/// `TIMELINE` lines of one rank's recorded step: label, ms, intervals, and the run's label.
fn print_timeline(mesh: &str, rank: usize, totals: &[(&'static str, f64, usize)], run: &str) {
    for (label, secs, n) in totals {
        println!(
            "TIMELINE\t{mesh}\trank {rank}\t{label}\t{:.3}\tms\t{n}\t{run}",
            secs * 1e3
        );
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    // The GPU script's CUDA settings (kernel cache, CUDA headers, algorithm searches).
    ditstream_kernels::testing::configure_cuda()?;
    if args.frames % 4 != 1 || args.height % 16 != 0 || args.width % 16 != 0 {
        bail!("--frames must be 4k + 1 and --height, --width multiples of 16");
    }
    let preset = preset(&args.preset)?;
    let mut cfg = WanConfig::preset(preset);
    if let Some(n) = args.layers {
        cfg.num_layers = n;
    }
    let label = args.label.clone().unwrap_or_else(|| match args.layers {
        Some(n) => format!("{}f/{n}blk", args.frames),
        None => format!("{}f", args.frames),
    });
    let latent = [
        1,
        cfg.in_channels,
        (args.frames - 1) / 4 + 1,
        args.height / 8,
        args.width / 8,
    ];
    let tokens = latent[2] * (latent[3] / 2) * (latent[4] / 2);
    let dims = Dims {
        tokens,
        heads: cfg.num_attention_heads,
        head_dim: cfg.attention_head_dim,
        dim: cfg.dim(),
        layers: cfg.num_layers,
        latent: latent.iter().product(),
    };
    let meshes = args
        .meshes
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| Ok((s.to_string(), mesh_of(s)?)))
        .collect::<Result<Vec<_>>>()?;
    println!(
        "model {} ({} blocks, {} heads x {}) bf16, random weights; video {}x{}x{} -> latent {latent:?} -> {tokens} tokens; text {}; one CFG step (guidance 5, both branches, UniPC)",
        preset.name(),
        cfg.num_layers,
        cfg.num_attention_heads,
        cfg.attention_head_dim,
        args.frames,
        args.height,
        args.width,
        args.text_len
    );
    let t0 = Instant::now();
    // Drawn once on every host core and kept: the model copies (1 GPU, then one per rank) share them.
    let weights = DrawnWeights::draw(0, |ws| {
        WanTransformer::new(cfg.clone(), ws, DType::BF16, Device::Cpu).map(drop)
    })?;
    println!("weights drawn in {:.1} s", t0.elapsed().as_secs_f64());

    // 1 GPU: the single-rank loop, branches batched.
    let one = {
        let model = WanTransformer::new(cfg.clone(), &weights, DType::BF16, Device::Cuda(0))?;
        let inp = step_inputs(&cfg, latent, args.text_len, Device::Cuda(0))?;
        let experts = Experts {
            high: &model,
            low: None,
        };
        let step = || -> Result<()> {
            denoise::denoise(
                experts,
                &params(),
                inp.latents.clone(),
                &inp.cond,
                Some(&inp.uncond),
                |_| Control::Continue,
            )?;
            Ok(())
        };
        for _ in 0..args.warmup {
            timed(0, step)?;
        }
        let samples = (0..args.iters.max(1))
            .map(|_| timed(0, step))
            .collect::<Result<Vec<_>>>()?;
        let ev = median(&samples.iter().map(|s| s.0).collect::<Vec<_>>()).context("samples")?;
        let wall = median(&samples.iter().map(|s| s.1).collect::<Vec<_>>()).context("samples")?;
        println!(
            "RESULT\t1gpu\tstep\t{:.1}\tms (events)\t{:.1}\tms (wall)\t1.00\tx\t-\tms comm\t1 GPU\t{label}",
            ev * 1e3,
            wall * 1e3
        );
        print_timeline("1gpu", 0, &timeline_of(Device::Cuda(0), step)?, &label);
        ev
    };

    // 2 GPUs over NCCL: one world, every mesh in turn.
    let per_rank = NcclWorld::run_local(
        2,
        Duration::from_secs(300),
        |world| -> Result<Vec<RankTimes>, String> {
            let rank = world.rank();
            let device = Device::Cuda(rank);
            let run = || -> Result<Vec<RankTimes>> {
                let model = WanTransformer::new(cfg.clone(), &weights, DType::BF16, device)?;
                let inp = step_inputs(&cfg, latent, args.text_len, device)?;
                let experts = Experts {
                    high: &model,
                    low: None,
                };
                let mut out = Vec::new();
                for (_, (mesh, async_ulysses)) in &meshes {
                    let comms = MeshComms::new(&world, *mesh)?.with_async_ulysses(*async_ulysses);
                    let barrier = comms
                        .world
                        .as_ref()
                        .context("a 2-rank mesh has a world comm")?;
                    let step = || -> Result<()> {
                        parallel::denoise(
                            experts,
                            &comms,
                            &params(),
                            inp.latents.clone(),
                            &inp.cond,
                            Some(&inp.uncond),
                            |_| Control::Continue,
                        )?;
                        Ok(())
                    };
                    for _ in 0..args.warmup {
                        barrier.barrier()?;
                        timed(rank, step)?;
                    }
                    let mut samples = Vec::new();
                    for _ in 0..args.iters.max(1) {
                        barrier.barrier()?;
                        samples.push(timed(rank, step)?);
                    }
                    barrier.barrier()?;
                    let timeline = timeline_of(device, step)?;
                    let mut comm = Vec::new();
                    for _ in 0..args.iters.max(3) {
                        barrier.barrier()?;
                        comm.push(collectives_alone(&comms, dims)?);
                    }
                    out.push((samples, median(&comm).context("samples")?, timeline));
                }
                Ok(out)
            };
            run().map_err(|e| format!("rank {rank}: {e:#}"))
        },
    )?;
    let per_rank = per_rank
        .into_iter()
        .map(|r| r.and_then(|v| v))
        .collect::<std::result::Result<Vec<_>, String>>()
        .map_err(|e| anyhow::anyhow!(e))?;
    for (m, (name, (mesh, _))) in meshes.iter().enumerate() {
        for (rank, r) in per_rank.iter().enumerate() {
            print_timeline(name, rank, &r[m].2, &label);
        }
        let iters = per_rank[0][m].0.len();
        // A step lasts as long as its slower rank.
        let ev: Vec<f64> = (0..iters)
            .map(|i| per_rank.iter().map(|r| r[m].0[i].0).fold(0.0, f64::max))
            .collect();
        let wall: Vec<f64> = (0..iters)
            .map(|i| per_rank.iter().map(|r| r[m].0[i].1).fold(0.0, f64::max))
            .collect();
        let comm = per_rank.iter().map(|r| r[m].1).fold(0.0, f64::max);
        let ev = median(&ev).context("samples")?;
        let wall = median(&wall).context("samples")?;
        println!(
            "RESULT\t{name}\tstep\t{:.1}\tms (events)\t{:.1}\tms (wall)\t{:.2}\tx\t{:.1}\tms comm\t{mesh}\t{label}",
            ev * 1e3,
            wall * 1e3,
            one / ev,
            comm * 1e3
        );
    }
    Ok(())
}
