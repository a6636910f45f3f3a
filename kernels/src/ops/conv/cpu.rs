//! CPU reference convolution: im2col one output frame at a time (bounded memory), then a GEMM with the
//! weights viewed as [C_out, C_in·kt·kh·kw]. Plus nearest ×2 upsampling.

use crate::ops::matmul::cpu::{MatRef, gemm};

/// Sizes of one Conv3d call; padding may differ front and back (causal time padding).
pub(super) struct ConvGeometry {
    pub batch: usize,
    pub in_channels: usize,
    pub out_channels: usize,
    /// [T, H, W] of the input.
    pub input: [usize; 3],
    /// [kt, kh, kw].
    pub kernel: [usize; 3],
    pub stride: [usize; 3],
    pub pad_front: [usize; 3],
    pub pad_back: [usize; 3],
}

impl ConvGeometry {
    /// [T_out, H_out, W_out]. The caller has checked that each padded axis is at least the kernel.
    pub fn output(&self) -> [usize; 3] {
        std::array::from_fn(|a| {
            (self.input[a] + self.pad_front[a] + self.pad_back[a] - self.kernel[a]) / self.stride[a]
                + 1
        })
    }

    /// [B, C_out, T_out, H_out, W_out].
    pub fn output_shape(&self) -> Vec<usize> {
        let [t, h, w] = self.output();
        vec![self.batch, self.out_channels, t, h, w]
    }
}

/// Input index for output index `o` and kernel tap `k` on one axis, or None inside the zero padding.
fn source_index(o: usize, k: usize, stride: usize, pad_front: usize, len: usize) -> Option<usize> {
    (o * stride + k).checked_sub(pad_front).filter(|&i| i < len)
}

/// x [B, C_in, T, H, W], w [C_out, C_in, kt, kh, kw], bias [C_out] → [B, C_out, T_out, H_out, W_out].
pub(super) fn conv3d(x: &[f32], w: &[f32], bias: Option<&[f32]>, g: &ConvGeometry) -> Vec<f32> {
    let [t_in, h_in, w_in] = g.input;
    let [kt, kh, kw] = g.kernel;
    let [t_out, h_out, w_out] = g.output();
    let plane = h_out * w_out;
    let taps = g.in_channels * kt * kh * kw;
    let mut out = vec![0.0; g.batch * g.out_channels * t_out * plane];
    // col[tap][pixel]: for each kernel tap (c, dt, dh, dw), the input value under each output pixel.
    let mut col = vec![0.0; taps * plane];
    for b in 0..g.batch {
        let image = &x[b * g.in_channels * t_in * h_in * w_in..];
        for ot in 0..t_out {
            for c in 0..g.in_channels {
                for dt in 0..kt {
                    let it = source_index(ot, dt, g.stride[0], g.pad_front[0], t_in);
                    for dh in 0..kh {
                        for dw in 0..kw {
                            let tap = ((c * kt + dt) * kh + dh) * kw + dw;
                            let row = &mut col[tap * plane..(tap + 1) * plane];
                            let Some(it) = it else {
                                row.fill(0.0); // a padded frame
                                continue;
                            };
                            let frame = &image[(c * t_in + it) * h_in * w_in..];
                            for oh in 0..h_out {
                                let ih = source_index(oh, dh, g.stride[1], g.pad_front[1], h_in);
                                for ow in 0..w_out {
                                    let iw =
                                        source_index(ow, dw, g.stride[2], g.pad_front[2], w_in);
                                    row[oh * w_out + ow] = match (ih, iw) {
                                        (Some(ih), Some(iw)) => frame[ih * w_in + iw],
                                        _ => 0.0,
                                    };
                                }
                            }
                        }
                    }
                }
            }
            // out[b, :, ot, :, :] as [C_out, plane] with rows t_out·plane apart = w · col.
            let offset = (b * g.out_channels * t_out + ot) * plane;
            gemm(
                MatRef::row_major(w, g.out_channels, taps),
                MatRef::row_major(&col, taps, plane),
                &mut out[offset..],
                t_out * plane,
                false,
            );
        }
    }
    if let Some(bias) = bias {
        let volume = t_out * plane;
        for (i, channel) in out.chunks_exact_mut(volume.max(1)).enumerate() {
            let value = bias[i % g.out_channels];
            channel.iter_mut().for_each(|v| *v += value);
        }
    }
    out
}

/// x [.., H, W] → [.., 2H, 2W] with out[i][j] = x[i/2][j/2].
pub(super) fn upsample_nearest2x(x: &[f32], h: usize, w: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(4 * x.len());
    for image in x.chunks_exact((h * w).max(1)) {
        for i in 0..2 * h {
            let src_row = &image[(i / 2) * w..(i / 2 + 1) * w];
            for j in 0..2 * w {
                out.push(src_row[j / 2]);
            }
        }
    }
    out
}
