//! The decoder's two neighbourhood operations, behind one trait: every convolution and the mid-block
//! frame attention. They are the only places where an output pixel reads other pixels, so they are the
//! only places a spatially sharded decode (parallel VAE, wan.md §2.5) must change: a sharded
//! implementation exchanges halo rows before each convolution (zeros only at true image borders) and
//! gathers keys and values for the attention, while the model code stays as it is.

use ditstream_kernels::{AttentionOptions, Tensor, attention, causal_conv3d};

use super::error::Result;

/// The decoder's neighbourhood operations. [`Unsharded`] runs them on whole frames.
pub trait SpatialOps: Send + Sync {
    /// Wan's causal Conv3d with its cached frames (the kernels crate's [`causal_conv3d`] contract):
    /// x [B, C_in, T, H, W], weight [C_out, C_in, kt, kh, kw] (odd sizes), bias [C_out],
    /// cache [B, C_in, T_c ≤ kt − 1, H, W] → [B, C_out, T, H, W]. H and W are zero-padded by kh/2 and
    /// kw/2 on both sides: a sharded implementation needs a halo of kh/2 rows (1 for 3×3, 0 for 1×1).
    /// The upsamplers' per-frame 3×3 Conv2d comes here too, as a kt = 1 kernel.
    fn causal_conv3d(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        cache: Option<&Tensor>,
    ) -> Result<Tensor>;

    /// Single-head softmax attention of each frame's tokens over the same frame's tokens, scale
    /// 1/√C, no mask: q, k, v [N, S, 1, C] (N = B·T frames, S = H·W tokens) → [N, S, 1, C].
    /// A sharded implementation holds a slice of S and gathers k and v over the shards.
    fn frame_attention(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor>;
}

/// Whole frames on one device: zero padding at every border, attention over all tokens.
#[derive(Debug, Clone, Copy, Default)]
pub struct Unsharded;

impl SpatialOps for Unsharded {
    fn causal_conv3d(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        cache: Option<&Tensor>,
    ) -> Result<Tensor> {
        Ok(causal_conv3d(x, weight, bias, cache)?)
    }

    fn frame_attention(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let (out, _lse) = attention(q, k, v, AttentionOptions::default())?;
        Ok(out)
    }
}
