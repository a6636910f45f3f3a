//! Norms against f64 formulas and hand-computed cases.
//!
//! Tolerance: each output is a handful of f32 operations on a mean over ≤ 64 values; the sums carry
//! ≤ D·2⁻²⁴ relative error (≈ 4e-6 for D = 64) and the outputs are O(1–4) for N(0,1) inputs, so
//! atol 2e-5 + rtol 1e-5 covers them with margin.

use super::*;
use crate::testing::assert_close_slices;
use crate::{DType, Device};

#[test]
fn layer_norm_hand_case() -> Result<()> {
    // Row [1, 2, 3, 4]: mean 2.5, biased var 1.25 → (x − 2.5)/sqrt(1.25) = [−1.3416, −0.4472, 0.4472, 1.3416].
    let x = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[1, 4])?;
    let plain = layer_norm(&x, None, None, 0.0)?;
    let s = 1.25f32.sqrt();
    let expect = [-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s];
    assert_close_slices(&plain.to_vec_f32()?, &expect, 1e-6, 1e-6);
    let w = Tensor::from_vec(vec![2.0, 2.0, 2.0, 2.0], &[4])?;
    let b = Tensor::from_vec(vec![1.0, 1.0, 1.0, 1.0], &[4])?;
    let affine = layer_norm(&x, Some(&w), Some(&b), 0.0)?;
    let expect: Vec<f32> = expect.iter().map(|v| 2.0 * v + 1.0).collect();
    assert_close_slices(&affine.to_vec_f32()?, &expect, 1e-6, 1e-6);
    Ok(())
}

#[test]
fn layer_norm_random_against_f64() -> Result<()> {
    let (rows, d, eps) = (7, 64, 1e-6);
    let x = Tensor::randn(&[rows, d], DType::F32, 11, Device::Cpu)?;
    let w = Tensor::randn(&[d], DType::F32, 12, Device::Cpu)?;
    let b = Tensor::randn(&[d], DType::F32, 13, Device::Cpu)?;
    let (xv, wv, bv) = (x.to_vec_f32()?, w.to_vec_f32()?, b.to_vec_f32()?);
    let mut expect = Vec::new();
    for row in xv.chunks(d) {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / d as f64;
        for (i, &v) in row.iter().enumerate() {
            let n = (v as f64 - mean) / (var + eps as f64).sqrt();
            expect.push((n * wv[i] as f64 + bv[i] as f64) as f32);
        }
    }
    let out = layer_norm(&x, Some(&w), Some(&b), eps)?;
    assert_close_slices(&out.to_vec_f32()?, &expect, 2e-5, 1e-5);
    assert!(layer_norm(&x, Some(&b.narrow(0, 0, 3)?), None, eps).is_err());
    Ok(())
}

#[test]
fn rms_norm_against_f64_and_hand_case() -> Result<()> {
    // [3, 4]: mean(x²) = 12.5 → x / sqrt(12.5) · [1, 2].
    let x = Tensor::from_vec(vec![3.0, 4.0], &[1, 2])?;
    let w = Tensor::from_vec(vec![1.0, 2.0], &[2])?;
    let r = 12.5f32.sqrt();
    assert_close_slices(
        &rms_norm(&x, &w, 0.0)?.to_vec_f32()?,
        &[3.0 / r, 8.0 / r],
        1e-6,
        1e-6,
    );

    let (rows, d, eps) = (5, 48, 1e-6);
    let x = Tensor::randn(&[rows, d], DType::F32, 21, Device::Cpu)?;
    let w = Tensor::randn(&[d], DType::F32, 22, Device::Cpu)?;
    let (xv, wv) = (x.to_vec_f32()?, w.to_vec_f32()?);
    let mut expect = Vec::new();
    for row in xv.chunks(d) {
        let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
        for (i, &v) in row.iter().enumerate() {
            expect.push((v as f64 / (ms + eps as f64).sqrt() * wv[i] as f64) as f32);
        }
    }
    assert_close_slices(&rms_norm(&x, &w, eps)?.to_vec_f32()?, &expect, 2e-5, 1e-5);
    Ok(())
}

#[test]
fn rms_norm_channels_normalises_over_dim_1() -> Result<()> {
    // [B, C, T, H, W] = [2, 3, 2, 2, 3]; gamma in checkpoint shape [C, 1, 1, 1].
    let shape = [2, 3, 2, 2, 3];
    let (b, c, p) = (2, 3, 12);
    let x = Tensor::randn(&shape, DType::F32, 31, Device::Cpu)?;
    let gamma = Tensor::randn(&[c, 1, 1, 1], DType::F32, 32, Device::Cpu)?;
    let bias = Tensor::randn(&[c], DType::F32, 33, Device::Cpu)?;
    let (xv, gv, bv) = (x.to_vec_f32()?, gamma.to_vec_f32()?, bias.to_vec_f32()?);
    let mut expect = vec![0.0; xv.len()];
    for bi in 0..b {
        for pi in 0..p {
            let at = |ci: usize| (bi * c + ci) * p + pi;
            let norm = (0..c)
                .map(|ci| (xv[at(ci)] as f64).powi(2))
                .sum::<f64>()
                .sqrt();
            for ci in 0..c {
                let y = xv[at(ci)] as f64 / norm.max(1e-12) * (c as f64).sqrt() * gv[ci] as f64;
                expect[at(ci)] = (y + bv[ci] as f64) as f32;
            }
        }
    }
    let out = rms_norm_channels(&x, &gamma, Some(&bias))?;
    assert_eq!(out.shape(), shape);
    assert_close_slices(&out.to_vec_f32()?, &expect, 2e-5, 1e-5);

    // One channel (the diffusers test VAE's 1-channel layers): y = sign(x)·gamma; zero stays zero.
    let x1 = Tensor::from_vec(vec![-2.0, 0.0, 0.5], &[1, 1, 3])?;
    let g1 = Tensor::from_vec(vec![3.0], &[1, 1])?;
    assert_eq!(
        rms_norm_channels(&x1, &g1, None)?.to_vec_f32()?,
        [-3.0, 0.0, 3.0]
    );
    Ok(())
}

/// The fused channel norm + SiLU is bit-identical to the two ops it replaces, in f32 and in bf16
/// (where the norm is rounded to bf16 before the SiLU, as the unfused norm stores it), with and
/// without bias; and it rejects what the norm rejects.
#[test]
fn rms_norm_channels_silu_equals_norm_then_silu() -> Result<()> {
    for dtype in [DType::F32, DType::BF16] {
        let x = Tensor::randn(&[2, 5, 3, 2, 3], dtype, 41, Device::Cpu)?;
        let gamma = Tensor::randn(&[5, 1, 1, 1], dtype, 42, Device::Cpu)?;
        let bias = Tensor::randn(&[5], DType::F32, 43, Device::Cpu)?;
        for b in [None, Some(&bias)] {
            let fused = rms_norm_channels_silu(&x, &gamma, b)?;
            let composed = crate::silu(&rms_norm_channels(&x, &gamma, b)?)?;
            assert_eq!(fused.dtype(), dtype);
            assert_eq!(fused.shape(), x.shape());
            assert_eq!(
                fused.to_vec_f32()?,
                composed.to_vec_f32()?,
                "{dtype:?}, bias {}",
                b.is_some()
            );
        }
    }
    let x = Tensor::randn(&[2, 5, 3], DType::F32, 44, Device::Cpu)?;
    let short = Tensor::randn(&[4], DType::F32, 45, Device::Cpu)?;
    assert!(rms_norm_channels_silu(&x, &short, None).is_err());
    assert!(rms_norm_channels_silu(&x.reshape(&[30])?, &short, None).is_err());
    Ok(())
}

/// The fused norm-modulate equals LN then modulate (the composition it replaces) for per-sample
/// and per-token modulation, and against an f64 formula; bf16 output is the f32 result rounded once.
#[test]
fn layer_norm_modulate_matches_the_composition_and_f64() -> Result<()> {
    let (b, l, d, eps) = (2, 5, 64, 1e-6);
    let x = Tensor::randn(&[b, l, d], DType::F32, 21, Device::Cpu)?;
    for (what, mod_shape) in [("per sample", vec![b, 1, d]), ("per token", vec![b, l, d])] {
        let shift = Tensor::randn(&mod_shape, DType::F32, 22, Device::Cpu)?;
        let scale = Tensor::randn(&mod_shape, DType::F32, 23, Device::Cpu)?;
        let fused = layer_norm_modulate(&x, &shift, &scale, eps, DType::F32)?;
        let composed = crate::modulate(&layer_norm(&x, None, None, eps)?, &shift, &scale)?;
        assert_eq!(fused.to_vec_f32()?, composed.to_vec_f32()?, "{what}");

        let (xv, sh, sc) = (x.to_vec_f32()?, shift.to_vec_f32()?, scale.to_vec_f32()?);
        let per = if mod_shape[1] == 1 { l } else { 1 };
        let mut expect = Vec::new();
        for (r, row) in xv.chunks(d).enumerate() {
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / d as f64;
            let m = (r / per) * d;
            for (i, &v) in row.iter().enumerate() {
                let n = (v as f64 - mean) / (var + eps as f64).sqrt();
                expect.push((n * (1.0 + sc[m + i] as f64) + sh[m + i] as f64) as f32);
            }
        }
        assert_close_slices(&fused.to_vec_f32()?, &expect, 2e-5, 1e-5);

        let bf = layer_norm_modulate(&x.to_dtype(DType::BF16)?, &shift, &scale, eps, DType::BF16)?;
        assert_eq!(bf.dtype(), DType::BF16);
        let want = layer_norm_modulate(&x.to_dtype(DType::BF16)?, &shift, &scale, eps, DType::F32)?
            .to_dtype(DType::BF16)?;
        assert_eq!(bf.to_vec_f32()?, want.to_vec_f32()?, "{what}: one rounding");
    }
    Ok(())
}

#[test]
fn layer_norm_modulate_refuses_other_broadcasts() -> Result<()> {
    let x = Tensor::zeros(&[2, 3, 8], DType::F32, Device::Cpu)?;
    let ok = Tensor::zeros(&[2, 1, 8], DType::F32, Device::Cpu)?;
    // [1, 3, 8] broadcasts over the batch but keeps the token dim: not a kept prefix.
    let over_batch = Tensor::zeros(&[1, 3, 8], DType::F32, Device::Cpu)?;
    let e = layer_norm_modulate(&x, &over_batch, &over_batch, 1e-6, DType::F32)
        .unwrap_err()
        .to_string();
    assert!(e.contains("prefix of x's leading dims"), "{e}");
    let e = layer_norm_modulate(&x, &ok, &over_batch, 1e-6, DType::F32)
        .unwrap_err()
        .to_string();
    assert!(e.contains("same shape"), "{e}");
    let bf = ok.to_dtype(DType::BF16)?;
    let e = layer_norm_modulate(&x, &bf, &bf, 1e-6, DType::F32)
        .unwrap_err()
        .to_string();
    assert!(e.contains("f32"), "{e}");
    // [8] alone (one row for all) is fine.
    let one = Tensor::zeros(&[8], DType::F32, Device::Cpu)?;
    layer_norm_modulate(&x, &one, &one, 1e-6, DType::F32)?;
    Ok(())
}

/// The fused q/k op is `apply_rope(rms_norm(x))` split into heads (on the CPU, bit for bit: it is that
/// composition, the norm rounded to x's dtype in between), and bad shapes name the rule.
#[test]
fn rms_norm_rope_is_the_two_ops_and_checks_its_shapes() -> Result<()> {
    let (b, s, heads, hd) = (2, 6, 3, 12);
    let (cos, sin) = crate::rope_tables_3d([1, 2, 3], hd, 1e4, Device::Cpu)?;
    let w = Tensor::randn(&[heads * hd], DType::F32, 31, Device::Cpu)?;
    for dtype in [DType::F32, DType::BF16] {
        let x = Tensor::randn(&[b, s, heads * hd], dtype, 30, Device::Cpu)?;
        let fused = rms_norm_rope(&x, &w, 1e-6, &cos, &sin, heads)?;
        assert_eq!(fused.shape(), [b, s, heads, hd]);
        assert_eq!(fused.dtype(), dtype);
        let normed = rms_norm(&x, &w, 1e-6)?.reshape(&[b, s, heads, hd])?;
        let unfused = crate::apply_rope(&normed, &cos, &sin)?;
        assert_eq!(fused.to_vec_f32()?, unfused.to_vec_f32()?);
    }
    let x = Tensor::zeros(&[b, s, heads * hd], DType::F32, Device::Cpu)?;
    let e = rms_norm_rope(&x, &w, 1e-6, &cos, &sin, 5)
        .unwrap_err()
        .to_string();
    assert!(e.contains("H = 5") && e.contains("[2, 6, 36]"), "{e}");
    let short = cos.narrow(0, 0, 4)?;
    let e = rms_norm_rope(&x, &w, 1e-6, &short, &sin, heads)
        .unwrap_err()
        .to_string();
    assert!(e.contains("[S, hd/2]") && e.contains("[4, 6]"), "{e}");
    Ok(())
}
