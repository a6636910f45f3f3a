//! The umT5 text encoder's forward (Wan's prompt encode) at umT5-XXL size with seeded random weights,
//! in bf16 on `cuda:0`: one 512-token prompt (batch 1), and a prompt with its negative prompt in one
//! batch of 2, both padded to 512 tokens with an attention mask as the Wan pipeline pads them (the
//! negative prompt is 126 real tokens; padded keys are masked, and every length costs the same).
//!
//! Weights come from `T5Encoder::random`, drawn on the GPU itself (the host draw would take minutes for
//! 5.7 B values); the time to build them is printed apart and is not part of the encode. Timing follows
//! GPU.md: CUDA events on the one stream every op runs on, around the whole `forward` (the host's copy
//! of the token ids, buckets and lengths included), after `--warmup` untimed calls (the first compiles
//! the kernels and plans the GEMMs); the median of `--iters`. The effective rate counts the matrix
//! FLOPs of one forward: per layer 2·T·d·inner·4 (q, k, v, o) + 2·T·d·d_ff·3 (wi_0, wi_1, wo)
//! + 4·B·S²·inner (QKᵀ and PV), T = B·S tokens.
//!
//! `bench/text_encode_torch.py` times transformers' `UMT5EncoderModel` the same way;
//! `scripts/gpu-text.sh` runs both and compares the `RESULT` lines. `--device cpu --preset tiny` runs
//! the same code on the CPU backend (wall clock) as a smoke test of the driver.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use ditstream_bench::{median, time_on};
use ditstream_denoiser::text::{T5Config, T5Encoder};
use ditstream_kernels::{DType, Device};

#[derive(Parser, Debug)]
#[command(about = "Time the umT5 encoder forward with random weights (bf16, one GPU)")]
struct Args {
    /// Model dimensions: `umt5-xxl` (Wan's text encoder) or `tiny` (the built-in tiny model).
    #[arg(long, default_value = "umt5-xxl")]
    preset: String,
    /// Tokens per prompt (Wan pads to 512).
    #[arg(long, default_value_t = 512)]
    seq: usize,
    /// Real tokens of the negative prompt in the batch of 2 (the rest is padding, masked).
    #[arg(long, default_value_t = 126)]
    negative_len: usize,
    /// Untimed warm-up forwards per batch size.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Timed forwards per batch size (the median is reported).
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// `cuda` (cuda:0) or `cpu` (a smoke test of the driver).
    #[arg(long, default_value = "cuda")]
    device: String,
}

/// Waits for everything queued on `device`.
fn sync(device: Device) -> Result<()> {
    if let Device::Cuda(ordinal) = device {
        ditstream_kernels::cuda::synchronize(ordinal)?;
    }
    Ok(())
}

/// Seeded token ids in [1, vocab) (a SplitMix64 stream; any id costs the same).
fn token_ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    (0..n as u64)
        .map(|i| {
            let mut z = (seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_add(0x9E37_79B9);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (1 + z % (vocab as u64 - 1)) as u32
        })
        .collect()
}

/// Matrix FLOPs of one forward over a [batch, seq] input.
fn forward_flops(c: &T5Config, batch: usize, seq: usize) -> f64 {
    let (t, d, inner, ff) = (
        (batch * seq) as f64,
        c.d_model as f64,
        c.inner_dim() as f64,
        c.d_ff as f64,
    );
    let per_layer = 2.0 * t * d * inner * 4.0
        + 2.0 * t * d * ff * 3.0
        + 4.0 * batch as f64 * (seq as f64).powi(2) * inner;
    c.num_layers as f64 * per_layer
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
    let config = match args.preset.as_str() {
        "umt5-xxl" => T5Config::umt5_xxl(),
        "tiny" => T5Config::tiny(),
        other => bail!("--preset {other:?}: umt5-xxl or tiny"),
    };
    if args.seq == 0 || args.negative_len == 0 || args.negative_len > args.seq {
        bail!(
            "--seq {} --negative-len {}: need 0 < negative-len ≤ seq",
            args.seq,
            args.negative_len
        );
    }
    let params = config.vocab_size * config.d_model
        + config.num_layers
            * (4 * config.d_model * config.inner_dim()
                + 3 * config.d_model * config.d_ff
                + config.num_buckets * config.num_heads
                + 2 * config.d_model)
        + config.d_model;

    let t0 = Instant::now();
    let encoder = T5Encoder::random(&config, 0, DType::BF16, device)?;
    sync(device)?;
    let build_s = t0.elapsed().as_secs_f64();
    println!(
        "model {} ({} layers, d {}, {} heads × {}, d_ff {}, vocab {}): {:.1} M parameters, bf16 on \
         {device}, random weights drawn on the device in {build_s:.2} s",
        args.preset,
        config.num_layers,
        config.d_model,
        config.num_heads,
        config.d_kv,
        config.d_ff,
        config.vocab_size,
        params as f64 / 1e6,
    );

    let s = args.seq;
    for (label, lens) in [("b1", vec![s]), ("b2", vec![s, args.negative_len])] {
        let batch = lens.len();
        let ids = token_ids(batch * s, config.vocab_size, 7);
        let forward = || Ok(encoder.forward(&ids, [batch, s], &lens)?);
        // One checked call first: the states have the pipeline's shape and are finite.
        let out = forward()?;
        let values = out.to_vec_f32()?;
        if out.shape() != [batch, s, config.d_model] || values.iter().any(|v| !v.is_finite()) {
            bail!(
                "{label}: states of shape {:?} with non-finite values",
                out.shape()
            );
        }
        let rms = (values.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / values.len() as f64)
            .sqrt();
        for _ in 0..args.warmup {
            time_on(device, forward)?;
        }
        let samples = (0..args.iters.max(1))
            .map(|_| time_on(device, forward))
            .collect::<Result<Vec<_>>>()?;
        let secs = median(&samples).context("no samples")?;
        let (lo, hi) = samples
            .iter()
            .fold((f64::INFINITY, 0.0f64), |(lo, hi), &x| {
                (lo.min(x), hi.max(x))
            });
        println!(
            "{label}: ids [{batch}, {s}], valid lengths {lens:?}; states rms {rms:.3}; {} timed \
             forwards: min {:.3} ms, max {:.3} ms",
            samples.len(),
            lo * 1e3,
            hi * 1e3
        );
        println!(
            "RESULT\tours\t{label}\t{:.3}\tms\t{:.1}\tTFLOP/s",
            secs * 1e3,
            forward_flops(&config, batch, s) / secs / 1e12
        );
    }
    Ok(())
}
