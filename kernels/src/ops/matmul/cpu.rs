//! CPU reference GEMM: a safe, bounds-checked wrapper over `matrixmultiply::sgemm`, and the
//! `matmul`/`linear` loops on top of it. Attention and convolution reuse [`gemm`].

/// A row-major-or-strided f32 matrix view: `data[row * row_stride + col * col_stride]`.
#[derive(Clone, Copy)]
pub(crate) struct MatRef<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub col_stride: usize,
}

impl<'a> MatRef<'a> {
    /// A contiguous row-major `rows × cols` matrix.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        MatRef {
            data,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose, as a view (no copy).
    pub fn t(self) -> Self {
        MatRef {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }

    /// Whether every addressed element lies inside `data`.
    fn in_bounds(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride
                < self.data.len()
    }
}

/// c [M, N] (row stride `c_row_stride`, unit column stride) = a [M, K] · b [K, N] (+ c if `accumulate`).
///
/// Panics if a view addresses memory outside its slice or the shapes disagree: the callers in this crate
/// build the views from checked tensor shapes, so a panic here is a bug in this crate, not bad input.
pub(crate) fn gemm(
    a: MatRef<'_>,
    b: MatRef<'_>,
    c: &mut [f32],
    c_row_stride: usize,
    accumulate: bool,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "gemm: inner dims differ");
    assert!(
        a.in_bounds() && b.in_bounds(),
        "gemm: operand view out of bounds"
    );
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        c_row_stride >= n && (m - 1) * c_row_stride + n <= c.len(),
        "gemm: output view out of bounds or overlapping"
    );
    if k == 0 {
        if !accumulate {
            for row in 0..m {
                c[row * c_row_stride..row * c_row_stride + n].fill(0.0);
            }
        }
        return;
    }
    let beta = if accumulate { 1.0 } else { 0.0 };
    // SAFETY: the asserts above show every element sgemm reads through a/b and writes through c lies
    // inside its slice; c's rows (stride ≥ n, unit column stride) never overlap, and c is borrowed
    // mutably, so it aliases neither a nor b. With beta = 0 sgemm does not read c.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.data.as_ptr(),
            a.row_stride as isize,
            a.col_stride as isize,
            b.data.as_ptr(),
            b.row_stride as isize,
            b.col_stride as isize,
            beta,
            c.as_mut_ptr(),
            c_row_stride as isize,
            1,
        );
    }
}

/// `batch` products a_i [m, k] · b_i [k, n]; with `shared_b`, every a_i uses the single b.
pub(super) fn batched_matmul(
    a: &[f32],
    b: &[f32],
    batch: usize,
    shared_b: bool,
    m: usize,
    k: usize,
    n: usize,
) -> Vec<f32> {
    let mut out = vec![0.0; batch * m * n];
    for i in 0..batch {
        let b_i = if shared_b {
            b
        } else {
            &b[i * k * n..(i + 1) * k * n]
        };
        gemm(
            MatRef::row_major(&a[i * m * k..(i + 1) * m * k], m, k),
            MatRef::row_major(b_i, k, n),
            &mut out[i * m * n..(i + 1) * m * n],
            n,
            false,
        );
    }
    out
}

/// x [rows, in] · w [out, in]ᵀ + bias [out] → [rows, out].
pub(super) fn linear(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    rows: usize,
    in_features: usize,
    out_features: usize,
) -> Vec<f32> {
    let mut out = vec![0.0; rows * out_features];
    if let Some(bias) = bias.filter(|_| out_features > 0) {
        for row in out.chunks_exact_mut(out_features) {
            row.copy_from_slice(bias);
        }
    }
    gemm(
        MatRef::row_major(x, rows, in_features),
        MatRef::row_major(w, out_features, in_features).t(),
        &mut out,
        out_features,
        bias.is_some(),
    );
    out
}

/// `groups` runs of rows, run g: residual + bias_g + x_g · w_gᵀ, with w [groups, out, in] and bias
/// [groups, out] (one group: [out, in] and [out]); the residual buffer becomes the output.
pub(super) fn linear_residual(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    mut out: Vec<f32>,
    groups: usize,
    (rows, in_features, out_features): (usize, usize, usize),
) -> Vec<f32> {
    let rows_per_group = rows / groups.max(1);
    for g in 0..groups {
        let (r0, r1) = (g * rows_per_group, (g + 1) * rows_per_group);
        let out_g = &mut out[r0 * out_features..r1 * out_features];
        if let Some(bias) = bias.filter(|_| out_features > 0) {
            let bias_g = &bias[g * out_features..(g + 1) * out_features];
            for row in out_g.chunks_exact_mut(out_features) {
                for (o, b) in row.iter_mut().zip(bias_g) {
                    *o += b;
                }
            }
        }
        let w_g = &w[g * out_features * in_features..(g + 1) * out_features * in_features];
        gemm(
            MatRef::row_major(&x[r0 * in_features..r1 * in_features], r1 - r0, in_features),
            MatRef::row_major(w_g, out_features, in_features).t(),
            out_g,
            out_features,
            true,
        );
    }
    out
}
