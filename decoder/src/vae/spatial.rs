//! The decoder's two neighbourhood operations, behind one trait: every convolution and the mid-block
//! frame attention. They are the only places where an output pixel reads other pixels, so they are the
//! only places a spatially sharded decode (parallel VAE, wan.md §2.5) must change: a sharded
//! implementation exchanges halo rows before each convolution (zeros only at true image borders) and
//! gathers keys and values for the attention, while the model code stays as it is.

use ditstream_kernels::{
    AttentionOptions, Tensor, add, attention, causal_conv3d, causal_conv3d_residual,
    causal_conv3d_upsampled, upsample_nearest2x,
};

use super::error::Result;

/// The decoder's neighbourhood operations. [`Unsharded`] runs them on whole frames.
pub trait SpatialOps: Send + Sync {
    /// Wan's causal Conv3d with its cached frames (the kernels crate's [`causal_conv3d`] contract):
    /// x [B, C_in, T, H, W], weight [C_out, C_in, kt, kh, kw] (odd sizes), bias `[C_out]`,
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

    /// [`causal_conv3d`](Self::causal_conv3d) of x nearest ×2 upsampled in H and W, without a cache
    /// (the upsamplers' 3×3 conv): x [B, C_in, T, H, W] → [B, C_out, T, 2H, 2W]. By default it
    /// upsamples and calls `causal_conv3d` (what a sharded implementation does: its halo is of the
    /// upsampled rows); [`Unsharded`] runs the kernels' fused op, which never writes the upsampled
    /// tensor where the conv runs channels-last, with the same result bit for bit.
    fn causal_conv3d_upsampled(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.causal_conv3d(&upsample_nearest2x(x)?, weight, bias, None)
    }

    /// `causal_conv3d(x, ..) + residual` (the residual blocks' last conv plus their shortcut), the sum
    /// in x's dtype; `residual` has the output's shape. By default the conv then the `add` op (a
    /// sharded implementation's residual is its own rows); [`Unsharded`] runs the kernels' fused op,
    /// which adds in the conv's epilogue with the same roundings.
    fn causal_conv3d_residual(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        cache: Option<&Tensor>,
        residual: &Tensor,
    ) -> Result<Tensor> {
        Ok(add(&self.causal_conv3d(x, weight, bias, cache)?, residual)?)
    }

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

    fn causal_conv3d_upsampled(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        Ok(causal_conv3d_upsampled(x, weight, bias, None)?)
    }

    fn causal_conv3d_residual(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        cache: Option<&Tensor>,
        residual: &Tensor,
    ) -> Result<Tensor> {
        Ok(causal_conv3d_residual(x, weight, bias, cache, residual)?)
    }

    fn frame_attention(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let (out, _lse) = attention(q, k, v, AttentionOptions::default())?;
        Ok(out)
    }
}
