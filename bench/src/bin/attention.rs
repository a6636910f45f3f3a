//! Attention forward speed on `cuda:0`: our tensor-core kernel (every compiled variant of the head dim
//! and the automatic choice) and, at D = 128, the Hopper wgmma kernel's variants (`HOPPER_VARIANTS`), at the
//! DiT self-attention shapes, bf16, non-causal, D = 128 by default. `--no-hopper` leaves the Hopper
//! kernel out, `--hopper-only` times only its variants and the automatic choice: `scripts/gpu-attention.sh` runs
//! it in its own process, so a device fault of the new kernel cannot take the other timings with it.
//!
//! Timing follows GPU.md: CUDA events around each call on the one stream every op runs on (the output
//! allocation included, as a model step pays it), after `--warmup` untimed calls (the first compiles
//! the kernels), the median of `--iters`. Inputs are seeded normals. FLOPs = 4·B·H·S²·D.
//! `bench/attention_torch.py` times torch's `scaled_dot_product_attention` the same way;
//! `scripts/gpu-attention.sh` runs both and prints the table.
//!
//! Before timing, a check at full size: the automatic choice against the portable f32 kernel at the
//! first shape (one call, ~1 s), and every variant against the automatic choice at every shape, printed
//! as `CHECK` lines (max |diff| of out, max |diff| of lse).
//!
//! A shape may name a key length of its own (`B,H,S,D,S_kv`, e.g. the DiT's cross-attention to 512
//! text tokens: `1,12,32760,128,512`); FLOPs are then 4·B·H·S·S_kv·D.
//!
//! `--fp8` adds the FP8 attention's variants (quantisation of Q, K, V included in the time) and their
//! relative RMS distance to the bf16 result, and for each the call's parts timed inside it: the
//! quantisation's two kernels and the attention kernel, on a recorded timeline of `--iters` calls
//! (`SPLIT` lines).
//!
//! Each kernel is timed one way, or two with `--batch`. `RESULT`: each call alone between an
//! event pair, waited for before the next (the median of `--iters`), so a call's time also holds
//! whatever the idle GPU waits for while the host queues the call. `BATCH`: the median of
//! `BATCHES` batches of `--iters` back-to-back calls, one event pair around each batch, divided by
//! `--iters`: the host queues ahead of the GPU, as through a forward's ops. Why both: on an H100
//! (bench/RESULTS.md, 2026-12-07, fourteenth session) the FP8 default's `RESULT` exceeded the sum
//! of its `SPLIT` parts (back to back) by 0.20–0.56 ms, 2.7–7.3 % of the call. Measured both ways
//! (fifteenth session), the two kernels lose about as much back to back (bf16 0.33–0.68 ms, FP8
//! 0.29–0.72), so the FP8/bf16 ratio moves little between the two.
//!
//! Output: `RESULT|BATCH\tours\t<kernel>\t(B,H,S,D[,S_kv])\t<ms>\t<TFLOP/s>` lines; with `--fp8` also
//! `SPLIT\t<kernel>\t(B,H,S,D)\tquantize q,k <ms>\tquantize v <ms>\tkernel <ms>` (medians per call).

use anyhow::{Context, Result, bail};
use clap::Parser;
use ditstream_bench::{median, median_per_call, rel_rms, time_on};
use ditstream_kernels::cuda::{
    AttentionKernel, FLASH_VARIANTS, HOPPER_FP8_VARIANTS, HOPPER_VARIANTS, with_attention_kernel,
};
use ditstream_kernels::testing::max_abs_diff;
use ditstream_kernels::{
    AttentionOptions, DType, Device, FP8_ATTENTION_QUANTIZE_MARKS, Tensor, attention, attention_fp8,
};

/// `BATCH` timing: batches of `--iters` back-to-back calls (see the module docs).
const BATCHES: usize = 3;

#[derive(Parser, Debug)]
#[command(about = "Time our attention forward (bf16, D = 128) at the DiT shapes")]
struct Args {
    /// Shapes as B,H,S (D = 128), B,H,S,D or B,H,S,D,S_kv (keys ≠ queries), separated by spaces.
    #[arg(
        long,
        num_args = 1..,
        default_values_t = ["1,12,32760".to_string(), "1,40,75600".to_string(), "1,24,27280".to_string(), "2,12,8190".to_string()]
    )]
    shapes: Vec<String>,
    /// Untimed warm-up calls per kernel and shape.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Before each kernel's warm-up calls, more untimed calls until this many milliseconds of GPU
    /// time have passed, so that every kernel is timed at the clock the GPU sustains at its power
    /// limit, as inside a forward. Without it a few calls of ~10 ms ran partly at the clock of a
    /// GPU that was idle: at (1,12,32760,128) on an H100 our bf16 took 9.3–9.9 ms and the FP8
    /// default 6.35–6.38 without it, 10.6–10.8 and 7.36–7.46 with it (bench/RESULTS.md,
    /// 2026-12-06, tenth session). 0 turns it off.
    #[arg(long, default_value_t = 1000)]
    settle_ms: u64,
    /// Timed calls (the median is reported).
    #[arg(long, default_value_t = 7)]
    iters: usize,
    /// Skip the full-size comparison with the portable kernel.
    #[arg(long)]
    no_portable_check: bool,
    /// Only the automatic choice (not every variant).
    #[arg(long)]
    auto_only: bool,
    /// Leave the Hopper kernel out.
    #[arg(long, conflicts_with = "hopper_only")]
    no_hopper: bool,
    /// Only the automatic choice and the Hopper kernel.
    #[arg(long)]
    hopper_only: bool,
    /// Also time each kernel back to back (`BATCH` lines, see the module docs): `BATCHES` ×
    /// `--iters` more calls per kernel and shape.
    #[arg(long)]
    batch: bool,
    /// Also time the FP8 attention (`attention_fp8`, every `HOPPER_FP8_VARIANTS` entry; D = 128),
    /// its operands' quantisation included, and print its distance to the bf16 result.
    #[arg(long)]
    fp8: bool,
    /// With --fp8, only the variants with these labels (`HopperFp8Variant::label`; repeatable).
    #[arg(long = "fp8-variant", requires = "fp8")]
    fp8_variants: Vec<String>,
}

/// Calls `f` until `ms` milliseconds of GPU time have passed (`--settle-ms`).
fn settle<T>(dev: Device, ms: u64, mut f: impl FnMut() -> Result<T>) -> Result<()> {
    let mut spent = 0.0;
    while spent * 1e3 < ms as f64 {
        spent += time_on(dev, &mut f)?;
    }
    Ok(())
}

/// The FP8 attention's parts inside `calls` back-to-back calls of `run`, on a recorded timeline
/// (`ditstream_kernels::timeline`): the op marks the end of each of its two quantisation kernels
/// (`FP8_ATTENTION_QUANTIZE_MARKS`), and here each call's end closes its kernel's interval → the
/// medians per call, seconds, [quantize q and k, quantize v, kernel].
fn fp8_split<T>(dev: Device, calls: usize, mut run: impl FnMut() -> Result<T>) -> Result<[f64; 3]> {
    use ditstream_kernels::timeline::{mark, record};
    const KERNEL: &str = "fp8 attention: kernel";
    let (_, intervals) = record(dev, || {
        for _ in 0..calls {
            run()?;
            mark(KERNEL);
        }
        Ok::<_, anyhow::Error>(())
    })?;
    let median_of = |label: &str| -> Result<f64> {
        let v: Vec<f64> = intervals
            .iter()
            .filter(|(l, _)| *l == label)
            .map(|(_, s)| *s)
            .collect();
        match median(&v) {
            Some(m) if v.len() == calls => Ok(m),
            _ => bail!("{label}: {} intervals in {calls} calls", v.len()),
        }
    };
    let [qk, v] = FP8_ATTENTION_QUANTIZE_MARKS;
    Ok([median_of(qk)?, median_of(v)?, median_of(KERNEL)?])
}

fn parse_shape(s: &str) -> Result<[usize; 5]> {
    let v: Vec<usize> = s
        .split(',')
        .map(|x| x.trim().parse::<usize>())
        .collect::<std::result::Result<_, _>>()
        .with_context(|| format!("shape {s:?}: expected B,H,S[,D[,S_kv]]"))?;
    match v[..] {
        [b, h, seq] => Ok([b, h, seq, 128, seq]),
        [b, h, seq, d] => Ok([b, h, seq, d, seq]),
        [b, h, seq, d, kv] => Ok([b, h, seq, d, kv]),
        _ => bail!("shape {s:?}: expected B,H,S[,D[,S_kv]]"),
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let labels: Vec<String> = HOPPER_FP8_VARIANTS.iter().map(|v| v.label()).collect();
    if let Some(bad) = args.fp8_variants.iter().find(|l| !labels.contains(l)) {
        bail!(
            "--fp8-variant {bad}: no such FP8 variant; the labels are {}",
            labels.join(", ")
        );
    }
    // The GPU script's CUDA settings (kernel cache, CUDA headers, algorithm searches).
    ditstream_kernels::testing::configure_cuda()?;
    let dev = Device::Cuda(0);
    for (si, shape) in args.shapes.iter().enumerate() {
        let [b, h, s, d, s_kv] = parse_shape(shape)?;
        let mut kernels = vec![(AttentionKernel::Auto, "auto".to_string())];
        if !args.auto_only && !args.hopper_only {
            for (i, v) in FLASH_VARIANTS.iter().enumerate() {
                if v.head_dim == d {
                    kernels.push((AttentionKernel::Flash(i), v.name.to_string()));
                }
            }
        }
        // Last, so that a fault of the new kernel comes after every other timing of the shape.
        if d == 128 && !args.no_hopper && (!args.auto_only || args.hopper_only) {
            for (i, v) in HOPPER_VARIANTS.iter().enumerate() {
                kernels.push((AttentionKernel::Hopper(i), v.label()));
            }
        }
        let label = if s_kv == s {
            format!("({b},{h},{s},{d})")
        } else {
            format!("({b},{h},{s},{d},{s_kv})")
        };
        let q = Tensor::randn(&[b, s, h, d], DType::BF16, 11, dev)?;
        let k = Tensor::randn(&[b, s_kv, h, d], DType::BF16, 12, dev)?;
        let v = Tensor::randn(&[b, s_kv, h, d], DType::BF16, 13, dev)?;
        let opts = AttentionOptions::default();
        let run =
            |kernel: AttentionKernel| with_attention_kernel(kernel, || attention(&q, &k, &v, opts));
        let (ref_out, ref_lse) = run(AttentionKernel::Auto)?;
        if si == 0 && !args.no_portable_check && !args.hopper_only {
            let (po, pl) = run(AttentionKernel::Portable)?;
            println!(
                "CHECK\tauto vs portable\t{label}\tout max|diff| {:.3e}\tlse max|diff| {:.3e}",
                max_abs_diff(&ref_out, &po)?,
                max_abs_diff(&ref_lse, &pl)?
            );
        }
        let flops = 4.0 * (b * h * s * s_kv * d) as f64;
        for (kernel, name) in &kernels {
            // A kernel that refuses this GPU or shape (the Hopper one off sm_90a) is reported, not fatal.
            let (o, l) = match run(*kernel) {
                Ok(r) => r,
                Err(e) if matches!(kernel, AttentionKernel::Hopper(_)) => {
                    println!("SKIP\t{name}\t{label}\t{e}");
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            if *kernel != AttentionKernel::Auto {
                println!(
                    "CHECK\t{name} vs auto\t{label}\tout max|diff| {:.3e}\tlse max|diff| {:.3e}",
                    max_abs_diff(&o, &ref_out)?,
                    max_abs_diff(&l, &ref_lse)?
                );
            }
            settle(dev, args.settle_ms, || Ok(run(*kernel)?))?;
            let t = median_per_call(dev, args.warmup, args.iters, 1, || Ok(run(*kernel)?))?;
            println!(
                "RESULT\tours\t{name}\t{label}\t{:.3}\t{:.1}",
                t * 1e3,
                flops / t / 1e12
            );
            if args.batch {
                let t = median_per_call(dev, 0, BATCHES, args.iters, || Ok(run(*kernel)?))?;
                println!(
                    "BATCH\tours\t{name}\t{label}\t{:.3}\t{:.1}",
                    t * 1e3,
                    flops / t / 1e12
                );
            }
        }
        if args.fp8 && d == 128 {
            for (i, variant) in HOPPER_FP8_VARIANTS.iter().enumerate() {
                if !args.fp8_variants.is_empty() && !args.fp8_variants.contains(&variant.label()) {
                    continue;
                }
                let kernel = AttentionKernel::HopperFp8(i);
                let run8 = || with_attention_kernel(kernel, || attention_fp8(&q, &k, &v, opts));
                let (o, l) = match run8() {
                    Ok(r) => r,
                    Err(e) => {
                        println!("SKIP\t{}\t{label}\t{e}", variant.label());
                        continue;
                    }
                };
                println!(
                    "CHECK\t{} vs auto (bf16)\t{label}\tout rel rms {:.3e}\tlse max|diff| {:.3e}",
                    variant.label(),
                    rel_rms(&o, &ref_out)?,
                    max_abs_diff(&l, &ref_lse)?
                );
                settle(dev, args.settle_ms, || Ok(run8()?))?;
                let t = median_per_call(dev, args.warmup, args.iters, 1, || Ok(run8()?))?;
                println!(
                    "RESULT\tours\t{}\t{label}\t{:.3}\t{:.1}",
                    variant.label(),
                    t * 1e3,
                    flops / t / 1e12
                );
                if args.batch {
                    let t = median_per_call(dev, 0, BATCHES, args.iters, || Ok(run8()?))?;
                    println!(
                        "BATCH\tours\t{}\t{label}\t{:.3}\t{:.1}",
                        variant.label(),
                        t * 1e3,
                        flops / t / 1e12
                    );
                }
                let [qk, v, kernel] = fp8_split(dev, args.iters, || Ok(run8()?))?;
                println!(
                    "SPLIT\t{}\t{label}\tquantize q,k {:.3}\tquantize v {:.3}\tkernel {:.3}",
                    variant.label(),
                    qk * 1e3,
                    v * 1e3,
                    kernel * 1e3
                );
            }
        }
    }
    Ok(())
}
