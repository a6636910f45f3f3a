//! Elementwise ops against hand-computed values and per-element formulas.
//!
//! Tolerances: each output is one or two f32 roundings of the same formula evaluated in f64, so the
//! relative error is ≤ a few ulp (2⁻²⁴ ≈ 6e-8 each); activation formulas add exp/tanh errors of a
//! few ulp. We allow atol 1e-6 + rtol 1e-6 for values of order 1.

use super::*;
use crate::testing::{assert_close, assert_close_slices};
use crate::{DType, Device};

fn t(data: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(data.to_vec(), shape).expect("test tensor")
}

#[test]
fn broadcasting_binary_ops() -> Result<()> {
    let a = t(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let row = t(&[10.0, 20.0, 30.0], &[3]);
    let col = t(&[1.0, -1.0], &[2, 1]);
    assert_eq!(add(&a, &row)?.to_vec_f32()?, [11., 22., 33., 14., 25., 36.]);
    assert_eq!(sub(&a, &col)?.to_vec_f32()?, [0., 1., 2., 5., 6., 7.]);
    assert_eq!(mul(&a, &col)?.to_vec_f32()?, [1., 2., 3., -4., -5., -6.]);
    // Both sides stretch: [2, 1] × [3] → [2, 3].
    let outer = mul(&col, &row)?;
    assert_eq!(outer.shape(), [2, 3]);
    assert_eq!(outer.to_vec_f32()?, [10., 20., 30., -10., -20., -30.]);
    assert!(add(&a, &t(&[1.0, 2.0], &[2])).is_err());
    Ok(())
}

#[test]
fn scalar_ops_and_clamp() -> Result<()> {
    let x = t(&[-2.0, -0.5, 0.0, 0.5, 2.0], &[5]);
    assert_eq!(affine(&x, 2.0, 1.0)?.to_vec_f32()?, [-3., 0., 1., 2., 5.]);
    assert_eq!(scale(&x, -1.0)?.to_vec_f32()?, [2., 0.5, -0.0, -0.5, -2.]);
    assert_eq!(
        clamp(&x, -1.0, 1.0)?.to_vec_f32()?,
        [-1., -0.5, 0., 0.5, 1.]
    );
    assert!(clamp(&x, 1.0, -1.0).is_err());
    Ok(())
}

#[test]
fn activations_match_formulas() -> Result<()> {
    let values: Vec<f32> = (-40..=40).map(|i| i as f32 * 0.2).collect();
    let x = t(&values, &[values.len()]);
    let silu_expect: Vec<f32> = values
        .iter()
        .map(|&v| (v as f64 / (1.0 + (-(v as f64)).exp())) as f32)
        .collect();
    assert_close_slices(&silu(&x)?.to_vec_f32()?, &silu_expect, 1e-6, 1e-6);
    let gelu_expect: Vec<f32> = values
        .iter()
        .map(|&v| {
            let v = v as f64;
            let inner = (2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3));
            (0.5 * v * (1.0 + inner.tanh())) as f32
        })
        .collect();
    assert_close_slices(&gelu_tanh(&x)?.to_vec_f32()?, &gelu_expect, 1e-6, 1e-6);
    // Hand values: silu(0) = 0, gelu(0) = 0; gelu_tanh(1) = 0.5·(1 + tanh(0.7978846·1.044715)) ≈ 0.841192.
    assert_eq!(silu(&t(&[0.0], &[1]))?.to_vec_f32()?, [0.0]);
    assert_close_slices(
        &gelu_tanh(&t(&[1.0], &[1]))?.to_vec_f32()?,
        &[0.841_192],
        1e-6,
        0.0,
    );
    Ok(())
}

#[test]
fn modulate_broadcasts_per_batch_params() -> Result<()> {
    let (b, l, d) = (2, 3, 4);
    let x = Tensor::randn(&[b, l, d], DType::F32, 1, Device::Cpu)?;
    let shift = Tensor::randn(&[b, 1, d], DType::F32, 2, Device::Cpu)?;
    let scale_t = Tensor::randn(&[b, 1, d], DType::F32, 3, Device::Cpu)?;
    let out = modulate(&x, &shift, &scale_t)?;
    let (xv, sh, sc) = (x.to_vec_f32()?, shift.to_vec_f32()?, scale_t.to_vec_f32()?);
    let mut expect = vec![0.0; b * l * d];
    for bi in 0..b {
        for li in 0..l {
            for di in 0..d {
                let i = (bi * l + li) * d + di;
                expect[i] = xv[i] * (1.0 + sc[bi * d + di]) + sh[bi * d + di];
            }
        }
    }
    assert_close(&out, &Tensor::from_vec(expect, &[b, l, d])?, 1e-6, 1e-6);
    // bf16 x keeps its dtype; f32 params are allowed.
    let out_bf16 = modulate(&x.to_dtype(DType::BF16)?, &shift, &scale_t)?;
    assert_eq!(out_bf16.dtype(), DType::BF16);
    assert!(
        modulate(
            &x,
            &Tensor::zeros(&[b, 2, d], DType::F32, Device::Cpu)?,
            &scale_t
        )
        .is_err()
    );
    Ok(())
}

#[test]
fn gated_residual_hand_case() -> Result<()> {
    let x = t(&[1.0, 2.0, 3.0, 4.0], &[1, 2, 2]);
    let y = t(&[10.0, 10.0, 10.0, 10.0], &[1, 2, 2]);
    let gate = t(&[0.5, -1.0], &[1, 1, 2]);
    assert_eq!(
        gated_residual(&x, &y, &gate)?.to_vec_f32()?,
        [6., -8., 8., -6.]
    );
    assert!(gated_residual(&x, &t(&[1.0], &[1]), &gate).is_err());
    Ok(())
}
