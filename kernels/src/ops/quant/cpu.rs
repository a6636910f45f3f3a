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

/// Per-row scale and e4m3 values of `x` (rows of `k`): s = max|row| / 448 (1 if the row is all
/// zeros), q = e4m3(x / s).
pub(super) fn quantize_rows(x: &[f32], k: usize) -> (Vec<f32>, Vec<f32>) {
    let mut q = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len() / k);
    for row in x.chunks_exact(k) {
        let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
        q.extend(row.iter().map(|v| e4m3(v / s)));
        scales.push(s);
    }
    (q, scales)
}

/// y [rows, out] = (Σₖ qx·qw)·s_x·s_w + bias, x [rows, k] and w [out, k] quantised per row, the
/// products summed in f32 in k order.
pub(super) fn linear_fp8(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    k: usize,
    out: usize,
) -> Vec<f32> {
    let (qx, sx) = quantize_rows(x, k);
    let (qw, sw) = quantize_rows(w, k);
    let mut y = Vec::with_capacity(sx.len() * out);
    for (xr, &sxr) in qx.chunks_exact(k).zip(&sx) {
        for (o, (wr, &swr)) in qw.chunks_exact(k).zip(&sw).enumerate() {
            let dot: f32 = xr.iter().zip(wr).map(|(a, b)| a * b).sum();
            y.push(dot * (sxr * swr) + bias.map_or(0.0, |b| b[o]));
        }
    }
    y
}
