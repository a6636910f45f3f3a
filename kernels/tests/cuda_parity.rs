//! GPU parity: every CUDA op against its CPU twin on seeded random inputs (feature `cuda`).
//!
//! Skips (with a message) where no GPU or CUDA library is found, but fails when the environment sets
//! `DITSTREAM_REQUIRE_GPUS` (≥ 1), as `scripts/gpu-kernels.sh` does on the GPU machine, so a skip never
//! hides a failure. Each case prints a `PARITY` line (op, dtype, shape, max abs diff, tolerance) that
//! the script summarises.
//!
//! ## Tolerances
//! Both sides read the *same* stored values (bf16 inputs are bf16 on both sides) and compute in f32, so
//! they differ only by f32 evaluation order and by the GPU's `expf`/`tanhf`/`logf` (≤ 2 ulp), i.e. by a
//! few f32 ulps before the output is stored. Stored in bf16 (8 significant bits, round to nearest), two
//! f32 values that close round to the same bf16 or to neighbours: at most one bf16 ulp apart, 2⁻⁷ of the
//! value. Hence, per element, `|gpu − cpu| ≤ atol + rtol·|cpu|` with
//! - bf16 outputs: rtol = 1e-2 (> 2⁻⁷ ≈ 7.8e-3); atol covers values near 0, where one bf16 ulp is tiny
//!   but the f32 order difference is not: it is set per op from the size of the f32 terms summed
//!   (1e-5 for pointwise ops, ~1e-6·n·max|term| for sums of n terms: GEMM, attention, norms);
//! - f32 outputs: rtol = 1e-5 for pointwise ops (a few f32 ulps), and for reductions the same
//!   n·2⁻²⁴·max|term| bound as atol;
//! - LSE (always f32): it is a max plus a log of a sum of ≤ S_k terms in [0, 1]: atol 1e-4 covers
//!   S_k·2⁻²⁴ relative error of the sum for S_k up to ~1e3 with margin, plus rtol 1e-5 on |lse|;
//! - layout ops and casts move stored values: exact;
//! - convolutions (every CUDA path: im2col, cuDNN on NCDHW, cuDNN on NDHWC): as `linear` (atol 1e-5 per
//!   summed tap), plus, in bf16, the bias added after the sum's own bf16 rounding (derived at
//!   `convolutions_match_cpu`).

#![cfg(feature = "cuda")]

use ditstream_kernels::cuda::{
    AttentionKernel, ConvAlgo, FLASH_VARIANTS, HOPPER_FP8_KEYS, HOPPER_FP8_VARIANTS,
    HOPPER_VARIANTS, with_attention_kernel, with_conv_algo,
};
use ditstream_kernels::testing::{assert_close, max_abs_diff};
use ditstream_kernels::{AttentionOptions, DType, Device, Tensor};

type Result<T> = anyhow::Result<T>;

/// The GPU to test on (the shared gate: skips without one unless DITSTREAM_REQUIRE_GPUS is set).
/// How many elements of a and b (any devices, one shape) differ in their bits: the check of ops that
/// must equal the ops they fuse exactly.
fn differing_bits(a: &Tensor, b: &Tensor) -> Result<usize> {
    assert_eq!(a.shape(), b.shape(), "shapes differ");
    let (a, b) = (
        a.to_device(Device::Cpu)?.to_vec_f32()?,
        b.to_device(Device::Cpu)?.to_vec_f32()?,
    );
    Ok(a.iter()
        .zip(&b)
        .filter(|(p, q)| p.to_bits() != q.to_bits())
        .count())
}

/// Every CUDA convolution path, forced in turn by the conv tests, and its label.
const CONV_PATHS: [(ConvAlgo, &str); 4] = [
    (ConvAlgo::Im2col, "im2col"),
    (ConvAlgo::Cudnn, "cudnn"),
    (ConvAlgo::CudnnNdhwc, "cudnn_ndhwc"),
    (ConvAlgo::Auto, "auto"),
];

fn gpu() -> Option<Device> {
    ditstream_kernels::testing::test_gpu()
}

/// The GPU of the FP8 tests: none (the test skips) without a GPU or, said on stderr, without FP8
/// tensor cores.
fn fp8_gpu() -> Result<Option<Device>> {
    let Some(dev) = gpu() else { return Ok(None) };
    if !ditstream_kernels::cuda::supports_fp8(0)? {
        eprintln!("skipped: this GPU has no FP8 tensor cores");
        return Ok(None);
    }
    Ok(Some(dev))
}

fn randn(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    Tensor::randn(shape, dtype, seed, Device::Cpu).expect("randn")
}

fn name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
    }
}

/// Compares a GPU result with the CPU reference, prints the PARITY line, and asserts the tolerance.
fn check(op: &str, gpu: &Tensor, cpu: &Tensor, atol: f32, rtol: f32) {
    assert_eq!(gpu.shape(), cpu.shape(), "{op}: shapes differ");
    assert_eq!(gpu.dtype(), cpu.dtype(), "{op}: dtypes differ");
    let host = gpu.to_device(Device::Cpu).expect("download");
    let diff = max_abs_diff(&host, cpu).expect("diff");
    println!(
        "PARITY\t{op}\t{}\t{:?}\t{diff:.3e}\tatol {atol:.0e} rtol {rtol:.0e}",
        name(cpu.dtype()),
        cpu.shape()
    );
    assert_close(&host, cpu, atol, rtol);
}

/// rtol of a stored output: one bf16 ulp (with margin) or a few f32 ulps.
fn rtol(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => 1e-2,
        DType::F32 => 1e-5,
    }
}

#[test]
fn layout_ops_and_casts_are_exact() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for dtype in [DType::F32, DType::BF16] {
        let x = randn(&[2, 3, 5, 7], dtype, 1);
        let g = x.to_device(dev)?;
        assert_eq!(g.device(), dev);
        check("to_device", &g, &x, 0.0, 0.0);
        check(
            "permute",
            &g.permute(&[2, 0, 3, 1])?,
            &x.permute(&[2, 0, 3, 1])?,
            0.0,
            0.0,
        );
        check("narrow", &g.narrow(2, 1, 3)?, &x.narrow(2, 1, 3)?, 0.0, 0.0);
        let parts = [&x, &x.narrow(1, 0, 2)?];
        let gparts = [&g, &g.narrow(1, 0, 2)?];
        check(
            "concat",
            &Tensor::concat(&gparts, 1)?,
            &Tensor::concat(&parts, 1)?,
            0.0,
            0.0,
        );
        let other = if dtype == DType::F32 {
            DType::BF16
        } else {
            DType::F32
        };
        check(
            "to_dtype",
            &g.to_dtype(other)?,
            &x.to_dtype(other)?,
            0.0,
            0.0,
        );
        let chunks = g.chunk(1, 3)?;
        check("chunk", &chunks[2], &x.chunk(1, 3)?[2], 0.0, 0.0);
        // Copies of runs ≥ 64 elements take the row kernel (copy_rows): narrow along a middle axis
        // (16-byte words), along the last one from an odd offset (element-sized words), concat, and
        // channels_to_frames' permute (runs over three axes).
        let y = randn(&[2, 3, 4, 66], dtype, 3);
        let gy = y.to_device(dev)?;
        check(
            "narrow rows",
            &gy.narrow(2, 1, 2)?,
            &y.narrow(2, 1, 2)?,
            0.0,
            0.0,
        );
        check(
            "narrow odd",
            &gy.narrow(3, 1, 65)?,
            &y.narrow(3, 1, 65)?,
            0.0,
            0.0,
        );
        check(
            "concat rows",
            &Tensor::concat(&[&gy, &gy.narrow(2, 0, 1)?], 2)?,
            &Tensor::concat(&[&y, &y.narrow(2, 0, 1)?], 2)?,
            0.0,
            0.0,
        );
        let f = randn(&[1, 2, 3, 2, 8, 8], dtype, 4);
        check(
            "permute rows",
            &f.to_device(dev)?.permute(&[0, 2, 3, 1, 4, 5])?,
            &f.permute(&[0, 2, 3, 1, 4, 5])?,
            0.0,
            0.0,
        );
    }
    // Fills and seeded draws are identical on both devices.
    let z = Tensor::randn(&[1000], DType::BF16, 9, dev)?;
    check("randn", &z, &randn(&[1000], DType::BF16, 9), 0.0, 0.0);
    let f = Tensor::full(&[3, 4], 2.5, DType::F32, dev)?;
    check(
        "full",
        &f,
        &Tensor::full(&[3, 4], 2.5, DType::F32, Device::Cpu)?,
        0.0,
        0.0,
    );
    Ok(())
}

#[test]
fn elementwise_ops_match_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    use ditstream_kernels as k;
    for dtype in [DType::F32, DType::BF16] {
        let (atol, rt) = (1e-5, rtol(dtype));
        let x = randn(&[2, 7, 33], dtype, 10);
        let g = x.to_device(dev)?;
        check("scale", &k::scale(&g, 0.3)?, &k::scale(&x, 0.3)?, atol, rt);
        check(
            "affine",
            &k::affine(&g, -1.5, 0.25)?,
            &k::affine(&x, -1.5, 0.25)?,
            atol,
            rt,
        );
        check(
            "clamp",
            &k::clamp(&g, -0.5, 0.75)?,
            &k::clamp(&x, -0.5, 0.75)?,
            atol,
            rt,
        );
        check("silu", &k::silu(&g)?, &k::silu(&x)?, atol, rt);
        check(
            "gelu_tanh",
            &k::gelu_tanh(&g)?,
            &k::gelu_tanh(&x)?,
            atol,
            rt,
        );
        // Broadcasts the models use, in both operand dtypes. An innermost length of 33 takes the
        // per-element kernel; 40 (whole 16-byte words in both dtypes) the word-wise one, with b
        // along the words (full, [2, 1, n], [n]) or broadcast across them ([7, 1]: the weight fold).
        for n in [33, 40] {
            let (x, g) = if n == 33 {
                (x.clone(), g.clone())
            } else {
                let x = randn(&[2, 7, n], dtype, 18);
                let g = x.to_device(dev)?;
                (x, g)
            };
            for (b_shape, b_dtype) in [
                (vec![2, 7, n], dtype),
                (vec![2, 1, n], DType::F32),
                (vec![n], DType::BF16),
                (vec![7, 1], dtype),
            ] {
                let b = randn(&b_shape, b_dtype, 11);
                let gb = b.to_device(dev)?;
                check("add", &k::add(&g, &gb)?, &k::add(&x, &b)?, atol, rt);
                check("sub", &k::sub(&g, &gb)?, &k::sub(&x, &b)?, atol, rt);
                check("mul", &k::mul(&g, &gb)?, &k::mul(&x, &b)?, atol, rt);
            }
            // b broadcasting on both sides: [2, 1, n] + [7, 1] → [2, 7, n].
            let a = randn(&[2, 1, n], dtype, 12);
            let b = randn(&[7, 1], dtype, 13);
            check(
                "add",
                &k::add(&a.to_device(dev)?, &b.to_device(dev)?)?,
                &k::add(&a, &b)?,
                atol,
                rt,
            );
        }
        // AdaLN modulation and gated residual with f32 and bf16 modulation tensors.
        for mod_dtype in [DType::F32, DType::BF16] {
            let shift = randn(&[2, 1, 33], mod_dtype, 14);
            let scale = randn(&[2, 1, 33], mod_dtype, 15);
            let (gs, gsc) = (shift.to_device(dev)?, scale.to_device(dev)?);
            check(
                "modulate",
                &k::modulate(&g, &gs, &gsc)?,
                &k::modulate(&x, &shift, &scale)?,
                atol,
                rt,
            );
            let y = randn(&[2, 7, 33], dtype, 16);
            let gate = randn(&[2, 1, 33], mod_dtype, 17);
            check(
                "gated_residual",
                &k::gated_residual(&g, &y.to_device(dev)?, &gate.to_device(dev)?)?,
                &k::gated_residual(&x, &y, &gate)?,
                atol,
                rt,
            );
        }
    }
    Ok(())
}

#[test]
fn norms_match_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    use ditstream_kernels as k;
    for dtype in [DType::F32, DType::BF16] {
        // d = 33 runs the element-wise kernels; 1536 and 5120 (the DiT widths) the register-held
        // `_rows` ones (for 5120 in bf16, 160 threads of four 16-byte words).
        for d in [1, 33, 1536, 5120] {
            let x = randn(&[3, 5, d], dtype, 20);
            let g = x.to_device(dev)?;
            // Sums of d terms of size ~1 (normalised outputs ~1): atol ~ d·2⁻²⁴ with margin.
            let atol = 1e-5 + 1e-6 * d as f32;
            let w = randn(&[d], DType::F32, 21);
            let b = randn(&[d], DType::BF16, 22);
            let (gw, gb) = (w.to_device(dev)?, b.to_device(dev)?);
            check(
                "layer_norm",
                &k::layer_norm(&g, None, None, 1e-6)?,
                &k::layer_norm(&x, None, None, 1e-6)?,
                atol,
                rtol(dtype),
            );
            check(
                "layer_norm_affine",
                &k::layer_norm(&g, Some(&gw), Some(&gb), 1e-6)?,
                &k::layer_norm(&x, Some(&w), Some(&b), 1e-6)?,
                atol,
                rtol(dtype),
            );
            check(
                "rms_norm",
                &k::rms_norm(&g, &gw, 1e-6)?,
                &k::rms_norm(&x, &w, 1e-6)?,
                atol,
                rtol(dtype),
            );
            // A bf16 weight (the DiT's q/k norms): the rows kernels read a word's weights as one
            // 16-byte piece for bf16 x and one 8-byte piece for f32 x.
            check(
                "rms_norm_bf16_weight",
                &k::rms_norm(&g, &gb, 1e-6)?,
                &k::rms_norm(&x, &b, 1e-6)?,
                atol,
                rtol(dtype),
            );
            // The DiT's fused norm-modulate, per sample and per token, output in x's dtype: the
            // LayerNorm's bound, and (1 + scale) ~ 1–3 times it plus shift: atol × 4.
            for mod_shape in [[3, 1, d], [3, 5, d]] {
                let shift = randn(&mod_shape, DType::F32, 26);
                let scale = randn(&mod_shape, DType::F32, 27);
                let (gs, gc) = (shift.to_device(dev)?, scale.to_device(dev)?);
                check(
                    "layer_norm_modulate",
                    &k::layer_norm_modulate(&g, &gs, &gc, 1e-6, dtype)?,
                    &k::layer_norm_modulate(&x, &shift, &scale, 1e-6, dtype)?,
                    4.0 * atol,
                    rtol(dtype),
                );
            }
        }
        // The VAE's channel-first norm: x [B, C, T, H, W], gamma [C, 1, 1, 1]. Positions not a
        // multiple of 16 bytes (element-wise tiles), a multiple with a ragged last tile (16-byte
        // words), and 640 channels (more shared memory than a block gets without opting in). The
        // bound is 1e-4 at 96 channels, as before, and grows as √C: the f32 sum of C squares takes
        // C roundings, whose error grows as √C.
        for xs in [[2, 96, 2, 5, 7], [2, 96, 2, 6, 12], [1, 640, 1, 4, 8]] {
            let c = xs[1];
            let x = randn(&xs, dtype, 23);
            let gamma = randn(&[c, 1, 1, 1], dtype, 24);
            let bias = randn(&[c], DType::F32, 25);
            check(
                "rms_norm_channels",
                &k::rms_norm_channels(
                    &x.to_device(dev)?,
                    &gamma.to_device(dev)?,
                    Some(&bias.to_device(dev)?),
                )?,
                &k::rms_norm_channels(&x, &gamma, Some(&bias))?,
                1e-4 * (c as f32 / 96.0).sqrt().max(1.0),
                rtol(dtype),
            );
        }
    }
    Ok(())
}

#[test]
fn rope_matches_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    use ditstream_kernels as k;
    let grid = [2, 3, 4];
    let (cos, sin) = k::rope_tables_3d(grid, 128, 1e4, Device::Cpu)?;
    let (gcos, gsin) = k::rope_tables_3d(grid, 128, 1e4, dev)?;
    check("rope_tables_3d", &gcos, &cos, 0.0, 0.0);
    for dtype in [DType::F32, DType::BF16] {
        let x = randn(&[2, 24, 3, 128], dtype, 30);
        check(
            "apply_rope",
            &k::apply_rope(&x.to_device(dev)?, &gcos, &gsin)?,
            &k::apply_rope(&x, &cos, &sin)?,
            1e-5,
            rtol(dtype),
        );
    }
    // The fused q/k op against its CPU twin (`apply_rope(rms_norm(x))`): 3 heads of 128 (the
    // register-held kernel) and of 6 (d = 18, not whole 16-byte words: the two kernels). The norm's
    // f32 sum of d squares differs by ≲ d·2⁻²⁴ relative (rms_norm's atol); the rotation mixes two
    // such values with |cos|, |sin| ≤ 1: × 2. In bf16 the norm is rounded before the rotation, and
    // GPU and CPU may round one normed value to neighbouring bf16s (an f32 difference straddling a
    // rounding boundary): one bf16 ulp of the largest normed value, 2⁻⁷·max|n|, on each of the
    // pair's two terms. 2 heads of 12 (d = 24): whole words, but in bf16 a word of 8 elements
    // spans two heads, so the row kernel reads the tables entry by entry (in f32, 4 per word).
    for (hd, heads) in [(128, 3), (6, 3), (12, 2)] {
        let (cos, sin) = k::rope_tables_3d(grid, hd, 1e4, Device::Cpu)?;
        let (gcos, gsin) = k::rope_tables_3d(grid, hd, 1e4, dev)?;
        let d = heads * hd;
        let w = randn(&[d], DType::BF16, 32);
        for dtype in [DType::F32, DType::BF16] {
            let x = randn(&[2, 24, d], dtype, 31);
            let cpu = k::rms_norm_rope(&x, &w, 1e-6, &cos, &sin, heads)?;
            let max_normed = k::rms_norm(&x, &w, 1e-6)?
                .to_vec_f32()?
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()));
            let atol = 2.0 * (1e-5 + 1e-6 * d as f32)
                + if dtype == DType::BF16 {
                    2.0 * 2f32.powi(-7) * max_normed
                } else {
                    0.0
                };
            check(
                "rms_norm_rope",
                &k::rms_norm_rope(
                    &x.to_device(dev)?,
                    &w.to_device(dev)?,
                    1e-6,
                    &gcos,
                    &gsin,
                    heads,
                )?,
                &cpu,
                atol,
                rtol(dtype),
            );
        }
    }
    Ok(())
}

/// A GEMM large enough for its algorithm to be chosen by timing (`gemm.rs`: ≥ 1e11 FLOPs) runs the
/// chosen one correctly, with the bias and with the GELU epilogue; the choice is written to the
/// algorithm cache when the search is on. Rows at both ends are checked against the CPU (the whole
/// product would be 1.2e11 FLOPs there), with `gemms_match_cpu`'s bounds.
#[test]
fn searched_gemms_match_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    use ditstream_kernels as k;
    let (rows, inf, outf) = (24576, 1536, 1536);
    let x = randn(&[rows, inf], DType::BF16, 48);
    let w = randn(&[outf, inf], DType::BF16, 49);
    let b = randn(&[outf], DType::F32, 50);
    let (gx, gw, gb) = (x.to_device(dev)?, w.to_device(dev)?, b.to_device(dev)?);
    let atol = 1e-5 * inf as f32 + 8.0 * 2f32.powi(-9);
    let ends = |t: &Tensor| -> Result<Vec<Tensor>> {
        let t = t.to_device(Device::Cpu)?;
        Ok(vec![t.narrow(0, 0, 32)?, t.narrow(0, rows - 32, 32)?])
    };
    let (out, gelu) = (
        k::linear(&gx, &gw, Some(&gb))?,
        k::linear_gelu_tanh(&gx, &gw, &gb)?,
    );
    for ((got, got_gelu), xs) in ends(&out)?.iter().zip(ends(&gelu)?).zip(ends(&x)?) {
        check(
            "searched linear",
            got,
            &k::linear(&xs, &w, Some(&b))?,
            atol,
            rtol(DType::BF16),
        );
        check(
            "searched linear_gelu_tanh",
            &got_gelu,
            &k::linear_gelu_tanh(&xs, &w, &b)?,
            1.13 * atol,
            rtol(DType::BF16),
        );
    }
    let config = ditstream_kernels::cuda::cuda_config();
    if config.gemm_search == ditstream_kernels::cuda::AlgoSearch::Find {
        let path = config.cache_dir.join("cublaslt-algos.tsv");
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        for epilogue in ["bias", "gelu_bias"] {
            let shape = format!("bf16 m{outf} n{rows} k{inf} ta b1 s0,0,0 {epilogue}");
            assert!(
                text.lines().any(|l| l.contains(&format!("\t{shape}\t"))),
                "{} holds no choice for {shape}:\n{text}",
                path.display()
            );
        }
    }
    Ok(())
}

#[test]
fn gemms_match_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    use ditstream_kernels as k;
    // (rows, in, out, bias)
    for (rows, inf, outf, with_bias) in [
        (1, 16, 8, false),
        (37, 130, 70, true),
        (256, 1536, 1536, true),
    ] {
        for (x_dtype, w_dtype) in [
            (DType::F32, DType::F32),
            (DType::BF16, DType::BF16),
            (DType::BF16, DType::F32),
        ] {
            let x = randn(&[1, rows, inf], x_dtype, 40);
            let w = randn(&[outf, inf], w_dtype, 41);
            let b = randn(&[outf], DType::F32, 42);
            let bias = with_bias.then_some(&b);
            let gb = b.to_device(dev)?;
            let gbias = with_bias.then_some(&gb);
            let out = k::linear(&x.to_device(dev)?, &w.to_device(dev)?, gbias)?;
            // Terms are products of N(0,1) values: the f32 order difference is ≲ in·2⁻²⁴·few; outputs
            // are ~√in, so a bf16 ulp near zero is tiny: atol = 1e-5·in (margin over in·6e-8·10).
            let atol = 1e-5 * inf as f32;
            // With a bf16 GEMM the f32 bias is rounded to bf16 before the epilogue adds it: at most half a
            // bf16 ulp of |bias| (≲ 4·2⁻⁹) more.
            let atol = if with_bias && x_dtype == DType::BF16 && w_dtype == DType::BF16 {
                atol + 8.0 * 2f32.powi(-9)
            } else {
                atol
            };
            check(
                "linear",
                &out,
                &k::linear(&x, &w, bias)?,
                atol,
                rtol(x_dtype),
            );
            // The same GEMM with GELU(tanh) in cuBLASLt's epilogue against the CPU twin (GELU of the
            // f32 sum, one rounding): GELU's slope is ≤ 1.13, so the sum's difference bound grows by
            // that factor; the output's own rounding is rtol's.
            if with_bias {
                check(
                    "linear_gelu_tanh",
                    &k::linear_gelu_tanh(&x.to_device(dev)?, &w.to_device(dev)?, &gb)?,
                    &k::linear_gelu_tanh(&x, &w, &b)?,
                    1.13 * atol,
                    rtol(x_dtype),
                );
            }
        }
    }
    // The residual branch in one GEMM (C = residual, beta 1): no gate, a shared gate and a per-sample
    // gate (folded into the weights by `mul`, identical on both sides), at a DiT shape and a small
    // one. The GEMM's terms are x·(g·w): `linear`'s bound × max|g| (< 4.5 for these draws), plus in
    // bf16 the bias rounded to bf16 on the GPU (as for `linear`, × max|g|); the residual enters the
    // f32 sum on both sides, and rtol covers the output's one rounding.
    for (rows, inf, outf) in [(37, 130, 70), (256, 1536, 1536)] {
        for dtype in [DType::F32, DType::BF16] {
            let x = randn(&[2, rows, inf], dtype, 46);
            let w = randn(&[outf, inf], dtype, 47);
            let b = randn(&[outf], DType::F32, 48);
            let r = randn(&[2, rows, outf], dtype, 49);
            let shared = randn(&[1, 1, outf], DType::F32, 50);
            let per_sample = randn(&[2, 1, outf], DType::F32, 51);
            let (gx, gw, gb, gr) = (
                x.to_device(dev)?,
                w.to_device(dev)?,
                b.to_device(dev)?,
                r.to_device(dev)?,
            );
            for (label, gate) in [
                ("none", None),
                ("shared", Some(&shared)),
                ("per_sample", Some(&per_sample)),
            ] {
                let ggate = gate.map(|g| g.to_device(dev)).transpose()?;
                let max_g = gate.map_or(Ok(1f32), |g| {
                    g.to_vec_f32()
                        .map(|v| v.iter().fold(0f32, |m, x| m.max(x.abs())))
                })?;
                let mut atol = 1e-5 * inf as f32;
                if dtype == DType::BF16 {
                    atol += 8.0 * 2f32.powi(-9);
                }
                check(
                    &format!("linear_residual_{label}"),
                    &k::linear_residual(&gx, &gw, Some(&gb), &gr, ggate.as_ref())?,
                    &k::linear_residual(&x, &w, Some(&b), &r, gate)?,
                    atol * max_g.max(1.0),
                    rtol(dtype),
                );
            }
        }
    }
    for dtype in [DType::F32, DType::BF16] {
        let a = randn(&[3, 17, 40], dtype, 43);
        let b = randn(&[3, 40, 9], dtype, 44);
        check(
            "matmul_batched",
            &k::matmul(&a.to_device(dev)?, &b.to_device(dev)?)?,
            &k::matmul(&a, &b)?,
            1e-3,
            rtol(dtype),
        );
        let shared = randn(&[40, 9], dtype, 45);
        check(
            "matmul_shared_b",
            &k::matmul(&a.to_device(dev)?, &shared.to_device(dev)?)?,
            &k::matmul(&a, &shared)?,
            1e-3,
            rtol(dtype),
        );
    }
    Ok(())
}

#[test]
fn attention_matches_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    use ditstream_kernels as k;
    // (B, S_q, S_k, H, D, kv_len)
    for (batch, seq_q, seq_k, heads, head_dim, kv_len) in [
        (1, 17, 33, 2, 64, None),
        (2, 64, 100, 3, 128, Some(77)),
        (1, 5, 40, 1, 8, Some(0)),
        (1, 16, 32, 1, 256, Some(31)),
        (1, 130, 300, 2, 12, None),
    ] {
        for dtype in [DType::F32, DType::BF16] {
            let q = randn(&[batch, seq_q, heads, head_dim], dtype, 50);
            let kk = randn(&[batch, seq_k, heads, head_dim], dtype, 51);
            let v = randn(&[batch, seq_k, heads, head_dim], dtype, 52);
            let opts = AttentionOptions {
                scale: None,
                kv_len,
            };
            let (out, lse) = k::attention(&q, &kk, &v, opts)?;
            // The portable kernel (bf16 at head dim 64/128 would otherwise go to the tensor-core one,
            // tested with its own tolerance in `flash_attention_matches_cpu`).
            let (gout, glse) = with_attention_kernel(AttentionKernel::Portable, || {
                k::attention(
                    &q.to_device(dev)?,
                    &kk.to_device(dev)?,
                    &v.to_device(dev)?,
                    opts,
                )
            })?;
            // out is a convex combination of v rows (|v| ≲ 4): the f32 differences are ~S_k·2⁻²⁴·4.
            check("attention_out", &gout, &out, 1e-4, rtol(dtype));
            check("attention_lse", &glse, &lse, 1e-4, 1e-5);
        }
    }
    Ok(())
}

/// The tensor-core attention (flash.cu: bf16 Q/K/V, mma.sync with f32 accumulation, P rounded to bf16
/// for P·V), every compiled variant and the automatic choice, against the CPU twin on the same bf16
/// inputs.
///
/// Tolerance. The GPU differs from the CPU (f32 throughout, out rounded to bf16 once) by
/// - P rounded to bf16 before P·V: p̃ = p(1 + δ), |δ| ≤ u = 2⁻⁸, while l sums the unrounded p. The error
///   of out = Σ p̃·v / l is |Σ p·δ·v| / l ≤ u·max|v| (p/l are convex weights): atol = 2⁻⁸·max|v|;
/// - out stored in bf16 on both sides from f32 values that differ by the above: within rtol 1e-2 of
///   |cpu| (one bf16 ulp, 2⁻⁷, with margin) plus the atol;
/// - f32 order of the tensor-core sums and `ex2.approx` (≤ 2 ulp): ~1e-6 relative, inside both.
///
/// The bound above is worst case (all δ of one sign); random δ make the typical error ~u/√3 of |out|,
/// so a second check bounds the relative RMS error ‖gpu − cpu‖/‖cpu‖ by 1e-2 (expected ≈ 4e-3: the two
/// bf16 roundings of out and the P rounding, each ≲ 2⁻⁸/√3 RMS): a wrong key or column mapping would
/// show there even where it stays inside the per-element bound.
///
/// LSE = m·scale + ln l with l an f32 sum of `ex2.approx` terms (relative error ~1e-6) and scores from
/// f32 tensor-core sums of exact bf16 products (~D·2⁻²⁴·|q||k|): atol 1e-4 + rtol 1e-5, as for the
/// portable kernel; −∞ exactly where no key is valid.
#[test]
fn flash_attention_matches_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for head_dim in [128, 64] {
        let choices: Vec<_> = FLASH_VARIANTS
            .iter()
            .enumerate()
            .filter(|(_, var)| var.head_dim == head_dim)
            .map(|(i, var)| (AttentionKernel::Flash(i), var.name))
            .chain([(AttentionKernel::Auto, "auto")])
            .collect();
        tensor_core_attention_cases(dev, head_dim, &choices)?;
    }
    Ok(())
}

/// The Hopper kernel, every variant (hopper.cu: wgmma with f32 accumulation, P rounded to bf16 for P·V,
/// as flash.cu) on `flash_attention_matches_cpu`'s cases with its tolerances (derived there: the arithmetic is the
/// same, only the instructions and shared-memory layout differ). Its own test so that a failure of the
/// new kernel cannot hide or break the other variants' cases. Where the GPU is not sm_90a the kernel must
/// refuse with an error naming the rule (checked here too), not run.
#[test]
fn hopper_attention_matches_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let labels: Vec<_> = HOPPER_VARIANTS
        .iter()
        .enumerate()
        .map(|(i, var)| (AttentionKernel::Hopper(i), var.label()))
        .collect();
    let hopper: Vec<_> = labels.iter().map(|(k, l)| (*k, l.as_str())).collect();
    let probe = Tensor::zeros(&[1, 1, 1, 128], DType::BF16, dev)?;
    let forced = with_attention_kernel(AttentionKernel::Hopper(0), || {
        ditstream_kernels::attention(&probe, &probe, &probe, AttentionOptions::default())
    });
    if let Err(e) = forced {
        let msg = e.to_string();
        assert!(
            msg.contains("needs sm_90a"),
            "the Hopper kernel failed other than by refusing a non-sm_90a GPU: {msg}"
        );
        eprintln!("skipped: {msg}");
        return Ok(());
    }
    tensor_core_attention_cases(dev, 128, &hopper)
}

/// Runs every case of `flash_attention_matches_cpu` at `head_dim` through each of `choices` and checks it
/// against the CPU twin with the tensor-core tolerances documented there.
fn tensor_core_attention_cases(
    dev: Device,
    head_dim: usize,
    choices: &[(AttentionKernel, &str)],
) -> Result<()> {
    use ditstream_kernels as k;
    // (B, S_q, S_k, H, kv_len): S not a multiple of any tile, partial last K/V blocks, kv_len 0, a
    // single key, kv_len on a 64/128-key boundary, and every key valid; last, more tiles of 128
    // query rows (144) than an H200 has SMs (132), over a short key run as the cross-attention's,
    // so that a persistent launch takes several items per CTA (with 128-key blocks a whole tile
    // and then a chunk of a split one: 12 tiles left over split 2 ways).
    let cases = [
        (1, 200, 200, 2, None),
        (2, 130, 300, 3, Some(77)),
        (1, 64, 128, 1, Some(0)),
        (1, 1, 5, 1, Some(1)),
        (1, 300, 257, 2, Some(129)),
        (2, 257, 700, 2, Some(640)),
        (1, 129, 1000, 1, None),
        (2, 2200, 512, 4, Some(500)),
    ];
    for (ci, &(batch, seq_q, seq_k, heads, kv_len)) in cases.iter().enumerate() {
        let seed = 60 + 3 * ci as u64;
        let q = randn(&[batch, seq_q, heads, head_dim], DType::BF16, seed);
        let kk = randn(&[batch, seq_k, heads, head_dim], DType::BF16, seed + 1);
        let v = randn(&[batch, seq_k, heads, head_dim], DType::BF16, seed + 2);
        // A non-default scale too, on one case.
        let scale = (ci == 4).then_some(0.3);
        let opts = AttentionOptions { scale, kv_len };
        let (out, lse) = k::attention(&q, &kk, &v, opts)?;
        let max_v = v.to_vec_f32()?.iter().fold(0.0f32, |a, x| a.max(x.abs()));
        let atol = max_v / 256.0;
        let (gq, gk, gv) = (q.to_device(dev)?, kk.to_device(dev)?, v.to_device(dev)?);
        for &(choice, label) in choices {
            let (gout, glse) = with_attention_kernel(choice, || k::attention(&gq, &gk, &gv, opts))?;
            // LSE first: it depends on the scores alone, so a failure there points at Q·Kᵀ (the Q/K
            // operands), one in out alone at P·V (the P fragments or V operand).
            check(
                &format!("flash_attention_lse {label}"),
                &glse,
                &lse,
                1e-4,
                1e-5,
            );
            let (gl, cl) = (glse.to_vec_f32()?, lse.to_vec_f32()?);
            for (a, b) in gl.iter().zip(&cl) {
                assert_eq!(
                    *a == f32::NEG_INFINITY,
                    *b == f32::NEG_INFINITY,
                    "{label}: lse −∞ where the CPU's is not (or the reverse): {a} vs {b}"
                );
            }
            let op = format!("flash_attention_out {label}");
            check(&op, &gout, &out, atol, 1e-2);
            let (g, c) = (gout.to_vec_f32()?, out.to_vec_f32()?);
            let err: f64 = g
                .iter()
                .zip(&c)
                .map(|(a, b)| f64::from(a - b).powi(2))
                .sum();
            let norm: f64 = c.iter().map(|b| f64::from(*b).powi(2)).sum();
            let rel_rms = if norm > 0.0 {
                (err / norm).sqrt()
            } else {
                err.sqrt()
            };
            println!(
                "PARITY\tflash_attention_rel_rms {label}\tbf16\t{:?}\t{rel_rms:.3e}\tbound 1e-2",
                out.shape()
            );
            assert!(
                rel_rms <= 1e-2,
                "{op}: relative RMS error {rel_rms:.3e} > 1e-2"
            );
        }
    }
    Ok(())
}

#[test]
fn lse_merges_match_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    use ditstream_kernels as k;
    let shape = [2, 9, 3, 16];
    let lse_shape = [2, 3, 9];
    for dtype in [DType::F32, DType::BF16] {
        for parts_n in [1, 3, 20] {
            let outs: Vec<Tensor> = (0..parts_n).map(|i| randn(&shape, dtype, 60 + i)).collect();
            let mut lses: Vec<Tensor> = (0..parts_n)
                .map(|i| randn(&lse_shape, DType::F32, 90 + i))
                .collect();
            // One partial that saw no valid key anywhere.
            if parts_n > 1 {
                lses[1] = Tensor::full(&lse_shape, f32::NEG_INFINITY, DType::F32, Device::Cpu)?;
            }
            let cpu_parts: Vec<(&Tensor, &Tensor)> = outs.iter().zip(&lses).collect();
            let gouts = outs
                .iter()
                .map(|t| t.to_device(dev))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let glses = lses
                .iter()
                .map(|t| t.to_device(dev))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let gpu_parts: Vec<(&Tensor, &Tensor)> = gouts.iter().zip(&glses).collect();
            let (o, l) = k::lse_combine(&cpu_parts)?;
            let (go, gl) = k::lse_combine(&gpu_parts)?;
            check("lse_combine_out", &go, &o, 1e-5, rtol(dtype));
            check("lse_combine_lse", &gl, &l, 1e-5, 1e-5);
        }
        let (a, b) = (randn(&shape, dtype, 70), randn(&shape, DType::F32, 71));
        let mut la = randn(&lse_shape, DType::F32, 72).to_vec_f32()?;
        let mut lb = randn(&lse_shape, DType::F32, 73).to_vec_f32()?;
        la[0] = f32::NEG_INFINITY; // empty accumulator
        lb[1] = f32::NEG_INFINITY; // empty block
        let (la, lb) = (
            Tensor::from_vec(la, &lse_shape)?,
            Tensor::from_vec(lb, &lse_shape)?,
        );
        let (o, l) = k::lse_merge_pair(&a, &la, &b, &lb)?;
        let (go, gl) = k::lse_merge_pair(
            &a.to_device(dev)?,
            &la.to_device(dev)?,
            &b.to_device(dev)?,
            &lb.to_device(dev)?,
        )?;
        check("lse_merge_pair_out", &go, &o, 1e-5, rtol(dtype));
        check("lse_merge_pair_lse", &gl, &l, 1e-5, 1e-5);
    }
    Ok(())
}

/// Not parity: speed of the GEMM and the portable attention at DiT sizes, printed as TIMING lines.
/// CUDA events around `ITERS` back-to-back calls on our stream (allocation of each output included, as a
/// model step pays it), median of 5 such batches; `scripts/gpu-kernels.sh` times PyTorch the same way.
#[test]
fn timing_at_dit_sizes() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    use cudarc::driver::sys::CUevent_flags;
    use ditstream_kernels as k;
    let Device::Cuda(ordinal) = dev else {
        return Ok(());
    };
    let stream = ditstream_kernels::cuda::cuda_stream(ordinal)?;
    let time = |iters: usize, f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        for _ in 0..3 {
            f()?; // warm-up: compiles, plans, fills the memory pool
        }
        let mut batches = Vec::new();
        for _ in 0..5 {
            let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            for _ in 0..iters {
                f()?;
            }
            let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            end.synchronize()?;
            batches.push(f64::from(start.elapsed_ms(&end)?) / 1e3 / iters as f64);
        }
        batches.sort_by(f64::total_cmp);
        Ok(batches[batches.len() / 2])
    };
    // Wan 1.3B linears at 480p 81f (32760 tokens): qkvo 1536 → 1536, FFN 1536 → 8960 → 1536; and 8192³.
    for (rows, inf, outf) in [
        (32760, 1536, 1536),
        (32760, 1536, 8960),
        (32760, 8960, 1536),
        (8192, 8192, 8192),
    ] {
        let x = Tensor::randn(&[rows, inf], DType::BF16, 1, dev)?;
        let w = Tensor::randn(&[outf, inf], DType::BF16, 2, dev)?;
        let b = Tensor::randn(&[outf], DType::BF16, 3, dev)?;
        let secs = time(20, &mut || {
            k::linear(&x, &w, Some(&b))?;
            Ok(())
        })?;
        let tflops = 2.0 * (rows * inf * outf) as f64 / secs / 1e12;
        println!(
            "TIMING\tours linear+bias bf16 {rows}x{inf}x{outf}\t{:.3} ms\t{tflops:.1} TFLOP/s",
            secs * 1e3
        );
    }
    {
        let (seq, heads) = (4096, 12);
        let q = Tensor::randn(&[1, seq, heads, 128], DType::BF16, 4, dev)?;
        let secs = time(2, &mut || {
            k::attention(&q, &q, &q, AttentionOptions::default())?;
            Ok(())
        })?;
        let tflops = 4.0 * (seq * seq * heads * 128) as f64 / secs / 1e12;
        println!(
            "TIMING\tours attention bf16 (1,{heads},{seq},128) portable\t{:.3} ms\t{tflops:.1} TFLOP/s",
            secs * 1e3
        );
    }
    Ok(())
}

/// Convolutions, by every CUDA path (`ConvAlgo::Im2col`: im2col + cuBLASLt GEMM + bias;
/// `ConvAlgo::Cudnn`: the frame join where needed + cuDNN + bias; `ConvAlgo::CudnnNdhwc`: the frame join
/// transposed to channels last + cuDNN + the transpose back with the bias) and the default (`Auto`,
/// which routes between them by kernel).
///
/// Tolerance. Every path sums the K = C_in·kt·kh·kw products of N(0,1) values in f32 (the GEMM's or
/// cuDNN's f32 compute type; f32 data use FMA maths only, no TF32), in some order: the difference from
/// the CPU's order is ≲ K·2⁻²⁴·few, as for `linear`: atol = 1e-5·K. cuDNN may also pick a transform
/// algorithm (FFT, Winograd) for f32, whose error is ~1e-6 of the output's size (≲ √K·1e-6 here), well
/// inside that atol. In bf16 the GPU rounds the sum to bf16 before adding the bias and rounds again (the
/// CPU rounds once): the extra rounding is ≤ 2⁻⁹·|sum| ≤ 2⁻⁹·(|out| + |bias|); the |out| part is inside
/// rtol 1e-2 with the final rounding (2 · 2⁻⁹ < 1e-2), the |bias| part (|bias| ≲ 4 for N(0,1)) adds
/// 4·2⁻⁹ to atol. The frame joins and the transposes copy stored bits (exact); the channels-last path
/// adds the bias to the stored (bf16-rounded) sum in f32 and rounds once more, the same two roundings.
#[test]
fn convolutions_match_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    use ditstream_kernels as k;
    // The GPU machine has cuDNN (GPU.md): this suite claims to test that path, so it must load there.
    let version = ditstream_kernels::cuda::cudnn_version(0)?;
    println!("cuDNN {version}");
    let atol = |taps: usize, dtype: DType| {
        1e-5 * taps as f32
            + match dtype {
                DType::BF16 => 4.0 * 2f32.powi(-9),
                DType::F32 => 0.0,
            }
    };
    for dtype in [DType::F32, DType::BF16] {
        // conv3d: (x shape, w shape, stride, padding, bias); batch 2 and odd sizes included.
        for (xs, ws, stride, padding, with_bias) in [
            ([1, 3, 4, 6, 5], [8, 3, 3, 3, 3], [1, 1, 1], [1, 1, 1], true),
            ([2, 5, 3, 7, 9], [4, 5, 3, 3, 3], [1, 2, 2], [0, 1, 1], true),
            (
                [2, 3, 2, 8, 8],
                [6, 3, 1, 2, 2],
                [1, 2, 2],
                [0, 0, 0],
                false,
            ), // DiT patch embedding
            ([2, 7, 3, 5, 3], [5, 7, 1, 1, 1], [1, 1, 1], [0, 0, 0], true), // pointwise, batch 2
            (
                [1, 64, 2, 12, 20],
                [64, 64, 3, 3, 3],
                [1, 1, 1],
                [1, 1, 1],
                true,
            ),
        ] {
            let x = randn(&xs, dtype, 100);
            let w = randn(&ws, dtype, 101);
            let b = randn(&[ws[0]], DType::F32, 102);
            let bias = with_bias.then_some(&b);
            let (gx, gw, gb) = (x.to_device(dev)?, w.to_device(dev)?, b.to_device(dev)?);
            let gbias = with_bias.then_some(&gb);
            let taps = ws[1] * ws[2] * ws[3] * ws[4];
            let cpu = k::conv3d(&x, &w, bias, stride, padding)?;
            for (algo, label) in CONV_PATHS {
                let out = with_conv_algo(algo, || k::conv3d(&gx, &gw, gbias, stride, padding))?;
                check(
                    &format!("conv3d {label}"),
                    &out,
                    &cpu,
                    atol(taps, dtype),
                    rtol(dtype),
                );
            }
        }
        // causal_conv3d: each of the VAE's kernels, without a cache and with 1 and 2 cached frames
        // (cuDNN: joined with 2, 1 and 0 zero frames), one with an odd frame size (the join's 2-byte
        // words in bf16). The last four span several transpose tiles (128 bytes of elements per side)
        // with ragged edges: channels and planes that are multiples of 8 (16-byte words), even ones
        // (word pairs), then odd ones (single elements) in and out, in a batch of 2 (the cache is per
        // item).
        for (ws, cached, hw, batch) in [
            ([6, 4, 3, 3, 3], 0, [6, 10], 1),
            ([6, 4, 3, 3, 3], 1, [6, 10], 1),
            ([6, 4, 3, 3, 3], 2, [6, 10], 1),
            ([8, 4, 3, 1, 1], 2, [6, 10], 1), // upsample3d's time_conv
            ([5, 4, 1, 1, 1], 0, [6, 10], 1),
            ([16, 16, 3, 3, 3], 2, [6, 10], 1),
            ([6, 3, 3, 3, 3], 2, [5, 7], 1),
            ([24, 16, 3, 3, 3], 2, [8, 20], 1),
            ([40, 24, 3, 3, 3], 1, [4, 26], 2),
            ([72, 66, 3, 3, 3], 2, [9, 14], 1),
            ([67, 65, 3, 3, 3], 1, [5, 13], 2),
        ] {
            let x = randn(&[batch, ws[1], 3, hw[0], hw[1]], dtype, 110);
            let w = randn(&ws, dtype, 111);
            let b = randn(&[ws[0]], dtype, 112);
            let cache =
                (cached > 0).then(|| randn(&[batch, ws[1], cached, hw[0], hw[1]], dtype, 113));
            let gcache = cache.as_ref().map(|c| c.to_device(dev)).transpose()?;
            let (gx, gw, gb) = (x.to_device(dev)?, w.to_device(dev)?, b.to_device(dev)?);
            let taps = ws[1] * ws[2] * ws[3] * ws[4];
            let cpu = k::causal_conv3d(&x, &w, Some(&b), cache.as_ref())?;
            for (algo, label) in CONV_PATHS {
                let out = with_conv_algo(algo, || {
                    k::causal_conv3d(&gx, &gw, Some(&gb), gcache.as_ref())
                })?;
                check(
                    &format!("causal_conv3d {label}"),
                    &out,
                    &cpu,
                    atol(taps, dtype),
                    rtol(dtype),
                );
            }
        }
        // conv2d: the upsamplers' 3×3 stride 1, and stride 2 (the encoder's downsampling).
        for (xs, ws, stride, padding) in [
            ([3, 6, 9, 7], [4, 6, 3, 3], [1, 1], [1, 1]),
            ([2, 5, 10, 11], [3, 5, 3, 3], [2, 2], [0, 0]),
            ([1, 4, 8, 8], [4, 4, 3, 3], [2, 2], [1, 1]),
        ] {
            let x = randn(&xs, dtype, 120);
            let w = randn(&ws, dtype, 121);
            let b = randn(&[ws[0]], DType::F32, 122);
            let (gx, gw, gb) = (x.to_device(dev)?, w.to_device(dev)?, b.to_device(dev)?);
            let taps = ws[1] * ws[2] * ws[3];
            let cpu = k::conv2d(&x, &w, Some(&b), stride, padding)?;
            for (algo, label) in CONV_PATHS {
                let out = with_conv_algo(algo, || k::conv2d(&gx, &gw, Some(&gb), stride, padding))?;
                check(
                    &format!("conv2d {label}"),
                    &out,
                    &cpu,
                    atol(taps, dtype),
                    rtol(dtype),
                );
            }
        }
        // Channels-last (cuDNN only): its CPU twin is permute ∘ conv3d ∘ permute. Bias in f32 and in
        // the data dtype; channel counts that do (8, 16) and do not (3, 5) fill 16-byte words.
        for (xs, ws, stride, padding, bias_dtype) in [
            (
                [1, 3, 6, 10, 8],
                [16, 3, 3, 3, 8],
                [1, 1, 1],
                [1, 1, 1],
                DType::F32,
            ),
            (
                [2, 3, 5, 7, 3],
                [5, 3, 3, 3, 3],
                [1, 2, 2],
                [0, 1, 1],
                dtype,
            ),
            (
                [1, 2, 6, 4, 16],
                [8, 1, 1, 1, 16],
                [1, 1, 1],
                [0, 0, 0],
                dtype,
            ),
        ] {
            let x = randn(&xs, dtype, 125);
            let w = randn(&ws, dtype, 126);
            let b = randn(&[ws[0]], bias_dtype, 127);
            let taps = ws[1] * ws[2] * ws[3] * ws[4];
            check(
                "conv3d_channels_last cudnn",
                &k::conv3d_channels_last(
                    &x.to_device(dev)?,
                    &w.to_device(dev)?,
                    Some(&b.to_device(dev)?),
                    stride,
                    padding,
                )?,
                &k::conv3d_channels_last(&x, &w, Some(&b), stride, padding)?,
                atol(taps, dtype),
                rtol(dtype),
            );
        }
        // Mixed dtypes: bf16 activations with f32 weights are promoted to f32, as in `linear`.
        let x = randn(&[1, 3, 2, 5, 4], DType::BF16, 130);
        let w = randn(&[4, 3, 3, 3, 3], DType::F32, 131);
        let (gx, gw) = (x.to_device(dev)?, w.to_device(dev)?);
        let cpu = k::causal_conv3d(&x, &w, None, None)?;
        for (algo, label) in CONV_PATHS {
            check(
                &format!("conv3d_mixed {label}"),
                &with_conv_algo(algo, || k::causal_conv3d(&gx, &gw, None, None))?,
                &cpu,
                atol(81, DType::F32),
                rtol(DType::BF16),
            );
        }
        // The channels-last path keeps each weight's filter: a second weight of the same shape must
        // not reuse the first's, and the first, asked again (also through a reshape, as conv2d does),
        // must still give its own result.
        let x = randn(&[1, 8, 3, 6, 10], dtype, 135);
        let gx = x.to_device(dev)?;
        let weights = [136, 137].map(|seed| randn(&[8, 8, 3, 3, 3], dtype, seed));
        let gweights = weights
            .iter()
            .map(|w| w.to_device(dev))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        for i in [0, 1, 0] {
            let cpu = k::causal_conv3d(&x, &weights[i], None, None)?;
            let out = with_conv_algo(ConvAlgo::CudnnNdhwc, || {
                k::causal_conv3d(&gx, &gweights[i], None, None)
            })?;
            check(
                &format!("causal_conv3d cudnn_ndhwc filter {i}"),
                &out,
                &cpu,
                atol(8 * 27, dtype),
                rtol(dtype),
            );
        }
        let frames = x.permute(&[0, 2, 1, 3, 4])?.reshape(&[3, 8, 6, 10])?;
        let w2 = randn(&[8, 8, 3, 3], dtype, 138);
        let gw2 = w2.to_device(dev)?;
        let cpu = k::conv2d(&frames, &w2, None, [1, 1], [1, 1])?;
        let gframes = frames.to_device(dev)?;
        for _ in 0..2 {
            let out = with_conv_algo(ConvAlgo::CudnnNdhwc, || {
                k::conv2d(&gframes, &gw2, None, [1, 1], [1, 1])
            })?;
            check(
                "conv2d cudnn_ndhwc filter kept",
                &out,
                &cpu,
                atol(8 * 9, dtype),
                rtol(dtype),
            );
        }
        // Resampling moves stored values: exact. A width of 7 upsamples element by element, 8
        // (whole 8-byte words in both dtypes) word by word.
        for (seed, w) in [(140, 7), (142, 8)] {
            let x = randn(&[2, 3, 2, 5, w], dtype, seed);
            let g = x.to_device(dev)?;
            check(
                "upsample_nearest2x",
                &k::upsample_nearest2x(&g)?,
                &k::upsample_nearest2x(&x)?,
                0.0,
                0.0,
            );
        }
        let x = randn(&[2, 6, 3, 4, 5], dtype, 141);
        check(
            "channels_to_frames",
            &k::channels_to_frames(&x.to_device(dev)?)?,
            &k::channels_to_frames(&x)?,
            0.0,
            0.0,
        );
    }
    Ok(())
}

// ---- Wide attention heads (head dim 256–512: the Wan VAE's mid-block attention is one head of 384
// over a frame's 6,240 (480p) or 14,400 (720p) tokens). Both CUDA kernels against the CPU twin.

/// Relative RMS error ‖gpu − cpu‖ / ‖cpu‖.
fn attention_rel_rms(gpu: &Tensor, cpu: &Tensor) -> Result<f64> {
    let (g, c) = (gpu.to_vec_f32()?, cpu.to_vec_f32()?);
    let err: f64 = g
        .iter()
        .zip(&c)
        .map(|(a, b)| f64::from(a - b).powi(2))
        .sum();
    let norm: f64 = c.iter().map(|b| f64::from(*b).powi(2)).sum();
    Ok(if norm > 0.0 {
        (err / norm).sqrt()
    } else {
        err.sqrt()
    })
}

/// max over tokens of ‖x_token,head‖₂ for x [B, S, H, D].
fn max_token_norm(x: &Tensor) -> Result<f32> {
    let d = x.shape()[3];
    Ok(x.to_vec_f32()?
        .chunks_exact(d)
        .map(|row| row.iter().map(|v| v * v).sum::<f32>().sqrt())
        .fold(0.0, f32::max))
}

/// Head dims 256, 320, 384 and 512, every kernel that takes them, against the CPU twin on the same
/// stored inputs; the first case is the VAE's 480p frame (1 × 6,240 tokens × one head of 384).
///
/// Tolerances (u = 2⁻²⁴, f32 unit roundoff; inputs N(0,1)):
/// - **Portable kernel** (f32 maths like the CPU, other summation order). A score s = scale·q·k is a
///   D-term f32 dot product: |δs| ≤ D·u·scale·Σ|q_i k_i| ≤ D·u·scale·‖q‖·‖k‖ (Cauchy–Schwarz; the max
///   row norms are measured). A score error δ changes each softmax weight by a factor e^{±2δ}, so out,
///   a convex combination of v rows, moves by ≤ 2δ·max|v|; the P·V sum of S_k terms adds
///   ≤ S_k·u·max|v|. Per element: atol = (2·δs_max + S_k·u)·max|v| (worst case, all errors aligned),
///   rtol = one stored ulp (`rtol(dtype)`). LSE = m + ln l: atol = δs_max + S_k·u, rtol 1e-5.
///   Those worst cases are loose at 6,240 keys (they allow ~1e-3 on outputs of ~2e-2), so a second
///   check bounds the relative RMS error: f32 1e-4 (random-order errors are ~√n·u ≈ 1e-6 relative),
///   bf16 1e-2 (the one bf16 rounding of out on each side, u_bf16 = 2⁻⁸, rarely differs).
/// - **Tensor-core kernel** (bf16 only): as `flash_attention_matches_cpu`: P rounded to bf16 before
///   P·V gives atol = 2⁻⁸·max|v| and relative RMS ≤ 1e-2; its LSE has the portable kernel's bound.
///   Each output slice's block recomputes the same scores, so the slices must agree as one head does:
///   a slice mapped to the wrong columns or head fails the RMS check by O(1).
#[test]
fn wide_head_attention_matches_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    use ditstream_kernels as k;
    let u = 2f32.powi(-24);
    // (B, S_q, S_k, H, D, kv_len)
    let cases = [
        (1, 6240, 6240, 1, 384, None),
        (2, 130, 300, 2, 384, Some(77)),
        (1, 64, 128, 1, 384, Some(0)),
        (1, 200, 257, 3, 256, Some(129)),
        (1, 129, 1000, 1, 512, None),
        (1, 70, 90, 1, 320, None),
    ];
    for (ci, &(batch, seq_q, seq_k, heads, head_dim, kv_len)) in cases.iter().enumerate() {
        for dtype in [DType::F32, DType::BF16] {
            let seed = 200 + 3 * ci as u64;
            let q = randn(&[batch, seq_q, heads, head_dim], dtype, seed);
            let kk = randn(&[batch, seq_k, heads, head_dim], dtype, seed + 1);
            let v = randn(&[batch, seq_k, heads, head_dim], dtype, seed + 2);
            let opts = AttentionOptions {
                scale: None,
                kv_len,
            };
            let scale = 1.0 / (head_dim as f32).sqrt();
            let (out, lse) = k::attention(&q, &kk, &v, opts)?;
            let max_v = v.to_vec_f32()?.iter().fold(0.0f32, |a, x| a.max(x.abs()));
            let ds = head_dim as f32 * u * scale * max_token_norm(&q)? * max_token_norm(&kk)?;
            let lse_atol = ds + seq_k as f32 * u;
            let (gq, gk, gv) = (q.to_device(dev)?, kk.to_device(dev)?, v.to_device(dev)?);
            let shape = format!("{:?}", out.shape());

            let mut choices = vec![(AttentionKernel::Portable, "portable".to_string())];
            if dtype == DType::BF16 {
                choices.extend(
                    FLASH_VARIANTS
                        .iter()
                        .enumerate()
                        .filter(|(_, var)| var.head_dim == head_dim)
                        .map(|(i, var)| (AttentionKernel::Flash(i), var.name.to_string())),
                );
                choices.push((AttentionKernel::Auto, "auto".to_string()));
            }
            for (choice, label) in choices {
                let portable = choice == AttentionKernel::Portable
                    || (choice == AttentionKernel::Auto && ![256, 384, 512].contains(&head_dim));
                let (atol, rms_bound) = if portable {
                    let rms = if dtype == DType::F32 { 1e-4 } else { 1e-2 };
                    ((2.0 * ds + seq_k as f32 * u) * max_v, rms)
                } else {
                    (max_v / 256.0, 1e-2)
                };
                let (gout, glse) =
                    with_attention_kernel(choice, || k::attention(&gq, &gk, &gv, opts))?;
                check(
                    &format!("wide_attention_out {label}"),
                    &gout,
                    &out,
                    atol,
                    rtol(dtype),
                );
                let rel = attention_rel_rms(&gout.to_device(Device::Cpu)?, &out)?;
                println!(
                    "PARITY\twide_attention_rel_rms {label}\t{}\t{shape}\t{rel:.3e}\tbound {rms_bound:.0e}",
                    name(dtype)
                );
                assert!(
                    rel <= rms_bound,
                    "{label} {shape} {dtype:?}: relative RMS error {rel:.3e} > {rms_bound:.0e}"
                );
                check(
                    &format!("wide_attention_lse {label}"),
                    &glse,
                    &lse,
                    lse_atol,
                    1e-5,
                );
            }
        }
    }
    Ok(())
}

// ---- The VAE's fused elementwise paths (vfuse) ----

/// `rms_norm_channels_silu` on the GPU is bit-identical to the GPU's own norm then SiLU (the two
/// kernels it replaces: the decoder's numerics must not move), and matches its CPU twin.
///
/// Tolerance against the CPU: the norm y differs by a few f32 ulps (as `rms_norm_channels`, atol 1e-4
/// at these sizes); in bf16 that can round y to a neighbouring bf16, |Δy| ≤ 2⁻⁸·|y|, so before the
/// SiLU's own rounding the outputs differ by ≤ max|SiLU′|·|Δy| ≤ 1.1·2⁻⁸·max|y| (SiLU′ ∈ [−0.1, 1.1]);
/// the final rounding adds one bf16 ulp of the output, rtol. In f32 the SiLU passes the norm's error
/// through scaled by ≤ 1.1, plus a few ulps: atol 1.1·1e-4 plus rtol.
#[test]
fn rms_norm_channels_silu_matches_unfused_and_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    use ditstream_kernels as k;
    for dtype in [DType::F32, DType::BF16] {
        // Odd sizes (element-wise tiles), then 16-byte words with a ragged last tile; a VAE-like width.
        for xs in [[2, 96, 2, 5, 7], [2, 96, 2, 6, 12]] {
            let x = randn(&xs, dtype, 51);
            let gamma = randn(&[96, 1, 1, 1], dtype, 52);
            let (gx, gg) = (x.to_device(dev)?, gamma.to_device(dev)?);
            let fused = k::rms_norm_channels_silu(&gx, &gg, None)?;
            let unfused = k::silu(&k::rms_norm_channels(&gx, &gg, None)?)?;
            let differing = differing_bits(&fused, &unfused)?;
            println!(
                "PARITY\trms_norm_channels_silu vs unfused gpu\t{}\t{:?}\t{differing} differing\texact",
                name(dtype),
                x.shape()
            );
            assert_eq!(differing, 0, "{dtype:?}: fused differs from norm then silu");

            let normed = k::rms_norm_channels(&x, &gamma, None)?;
            let max_y = normed
                .to_vec_f32()?
                .iter()
                .fold(0.0f32, |m, v| m.max(v.abs()));
            let atol = match dtype {
                DType::F32 => 1.1 * 1e-4,
                DType::BF16 => 1.1 * (max_y / 256.0) + 1.1 * 1e-4,
            };
            check(
                "rms_norm_channels_silu",
                &fused,
                &k::rms_norm_channels_silu(&x, &gamma, None)?,
                atol,
                rtol(dtype),
            );
        }
    }
    Ok(())
}

/// `causal_conv3d_upsampled` on the GPU is bit-identical to the GPU's own upsample then causal conv
/// on every path (the channels-last path reads the upsampling in place in `conv_to_ndhwc_up2`, so its
/// cuDNN input holds the same bits; the others upsample first), and matches the CPU twin with
/// `convolutions_match_cpu`'s tolerance (atol 1e-5 per tap, plus 4·2⁻⁹ in bf16 for the bias added
/// after the sum's own rounding). Cases: the upsamplers' 1×3×3 kernel at even sizes (word pairs in
/// the transposes) and odd channels (single elements), a 3×3×3 kernel with 2 cached frames, and a
/// batch of 2 spanning several 64-wide tiles with ragged edges.
#[test]
fn causal_conv3d_upsampled_matches_unfused_and_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    use ditstream_kernels as k;
    for dtype in [DType::F32, DType::BF16] {
        for (ws, cached, hw, batch) in [
            ([8, 16, 1, 3, 3], 0, [6, 10], 1),
            ([6, 5, 1, 3, 3], 0, [5, 7], 1),
            ([6, 4, 3, 3, 3], 2, [6, 10], 1),
            ([33, 66, 1, 3, 3], 0, [9, 37], 2),
        ] {
            let x = randn(&[batch, ws[1], 2, hw[0], hw[1]], dtype, 120);
            let w = randn(&ws, dtype, 121);
            let b = randn(&[ws[0]], DType::F32, 122);
            let cache =
                (cached > 0).then(|| randn(&[batch, ws[1], cached, hw[0], hw[1]], dtype, 123));
            let (gx, gw, gb) = (x.to_device(dev)?, w.to_device(dev)?, b.to_device(dev)?);
            let gcache = cache.as_ref().map(|c| c.to_device(dev)).transpose()?;
            let gup_cache = gcache.as_ref().map(k::upsample_nearest2x).transpose()?;
            let cpu = k::causal_conv3d_upsampled(&x, &w, Some(&b), cache.as_ref())?;
            let taps = ws[1] * ws[2] * ws[3] * ws[4];
            let atol = 1e-5 * taps as f32
                + match dtype {
                    DType::BF16 => 4.0 * 2f32.powi(-9),
                    DType::F32 => 0.0,
                };
            for (algo, label) in CONV_PATHS {
                let fused = with_conv_algo(algo, || {
                    k::causal_conv3d_upsampled(&gx, &gw, Some(&gb), gcache.as_ref())
                })?;
                let unfused = with_conv_algo(algo, || {
                    k::causal_conv3d(
                        &k::upsample_nearest2x(&gx)?,
                        &gw,
                        Some(&gb),
                        gup_cache.as_ref(),
                    )
                })?;
                let differing = differing_bits(&fused, &unfused)?;
                println!(
                    "PARITY\tcausal_conv3d_upsampled {label} vs unfused gpu\t{}\t{:?}\t{differing} differing\texact",
                    name(dtype),
                    x.shape()
                );
                assert_eq!(differing, 0, "{label} {dtype:?} {ws:?}: fused differs");
                check(
                    &format!("causal_conv3d_upsampled {label}"),
                    &fused,
                    &cpu,
                    atol,
                    rtol(dtype),
                );
            }
        }
    }
    Ok(())
}

/// `conv3d_cached` with a halo (the parallel VAE's band between its neighbours' rows, read in place by
/// the channels-last transpose, `conv_to_ndhwc_halo`, and joined by concatenation on the other paths)
/// is bit-identical on the GPU to `conv3d_cached` on the explicitly joined input, on every path: rows
/// (with and without whole chunks per row) and columns, with and without cached frames, with and
/// without a residual, with a missing edge (zeros: the odd channel counts), odd and even channel
/// counts (both transpose word sizes), f32 and bf16. The joined conv's agreement with the CPU is
/// `convolutions_match_cpu`'s.
#[test]
fn conv3d_cached_halo_matches_joined() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    use ditstream_kernels as k;
    for dtype in [DType::F32, DType::BF16] {
        // Widths of 16 and 24 hold whole 16-byte chunks of a row (8 bf16, 4 f32): the height
        // split's word loads; a width of 10 loads element by element.
        for (axis, c_in, cached, residual, hw) in [
            (3, 16, 2, true, [6, 10]),
            (3, 5, 0, false, [6, 10]),
            (3, 16, 2, true, [6, 16]),
            (3, 5, 1, false, [5, 24]),
            (4, 16, 1, false, [6, 10]),
            (4, 7, 2, true, [6, 10]),
        ] {
            let frames = 2;
            let x = randn(&[1, c_in, frames, hw[0], hw[1]], dtype, 140).to_device(dev)?;
            let w = randn(&[8, c_in, 3, 3, 3], dtype, 141).to_device(dev)?;
            let b = randn(&[8], dtype, 142).to_device(dev)?;
            let cache = (cached > 0)
                .then(|| randn(&[1, c_in, cached, hw[0], hw[1]], dtype, 143).to_device(dev))
                .transpose()?;
            let mut edge = vec![1, c_in, cached + frames, hw[0], hw[1]];
            edge[axis] = 1;
            let before = randn(&edge, dtype, 144).to_device(dev)?;
            let after = randn(&edge, dtype, 145).to_device(dev)?;
            // Odd channel counts stand for a border rank: no edge before (zeros).
            let halo = k::Halo {
                axis,
                extent: 1,
                before: (c_in % 2 == 0).then_some(&before),
                after: Some(&after),
            };
            let before = match halo.before {
                Some(_) => before.clone(),
                None => k::Tensor::zeros(&edge, dtype, dev)?,
            };
            // Causal in T, kw/2 on the other spatial axis, none along the halo's.
            let mut pads = ([2 - cached, 1, 1], [0, 1, 1]);
            pads.0[axis - 2] = 0;
            pads.1[axis - 2] = 0;
            let mut out_shape = vec![1, 8, frames, hw[0], hw[1]];
            out_shape[axis] = hw[axis - 3];
            let r = residual
                .then(|| randn(&out_shape, dtype, 146).to_device(dev))
                .transpose()?;
            let join = |t: &Tensor, from: usize, n: usize| -> Result<Tensor> {
                Ok(k::Tensor::concat(
                    &[&before.narrow(2, from, n)?, t, &after.narrow(2, from, n)?],
                    axis,
                )?)
            };
            let joined_x = join(&x, cached, frames)?;
            let joined_cache = cache.as_ref().map(|c| join(c, 0, cached)).transpose()?;
            for (algo, label) in CONV_PATHS {
                let haloed = with_conv_algo(algo, || {
                    k::conv3d_cached(
                        &x,
                        &w,
                        Some(&b),
                        cache.as_ref(),
                        Some(&halo),
                        pads,
                        r.as_ref(),
                    )
                })?;
                let joined = with_conv_algo(algo, || {
                    k::conv3d_cached(
                        &joined_x,
                        &w,
                        Some(&b),
                        joined_cache.as_ref(),
                        None,
                        pads,
                        r.as_ref(),
                    )
                })?;
                assert_eq!(haloed.shape(), out_shape.as_slice(), "{label}");
                let differing = differing_bits(&haloed, &joined)?;
                println!(
                    "PARITY\tconv3d_cached halo {label} vs joined gpu\t{}\taxis {axis} c_in {c_in} cached {cached} {hw:?}\t{differing} differing\texact",
                    name(dtype),
                );
                assert_eq!(
                    differing, 0,
                    "{label} {dtype:?} axis {axis} c_in {c_in}: haloed differs"
                );
            }
        }
    }
    Ok(())
}

/// `conv3d_cached_upsampled` with a halo of x's resolution (the parallel VAE's upsampling convs: the
/// channels-last transpose reads the upsampling and the halo in place, `conv_to_ndhwc_halo_up2`;
/// the other paths join, upsample and cut) is bit-identical on the GPU to `conv3d_cached` of the
/// explicitly joined, upsampled and cut input, on every path: the upsamplers' 1×3×3 kernel on rows
/// and columns, a 3×3×3 one with cached frames, a missing edge (zeros), odd and even channel counts,
/// f32 and bf16.
#[test]
fn conv3d_cached_upsampled_halo_matches_joined() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    use ditstream_kernels as k;
    for dtype in [DType::F32, DType::BF16] {
        for (axis, c_in, kt, cached, hw) in [
            // Upsampled widths of 16 and 8 hold whole 16-byte chunks (8 bf16, 4 f32): the height
            // split's word path; 12 only in f32; the width split goes element by element.
            (3, 16, 1, 0, [4, 8]),
            (3, 5, 1, 0, [3, 4]),
            (4, 16, 1, 0, [4, 8]),
            (3, 8, 3, 2, [3, 6]),
            (4, 7, 3, 1, [3, 5]),
        ] {
            let frames = 2;
            let x = randn(&[1, c_in, frames, hw[0], hw[1]], dtype, 160).to_device(dev)?;
            let w = randn(&[8, c_in, kt, 3, 3], dtype, 161).to_device(dev)?;
            let b = randn(&[8], dtype, 162).to_device(dev)?;
            let cache = (cached > 0)
                .then(|| randn(&[1, c_in, cached, hw[0], hw[1]], dtype, 163).to_device(dev))
                .transpose()?;
            let mut edge = vec![1, c_in, cached + frames, hw[0], hw[1]];
            edge[axis] = 1;
            let before = randn(&edge, dtype, 164).to_device(dev)?;
            let after = randn(&edge, dtype, 165).to_device(dev)?;
            // Odd channel counts stand for a border rank: no edge before (zeros).
            let halo = k::Halo {
                axis,
                extent: 1,
                before: (c_in % 2 == 0).then_some(&before),
                after: Some(&after),
            };
            let before = match halo.before {
                Some(_) => before.clone(),
                None => k::Tensor::zeros(&edge, dtype, dev)?,
            };
            let mut pads = ([kt - 1 - cached.min(kt - 1), 1, 1], [0, 1, 1]);
            pads.0[axis - 2] = 0;
            pads.1[axis - 2] = 0;
            let band = match &cache {
                Some(c) => k::Tensor::concat(&[c, &x], 2)?,
                None => x.clone(),
            };
            let up = k::upsample_nearest2x(&k::Tensor::concat(&[&before, &band, &after], axis)?)?;
            let cut = up.narrow(axis, 1, up.shape()[axis] - 2)?;
            for (algo, label) in CONV_PATHS {
                let haloed = with_conv_algo(algo, || {
                    k::conv3d_cached_upsampled(&x, &w, Some(&b), cache.as_ref(), Some(&halo), pads)
                })?;
                let joined = with_conv_algo(algo, || {
                    k::conv3d_cached(&cut, &w, Some(&b), None, None, pads, None)
                })?;
                assert_eq!(haloed.shape(), joined.shape(), "{label}");
                let differing = differing_bits(&haloed, &joined)?;
                println!(
                    "PARITY\tconv3d_cached_upsampled halo {label} vs joined gpu\t{}\taxis {axis} c_in {c_in} kt {kt} cached {cached} {hw:?}\t{differing} differing\texact",
                    name(dtype),
                );
                assert_eq!(
                    differing, 0,
                    "{label} {dtype:?} axis {axis} c_in {c_in}: haloed differs"
                );
            }
        }
    }
    Ok(())
}

/// `halo_edges` (both edges of cache ++ x from one kernel) is bit-identical on the GPU to the CPU's
/// narrows and join: rows and columns, extents 1 and 2, with and without cached frames, widths that
/// take 16-byte words (16) and ones that take elements (10, 7 columns), f32 and bf16.
#[test]
fn halo_edges_match_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    use ditstream_kernels as k;
    for dtype in [DType::F32, DType::BF16] {
        for (axis, extent, cached, hw) in [
            (3, 1, 2, [6, 16]),
            (3, 2, 0, [5, 10]),
            (3, 1, 1, [4, 7]),
            (4, 1, 2, [6, 16]),
            (4, 2, 1, [5, 10]),
        ] {
            let x = randn(&[2, 3, 2, hw[0], hw[1]], dtype, 150);
            let cache = (cached > 0).then(|| randn(&[2, 3, cached, hw[0], hw[1]], dtype, 151));
            let (want_first, want_last) = k::halo_edges(cache.as_ref(), &x, axis, extent)?;
            let gpu_cache = cache.map(|c| c.to_device(dev)).transpose()?;
            let (first, last) =
                k::halo_edges(gpu_cache.as_ref(), &x.to_device(dev)?, axis, extent)?;
            for (got, want, side) in [(&first, &want_first, "first"), (&last, &want_last, "last")] {
                assert_eq!(got.shape(), want.shape(), "{side}");
                let differing = differing_bits(&got.to_device(Device::Cpu)?, want)?;
                println!(
                    "PARITY\thalo_edges {side} gpu vs cpu\t{}\taxis {axis} e {extent} cached {cached} {hw:?}\t{differing} differing\texact",
                    name(dtype),
                );
                assert_eq!(differing, 0, "{dtype:?} axis {axis} {side}: edges differ");
            }
        }
    }
    Ok(())
}

/// `causal_conv3d_residual` on the GPU is bit-identical to the GPU's own causal conv then `add` on
/// every path (the channels-last path adds in `conv_from_ndhwc`'s epilogue after the bias's rounding;
/// the others, and a residual in another dtype, run the `add` op), with f32 and bf16 biases (both
/// epilogue instances). Against the CPU twin: the conv's bound of `convolutions_match_cpu` (atol 1e-5
/// per tap, + 4·2⁻⁹ in bf16) carries through the add unchanged, but its relative part is relative to
/// the conv's value, which the residual may cancel, so it is taken as an absolute rtol·max|conv|; the
/// add's own rounding is ≤ one ulp of the output (rtol).
#[test]
fn causal_conv3d_residual_matches_unfused_and_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    use ditstream_kernels as k;
    for dtype in [DType::F32, DType::BF16] {
        for (ws, cached, hw, batch, bias_dtype, residual_dtype) in [
            ([16, 16, 3, 3, 3], 2, [6, 10], 1, dtype, dtype),
            ([6, 4, 3, 3, 3], 0, [5, 7], 1, DType::F32, dtype),
            ([66, 33, 3, 3, 3], 1, [9, 14], 2, dtype, dtype),
            ([6, 4, 3, 3, 3], 2, [6, 10], 1, dtype, DType::F32), // unfused: the add op
        ] {
            let x = randn(&[batch, ws[1], 2, hw[0], hw[1]], dtype, 130);
            let w = randn(&ws, dtype, 131);
            let b = randn(&[ws[0]], bias_dtype, 132);
            let r = randn(&[batch, ws[0], 2, hw[0], hw[1]], residual_dtype, 133);
            let cache =
                (cached > 0).then(|| randn(&[batch, ws[1], cached, hw[0], hw[1]], dtype, 134));
            let (gx, gw, gb, gr) = (
                x.to_device(dev)?,
                w.to_device(dev)?,
                b.to_device(dev)?,
                r.to_device(dev)?,
            );
            let gcache = cache.as_ref().map(|c| c.to_device(dev)).transpose()?;
            let cpu = k::causal_conv3d_residual(&x, &w, Some(&b), cache.as_ref(), &r)?;
            let cpu_conv = k::causal_conv3d(&x, &w, Some(&b), cache.as_ref())?;
            let max_conv = cpu_conv
                .to_vec_f32()?
                .iter()
                .fold(0.0f32, |m, v| m.max(v.abs()));
            let taps = ws[1] * ws[2] * ws[3] * ws[4];
            let atol = 1e-5 * taps as f32
                + match dtype {
                    DType::BF16 => 4.0 * 2f32.powi(-9),
                    DType::F32 => 0.0,
                }
                + rtol(dtype) * max_conv;
            for (algo, label) in CONV_PATHS {
                let fused = with_conv_algo(algo, || {
                    k::causal_conv3d_residual(&gx, &gw, Some(&gb), gcache.as_ref(), &gr)
                })?;
                let unfused = with_conv_algo(algo, || {
                    k::add(
                        &k::causal_conv3d(&gx, &gw, Some(&gb), gcache.as_ref())?,
                        &gr,
                    )
                })?;
                let differing = differing_bits(&fused, &unfused)?;
                println!(
                    "PARITY\tcausal_conv3d_residual {label} vs unfused gpu\t{}\t{:?}\t{differing} differing\texact",
                    name(dtype),
                    x.shape()
                );
                assert_eq!(differing, 0, "{label} {dtype:?} {ws:?}: fused differs");
                check(
                    &format!("causal_conv3d_residual {label}"),
                    &fused,
                    &cpu,
                    atol,
                    rtol(dtype),
                );
            }
        }
    }
    Ok(())
}

/// FP8 (e4m3) linears against the CPU reference.
///
/// Quantisation: exact. The kernel does the reference's arithmetic step for step (`quant.cu`), so
/// the codes and the scales must be bit-identical, for bf16 and f32 rows, for k a multiple of 8
/// (the vectorised kernel) and not (the scalar one), with all-zero rows and rows of very different
/// magnitudes.
///
/// The linear: both sides multiply the same codes (exact products: 4 × 4 significant bits) and
/// apply the same scales; they differ in the sum S = Σₖ qx·qw. The CPU rounds k f32 additions
/// (≤ k·2⁻²⁴·A, A = Σₖ|qx·qw|); the GPU's FP8 tensor cores, with fast accumulation (gemm.rs),
/// sum the whole k in their own adder, which keeps ~14 significant bits (DeepSeek-V3, on
/// Hopper): one rounding of at most 2⁻¹³ of the partial sum (≤ A) per wgmma k-step of 32, so
/// we allow ⌈k/32⌉·2⁻¹³·A (2⁻¹⁰·A at k = 256, ~2⁻⁷·⁴·A at the DiT's 1,536; a result wrong by
/// as much as the output itself, ~A/√k, is still far outside). Scaled by s_x·s_w and rounded to
/// bf16 on both sides (two results that close are at most one bf16 ulp, 2⁻⁷ of the value, apart):
/// |gpu − cpu| ≤ 2⁻⁷·|cpu| + ⌈k/32⌉·2⁻¹³·A·s_x·s_w, times GELU's largest slope (1.13) after the sum, or
/// |gate| where the gate is folded into the scales; plus 2⁻⁸·|bias| of margin for the f32 order in
/// which the epilogue adds the bias. A is computed per element from the codes.
#[test]
fn fp8_linears_match_cpu() -> Result<()> {
    let Some(dev) = fp8_gpu()? else { return Ok(()) };
    use ditstream_kernels as k;
    // Quantisation, bit for bit.
    // k: bf16 rows held in registers (up to 32,768: 256, the DiT's 1,536, 5,120, 8,960 and
    // 13,824), the vectorised kernel (f32 rows, and bf16 rows too long to hold: 40,000) and the
    // scalar one (37).
    for (dtype, kk) in [
        (DType::BF16, 256),
        (DType::F32, 256),
        (DType::BF16, 1536),
        (DType::BF16, 5120),
        (DType::BF16, 8960),
        (DType::BF16, 13824),
        (DType::BF16, 37),
        (DType::BF16, 40000),
    ] {
        let mut x = randn(&[6, kk], DType::F32, 60).to_vec_f32()?;
        for (i, v) in x.iter_mut().enumerate() {
            *v *= [1e-3f32, 1.0, 300.0][i / kk % 3];
        }
        x[kk..2 * kk].fill(0.0);
        let x = Tensor::from_vec(x, &[6, kk])?.to_dtype(dtype)?;
        let (cpu, gpu) = (
            k::Fp8Tensor::quantize(&x)?,
            k::Fp8Tensor::quantize(&x.to_device(dev)?)?,
        );
        assert_eq!(gpu.codes()?, cpu.codes()?, "{dtype:?} k {kk}: codes");
        assert_eq!(
            differing_bits(gpu.scales(), cpu.scales())?,
            0,
            "{dtype:?} k {kk}: scales"
        );
        println!(
            "PARITY\tquantize_e4m3\t{}\t[6, {kk}]\t0\texact",
            name(dtype)
        );
    }

    // Every epilogue of the FP8 GEMM runs (each one reported, so one run says which cuBLASLt
    // refuses, if any).
    {
        let x = k::Fp8Tensor::quantize(&randn(&[2, 24, 256], DType::BF16, 66).to_device(dev)?)?;
        let w = k::Fp8Tensor::quantize(&randn(&[256, 256], DType::BF16, 67).to_device(dev)?)?;
        let b = randn(&[256], DType::BF16, 68).to_device(dev)?;
        let res = randn(&[2, 24, 256], DType::BF16, 69).to_device(dev)?;
        let gate = randn(&[2, 1, 256], DType::F32, 70).to_device(dev)?;
        let variants: [(&str, ditstream_kernels::Result<Tensor>); 6] = [
            ("no bias", k::linear_fp8(&x, &w, None)),
            ("bias", k::linear_fp8(&x, &w, Some(&b))),
            ("gelu + bias", k::linear_fp8_gelu_tanh(&x, &w, &b)),
            ("residual", k::linear_fp8_residual(&x, &w, None, &res, None)),
            (
                "residual + bias",
                k::linear_fp8_residual(&x, &w, Some(&b), &res, None),
            ),
            (
                "residual + bias, per-sample gate",
                k::linear_fp8_residual(&x, &w, Some(&b), &res, Some(&gate)),
            ),
        ];
        let mut failed = Vec::new();
        for (what, out) in variants {
            match out.and_then(|t| t.to_vec_f32()) {
                Ok(v) if v.iter().all(|x| x.is_finite()) => println!("FP8GEMM\t{what}\tok"),
                Ok(_) => failed.push(format!("{what}: non-finite output")),
                Err(e) => failed.push(format!("{what}: {e}")),
            }
        }
        assert!(
            failed.is_empty(),
            "FP8 GEMM variants failed:\n{}",
            failed.join("\n")
        );
    }

    // The linears: a small case whole, and the DiT's 1.3B q/k/v/o shape (searched) on sampled rows
    // (per-token quantisation makes each output row depend on its input row only).
    for (rows, inf, outf, sampled) in [(154, 256, 96, None), (32760, 1536, 1536, Some(16))] {
        let x = randn(&[rows, inf], DType::BF16, 61);
        let w = randn(&[outf, inf], DType::BF16, 62);
        let b = randn(&[outf], DType::BF16, 63);
        let res = randn(&[rows, outf], DType::BF16, 64);
        let gx = k::Fp8Tensor::quantize(&x.to_device(dev)?)?;
        let (gb, gres) = (b.to_device(dev)?, res.to_device(dev)?);
        let (cw, gw) = (
            k::Fp8Tensor::quantize(&w)?,
            k::Fp8Tensor::quantize(&w.to_device(dev)?)?,
        );
        let gate = randn(&[1, 1, outf], DType::F32, 65);
        let gate_abs: Vec<f32> = gate.to_vec_f32()?.iter().map(|g| g.abs()).collect();
        // (op, GPU result, the slope of what follows the sum per output feature: GELU's bound,
        // the gate folded into the scales)
        let outs = [
            (
                "linear_fp8",
                k::linear_fp8(&gx, &gw, Some(&gb))?,
                vec![1.0; outf],
            ),
            (
                "linear_fp8_gelu_tanh",
                k::linear_fp8_gelu_tanh(&gx, &gw, &gb)?,
                vec![1.13; outf],
            ),
            (
                "linear_fp8_residual",
                k::linear_fp8_residual(&gx, &gw, Some(&gb), &gres, Some(&gate.to_device(dev)?))?,
                gate_abs,
            ),
        ];
        let pick = |t: &Tensor| -> Result<Tensor> {
            let t = t.to_device(Device::Cpu)?;
            Ok(match sampled {
                Some(n) => t.narrow(0, rows - n, n)?,
                None => t,
            })
        };
        let (xs, ress) = (pick(&x)?, pick(&res)?);
        let qx = k::Fp8Tensor::quantize(&xs)?;
        let cpu_outs = [
            k::linear_fp8(&qx, &cw, Some(&b))?,
            k::linear_fp8_gelu_tanh(&qx, &cw, &b)?,
            k::linear_fp8_residual(&qx, &cw, Some(&b), &ress, Some(&gate))?,
        ];
        // A·s_x·s_w per element, from the codes: |qx|·|qw|ᵀ scaled.
        let abs_values = |t: &k::Fp8Tensor| -> Result<Tensor> {
            let v: Vec<f32> = t
                .codes()?
                .into_iter()
                .map(|c| k::e4m3_value(c).abs())
                .collect();
            Ok(Tensor::from_vec(v, t.shape())?)
        };
        let a = k::linear(&abs_values(&qx)?, &abs_values(&cw)?, None)?;
        let scaled = k::mul(
            &k::mul(&a, &qx.scales().reshape(&[xs.shape()[0], 1])?)?,
            cw.scales(),
        )?
        .to_vec_f32()?;
        let bias = b.to_vec_f32()?;
        let accumulation = inf.div_ceil(32) as f32 * 2f32.powi(-13);
        for ((op, got, slope), cpu) in outs.iter().zip(&cpu_outs) {
            let got = pick(got)?;
            let (g, c) = (got.to_vec_f32()?, cpu.to_vec_f32()?);
            let mut worst = 0f32;
            for (i, (gv, cv)) in g.iter().zip(&c).enumerate() {
                let o = i % outf;
                let bound = 2f32.powi(-7) * cv.abs()
                    + slope[o] * (accumulation * scaled[i] + 2f32.powi(-8) * bias[o].abs());
                assert!(
                    (gv - cv).abs() <= bound,
                    "{op} [{rows}, {inf}]·[{outf}, {inf}]ᵀ element {i}: {gv} vs {cv} (bound {bound})"
                );
                worst = worst.max((gv - cv).abs() / bound);
            }
            println!(
                "PARITY\t{op}\tbf16\t[{rows}, {inf}]x[{outf}, {inf}]\t{:.3e}\tworst/bound {worst:.3}",
                max_abs_diff(&got, cpu)?
            );
        }
    }
    Ok(())
}

/// The norms that write e4m3 (`layer_norm_e4m3`, `layer_norm_modulate_e4m3`) are, on the GPU, the
/// unfused norm then `Fp8Tensor::quantize` bit for bit: the fused kernels do the register-held norm's
/// maths in its order (same threads per row), round to bf16 as it stores, and quantise as quant.cu
/// does. Cases: the DiT's widths (1,536 and 5,120: the 14B's rows, 640 words over 160 threads), the
/// modulation per sample and per token, LayerNorm without affine and with bf16 or f32 parameters,
/// rows of very different magnitudes and an all-zero row; then shapes the fused kernels do not take
/// (f32 x, an f32 output, a width that is not whole words), which must give the same as the
/// composition too. The unfused ops are held to the CPU by `norms_match_cpu` and
/// `fp8_linears_match_cpu`.
#[test]
fn fp8_norms_match_unfused() -> Result<()> {
    let Some(dev) = fp8_gpu()? else { return Ok(()) };
    use ditstream_kernels as k;
    let same = |what: &str, fused: &k::Fp8Tensor, unfused: &k::Fp8Tensor| -> Result<()> {
        let (fc, uc) = (fused.codes()?, unfused.codes()?);
        let codes = fc.iter().zip(&uc).filter(|(a, b)| a != b).count();
        let scales = differing_bits(fused.scales(), unfused.scales())?;
        println!("PARITY\t{what} vs unfused gpu\t{codes} codes, {scales} scales differing\texact");
        assert_eq!(
            (codes, scales),
            (0, 0),
            "{what}: fused differs from norm then quantize"
        );
        assert_eq!(
            (fused.shape(), fused.dtype()),
            (unfused.shape(), unfused.dtype()),
            "{what}"
        );
        Ok(())
    };
    // x [2, 7, d] with rows scaled by 1e-3, 1, 300 and row 1 all zero (LayerNorm then gives the
    // bias or the shift alone).
    let input = |d: usize, dtype: DType| -> Result<Tensor> {
        let mut x = randn(&[2, 7, d], DType::F32, 71).to_vec_f32()?;
        for (i, v) in x.iter_mut().enumerate() {
            *v *= [1e-3f32, 1.0, 300.0][i / d % 3];
        }
        x[d..2 * d].fill(0.0);
        Ok(Tensor::from_vec(x, &[2, 7, d])?
            .to_dtype(dtype)?
            .to_device(dev)?)
    };
    for (d, xdt, odt) in [
        (1536, DType::BF16, DType::BF16),
        (5120, DType::BF16, DType::BF16),
        (1536, DType::F32, DType::BF16),
        (1536, DType::BF16, DType::F32),
        (36, DType::BF16, DType::BF16),
    ] {
        let x = input(d, xdt)?;
        for (per, mod_shape) in [("per sample", [2, 1, d]), ("per token", [2, 7, d])] {
            let shift = randn(&mod_shape, DType::F32, 72).to_device(dev)?;
            let scale = randn(&mod_shape, DType::F32, 73).to_device(dev)?;
            same(
                &format!("layer_norm_modulate_e4m3 d {d} {xdt:?} → {odt:?}, {per}"),
                &k::layer_norm_modulate_e4m3(&x, &shift, &scale, 1e-6, odt)?,
                &k::Fp8Tensor::quantize(&k::layer_norm_modulate(&x, &shift, &scale, 1e-6, odt)?)?,
            )?;
        }
        for pdt in [None, Some(DType::BF16), Some(DType::F32)] {
            let w = pdt.map(|t| randn(&[d], t, 74).to_device(dev)).transpose()?;
            let b = pdt.map(|t| randn(&[d], t, 75).to_device(dev)).transpose()?;
            same(
                &format!("layer_norm_e4m3 d {d} {xdt:?}, affine {pdt:?}"),
                &k::layer_norm_e4m3(&x, w.as_ref(), b.as_ref(), 1e-6)?,
                &k::Fp8Tensor::quantize(&k::layer_norm(&x, w.as_ref(), b.as_ref(), 1e-6)?)?,
            )?;
        }
    }
    Ok(())
}

/// The FP8 attention (hopper.cu's `fp8` kernel on quant.cu's operands) against its CPU reference,
/// `attention_fp8`, on the same bf16 inputs: partial query tiles and key blocks (kv_len < S_k),
/// a batch of 2, keys ≠ queries (the cross-attention's 512), scores spread as in the CPU test.
///
/// Tolerance. Both follow one recipe on identical codes and scales (the quantisation is the CPU's
/// arithmetic), so they differ only where f32 arithmetic does: the tensor cores' e4m3 sums (they keep
/// ≥ 13 bits of the running sum, so a score moves by ≤ 2⁻¹³ relative to Σ|q·k|, ~1e-3 here, and a
/// window of P·V, ≤ 384 keys, by as much), ex2.approx
/// (2 ulp) and the order of the descale products: each p by ≲ 2⁻¹⁰ relative, which moves out by as
/// much, except where it tips p·448's rounding to e4m3 to the other neighbour (a fraction ~2⁻¹⁰/2⁻⁴
/// of the p's, each by ≤ 2⁻³ of itself, averaged over 128+ keys per row). Expected: relative RMS of
/// out ~1e-3; bound 1e-2, which is still several times below what the quantisation itself costs (the
/// reference against exact bf16 attention, printed; asserted ≥ 3× the GPU's distance). LSE: m moves by
/// the score error and ln l by the same relative p error (≤ 1e-2 together), and since l sums the
/// rounded p (the kernel's P·V adds them), by each tipped rounding: ≤ 2⁻³ of that p's share of l, so
/// |Δlse| ≤ −ln(1 − 2⁻³) + 1e-2 in any row (the shares sum to 1). A key tips with probability
/// ~2⁻¹⁰/2⁻⁴, so E[Δ ln l²] ≤ 2⁻⁶·2⁻⁶·Σ share² ≤ 2⁻¹²: the RMS over rows ≤ 2⁻⁶ + 1e-2. A wrong
/// key order of Vᵀ, a missed descale, P left unscaled or a wrong column of sums fails by O(0.1–1).
/// Where a launch splits the keys (these small calls are a sparse last wave), each run of ≥ 2
/// blocks is the case above and both sides merge the runs' rows by their LSEs in f32, which
/// averages the runs' errors (weights summing to 1) and adds f32 rounding: the same bounds hold.
/// A run merged with a wrong weight, or one left out, moves out by its share, O(1/runs).
#[test]
fn fp8_attention_matches_cpu() -> Result<()> {
    let Some(dev) = fp8_gpu()? else { return Ok(()) };
    for (b, sq, sk, h, kv_len, spread) in [
        (1, 300, 257, 2, 250, 4.0),
        (2, 1024, 1024, 3, 1024, 1.0),
        (1, 640, 512, 2, 512, 2.0),
        (1, 100, 60, 1, 60, 4.0),
    ] {
        fp8_attention_case(dev, [b, sq, sk, h, kv_len], spread, 0.0, (sk, 1.0), true)?;
    }
    Ok(())
}

/// `fp8_attention_matches_cpu` where later keys pass the softmax's exponent offset, by a little and
/// by far: the keys from 640 on are 3× larger, those from 896 on 20× (scores up to ~100 nats above
/// the first blocks' maxima: past f32's range, 2¹²⁸, for a p taken at the old offset). The
/// speculative kernel (`_spec`) must notice every pass and put those rows right: at 3× from their
/// p (hopper.cu's `fix_rows`), at 20× from S taken again on the CUDA cores. (There, on an H100,
/// it came within 4.7e-4 of the recipe and the exact kernels within 3.4e-3: at ~100 nats the
/// tensor cores' accumulation of S shows; bench/RESULTS.md, 2026-12-06, seventh session. At 3×
/// the kernels come within 4.7e-3; a kernel that took those blocks' S again on f16 tensor-core
/// products, exact for e4m3, came within 1.1e-3: the wgmma's S is most of that distance too;
/// eighth session.)
#[test]
fn fp8_attention_matches_cpu_when_scores_pass_the_offset() -> Result<()> {
    let Some(dev) = fp8_gpu()? else { return Ok(()) };
    fp8_attention_case(dev, [1, 256, 1024, 2, 1000], 2.0, 0.0, (640, 3.0), false)?;
    fp8_attention_case(dev, [1, 256, 1024, 2, 1000], 2.0, 0.0, (896, 20.0), false)
}

/// `fp8_attention_matches_cpu` over a long run of keys with flat scores (spread 0.25) and V of
/// mean 0.5 besides its N(0, 1) part, the case where the tensor cores' FP8 accumulation shows: a
/// wgmma adds its e4m3 products to the f32 accumulator keeping ~14 bits relative to the larger
/// (DeepSeek-V3 measured it in FP8 GEMMs), so over 1,024 k-steps a sum of positive terms that
/// grows as it goes loses a large share of its later terms. On an H100 (bench/RESULTS.md,
/// 2026-12-06, fourth session) kernels that kept one accumulator over all keys came out 0.83 from
/// the recipe here (relative RMS of out; 0.92 in LSE); the kernels accumulate a window of 1 to 3
/// blocks in the tensor cores and add it into an f32 O (two-level accumulation), and came within
/// 7.3e-4, 1.2e-3 and 1.7e-3 (windows of 1, 2 and 3; tenth session).
#[test]
fn fp8_attention_matches_cpu_over_long_flat_key_runs() -> Result<()> {
    let Some(dev) = fp8_gpu()? else { return Ok(()) };
    // Flat scores average the quantisation away, so its error is no yardstick here.
    fp8_attention_case(
        dev,
        [1, 128, 32768, 1, 32768],
        0.25,
        0.5,
        (32768, 1.0),
        false,
    )
}

/// The default FP8 launch splits only a sparse last wave: on a call of a few more tiles than the
/// GPU has SMs (one 128-row tile per head, 512 keys), the tiles before the split's first are
/// computed by the same code as in the `_whole` launch, so their out and lse are bit-identical to
/// it, and the split tiles' rows are not (their runs' offsets round P otherwise). A launch that
/// split where `fp8_attention_split` says it does not, or that wrote a merged row over a whole
/// tile, fails here; the split rows' distance to the recipe is `fp8_attention_matches_cpu`'s.
#[test]
fn fp8_attention_split_leaves_whole_tiles_alone() -> Result<()> {
    use ditstream_kernels as k;
    let Some(dev) = fp8_gpu()? else { return Ok(()) };
    let Device::Cuda(ordinal) = dev else {
        unreachable!("fp8_gpu returns a GPU")
    };
    let (sq, kv) = (128, 512);
    let whole = HOPPER_FP8_VARIANTS
        .iter()
        .position(|v| !v.split)
        .expect("a `_whole` variant");
    // The fewest heads past the SM count whose last wave the default launch splits.
    let mut found = None;
    for h in 1..=1024 {
        let split = k::cuda::fp8_attention_split(ordinal, 0, [1, sq, h], kv)?;
        if split.first > 0 && split.ways > 1 {
            found = Some((h, split));
            break;
        }
    }
    let (h, split) = found.expect("some head count splits a partial last wave");
    let q = randn(&[1, sq, h, 128], DType::BF16, 44).to_device(dev)?;
    let kt = randn(&[1, kv, h, 128], DType::BF16, 45).to_device(dev)?;
    let v = randn(&[1, kv, h, 128], DType::BF16, 46).to_device(dev)?;
    let options = AttentionOptions::default();
    let run = |i| {
        with_attention_kernel(AttentionKernel::HopperFp8(i), || {
            k::attention_fp8(&q, &kt, &v, options)
        })
    };
    let ((so, sl), (wo, wl)) = (run(0)?, run(whole)?);
    let host = |t: &Tensor| t.to_device(Device::Cpu)?.to_vec_f32();
    let (so, sl, wo, wl) = (host(&so)?, host(&sl)?, host(&wo)?, host(&wl)?);
    // Tile t is head t here: out [1, 128, h, 128], lse [1, h, 128].
    let rows_of = |o: &[f32], l: &[f32], t: usize| {
        let out: Vec<f32> = (0..sq)
            .flat_map(|r| o[(r * h + t) * 128..][..128].to_vec())
            .collect();
        (out, l[t * sq..][..sq].to_vec())
    };
    let differing = (0..h)
        .filter(|&t| rows_of(&so, &sl, t) != rows_of(&wo, &wl, t))
        .collect::<Vec<_>>();
    println!(
        "PARITY\tattention_fp8 split vs whole launch\t(1,{sq},{kv},{h}) tiles {}.. in {} runs\ttiles differing: {differing:?}",
        split.first, split.ways
    );
    assert!(
        differing.iter().all(|&t| t >= split.first),
        "whole tiles differ between the launches: {differing:?} (split from {})",
        split.first
    );
    assert!(
        !differing.is_empty(),
        "no split tile differs from the whole launch"
    );
    Ok(())
}

/// Every FP8 variant against the recipe at the kernels' softmax step on q [b, sq, h, 128] (N(0, 1)
/// times `spread`), k and v [b, sk, h, 128] (N(0, 1), v plus `v_mean`, the keys from `k_from` on
/// times `k_gain`), kv_len valid keys, with the tolerances of `fp8_attention_matches_cpu` (the
/// distance ≤ a third of the quantisation's own when `below_quantisation`); every variant's
/// distances are printed, all before the first assertion, so that one failing variant does not
/// hide the others' figures.
fn fp8_attention_case(
    dev: Device,
    [b, sq, sk, h, kv_len]: [usize; 5],
    spread: f32,
    v_mean: f32,
    (k_from, k_gain): (usize, f32),
    below_quantisation: bool,
) -> Result<()> {
    use ditstream_kernels as k;
    let q = k::mul(
        &randn(&[b, sq, h, 128], DType::F32, 41),
        &Tensor::from_vec(vec![spread], &[1])?,
    )?
    .to_dtype(DType::BF16)?;
    let mut kv = randn(&[b, sk, h, 128], DType::F32, 42).to_vec_f32()?;
    for (i, x) in kv.iter_mut().enumerate() {
        if (i / (h * 128)) % sk >= k_from {
            *x *= k_gain;
        }
    }
    let kt = Tensor::from_vec(kv, &[b, sk, h, 128])?.to_dtype(DType::BF16)?;
    let v = k::add(
        &randn(&[b, sk, h, 128], DType::F32, 43),
        &Tensor::from_vec(vec![v_mean], &[1])?,
    )?
    .to_dtype(DType::BF16)?;
    let options = AttentionOptions {
        scale: None,
        kv_len: Some(kv_len),
    };
    let (eo, _) = k::attention(&q, &kt, &v, options)?;
    let (gq, gk, gv) = (q.to_device(dev)?, kt.to_device(dev)?, v.to_device(dev)?);
    // Every variant against the recipe at the kernels' softmax step (their K/V block), its keys
    // taken in the runs of the variant's launch (`fp8_attention_split`: the small calls here are
    // all a sparse last wave, split 2–8 ways, except in `_whole` launches).
    let reference =
        |split| k::attention_fp8_reference(&q, &kt, &v, options, HOPPER_FP8_KEYS, split);
    let quant = attention_rel_rms(&reference(k::Fp8KeySplit::NONE)?.0, &eo)?;
    let Device::Cuda(ordinal) = dev else {
        unreachable!("fp8_gpu returns a GPU")
    };
    let mut references: Vec<(k::Fp8KeySplit, (Tensor, Tensor))> = Vec::new();
    let mut measured = Vec::new();
    for (i, variant) in HOPPER_FP8_VARIANTS.iter().enumerate() {
        let split = ditstream_kernels::cuda::fp8_attention_split(ordinal, i, [b, sq, h], kv_len)?;
        let at = match references.iter().position(|(s, _)| *s == split) {
            Some(at) => at,
            None => {
                references.push((split, reference(split)?));
                references.len() - 1
            }
        };
        let (ro, rl) = &references[at].1;
        let split = match split.ways {
            1 => "keys whole".to_string(),
            ways => format!("tiles {}.. in {ways} runs", split.first),
        };
        let (go, gl) = with_attention_kernel(AttentionKernel::HopperFp8(i), || {
            k::attention_fp8(&gq, &gk, &gv, options)
        })?;
        assert_eq!((go.shape(), gl.shape()), (ro.shape(), rl.shape()));
        let (go, gl) = (go.to_device(Device::Cpu)?, gl.to_device(Device::Cpu)?);
        let rms = attention_rel_rms(&go, ro)?;
        let lse = max_abs_diff(&gl, rl)?;
        let (gv, rv) = (gl.to_vec_f32()?, rl.to_vec_f32()?);
        let rows = gv
            .iter()
            .zip(&rv)
            .filter(|(g, r)| g.is_finite() || r.is_finite());
        let (n, sum_sq) = rows.fold((0usize, 0f64), |(n, s), (g, r)| {
            (n + 1, s + f64::from(g - r).powi(2))
        });
        let lse_rms = (sum_sq / n.max(1) as f64).sqrt();
        println!(
            "PARITY\tattention_fp8 {}\t({b},{sq},{sk},{h}) kv {kv_len} v mean {v_mean} {split}\trel rms {rms:.3e} (recipe vs exact {quant:.3e})\tlse max|diff| {lse:.3e} rms {lse_rms:.3e}",
            variant.label(),
        );
        measured.push((variant.label(), rms, lse, lse_rms));
    }
    for (name, rms, lse, lse_rms) in measured {
        assert!(rms <= 1e-2, "{name}: rel rms {rms} against the reference");
        assert!(
            !below_quantisation || 3.0 * rms <= quant,
            "{name}: rel rms {rms}, not well below the quantisation's {quant}"
        );
        let tip = -(1.0 - 2f32.powi(-3)).ln();
        assert!(lse <= tip + 1e-2, "{name}: lse max|diff| {lse}");
        assert!(lse_rms <= 2f64.powi(-6) + 1e-2, "{name}: lse rms {lse_rms}");
    }
    Ok(())
}
