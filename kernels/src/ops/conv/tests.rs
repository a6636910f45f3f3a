//! Convolutions against a naive loop over an explicitly zero-padded input, chunked causal decoding
//! against the full sequence, and hand cases for the resampling ops.
//!
//! Tolerance: an output is a dot product over K = C_in·kt·kh·kw ≤ 81 taps plus a bias; f32 summation
//! error ≤ γ_K·Σ|x w| ≈ 81·6e-8·(0.64·81) ≈ 2.5e-4 as a worst case for N(0,1) data, far above the typical
//! ~1e-6; the f64 reference has no error to speak of. We allow atol 2.5e-4.

use super::*;
use crate::testing::{assert_close, assert_close_slices};
use crate::{DType, Device};

const ATOL: f32 = 2.5e-4;

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F32, seed, Device::Cpu).expect("randn")
}

/// Zero-pads x [B, C, T, H, W] explicitly: `front`/`back` frames/rows/cols per axis.
fn pad(x: &Tensor, front: [usize; 3], back: [usize; 3]) -> Result<(Vec<f32>, [usize; 5])> {
    let s = x.shape();
    let v = x.to_vec_f32()?;
    let dims = [
        s[0],
        s[1],
        s[2] + front[0] + back[0],
        s[3] + front[1] + back[1],
        s[4] + front[2] + back[2],
    ];
    let mut out = vec![0.0; dims.iter().product()];
    for b in 0..s[0] {
        for c in 0..s[1] {
            for t in 0..s[2] {
                for h in 0..s[3] {
                    for w in 0..s[4] {
                        let src = (((b * s[1] + c) * s[2] + t) * s[3] + h) * s[4] + w;
                        let (pt, ph, pw) = (t + front[0], h + front[1], w + front[2]);
                        out[(((b * dims[1] + c) * dims[2] + pt) * dims[3] + ph) * dims[4] + pw] =
                            v[src];
                    }
                }
            }
        }
    }
    Ok((out, dims))
}

/// "Valid" Conv3d of an already padded input, straight from the definition, in f64.
fn naive_valid_conv3d(
    (x, xd): (&[f32], [usize; 5]),
    w: &Tensor,
    bias: Option<&Tensor>,
    stride: [usize; 3],
) -> Result<(Vec<f32>, Vec<usize>)> {
    let ws = w.shape();
    let (wv, bv) = (w.to_vec_f32()?, bias.map(|b| b.to_vec_f32()).transpose()?);
    let out_dims: Vec<usize> = (0..3)
        .map(|a| (xd[2 + a] - ws[2 + a]) / stride[a] + 1)
        .collect();
    let mut out = Vec::new();
    for b in 0..xd[0] {
        for o in 0..ws[0] {
            for ot in 0..out_dims[0] {
                for oh in 0..out_dims[1] {
                    for ow in 0..out_dims[2] {
                        let mut acc = bv.as_ref().map_or(0.0, |bv| bv[o] as f64);
                        for c in 0..ws[1] {
                            for dt in 0..ws[2] {
                                for dh in 0..ws[3] {
                                    for dw in 0..ws[4] {
                                        let (it, ih, iw) = (
                                            ot * stride[0] + dt,
                                            oh * stride[1] + dh,
                                            ow * stride[2] + dw,
                                        );
                                        let xi = (((b * xd[1] + c) * xd[2] + it) * xd[3] + ih)
                                            * xd[4]
                                            + iw;
                                        let wi = (((o * ws[1] + c) * ws[2] + dt) * ws[3] + dh)
                                            * ws[4]
                                            + dw;
                                        acc += x[xi] as f64 * wv[wi] as f64;
                                    }
                                }
                            }
                        }
                        out.push(acc as f32);
                    }
                }
            }
        }
    }
    Ok((
        out,
        vec![xd[0], ws[0], out_dims[0], out_dims[1], out_dims[2]],
    ))
}

#[test]
fn conv3d_matches_naive_for_wan_kernels() -> Result<()> {
    // (kernel, stride, padding): VAE 3×3×3 / 1×1×1 / 3×1×1, the DiT patch embedding, a strided case.
    let cases = [
        ([3, 3, 3], [1, 1, 1], [1, 1, 1]),
        ([1, 1, 1], [1, 1, 1], [0, 0, 0]),
        ([3, 1, 1], [1, 1, 1], [1, 0, 0]),
        ([1, 2, 2], [1, 2, 2], [0, 0, 0]),
        ([3, 3, 3], [1, 2, 2], [0, 1, 1]),
    ];
    for (i, (kernel, stride, padding)) in cases.into_iter().enumerate() {
        let seed = 10 * i as u64;
        let x = randn(&[2, 3, 4, 6, 5], seed);
        let w = randn(&[4, 3, kernel[0], kernel[1], kernel[2]], seed + 1);
        let bias = randn(&[4], seed + 2);
        let out = conv3d(&x, &w, Some(&bias), stride, padding)?;
        let (padded, dims) = pad(&x, padding, padding)?;
        let (expect, shape) = naive_valid_conv3d((&padded, dims), &w, Some(&bias), stride)?;
        assert_eq!(out.shape(), shape.as_slice(), "case {i}");
        assert_close_slices(&out.to_vec_f32()?, &expect, ATOL, 0.0);
    }
    Ok(())
}

#[test]
fn causal_conv3d_pads_two_frames_in_front() -> Result<()> {
    for (kernel, front) in [([3, 3, 3], 2), ([3, 1, 1], 2), ([1, 1, 1], 0)] {
        let x = randn(&[1, 3, 5, 4, 6], 40);
        let w = randn(&[2, 3, kernel[0], kernel[1], kernel[2]], 41);
        let bias = randn(&[2], 42);
        let out = causal_conv3d(&x, &w, Some(&bias), None)?;
        assert_eq!(out.shape(), [1, 2, 5, 4, 6]);
        let spatial = [kernel[1] / 2, kernel[2] / 2];
        let (padded, dims) = pad(
            &x,
            [front, spatial[0], spatial[1]],
            [0, spatial[0], spatial[1]],
        )?;
        let (expect, _) = naive_valid_conv3d((&padded, dims), &w, Some(&bias), [1, 1, 1])?;
        assert_close_slices(&out.to_vec_f32()?, &expect, ATOL, 0.0);
    }
    Ok(())
}

#[test]
fn causal_conv3d_with_cache_equals_full_sequence() -> Result<()> {
    // Frame-at-a-time decoding: each chunk's conv sees the previous chunk's last frames as its cache.
    let x = randn(&[1, 3, 5, 4, 4], 50);
    let w = randn(&[2, 3, 3, 3, 3], 51);
    let bias = randn(&[2], 52);
    let full = causal_conv3d(&x, &w, Some(&bias), None)?;
    // Two cached frames.
    let tail = causal_conv3d(
        &x.narrow(2, 2, 3)?,
        &w,
        Some(&bias),
        Some(&x.narrow(2, 0, 2)?),
    )?;
    assert_close(&tail, &full.narrow(2, 2, 3)?, 1e-6, 0.0);
    // One cached frame (the decode after a 1-frame first chunk): one zero frame remains in front.
    let tail = causal_conv3d(
        &x.narrow(2, 1, 4)?,
        &w,
        Some(&bias),
        Some(&x.narrow(2, 0, 1)?),
    )?;
    assert_close(&tail, &full.narrow(2, 1, 4)?, 1e-6, 0.0);
    // Too many cached frames, or a cache of the wrong size, are errors.
    assert!(causal_conv3d(&x, &w, None, Some(&x.narrow(2, 0, 3)?)).is_err());
    assert!(causal_conv3d(&x, &w, None, Some(&randn(&[1, 3, 1, 4, 5], 53))).is_err());
    Ok(())
}

#[test]
fn conv3d_cached_pads_each_side_as_asked() -> Result<()> {
    // The parallel VAE's form: cache ++ x along T, one zero frame in front, none behind, no padding
    // along H (the halo rows are part of the input), one column each side along W; against the
    // naive conv of the explicitly padded concatenation.
    let cache = randn(&[1, 3, 1, 6, 5], 60);
    let x = randn(&[1, 3, 4, 6, 5], 61);
    let w = randn(&[2, 3, 3, 3, 3], 62);
    let bias = randn(&[2], 63);
    let pads = ([1, 0, 1], [0, 0, 1]);
    let out = conv3d_cached(&x, &w, Some(&bias), Some(&cache), None, pads, None)?;
    assert_eq!(out.shape(), [1, 2, 4, 4, 5]);
    let (padded, dims) = pad(&Tensor::concat(&[&cache, &x], 2)?, pads.0, pads.1)?;
    let (expect, _) = naive_valid_conv3d((&padded, dims), &w, Some(&bias), [1, 1, 1])?;
    assert_close_slices(&out.to_vec_f32()?, &expect, ATOL, 0.0);
    // Without a cache it is the plain conv of the padded x; a cache of another size is an error.
    let out = conv3d_cached(&x, &w, None, None, None, ([2, 1, 0], [0, 1, 0]), None)?;
    let (padded, dims) = pad(&x, [2, 1, 0], [0, 1, 0])?;
    let (expect, _) = naive_valid_conv3d((&padded, dims), &w, None, [1, 1, 1])?;
    assert_close_slices(&out.to_vec_f32()?, &expect, ATOL, 0.0);
    let wrong = randn(&[1, 3, 1, 5, 5], 64);
    assert!(conv3d_cached(&x, &w, None, Some(&wrong), None, pads, None).is_err());
    Ok(())
}

/// With a halo, the input is the halo's edges around cache ++ x along its axis (each edge holds the
/// cache's frames, then x's; a missing one is zeros), for rows and for columns, against the naive
/// conv of that explicit join; edges of the wrong shape, axis or extent are refused.
#[test]
fn conv3d_cached_reads_a_halo_around_the_band() -> Result<()> {
    let cache = randn(&[1, 3, 2, 4, 5], 65);
    let x = randn(&[1, 3, 3, 4, 5], 66);
    let w = randn(&[2, 3, 3, 3, 3], 67);
    let bias = randn(&[2], 68);
    for (axis, edge, pads) in [
        (3, [1, 3, 5, 1, 5], ([0, 0, 1], [0, 0, 1])),
        (4, [1, 3, 5, 4, 1], ([0, 1, 0], [0, 1, 0])),
    ] {
        let (before, after) = (randn(&edge, 69), randn(&edge, 70));
        let zeros = Tensor::zeros(&edge, DType::F32, Device::Cpu)?;
        // Both edges, and a border on either side (a missing edge is zeros).
        for (b, a) in [
            (Some(&before), Some(&after)),
            (None, Some(&after)),
            (Some(&before), None),
        ] {
            let halo = Halo {
                axis,
                extent: 1,
                before: b,
                after: a,
            };
            let out = conv3d_cached(&x, &w, Some(&bias), Some(&cache), Some(&halo), pads, None)?;
            let band = Tensor::concat(&[&cache, &x], 2)?;
            let joined = Tensor::concat(&[b.unwrap_or(&zeros), &band, a.unwrap_or(&zeros)], axis)?;
            let (padded, dims) = pad(&joined, pads.0, pads.1)?;
            let (expect, _) = naive_valid_conv3d((&padded, dims), &w, Some(&bias), [1, 1, 1])?;
            assert_eq!(out.shape(), [1, 2, 3, 4, 5], "axis {axis}");
            assert_close_slices(&out.to_vec_f32()?, &expect, ATOL, 0.0);
        }
        let short = before.narrow(2, 1, 4)?; // x's frames only: the cache's are missing
        let bad = Halo {
            before: Some(&short),
            after: None,
            axis,
            extent: 1,
        };
        assert!(conv3d_cached(&x, &w, None, Some(&cache), Some(&bad), pads, None).is_err());
    }
    let edge = randn(&[1, 3, 5, 1, 5], 71);
    let pads = ([0, 0, 1], [0, 0, 1]);
    for (axis, extent) in [(2, 1), (3, 0), (3, 2)] {
        let bad = Halo {
            axis,
            extent,
            before: Some(&edge),
            after: Some(&edge),
        };
        assert!(conv3d_cached(&x, &w, None, Some(&cache), Some(&bad), pads, None).is_err());
    }
    Ok(())
}

/// The upsampled conv with a halo of x's resolution is the conv of the explicit join, upsampled and
/// cut to the halo's extent (one upsampled row or column of each edge next to the band), bit for
/// bit: rows and columns, with and without cached frames, a missing edge (zeros), and its checks
/// (edges at the upsampled size are refused).
#[test]
fn conv3d_cached_upsampled_reads_the_halo_at_x_resolution() -> Result<()> {
    let x = randn(&[1, 3, 2, 4, 5], 72);
    let bias = randn(&[2], 73);
    for (axis, ws, cached) in [(3, [2, 3, 1, 3, 3], 0), (4, [2, 3, 3, 3, 3], 2)] {
        let w = randn(&ws, 74);
        let cache = (cached > 0).then(|| randn(&[1, 3, cached, 4, 5], 75));
        let mut edge = vec![1, 3, cached + 2, 4, 5];
        edge[axis] = 1;
        let (before, after) = (randn(&edge, 76), randn(&edge, 77));
        let zeros = Tensor::zeros(&edge, DType::F32, Device::Cpu)?;
        let mut pads = ([2 - cached.min(2), 1, 1], [0, 1, 1]);
        if ws[2] == 1 {
            pads.0[0] = 0;
        }
        pads.0[axis - 2] = 0;
        pads.1[axis - 2] = 0;
        for (b, a) in [(Some(&before), Some(&after)), (None, Some(&after))] {
            let halo = Halo {
                axis,
                extent: 1,
                before: b,
                after: a,
            };
            let out =
                conv3d_cached_upsampled(&x, &w, Some(&bias), cache.as_ref(), Some(&halo), pads)?;
            let band = match &cache {
                Some(c) => Tensor::concat(&[c, &x], 2)?,
                None => x.clone(),
            };
            let joined = Tensor::concat(&[b.unwrap_or(&zeros), &band, a.unwrap_or(&zeros)], axis)?;
            let up = upsample_nearest2x(&joined)?;
            let cut = up.narrow(axis, 1, up.shape()[axis] - 2)?;
            let expect = conv3d_cached(&cut, &w, Some(&bias), None, None, pads, None)?;
            assert_eq!(out.shape(), expect.shape(), "axis {axis}");
            assert_eq!(out.to_vec_f32()?, expect.to_vec_f32()?, "axis {axis}");
        }
        let upsampled_edge = upsample_nearest2x(&before)?;
        let bad = Halo {
            axis,
            extent: 1,
            before: Some(&upsampled_edge),
            after: None,
        };
        assert!(conv3d_cached_upsampled(&x, &w, None, cache.as_ref(), Some(&bad), pads).is_err());
    }
    Ok(())
}

/// With a residual (the parallel VAE's residual blocks) it is the conv then `add`, bit for bit, in
/// f32 and bf16; a residual of another shape is refused.
#[test]
fn conv3d_cached_residual_is_conv_then_add() -> Result<()> {
    let pads = ([1, 0, 1], [0, 0, 1]);
    for dtype in [DType::F32, DType::BF16] {
        let cache = Tensor::randn(&[1, 3, 1, 6, 5], dtype, 110, Device::Cpu)?;
        let x = Tensor::randn(&[1, 3, 2, 6, 5], dtype, 111, Device::Cpu)?;
        let w = Tensor::randn(&[4, 3, 3, 3, 3], dtype, 112, Device::Cpu)?;
        let b = Tensor::randn(&[4], DType::F32, 113, Device::Cpu)?;
        let r = Tensor::randn(&[1, 4, 2, 4, 5], dtype, 114, Device::Cpu)?;
        let fused = conv3d_cached(&x, &w, Some(&b), Some(&cache), None, pads, Some(&r))?;
        let conv = conv3d_cached(&x, &w, Some(&b), Some(&cache), None, pads, None)?;
        let composed = crate::add(&conv, &r)?;
        assert_eq!(fused.dtype(), dtype);
        assert_eq!(fused.to_vec_f32()?, composed.to_vec_f32()?, "{dtype:?}");
    }
    let x = randn(&[1, 3, 2, 6, 5], 115);
    let w = randn(&[4, 3, 3, 3, 3], 116);
    let wrong = randn(&[1, 4, 2, 6, 5], 117); // rows of the haloed input, not the output's
    let pads = ([2, 0, 1], [0, 0, 1]);
    assert!(conv3d_cached(&x, &w, None, None, None, pads, Some(&wrong)).is_err());
    Ok(())
}

#[test]
fn conv3d_channels_last_matches_naive() -> Result<()> {
    // x [B, T, H, W, C] and w [C_out, kt, kh, kw, C_in]: the naive loop runs on the channels-first
    // copies, and its output is read back channels-last.
    let x = randn(&[2, 4, 5, 6, 3], 30);
    let w = randn(&[4, 3, 3, 3, 3], 31);
    let bias = randn(&[4], 32);
    let (stride, padding) = ([1, 2, 1], [1, 1, 0]);
    let out = conv3d_channels_last(&x, &w, Some(&bias), stride, padding)?;
    let first = [0, 4, 1, 2, 3];
    let (padded, dims) = pad(&x.permute(&first)?, padding, padding)?;
    let (expect, shape) =
        naive_valid_conv3d((&padded, dims), &w.permute(&first)?, Some(&bias), stride)?;
    assert_eq!(
        out.shape(),
        [shape[0], shape[2], shape[3], shape[4], shape[1]]
    );
    let expect = Tensor::from_vec(expect, &shape)?.permute(&[0, 2, 3, 4, 1])?;
    assert_close(&out, &expect, ATOL, 0.0);
    // Channel counts of x and w must agree (C_in is the last axis of both).
    assert!(conv3d_channels_last(&x, &randn(&[4, 3, 3, 3, 2], 33), None, stride, padding).is_err());
    Ok(())
}

#[test]
fn conv2d_matches_naive() -> Result<()> {
    for (stride, padding) in [([1, 1], [1, 1]), ([2, 2], [1, 1]), ([1, 1], [0, 0])] {
        let x = randn(&[3, 4, 7, 6], 60);
        let w = randn(&[5, 4, 3, 3], 61);
        let bias = randn(&[5], 62);
        let out = conv2d(&x, &w, Some(&bias), stride, padding)?;
        // Naive: as a one-frame 3-D conv of the explicitly padded input.
        let x3 = x.reshape(&[3, 4, 1, 7, 6])?;
        let w3 = w.reshape(&[5, 4, 1, 3, 3])?;
        let (padded, dims) = pad(
            &x3,
            [0, padding[0], padding[1]],
            [0, padding[0], padding[1]],
        )?;
        let (expect, shape) =
            naive_valid_conv3d((&padded, dims), &w3, Some(&bias), [1, stride[0], stride[1]])?;
        assert_eq!(out.shape(), [shape[0], shape[1], shape[3], shape[4]]);
        assert_close_slices(&out.to_vec_f32()?, &expect, ATOL, 0.0);
    }
    Ok(())
}

#[test]
fn conv_shape_errors() {
    let x = randn(&[1, 3, 2, 4, 4], 70);
    let w = randn(&[2, 4, 3, 3, 3], 71);
    assert!(conv3d(&x, &w, None, [1, 1, 1], [1, 1, 1]).is_err());
    let w_even = randn(&[2, 3, 2, 2, 2], 72);
    assert!(causal_conv3d(&x, &w_even, None, None).is_err());
    let w_big = randn(&[2, 3, 1, 7, 7], 73);
    assert!(conv3d(&x, &w_big, None, [1, 1, 1], [0, 0, 0]).is_err());
}

/// `halo_edges` gives the first and last rows (columns) of cache ++ x, the cache's frames first, and
/// refuses an extent of 0 or past the band, another axis, and a cache of another size, naming them.
#[test]
fn halo_edges_are_the_joined_edges() -> Result<()> {
    let x = randn(&[1, 2, 2, 4, 5], 95);
    let cache = randn(&[1, 2, 1, 4, 5], 96);
    let joined = Tensor::concat(&[&cache, &x], 2)?;
    let (first, last) = halo_edges(Some(&cache), &x, 3, 1)?;
    assert_eq!(first.to_vec_f32()?, joined.narrow(3, 0, 1)?.to_vec_f32()?);
    assert_eq!(last.to_vec_f32()?, joined.narrow(3, 3, 1)?.to_vec_f32()?);
    let (first, last) = halo_edges(None, &x, 4, 2)?;
    assert_eq!(first.shape(), [1, 2, 2, 4, 2]);
    assert_eq!(last.to_vec_f32()?, x.narrow(4, 3, 2)?.to_vec_f32()?);
    for (axis, extent, what) in [(3, 0, "extent"), (3, 5, "extent"), (2, 1, "axis")] {
        let err = halo_edges(None, &x, axis, extent).unwrap_err().to_string();
        assert!(err.contains(what), "{err}");
    }
    let wrong = randn(&[1, 2, 1, 3, 5], 97);
    assert!(halo_edges(Some(&wrong), &x, 3, 1).is_err());
    Ok(())
}

/// The upsampled causal conv is the causal conv of the upsampled input (and cache), bit for bit, for
/// the upsamplers' 1×3×3 kernel and a 3×3×3 one with cached frames; its checks are the causal conv's.
#[test]
fn causal_conv3d_upsampled_is_upsample_then_conv() -> Result<()> {
    for (ws, cached) in [
        ([4, 3, 1, 3, 3], 0),
        ([4, 3, 3, 3, 3], 1),
        ([4, 3, 3, 3, 3], 2),
    ] {
        let x = randn(&[1, 3, 2, 3, 5], 90);
        let w = randn(&ws, 91);
        let b = randn(&[4], 92);
        let cache = (cached > 0).then(|| randn(&[1, 3, cached, 3, 5], 93));
        let up_cache = cache.as_ref().map(upsample_nearest2x).transpose()?;
        let fused = causal_conv3d_upsampled(&x, &w, Some(&b), cache.as_ref())?;
        let composed = causal_conv3d(&upsample_nearest2x(&x)?, &w, Some(&b), up_cache.as_ref())?;
        assert_eq!(fused.shape(), [1, 4, 2, 6, 10]);
        assert_eq!(
            fused.to_vec_f32()?,
            composed.to_vec_f32()?,
            "{ws:?} {cached}"
        );
    }
    let x = randn(&[1, 3, 2, 3, 5], 94);
    let w_even = randn(&[2, 3, 1, 2, 2], 95);
    assert!(causal_conv3d_upsampled(&x, &w_even, None, None).is_err());
    let w_wide = randn(&[2, 4, 1, 3, 3], 96);
    assert!(causal_conv3d_upsampled(&x, &w_wide, None, None).is_err());
    let bad_cache = randn(&[1, 3, 1, 6, 10], 97); // the cache is at x's size, not the upsampled one
    let w = randn(&[2, 3, 3, 3, 3], 98);
    assert!(causal_conv3d_upsampled(&x, &w, None, Some(&bad_cache)).is_err());
    assert!(causal_conv3d_upsampled(&randn(&[3, 5], 99), &w, None, None).is_err());
    Ok(())
}

/// The residual causal conv is the causal conv plus the residual through `add`, bit for bit, in f32
/// and bf16 (where the conv's result is rounded before the add, as stored), with and without cached
/// frames; a residual of another shape is refused.
#[test]
fn causal_conv3d_residual_is_conv_then_add() -> Result<()> {
    for dtype in [DType::F32, DType::BF16] {
        for cached in [0, 2] {
            let x = Tensor::randn(&[1, 3, 2, 4, 5], dtype, 100, Device::Cpu)?;
            let w = Tensor::randn(&[4, 3, 3, 3, 3], dtype, 101, Device::Cpu)?;
            let b = Tensor::randn(&[4], DType::F32, 102, Device::Cpu)?;
            let r = Tensor::randn(&[1, 4, 2, 4, 5], dtype, 103, Device::Cpu)?;
            let cache = (cached > 0)
                .then(|| Tensor::randn(&[1, 3, cached, 4, 5], dtype, 104, Device::Cpu))
                .transpose()?;
            let fused = causal_conv3d_residual(&x, &w, Some(&b), cache.as_ref(), &r)?;
            let composed = crate::add(&causal_conv3d(&x, &w, Some(&b), cache.as_ref())?, &r)?;
            assert_eq!(fused.dtype(), dtype);
            assert_eq!(
                fused.to_vec_f32()?,
                composed.to_vec_f32()?,
                "{dtype:?} {cached}"
            );
        }
    }
    let x = randn(&[1, 3, 2, 4, 5], 105);
    let w = randn(&[4, 3, 3, 3, 3], 106);
    let wrong = randn(&[1, 3, 2, 4, 5], 107); // x's shape, not the output's
    assert!(causal_conv3d_residual(&x, &w, None, None, &wrong).is_err());
    Ok(())
}

#[test]
fn upsample_nearest2x_hand_case() -> Result<()> {
    let x = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[1, 1, 2, 3])?;
    let up = upsample_nearest2x(&x)?;
    assert_eq!(up.shape(), [1, 1, 4, 6]);
    #[rustfmt::skip]
    let expect = [
        1., 1., 2., 2., 3., 3.,
        1., 1., 2., 2., 3., 3.,
        4., 4., 5., 5., 6., 6.,
        4., 4., 5., 5., 6., 6.,
    ];
    assert_eq!(up.to_vec_f32()?, expect);
    // Works on [B, C, T, H, W] directly, frame by frame.
    assert_eq!(
        upsample_nearest2x(&randn(&[1, 2, 3, 2, 2], 80))?.shape(),
        [1, 2, 3, 4, 4]
    );
    Ok(())
}

#[test]
fn channels_to_frames_interleaves_halves() -> Result<()> {
    // C = 1, T = 2: channel 0 frames [a0, a1], channel 1 frames [b0, b1] → frames [a0, b0, a1, b1].
    let x = Tensor::from_vec(vec![1.0, 2.0, 10.0, 20.0], &[1, 2, 2, 1, 1])?;
    let y = channels_to_frames(&x)?;
    assert_eq!(y.shape(), [1, 1, 4, 1, 1]);
    assert_eq!(y.to_vec_f32()?, [1.0, 10.0, 2.0, 20.0]);
    // General case: out[b, c, 2t + i, h, w] = x[b, i·C + c, t, h, w].
    let (b, c, t, h, w) = (2, 3, 2, 2, 3);
    let x = randn(&[b, 2 * c, t, h, w], 90);
    let (xv, yv) = (x.to_vec_f32()?, channels_to_frames(&x)?.to_vec_f32()?);
    for bi in 0..b {
        for ci in 0..c {
            for ti in 0..t {
                for i in 0..2 {
                    for p in 0..h * w {
                        let src = ((bi * 2 * c + i * c + ci) * t + ti) * h * w + p;
                        let dst = ((bi * c + ci) * 2 * t + 2 * ti + i) * h * w + p;
                        assert_eq!(yv[dst], xv[src]);
                    }
                }
            }
        }
    }
    assert!(channels_to_frames(&randn(&[1, 3, 1, 1, 1], 91)).is_err());
    Ok(())
}
