//! CPU reference for the norms: one pass per row (or per pixel for the channel-first norm).

/// LayerNorm of each length-`d` row: two passes (mean, then biased variance) for accuracy.
pub(super) fn layer_norm(
    x: &[f32],
    d: usize,
    weight: Option<&[f32]>,
    bias: Option<&[f32]>,
    eps: f32,
) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    if d == 0 {
        return out;
    }
    for (row, out_row) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let mean = row.iter().sum::<f32>() / d as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
        let inv_std = 1.0 / (var + eps).sqrt();
        for (i, (o, &v)) in out_row.iter_mut().zip(row).enumerate() {
            let normed = (v - mean) * inv_std;
            let scaled = weight.map_or(normed, |w| normed * w[i]);
            *o = bias.map_or(scaled, |b| scaled + b[i]);
        }
    }
    out
}

/// LayerNorm (no affine) of each length-`d` row, then `· (1 + scale) + shift` with row r using
/// modulation row r / `rows_per_mod` of `shift`/`scale`.
pub(super) fn layer_norm_modulate(
    x: &[f32],
    d: usize,
    shift: &[f32],
    scale: &[f32],
    rows_per_mod: usize,
    eps: f32,
) -> Vec<f32> {
    let mut out = layer_norm(x, d, None, None, eps);
    if d == 0 {
        return out;
    }
    for (r, row) in out.chunks_exact_mut(d).enumerate() {
        let m = (r / rows_per_mod) * d;
        let (sh, sc) = (&shift[m..m + d], &scale[m..m + d]);
        for ((o, &sh), &sc) in row.iter_mut().zip(sh).zip(sc) {
            *o = *o * (1.0 + sc) + sh;
        }
    }
    out
}

/// RMSNorm of each length-`d` row: x · rsqrt(mean(x²) + eps) · weight.
pub(super) fn rms_norm(x: &[f32], d: usize, weight: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    if d == 0 {
        return out;
    }
    for (row, out_row) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv_rms = 1.0 / (mean_sq + eps).sqrt();
        for ((o, &v), &w) in out_row.iter_mut().zip(row).zip(weight) {
            *o = v * inv_rms * w;
        }
    }
    out
}

/// Channel-first L2 norm on x [batch, channels, positions]:
/// y[b, c, p] = x[b, c, p] / max(‖x[b, :, p]‖₂, 1e-12) · √channels · gamma[c] + bias[c].
pub(super) fn rms_norm_channels(
    x: &[f32],
    batch: usize,
    channels: usize,
    positions: usize,
    gamma: &[f32],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    // F.normalize's eps: the norm is clamped below at 1e-12, not added to.
    const MIN_NORM: f32 = 1e-12;
    let sqrt_c = (channels as f32).sqrt();
    let mut out = vec![0.0; x.len()];
    let mut norms = vec![0.0f32; positions];
    for b in 0..batch {
        let image = &x[b * channels * positions..(b + 1) * channels * positions];
        // Sum of squares per position, walking channel planes so the inner loop is contiguous.
        norms.fill(0.0);
        for plane in image.chunks_exact(positions.max(1)) {
            for (n, v) in norms.iter_mut().zip(plane) {
                *n += v * v;
            }
        }
        for n in norms.iter_mut() {
            *n = n.sqrt().max(MIN_NORM);
        }
        let out_image = &mut out[b * channels * positions..(b + 1) * channels * positions];
        for c in 0..channels {
            let factor = sqrt_c * gamma[c];
            let shift = bias.map_or(0.0, |b| b[c]);
            let plane = &image[c * positions..(c + 1) * positions];
            let out_plane = &mut out_image[c * positions..(c + 1) * positions];
            for ((o, &v), &n) in out_plane.iter_mut().zip(plane).zip(&norms) {
                *o = v / n * factor + shift;
            }
        }
    }
    out
}
