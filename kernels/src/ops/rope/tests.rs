//! RoPE against the direct complex-multiplication formula of wan.md §1.3, evaluated in f64.
//!
//! Tolerance: the tables are f64 angles rounded once to f32 (≤ 2⁻²⁴ ≈ 6e-8 absolute for |cos|, |sin| ≤ 1);
//! each output is two products and a sum of f32 values with |x| ≲ 5 (N(0,1) samples), so the error is
//! ≲ 5·(2·6e-8 + 3·6e-8) ≈ 1.5e-6. We allow atol 3e-6.

use super::*;
use crate::testing::assert_close_slices;

#[test]
fn band_split() -> Result<()> {
    assert_eq!(rope_band_dims(128)?, [44, 42, 42]);
    assert_eq!(rope_band_dims(12)?, [4, 4, 4]);
    assert!(rope_band_dims(7).is_err());
    Ok(())
}

#[test]
fn tables_hold_grid_angles() -> Result<()> {
    let grid = [3, 6, 10];
    let (cos, sin) = rope_tables_3d(grid, 128, 1e4, Device::Cpu)?;
    assert_eq!(cos.shape(), [180, 64]);
    let (cos, sin) = (cos.to_vec_f32()?, sin.to_vec_f32()?);
    // Token (f, h, w) = (2, 5, 7): pair 0 is f·θ⁰ = 2; pair 22 (first of the h band) is h = 5; pair 43
    // (first of the w band) is w = 7; pair 1 is f·θ^(−2/44).
    let row = (2 * 6 + 5) * 10 + 7;
    let at = |k: usize| row * 64 + k;
    assert!((cos[at(0)] - 2.0f32.cos()).abs() < 1e-7);
    assert!((sin[at(22)] - 5.0f32.sin()).abs() < 1e-7);
    assert!((sin[at(43)] - 7.0f32.sin()).abs() < 1e-7);
    let angle_1 = 2.0 * 1e4f64.powf(-2.0 / 44.0);
    assert!((cos[at(1)] as f64 - angle_1.cos()).abs() < 1e-7);
    Ok(())
}

/// wan.md §1.3 restated: φ for token (f, h, w) and pair k, straight from the definition.
fn angle(f: usize, h: usize, w: usize, k: usize, head_dim: usize) -> f64 {
    let d_hw = 2 * (head_dim / 6);
    let d_t = head_dim - 2 * d_hw;
    let omega = |i: usize, d: usize| 1e4f64.powf(-2.0 * i as f64 / d as f64);
    if k < d_t / 2 {
        f as f64 * omega(k, d_t)
    } else if k < d_t / 2 + d_hw / 2 {
        h as f64 * omega(k - d_t / 2, d_hw)
    } else {
        w as f64 * omega(k - d_t / 2 - d_hw / 2, d_hw)
    }
}

#[test]
fn apply_rope_is_complex_multiplication() -> Result<()> {
    for (grid, head_dim) in [([3, 6, 10], 128), ([2, 3, 2], 12)] {
        let (b, heads) = (2, 3);
        let s: usize = grid.iter().product();
        let x = Tensor::randn(&[b, s, heads, head_dim], DType::F32, 41, Device::Cpu)?;
        let (cos, sin) = rope_tables_3d(grid, head_dim, 1e4, Device::Cpu)?;
        let out = apply_rope(&x, &cos, &sin)?.to_vec_f32()?;
        let xv = x.to_vec_f32()?;
        let mut expect = vec![0.0; xv.len()];
        for bi in 0..b {
            for f in 0..grid[0] {
                for h in 0..grid[1] {
                    for w in 0..grid[2] {
                        let token = (f * grid[1] + h) * grid[2] + w;
                        for hd in 0..heads {
                            let base = ((bi * s + token) * heads + hd) * head_dim;
                            for k in 0..head_dim / 2 {
                                let phi = angle(f, h, w, k, head_dim);
                                let (re, im) =
                                    (xv[base + 2 * k] as f64, xv[base + 2 * k + 1] as f64);
                                // (re + i·im)·(cos φ + i·sin φ)
                                expect[base + 2 * k] = (re * phi.cos() - im * phi.sin()) as f32;
                                expect[base + 2 * k + 1] = (re * phi.sin() + im * phi.cos()) as f32;
                            }
                        }
                    }
                }
            }
        }
        assert_close_slices(&out, &expect, 3e-6, 0.0);
    }
    Ok(())
}

#[test]
fn rope_preserves_pair_norms_and_checks_shapes() -> Result<()> {
    let x = Tensor::from_vec(vec![3.0, 4.0], &[1, 1, 1, 2])?;
    let cos = Tensor::from_vec(vec![0.0], &[1, 1])?;
    let sin = Tensor::from_vec(vec![1.0], &[1, 1])?;
    // Rotation by 90°: (3 + 4i)·i = −4 + 3i.
    assert_eq!(apply_rope(&x, &cos, &sin)?.to_vec_f32()?, [-4.0, 3.0]);
    let wrong = Tensor::from_vec(vec![0.0, 0.0], &[2, 1])?;
    assert!(apply_rope(&x, &wrong, &wrong).is_err());
    Ok(())
}
