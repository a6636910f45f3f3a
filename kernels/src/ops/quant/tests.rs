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
    let y = linear_fp8(
        &Fp8Tensor::quantize(&x)?,
        &Fp8Tensor::quantize(&w)?,
        Some(&b),
    )?;
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
    let x = Fp8Tensor::quantize(&x)?;
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
    let x = Fp8Tensor::quantize(&Tensor::randn(&[b, l, k], DType::F32, 11, Device::Cpu)?)?;
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

/// FP8 attention against exact attention on the same inputs, term by term.
///
/// P's rounding: each p·448 is off by ≤ u relative (≥ 2⁻⁶) or 2⁻¹⁰ absolute, u = 2⁻⁴ (round to
/// nearest, 3 mantissa bits), so each weight p_j (relative to the final max, which only scales
/// these down) is off by e_j, |e_j| ≤ dp_j = u·p_j + 2⁻¹⁰/448; V's by ε_j, |ε_j| ≤ u|v_j| +
/// 2⁻¹⁰·s_v[d].
///
/// LSE: log-sum-exp is 1-Lipschitz in the max norm, so the scores alone move it by at most
/// maxⱼ |ΔS_ij|, where S moves only by Q's and K's quantisation: |ΔS_ij| ≤ scale·Σ_d ((2u + u²)
/// |q||k| + 2⁻¹⁰(1 + u)(|q|·s_k + |k|·s_q) + 2⁻²⁰·s_q·s_k), plus f32 rounding. The row sum adds
/// the rounded weights: Σ(p_j + e_j) = l·(1 + η), |η| ≤ Σ dp_j / l, which moves it by at most
/// −ln(1 − Σ dp_j / l) more (l ≥ 1: the max's p is 1).
///
/// Output: against the exact attention with the *quantised* S (Q, K dequantised, in f64), out =
/// Σ (p_j + e_j)(v_j + ε_j) / Σ (p_j + e_j), and Σ p_j (v_j − want) = 0 leaves |Δout_id| ≤
/// (Σⱼ dp_j |v_jd − want| + (p_j + dp_j)|ε_j|) / (l − Σⱼ dp_j) + f32 terms.
#[test]
fn fp8_attention_is_exact_attention_within_the_quantisation_bounds() -> crate::Result<()> {
    let (b, sq, sk, h, d) = (1, 150, 300, 2, 32);
    // Scores of spread ~4 (q ×4): most probabilities are far below the largest, where P's
    // scaling into e4m3's range matters.
    let q = crate::mul(
        &Tensor::randn(&[b, sq, h, d], DType::F32, 21, Device::Cpu)?,
        &Tensor::from_vec(vec![4.0], &[1])?,
    )?;
    let k = Tensor::randn(&[b, sk, h, d], DType::F32, 22, Device::Cpu)?;
    let v = Tensor::randn(&[b, sk, h, d], DType::F32, 23, Device::Cpu)?;
    let kv_len = 290; // the last key block partial, and padding masked
    let options = crate::AttentionOptions {
        scale: None,
        kv_len: Some(kv_len),
    };
    let (out, lse) = attention_fp8(&q, &k, &v, options)?;
    assert_eq!((out.shape(), lse.shape()), (q.shape(), &[b, h, sq][..]));
    let (qv, kv, vv, ov, lv) = (
        q.to_vec_f32()?,
        k.to_vec_f32()?,
        v.to_vec_f32()?,
        out.to_vec_f32()?,
        lse.to_vec_f32()?,
    );
    let scale = 1.0 / (d as f64).sqrt();
    let u = 2f64.powi(-4);
    // One sample: token t, head hi starts at (t·H + hi)·D.
    let at = |t: usize, hi: usize| (t * h + hi) * d;
    // Block scales as the recipe sets them.
    let block_scales = |x: &[f32], n: usize, hi: usize| -> Vec<f64> {
        (0..n.div_ceil(FP8_ATTENTION_BLOCK))
            .map(|blk| {
                let amax = (blk * FP8_ATTENTION_BLOCK..((blk + 1) * FP8_ATTENTION_BLOCK).min(n))
                    .flat_map(|t| x[at(t, hi)..][..d].iter())
                    .fold(0f32, |m, v| m.max(v.abs()));
                f64::from(amax / E4M3_MAX)
            })
            .collect()
    };
    let mut worst_out = 0f64;
    for hi in 0..h {
        let (sq_s, sk_s) = (block_scales(&qv, sq, hi), block_scales(&kv, kv_len, hi));
        let sv: Vec<f64> = (0..d)
            .map(|c| {
                let amax = (0..kv_len).fold(0f32, |m, t| m.max(vv[at(t, hi) + c].abs()));
                f64::from(amax / E4M3_MAX)
            })
            .collect();
        // The recipe's codes (x times the f32 reciprocal of the f32 scale), dequantised in f64.
        let deq = |x: &[f32], s: f64| -> Vec<f64> {
            let r = 1.0 / s as f32;
            x.iter().map(|v| f64::from(e4m3(v * r)) * s).collect()
        };
        for i in 0..sq {
            let qi = &qv[at(i, hi)..][..d];
            let (sqi, qd) = (
                sq_s[i / FP8_ATTENTION_BLOCK],
                deq(qi, sq_s[i / FP8_ATTENTION_BLOCK]),
            );
            let mut exact = Vec::new();
            let mut quant = Vec::new();
            let mut ds_max = 0f64;
            for j in 0..kv_len {
                let kj = &kv[at(j, hi)..][..d];
                let skj = sk_s[j / FP8_ATTENTION_BLOCK];
                let kd = deq(kj, skj);
                let e: f64 = qi
                    .iter()
                    .zip(kj)
                    .map(|(a, c)| f64::from(*a) * f64::from(*c))
                    .sum();
                let qs: f64 = qd.iter().zip(&kd).map(|(a, c)| a * c).sum();
                let bound: f64 = qi
                    .iter()
                    .zip(kj)
                    .map(|(a, c)| {
                        let (a, c) = (f64::from(a.abs()), f64::from(c.abs()));
                        (2.0 * u + u * u) * a * c
                            + 2f64.powi(-10) * (1.0 + u) * (a * skj + c * sqi)
                            + 2f64.powi(-20) * sqi * skj
                    })
                    .sum();
                ds_max = ds_max.max(scale * bound);
                exact.push(scale * e);
                quant.push(scale * qs);
            }
            let lse_of = |s: &[f64]| {
                let m = s.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
            };
            // P's rounding, relative to the quantised scores' softmax.
            let m = quant.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
            let p: Vec<f64> = quant.iter().map(|s| (s - m).exp()).collect();
            let l: f64 = p.iter().sum();
            let dp: Vec<f64> = p.iter().map(|p| u * p + 2f64.powi(-10) / 448.0).collect();
            let dl: f64 = dp.iter().sum();
            let got_lse = f64::from(lv[hi * sq + i]);
            assert!(
                (got_lse - lse_of(&exact)).abs()
                    <= ds_max - (1.0 - dl / l).ln() + 1e-5 * got_lse.abs().max(1.0),
                "lse ({i}, {hi}): {got_lse} vs {}",
                lse_of(&exact)
            );
            // Output against attention with the quantised scores and exact values.
            for c in 0..d {
                let want: f64 = (0..kv_len)
                    .map(|j| p[j] * f64::from(vv[at(j, hi) + c]))
                    .sum::<f64>()
                    / l;
                let bound: f64 = (0..kv_len)
                    .map(|j| {
                        let vj = f64::from(vv[at(j, hi) + c]);
                        let ev = u * vj.abs() + 2f64.powi(-10) * sv[c];
                        dp[j] * (vj - want).abs() + (p[j] + dp[j]) * ev
                    })
                    .sum::<f64>()
                    / (l - dl)
                    + 1e-5 * (1.0 + want.abs());
                let got = f64::from(ov[at(i, hi) + c]);
                assert!(
                    (got - want).abs() <= bound,
                    "out ({i}, {hi}, {c}): {got} vs {want} (bound {bound})"
                );
                worst_out = worst_out.max((got - want).abs());
            }
        }
    }
    // Quantisation did happen.
    assert!(worst_out > 1e-4, "worst output error {worst_out}");
    Ok(())
}

/// Bad shapes and kv_len are refused, and no valid key gives a zero output and lse −∞, as the
/// bf16 attention.
#[test]
fn fp8_attention_checks_its_inputs() -> crate::Result<()> {
    let q = Tensor::randn(&[1, 4, 2, 8], DType::F32, 1, Device::Cpu)?;
    let k = Tensor::randn(&[1, 6, 2, 8], DType::F32, 2, Device::Cpu)?;
    let bad = Tensor::randn(&[1, 6, 3, 8], DType::F32, 3, Device::Cpu)?;
    assert!(attention_fp8(&q, &k, &bad, crate::AttentionOptions::default()).is_err());
    let too_long = crate::AttentionOptions {
        scale: None,
        kv_len: Some(7),
    };
    let e = attention_fp8(&q, &k, &k, too_long).unwrap_err().to_string();
    assert!(e.contains("kv_len") && e.contains('7'), "{e}");
    let none = crate::AttentionOptions {
        scale: None,
        kv_len: Some(0),
    };
    let (out, lse) = attention_fp8(&q, &k, &k, none)?;
    assert!(out.to_vec_f32()?.iter().all(|v| *v == 0.0));
    assert!(lse.to_vec_f32()?.iter().all(|v| *v == f32::NEG_INFINITY));
    Ok(())
}

/// The FP8 attention's online schedule in closed form, at the default step (the GPU kernels') and
/// at others (192 keys straddle the 128-token K scale blocks): with M_b the exponent offset
/// after softmax step b (the first block's max + the headroom, moved only when a block's max
/// passes it), M the final one and wⱼ = e4m3(448·exp(S_j − M_b(j)))·exp(M_b(j) − M) the
/// weight of key j, the recipe computes out = Σⱼ wⱼ·q_v[j]·s_v / Σⱼ wⱼ (the rounded weights are
/// what the row sum adds). Evaluated here in f64 from the same f32 scores (so no e4m3 rounding can
/// flip), it must equal the reference to f32 rounding: this pins P's scaling, the sums of the
/// rounded weights, the rescaling by the running max and V's scales, which the bounds above are
/// too loose to.
#[test]
fn fp8_attention_follows_its_online_schedule() -> crate::Result<()> {
    let (sq, sk, h, d) = (3, 300, 1, 16);
    let q = crate::mul(
        &Tensor::randn(&[1, sq, h, d], DType::F32, 31, Device::Cpu)?,
        &Tensor::from_vec(vec![4.0], &[1])?,
    )?;
    let k = Tensor::randn(&[1, sk, h, d], DType::F32, 32, Device::Cpu)?;
    let v = Tensor::randn(&[1, sk, h, d], DType::F32, 33, Device::Cpu)?;
    let options = crate::AttentionOptions::default();
    let (default, _) = attention_fp8(&q, &k, &v, options)?;
    let none = super::attention::KeySplit::NONE;
    let (at_step, _) = attention_fp8_reference(&q, &k, &v, options, super::attention::STEP, none)?;
    assert_eq!(default.to_vec_f32()?, at_step.to_vec_f32()?);
    let mut outs = Vec::new();
    for step in [64, 128, 192] {
        let (out, _) = attention_fp8_reference(&q, &k, &v, options, step, none)?;
        check_online_schedule(&q, &k, &v, &out, step)?;
        outs.push(out.to_vec_f32()?);
    }
    // The step is seen: P rounds at another running max.
    assert!(outs[0] != outs[1] && outs[1] != outs[2]);
    let e = attention_fp8_reference(&q, &k, &v, options, 0, none).unwrap_err();
    assert!(e.to_string().contains("step"), "{e}");
    let no_runs = super::attention::KeySplit { first: 0, ways: 0 };
    let e = attention_fp8_reference(&q, &k, &v, options, 128, no_runs).unwrap_err();
    assert!(e.to_string().contains("split.ways"), "{e}");
    Ok(())
}

/// A split of the keys (`KeySplit`, the GPU's sparse last wave) is the recipe over each run of
/// key blocks alone, merged by the runs' LSEs: with V's channel scales 1 in every run (each run
/// holds a 448 in every channel, the rest small integers, so V's codes are its values whatever
/// keys a run holds) and runs at K's scale blocks, the reference over k and v cut to a run is
/// that run exactly, and the merge of those must give the split reference's rows to f32 rounding
/// (the same merge, in another order); tiles before `first` are untouched, bit for bit.
#[test]
fn fp8_attention_split_merges_its_runs() -> crate::Result<()> {
    use super::attention::{BLOCK, KeySplit};
    let (sq, h, d, kv_len) = (200, 2, 16, 700); // 2 q-tiles per head; 6 key blocks, the last partial
    let q = crate::mul(
        &Tensor::randn(&[1, sq, h, d], DType::F32, 34, Device::Cpu)?,
        &Tensor::from_vec(vec![2.0], &[1])?,
    )?;
    let k = Tensor::randn(&[1, kv_len, h, d], DType::F32, 35, Device::Cpu)?;
    let split = KeySplit { first: 1, ways: 3 }; // runs of blocks [0, 2), [2, 4), [4, 6)
    let runs = [0..2 * BLOCK, 2 * BLOCK..4 * BLOCK, 4 * BLOCK..kv_len];
    let v: Vec<f32> = (0..kv_len * h * d)
        .map(|i| {
            let t = i / (h * d);
            if runs.iter().any(|r| r.start == t) {
                448.0
            } else {
                ((i * 7919) % 17) as f32 - 8.0
            }
        })
        .collect();
    let v = Tensor::from_vec(v, &[1, kv_len, h, d])?;
    let options = crate::AttentionOptions::default();
    let (whole, whole_lse) = attention_fp8_reference(&q, &k, &v, options, 128, KeySplit::NONE)?;
    let (out, lse) = attention_fp8_reference(&q, &k, &v, options, 128, split)?;
    let parts = runs
        .iter()
        .map(|r| {
            let cut = |t: &Tensor| t.narrow(1, r.start, r.len());
            attention_fp8_reference(&q, &cut(&k)?, &cut(&v)?, options, 128, KeySplit::NONE)
        })
        .collect::<crate::Result<Vec<_>>>()?;
    let parts: Vec<(Vec<f32>, Vec<f32>)> = parts
        .iter()
        .map(|(o, l)| Ok((o.to_vec_f32()?, l.to_vec_f32()?)))
        .collect::<crate::Result<_>>()?;
    let (whole, whole_lse) = (whole.to_vec_f32()?, whole_lse.to_vec_f32()?);
    let (out, lse) = (out.to_vec_f32()?, lse.to_vec_f32()?);
    let mut split_rows_differ = false;
    for hi in 0..h {
        for i in 0..sq {
            let (row, at) = ((i * h + hi) * d, hi * sq + i);
            let tile = i / BLOCK + sq.div_ceil(BLOCK) * hi;
            if tile < split.first {
                assert_eq!(out[row..row + d], whole[row..row + d], "row {i} head {hi}");
                assert_eq!(lse[at], whole_lse[at]);
                continue;
            }
            let mx = parts.iter().fold(f32::NEG_INFINITY, |m, p| m.max(p.1[at]));
            let wsum: f32 = parts.iter().map(|p| (p.1[at] - mx).exp()).sum();
            for c in 0..d {
                let merged: f32 = parts
                    .iter()
                    .map(|p| (p.1[at] - mx).exp() / wsum * p.0[row + c])
                    .sum();
                let got = out[row + c];
                assert!(
                    (got - merged).abs() <= 1e-5 * (1.0 + merged.abs()),
                    "row {i} head {hi} channel {c}: {got} vs merged runs {merged}"
                );
            }
            assert!((lse[at] - (mx + wsum.ln())).abs() <= 1e-5);
            split_rows_differ |= out[row..row + d] != whole[row..row + d];
        }
    }
    // The runs are seen: their offsets round P differently from one softmax over all the keys.
    assert!(split_rows_differ);
    // More runs than key blocks would leave a run without keys: refused, naming the rule.
    let seven = KeySplit { first: 0, ways: 7 };
    let e = attention_fp8_reference(&q, &k, &v, options, 128, seven).unwrap_err();
    assert!(
        e.to_string().contains("split.ways") && e.to_string().contains("6 blocks"),
        "{e}"
    );
    Ok(())
}

/// The recipe's exponent offset moves as the GPU kernel's: the same headroom on both sides.
#[test]
fn the_recipe_and_the_kernel_keep_the_same_headroom() {
    let kernel = include_str!("../attention/hopper.cu");
    let line = format!(
        "constexpr float HEADROOM = {:.1}f;",
        super::attention::HEADROOM
    );
    assert!(kernel.contains(&line), "hopper.cu lacks `{line}`");
}

/// `fp8_attention_follows_its_online_schedule`'s closed form for one step.
fn check_online_schedule(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    step: usize,
) -> crate::Result<()> {
    let [_, sq, _, d] = q.shape()[..] else {
        unreachable!()
    };
    let sk = k.shape()[1];
    let (qv, kv, vv, ov) = (
        q.to_vec_f32()?,
        k.to_vec_f32()?,
        v.to_vec_f32()?,
        out.to_vec_f32()?,
    );
    let scale = 1.0 / (d as f32).sqrt();
    let amax = |x: &[f32]| x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let sqs = amax(&qv) / E4M3_MAX; // one query block
    let kblocks: Vec<f32> = kv
        .chunks(FP8_ATTENTION_BLOCK * d)
        .map(|c| amax(c) / E4M3_MAX)
        .collect();
    let sv: Vec<f32> = (0..d)
        .map(|c| (0..sk).fold(0f32, |m, j| m.max(vv[j * d + c].abs())) / E4M3_MAX)
        .collect();
    for i in 0..sq {
        let q8: Vec<f32> = qv[i * d..][..d]
            .iter()
            .map(|x| e4m3(x * (1.0 / sqs)))
            .collect();
        let s: Vec<f32> = (0..sk)
            .map(|j| {
                let kb = kblocks[j / FP8_ATTENTION_BLOCK];
                let k8 = kv[j * d..][..d].iter().map(|x| e4m3(x * (1.0 / kb)));
                let dot: f32 = q8.iter().zip(k8).map(|(a, c)| a * c).sum();
                dot * (sqs * kb) * scale
            })
            .collect();
        // The exponent offset: the first block's max + the headroom, moved only when a block's
        // max passes it.
        let mut running = Vec::new();
        let mut m = f32::NEG_INFINITY;
        for block in s.chunks(step) {
            let block_max = block.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            if block_max > m {
                m = block_max + super::attention::HEADROOM * std::f32::consts::LN_2;
            }
            running.push(m);
        }
        let total = f64::from(m);
        let w: Vec<f64> = (0..sk)
            .map(|j| {
                let mb = running[j / step];
                let p8 = e4m3((f64::from(s[j] - mb).exp() as f32) * E4M3_MAX);
                f64::from(p8) * (f64::from(mb) - total).exp()
            })
            .collect();
        let l: f64 = w.iter().sum();
        for c in 0..d {
            let acc: f64 = (0..sk)
                .map(|j| w[j] * f64::from(e4m3(vv[j * d + c] * (1.0 / sv[c]))))
                .sum();
            let want = acc * f64::from(sv[c]) / l;
            let got = f64::from(ov[i * d + c]);
            assert!(
                (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "step {step}, ({i}, {c}): {got} vs {want}"
            );
        }
    }
    Ok(())
}

/// An FP8 linear returns the dtype its input was quantised from, and the norms that write e4m3
/// report bad shapes as themselves (their composition would name the inner op) and refuse a
/// modulation that is not f32.
#[test]
fn quantised_activations_keep_their_dtype_and_the_e4m3_norms_check_their_operands()
-> crate::Result<()> {
    let x = Tensor::randn(&[2, 3, 16], DType::F32, 21, Device::Cpu)?.to_dtype(DType::BF16)?;
    let w = Fp8Tensor::quantize(&Tensor::randn(&[8, 16], DType::F32, 22, Device::Cpu)?)?;
    let qx = Fp8Tensor::quantize(&x)?;
    assert_eq!((qx.dtype(), w.dtype()), (DType::BF16, DType::F32));
    let y = linear_fp8(&qx, &w, None)?;
    assert_eq!((y.shape(), y.dtype()), (&[2, 3, 8][..], DType::BF16));

    let shift = Tensor::zeros(&[2, 1, 16], DType::F32, Device::Cpu)?;
    let q = crate::layer_norm_modulate_e4m3(&x, &shift, &shift, 1e-6, DType::F32)?;
    assert_eq!((q.shape(), q.dtype()), (x.shape(), DType::F32));
    let bad = Tensor::zeros(&[2, 1, 15], DType::F32, Device::Cpu)?;
    let err = crate::layer_norm_modulate_e4m3(&x, &bad, &bad, 1e-6, DType::BF16).unwrap_err();
    assert!(
        err.to_string().contains("layer_norm_modulate_e4m3"),
        "{err}"
    );
    let bf16_shift = shift.to_dtype(DType::BF16)?;
    let err = crate::layer_norm_modulate_e4m3(&x, &bf16_shift, &bf16_shift, 1e-6, DType::BF16)
        .unwrap_err();
    assert!(err.to_string().contains("f32"), "{err}");
    let err = crate::layer_norm_e4m3(&x, Some(&bad), None, 1e-6).unwrap_err();
    assert!(err.to_string().contains("layer_norm_e4m3"), "{err}");
    Ok(())
}

/// The GPU's FP8 attention operands are the recipe's code for code (`attention_fp8`'s CPU branch:
/// Q and K per head and 128-token block with s = amax/448, V per head and channel over the keys
/// below kv_len; codes e4m3(x · (1/s))), and Vᵀ holds key 32r + 16h + 8j + 2t + e at column
/// 32r + 16h + 4t + 2j + e (the P fragments' order) with 0 from kv_len to s_pad. Exact: a max is
/// exact in any order and both sides divide in IEEE f32, so a single differing code or scale is a
/// bug (a wrong block, a missed token, a mis-ordered key), which the attention's tolerance could
/// hide. Shapes with partial Q and K blocks, kv_len < S_k, several batches and heads.
#[cfg(feature = "cuda")]
#[test]
fn gpu_attention_operands_are_the_recipes_code_for_code() -> crate::Result<()> {
    use crate::{DType, Device};
    let Some(dev) = crate::testing::test_gpu() else {
        return Ok(());
    };
    if !crate::cuda::supports_fp8(0)? {
        eprintln!("skipped: this GPU has no FP8 tensor cores");
        return Ok(());
    }
    let backend = crate::cuda::CudaBackend::get(0)?;
    const D: usize = 128;
    for (b, sq, sk, h, kv_len) in [
        (1, 300, 257, 2, 250),
        (2, 256, 384, 3, 384),
        (1, 100, 60, 1, 60),
        (1, 129, 385, 2, 257),
    ] {
        let draw = |s: usize, seed| -> crate::Result<Tensor> {
            let x = Tensor::randn(&[b, s, h, D], DType::F32, seed, Device::Cpu)?;
            // Magnitudes over a few binades, so blocks' and channels' scales differ.
            let spread: Vec<f32> = (0..b * s * h * D)
                .map(|i| 2f32.powi((i % 7) as i32 - 3))
                .collect();
            crate::mul(&x, &Tensor::from_vec(spread, &[b, s, h, D])?)?.to_dtype(DType::BF16)
        };
        let (q, k, v) = (draw(sq, 51)?, draw(sk, 52)?, draw(sk, 53)?);
        let ops = super::cuda::quantize_attention(
            "test",
            &backend,
            (&q.to_device(dev)?, &k.to_device(dev)?, &v.to_device(dev)?),
            [b, sq, sk, h, D],
            kv_len,
        )?;
        let (gq, gk, gvt) = (ops.q.download()?, ops.k.download()?, ops.vt.download()?);
        let [qs, ks, vs] = &ops.scales;
        let (qs, ks, vs) = (qs.to_vec_f32()?, ks.to_vec_f32()?, vs.to_vec_f32()?);
        let (qv, kv, vv) = (q.to_vec_f32()?, k.to_vec_f32()?, v.to_vec_f32()?);
        let s_pad = kv_len.div_ceil(FP8_ATTENTION_BLOCK) * FP8_ATTENTION_BLOCK;
        assert_eq!(ops.s_pad, s_pad);
        let at = |s: usize, bi: usize, t: usize, hi: usize| ((bi * s + t) * h + hi) * D;
        let case = format!("({b},{sq},{sk},{h}) kv {kv_len}");
        for bi in 0..b {
            for hi in 0..h {
                let head = bi * h + hi;
                // Q and K: every block's scale, every code below the valid length.
                for (name, x, codes, scales, s, n) in [
                    ("q", &qv, &gq, &qs, sq, sq),
                    ("k", &kv, &gk, &ks, sk, kv_len),
                ] {
                    let blocks = n.div_ceil(FP8_ATTENTION_BLOCK);
                    for blk in 0..blocks {
                        let tokens =
                            blk * FP8_ATTENTION_BLOCK..((blk + 1) * FP8_ATTENTION_BLOCK).min(n);
                        let amax = tokens.clone().fold(0f32, |m, t| {
                            x[at(s, bi, t, hi)..][..D]
                                .iter()
                                .fold(m, |m, v| m.max(v.abs()))
                        });
                        let sc = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
                        let got = scales[head * blocks + blk];
                        assert_eq!(
                            got.to_bits(),
                            sc.to_bits(),
                            "{case} {name} scale b{bi} h{hi} block {blk}"
                        );
                        for t in tokens {
                            for c in 0..D {
                                let i = at(s, bi, t, hi) + c;
                                let want = e4m3(x[i] * (1.0 / sc));
                                assert_eq!(
                                    e4m3_value(codes[i]),
                                    want,
                                    "{case} {name} code b{bi} t{t} h{hi} c{c}"
                                );
                            }
                        }
                    }
                }
                // V: per-channel scales, Vᵀ's codes in the fragments' key order, 0 past kv_len.
                for c in 0..D {
                    let amax =
                        (0..kv_len).fold(0f32, |m, t| m.max(vv[at(sk, bi, t, hi) + c].abs()));
                    let sc = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
                    let got = vs[head * D + c];
                    assert_eq!(
                        got.to_bits(),
                        sc.to_bits(),
                        "{case} v scale b{bi} h{hi} c{c}"
                    );
                    for col in 0..s_pad {
                        let r = col % 32;
                        let (hh, tt, j, e) = (r / 16, (r % 16) / 4, (r % 4) / 2, r % 2);
                        let key = col - r + 16 * hh + 8 * j + 2 * tt + e;
                        let want = if key < kv_len {
                            e4m3(vv[at(sk, bi, key, hi) + c] * (1.0 / sc))
                        } else {
                            0.0
                        };
                        let code = gvt[(head * D + c) * s_pad + col];
                        assert_eq!(
                            (e4m3_value(code), key >= kv_len && code != 0),
                            (want, false),
                            "{case} vt code b{bi} h{hi} c{c} column {col} (key {key})"
                        );
                    }
                }
            }
        }
        println!("PARITY\tattention_fp8 operands\t{case}\texact");
    }
    Ok(())
}
