//! CPU reference for RoPE: table construction (f64 angles) and the pairwise rotation.

/// Frequencies of one band of width `d_band`: theta^(−2i/d_band) for i < d_band/2, in f64.
fn band_frequencies(d_band: usize, theta: f64) -> Vec<f64> {
    (0..d_band / 2)
        .map(|i| theta.powf(-((2 * i) as f64) / d_band as f64))
        .collect()
}

/// (cos, sin), each [F·H·W, (d_t + d_h + d_w)/2] row-major.
pub(super) fn rope_tables_3d(
    [frames, height, width]: [usize; 3],
    [d_t, d_h, d_w]: [usize; 3],
    theta: f64,
) -> (Vec<f32>, Vec<f32>) {
    let omega_t = band_frequencies(d_t, theta);
    let omega_h = band_frequencies(d_h, theta);
    let omega_w = band_frequencies(d_w, theta);
    let pairs = (d_t + d_h + d_w) / 2;
    let tokens = frames * height * width;
    let (mut cos, mut sin) = (
        Vec::with_capacity(tokens * pairs),
        Vec::with_capacity(tokens * pairs),
    );
    for f in 0..frames {
        for h in 0..height {
            for w in 0..width {
                let angles = omega_t
                    .iter()
                    .map(|o| f as f64 * o)
                    .chain(omega_h.iter().map(|o| h as f64 * o))
                    .chain(omega_w.iter().map(|o| w as f64 * o));
                for angle in angles {
                    cos.push(angle.cos() as f32);
                    sin.push(angle.sin() as f32);
                }
            }
        }
    }
    (cos, sin)
}

/// x [B, S, H, D]; cos/sin [S, D/2].
pub(super) fn apply_rope(
    x: &[f32],
    [batch, seq, heads, head_dim]: [usize; 4],
    cos: &[f32],
    sin: &[f32],
) -> Vec<f32> {
    let pairs = head_dim / 2;
    let mut out = vec![0.0; x.len()];
    for b in 0..batch {
        for s in 0..seq {
            let (cos_s, sin_s) = (
                &cos[s * pairs..(s + 1) * pairs],
                &sin[s * pairs..(s + 1) * pairs],
            );
            for h in 0..heads {
                let base = ((b * seq + s) * heads + h) * head_dim;
                for k in 0..pairs {
                    let (x0, x1) = (x[base + 2 * k], x[base + 2 * k + 1]);
                    out[base + 2 * k] = x0 * cos_s[k] - x1 * sin_s[k];
                    out[base + 2 * k + 1] = x0 * sin_s[k] + x1 * cos_s[k];
                }
            }
        }
    }
    out
}
