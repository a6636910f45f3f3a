//! matmul / linear against a naive f64 triple loop.
//!
//! Tolerance: an f32 dot product of K terms has error ≤ γ_K·Σ|a_i b_i| with γ_K ≈ K·2⁻²⁴ (blocked
//! summation does better). With N(0,1) inputs Σ|a_i b_i| ≈ 0.64·K, so for K ≤ 70 the bound is
//! ≈ 70·6e-8·45 ≈ 2e-4; we allow atol 2e-4 (typical errors are ~1e-6).

use super::*;
use crate::testing::assert_close_slices;
use crate::{DType, Device};

fn naive_matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k)
                .map(|p| a[i * k + p] as f64 * b[p * n + j] as f64)
                .sum();
            out[i * n + j] = dot as f32;
        }
    }
    out
}

#[test]
fn matmul_batched_and_shared_b_match_naive() -> Result<()> {
    let (batch, m, k, n) = (3, 5, 7, 9);
    let a = Tensor::randn(&[batch, m, k], DType::F32, 1, Device::Cpu)?;
    let b = Tensor::randn(&[batch, k, n], DType::F32, 2, Device::Cpu)?;
    let b_shared = Tensor::randn(&[k, n], DType::F32, 3, Device::Cpu)?;
    let (av, bv, bs) = (a.to_vec_f32()?, b.to_vec_f32()?, b_shared.to_vec_f32()?);

    let out = matmul(&a, &b)?;
    assert_eq!(out.shape(), [batch, m, n]);
    let shared = matmul(&a, &b_shared)?;
    let (out, shared) = (out.to_vec_f32()?, shared.to_vec_f32()?);
    for i in 0..batch {
        let a_i = &av[i * m * k..(i + 1) * m * k];
        let expect = naive_matmul(a_i, &bv[i * k * n..(i + 1) * k * n], m, k, n);
        assert_close_slices(&out[i * m * n..(i + 1) * m * n], &expect, 2e-4, 0.0);
        let expect = naive_matmul(a_i, &bs, m, k, n);
        assert_close_slices(&shared[i * m * n..(i + 1) * m * n], &expect, 2e-4, 0.0);
    }
    Ok(())
}

#[test]
fn linear_is_x_times_w_transposed_plus_bias() -> Result<()> {
    let (rows, d_in, d_out) = (2 * 11, 67, 13);
    let x = Tensor::randn(&[2, 11, d_in], DType::F32, 4, Device::Cpu)?;
    let w = Tensor::randn(&[d_out, d_in], DType::F32, 5, Device::Cpu)?;
    let bias = Tensor::randn(&[d_out], DType::F32, 6, Device::Cpu)?;
    let (xv, wv, bv) = (x.to_vec_f32()?, w.to_vec_f32()?, bias.to_vec_f32()?);

    let with_bias = linear(&x, &w, Some(&bias))?;
    let without = linear(&x, &w, None)?;
    assert_eq!(with_bias.shape(), [2, 11, d_out]);
    let mut expect = vec![0.0; rows * d_out];
    for r in 0..rows {
        for o in 0..d_out {
            let dot: f64 = (0..d_in)
                .map(|i| xv[r * d_in + i] as f64 * wv[o * d_in + i] as f64)
                .sum();
            expect[r * d_out + o] = dot as f32;
        }
    }
    assert_close_slices(&without.to_vec_f32()?, &expect, 2e-4, 0.0);
    for row in expect.chunks_exact_mut(d_out) {
        for (v, b) in row.iter_mut().zip(&bv) {
            *v += b;
        }
    }
    assert_close_slices(&with_bias.to_vec_f32()?, &expect, 2e-4, 0.0);
    Ok(())
}

#[test]
fn linear_hand_computed_and_bf16_output() -> Result<()> {
    // [[1, 2]] · [[1, 0], [0, 1], [1, 1]]ᵀ + [0.5, 0, -1] = [1.5, 2, 2]
    let x = Tensor::from_vec(vec![1.0, 2.0], &[1, 2])?.to_dtype(DType::BF16)?;
    let w = Tensor::from_vec(vec![1.0, 0.0, 0.0, 1.0, 1.0, 1.0], &[3, 2])?;
    let b = Tensor::from_vec(vec![0.5, 0.0, -1.0], &[3])?;
    let y = linear(&x, &w, Some(&b))?;
    assert_eq!(y.dtype(), DType::BF16);
    assert_eq!(y.to_vec_f32()?, vec![1.5, 2.0, 2.0]);
    Ok(())
}

/// The fused op is the two ops it replaces, exactly in f32 (the activation sees the same f32 sum).
/// In bf16 the fused op rounds once and `gelu_tanh(linear(..))` twice: the first rounding moves
/// the pre-activation y by ≤ ½ ulp(y), which GELU (slope ≤ 1.13) turns into ≤ 0.57 ulp(y), and
/// each output rounding adds ≤ ½ ulp of the output: |fused − unfused| ≤ 0.57 ulp(y) + ulp(out).
#[test]
fn linear_gelu_is_gelu_of_linear() -> Result<()> {
    let x = Tensor::randn(&[3, 5, 40], DType::F32, 7, Device::Cpu)?;
    let w = Tensor::randn(&[24, 40], DType::F32, 8, Device::Cpu)?;
    let b = Tensor::randn(&[24], DType::F32, 9, Device::Cpu)?;
    let fused = linear_gelu_tanh(&x, &w, &b)?;
    let unfused = crate::gelu_tanh(&linear(&x, &w, Some(&b))?)?;
    assert_eq!(fused.shape(), [3, 5, 24]);
    assert_eq!(fused.to_vec_f32()?, unfused.to_vec_f32()?);

    let xb = x.to_dtype(DType::BF16)?;
    let fused = linear_gelu_tanh(&xb, &w, &b)?;
    assert_eq!(fused.dtype(), DType::BF16);
    let unfused = crate::gelu_tanh(&linear(&xb, &w, Some(&b))?)?.to_vec_f32()?;
    let pre = linear(&xb.to_dtype(DType::F32)?, &w, Some(&b))?.to_vec_f32()?;
    let ulp = |v: f32| 2f32.powi(v.abs().max(1e-30).log2().floor() as i32 - 7);
    for ((f, u), y) in fused.to_vec_f32()?.iter().zip(&unfused).zip(&pre) {
        let bound = 0.57 * ulp(*y) + ulp(*u);
        assert!(
            (f - u).abs() <= bound,
            "fused {f} vs unfused {u} (pre-activation {y})"
        );
    }
    let e = linear_gelu_tanh(&x, &w, &Tensor::zeros(&[3], DType::F32, Device::Cpu)?)
        .expect_err("bias of the wrong size");
    assert!(e.to_string().contains("linear_gelu_tanh"), "{e}");
    Ok(())
}

/// residual + (x·Wᵀ + b)·g against an f64 loop over the folded weights, for no gate, a shared gate
/// and a per-sample gate. In f32 the fold's products round in f32 (relative 2⁻²⁴), so the f64 loop
/// over unfolded weights is within the `linear` bound (2e-4) scaled by max|g| (< 4 for these N(0,1)
/// draws) plus the residual's own f32 rounding; in bf16 the fused op must be the f64 sum over the
/// folded bf16 weights (`mul`, which both backends compute alike) rounded once to bf16.
#[test]
fn linear_residual_is_the_gated_sum_over_folded_weights() -> Result<()> {
    let (b, l, d_in, d_out) = (2, 5, 33, 12);
    let x = Tensor::randn(&[b, l, d_in], DType::F32, 10, Device::Cpu)?;
    let w = Tensor::randn(&[d_out, d_in], DType::F32, 11, Device::Cpu)?;
    let bias = Tensor::randn(&[d_out], DType::F32, 12, Device::Cpu)?;
    let r = Tensor::randn(&[b, l, d_out], DType::F32, 13, Device::Cpu)?;
    let per_sample = Tensor::randn(&[b, 1, d_out], DType::F32, 14, Device::Cpu)?;
    let shared = Tensor::randn(&[d_out], DType::F32, 15, Device::Cpu)?;
    let (xv, wv, bv, rv) = (
        x.to_vec_f32()?,
        w.to_vec_f32()?,
        bias.to_vec_f32()?,
        r.to_vec_f32()?,
    );
    // g(sample, o) for each gate case; None = 1.
    let cases: [(Option<&Tensor>, Vec<f32>); 3] = [
        (None, vec![1.0; b * d_out]),
        (
            Some(&shared),
            [shared.to_vec_f32()?, shared.to_vec_f32()?].concat(),
        ),
        (Some(&per_sample), per_sample.to_vec_f32()?),
    ];
    for (gate, gv) in &cases {
        let out = linear_residual(&x, &w, Some(&bias), &r, *gate)?;
        assert_eq!(out.shape(), [b, l, d_out]);
        let mut expect = vec![0.0; b * l * d_out];
        for s in 0..b {
            for t in 0..l {
                let row = s * l + t;
                for o in 0..d_out {
                    let dot: f64 = (0..d_in)
                        .map(|i| xv[row * d_in + i] as f64 * wv[o * d_in + i] as f64)
                        .sum();
                    let g = gv[s * d_out + o] as f64;
                    expect[row * d_out + o] =
                        (rv[row * d_out + o] as f64 + (dot + bv[o] as f64) * g) as f32;
                }
            }
        }
        assert_close_slices(&out.to_vec_f32()?, &expect, 8e-4, 1e-6);
    }

    // bf16: exactly the folded weights' sum, rounded once.
    let (xb, wb, bb, rb) = (
        x.to_dtype(DType::BF16)?,
        w.to_dtype(DType::BF16)?,
        bias.to_dtype(DType::BF16)?,
        r.to_dtype(DType::BF16)?,
    );
    let out = linear_residual(&xb, &wb, Some(&bb), &rb, Some(&per_sample))?;
    assert_eq!(out.dtype(), DType::BF16);
    let g = per_sample.reshape(&[b, d_out])?;
    let wf = crate::mul(&wb, &g.reshape(&[b, d_out, 1])?)?.to_vec_f32()?;
    let bf = crate::mul(&bb, &g)?.to_vec_f32()?;
    let (xv, rv) = (xb.to_vec_f32()?, rb.to_vec_f32()?);
    let out = out.to_vec_f32()?;
    for s in 0..b {
        for t in 0..l {
            let row = s * l + t;
            for o in 0..d_out {
                let wrow = &wf[(s * d_out + o) * d_in..(s * d_out + o + 1) * d_in];
                let dot: f64 = (0..d_in)
                    .map(|i| xv[row * d_in + i] as f64 * wrow[i] as f64)
                    .sum();
                let exact = rv[row * d_out + o] as f64 + bf[s * d_out + o] as f64 + dot;
                let expect = half::bf16::from_f64(exact).to_f32();
                let got = out[row * d_out + o];
                // The f32 accumulation may land the sum on the other side of a rounding tie: one ulp.
                let ulp = 2f32.powi(expect.abs().max(1e-30).log2().floor() as i32 - 7);
                assert!(
                    (got - expect).abs() <= ulp,
                    "{got} vs {expect} at row {row}, out {o}"
                );
            }
        }
    }

    // A per-token gate is refused with the shapes named.
    let per_token = Tensor::randn(&[b, l, d_out], DType::F32, 16, Device::Cpu)?;
    let err = linear_residual(&x, &w, Some(&bias), &r, Some(&per_token)).expect_err("per token");
    assert!(
        err.to_string().contains("linear_residual") && err.to_string().contains("[2, 5, 12]"),
        "{err}"
    );
    Ok(())
}

#[test]
fn shape_errors_name_the_shapes() {
    let x = Tensor::zeros(&[2, 3], DType::F32, Device::Cpu).expect("zeros");
    let w = Tensor::zeros(&[4, 5], DType::F32, Device::Cpu).expect("zeros");
    let err = linear(&x, &w, None).expect_err("in-dims differ");
    assert!(err.to_string().contains("[2, 3]") && err.to_string().contains("[4, 5]"));
    assert!(matmul(&x, &w).is_err());
}
