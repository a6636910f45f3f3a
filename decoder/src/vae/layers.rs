//! The decoder's building blocks (diffusers `autoencoder_kl_wan.py`, one struct per module): the
//! causal conv with its frame cache, the channel RMS norm, the residual block, the mid-block
//! attention, the upsampler (`WanResample`), and the up and mid blocks that group them.
//!
//! Every block runs on a chunk of frames x [B, C, T, H, W] inside a [`Pass`], which carries the
//! stream's cache slots and the [`SpatialOps`] that perform convolutions and attention.
//!
//! Cache semantics (wan.md §2.4). diffusers decodes one latent frame at a time and each 3×3×3 conv
//! keeps the last 2 frames of its input; with the cache prepended and the zero front padding shrunk to
//! match, each such conv **equals a causal conv over the layer's whole frame sequence with 2 zero frames
//! in front**. Here a chunk may hold any number of frames and the cache holds the last ≤ 2 input frames
//! seen, which is that same function, so decoding is identical however the latent is cut into chunks.
//! The exception is upsample3d's `time_conv`: the layer's first frame (from latent frame 0) bypasses it
//! (diffusers' "Rep" slot), and it runs as a causal conv with 2 zero frames in front over the frames
//! after that one only (chunk 1 pads with zeros: chunk 0 is not history).

use ditstream_kernels::{
    Tensor, add, channels_to_frames, rms_norm_channels, rms_norm_channels_silu, upsample_nearest2x,
};

use super::config::{UpBlockLayout, UpsampleMode};
use super::error::Result;
use super::spatial::SpatialOps;
use super::weights::Prefixed;

/// One forward pass over a chunk: the stream's cache slots and where neighbourhood ops run.
pub(crate) struct Pass<'a> {
    /// Performs every convolution and the frame attention.
    pub ops: &'a dyn SpatialOps,
    /// One slot per cached conv (see [`SlotCounter`]); each holds that conv's last ≤ kt − 1 input frames.
    pub caches: &'a mut [Option<Tensor>],
    /// The chunk holds the stream's first latent frame (upsample3d's bypass rule).
    pub first_chunk: bool,
}

/// Hands out cache slot numbers while the decoder is built, one per conv with a time extent.
#[derive(Debug, Default)]
pub(crate) struct SlotCounter(usize);

impl SlotCounter {
    fn next(&mut self) -> usize {
        self.0 += 1;
        self.0 - 1
    }

    /// Slots handed out so far.
    pub(crate) fn count(&self) -> usize {
        self.0
    }
}

/// diffusers `WanCausalConv3d`: weight [C_out, C_in, kt, kh, kw], bias [C_out]; a conv with kt > 1
/// owns a cache slot.
pub(crate) struct CausalConv {
    weight: Tensor,
    bias: Tensor,
    /// Frames of history the conv reads: kt − 1.
    history: usize,
    slot: Option<usize>,
}

impl CausalConv {
    /// Loads `{w}.weight` [c_out, c_in, kernel..] and `{w}.bias` [c_out]; takes a cache slot if kt > 1.
    pub(crate) fn load(
        w: &Prefixed,
        c_in: usize,
        c_out: usize,
        kernel: [usize; 3],
        slots: &mut SlotCounter,
    ) -> Result<Self> {
        let weight = w.get("weight", &[c_out, c_in, kernel[0], kernel[1], kernel[2]])?;
        Self::with_weight(w, weight, slots)
    }

    /// A Conv2d checkpoint weight [c_out, c_in, kh, kw] run as a kt = 1 causal conv (per frame).
    pub(crate) fn load_2d(
        w: &Prefixed,
        c_in: usize,
        c_out: usize,
        kernel: [usize; 2],
        slots: &mut SlotCounter,
    ) -> Result<Self> {
        let weight = w
            .get("weight", &[c_out, c_in, kernel[0], kernel[1]])?
            .reshape(&[c_out, c_in, 1, kernel[0], kernel[1]])?;
        Self::with_weight(w, weight, slots)
    }

    fn with_weight(w: &Prefixed, weight: Tensor, slots: &mut SlotCounter) -> Result<Self> {
        let (c_out, kt) = (weight.shape()[0], weight.shape()[2]);
        let bias = w.get("bias", &[c_out])?;
        let history = kt - 1;
        Ok(CausalConv {
            weight,
            bias,
            history,
            slot: (history > 0).then(|| slots.next()),
        })
    }

    /// x [B, C_in, T, H, W] → [B, C_out, T, H, W]: the cached frames (if any) stand in front of x in
    /// place of zero padding; afterwards the slot keeps the last `history` frames of cache ++ x.
    pub(crate) fn forward(&self, pass: &mut Pass, x: &Tensor) -> Result<Tensor> {
        self.forward_with(pass, x, None)
    }

    /// `add(&self.forward(pass, x)?, residual)`, bit for bit, with the add in the conv's epilogue
    /// where the ops can (see [`SpatialOps::causal_conv3d_residual`]).
    pub(crate) fn forward_residual(
        &self,
        pass: &mut Pass,
        x: &Tensor,
        residual: &Tensor,
    ) -> Result<Tensor> {
        self.forward_with(pass, x, Some(residual))
    }

    fn forward_with(
        &self,
        pass: &mut Pass,
        x: &Tensor,
        residual: Option<&Tensor>,
    ) -> Result<Tensor> {
        let conv = |pass: &mut Pass, cache: Option<&Tensor>| match residual {
            None => pass
                .ops
                .causal_conv3d(x, &self.weight, Some(&self.bias), cache),
            Some(r) => pass
                .ops
                .causal_conv3d_residual(x, &self.weight, Some(&self.bias), cache, r),
        };
        let Some(slot) = self.slot else {
            return conv(pass, None);
        };
        let cache = pass.caches[slot].take();
        let out = conv(pass, cache.as_ref())?;
        pass.caches[slot] = Some(last_frames(cache.as_ref(), x, self.history)?);
        Ok(out)
    }

    /// `forward(pass, &upsample_nearest2x(x)?)`, bit for bit, for a conv without a time extent (the
    /// upsamplers' per-frame 3×3 conv): x [B, C_in, T, H, W] → [B, C_out, T, 2H, 2W] with the
    /// upsampling read in place by the conv where the ops can (see
    /// [`SpatialOps::causal_conv3d_upsampled`]); a conv with a cache slot upsamples first.
    pub(crate) fn forward_upsampled(&self, pass: &mut Pass, x: &Tensor) -> Result<Tensor> {
        match self.slot {
            None => pass
                .ops
                .causal_conv3d_upsampled(x, &self.weight, Some(&self.bias)),
            Some(_) => self.forward(pass, &upsample_nearest2x(x)?),
        }
    }
}

/// The last min(keep, frames available) frames of cache ++ x, along T (axis 2).
fn last_frames(cache: Option<&Tensor>, x: &Tensor, keep: usize) -> Result<Tensor> {
    let t = x.shape()[2];
    if t >= keep {
        return Ok(x.narrow(2, t - keep, keep)?);
    }
    let joined = match cache {
        Some(cache) => Tensor::concat(&[cache, x], 2)?,
        None => x.clone(),
    };
    let n = joined.shape()[2];
    let keep = keep.min(n);
    Ok(joined.narrow(2, n - keep, keep)?)
}

/// diffusers `WanRMS_norm` (channel-first, no bias): x / max(‖x‖₂ over C, 1e-12) · √C · γ per pixel.
pub(crate) struct RmsNorm {
    gamma: Tensor,
}

impl RmsNorm {
    /// Loads `{w}.gamma` with the checkpoint's shape ([C, 1, 1, 1], or [C, 1, 1] in attention).
    pub(crate) fn load(w: &Prefixed, shape: &[usize]) -> Result<Self> {
        Ok(RmsNorm {
            gamma: w.get("gamma", shape)?,
        })
    }

    /// x [B, C, ..] → same shape.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(rms_norm_channels(x, &self.gamma, None)?)
    }

    /// SiLU(norm(x)) in one pass, bit-identical to `silu(&self.forward(x)?)` (the norm is rounded to
    /// x's dtype in between, as when stored): the normalised tensor is never written to memory.
    pub(crate) fn forward_silu(&self, x: &Tensor) -> Result<Tensor> {
        Ok(rms_norm_channels_silu(x, &self.gamma, None)?)
    }
}

/// diffusers `WanResidualBlock` (dropout 0): conv2(SiLU(norm2(conv1(SiLU(norm1(x)))))) + shortcut(x),
/// 3×3×3 causal convs, shortcut a 1×1×1 conv when the width changes.
pub(crate) struct ResidualBlock {
    norm1: RmsNorm,
    conv1: CausalConv,
    norm2: RmsNorm,
    conv2: CausalConv,
    shortcut: Option<CausalConv>,
}

impl ResidualBlock {
    pub(crate) fn load(
        w: &Prefixed,
        in_dim: usize,
        out_dim: usize,
        slots: &mut SlotCounter,
    ) -> Result<Self> {
        Ok(ResidualBlock {
            norm1: RmsNorm::load(&w.pp("norm1"), &[in_dim, 1, 1, 1])?,
            conv1: CausalConv::load(&w.pp("conv1"), in_dim, out_dim, [3, 3, 3], slots)?,
            norm2: RmsNorm::load(&w.pp("norm2"), &[out_dim, 1, 1, 1])?,
            conv2: CausalConv::load(&w.pp("conv2"), out_dim, out_dim, [3, 3, 3], slots)?,
            shortcut: (in_dim != out_dim)
                .then(|| {
                    CausalConv::load(&w.pp("conv_shortcut"), in_dim, out_dim, [1, 1, 1], slots)
                })
                .transpose()?,
        })
    }

    /// x [B, in_dim, T, H, W] → [B, out_dim, T, H, W].
    pub(crate) fn forward(&self, pass: &mut Pass, x: &Tensor) -> Result<Tensor> {
        let residual = match &self.shortcut {
            Some(conv) => conv.forward(pass, x)?,
            None => x.clone(),
        };
        let h = self.norm1.forward_silu(x)?;
        let h = self.conv1.forward(pass, &h)?;
        let h = self.norm2.forward_silu(&h)?;
        // conv2(h) + residual with the add in the conv's epilogue where the ops can (same roundings).
        self.conv2.forward_residual(pass, &h, &residual)
    }
}

/// diffusers `WanAttentionBlock`: per frame, RMS norm, 1×1 to_qkv (channels [q | k | v]), one head of
/// dim C over the frame's H·W tokens, 1×1 proj, plus the input. No mixing across frames.
pub(crate) struct AttentionBlock {
    norm: RmsNorm,
    to_qkv: CausalConv,
    proj: CausalConv,
}

impl AttentionBlock {
    pub(crate) fn load(w: &Prefixed, dim: usize, slots: &mut SlotCounter) -> Result<Self> {
        Ok(AttentionBlock {
            norm: RmsNorm::load(&w.pp("norm"), &[dim, 1, 1])?,
            to_qkv: CausalConv::load_2d(&w.pp("to_qkv"), dim, 3 * dim, [1, 1], slots)?,
            proj: CausalConv::load_2d(&w.pp("proj"), dim, dim, [1, 1], slots)?,
        })
    }

    /// x [B, C, T, H, W] → same shape.
    pub(crate) fn forward(&self, pass: &mut Pass, x: &Tensor) -> Result<Tensor> {
        let [b, c, t, h, w] = five_dims(x);
        let qkv = self.to_qkv.forward(pass, &self.norm.forward(x)?)?;
        // [B, 3C, T, H, W] → tokens [B·T, H·W, 3C]; channels split [q | k | v] as diffusers' chunk(3).
        let tokens = qkv
            .permute(&[0, 2, 3, 4, 1])?
            .reshape(&[b * t, h * w, 3 * c])?;
        let heads = tokens
            .chunk(2, 3)?
            .into_iter()
            .map(|part| part.reshape(&[b * t, h * w, 1, c]))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let attended = pass.ops.frame_attention(&heads[0], &heads[1], &heads[2])?;
        let attended = attended
            .reshape(&[b, t, h, w, c])?
            .permute(&[0, 4, 1, 2, 3])?;
        Ok(add(&self.proj.forward(pass, &attended)?, x)?)
    }
}

/// diffusers `WanResample` in its two decoder modes: `upsample2d` (nearest ×2 in H and W, then a 3×3
/// Conv2d C → C/2 per frame) and `upsample3d` (first `time_conv`, 3×1×1 C → 2C whose channel halves
/// become frames 2i and 2i + 1, then the same spatial step).
pub(crate) struct Upsampler {
    time_conv: Option<CausalConv>,
    conv: CausalConv,
}

impl Upsampler {
    /// Loads `{w}.resample.1` (Conv2d dim → out_dim, 3×3) and, for upsample3d, `{w}.time_conv`.
    pub(crate) fn load(
        w: &Prefixed,
        mode: UpsampleMode,
        dim: usize,
        out_dim: usize,
        slots: &mut SlotCounter,
    ) -> Result<Self> {
        let time_conv = match mode {
            UpsampleMode::Spatial => None,
            UpsampleMode::SpatioTemporal => Some(CausalConv::load(
                &w.pp("time_conv"),
                dim,
                2 * dim,
                [3, 1, 1],
                slots,
            )?),
        };
        let conv = CausalConv::load_2d(&w.pp("resample.1"), dim, out_dim, [3, 3], slots)?;
        Ok(Upsampler { time_conv, conv })
    }

    /// x [B, C, T, H, W] → [B, C/2, T', 2H, 2W] with T' = T for upsample2d; for upsample3d
    /// T' = 2T, or 2T − 1 in the first chunk, whose first frame bypasses time_conv.
    pub(crate) fn forward(&self, pass: &mut Pass, x: &Tensor) -> Result<Tensor> {
        let x = match &self.time_conv {
            None => x.clone(),
            Some(time_conv) => {
                let t = x.shape()[2];
                let (bypass, rest) = if pass.first_chunk {
                    (
                        Some(x.narrow(2, 0, 1)?),
                        (t > 1).then(|| x.narrow(2, 1, t - 1)),
                    )
                } else {
                    (None, Some(Ok(x.clone())))
                };
                let doubled = match rest {
                    Some(rest) => Some(channels_to_frames(&time_conv.forward(pass, &rest?)?)?),
                    None => None,
                };
                match (bypass, doubled) {
                    // Every chunk after the first: nothing to join (a concat of one part would copy it).
                    (None, Some(doubled)) => doubled,
                    (bypass, doubled) => {
                        let parts: Vec<&Tensor> = bypass.iter().chain(doubled.iter()).collect();
                        Tensor::concat(&parts, 2)?
                    }
                }
            }
        };
        self.conv.forward_upsampled(pass, &x)
    }
}

/// diffusers `WanUpBlock`: num_res_blocks + 1 residual blocks (the first in_dim → out_dim), then an
/// optional upsampler out_dim → out_dim/2.
pub(crate) struct UpBlock {
    resnets: Vec<ResidualBlock>,
    upsampler: Option<Upsampler>,
}

impl UpBlock {
    pub(crate) fn load(
        w: &Prefixed,
        layout: UpBlockLayout,
        num_res_blocks: usize,
        slots: &mut SlotCounter,
    ) -> Result<Self> {
        let resnets = (0..=num_res_blocks)
            .map(|j| {
                let in_dim = if j == 0 {
                    layout.in_dim
                } else {
                    layout.out_dim
                };
                ResidualBlock::load(&w.pp("resnets").pp(j), in_dim, layout.out_dim, slots)
            })
            .collect::<Result<Vec<_>>>()?;
        let upsampler = layout
            .upsample
            .map(|mode| {
                let out = layout.out_dim / 2; // Wan 2.1: the upsampler halves the width
                Upsampler::load(&w.pp("upsamplers").pp(0), mode, layout.out_dim, out, slots)
            })
            .transpose()?;
        Ok(UpBlock { resnets, upsampler })
    }

    pub(crate) fn forward(&self, pass: &mut Pass, x: &Tensor) -> Result<Tensor> {
        let mut x = x.clone();
        for resnet in &self.resnets {
            x = resnet.forward(pass, &x)?;
        }
        match &self.upsampler {
            Some(upsampler) => upsampler.forward(pass, &x),
            None => Ok(x),
        }
    }
}

/// diffusers `WanMidBlock` (num_layers 1): residual block, attention, residual block, all at C.
pub(crate) struct MidBlock {
    resnet0: ResidualBlock,
    attention: AttentionBlock,
    resnet1: ResidualBlock,
}

impl MidBlock {
    pub(crate) fn load(w: &Prefixed, dim: usize, slots: &mut SlotCounter) -> Result<Self> {
        Ok(MidBlock {
            resnet0: ResidualBlock::load(&w.pp("resnets.0"), dim, dim, slots)?,
            attention: AttentionBlock::load(&w.pp("attentions.0"), dim, slots)?,
            resnet1: ResidualBlock::load(&w.pp("resnets.1"), dim, dim, slots)?,
        })
    }

    pub(crate) fn forward(&self, pass: &mut Pass, x: &Tensor) -> Result<Tensor> {
        let x = self.resnet0.forward(pass, x)?;
        let x = self.attention.forward(pass, &x)?;
        self.resnet1.forward(pass, &x)
    }
}

/// [B, C, T, H, W] of a tensor the decoder built itself (always rank 5 here).
fn five_dims(x: &Tensor) -> [usize; 5] {
    let s = x.shape();
    [s[0], s[1], s[2], s[3], s[4]]
}

#[cfg(test)]
mod tests {
    use super::*;
    use ditstream_kernels::{DType, Device};

    fn frames(t: usize, seed: u64) -> Tensor {
        Tensor::randn(&[1, 2, t, 3, 2], DType::F32, seed, Device::Cpu).expect("randn")
    }

    #[test]
    fn last_frames_keeps_the_tail_of_cache_and_chunk() -> Result<()> {
        let (a, b) = (frames(1, 1), frames(3, 2));
        // A long chunk: its own last two frames.
        assert_eq!(
            last_frames(Some(&a), &b, 2)?.to_vec_f32()?,
            b.narrow(2, 1, 2)?.to_vec_f32()?
        );
        // A one-frame chunk after a cache: the cache's last frame, then the chunk.
        let tail = last_frames(Some(&b), &a, 2)?;
        let expected = Tensor::concat(&[&b.narrow(2, 2, 1)?, &a], 2)?;
        assert_eq!(tail.to_vec_f32()?, expected.to_vec_f32()?);
        // The first one-frame chunk: just that frame.
        assert_eq!(last_frames(None, &a, 2)?.shape(), [1, 2, 1, 3, 2]);
        Ok(())
    }
}
