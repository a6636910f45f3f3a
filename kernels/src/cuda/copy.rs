//! Strided index spaces for kernels ([`Layout`]) and the strided copy/cast kernel behind `permute`,
//! `narrow`, `concat` and `to_dtype` on the GPU.

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

use super::{CudaBackend, CudaStorage, KernelSource, grid_1d, suffix};
use crate::{KernelError, Result};

pub(crate) const SOURCE: KernelSource = KernelSource {
    name: "copy",
    text: include_str!("copy.cu"),
};

/// Most axes a [`Layout`] holds after merging (`MAX_RANK` in prelude.cuh).
const MAX_RANK: usize = 8;

/// An index space (row-major over `shape`) and up to three operands' element strides per axis; the
/// kernel-side twin is `struct Layout` in prelude.cuh (same field order and padding).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Layout {
    rank: i32,
    pad: i32,
    shape: [i64; MAX_RANK],
    stride: [[i64; MAX_RANK]; 3],
}

// SAFETY: plain-old-data `#[repr(C)]` struct matching the kernel's `Layout` by value.
unsafe impl DeviceRepr for Layout {}

impl Layout {
    /// The index space `shape` read through `strides` (one slice per operand, ≤ 3, each of `shape`'s rank).
    /// Axes of length 1 are dropped and neighbouring axes that are contiguous in every operand merged,
    /// which keeps the per-element index maths short; more than 8 axes left is an error.
    pub fn new(op: &'static str, shape: &[usize], strides: &[&[usize]]) -> Result<Layout> {
        debug_assert!(strides.len() <= 3 && strides.iter().all(|s| s.len() == shape.len()));
        let mut axes: Vec<(usize, [usize; 3])> = Vec::new();
        for (axis, &n) in shape.iter().enumerate() {
            if n == 1 {
                continue;
            }
            let mut s = [0; 3];
            for (k, st) in strides.iter().enumerate() {
                s[k] = st[axis];
            }
            match axes.last_mut() {
                Some((pn, ps)) if (0..3).all(|k| ps[k] == s[k] * n) => {
                    *pn *= n;
                    *ps = s;
                }
                _ => axes.push((n, s)),
            }
        }
        if axes.len() > MAX_RANK {
            return Err(KernelError::arg(
                op,
                "rank",
                axes.len(),
                format!("the CUDA kernels index at most {MAX_RANK} non-mergeable axes"),
            ));
        }
        let mut layout = Layout {
            rank: axes.len().max(1) as i32,
            pad: 0,
            shape: [1; MAX_RANK],
            stride: [[0; MAX_RANK]; 3],
        };
        for (a, (n, s)) in axes.iter().enumerate() {
            layout.shape[a] = *n as i64;
            for (k, &stride) in s.iter().enumerate() {
                layout.stride[k][a] = stride as i64;
            }
        }
        Ok(layout)
    }
}

/// A copy as contiguous runs: `rows` runs of `width` elements, the rows `src_pitch` and `dst_pitch`
/// elements apart.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Rows {
    rows: usize,
    width: usize,
    src_pitch: usize,
    dst_pitch: usize,
}

impl Layout {
    /// This two-operand index space as contiguous runs, where it is one (at most two axes left after
    /// merging, the inner one contiguous in both operands): what narrow and concat along any axis give.
    fn rows(&self) -> Option<Rows> {
        let (rank, inner) = (self.rank as usize, self.rank as usize - 1);
        if rank > 2 || self.stride[0][inner] != 1 || self.stride[1][inner] != 1 {
            return None;
        }
        let outer = |k: usize| {
            if rank == 2 {
                self.stride[k][0] as usize
            } else {
                0
            }
        };
        Some(Rows {
            rows: if rank == 2 { self.shape[0] as usize } else { 1 },
            width: self.shape[inner] as usize,
            src_pitch: outer(0),
            dst_pitch: outer(1),
        })
    }
}

/// `copy_rows` of copy.cu in the widest word that every address, pitch and width allows; `es` is the
/// element size in bytes.
fn copy_rows(
    op: &'static str,
    backend: &CudaBackend,
    src_ptr: u64,
    dst_ptr: u64,
    r: Rows,
    es: usize,
) -> Result<()> {
    let bytes = [r.width * es, r.src_pitch * es, r.dst_pitch * es];
    let aligned = |w: usize| {
        bytes.iter().all(|b| b.is_multiple_of(w))
            && src_ptr.is_multiple_of(w as u64)
            && dst_ptr.is_multiple_of(w as u64)
    };
    let (name, word) = [
        ("copy_rows_w16", 16),
        ("copy_rows_w8", 8),
        ("copy_rows_w4", 4),
    ]
    .into_iter()
    .find(|&(_, w)| aligned(w))
    .unwrap_or(("copy_rows_w2", 2));
    let f = backend.function(&SOURCE, name)?;
    let [width, src_pitch, dst_pitch] = bytes.map(|b| (b / word) as i64);
    let rows = r.rows as i64;
    let block = super::BLOCK;
    let x = (width as usize).div_ceil(block as usize).clamp(1, 1 << 16) as u32;
    let y = r.rows.clamp(1, 65_535) as u32;
    let mut launch = backend.stream.launch_builder(&f);
    launch
        .arg(&src_ptr)
        .arg(&dst_ptr)
        .arg(&rows)
        .arg(&width)
        .arg(&src_pitch)
        .arg(&dst_pitch);
    let cfg = LaunchConfig {
        grid_dim: (x, y, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: rows · pitch + width stays inside each buffer (the caller's layout does, and the word
    // divides every byte count and address); the parameters are (const W*, W*, i64 ×4) as pushed.
    unsafe { launch.launch(cfg) }.map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    Ok(())
}

/// dst[dst_offset + Σ idx·dst_strides] = src[src_offset + Σ idx·src_strides] over every index of `shape`,
/// converting between the two storages' dtypes. Offsets and strides are in elements.
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy_strided(
    op: &'static str,
    src: &CudaStorage,
    src_offset: usize,
    src_strides: &[usize],
    dst: &CudaStorage,
    dst_offset: usize,
    dst_strides: &[usize],
    shape: &[usize],
) -> Result<()> {
    let n: usize = shape.iter().product();
    if n == 0 {
        return Ok(());
    }
    let backend = CudaBackend::get(src.ordinal)?;
    let layout = Layout::new(op, shape, &[src_strides, dst_strides])?;
    let es = src.dtype().size_in_bytes();
    let src_ptr = src.ptr() + (src_offset * es) as u64;
    let dst_ptr = dst.ptr() + (dst_offset * dst.dtype().size_in_bytes()) as u64;
    if let Some(rows) = layout.rows().filter(|_| src.dtype() == dst.dtype()) {
        return copy_rows(op, &backend, src_ptr, dst_ptr, rows, es);
    }
    let name = format!("copy_{}_{}", suffix(src.dtype()), suffix(dst.dtype()));
    let f = backend.function(&SOURCE, &name)?;
    let n = n as i64;
    let mut launch = backend.stream.launch_builder(&f);
    launch.arg(&src_ptr).arg(&dst_ptr).arg(&n).arg(&layout);
    // SAFETY: the callers' shapes and strides keep every offset inside both buffers; the kernel's
    // parameters are (const S*, D*, i64, Layout) as pushed.
    unsafe { launch.launch(grid_1d(n as usize)) }
        .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_merges_contiguous_axes() -> Result<()> {
        // A contiguous copy of [2, 3, 4] is one axis of 24.
        let l = Layout::new("t", &[2, 3, 4], &[&[12, 4, 1], &[12, 4, 1]])?;
        assert_eq!((l.rank, l.shape[0], l.stride[0][0]), (1, 24, 1));
        // Broadcast [B, 1, D] against [B, L, D]: nothing merges across the stretched axis.
        let l = Layout::new("t", &[2, 5, 4], &[&[20, 4, 1], &[4, 0, 1]])?;
        assert_eq!(l.rank, 3);
        // Size-1 axes vanish.
        let l = Layout::new("t", &[1, 3, 1], &[&[3, 1, 1]])?;
        assert_eq!((l.rank, l.shape[0]), (1, 3));
        Ok(())
    }

    #[test]
    fn narrow_and_concat_copies_are_rows() -> Result<()> {
        // narrow(2, 1, 2) of [1, 4, 5, 6]: 4 rows of 2·6, pitch 5·6 in the source.
        let l = Layout::new("t", &[1, 4, 2, 6], &[&[120, 30, 6, 1], &[48, 12, 6, 1]])?;
        let rows = Rows {
            rows: 4,
            width: 12,
            src_pitch: 30,
            dst_pitch: 12,
        };
        assert_eq!(l.rows(), Some(rows));
        // A whole contiguous tensor is one row.
        let l = Layout::new("t", &[2, 3], &[&[3, 1], &[3, 1]])?;
        assert_eq!(l.rows().map(|r| (r.rows, r.width)), Some((1, 6)));
        // A transpose is not.
        let l = Layout::new("t", &[2, 3], &[&[1, 2], &[3, 1]])?;
        assert_eq!(l.rows(), None);
        // Nor is a copy with three unmergeable axes.
        let l = Layout::new("t", &[2, 3, 4], &[&[24, 4, 1], &[12, 8, 1]])?;
        assert_eq!(l.rows(), None);
        Ok(())
    }
}
