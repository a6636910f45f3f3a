//! GEMM speed on `cuda:0` at the Wan DiT's linear shapes (issue 3's "GEMM TFLOP/s on the DiT shapes of
//! GPU.md, ≥ 90 % of the cuBLASLt figures there"): our cuBLASLt path (`kernels/src/cuda/gemm.rs`, plans
//! cached per shape) through the `linear` and `matmul` ops, bf16, f32 accumulation.
//!
//! Shapes (M tokens × K in → N out): the Wan2.1-1.3B block linears at 480p 81 frames (32,760 tokens:
//! q/k/v/o 1536→1536, FFN 1536→8960→1536), the 14B ones at 720p 81 frames (75,600 tokens: 5120→5120,
//! FFN 5120→13824→5120), and 8192³, GPU.md's ceilings. Variants (`RESULT\tours\t<variant>\t<shape>\t<ms>
//! \t<TFLOP/s>`):
//! - `linear`: x [M, K] · W [N, K]ᵀ, no bias (the plain GEMM, what GPU.md's figures measure);
//! - `linear+bias`: the same with the bias epilogue (what the DiT runs);
//! - `matmul`: a [M, K] · b [K, N] (no transpose).
//!
//! `bench/gemm_torch.py` times torch.matmul / F.linear on the same list (`--list` prints it) in the same
//! machine call; `scripts/gpu-conv.sh` prints ratios to torch and to GPU.md's figures. Timing follows
//! GPU.md: CUDA events around `--reps` back-to-back calls on our stream (output allocation included),
//! after `--warmup` untimed calls, median of `--iters` batches. FLOPs = 2·M·K·N. Inputs: seeded normals
//! (beyond 16 Mi elements one block repeated, `ditstream_bench::random_input`).

use anyhow::{Result, bail};
use clap::Parser;
use ditstream_bench::{median_per_call, random_input};
use ditstream_kernels::{DType, Device, Tensor, linear, matmul};

#[derive(Parser, Debug)]
#[command(about = "Time our cuBLASLt GEMMs at the DiT linear shapes")]
struct Args {
    /// Untimed calls per variant and shape.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Back-to-back calls between two events.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Timed batches (the median is reported).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Print the shape list (`CASE` lines, read by bench/gemm_torch.py) and exit.
    #[arg(long)]
    list: bool,
}

/// (label, M, K, N, GPU.md's cuBLASLt figure in TFLOP/s for the shape family: the low end of its
/// measured range, "706–817" for the DiT-shaped linears and "788–791" for 8192³).
const SHAPES: &[(&str, usize, usize, usize, f64)] = &[
    ("1.3B.qkvo", 32760, 1536, 1536, 706.0),
    ("1.3B.ffn_up", 32760, 1536, 8960, 706.0),
    ("1.3B.ffn_down", 32760, 8960, 1536, 706.0),
    ("14B.qkvo", 75600, 5120, 5120, 706.0),
    ("14B.ffn_up", 75600, 5120, 13824, 706.0),
    ("14B.ffn_down", 75600, 13824, 5120, 706.0),
    ("8192^3", 8192, 8192, 8192, 788.0),
];

fn main() -> Result<()> {
    let args = Args::parse();
    // The GPU script's CUDA settings (kernel cache, CUDA headers, algorithm searches).
    ditstream_kernels::testing::configure_cuda()?;
    if args.list {
        for (label, m, k, n, gpu_md) in SHAPES {
            println!("CASE\t{label}\t{m}\t{k}\t{n}\t{gpu_md}");
        }
        return Ok(());
    }
    if args.reps == 0 || args.iters == 0 {
        bail!("--reps and --iters must be ≥ 1");
    }
    let dev = Device::Cuda(0);
    let time = |f: &mut dyn FnMut() -> Result<Tensor>| -> Result<f64> {
        median_per_call(dev, args.warmup, args.iters, args.reps, f)
    };
    for (si, &(label, m, k, n, _)) in SHAPES.iter().enumerate() {
        let seed = 10 * si as u64;
        let x = random_input(&[m, k], DType::BF16, seed, dev)?;
        let w = random_input(&[n, k], DType::BF16, seed + 1, dev)?;
        let bias = random_input(&[n], DType::BF16, seed + 2, dev)?;
        let flops = 2.0 * (m * k * n) as f64;
        let report = |variant: &str, secs: f64| {
            println!(
                "RESULT\tours\t{variant}\t{label}\t{:.3}\t{:.1}",
                secs * 1e3,
                flops / secs / 1e12
            );
        };
        report("linear", time(&mut || Ok(linear(&x, &w, None)?))?);
        report(
            "linear+bias",
            time(&mut || Ok(linear(&x, &w, Some(&bias))?))?,
        );
        // b [K, N]: a layout of its own (not Wᵀ as a view: tensors are contiguous).
        let b = random_input(&[k, n], DType::BF16, seed + 3, dev)?;
        report("matmul", time(&mut || Ok(matmul(&x, &b)?))?);
    }
    Ok(())
}
