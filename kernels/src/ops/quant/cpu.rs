//! CPU reference of the e4m3 quantisation (see `mod.rs` for the format and the recipe).

use super::E4M3_MAX;

/// The smallest normal e4m3 exponent: below 2⁻⁶ the values are subnormal, spaced 2⁻⁹.
const MIN_EXP: i32 = -6;

/// Nearest e4m3 value, ties to even, saturating; NaN stays NaN.
pub(super) fn e4m3(v: f32) -> f32 {
    if v.is_nan() {
        return v;
    }
    let a = v.abs();
    if a >= E4M3_MAX {
        return E4M3_MAX.copysign(v);
    }
    // The binary exponent of a (from its bits: exact, unlike log2), floored at the subnormal range;
    // the spacing of e4m3 values there is 2^(e − 3). Scaling by a power of two is exact in f32,
    // so the one rounding is round_ties_even's.
    let e = (((a.to_bits() >> 23) & 0xff) as i32 - 127).max(MIN_EXP);
    let step = 2f32.powi(e - 3);
    ((a / step).round_ties_even() * step).copysign(v)
}

/// What codes are made with: e4m3(x · rcp(s)), the reciprocal rounded to f32 once per scale, as
/// the GPU's kernels make them (`e4m3_rcp` in prelude.cuh: a division per element there made the
/// row kernels' code 2.5× a plain norm's).
pub(super) fn rcp(s: f32) -> f32 {
    1.0 / s
}

/// Per-row scale and e4m3 values of `x` (rows of `k`): s = max|row| / 448 (1 if the row is all
/// zeros), q = e4m3(x · (1/s)).
pub(super) fn quantize_rows(x: &[f32], k: usize) -> (Vec<f32>, Vec<f32>) {
    let mut q = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len() / k);
    for row in x.chunks_exact(k) {
        let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
        let r = rcp(s);
        q.extend(row.iter().map(|v| e4m3(v * r)));
        scales.push(s);
    }
    (q, scales)
}

/// The e4m3 code of `e4m3(v)`: sign, 4 exponent bits (bias 7), 3 mantissa bits; NaN is 0x7f with
/// v's sign (CUDA's code for NaN).
pub(super) fn e4m3_code(v: f32) -> u8 {
    let r = e4m3(v);
    let sign = if r.is_sign_negative() { 0x80 } else { 0 };
    if r.is_nan() {
        return sign | 0x7f;
    }
    let a = r.abs();
    let e = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
    if a == 0.0 {
        sign
    } else if e < MIN_EXP {
        // Subnormal: a = m·2⁻⁹, m in 1..=7 (exact: `e4m3` put a on that grid).
        sign | (a * 512.0) as u8
    } else {
        let m = (a / 2f32.powi(e) - 1.0) * 8.0; // 0..=7, exact
        sign | (((e + 7) as u8) << 3) | m as u8
    }
}

/// The value of an e4m3 code (0x7f and 0xff: NaN).
pub(super) fn e4m3_value(code: u8) -> f32 {
    let (e, m) = (i32::from((code >> 3) & 0xf), f32::from(code & 7));
    let mag = match (e, code & 7) {
        (15, 7) => f32::NAN,
        (0, _) => m / 8.0 * 2f32.powi(MIN_EXP),
        _ => (1.0 + m / 8.0) * 2f32.powi(e - 7),
    };
    if code & 0x80 != 0 { -mag } else { mag }
}

/// y [rows, out] = (Σₖ qx·qw)·s_x[r]·s_w[o] + bias[o] (+ residual), x and w given as their e4m3
/// values (`qx` [rows, k], `qw` [out, k]) and scales: the products summed in f32 in k order. With
/// `groups` > 1, `sw` and `bias` hold one [out] run per group of rows (a gate folded in, see
/// `linear_fp8_residual`).
pub(super) fn linear_fp8(
    (qx, sx): (&[f32], &[f32]),
    (qw, sw): (&[f32], &[f32]),
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
    groups: usize,
    (k, out): (usize, usize),
) -> Vec<f32> {
    let rows = sx.len();
    let rows_per_group = rows / groups.max(1);
    let mut y = Vec::with_capacity(rows * out);
    for (r, (xr, &sxr)) in qx.chunks_exact(k).zip(sx).enumerate() {
        let g = r.checked_div(rows_per_group).unwrap_or(0).min(groups - 1);
        for (o, wr) in qw.chunks_exact(k).enumerate() {
            let dot: f32 = xr.iter().zip(wr).map(|(a, b)| a * b).sum();
            let v = dot * (sxr * sw[g * out + o])
                + bias.map_or(0.0, |b| b[g * out + o])
                + residual.map_or(0.0, |res| res[r * out + o]);
            y.push(v);
        }
    }
    y
}
