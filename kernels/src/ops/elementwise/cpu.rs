//! CPU reference for the elementwise ops: scalar activation formulas and broadcasting loops.

use crate::ops::broadcast_strides;
use crate::tensor::StridedOffsets;

/// SiLU: x / (1 + e^(−x)).
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU with the tanh approximation: ½x(1 + tanh(√(2/π)(x + 0.044715x³))).
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

/// f(a, b) over the broadcast shape `out_shape`.
pub(super) fn broadcast_binary(
    a: &[f32],
    a_shape: &[usize],
    b: &[f32],
    b_shape: &[usize],
    out_shape: &[usize],
    f: fn(f32, f32) -> f32,
) -> Vec<f32> {
    let a_offsets = StridedOffsets::new(out_shape, &broadcast_strides(a_shape, out_shape));
    let b_offsets = StridedOffsets::new(out_shape, &broadcast_strides(b_shape, out_shape));
    a_offsets
        .zip(b_offsets)
        .map(|(i, j)| f(a[i], b[j]))
        .collect()
}

/// f(x, p, q) over x's (contiguous) shape, with p and q broadcast to it.
pub(super) fn broadcast_ternary(
    x: &[f32],
    x_shape: &[usize],
    (p, p_shape): (&[f32], &[usize]),
    (q, q_shape): (&[f32], &[usize]),
    f: impl Fn(f32, f32, f32) -> f32,
) -> Vec<f32> {
    let p_offsets = StridedOffsets::new(x_shape, &broadcast_strides(p_shape, x_shape));
    let q_offsets = StridedOffsets::new(x_shape, &broadcast_strides(q_shape, x_shape));
    x.iter()
        .zip(p_offsets.zip(q_offsets))
        .map(|(&v, (i, j))| f(v, p[i], q[j]))
        .collect()
}
