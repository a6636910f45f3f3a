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

impl Layout {
    /// Whether the index space can be walked in words of `v` elements of its innermost axis (the
    /// word-wise binary kernel): that axis has a length that is a multiple of `v` and stride 1 in
    /// operand 0, and every other stride of operand 0 is a multiple of `v`. Returns operand 1's
    /// innermost stride class: `Some(true)` for stride 1 with its other strides multiples of `v`
    /// too, `Some(false)` for stride 0 (broadcast along the axis), `None` otherwise.
    pub(crate) fn words(&self, v: usize) -> Option<bool> {
        let v = v as i64;
        let inner = self.rank as usize - 1;
        let outer_multiple = |k: usize| self.stride[k][..inner].iter().all(|s| s % v == 0);
        if self.shape[inner] % v != 0 || self.stride[0][inner] != 1 || !outer_multiple(0) {
            return None;
        }
        match self.stride[1][inner] {
            0 => Some(false),
            1 if outer_multiple(1) => Some(true),
            _ => None,
        }
    }
}

/// A copy as contiguous runs of `width` elements, one per index of `outer` (the other axes, with both
/// operands' strides in elements).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Rows {
    outer: Layout,
    width: usize,
}

/// The shortest run worth a row of its own (in elements; shorter ones take the per-element kernel).
const MIN_ROW: usize = 64;

impl Layout {
    /// This two-operand index space as contiguous runs, where its innermost axis (after merging) is
    /// contiguous in both operands and at least [`MIN_ROW`] long: what narrow, concat and most
    /// permutes of the VAE give (a frame's pixels stay together).
    fn rows(&self) -> Option<Rows> {
        let inner = self.rank as usize - 1;
        let width = self.shape[inner] as usize;
        if self.stride[0][inner] != 1 || self.stride[1][inner] != 1 || width < MIN_ROW {
            return None;
        }
        let mut outer = *self;
        outer.rank = inner.max(1) as i32;
        if inner == 0 {
            outer.shape[0] = 1;
            outer.stride = [[0; MAX_RANK]; 3];
        }
        Some(Rows { outer, width })
    }
}

/// The widest word, 16, 8, 4 or 2 bytes, that divides every byte count of `bytes` and every address
/// of `ptrs`: the instance (`_w16` … `_w2`) of a copy.cu kernel that moves words. 2 is the smallest
/// element, so it always fits.
fn widest_word(bytes: impl Iterator<Item = usize> + Clone, ptrs: &[u64]) -> usize {
    [16, 8, 4]
        .into_iter()
        .find(|&w| {
            bytes.clone().all(|b| b.is_multiple_of(w))
                && ptrs.iter().all(|p| p.is_multiple_of(w as u64))
        })
        .unwrap_or(2)
}

/// `copy_rows` of copy.cu in the widest word that every address, stride and width allows; `es` is
/// the element size in bytes.
fn copy_rows(
    op: &'static str,
    backend: &CudaBackend,
    src_ptr: u64,
    dst_ptr: u64,
    r: Rows,
    es: usize,
) -> Result<()> {
    let outer_rank = r.outer.rank as usize;
    let strides = r.outer.stride[..2].iter().flat_map(|s| &s[..outer_rank]);
    let bytes = std::iter::once(r.width).chain(strides.map(|&s| s as usize));
    let word = widest_word(bytes.map(|v| v * es), &[src_ptr, dst_ptr]);
    let f = backend.function(&SOURCE, &format!("copy_rows_w{word}"))?;
    let per_word = (word / es) as i64; // elements per word
    let mut outer = r.outer;
    for k in 0..2 {
        for s in &mut outer.stride[k][..outer_rank] {
            *s /= per_word;
        }
    }
    let rows: usize = outer.shape[..outer_rank].iter().product::<i64>() as usize;
    let width = (r.width * es / word) as i64;
    let block = super::BLOCK;
    let x = (width as usize).div_ceil(block as usize).clamp(1, 1 << 16) as u32;
    let y = rows.clamp(1, 65_535) as u32;
    let rows = rows as i64;
    let mut launch = backend.stream.launch_builder(&f);
    launch
        .arg(&src_ptr)
        .arg(&dst_ptr)
        .arg(&rows)
        .arg(&width)
        .arg(&outer);
    let cfg = LaunchConfig {
        grid_dim: (x, y, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: every row's offsets plus `width` words stay inside each buffer (the caller's layout
    // does, and the word divides every byte count, stride and address); the parameters are
    // (const W*, W*, i64, i64, Layout) as pushed.
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

/// The geometry of [`halo_edges`] in elements: `slabs` (B·C) channel slabs of `cached` cache frames and
/// `frames` x frames of `plane` elements each; an edge of a frame is `runs` runs of `run` elements,
/// run i starting at `start[e]` + i·`stride` of the frame, for edge e (0: before, 1: after).
#[derive(Debug, Clone, Copy)]
pub(crate) struct EdgeRuns {
    pub slabs: usize,
    pub cached: usize,
    pub frames: usize,
    pub plane: usize,
    pub runs: usize,
    pub run: usize,
    pub stride: usize,
    pub start: [usize; 2],
}

/// `halo_edges` of copy.cu: both edges of cache ++ x (frames joined, the cache's first) into `outs`
/// ([slabs, cached + frames, runs, run] each), in one launch, in the widest word that every address,
/// offset and length allows; `es` is the element size in bytes. `cache_ptr` is read only when
/// `cached` > 0.
pub(crate) fn halo_edges(
    op: &'static str,
    backend: &CudaBackend,
    (x_ptr, cache_ptr): (u64, u64),
    outs: [u64; 2],
    g: EdgeRuns,
    es: usize,
) -> Result<()> {
    let n = g.slabs * (g.cached + g.frames) * g.runs * g.run;
    if n == 0 {
        return Ok(());
    }
    let bytes = [g.plane, g.run, g.stride, g.start[0], g.start[1]].map(|v| v * es);
    let word = widest_word(bytes.into_iter(), &[x_ptr, cache_ptr, outs[0], outs[1]]);
    let f = backend.function(&SOURCE, &format!("halo_edges_w{word}"))?;
    let per_word = word / es;
    let words = |v: usize| (v / per_word) as i64;
    let (slabs, cached, frames, runs, stride) = (
        g.slabs as i64,
        g.cached as i64,
        g.frames as i64,
        g.runs as i64,
        words(g.stride),
    );
    let (plane, run, start0, start1) = (
        words(g.plane),
        words(g.run),
        words(g.start[0]),
        words(g.start[1]),
    );
    let block = super::BLOCK;
    let x_blocks = (n / per_word).div_ceil(block as usize).clamp(1, 1 << 16) as u32;
    let mut launch = backend.stream.launch_builder(&f);
    launch
        .arg(&x_ptr)
        .arg(&cache_ptr)
        .arg(&outs[0])
        .arg(&outs[1]);
    for v in [
        &slabs, &cached, &frames, &plane, &runs, &run, &stride, &start0, &start1,
    ] {
        launch.arg(v);
    }
    let cfg = LaunchConfig {
        grid_dim: (x_blocks, 2, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: x holds slabs·frames·plane elements and the cache slabs·cached·plane (the caller's
    // shapes), every run lies inside its frame (start + (runs − 1)·stride + run ≤ plane, the caller's
    // geometry), each output holds slabs·(cached + frames)·runs·run elements; the word divides every
    // byte count, offset and address; the parameters are (const W*, const W*, W*, W*, 9 × i64) as
    // pushed.
    unsafe { launch.launch(cfg) }.map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The word kernels get the widest word every length and address allows, down to 2 bytes.
    #[test]
    fn word_is_the_widest_that_divides_everything() {
        let at = 1 << 20; // 256-byte aligned, as the pool's buffers are
        assert_eq!(
            widest_word([832 * 2, 96 * 832 * 2].into_iter(), &[at, at]),
            16
        );
        assert_eq!(widest_word([104 * 2].into_iter(), &[at, at + 8]), 8);
        assert_eq!(widest_word([10 * 2].into_iter(), &[at]), 4);
        assert_eq!(widest_word([7 * 2].into_iter(), &[at]), 2);
        assert_eq!(widest_word([16].into_iter(), &[at + 2]), 2);
    }

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
    fn narrow_concat_and_frame_permutes_are_rows() -> Result<()> {
        // narrow(2, 1, 2) of [1, 4, 5, 64]: 4 runs of 2·64, 5·64 apart in the source.
        let l = Layout::new(
            "t",
            &[1, 4, 2, 64],
            &[&[1280, 320, 64, 1], &[512, 128, 64, 1]],
        )?;
        let r = l.rows().expect("rows");
        assert_eq!((r.width, r.outer.rank, r.outer.shape[0]), (128, 1, 4));
        assert_eq!((r.outer.stride[0][0], r.outer.stride[1][0]), (320, 128));
        // A whole contiguous tensor is one run.
        let l = Layout::new("t", &[2, 64], &[&[64, 1], &[64, 1]])?;
        let r = l.rows().expect("rows");
        assert_eq!((r.width, r.outer.rank, r.outer.shape[0]), (128, 1, 1));
        // channels_to_frames' permute out[c, t, j, hw] = in[j, c, t, hw] (C 3, T 2, HW 64): runs of
        // HW over (c, t) merged and j.
        let l = Layout::new(
            "t",
            &[3, 2, 2, 64],
            &[&[128, 64, 384, 1], &[256, 128, 64, 1]],
        )?;
        let r = l.rows().expect("rows");
        assert_eq!((r.width, r.outer.rank), (64, 2));
        // A transpose is not rows; nor are runs shorter than MIN_ROW.
        let l = Layout::new("t", &[64, 64], &[&[1, 64], &[64, 1]])?;
        assert_eq!(l.rows(), None);
        let l = Layout::new("t", &[4, 3], &[&[3, 1], &[6, 1]])?;
        assert_eq!(l.rows(), None);
        Ok(())
    }
}
