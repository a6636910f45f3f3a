//! VAE convolution speed on `cuda:0`, per path, at the Wan 2.1 VAE decoder's real convolution shapes:
//! the measurement behind `ditstream_kernels::cuda::AUTO_CONV_ALGO` (issue 3: "convolutions through
//! cuDNN or implicit GEMM, chosen by measurement on the VAE shapes").
//!
//! Shapes: every convolution of one steady-state decode chunk (one latent frame in, 4 video frames out;
//! each causal conv holding 2 cached frames) at a latent of `--latent` (default 60x104, i.e. 480p):
//! 3×3×3 causal convs with 1, 2 or 4 new frames, the 1×1×1 shortcut and attention convs, the 3×1×1
//! time_conv, and the upsamplers' per-frame 3×3 conv (a 1×3×3 kernel), listed from the layout of
//! `decoder/src/vae` (config.rs `up_blocks`, layers.rs). Batch 1, bf16 by default (`--dtype f32`).
//!
//! Paths (`RESULT\t<path>\t<case>\t<ms>\t<TFLOP/s>`):
//! - `auto`: `causal_conv3d` as the decoder runs it (`ConvAlgo::Auto`: im2col for the unpadded 1×1×1
//!   convs, `via_ndhwc` for the rest; the `ROUTE` lines say which), transposes included;
//! - `im2col`: `causal_conv3d` forced to im2col + cuBLASLt (the cache read in place, bias scattered);
//! - `cudnn`: `causal_conv3d` forced to cuDNN on NCDHW (cache and zero frames joined by one copy, cuDNN,
//!   bias);
//! - `via_ndhwc`: `causal_conv3d` forced to cuDNN on a channels-last copy (`ConvAlgo::CudnnNdhwc`: the
//!   join written transposed to NDHWC by one kernel, cuDNN, the transpose back with the bias by one
//!   kernel): what `cudnn_ndhwc` costs with our NCDHW tensors;
//! - `cudnn_prejoined`: cuDNN `conv3d` (+ bias) on an input that already holds the cached frames, i.e.
//!   the convolution alone, as `bench/conv_torch.py` times torch's;
//! - `cudnn_ndhwc`: the same on channels-last tensors (`conv3d_channels_last`): whether a channels-last
//!   VAE would pay, measured rather than guessed.
//!
//! `bench/conv_torch.py` times torch's `F.conv3d` (cuDNN, `benchmark = True`) on the same list
//! (`--list` prints it) in the same machine call; `scripts/gpu-conv.sh` runs both and prints the table.
//! Timing follows GPU.md: CUDA events around `--reps` back-to-back calls on the stream every op runs on
//! (output allocation included, as the decoder pays it), after `--warmup` untimed calls (the first one
//! compiles kernels and lets cuDNN measure its algorithms), median of `--iters` batches. FLOPs =
//! 2·C_out·C_in·kt·kh·kw·T·H·W (the bias not counted). Inputs: seeded normals (beyond 16 Mi elements
//! one block repeated, `ditstream_bench::random_input`), weights scaled by 1/√fan_in.
//!
//! Also printed: `CHECK` (cuDNN and the routed path vs im2col, and channels-last vs channels-first, at
//! full size), `ROUTE` (the path `auto` takes per case), `TOTAL`
//! (Σ calls × time over one chunk, per path) and `PLAN` (the algorithm cuDNN chose per shape, and how
//! long choosing took: `DITSTREAM_CUDNN_SEARCH=heuristic` compares cuDNN's ranking with its measurement).

use anyhow::{Context, Result, bail};
use clap::Parser;
use ditstream_bench::{median_per_call, random_input, rel_rms};
use ditstream_kernels::cuda::{
    ConvAlgo, auto_conv_algo, cudnn_conv_plans, cudnn_version, with_conv_algo,
};
use ditstream_kernels::testing::max_abs_diff;
use ditstream_kernels::{DType, Device, Tensor, causal_conv3d, conv3d, conv3d_channels_last};

/// Every path `--paths` may name.
const PATHS: [&str; 6] = [
    "auto",
    "im2col",
    "cudnn",
    "via_ndhwc",
    "cudnn_prejoined",
    "cudnn_ndhwc",
];

#[derive(Parser, Debug)]
#[command(about = "Time the VAE decoder's convolutions per CUDA path")]
struct Args {
    /// Latent height x width (60x104 is 480p, 90x160 720p).
    #[arg(long, default_value = "60x104")]
    latent: String,
    /// bf16 or f32.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Untimed calls per path and shape (the first measures cuDNN's algorithms).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Back-to-back calls between two events.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Timed batches (the median is reported).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Only these paths (comma-separated: auto, im2col, cudnn, via_ndhwc, cudnn_prejoined,
    /// cudnn_ndhwc).
    #[arg(
        long,
        default_value = "auto,im2col,cudnn,via_ndhwc,cudnn_prejoined,cudnn_ndhwc"
    )]
    paths: String,
    /// Appended to every path name in the output (e.g. `_heur` for a run with
    /// DITSTREAM_CUDNN_SEARCH=heuristic).
    #[arg(long, default_value = "")]
    tag: String,
    /// Skip the full-size comparison of the paths (`CHECK` lines).
    #[arg(long)]
    no_check: bool,
    /// Print the case list (`CASE` lines, read by bench/conv_torch.py) and exit.
    #[arg(long)]
    list: bool,
}

/// One convolution of the decoder: `calls` of them per steady-state chunk.
struct Case {
    name: String,
    c_in: usize,
    c_out: usize,
    kernel: [usize; 3],
    /// New frames in (the chunk's T at that layer).
    frames: usize,
    /// Cached frames in front (kt − 1 for a causal conv in steady state, 0 for kt = 1).
    cached: usize,
    h: usize,
    w: usize,
    calls: usize,
}

impl Case {
    fn flops(&self) -> f64 {
        let [kt, kh, kw] = self.kernel;
        2.0 * (self.c_out * self.c_in * kt * kh * kw * self.frames * self.h * self.w) as f64
    }
}

/// The Wan 2.1 decoder's convolutions for one chunk of one latent frame after the first (T = 1 at the
/// latent, 2 after the first upsample3d, 4 after the second), latent `lh`×`lw`. Widths from
/// `VaeConfig::wan21().up_blocks()`: [(384→384, upsample3d), (192→384, upsample3d), (192→192,
/// upsample2d), (96→96)], mid block at 384, conv_in 16→384, conv_out 96→3; 3 residual blocks per up
/// block (2 convs each), each upsampler's 3×3 conv halving the width.
fn decoder_cases(lh: usize, lw: usize) -> Vec<Case> {
    let case = |c_in, c_out, kernel: [usize; 3], frames, scale, calls, role: &str| {
        let cached = kernel[0] - 1;
        let (h, w) = (lh * scale, lw * scale);
        Case {
            name: format!(
                "{role} {}x{}x{} {c_in}>{c_out} {h}x{w} T{frames}+{cached}",
                kernel[0], kernel[1], kernel[2]
            ),
            c_in,
            c_out,
            kernel,
            frames,
            cached,
            h,
            w,
            calls,
        }
    };
    vec![
        case(16, 16, [1, 1, 1], 1, 1, 1, "post_quant"),
        case(16, 384, [3, 3, 3], 1, 1, 1, "conv_in"),
        case(384, 384, [3, 3, 3], 1, 1, 10, "mid+up0"),
        case(384, 1152, [1, 1, 1], 1, 1, 1, "attn.qkv"),
        case(384, 384, [1, 1, 1], 1, 1, 1, "attn.proj"),
        case(384, 768, [3, 1, 1], 1, 1, 1, "up0.time"),
        case(384, 192, [1, 3, 3], 2, 2, 1, "up0.resample"),
        case(192, 384, [3, 3, 3], 2, 2, 1, "up1.conv1"),
        case(192, 384, [1, 1, 1], 2, 2, 1, "up1.shortcut"),
        case(384, 384, [3, 3, 3], 2, 2, 5, "up1"),
        case(384, 768, [3, 1, 1], 2, 2, 1, "up1.time"),
        case(384, 192, [1, 3, 3], 4, 4, 1, "up1.resample"),
        case(192, 192, [3, 3, 3], 4, 4, 6, "up2"),
        case(192, 96, [1, 3, 3], 4, 8, 1, "up2.resample"),
        case(96, 96, [3, 3, 3], 4, 8, 6, "up3"),
        case(96, 3, [3, 3, 3], 4, 8, 1, "conv_out"),
    ]
}

fn parse_hw(s: &str) -> Result<(usize, usize)> {
    let (h, w) = s
        .split_once('x')
        .with_context(|| format!("--latent {s:?}: expected HxW"))?;
    Ok((h.trim().parse()?, w.trim().parse()?))
}

fn main() -> Result<()> {
    let args = Args::parse();
    // The GPU script's CUDA settings (kernel cache, CUDA headers, algorithm searches).
    ditstream_kernels::testing::configure_cuda()?;
    let (lh, lw) = parse_hw(&args.latent)?;
    let cases = decoder_cases(lh, lw);
    if args.list {
        for c in &cases {
            let [kt, kh, kw] = c.kernel;
            println!(
                "CASE\t{}\t{}\t{}\t{kt},{kh},{kw}\t{}\t{}\t{}\t{}\t{}",
                c.name, c.c_in, c.c_out, c.frames, c.cached, c.h, c.w, c.calls
            );
        }
        return Ok(());
    }
    let dtype = match args.dtype.as_str() {
        "bf16" => DType::BF16,
        "f32" => DType::F32,
        other => bail!("--dtype {other:?}: expected bf16 or f32"),
    };
    let paths: Vec<&str> = args.paths.split(',').map(str::trim).collect();
    for p in &paths {
        if !PATHS.contains(p) {
            bail!("--paths: unknown path {p:?}");
        }
    }
    let dev = Device::Cuda(0);
    println!(
        "conv bench: latent {lh}x{lw}, {}, cuDNN {}",
        args.dtype,
        cudnn_version(0).map_or_else(|e| format!("unavailable ({e})"), |v| v.to_string())
    );
    let time = |f: &mut dyn FnMut() -> Result<Tensor>| -> Result<f64> {
        median_per_call(dev, args.warmup, args.iters, args.reps, f)
    };
    let mut totals = vec![0.0f64; paths.len()];
    for (ci, c) in cases.iter().enumerate() {
        let seed = 100 + 10 * ci as u64;
        let [kt, kh, kw] = c.kernel;
        let x = random_input(&[1, c.c_in, c.frames, c.h, c.w], dtype, seed, dev)?;
        let cache = (c.cached > 0)
            .then(|| random_input(&[1, c.c_in, c.cached, c.h, c.w], dtype, seed + 1, dev))
            .transpose()?;
        // Weights ~ N(0, 1/fan_in) so that outputs stay O(1) in bf16.
        let fan_in = (c.c_in * kt * kh * kw) as f32;
        let w = ditstream_kernels::scale(
            &random_input(&[c.c_out, c.c_in, kt, kh, kw], dtype, seed + 2, dev)?,
            1.0 / fan_in.sqrt(),
        )?;
        let b = random_input(&[c.c_out], dtype, seed + 3, dev)?;
        // The input with its history joined in (what the prejoined paths and torch convolve).
        let joined = match &cache {
            Some(cache) => Tensor::concat(&[cache, &x], 2)?,
            None => x.clone(),
        };
        let padding = [0, kh / 2, kw / 2];
        let to_last = [0, 2, 3, 4, 1];
        let (joined_last, w_last) = (joined.permute(&to_last)?, w.permute(&to_last)?);
        let causal = |algo| {
            with_conv_algo(algo, || {
                causal_conv3d(&x, &w, Some(&b), cache.as_ref()).map_err(anyhow::Error::from)
            })
        };
        let prejoined = || {
            with_conv_algo(ConvAlgo::Cudnn, || {
                conv3d(&joined, &w, Some(&b), [1, 1, 1], padding).map_err(anyhow::Error::from)
            })
        };
        let ndhwc = || {
            conv3d_channels_last(&joined_last, &w_last, Some(&b), [1, 1, 1], padding)
                .map_err(anyhow::Error::from)
        };
        println!(
            "ROUTE\t{}\t{:?}",
            c.name,
            auto_conv_algo(c.kernel, kh > 1 || kw > 1 || c.cached < kt - 1)
        );
        if !args.no_check {
            // Full-size agreement of the paths (also the first, measuring, cuDNN call of each shape).
            let reference = causal(ConvAlgo::Im2col)?;
            let via_cudnn = causal(ConvAlgo::Cudnn)?;
            let via_ndhwc = causal(ConvAlgo::CudnnNdhwc)?;
            let routed = causal(ConvAlgo::Auto)?;
            let last = ndhwc()?.permute(&[0, 4, 1, 2, 3])?;
            println!(
                "CHECK\t{}\tcudnn vs im2col max|diff| {:.3e} rel rms {:.2e}\tvia_ndhwc vs im2col \
                 max|diff| {:.3e} rel rms {:.2e}\tauto vs im2col rel rms {:.2e}\tndhwc vs cudnn \
                 max|diff| {:.3e}",
                c.name,
                max_abs_diff(&via_cudnn, &reference)?,
                rel_rms(&via_cudnn, &reference)?,
                max_abs_diff(&via_ndhwc, &reference)?,
                rel_rms(&via_ndhwc, &reference)?,
                rel_rms(&routed, &reference)?,
                max_abs_diff(&last, &prejoined()?)?
            );
        }
        for (pi, path) in paths.iter().enumerate() {
            let secs = match *path {
                "auto" => time(&mut || causal(ConvAlgo::Auto))?,
                "im2col" => time(&mut || causal(ConvAlgo::Im2col))?,
                "cudnn" => time(&mut || causal(ConvAlgo::Cudnn))?,
                "via_ndhwc" => time(&mut || causal(ConvAlgo::CudnnNdhwc))?,
                "cudnn_prejoined" => time(&mut || prejoined())?,
                _ => time(&mut || ndhwc())?,
            };
            totals[pi] += secs * c.calls as f64;
            println!(
                "RESULT\t{path}{}\t{}\t{:.4}\t{:.1}",
                args.tag,
                c.name,
                secs * 1e3,
                c.flops() / secs / 1e12
            );
        }
    }
    for (path, total) in paths.iter().zip(&totals) {
        println!("TOTAL\t{path}{}\t{:.3}", args.tag, total * 1e3);
    }
    for plan in cudnn_conv_plans(0)? {
        println!("PLAN{}\t{plan}", args.tag);
    }
    Ok(())
}
