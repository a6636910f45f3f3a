//! Convolutions and resampling for the VAE (and the DiT's patch embedding): general Conv3d, Wan's causal
//! Conv3d with its cached previous frames, Conv2d, nearest ×2 upsampling, and the upsample3d step that
//! turns time_conv's doubled channels into doubled frames; plus a channels-last Conv3d, which measures
//! whether that layout would pay on a GPU (see [`conv3d_channels_last`]).
//!
//! On CUDA a convolution runs through im2col + cuBLASLt, cuDNN on our NCDHW tensors, or cuDNN on a
//! channels-last copy made and undone inside the call (`cuda.rs`; the choice is
//! `ditstream_kernels::cuda::ConvAlgo`, by default routed per kernel).

pub(crate) mod cpu;
#[cfg(feature = "cuda")]
pub(super) mod cuda;
#[cfg(test)]
mod tests;

#[cfg(not(feature = "cuda"))]
use super::unsupported;
use super::{dims, expect_rank, same_device};
use crate::{Device, KernelError, Result, Tensor};
use cpu::ConvGeometry;

/// Checks an input of shape `xs` = [B, C_in, T, H, W] against a filter of shape `ws` =
/// [C_out, C_in, kt, kh, kw] and bias [C_out] and returns the geometry with the given stride and
/// (front, back) padding per axis.
fn geometry(
    op: &'static str,
    xs: &[usize],
    ws: &[usize],
    bias: Option<&Tensor>,
    stride: [usize; 3],
    pad_front: [usize; 3],
    pad_back: [usize; 3],
) -> Result<ConvGeometry> {
    if xs.len() != 5 {
        return Err(KernelError::shape(
            op,
            "expected rank 5: x [B, C_in, T, H, W]",
            &[xs],
        ));
    }
    if ws.len() != 5 {
        return Err(KernelError::shape(
            op,
            "expected rank 5: w [C_out, C_in, kt, kh, kw]",
            &[ws],
        ));
    }
    let bias_ok = bias.is_none_or(|b| b.shape() == [ws[0]]);
    if ws[1] != xs[1] || !bias_ok {
        let mut shapes = vec![xs, ws];
        shapes.extend(bias.map(|b| b.shape()));
        return Err(KernelError::shape(
            op,
            "x [B, C_in, T, H, W], w [C_out, C_in, kt, kh, kw], bias [C_out]",
            &shapes,
        ));
    }
    if stride.contains(&0) {
        return Err(KernelError::arg(
            op,
            "stride",
            format!("{stride:?}"),
            "strides must be ≥ 1",
        ));
    }
    let input = [xs[2], xs[3], xs[4]];
    let kernel = [ws[2], ws[3], ws[4]];
    for axis in 0..3 {
        if input[axis] + pad_front[axis] + pad_back[axis] < kernel[axis] {
            return Err(KernelError::shape(
                op,
                format!(
                    "padded input is smaller than the kernel on axis {}",
                    axis + 2
                ),
                &[xs, ws],
            ));
        }
    }
    Ok(ConvGeometry {
        batch: xs[0],
        in_channels: xs[1],
        out_channels: ws[0],
        input,
        kernel,
        stride,
        pad_front,
        pad_back,
    })
}

/// Runs a checked geometry on the operands' device; output in x's dtype. The input the geometry
/// describes is `cache` (frames in front, optional, x's dtype) followed by x along T, nearest ×2
/// upsampled in H and W when `upsampled` (then x and the cache hold frames of half the geometry's H, W).
/// With `residual` (the output's shape, checked by the caller) the result is `add(conv, residual)`.
/// With `halo` (checked by the caller; not with `upsampled`), its edges sit around the cache and x
/// along its axis, and the geometry's extent there includes them.
#[allow(clippy::too_many_arguments)]
fn run(
    op: &'static str,
    cache: Option<&Tensor>,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    geometry: &ConvGeometry,
    upsampled: bool,
    residual: Option<&Tensor>,
    halo: Option<&Halo>,
) -> Result<Tensor> {
    let mut operands = vec![x, w];
    operands.extend(bias);
    operands.extend(cache);
    operands.extend(residual);
    operands.extend(
        halo.iter()
            .flat_map(|h| h.before.into_iter().chain(h.after)),
    );
    match same_device(op, &operands)? {
        Device::Cpu => {
            let input = match cache {
                Some(cache) => Tensor::concat(&[cache, x], 2)?,
                None => x.clone(),
            };
            // The definition: the band between its halos (each holds the cache's frames, then x's),
            // upsampled, then convolved (the CUDA path reads both in place).
            let input = match halo {
                Some(h) => h.joined(&input, x, cache.map_or(0, |c| c.shape()[2]), upsampled)?,
                None if upsampled => upsample_nearest2x(&input)?,
                None => input,
            };
            let bias = bias.map(|b| b.cpu_f32(op)).transpose()?;
            let out = cpu::conv3d(
                &input.cpu_f32(op)?,
                &w.cpu_f32(op)?,
                bias.as_deref(),
                geometry,
            );
            let out = Tensor::from_f32_cpu(out, &geometry.output_shape(), x.dtype())?;
            // The definition: the conv's stored result plus the residual, as the `add` op.
            residual.map_or(Ok(out.clone()), |r| crate::add(&out, r))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            cuda::conv3d(op, (cache, x, halo), w, bias, geometry, upsampled, residual)
        }
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => {
            let _ = upsampled;
            unsupported(op, device)
        }
    }
}

/// Conv3d with symmetric zero padding (PyTorch `nn.Conv3d`, dilation 1, groups 1):
/// x [B, C_in, T, H, W], w [C_out, C_in, kt, kh, kw], bias `[C_out]` →
/// [B, C_out, (T + 2p_t − kt)/s_t + 1, (H + 2p_h − kh)/s_h + 1, (W + 2p_w − kw)/s_w + 1], x's dtype.
/// The DiT's patch embedding is kernel = stride = (1, 2, 2), padding 0.
pub fn conv3d(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    stride: [usize; 3],
    padding: [usize; 3],
) -> Result<Tensor> {
    let geometry = geometry(
        "conv3d",
        x.shape(),
        w.shape(),
        bias,
        stride,
        padding,
        padding,
    )?;
    run("conv3d", None, x, w, bias, &geometry, false, None, None)
}

/// [`conv3d`] on channels-last tensors: x [B, T, H, W, C_in], w [C_out, kt, kh, kw, C_in], bias
/// `[C_out]` → [B, T_out, H_out, W_out, C_out] in x's dtype, with the sizes, stride and symmetric
/// padding of [`conv3d`]. By definition it equals permuting x and w to channels-first, [`conv3d`], and permuting
/// the result back, which is what the CPU does. On CUDA it is cuDNN with channels-last descriptors (an
/// error where cuDNN cannot be used): the measurement of whether a channels-last VAE would pay
/// (`bench/src/bin/conv.rs`); the models keep channels-first tensors.
pub fn conv3d_channels_last(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    stride: [usize; 3],
    padding: [usize; 3],
) -> Result<Tensor> {
    const OP: &str = "conv3d_channels_last";
    let xs = dims::<5>(OP, "x [B, T, H, W, C_in]", x)?;
    let ws = dims::<5>(OP, "w [C_out, kt, kh, kw, C_in]", w)?;
    let first = |[n, t, h, w, c]: [usize; 5]| [n, c, t, h, w];
    let geometry = geometry(OP, &first(xs), &first(ws), bias, stride, padding, padding)?;
    let mut operands = vec![x, w];
    operands.extend(bias);
    match same_device(OP, &operands)? {
        Device::Cpu => {
            let to_first = [0, 4, 1, 2, 3];
            let out = conv3d(
                &x.permute(&to_first)?,
                &w.permute(&to_first)?,
                bias,
                stride,
                padding,
            )?;
            out.permute(&[0, 2, 3, 4, 1])
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::conv3d_channels_last(OP, x, w, bias, &geometry),
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => {
            let _ = geometry;
            unsupported(OP, device)
        }
    }
}

/// Wan's causal Conv3d (diffusers `WanCausalConv3d`, stride 1, padding p = k/2 per axis for odd kernels:
/// 3×3×3, 1×1×1, 3×1×1): H and W are zero-padded by p on both sides, time by 2·p_t in front only, so
/// x [B, C_in, T, H, W] → [B, C_out, T, H, W] in x's dtype.
///
/// `cache` [B, C_in, T_c, H, W] with T_c ≤ 2·p_t holds the previous chunk's last input frames: they are
/// prepended to x and the front zero padding shrinks by T_c (frame-at-a-time decoding, wan.md §2.4).
pub fn causal_conv3d(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    cache: Option<&Tensor>,
) -> Result<Tensor> {
    causal("causal_conv3d", x, w, bias, cache, false, None)
}

/// [`causal_conv3d`] of the nearest ×2 upsampling of x (and of the cache) in H and W:
/// `causal_conv3d(&upsample_nearest2x(x)?, w, bias, upsampled cache)`, x [B, C_in, T, H, W] →
/// [B, C_out, T, 2H, 2W], with the same result bit for bit. The VAE's upsamplers run it (nearest ×2,
/// then a 3×3 conv per frame). On CUDA, where the convolution runs on a channels-last copy (cuDNN
/// NDHWC, the default for padded kernels), that copy reads x's pixels directly, so the upsampled
/// tensor (4× x) is never written nor read back; the other paths upsample first.
pub fn causal_conv3d_upsampled(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    cache: Option<&Tensor>,
) -> Result<Tensor> {
    causal("causal_conv3d_upsampled", x, w, bias, cache, true, None)
}

/// `add(&causal_conv3d(x, w, bias, cache)?, residual)`, bit for bit: the VAE residual block's
/// `conv2(h) + shortcut(x)`. `residual` has the output's shape [B, C_out, T, H, W] (any dtype; the sum
/// is in x's dtype, as `add`'s). On CUDA, where the conv runs channels-last in x's dtype and the
/// residual is stored in it, the add runs in the transpose back (`conv_from_ndhwc`'s epilogue, with
/// the conv's result rounded to x's dtype first, as stored): the conv's output is never written and
/// read back; elsewhere it is the `add` op.
pub fn causal_conv3d_residual(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    cache: Option<&Tensor>,
    residual: &Tensor,
) -> Result<Tensor> {
    causal(
        "causal_conv3d_residual",
        x,
        w,
        bias,
        cache,
        false,
        Some(residual),
    )
}

/// Shared body of [`causal_conv3d`] and [`causal_conv3d_upsampled`].
fn causal(
    op: &'static str,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    cache: Option<&Tensor>,
    upsampled: bool,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    expect_rank(op, "w [C_out, C_in, kt, kh, kw]", w, 5)?;
    let kernel = [w.shape()[2], w.shape()[3], w.shape()[4]];
    if kernel.iter().any(|k| k % 2 == 0) {
        return Err(KernelError::arg(
            op,
            "kernel",
            format!("{kernel:?}"),
            "causal padding needs odd kernel sizes",
        ));
    }
    let front_frames = kernel[0] - 1; // 2·p_t with p_t = kt/2
    let [p_h, p_w] = [kernel[1] / 2, kernel[2] / 2];
    let cached_frames = cache_frames(op, x, cache)?;
    if cached_frames > front_frames {
        return Err(KernelError::arg(
            op,
            "cache frames",
            cached_frames,
            format!("at most kt − 1 = {front_frames} frames can be cached"),
        ));
    }
    let mut input_shape = x.shape().to_vec();
    if upsampled && input_shape.len() == 5 {
        // The geometry is the upsampled input's (a rank error is reported by `geometry` below).
        input_shape[3] *= 2;
        input_shape[4] *= 2;
    }
    if let Some(frames) = input_shape.get_mut(2) {
        *frames += cached_frames; // x of another rank: `geometry` reports it
    }
    let geometry = geometry(
        op,
        &input_shape,
        w.shape(),
        bias,
        [1, 1, 1],
        [front_frames - cached_frames, p_h, p_w],
        [0, p_h, p_w],
    )?;
    if let Some(r) = residual
        && r.shape() != geometry.output_shape()
    {
        return Err(KernelError::shape(
            op,
            "residual must have the convolution's output shape [B, C_out, T, H, W]",
            &[x.shape(), w.shape(), r.shape()],
        ));
    }
    run(op, cache, x, w, bias, &geometry, upsampled, residual, None)
}

/// The frames of `cache` [B, C_in, T_c, H, W] (0 without one), checked against x [B, C_in, T, H, W]:
/// the same sizes except in T, the same dtype.
fn cache_frames(op: &'static str, x: &Tensor, cache: Option<&Tensor>) -> Result<usize> {
    let Some(cache) = cache else {
        return Ok(0);
    };
    expect_rank(op, "cache [B, C_in, T_c, H, W]", cache, 5)?;
    let (cs, xs) = (cache.shape(), x.shape());
    if x.rank() != 5 || [cs[0], cs[1], cs[3], cs[4]] != [xs[0], xs[1], xs[3], xs[4]] {
        return Err(KernelError::shape(
            op,
            "cache [B, C_in, T_c, H, W] must match x [B, C_in, T, H, W] except in T",
            &[xs, cs],
        ));
    }
    if cache.dtype() != x.dtype() {
        return Err(KernelError::DTypeMismatch {
            op,
            name: "cache",
            expected: x.dtype(),
            got: cache.dtype(),
        });
    }
    Ok(cs[2])
}

/// Halo rows (or columns) around a band of a frame along one spatial axis: the parallel VAE's
/// neighbours' edges, joined to a band for [`conv3d_cached`] without a copy of the band.
#[derive(Debug, Clone, Copy)]
pub struct Halo<'a> {
    /// The split axis of [B, C, T, H, W]: 3 (rows) or 4 (columns).
    pub axis: usize,
    /// Rows (columns) on each side, e ≥ 1.
    pub extent: usize,
    /// The rows (columns) before the band, [B, C_in, T_c + T, e, W] (axis 3) or
    /// [B, C_in, T_c + T, H, e] (axis 4): the cache's T_c frames first, then x's T. `None`: zeros
    /// (the image's border), never written. For [`conv3d_cached_upsampled`] the edges are of x's
    /// resolution, ⌈e/2⌉ rows (columns): the conv reads the e of their ×2 upsampling next to the band.
    pub before: Option<&'a Tensor>,
    /// The rows (columns) after the band, shaped as `before`; `None`: zeros.
    pub after: Option<&'a Tensor>,
}

impl Halo<'_> {
    /// Rows (columns) each edge holds: the extent, or ⌈extent/2⌉ of x's resolution for an
    /// `upsampled` conv.
    fn edge_rows(&self, upsampled: bool) -> usize {
        if upsampled {
            self.extent.div_ceil(2)
        } else {
            self.extent
        }
    }

    /// The shape of an edge around x [B, C_in, T, H, W] with `cached` frames in front.
    fn edge_shape(&self, x: &Tensor, cached: usize, upsampled: bool) -> Vec<usize> {
        let mut shape = x.shape().to_vec();
        shape[2] += cached;
        shape[self.axis] = self.edge_rows(upsampled);
        shape
    }

    /// The edge before (0) or after (1) as a tensor of `dtype` on `device`: zeros where it is `None`.
    fn edge_or_zeros(
        &self,
        side: usize,
        x: &Tensor,
        cached: usize,
        (dtype, upsampled): (crate::DType, bool),
    ) -> Result<Tensor> {
        match [self.before, self.after][side] {
            Some(edge) => edge.to_dtype(dtype),
            None => Tensor::zeros(&self.edge_shape(x, cached, upsampled), dtype, x.device()),
        }
    }

    /// The definition, on any device: `input` [B, C, T_c + T, H, W] (cache ++ x) between the edges
    /// (zeros for a missing one) along the axis, upsampled ×2 when `upsampled` and then cut to
    /// `extent` upsampled rows (columns) on each side.
    fn joined(&self, input: &Tensor, x: &Tensor, cached: usize, upsampled: bool) -> Result<Tensor> {
        let dtype = (input.dtype(), upsampled);
        let before = self.edge_or_zeros(0, x, cached, dtype)?;
        let after = self.edge_or_zeros(1, x, cached, dtype)?;
        let joined = Tensor::concat(&[&before, input, &after], self.axis)?;
        if !upsampled {
            return Ok(joined);
        }
        let up = upsample_nearest2x(&joined)?;
        let extra = 2 * self.edge_rows(true) - self.extent; // upsampled rows past the extent
        up.narrow(self.axis, extra, up.shape()[self.axis] - 2 * extra)
    }
}

/// What a parallel-VAE rank sends its neighbours before a conv: the first and the last `extent` rows
/// (axis 3) or columns (axis 4) of `cache` [B, C, T_c, H, W] (optional) followed by x [B, C, T, H, W]
/// along T → (first, last), each [B, C, T_c + T, e, W] or [B, C, T_c + T, H, e], the cache's frames
/// first: a neighbour's [`Halo`] edges. On the GPU both come from one kernel (the narrows and the
/// join along T would take six copies).
pub fn halo_edges(
    cache: Option<&Tensor>,
    x: &Tensor,
    axis: usize,
    extent: usize,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "halo_edges";
    expect_rank(OP, "x [B, C, T, H, W]", x, 5)?;
    let cached = cache_frames(OP, x, cache)?;
    if axis != 3 && axis != 4 {
        return Err(KernelError::arg(
            OP,
            "axis",
            axis,
            "a halo lies along H (3) or W (4)",
        ));
    }
    let along = x.shape()[axis];
    if extent == 0 || extent > along {
        return Err(KernelError::arg(
            OP,
            "extent",
            extent,
            format!("between 1 and x's {along} along axis {axis}"),
        ));
    }
    let cache = cache.filter(|_| cached > 0);
    match x.device() {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::halo_edges(OP, cache, x, axis, extent),
        _ => {
            let edge = |start: usize| -> Result<Tensor> {
                let rows = x.narrow(axis, start, extent)?;
                match cache {
                    Some(c) => Tensor::concat(&[&c.narrow(axis, start, extent)?, &rows], 2),
                    None => Ok(rows),
                }
            };
            Ok((edge(0)?, edge(along - extent)?))
        }
    }
}

/// Checks `halo` against x [B, C_in, T, H, W] and the cache's `cached` frames; returns its extent e.
fn halo_extent(
    op: &'static str,
    x: &Tensor,
    cached: usize,
    halo: &Halo,
    upsampled: bool,
) -> Result<usize> {
    if halo.axis != 3 && halo.axis != 4 {
        return Err(KernelError::arg(
            op,
            "halo.axis",
            halo.axis,
            "a halo lies along H (3) or W (4)",
        ));
    }
    if halo.extent == 0 {
        return Err(KernelError::arg(
            op,
            "halo.extent",
            0,
            "a halo has at least one row (column) on each side",
        ));
    }
    let expected = halo.edge_shape(x, cached, upsampled);
    for (name, edge) in [("halo.before", halo.before), ("halo.after", halo.after)] {
        let Some(t) = edge else { continue };
        if t.shape() != expected.as_slice() {
            return Err(KernelError::shape(
                op,
                "halo edges must be [B, C_in, T_c + T, e, W] (axis 3) or [B, C_in, T_c + T, H, e] \
                 (axis 4)",
                &[x.shape(), t.shape(), &expected],
            ));
        }
        if t.dtype() != x.dtype() {
            return Err(KernelError::DTypeMismatch {
                op,
                name,
                expected: x.dtype(),
                got: t.dtype(),
            });
        }
    }
    Ok(halo.extent)
}

/// Conv3d, stride 1, of `cache` [B, C_in, T_c, H, W] (frames in front, optional) followed by
/// x [B, C_in, T, H, W] along T, with `halo`'s edges (optional) before and after along its axis, then
/// zero-padded by `pad_front` before and `pad_back` after each of T, H, W: → [B, C_out,
/// T_c + T + front + back − kt + 1, …] in x's dtype, plus `residual` (the output's shape, optional).
/// [`causal_conv3d`] is the case front = (kt − 1 − T_c, kh/2, kw/2), back = (0, kh/2, kw/2) without
/// a halo; the parallel VAE passes its neighbours' rows as the halo, with no padding on the split
/// axis. Frames and halos are joined as [`causal_conv3d`] joins the cache (read in place, or in the one
/// copy a cuDNN path makes anyway), and the residual is added as [`causal_conv3d_residual`] adds it, so
/// equal inputs give the bits that concatenating them, calling [`conv3d`] and `add` give.
pub fn conv3d_cached(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    cache: Option<&Tensor>,
    halo: Option<&Halo>,
    (pad_front, pad_back): ([usize; 3], [usize; 3]),
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    const OP: &str = "conv3d_cached";
    let geometry = cached_geometry(OP, (x, cache, halo, false), w, bias, (pad_front, pad_back))?;
    if let Some(residual) = residual
        && residual.shape() != geometry.output_shape()
    {
        return Err(KernelError::shape(
            OP,
            "residual must have the convolution's output shape [B, C_out, T, H, W]",
            &[x.shape(), w.shape(), residual.shape()],
        ));
    }
    run(OP, cache, x, w, bias, &geometry, false, residual, halo)
}

/// [`conv3d_cached`] of the nearest ×2 upsampling (in H and W) of cache ++ x, with `halo`'s edges
/// of x's resolution (⌈e/2⌉ rows or columns each, see [`Halo`]): the input is the upsampled band
/// between the e upsampled rows (columns) next to it on each side, then padded; → [B, C_out, …] of
/// that input's geometry, in x's dtype. The parallel VAE's upsampling convs: the neighbours send
/// their edge rows before the upsampling (a quarter of the upsampled rows' bytes) and, on the CUDA
/// channels-last path, the transpose reads the upsampling and the halo in place (neither the
/// upsampled band nor the join is written). Equal inputs give the bits of upsampling the explicit
/// join, cutting it to e rows per side and calling [`conv3d_cached`].
pub fn conv3d_cached_upsampled(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    cache: Option<&Tensor>,
    halo: Option<&Halo>,
    (pad_front, pad_back): ([usize; 3], [usize; 3]),
) -> Result<Tensor> {
    const OP: &str = "conv3d_cached_upsampled";
    let geometry = cached_geometry(OP, (x, cache, halo, true), w, bias, (pad_front, pad_back))?;
    run(OP, cache, x, w, bias, &geometry, true, None, halo)
}

/// The geometry of [`conv3d_cached`] (or, `upsampled`, [`conv3d_cached_upsampled`]): stride 1 over
/// cache ++ x along T (upsampled ×2 in H and W), with the halo's extent on each side of its axis,
/// then padded; the arguments checked.
fn cached_geometry(
    op: &'static str,
    (x, cache, halo, upsampled): (&Tensor, Option<&Tensor>, Option<&Halo>, bool),
    w: &Tensor,
    bias: Option<&Tensor>,
    (pad_front, pad_back): ([usize; 3], [usize; 3]),
) -> Result<ConvGeometry> {
    expect_rank(op, "x [B, C_in, T, H, W]", x, 5)?;
    let cached = cache_frames(op, x, cache)?;
    let scale = if upsampled { 2 } else { 1 };
    let mut input_shape = x.shape().to_vec();
    input_shape[2] += cached;
    input_shape[3] *= scale;
    input_shape[4] *= scale;
    if let Some(halo) = halo {
        input_shape[halo.axis] += 2 * halo_extent(op, x, cached, halo, upsampled)?;
    }
    geometry(
        op,
        &input_shape,
        w.shape(),
        bias,
        [1, 1, 1],
        pad_front,
        pad_back,
    )
}

/// Conv2d with symmetric zero padding (PyTorch `nn.Conv2d`, dilation 1, groups 1):
/// x [N, C_in, H, W], w [C_out, C_in, kh, kw], bias `[C_out]` →
/// [N, C_out, (H + 2p_h − kh)/s_h + 1, (W + 2p_w − kw)/s_w + 1] in x's dtype. The VAE's per-frame 3×3
/// resample conv is stride 1, padding 1 on x reshaped to [B·T, C, H, W].
pub fn conv2d(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    stride: [usize; 2],
    padding: [usize; 2],
) -> Result<Tensor> {
    const OP: &str = "conv2d";
    expect_rank(OP, "x [N, C_in, H, W]", x, 4)?;
    expect_rank(OP, "w [C_out, C_in, kh, kw]", w, 4)?;
    let (xs, ws) = (x.shape(), w.shape());
    // A 2-D conv is a 3-D conv over a single frame with a single-frame kernel.
    let x3 = x.reshape(&[xs[0], xs[1], 1, xs[2], xs[3]])?;
    let w3 = w.reshape(&[ws[0], ws[1], 1, ws[2], ws[3]])?;
    let pad = [0, padding[0], padding[1]];
    let geometry = geometry(
        OP,
        x3.shape(),
        w3.shape(),
        bias,
        [1, stride[0], stride[1]],
        pad,
        pad,
    )?;
    let out = run(OP, None, &x3, &w3, bias, &geometry, false, None, None)?;
    let os = out.shape();
    out.reshape(&[os[0], os[1], os[3], os[4]])
}

/// Nearest-neighbour ×2 upsampling of the last two dims (PyTorch `nearest-exact` at factor 2:
/// out[.., i, j] = x[.., ⌊i/2⌋, ⌊j/2⌋]): x [.., H, W] → [.., 2H, 2W] in x's dtype.
pub fn upsample_nearest2x(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "upsample_nearest2x";
    if x.rank() < 2 {
        return Err(KernelError::shape(
            OP,
            "x must be [.., H, W] (rank ≥ 2)",
            &[x.shape()],
        ));
    }
    let (h, w) = (x.shape()[x.rank() - 2], x.shape()[x.rank() - 1]);
    let mut out_shape = x.shape().to_vec();
    let rank = out_shape.len();
    out_shape[rank - 2] = 2 * h;
    out_shape[rank - 1] = 2 * w;
    match x.device() {
        Device::Cpu => {
            let out = cpu::upsample_nearest2x(&x.cpu_f32(OP)?, h, w);
            Tensor::from_f32_cpu(out, &out_shape, x.dtype())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let images = x.numel().checked_div(h * w).unwrap_or(0);
            cuda::upsample_nearest2x(OP, x, (images, h, w), &out_shape)
        }
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => unsupported(OP, device),
    }
}

/// Upsample3d's reshape after time_conv: channels `[0:C]` become frames 2i and channels `[C:2C]`
/// frames 2i+1: x [B, 2C, T, H, W] → [B, C, 2T, H, W] (diffusers: reshape to [B, 2, C, T, H, W], stack the two
/// halves on a new axis after T, merge). A reshape and one permute: on a GPU the permute is the strided
/// copy kernel, so this needs no kernel of its own.
pub fn channels_to_frames(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "channels_to_frames";
    let [b, c2, t, h, w] = dims(OP, "x [B, 2C, T, H, W]", x)?;
    if c2 % 2 != 0 {
        return Err(KernelError::shape(
            OP,
            "the channel count must be even (x [B, 2C, T, H, W])",
            &[x.shape()],
        ));
    }
    let c = c2 / 2;
    // [B, 2, C, T, H, W] → [B, C, T, 2, H, W] → [B, C, 2T, H, W]
    x.reshape(&[b, 2, c, t, h, w])?
        .permute(&[0, 2, 3, 1, 4, 5])?
        .reshape(&[b, c, 2 * t, h, w])
}
