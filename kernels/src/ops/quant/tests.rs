use super::*;
use crate::Tensor;

/// Every finite e4m3 value, from its bit pattern (sign, 4 exponent bits with bias 7, 3 mantissa
/// bits; exponent 15 with mantissa 7 is NaN): the format's definition, independent of `e4m3`.
fn all_e4m3() -> Vec<f32> {
    let mut v = Vec::new();
    for bits in 0u8..=0x7f {
        let (e, m) = (i32::from(bits >> 3), f32::from(bits & 7));
        if e == 15 && m == 7.0 {
            continue;
        }
        let mag = if e == 0 {
            m / 8.0 * 2f32.powi(-6)
        } else {
            (1.0 + m / 8.0) * 2f32.powi(e - 7)
        };
        v.push(mag);
        v.push(-mag);
    }
    v.sort_by(f32::total_cmp);
    v.dedup(); // +0 and -0 compare equal
    v
}

/// The codes' values (unscaled) and the scales of a quantised tensor, on the host.
fn values_and_scales(t: &Fp8Tensor) -> crate::Result<(Vec<f32>, Vec<f32>)> {
    let values = t.codes()?.into_iter().map(e4m3_value).collect();
    Ok((values, t.scales().to_vec_f32()?))
}

/// Codes are the format's bit patterns: every code's value is the definition's (`all_e4m3` is
/// built from the bits too, but independently of `e4m3_value`), and quantising a value gives back
/// its code (both zeros and NaN aside).
#[test]
fn codes_are_the_formats_bit_patterns() {
    for code in 0u8..=255 {
        let v = e4m3_value(code);
        if code & 0x7f == 0x7f {
            assert!(v.is_nan(), "{code:#x} is NaN");
            continue;
        }
        assert_eq!(cpu::e4m3_code(v), code, "{v} ({code:#x})");
        let (e, m) = (i32::from((code >> 3) & 0xf), f32::from(code & 7));
        let mag = if e == 0 {
            m * 2f32.powi(-9)
        } else {
            (8.0 + m) * 2f32.powi(e - 10)
        };
        assert_eq!(v.abs(), mag, "{code:#x}");
        assert_eq!(v.is_sign_negative(), code & 0x80 != 0, "{code:#x}");
    }
    assert_eq!(cpu::e4m3_code(f32::NAN), 0x7f);
    assert_eq!(cpu::e4m3_code(1e9), 0x7e); // saturated to 448
}

#[test]
fn e4m3_keeps_its_values_rounds_ties_to_even_and_saturates() {
    let grid = all_e4m3();
    assert_eq!(grid.len(), 253); // 126 magnitudes > 0 per sign, and zero
    assert_eq!(*grid.last().unwrap(), E4M3_MAX);
    for &v in &grid {
        assert_eq!(e4m3(v), v, "{v} is an e4m3 value");
    }
    // Between neighbours: just below the midpoint rounds down, just above up, the midpoint itself
    // to the neighbour with an even mantissa (every other grid point, counting from zero).
    let positive: Vec<f32> = grid.iter().copied().filter(|v| *v >= 0.0).collect();
    for (i, pair) in positive.windows(2).enumerate() {
        let (lo, hi) = (pair[0], pair[1]);
        let mid = 0.5 * (lo + hi);
        assert_eq!(e4m3(f32::from_bits(mid.to_bits() - 1)), lo, "below {mid}");
        assert_eq!(e4m3(f32::from_bits(mid.to_bits() + 1)), hi, "above {mid}");
        let even = if i % 2 == 0 { lo } else { hi };
        assert_eq!(e4m3(mid), even, "the tie at {mid}");
        assert_eq!(e4m3(-mid), -even, "the tie at -{mid}");
    }
    for v in [448.5, 464.0, 1e6, f32::INFINITY] {
        assert_eq!(e4m3(v), E4M3_MAX);
        assert_eq!(e4m3(-v), -E4M3_MAX);
    }
    assert!(e4m3(f32::NAN).is_nan());
    // Below half the smallest subnormal (2⁻¹⁰), zero with the sign kept; f32 subnormals too.
    for v in [2f32.powi(-11), 1e-30, f32::from_bits(1)] {
        assert_eq!(e4m3(v).to_bits(), 0f32.to_bits());
        assert_eq!(e4m3(-v).to_bits(), (-0f32).to_bits());
    }
}

#[test]
fn rows_are_quantised_to_their_own_range_within_the_formats_error() -> crate::Result<()> {
    let mut x = Tensor::randn(&[3, 4, 96], DType::F32, 5, Device::Cpu)?.to_vec_f32()?;
    // Rows of very different magnitudes, and an all-zero row.
    for (i, v) in x.iter_mut().enumerate() {
        *v *= [1e-3f32, 1.0, 250.0][i / 96 % 3];
    }
    x[96 * 5..96 * 6].fill(0.0);
    let t = Tensor::from_vec(x.clone(), &[3, 4, 96])?;
    let fp8 = Fp8Tensor::quantize(&t)?;
    assert_eq!(fp8.shape(), [3, 4, 96]);
    assert_eq!(fp8.scales().shape(), [3, 4]);
    let (q, s) = values_and_scales(&fp8)?;
    let grid = all_e4m3();
    for (r, (xr, qr)) in x.chunks(96).zip(q.chunks(96)).enumerate() {
        let amax = xr.iter().fold(0f32, |m, v| m.max(v.abs()));
        if amax == 0.0 {
            assert_eq!(s[r], 1.0);
            assert!(qr.iter().all(|v| *v == 0.0));
            continue;
        }
        assert_eq!(s[r], amax / E4M3_MAX);
        // The row's largest magnitude lands on ±448; every value is on the grid; the error is the
        // format's: 2⁻⁴ relative (half a step of 3 mantissa bits) in the normal range, 2⁻¹⁰
        // (half the subnormal step) times the scale below it.
        assert!(qr.iter().any(|v| v.abs() == E4M3_MAX));
        for (&xv, &qv) in xr.iter().zip(qr) {
            assert!(grid.binary_search_by(|g| g.total_cmp(&qv)).is_ok() || qv == 0.0);
            let err = (xv - qv * s[r]).abs();
            let bound = (2f32.powi(-4) * xv.abs()).max(2f32.powi(-10) * s[r]) * (1.0 + 1e-6);
            assert!(
                err <= bound,
                "row {r}: {xv} -> {qv} × {}: error {err} > {bound}",
                s[r]
            );
        }
    }
    Ok(())
}

#[test]
fn the_fp8_linear_is_the_scaled_sum_of_e4m3_products() -> crate::Result<()> {
    let (rows, k, out) = (5, 64, 7);
    let x = Tensor::randn(&[1, rows, k], DType::F32, 8, Device::Cpu)?;
    let w = Tensor::randn(&[out, k], DType::F32, 9, Device::Cpu)?;
    let b = Tensor::randn(&[out], DType::F32, 10, Device::Cpu)?;
    let y = linear_fp8(&x, &Fp8Tensor::quantize(&w)?, Some(&b))?;
    assert_eq!(y.shape(), [1, rows, out]);
    let (qx, sx) = values_and_scales(&Fp8Tensor::quantize(&x)?)?;
    let (qw, sw) = values_and_scales(&Fp8Tensor::quantize(&w)?)?;
    let (xv, wv, bv, yv) = (
        x.to_vec_f32()?,
        w.to_vec_f32()?,
        b.to_vec_f32()?,
        y.to_vec_f32()?,
    );
    let mut worst_rel = 0f64;
    for r in 0..rows {
        for o in 0..out {
            let (xr, wr) = (&xv[r * k..][..k], &wv[o * k..][..k]);
            let (qxr, qwr) = (&qx[r * k..][..k], &qw[o * k..][..k]);
            // Term for term: the e4m3 products in f64, scaled, plus the bias. The f32 sum of k
            // exact products (e4m3 × e4m3 has 8 significant bits) rounds k times: ≤ k·2⁻²⁴·Σ|·|.
            let q_dot: f64 = qxr.iter().zip(qwr).map(|(a, c)| f64::from(a * c)).sum();
            let q_abs: f64 = qxr
                .iter()
                .zip(qwr)
                .map(|(a, c)| f64::from((a * c).abs()))
                .sum();
            let s = f64::from(sx[r] * sw[o]);
            let expect = q_dot * s + f64::from(bv[o]);
            let got = f64::from(yv[r * out + o]);
            let sum_bound =
                (k as f64 + 2.0) * 2f64.powi(-24) * (q_abs * s + f64::from(bv[o].abs()));
            assert!(
                (got - expect).abs() <= sum_bound,
                "({r}, {o}): {got} vs {expect}"
            );
            // Against the exact linear: each operand is off by ≤ u = 2⁻⁴ relative (or 2⁻¹⁰ of
            // its row's scale), so each product by ≤ (2u + u²)|x||w| plus the subnormal terms.
            let u = 2f64.powi(-4);
            let (sxr, swo) = (f64::from(sx[r]), f64::from(sw[o]));
            let exact: f64 = xr
                .iter()
                .zip(wr)
                .map(|(a, c)| f64::from(*a) * f64::from(*c))
                .sum();
            let bound: f64 = xr
                .iter()
                .zip(wr)
                .map(|(a, c)| {
                    let (a, c) = (f64::from(a.abs()), f64::from(c.abs()));
                    (2.0 * u + u * u) * a * c
                        + 2f64.powi(-10) * (1.0 + u) * (a * swo + c * sxr)
                        + 2f64.powi(-20) * sxr * swo
                })
                .sum::<f64>()
                + sum_bound;
            let err = (got - exact - f64::from(bv[o])).abs();
            assert!(err <= bound, "({r}, {o}): error {err} > {bound}");
            worst_rel = worst_rel.max(err / exact.abs().max(1.0));
        }
    }
    // Quantisation did happen: FP8 errors are far above bf16's (~2⁻⁸ relative on these sums).
    assert!(worst_rel > 1e-3, "worst relative error {worst_rel}");
    Ok(())
}

#[test]
fn bad_shapes_are_refused() -> crate::Result<()> {
    let x = Tensor::randn(&[2, 8], DType::F32, 1, Device::Cpu)?;
    let w = Tensor::randn(&[3, 9], DType::F32, 2, Device::Cpu)?;
    let err = linear_fp8(&x, &Fp8Tensor::quantize(&w)?, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("w [out, in]"), "{err}");
    let w = Fp8Tensor::quantize(&Tensor::randn(&[3, 8], DType::F32, 2, Device::Cpu)?)?;
    let b = Tensor::randn(&[4], DType::F32, 3, Device::Cpu)?;
    assert!(linear_fp8(&x, &w, Some(&b)).is_err());
    let residual = Tensor::zeros(&[2, 4], DType::F32, Device::Cpu)?;
    assert!(linear_fp8_residual(&x, &w, None, &residual, None).is_err());
    let empty = Tensor::from_vec(Vec::new(), &[2, 0])?;
    assert!(Fp8Tensor::quantize(&empty).is_err());
    Ok(())
}

/// The gated residual form is the plain FP8 linear, gated, plus the residual: the gate folded
/// into the scales and the bias changes nothing but roundings of f32 sums and of the bias (here
/// f32: none), so the two agree to f32 precision; a per-sample gate uses each sample's row.
#[test]
fn the_gated_residual_is_the_gated_linear_plus_the_residual() -> crate::Result<()> {
    let (b, l, k, out) = (2, 3, 32, 16);
    let x = Tensor::randn(&[b, l, k], DType::F32, 11, Device::Cpu)?;
    let w = Fp8Tensor::quantize(&Tensor::randn(&[out, k], DType::F32, 12, Device::Cpu)?)?;
    let bias = Tensor::randn(&[out], DType::F32, 13, Device::Cpu)?;
    let residual = Tensor::randn(&[b, l, out], DType::F32, 14, Device::Cpu)?;
    let gate = Tensor::randn(&[b, 1, out], DType::F32, 15, Device::Cpu)?;
    let got = linear_fp8_residual(&x, &w, Some(&bias), &residual, Some(&gate))?;
    let y = linear_fp8(&x, &w, Some(&bias))?;
    let expect = crate::add(&residual, &crate::mul(&y, &gate)?)?;
    let (got, expect) = (got.to_vec_f32()?, expect.to_vec_f32()?);
    for (i, (g, e)) in got.iter().zip(&expect).enumerate() {
        assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "{i}: {g} vs {e}");
    }
    // No gate: residual + y exactly as summed.
    let plain = linear_fp8_residual(&x, &w, Some(&bias), &residual, None)?.to_vec_f32()?;
    let sum = crate::add(&residual, &y)?.to_vec_f32()?;
    for (p, s) in plain.iter().zip(&sum) {
        assert!((p - s).abs() <= 1e-4 * (1.0 + s.abs()));
    }
    Ok(())
}
