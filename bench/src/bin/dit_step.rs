//! One Wan DiT forward (the denoiser's step) with seeded random weights, in bf16 on `cuda:0`: the
//! whole forward, and the ops that dominate it timed alone at the same shapes (self-attention,
//! cross-attention, one block's linears), so the report says where the time goes.
//!
//! Timing follows GPU.md: CUDA events around each call on the one stream every op runs on, after
//! `--warmup` untimed calls (the first compiles the kernels and plans the GEMMs), the median of
//! `--iters`. Inputs are seeded normals (never zeros; beyond 16 Mi elements one drawn block
//! repeated, `random_input`: drawing 10⁹ normals on the host took minutes at 14B dims, which kept
//! the 14B split from finishing). The effective rate counts the forward's matrix FLOPs: per block 2·L·D²·6 (self q/k/v/o, cross q/o) + 2·S·D²·2 (cross k/v over the S text
//! tokens) + 4·L·D·F (FFN) + 4·L²·D (self-attention) + 4·L·S·D (cross-attention); at 1.3B dims and
//! 32,760 tokens that is the 283 TFLOP GPU.md's diffusers figure uses. `bench/dit_step_torch.py`
//! times diffusers' `WanTransformer3DModel` the same way; `scripts/gpu-dit.sh` runs both and
//! compares the `RESULT` lines. `--device cpu` runs the same code on the CPU backend (wall clock) as
//! a smoke test of the driver with `--preset tiny`.
//!
//! Two more views of the forward: its host issue time (how long queueing one forward takes with
//! the GPU idle at the start: far below the forward, the host runs ahead; a forward longer than the
//! launch queue holds, as at 14B dims, blocks the host on the full queue, so there it is an upper
//! bound), and with the split the same four parts measured inside recorded forwards
//! (`kernels::timeline`: CUDA events between the ops the model marks, so each op runs at the clocks
//! and with the caches it has there; ops timed alone in short bursts run at the boost clock while
//! the forward runs power-limited, which is why the alone-timed "rest" is much larger).

use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use ditstream_bench::{median, median_per_call, random_input, rel_rms, time_on};
use ditstream_common::config::Preset;
use ditstream_decoder::vae::{VaeConfig, WanVaeDecoder};
use ditstream_denoiser::model::{WanConfig, WanTransformer};
use ditstream_kernels::cuda::{AttentionKernel, HOPPER_FP8_VARIANTS, with_attention_kernel};
use ditstream_kernels::weights::{DrawnWeights, RandomWeights};
use ditstream_kernels::{AttentionOptions, DType, Device, Tensor, attention, linear};

#[derive(Parser, Debug)]
#[command(about = "Time one Wan DiT forward with random weights (bf16, one GPU)")]
struct Args {
    /// Model dimensions (a built-in preset name).
    #[arg(long, default_value = "wan2.1-t2v-1.3b")]
    preset: String,
    /// Video height in pixels (the latent is /8, tokens /16).
    #[arg(long, default_value_t = 480)]
    height: usize,
    /// Video width in pixels.
    #[arg(long, default_value_t = 832)]
    width: usize,
    /// Video frames (4k + 1; the latent has (frames − 1)/4 + 1).
    #[arg(long, default_value_t = 5)]
    frames: usize,
    /// Text tokens of the prompt embedding (umT5 pads to 512).
    #[arg(long, default_value_t = 512)]
    text_len: usize,
    /// Untimed warm-up forwards.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Timed forwards (the median is reported).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Skip the per-op timings.
    #[arg(long)]
    no_split: bool,
    /// `cuda` (cuda:0) or `cpu` (a smoke test of the driver).
    #[arg(long, default_value = "cuda")]
    device: String,
    /// Also the same model in FP8 (e4m3) as `model.dtype: fp8` runs it (its blocks' linears and
    /// self-attention), and with FP8 linears only: their forwards' times, the FP8 forward's error
    /// against the bf16 one on the same inputs, the block's linears alone in FP8, and (without
    /// `--no-split`) the FP8 forward's split inside recorded forwards ("in fp8 forward").
    #[arg(long)]
    fp8: bool,
    /// With `--fp8`: this many Euler steps of a flow-matching denoise from the same noise with
    /// both models, the final latents' error, and the two latents decoded by the Wan 2.1 VAE
    /// (random weights, bf16) with the videos' PSNR (0: none).
    #[arg(long, default_value_t = 0)]
    steps: usize,
    /// With `--fp8`: also the FP8 forward with each of these FP8 attention kernels (labels of
    /// `HOPPER_FP8_VARIANTS`, comma-separated) in place of the default, each timed right after
    /// the default again (alternating, so clock drift shows), with its error against the bf16
    /// forward.
    #[arg(long, value_delimiter = ',')]
    fp8_attention: Vec<String>,
}

/// One block's linear operands at the forward's shapes (seeded, bf16; the gate f32), which the
/// split and the `--fp8` comparison time the block's linears on.
struct BlockOperands {
    /// Video tokens [1, L, D] and the FFN's hidden [1, L, FFN]; text tokens [1, S, D].
    h: Tensor,
    h_ffn: Tensor,
    txt: Tensor,
    w_dd: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    bias_d: Tensor,
    bias_f: Tensor,
    gate: Tensor,
}

impl BlockOperands {
    fn draw([l, s, d, ffn]: [usize; 4], device: Device) -> Result<BlockOperands> {
        let bf16 = |shape: &[usize], seed| random_input(shape, DType::BF16, seed, device);
        Ok(BlockOperands {
            h: bf16(&[1, l, d], 5)?,
            h_ffn: bf16(&[1, l, ffn], 6)?,
            txt: bf16(&[1, s, d], 7)?,
            w_dd: bf16(&[d, d], 8)?,
            w_up: bf16(&[ffn, d], 9)?,
            w_down: bf16(&[d, ffn], 10)?,
            bias_d: bf16(&[d], 11)?,
            bias_f: bf16(&[ffn], 12)?,
            gate: random_input(&[1, 1, d], DType::F32, 13, device)?,
        })
    }

    /// The block's linears over the video tokens in bf16, as the block runs them: self q/k/v and
    /// cross q, the output projections and the FFN's down-projection with their residuals in the
    /// GEMM (gated: the gate folded into the weights), the FFN's up-projection + GELU.
    fn video_linears(&self) -> Result<Tensor> {
        use ditstream_kernels as k;
        let (h, w_dd, bias_d, gate) = (&self.h, &self.w_dd, Some(&self.bias_d), Some(&self.gate));
        for _ in 0..4 {
            linear(h, w_dd, bias_d)?;
        }
        k::linear_residual(h, w_dd, bias_d, h, gate)?;
        k::linear_residual(h, w_dd, bias_d, h, None)?;
        k::linear_gelu_tanh(h, &self.w_up, &self.bias_f)?;
        Ok(k::linear_residual(
            &self.h_ffn,
            &self.w_down,
            bias_d,
            h,
            gate,
        )?)
    }
}

/// PSNR of video `a` against `b` ([.., frames, H, W] in [−1, 1], clamped there as the pipeline's
/// output is), on the 8-bit scale the encoder sees: 10·log10(255² / MSE).
fn psnr(a: &Tensor, b: &Tensor) -> Result<f64> {
    let (a, b) = (a.to_vec_f32()?, b.to_vec_f32()?);
    let to8 = |v: f32| f64::from((v.clamp(-1.0, 1.0) + 1.0) * 127.5);
    let mse = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (to8(*x) - to8(*y)).powi(2))
        .sum::<f64>()
        / a.len().max(1) as f64;
    Ok(10.0 * (255f64.powi(2) / mse.max(f64::MIN_POSITIVE)).log10())
}

/// `steps` Euler steps of Wan's flow-matching sampler (σ from 1 to 0, shifted by 5 as Wan's 480p
/// default; t = 1000·σ) from `noise`, no guidance: the latent each model denoises to, in f32.
fn denoise(model: &WanTransformer, noise: &Tensor, ctx: &Tensor, steps: usize) -> Result<Tensor> {
    use ditstream_kernels as k;
    let shift = 5.0f64;
    let sigma = |i: usize| {
        let s = 1.0 - i as f64 / steps as f64;
        shift * s / (1.0 + (shift - 1.0) * s)
    };
    let mut x = noise.to_dtype(DType::F32)?;
    for i in 0..steps {
        let t = Tensor::from_vec(vec![(1000.0 * sigma(i)) as f32], &[1])?;
        let v = model.forward(&x, &t, ctx)?.to_dtype(DType::F32)?;
        let dt = Tensor::from_vec(vec![(sigma(i + 1) - sigma(i)) as f32], &[1])?
            .to_device(noise.device())?;
        x = k::add(&x, &k::mul(&v, &dt)?)?;
    }
    Ok(x)
}

/// The model of `cfg` with `RandomWeights::new(seed)` in bf16 on `device`, the weights drawn on all
/// host cores first (one core would take ~1 min for 1.3B parameters, the GPU held idle meanwhile).
fn random_model(cfg: &WanConfig, seed: u64, device: Device) -> Result<WanTransformer> {
    let weights = DrawnWeights::draw(seed, |ws| {
        WanTransformer::new(cfg.clone(), ws, DType::BF16, Device::Cpu).map(drop)
    })?;
    Ok(WanTransformer::new(
        cfg.clone(),
        &weights,
        DType::BF16,
        device,
    )?)
}

/// The block's other ops (what "rest" is made of) alone at one block's shapes, each × `n` blocks,
/// with the bytes each must move and the bandwidth that implies, so the slow ones stand out.
fn block_rest_ops(
    [l, d, heads, hd, ffn]: [usize; 5],
    latent: [usize; 5],
    reps: usize,
    n: f64,
    device: Device,
) -> Result<()> {
    use ditstream_kernels as k;
    let x = random_input(&[1, l, d], DType::BF16, 20, device)?;
    let y = random_input(&[1, l, d], DType::BF16, 21, device)?;
    let m = random_input(&[1, 1, d], DType::F32, 22, device)?;
    let w = random_input(&[d], DType::F32, 23, device)?;
    let wb = random_input(&[d], DType::BF16, 24, device)?;
    let up = random_input(&[1, l, ffn], DType::BF16, 25, device)?;
    let q = random_input(&[1, l, heads, hd], DType::BF16, 26, device)?;
    let grid = [latent[2], latent[3] / 2, latent[4] / 2];
    let (cos, sin) = k::rope_tables_3d(grid, hd, 10_000.0, device)?;
    let act = (l * d * 2) as f64; // one bf16 [L, D] activation, bytes
    let ops: Vec<(&str, f64, f64)> = vec![
        (
            "norm+modulate, unfused (×2)",
            2.0,
            median_per_call(device, 1, reps, 1, || {
                let f = k::layer_norm(&x.to_dtype(DType::F32)?, None, None, 1e-6)?;
                Ok(k::modulate(&f, &m, &m)?.to_dtype(DType::BF16)?)
            })?,
        ),
        (
            "layer_norm_modulate (×2)",
            2.0,
            median_per_call(device, 1, reps, 1, || {
                Ok(k::layer_norm_modulate(&x, &m, &m, 1e-6, DType::BF16)?)
            })?,
        ),
        (
            "rms_norm (cross-attention q: ×1)",
            2.0,
            median_per_call(device, 1, reps, 1, || Ok(k::rms_norm(&x, &wb, 1e-6)?))?,
        ),
        (
            "rms_norm_rope (self-attention q, k: ×2)",
            2.0,
            median_per_call(device, 1, reps, 1, || {
                Ok(k::rms_norm_rope(&x, &wb, 1e-6, &cos, &sin, heads)?)
            })?,
        ),
        (
            "apply_rope (fused into rms_norm_rope: ×0)",
            2.0,
            median_per_call(device, 1, reps, 1, || Ok(k::apply_rope(&q, &cos, &sin)?))?,
        ),
        (
            "gated_residual (in the GEMMs: ×0)",
            3.0,
            median_per_call(device, 1, reps, 1, || Ok(k::gated_residual(&x, &y, &m)?))?,
        ),
        (
            "add (in the GEMM: ×0)",
            3.0,
            median_per_call(device, 1, reps, 1, || Ok(k::add(&x, &y)?))?,
        ),
        (
            "layer_norm affine (×1)",
            2.0,
            median_per_call(device, 1, reps, 1, || {
                Ok(k::layer_norm(&x, Some(&w), Some(&w), 1e-6)?)
            })?,
        ),
        (
            "gelu_tanh [L, FFN] (in the FFN's GEMM: ×0)",
            2.0 * ffn as f64 / d as f64,
            median_per_call(device, 1, reps, 1, || Ok(k::gelu_tanh(&up)?))?,
        ),
    ];
    let calls = [0.0, 2.0, 1.0, 2.0, 0.0, 0.0, 0.0, 1.0, 0.0];
    for ((what, passes, secs), calls) in ops.iter().zip(calls) {
        println!(
            "RESULT\tours\trest op {what}\t{:.3}\tms\t{:.0}\tGB/s\t({:.3} ms per call)",
            secs * 1e3 * calls * n,
            passes * act / secs / 1e9,
            secs * 1e3
        );
    }
    Ok(())
}

/// The `--fp8` part: the model as `model.dtype: fp8` runs it (FP8 linears and self-attention), and
/// with FP8 linears only, beside the bf16 one, on the same inputs.
fn fp8_forward(
    args: &Args,
    model: &WanTransformer,
    (x, t, ctx): (&Tensor, &Tensor, &Tensor),
    flops: f64,
    bf16_forward: f64,
    device: Device,
) -> Result<()> {
    use ditstream_kernels as k;
    let t0 = Instant::now();
    let linears = model.clone().with_fp8_linears()?;
    if let Device::Cuda(ordinal) = device {
        ditstream_kernels::cuda::synchronize(ordinal)?;
    }
    println!(
        "fp8: blocks' linears quantised in {:.2} s",
        t0.elapsed().as_secs_f64()
    );
    // `model.dtype: fp8`: the linears and the self-attention; the linears alone beside it.
    let fp8 = linears.clone().with_fp8_attention();
    for (label, m) in [("forward fp8-linears", &linears), ("forward fp8", &fp8)] {
        let forward = median_per_call(device, args.warmup, args.iters, 1, || {
            Ok(m.forward(x, t, ctx)?)
        })?;
        println!(
            "RESULT\tours\t{label}\t{:.3}\tms\t{:.1}\tTFLOP/s\t({:.3}x our bf16)",
            forward * 1e3,
            flops / forward / 1e12,
            forward / bf16_forward
        );
    }
    for name in &args.fp8_attention {
        let Some(i) = HOPPER_FP8_VARIANTS.iter().position(|v| v.label() == *name) else {
            bail!(
                "--fp8-attention {name}: no such FP8 attention kernel (there are: {})",
                HOPPER_FP8_VARIANTS
                    .iter()
                    .map(|v| v.label())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        };
        let kernel = AttentionKernel::HopperFp8(i);
        let with = || with_attention_kernel(kernel, || fp8.forward(x, t, ctx));
        let base = median_per_call(device, args.warmup, args.iters, 1, || {
            Ok(fp8.forward(x, t, ctx)?)
        })?;
        let other = median_per_call(device, args.warmup, args.iters, 1, || Ok(with()?))?;
        let err = rel_rms(&with()?, &model.forward(x, t, ctx)?)?;
        println!(
            "RESULT\tours\tforward fp8, attention {name}\t{:.3}\tms\t(default again {:.3} ms)\t{err:.3e}\trel rms vs bf16",
            other * 1e3,
            base * 1e3
        );
    }
    if !args.no_split {
        // Where the FP8 forward's time goes, as the bf16 split below (the quantisations that
        // no norm writes are their own marks: "fp8 quantize", `FP8_ATTENTION_QUANTIZE_MARKS`).
        let forward = median_per_call(device, 1, 1, 1, || Ok(fp8.forward(x, t, ctx)?))?;
        in_forward_split("in fp8 forward", device, args.iters.max(3), forward, || {
            Ok(fp8.forward(x, t, ctx)?)
        })?;
    }
    let err = rel_rms(&fp8.forward(x, t, ctx)?, &model.forward(x, t, ctx)?)?;
    println!("RESULT\tours\tfp8 forward vs bf16, rel rms\t{err:.3e}\t-");
    // One block's linears alone (as the split's bf16 set), FP8 against bf16 on the same operands.
    let cfg = model.config();
    let l = x.shape()[2] * (x.shape()[3] / 2) * (x.shape()[4] / 2);
    let (d, ffn) = (cfg.dim(), cfg.ffn_dim);
    let ops = BlockOperands::draw([l, 1, d, ffn], device)?;
    let BlockOperands {
        h,
        h_ffn,
        w_dd,
        w_up,
        w_down,
        bias_d,
        bias_f,
        gate,
        ..
    } = &ops;
    let (q_dd, q_up, q_down) = (
        k::Fp8Tensor::quantize(w_dd)?,
        k::Fp8Tensor::quantize(w_up)?,
        k::Fp8Tensor::quantize(w_down)?,
    );
    let reps = args.iters.max(3);
    let video_flops = 2.0 * l as f64 * (d * d * 6 + 2 * d * ffn) as f64;
    let bf16 = median_per_call(device, 1, reps, 1, || ops.video_linears())?;
    // Each linear quantises its own input here (as every FP8 linear did before the model's norms
    // wrote e4m3 and q/k/v shared one quantisation), so the figure stays comparable across dates.
    let q = k::Fp8Tensor::quantize;
    let e4m3 = median_per_call(device, 1, reps, 1, || {
        for _ in 0..4 {
            k::linear_fp8(&q(h)?, &q_dd, Some(bias_d))?;
        }
        k::linear_fp8_residual(&q(h)?, &q_dd, Some(bias_d), h, Some(gate))?;
        k::linear_fp8_residual(&q(h)?, &q_dd, Some(bias_d), h, None)?;
        k::linear_fp8_gelu_tanh(&q(h)?, &q_up, bias_f)?;
        Ok(k::linear_fp8_residual(
            &q(h_ffn)?,
            &q_down,
            Some(bias_d),
            h,
            Some(gate),
        )?)
    })?;
    println!(
        "RESULT\tours\tone block's video-token linears, bf16 → fp8 (quantisation included)\t{:.3} → {:.3}\tms\t{:.0} → {:.0}\tTFLOP/s",
        bf16 * 1e3,
        e4m3 * 1e3,
        video_flops / bf16 / 1e12,
        video_flops / e4m3 / 1e12
    );
    let quant = median_per_call(device, 1, reps, 1, || {
        Ok(k::Fp8Tensor::quantize(h)?.scales().clone())
    })?;
    println!(
        "RESULT\tours\tquantize [L, D] per token\t{:.3}\tms\t{:.0}\tGB/s",
        quant * 1e3,
        (l * d * 3) as f64 / quant / 1e9
    );
    if args.steps > 0 {
        let noise = random_input(x.shape(), DType::F32, 30, device)?;
        let t0 = Instant::now();
        let (a, b) = (
            denoise(&fp8, &noise, ctx, args.steps)?,
            denoise(model, &noise, ctx, args.steps)?,
        );
        println!(
            "RESULT\tours\t{}-step latent, fp8 vs bf16, rel rms\t{:.3e}\t-\t({:.1} s for both)",
            args.steps,
            rel_rms(&a, &b)?,
            t0.elapsed().as_secs_f64()
        );
        let vae = WanVaeDecoder::from_weights_on(
            VaeConfig::wan21(),
            &RandomWeights::new(0),
            device,
            DType::BF16,
        )?;
        let (va, vb) = (
            vae.decode(&a.to_dtype(DType::BF16)?)?,
            vae.decode(&b.to_dtype(DType::BF16)?)?,
        );
        println!(
            "RESULT\tours\t{}-step video, fp8 vs bf16 (random-weight VAE), PSNR\t{:.2}\tdB\t{:.3e}\trel rms",
            args.steps,
            psnr(&va, &vb)?,
            rel_rms(&va, &vb)?
        );
    }
    Ok(())
}

/// `reps` forwards recorded on the timeline: each mark's total per forward (median over the
/// forwards), then the forward in four parts as the split alone reports it (self-attention,
/// cross-attention, linears; "rest" = every other mark: norms, modulation, embedding, head, and
/// the gaps before each), and the recorded forward's total beside the unrecorded one's.
fn in_forward_split(
    what: &str,
    device: Device,
    reps: usize,
    forward: f64,
    mut run: impl FnMut() -> Result<Tensor>,
) -> Result<()> {
    use ditstream_kernels::timeline;
    let mut per_label: Vec<(&'static str, Vec<f64>, usize)> = Vec::new();
    let mut totals = Vec::new();
    for _ in 0..reps {
        let (_, intervals) = timeline::record(device, &mut run)?;
        totals.push(intervals.iter().map(|(_, s)| s).sum::<f64>());
        for (label, secs, n) in timeline::totals(&intervals) {
            match per_label.iter_mut().find(|(l, _, _)| *l == label) {
                Some((_, v, _)) => v.push(secs),
                None => per_label.push((label, vec![secs], n)),
            }
        }
    }
    let total = median(&totals).context("no recorded forwards")?;
    println!(
        "RESULT\tours\t{what}: recorded forward\t{:.3}\tms\t{:.1}\t% of the unrecorded one",
        total * 1e3,
        100.0 * total / forward
    );
    let mut parts = [0.0f64; 4];
    for (label, v, n) in &per_label {
        let secs = median(v).unwrap_or(0.0);
        println!(
            "RESULT\tours\t{what}: {label}\t{:.3}\tms\t{n}\tintervals",
            secs * 1e3
        );
        let part = match *label {
            "self-attention" => 0,
            "cross-attention" => 1,
            "linears" => 2,
            _ => 3,
        };
        parts[part] += secs;
    }
    for (part, secs) in ["self-attention", "cross-attention", "linears", "rest"]
        .iter()
        .zip(parts)
    {
        println!(
            "RESULT\tours\t{what}, {part}\t{:.3}\tms\t{:.1}\t% of the recorded forward",
            secs * 1e3,
            100.0 * secs / total
        );
    }
    Ok(())
}

fn preset(name: &str) -> Result<Preset> {
    Preset::ALL
        .into_iter()
        .find(|p| p.name() == name)
        .with_context(|| {
            let names: Vec<_> = Preset::ALL.iter().map(|p| p.name()).collect();
            format!("--preset {name:?}: one of {names:?}")
        })
}

fn main() -> Result<()> {
    let args = Args::parse();
    // The GPU script's CUDA settings (kernel cache, CUDA headers, algorithm searches).
    ditstream_kernels::testing::configure_cuda()?;
    let device = match args.device.as_str() {
        "cuda" => Device::Cuda(0),
        "cpu" => Device::Cpu,
        other => bail!("--device {other:?}: cuda or cpu"),
    };
    if args.frames % 4 != 1 || args.height % 16 != 0 || args.width % 16 != 0 {
        bail!(
            "--frames {} --height {} --width {}: frames must be 4k + 1 and height, width multiples of 16",
            args.frames,
            args.height,
            args.width
        );
    }
    let preset = preset(&args.preset)?;
    let cfg = WanConfig::preset(preset);
    let (d, heads, hd, ffn) = (
        cfg.dim(),
        cfg.num_attention_heads,
        cfg.attention_head_dim,
        cfg.ffn_dim,
    );
    let layers = cfg.num_layers;
    let latent = [
        1,
        cfg.in_channels,
        (args.frames - 1) / 4 + 1,
        args.height / 8,
        args.width / 8,
    ];
    let l = latent[2] * (latent[3] / 2) * (latent[4] / 2);
    let s = args.text_len;

    let t0 = Instant::now();
    let model = random_model(&cfg, 0, device)?;
    let build_s = t0.elapsed().as_secs_f64();
    println!(
        "model {} ({layers} blocks, D {d}, FFN {ffn}) bf16 on {device}: built from random weights in {build_s:.1} s",
        preset.name()
    );
    println!(
        "video {}x{}x{} → latent {latent:?} → {l} tokens; text {s} tokens",
        args.frames, args.height, args.width
    );

    let x = random_input(&latent, DType::BF16, 1, device)?;
    // The timestep stays on the host: the model computes the sinusoid there (no device read-back).
    let t = Tensor::from_vec(vec![500.0], &[1])?;
    let ctx = random_input(&[1, s, cfg.text_dim], DType::BF16, 2, device)?;

    let forward = median_per_call(device, args.warmup, args.iters, 1, || {
        Ok(model.forward(&x, &t, &ctx)?)
    })?;
    // The host's share: how long queueing one forward takes (the GPU idle at the start). Far below
    // the GPU's time, the host runs ahead and launch gaps are not its doing; near it, the GPU waits
    // for the host (a synchronisation inside the forward, or per-op host cost).
    let mut issue = Vec::new();
    for _ in 0..args.iters.max(1) {
        let mut secs = 0.0;
        time_on(device, || {
            let t0 = Instant::now();
            let y = model.forward(&x, &t, &ctx)?;
            secs = t0.elapsed().as_secs_f64();
            Ok(y)
        })?;
        issue.push(secs);
    }
    let issue = median(&issue).context("no forwards")?;
    println!(
        "RESULT\tours\tforward, host issue\t{:.3}\tms\t{:.0}\t% of the forward",
        issue * 1e3,
        100.0 * issue / forward
    );
    let (lf, sf, df, ff) = (l as f64, s as f64, d as f64, ffn as f64);
    let flops = layers as f64
        * (2.0 * lf * df * df * 6.0
            + 2.0 * sf * df * df * 2.0
            + 4.0 * lf * df * ff
            + 4.0 * lf * lf * df
            + 4.0 * lf * sf * df);
    println!(
        "RESULT\tours\tforward\t{:.3}\tms\t{:.1}\tTFLOP/s",
        forward * 1e3,
        flops / forward / 1e12
    );

    if args.fp8 {
        fp8_forward(&args, &model, (&x, &t, &ctx), flops, forward, device)?;
    }

    if !args.no_split {
        // The dominant ops alone, at one block's shapes, times the block count.
        let reps = args.iters.max(3);
        let q = random_input(&[1, l, heads, hd], DType::BF16, 3, device)?;
        let k_self = random_input(&[1, l, heads, hd], DType::BF16, 15, device)?;
        let v_self = random_input(&[1, l, heads, hd], DType::BF16, 16, device)?;
        let kv_txt = random_input(&[1, s, heads, hd], DType::BF16, 4, device)?;
        let self_attn = median_per_call(device, 1, reps, 1, || {
            Ok(attention(
                &q,
                &k_self,
                &v_self,
                AttentionOptions::default(),
            )?)
        })?;
        let cross_attn = median_per_call(device, 1, reps, 1, || {
            Ok(attention(
                &q,
                &kv_txt,
                &kv_txt,
                AttentionOptions::default(),
            )?)
        })?;
        use ditstream_kernels as k;
        let ops = BlockOperands::draw([l, s, d, ffn], device)?;
        let BlockOperands {
            h,
            h_ffn,
            txt,
            w_dd,
            w_up,
            w_down,
            bias_d,
            bias_f,
            gate,
        } = &ops;
        let linears = median_per_call(device, 1, reps, 1, || {
            // The block's video-token linears and cross-attention's k/v over the text.
            for _ in 0..2 {
                linear(txt, w_dd, Some(bias_d))?;
            }
            ops.video_linears()
        })?;
        // The residual branches: projection then gated_residual / add (before) against the
        // residual in the GEMM (now), self-attention's and the FFN's gated ones and cross-attention's.
        let residual_unfused = median_per_call(device, 1, reps, 1, || {
            k::gated_residual(h, &linear(h, w_dd, Some(bias_d))?, gate)?;
            k::add(h, &linear(h, w_dd, Some(bias_d))?)?;
            Ok(k::gated_residual(
                h,
                &linear(h_ffn, w_down, Some(bias_d))?,
                gate,
            )?)
        })?;
        let residual_fused = median_per_call(device, 1, reps, 1, || {
            k::linear_residual(h, w_dd, Some(bias_d), h, Some(gate))?;
            k::linear_residual(h, w_dd, Some(bias_d), h, None)?;
            Ok(k::linear_residual(
                h_ffn,
                w_down,
                Some(bias_d),
                h,
                Some(gate),
            )?)
        })?;
        println!(
            "RESULT\tours\tresidual branches (3 GEMMs + residuals), unfused → fused (×{layers})\t{:.3} → {:.3}\tms",
            residual_unfused * 1e3 * layers as f64,
            residual_fused * 1e3 * layers as f64
        );
        // The q/k preparation: rms_norm then apply_rope (before) against one pass (now), q and k.
        let w_norm = random_input(&[d], DType::BF16, 14, device)?;
        let grid = [latent[2], latent[3] / 2, latent[4] / 2];
        let (cos, sin) = k::rope_tables_3d(grid, hd, 10_000.0, device)?;
        let qk_unfused = median_per_call(device, 1, reps, 1, || {
            let n = k::rms_norm(h, &w_norm, 1e-6)?.reshape(&[1, l, heads, hd])?;
            Ok(k::apply_rope(&n, &cos, &sin)?)
        })?;
        let qk_fused = median_per_call(device, 1, reps, 1, || {
            Ok(k::rms_norm_rope(h, &w_norm, 1e-6, &cos, &sin, heads)?)
        })?;
        println!(
            "RESULT\tours\tq/k rms_norm + rope, unfused → fused (×2×{layers})\t{:.3} → {:.3}\tms",
            qk_unfused * 2e3 * layers as f64,
            qk_fused * 2e3 * layers as f64
        );
        // The FFN's up-projection and GELU: as two ops (before) and fused into the GEMM (now).
        let up_unfused = median_per_call(device, 1, reps, 1, || {
            Ok(k::gelu_tanh(&linear(h, w_up, Some(bias_f))?)?)
        })?;
        let up_fused = median_per_call(device, 1, reps, 1, || {
            Ok(k::linear_gelu_tanh(h, w_up, bias_f)?)
        })?;
        println!(
            "RESULT\tours\tffn up + gelu, unfused → fused (×{layers})\t{:.3} → {:.3}\tms",
            up_unfused * 1e3 * layers as f64,
            up_fused * 1e3 * layers as f64
        );
        // The same split inside the forward (kernels::timeline: CUDA events between the ops the
        // model marks), so each op runs at the clocks and with the caches it has there.
        in_forward_split("in forward", device, reps, forward, || {
            Ok(model.forward(&x, &t, &ctx)?)
        })?;
        let n = layers as f64;
        let rest = forward - n * (self_attn + cross_attn + linears);
        block_rest_ops([l, d, heads, hd, ffn], latent, reps, n, device)?;
        for (what, secs) in [
            ("self-attention", n * self_attn),
            ("cross-attention", n * cross_attn),
            ("linears", n * linears),
            ("rest", rest),
        ] {
            println!(
                "RESULT\tours\t{what}\t{:.3}\tms\t{:.1}\t% of forward",
                secs * 1e3,
                100.0 * secs / forward
            );
        }
        println!(
            "self-attention alone: {:.3} ms per block, {:.1} TFLOP/s; linears {:.1} TFLOP/s",
            self_attn * 1e3,
            4.0 * lf * lf * df / self_attn / 1e12,
            (2.0 * lf * df * df * 6.0 + 2.0 * sf * df * df * 2.0 + 4.0 * lf * df * ff)
                / linears
                / 1e12
        );
    }
    Ok(())
}
