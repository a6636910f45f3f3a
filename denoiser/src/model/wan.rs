//! Wan 2.x transformer (diffusers `WanTransformer3DModel`), op by op as reference/wan.md §1 gives
//! it. Construction walks the checkpoint's tensor names, so the code reads like the checkpoint.
//!
//! The forward is split at the two places sequence parallelism needs: [`WanTransformer::embed`]
//! (patchify, conditioning, RoPE tables, the text's cross-attention keys and values — these two
//! built once per token grid and per context tensor, as every step of a request repeats them) and [`WanTransformer::head`] (final norm and unpatchify)
//! around the blocks, and the blocks' self-attention goes through a [`SelfAttention`] the caller
//! chooses, so a parallel wrapper can gather heads or keys without the model knowing.
//!
//! Timing: every op group ends in a [`mark`] (each `Linear` marks `"linears"`; the blocks mark
//! `"self-attention"`, `"cross-attention"`, the norms and `"modulation"`; the rest of the patch
//! embedding and conditioning `"embed"`, the output norm `"head"`), so a
//! [`ditstream_kernels::timeline::record`] of a forward says where its time goes; unrecorded, a mark
//! costs a thread-local read.
//!
//! Devices and precision: the weights are put on the model's device once, at construction; inputs are
//! moved there (a no-op when they already are). Every op runs on that device, the Conv3d patch
//! embedding included (kernel = stride, so it is a linear over flattened patches). In bf16 the model
//! keeps f32 exactly where diffusers does (`_keep_in_fp32_modules`, the `.float()` calls of its
//! block): the time embedder, both `scale_shift_table`s and the modulation sums, `norm1`/`norm3`/
//! `norm_out` with their modulation (one rounding after `LN(x)·(1 + scale) + shift`), `norm2`'s
//! affine parameters, and the gated residuals — these are summed in the output projections' f32
//! GEMM accumulator (`linear_residual`), with the f32 gate folded into the bf16 weights: the one
//! place where our roundings differ from diffusers' (its projection output is rounded to bf16
//! before the gate; ours are the folded weights), by about one bf16 ulp of the branch either way.

use std::sync::{Arc, Mutex};

use ditstream_kernels::timeline::mark;
use ditstream_kernels::weights::WeightSource;
use ditstream_kernels::{
    AttentionOptions, DType, Device, Fp8Tensor, KernelError, Tensor, attention, gated_residual,
    gelu_tanh, layer_norm, layer_norm_e4m3, layer_norm_modulate, layer_norm_modulate_e4m3, linear,
    linear_fp8, linear_fp8_gelu_tanh, linear_fp8_residual, linear_gelu_tanh, linear_residual,
    rms_norm, rms_norm_rope, rope_tables_3d, silu,
};

use super::{ModelError, WanConfig};
use ditstream_kernels::attention_fp8;

/// Wan's RoPE base.
const ROPE_THETA: f64 = 10_000.0;

/// One of the self-attention's operands, as [`SelfAttention::attend_staged`] asks for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operand {
    /// The queries (projected, q-RMSNorm, RoPE).
    Q,
    /// The keys (projected, k-RMSNorm, RoPE).
    K,
    /// The values (projected).
    V,
}

/// Runs self-attention for the blocks. The local implementation attends over the tokens it is
/// given; parallel wrappers exchange shards around an inner attention.
pub trait SelfAttention {
    /// q, k, v: [B, S, H, D] (RoPE applied) → out [B, S, H, D].
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor, ModelError>;

    /// The same attention, its operands computed when it asks: `operand(Q)` (and K, V) runs that
    /// projection and returns it as [`SelfAttention::attend`] takes it. The blocks call this, so
    /// an attention that sends its operands somewhere (async Ulysses) asks for them in the order it
    /// sends them and puts each transfer under the next projection. The default asks for Q, K, V
    /// and attends.
    fn attend_staged(
        &self,
        operand: &mut dyn FnMut(Operand) -> Result<Tensor, ModelError>,
    ) -> Result<Tensor, ModelError> {
        let q = operand(Operand::Q)?;
        let k = operand(Operand::K)?;
        let v = operand(Operand::V)?;
        self.attend(&q, &k, &v)
    }
}

/// Self-attention over the local tokens only (single rank), masking keys at or past `kv_len`
/// (padding tokens of a padded sequence).
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalAttention {
    /// Valid keys; `None` means all.
    pub kv_len: Option<usize>,
    /// FP8 attention (`ditstream_kernels::attention_fp8`) rather than the tensors' dtype.
    pub fp8: bool,
}

impl SelfAttention for LocalAttention {
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor, ModelError> {
        let options = AttentionOptions {
            scale: None,
            kv_len: self.kv_len,
        };
        let out = if self.fp8 {
            attention_fp8(q, k, v, options)?
        } else {
            attention(q, k, v, options)?
        };
        Ok(out.0)
    }
}

/// Reads weights by checkpoint name and puts each on the model's device as it arrives (so a large
/// model never needs a second host copy).
struct Loader<'a> {
    ws: &'a dyn WeightSource,
    device: Device,
}

impl Loader<'_> {
    /// Tensor `name` with the expected `shape`, stored as `dtype` on the model's device.
    fn tensor(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor, ModelError> {
        Ok(self.ws.tensor(name, shape, dtype)?.to_device(self.device)?)
    }
}

/// A linear layer's weight [out, in]: in the model's dtype, or e4m3 with a scale per output
/// channel (see [`WanTransformer::with_fp8_linears`]).
#[derive(Debug, Clone)]
enum Weight {
    Dense(Tensor),
    Fp8(Fp8Tensor),
}

/// A `Linear` layer: weight [out, in], optional bias [out].
#[derive(Debug, Clone)]
struct Linear {
    weight: Weight,
    bias: Option<Tensor>,
}

/// A linear layer's input as its weight reads it: dense, or quantised per token for an FP8 weight.
/// Made by the layer ([`Linear::input`] and the norms beside it), so that layers of one kind share
/// it (the q/k/v projections quantise their input once) and a norm can write it quantised.
enum Input {
    Dense(Tensor),
    Fp8(Fp8Tensor),
}

impl Linear {
    fn load(
        ws: &Loader,
        name: &str,
        out: usize,
        inp: usize,
        dtype: DType,
    ) -> Result<Linear, ModelError> {
        Ok(Linear {
            weight: Weight::Dense(ws.tensor(&format!("{name}.weight"), &[out, inp], dtype)?),
            bias: Some(ws.tensor(&format!("{name}.bias"), &[out], dtype)?),
        })
    }

    /// The same layer with its weight quantised to e4m3 (on the weight's device).
    fn to_fp8(&self) -> Result<Linear, ModelError> {
        let weight = match &self.weight {
            Weight::Dense(w) => Weight::Fp8(Fp8Tensor::quantize(w)?),
            fp8 @ Weight::Fp8(_) => fp8.clone(),
        };
        Ok(Linear {
            weight,
            bias: self.bias.clone(),
        })
    }

    /// x as this layer's input (quantised per token for an FP8 weight), to share with the layers
    /// of its kind that read the same x.
    fn input(&self, x: &Tensor) -> Result<Input, ModelError> {
        Ok(match self.weight {
            Weight::Dense(_) => Input::Dense(x.clone()),
            Weight::Fp8(_) => {
                let x = Fp8Tensor::quantize(x)?;
                mark("fp8 quantize");
                Input::Fp8(x)
            }
        })
    }

    /// `LN(x)·(1 + scale) + shift` computed in f32 and stored once in `dtype`, as diffusers'
    /// `(norm(x.float()) * (1 + scale) + shift).type_as(x)` (x [.., D], shift/scale broadcasting to
    /// it), as this layer's input: for an FP8 weight the norm writes it quantised (the same codes
    /// as quantising the stored result, without it).
    fn norm_modulate_input(
        &self,
        x: &Tensor,
        (shift, scale): (&Tensor, &Tensor),
        eps: f32,
        dtype: DType,
    ) -> Result<Input, ModelError> {
        Ok(match self.weight {
            Weight::Dense(_) => Input::Dense(layer_norm_modulate(x, shift, scale, eps, dtype)?),
            Weight::Fp8(_) => Input::Fp8(layer_norm_modulate_e4m3(x, shift, scale, eps, dtype)?),
        })
    }

    /// `layer_norm(x, weight, bias)` as this layer's input, as [`Self::norm_modulate_input`].
    fn layer_norm_input(
        &self,
        x: &Tensor,
        (weight, bias): (&Tensor, &Tensor),
        eps: f32,
    ) -> Result<Input, ModelError> {
        Ok(match self.weight {
            Weight::Dense(_) => Input::Dense(layer_norm(x, Some(weight), Some(bias), eps)?),
            Weight::Fp8(_) => Input::Fp8(layer_norm_e4m3(x, Some(weight), Some(bias), eps)?),
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor, ModelError> {
        self.forward_input(&self.input(x)?)
    }

    fn forward_input(&self, x: &Input) -> Result<Tensor, ModelError> {
        let b = self.bias.as_ref();
        let y = match (&self.weight, x) {
            (Weight::Dense(w), Input::Dense(x)) => linear(x, w, b)?,
            (Weight::Fp8(w), Input::Fp8(x)) => linear_fp8(x, w, b)?,
            (weight, x) => return Err(mismatched_input(weight, x)),
        };
        mark("linears");
        Ok(y)
    }

    /// GELU(tanh) of [`forward_input`](Self::forward_input), fused into the GEMM where there is a
    /// bias (the activation then sees the f32 sum, rounded once).
    fn forward_gelu(&self, x: &Input) -> Result<Tensor, ModelError> {
        let y = match (&self.weight, &self.bias, x) {
            (Weight::Dense(w), Some(bias), Input::Dense(x)) => linear_gelu_tanh(x, w, bias)?,
            (Weight::Fp8(w), Some(bias), Input::Fp8(x)) => linear_fp8_gelu_tanh(x, w, bias)?,
            (_, None, _) => gelu_tanh(&self.forward_input(x)?)?,
            (weight, _, x) => return Err(mismatched_input(weight, x)),
        };
        mark("linears");
        Ok(y)
    }

    /// `residual + forward(x) ⊙ gate` (no gate: `residual + forward(x)`) with the residual added in
    /// the GEMM (`linear_residual`: a per-sample gate folds into the weights, or into an FP8
    /// weight's scales); a per-token gate ([B, L, D], L > 1) takes the projection then
    /// `gated_residual`.
    fn forward_residual(
        &self,
        x: &Tensor,
        residual: &Tensor,
        gate: Option<&Tensor>,
    ) -> Result<Tensor, ModelError> {
        let b = self.bias.as_ref();
        let y = match (gate, &self.weight) {
            (Some(g), _) if g.rank() == 3 && g.shape()[1] > 1 => {
                gated_residual(residual, &self.forward(x)?, g)?
            }
            (_, Weight::Dense(w)) => linear_residual(x, w, b, residual, gate)?,
            (_, Weight::Fp8(w)) => {
                let x = Fp8Tensor::quantize(x)?;
                mark("fp8 quantize");
                linear_fp8_residual(&x, w, b, residual, gate)?
            }
        };
        mark("linears");
        Ok(y)
    }
}

/// The error for an input made for another kind of weight (a bug: layers make their own inputs).
fn mismatched_input(weight: &Weight, x: &Input) -> ModelError {
    let kind = |fp8: bool| if fp8 { "e4m3" } else { "dense" };
    KernelError::InvalidArgument {
        op: "linear",
        name: "x",
        value: format!("{} activations", kind(matches!(x, Input::Fp8(_)))),
        rule: format!(
            "a layer with a {} weight reads its own kind of input",
            kind(matches!(weight, Weight::Fp8(_)))
        ),
    }
    .into()
}

/// One attention module (`attn1` self, `attn2` cross): q/k/v/out projections and the q/k
/// RMSNorms across all heads.
#[derive(Debug, Clone)]
struct Attention {
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
    norm_q: Tensor,
    norm_k: Tensor,
}

impl Attention {
    fn load(ws: &Loader, name: &str, dim: usize, dtype: DType) -> Result<Attention, ModelError> {
        Ok(Attention {
            to_q: Linear::load(ws, &format!("{name}.to_q"), dim, dim, dtype)?,
            to_k: Linear::load(ws, &format!("{name}.to_k"), dim, dim, dtype)?,
            to_v: Linear::load(ws, &format!("{name}.to_v"), dim, dim, dtype)?,
            to_out: Linear::load(ws, &format!("{name}.to_out.0"), dim, dim, dtype)?,
            norm_q: ws.tensor(&format!("{name}.norm_q.weight"), &[dim], dtype)?,
            norm_k: ws.tensor(&format!("{name}.norm_k.weight"), &[dim], dtype)?,
        })
    }
}

/// One transformer block (`blocks.i`).
#[derive(Debug, Clone)]
struct Block {
    /// [1, 6, D]: shift, scale, gate (self-attention), then shift, scale, gate (FFN).
    scale_shift_table: Tensor,
    attn1: Attention,
    attn2: Attention,
    /// Cross-attention input norm (`norm2`), LayerNorm with affine (f32 parameters, as diffusers
    /// keeps them), when `cross_attn_norm`.
    norm2: Option<(Tensor, Tensor)>,
    ffn_in: Linear,
    ffn_out: Linear,
}

/// What every block needs besides the hidden states, computed once per forward by
/// [`WanTransformer::embed`].
#[derive(Debug, Clone)]
pub struct Conditioning {
    /// Time embedding in the model's dtype (diffusers casts it to the text's dtype): [B, D], or
    /// [B, L, D] for per-token timesteps.
    pub temb: Tensor,
    /// Block modulation input: [B, 6, D], or [B, L, 6, D] for per-token timesteps.
    pub timestep_proj: Tensor,
    /// Projected text: [B, S_txt, D].
    pub context: Tensor,
    /// Every block's cross-attention keys (normed) and values of `context`, [B, S_txt, heads,
    /// head_dim] each: the same at every step of a request, so computed once per context tensor
    /// (see `text_cache`).
    pub cross_kv: Arc<Vec<(Tensor, Tensor)>>,
    /// RoPE angles for the tokens, [L, head_dim/2] each.
    pub rope_cos: Tensor,
    /// See `rope_cos`.
    pub rope_sin: Tensor,
    /// Latent token grid (F', H', W') after patchification.
    pub grid: [usize; 3],
}

/// The Wan transformer.
#[derive(Debug, Clone)]
pub struct WanTransformer {
    cfg: WanConfig,
    dtype: DType,
    device: Device,
    /// The Conv3d patch embedding (kernel = stride = patch) as the Linear over flattened patches it
    /// is: weight [D, C_in·pt·ph·pw] (the checkpoint's [D, C_in, pt, ph, pw] row-major), bias [D].
    patch_embedding: Linear,
    time_embedder: (Linear, Linear),
    time_proj: Linear,
    text_embedder: (Linear, Linear),
    blocks: Vec<Block>,
    /// [1, 2, D]: shift and scale of the output norm.
    scale_shift_table: Tensor,
    proj_out: Linear,
    /// The RoPE tables of the last token grid, on the device: every step of a request uses the same
    /// grid, and building them takes an f64 cos and sin per token and pair on the host (2·10⁶ of
    /// each at 480p 81 frames), while the GPU waits for the forward's first kernels.
    rope_cache: Arc<Mutex<Option<RopeTables>>>,
    /// The text side of the last contexts seen ([`TEXT_CACHE_ENTRIES`]): every step of a request
    /// passes the same context tensor, and its projection and the blocks' cross-attention keys and
    /// values (60 GEMMs at Wan2.1-1.3B dims) do not depend on the latent.
    text_cache: Arc<Mutex<Vec<TextStates>>>,
    /// Self-attention in FP8 ([`WanTransformer::with_fp8_attention`]).
    fp8_attention: bool,
}

/// How many contexts `text_cache` keeps: two, for ranks that share one model and each run one CFG
/// branch.
const TEXT_CACHE_ENTRIES: usize = 2;

/// What the model computes from one context tensor.
#[derive(Debug)]
struct TextStates {
    /// The caller's context, kept so that [`Tensor::is_same`] identifies it (holding it also keeps
    /// its storage from being reused for another tensor).
    input: Tensor,
    /// The text embedder's output, [B, S_txt, D].
    projected: Tensor,
    /// Per block: cross-attention keys (normed) and values.
    kv: Arc<Vec<(Tensor, Tensor)>>,
}

/// RoPE cos/sin tables for one token grid.
#[derive(Debug)]
struct RopeTables {
    grid: [usize; 3],
    cos: Tensor,
    sin: Tensor,
}

impl WanTransformer {
    /// Builds the model from `ws` (names as in diffusers' `transformer/` safetensors), in `dtype`,
    /// with every weight on `device` (moved there once, tensor by tensor, as it is read).
    pub fn new(
        cfg: WanConfig,
        ws: &dyn WeightSource,
        dtype: DType,
        device: Device,
    ) -> Result<WanTransformer, ModelError> {
        cfg.check().map_err(|message| ModelError::Config {
            path: "<config>".into(),
            message,
        })?;
        let ws = &Loader { ws, device };
        let d = cfg.dim();
        let [pt, ph, pw] = cfg.patch_size;
        let patch_in = cfg.in_channels * pt * ph * pw;
        let patch_embedding = Linear {
            weight: Weight::Dense(
                ws.tensor(
                    "patch_embedding.weight",
                    &[d, cfg.in_channels, pt, ph, pw],
                    dtype,
                )?
                .reshape(&[d, patch_in])?,
            ),
            bias: Some(ws.tensor("patch_embedding.bias", &[d], dtype)?),
        };
        let ce = "condition_embedder";
        let blocks = (0..cfg.num_layers)
            .map(|i| {
                let p = format!("blocks.{i}");
                let norm2 = if cfg.cross_attn_norm {
                    Some((
                        ws.tensor(&format!("{p}.norm2.weight"), &[d], DType::F32)?,
                        ws.tensor(&format!("{p}.norm2.bias"), &[d], DType::F32)?,
                    ))
                } else {
                    None
                };
                Ok(Block {
                    scale_shift_table: ws.tensor(
                        &format!("{p}.scale_shift_table"),
                        &[1, 6, d],
                        DType::F32,
                    )?,
                    attn1: Attention::load(ws, &format!("{p}.attn1"), d, dtype)?,
                    attn2: Attention::load(ws, &format!("{p}.attn2"), d, dtype)?,
                    norm2,
                    ffn_in: Linear::load(
                        ws,
                        &format!("{p}.ffn.net.0.proj"),
                        cfg.ffn_dim,
                        d,
                        dtype,
                    )?,
                    ffn_out: Linear::load(ws, &format!("{p}.ffn.net.2"), d, cfg.ffn_dim, dtype)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let out_features = cfg.out_channels * pt * ph * pw;
        Ok(WanTransformer {
            patch_embedding,
            // The time embedder stays in f32, as diffusers keeps it (`_keep_in_fp32_modules`).
            time_embedder: (
                Linear::load(
                    ws,
                    &format!("{ce}.time_embedder.linear_1"),
                    d,
                    cfg.freq_dim,
                    DType::F32,
                )?,
                Linear::load(
                    ws,
                    &format!("{ce}.time_embedder.linear_2"),
                    d,
                    d,
                    DType::F32,
                )?,
            ),
            time_proj: Linear::load(ws, &format!("{ce}.time_proj"), 6 * d, d, dtype)?,
            text_embedder: (
                Linear::load(
                    ws,
                    &format!("{ce}.text_embedder.linear_1"),
                    d,
                    cfg.text_dim,
                    dtype,
                )?,
                Linear::load(ws, &format!("{ce}.text_embedder.linear_2"), d, d, dtype)?,
            ),
            blocks,
            scale_shift_table: ws.tensor("scale_shift_table", &[1, 2, d], DType::F32)?,
            proj_out: Linear::load(ws, "proj_out", out_features, d, dtype)?,
            rope_cache: Arc::default(),
            text_cache: Arc::default(),
            fp8_attention: false,
            cfg,
            dtype,
            device,
        })
    }

    /// The model with its blocks' linear layers in FP8 (`model.dtype: fp8`): the q/k/v/out
    /// projections of both attentions and the FFN's two, each weight quantised to e4m3 per output
    /// channel on the model's device (see `ditstream_kernels::Fp8Tensor`), their activations per
    /// token at every call: written quantised by the norms before the self-attention's q/k/v (one
    /// quantisation for the three), the cross-attention's q and the FFN, quantised on their own
    /// before the output projections. The patch embedding, the condition embedders, the norms, the modulation
    /// and the head stay in the model's dtype. Block by block, so the bf16 weights of one block
    /// are freed as its FP8 ones are made (the clones that share them aside).
    pub fn with_fp8_linears(mut self) -> Result<WanTransformer, ModelError> {
        for blk in &mut self.blocks {
            for a in [&mut blk.attn1, &mut blk.attn2] {
                for l in [&mut a.to_q, &mut a.to_k, &mut a.to_v, &mut a.to_out] {
                    *l = l.to_fp8()?;
                }
            }
            blk.ffn_in = blk.ffn_in.to_fp8()?;
            blk.ffn_out = blk.ffn_out.to_fp8()?;
        }
        // Text states computed with the dense weights are not this model's.
        self.text_cache = Arc::default();
        Ok(self)
    }

    /// The model with its blocks' self-attention in FP8 (`model.dtype: fp8`): Q, K and V
    /// quantised to e4m3 per 128-token block (V per channel) at every call, the softmax and sums in
    /// f32 (`ditstream_kernels::attention_fp8`), on one rank and inside every parallel wrapper.
    /// The cross-attention to the text stays in the model's dtype (512 keys: ~2 % of the
    /// attention's work at 480p).
    pub fn with_fp8_attention(mut self) -> WanTransformer {
        self.fp8_attention = true;
        self
    }

    /// Whether the blocks' self-attention is FP8 ([`Self::with_fp8_attention`]).
    pub fn fp8_attention(&self) -> bool {
        self.fp8_attention
    }

    /// The model's dimensions.
    pub fn config(&self) -> &WanConfig {
        &self.cfg
    }

    /// Where the weights live and every op runs.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The storage dtype of the weights and activations (f32 parts aside, see the module docs).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Full forward on one rank: x [B, C_in, T, H, W], timestep `[B]` (or [B, L] per token),
    /// context [B, S_txt, text_dim] → velocity [B, C_out, T, H, W] in the model's dtype, on its
    /// device. Inputs may live anywhere (see [`WanTransformer::embed`]).
    pub fn forward(
        &self,
        x: &Tensor,
        timestep: &Tensor,
        context: &Tensor,
    ) -> Result<Tensor, ModelError> {
        self.forward_interruptible(x, timestep, context, &|| false)
    }

    /// [`forward`](Self::forward) that asks `interrupted` before every block and stops with
    /// [`ModelError::Interrupted`] when it says so: a cancelled request frees the device within
    /// one block, not one whole forward.
    pub fn forward_interruptible(
        &self,
        x: &Tensor,
        timestep: &Tensor,
        context: &Tensor,
        interrupted: &dyn Fn() -> bool,
    ) -> Result<Tensor, ModelError> {
        let (tokens, cond) = self.embed(x, timestep, context)?;
        let mut h = tokens;
        for i in 0..self.blocks.len() {
            if interrupted() {
                return Err(ModelError::Interrupted { block: i });
            }
            h = self.block(
                i,
                &h,
                &cond,
                &cond.rope_cos,
                &cond.rope_sin,
                &cond.timestep_proj,
                &LocalAttention {
                    kv_len: None,
                    fp8: self.fp8_attention,
                },
            )?;
        }
        self.head(&h, &cond.temb, cond.grid)
    }

    /// Patchify and condition: → tokens [B, L, D] (token index (f·H' + h)·W' + w) and the
    /// [`Conditioning`] every block reads, on the model's device.
    ///
    /// `x` and `context` are moved to the model's device and dtype. The timestep values are read on
    /// the host (the sinusoid is computed there, in f32, and uploaded): pass `timestep` as a host
    /// tensor, or its read-back synchronises the device.
    pub fn embed(
        &self,
        x: &Tensor,
        timestep: &Tensor,
        context: &Tensor,
    ) -> Result<(Tensor, Conditioning), ModelError> {
        let cfg = &self.cfg;
        let d = cfg.dim();
        let s = x.shape();
        let [pt, ph, pw] = cfg.patch_size;
        if s.len() != 5
            || s[1] != cfg.in_channels
            || !s[2].is_multiple_of(pt)
            || !s[3].is_multiple_of(ph)
            || !s[4].is_multiple_of(pw)
        {
            return Err(ModelError::Input {
                what: "latent",
                value: format!("{s:?}"),
                rule: format!(
                    "must be [B, {}, T, H, W] with H divisible by {ph} and W by {pw}",
                    cfg.in_channels
                ),
            });
        }
        let b = s[0];
        let grid = [s[2] / pt, s[3] / ph, s[4] / pw];
        let l = grid.iter().product::<usize>();
        let c = context.shape();
        if c.len() != 3 || c[0] != b || c[2] != cfg.text_dim {
            return Err(ModelError::Input {
                what: "context",
                value: format!("{c:?}"),
                rule: format!("must be [{b}, S_txt, {}]", cfg.text_dim),
            });
        }
        let per_token = match timestep.shape() {
            [tb] if *tb == b => false,
            [tb, tl] if *tb == b && *tl == l => true,
            other => {
                return Err(ModelError::Input {
                    what: "timestep",
                    value: format!("{other:?}"),
                    rule: format!("must be [{b}] or [{b}, {l}] (per token)"),
                });
            }
        };

        // Patch embedding. A Conv3d whose kernel equals its stride sees each patch once, so it is a
        // Linear over flattened patches: [B, C, F'·pt, H'·ph, W'·pw] → [B, F', H', W', C, pt, ph, pw]
        // → [B, L, C·pt·ph·pw] (the weight's [C, pt, ph, pw] order) · Wᵀ + b → [B, L, D].
        let [f, hh, ww] = grid;
        let x = x.to_device(self.device)?.to_dtype(self.dtype)?;
        let patches = x
            .reshape(&[b, cfg.in_channels, f, pt, hh, ph, ww, pw])?
            .permute(&[0, 2, 4, 6, 1, 3, 5, 7])?
            .reshape(&[b, l, cfg.in_channels * pt * ph * pw])?;
        let tokens = self.patch_embedding.forward(&patches)?;

        // Timestep sinusoid (f32, on the host), then the time MLP in f32; diffusers casts its output
        // to the text's dtype (`.type_as(encoder_hidden_states)`) before the projections and the head.
        let t_flat = timestep.reshape(&[timestep.numel()])?.to_vec_f32()?;
        let sinusoid = Tensor::from_vec(
            timestep_sinusoid(&t_flat, cfg.freq_dim),
            &[t_flat.len(), cfg.freq_dim],
        )?
        .to_device(self.device)?;
        let (l1, l2) = &self.time_embedder;
        let temb = l2
            .forward(&silu(&l1.forward(&sinusoid)?)?)?
            .to_dtype(self.dtype)?;
        let tproj = self.time_proj.forward(&silu(&temb)?)?;
        let (temb, timestep_proj) = if per_token {
            (temb.reshape(&[b, l, d])?, tproj.reshape(&[b, l, 6, d])?)
        } else {
            (temb.reshape(&[b, d])?, tproj.reshape(&[b, 6, d])?)
        };

        let (context, cross_kv) = self.text_states(context)?;
        let (rope_cos, rope_sin) = self.rope_tables(grid)?;
        mark("embed");
        Ok((
            tokens,
            Conditioning {
                temb,
                timestep_proj,
                context,
                cross_kv,
                rope_cos,
                rope_sin,
                grid,
            },
        ))
    }

    /// The projected text of `context` and every block's cross-attention keys and values, computed
    /// once per context tensor (see `text_cache`).
    #[allow(clippy::type_complexity)]
    fn text_states(
        &self,
        context: &Tensor,
    ) -> Result<(Tensor, Arc<Vec<(Tensor, Tensor)>>), ModelError> {
        let cached = |cache: &[TextStates]| {
            cache
                .iter()
                .find(|t| t.input.is_same(context))
                .map(|t| (t.projected.clone(), Arc::clone(&t.kv)))
        };
        if let Some(hit) = cached(&self.text_cache.lock().unwrap_or_else(|e| e.into_inner())) {
            return Ok(hit);
        }
        // Computed without the lock: ranks sharing the model do not wait for each other's text.
        let (cfg, eps) = (&self.cfg, self.cfg.eps as f32);
        let (heads, hd) = (cfg.num_attention_heads, cfg.attention_head_dim);
        let (t1, t2) = &self.text_embedder;
        let text = context.to_device(self.device)?.to_dtype(self.dtype)?;
        let projected = t2.forward(&t1.forward_gelu(&t1.input(&text)?)?)?;
        let [b, s_txt] = [projected.shape()[0], projected.shape()[1]];
        let kv = self
            .blocks
            .iter()
            .map(|blk| {
                let a = &blk.attn2;
                let text = a.to_k.input(&projected)?;
                let k = rms_norm(&a.to_k.forward_input(&text)?, &a.norm_k, eps)?
                    .reshape(&[b, s_txt, heads, hd])?;
                mark("q/k norm");
                let v = a
                    .to_v
                    .forward_input(&text)?
                    .reshape(&[b, s_txt, heads, hd])?;
                Ok((k, v))
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let kv = Arc::new(kv);
        let mut cache = self.text_cache.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() == TEXT_CACHE_ENTRIES {
            cache.remove(0);
        }
        cache.push(TextStates {
            input: context.clone(),
            projected: projected.clone(),
            kv: Arc::clone(&kv),
        });
        Ok((projected, kv))
    }

    /// The RoPE tables of `grid` on the model's device, built once per grid (see `rope_cache`).
    fn rope_tables(&self, grid: [usize; 3]) -> Result<(Tensor, Tensor), ModelError> {
        let mut cache = self.rope_cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = cache.as_ref().filter(|t| t.grid == grid) {
            return Ok((t.cos.clone(), t.sin.clone()));
        }
        let (cos, sin) =
            rope_tables_3d(grid, self.cfg.attention_head_dim, ROPE_THETA, self.device)?;
        *cache = Some(RopeTables {
            grid,
            cos: cos.clone(),
            sin: sin.clone(),
        });
        Ok((cos, sin))
    }

    /// Number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Block `i` on the tokens `x` [B, L_local, D]. `rope_cos`/`rope_sin` [L_local, hd/2] and
    /// `timestep_proj` ([B, 6, D], or [B, L_local, 6, D]) must be sliced to the same tokens;
    /// `attn` decides which keys the self-attention sees.
    #[allow(clippy::too_many_arguments)]
    pub fn block(
        &self,
        i: usize,
        x: &Tensor,
        cond: &Conditioning,
        rope_cos: &Tensor,
        rope_sin: &Tensor,
        timestep_proj: &Tensor,
        attn: &dyn SelfAttention,
    ) -> Result<Tensor, ModelError> {
        let blk = &self.blocks[i];
        let cfg = &self.cfg;
        let (d, heads, hd) = (cfg.dim(), cfg.num_attention_heads, cfg.attention_head_dim);
        let eps = cfg.eps as f32;
        let (b, l) = (x.shape()[0], x.shape()[1]);

        // Modulation rows m0..m5 in f32: table [1, 6, D] + projection.
        let m: Vec<Tensor> = if timestep_proj.rank() == 4 {
            let table = blk.scale_shift_table.reshape(&[1, 1, 6, d])?;
            let sum = ditstream_kernels::add(&timestep_proj.to_dtype(DType::F32)?, &table)?;
            (0..6)
                .map(|j| sum.narrow(2, j, 1)?.reshape(&[b, l, d]))
                .collect::<Result<_, _>>()?
        } else {
            let sum = ditstream_kernels::add(
                &timestep_proj.to_dtype(DType::F32)?,
                &blk.scale_shift_table,
            )?;
            (0..6)
                .map(|j| sum.narrow(1, j, 1))
                .collect::<Result<_, _>>()?
        };

        mark("modulation");

        // Self-attention: h = LN(x)·(1 + m1) + m0; q/k RMSNorm across heads and RoPE (one pass
        // each), attention, then x + to_out(o)·m2 in the output projection's GEMM.
        let a = &blk.attn1;
        // One input for the three projections (quantised once, by the norm, for FP8 weights).
        let h = a
            .to_q
            .norm_modulate_input(x, (&m[0], &m[1]), eps, self.dtype)?;
        mark("norm + modulate");
        // The projections run when the attention asks for them (`attend_staged`); each one's
        // output is a temporary, freed once normed (the projections mark themselves as "linears").
        let mut operand = |which| -> Result<Tensor, ModelError> {
            let (proj, norm) = match which {
                Operand::Q => (&a.to_q, &a.norm_q),
                Operand::K => (&a.to_k, &a.norm_k),
                Operand::V => return Ok(a.to_v.forward_input(&h)?.reshape(&[b, l, heads, hd])?),
            };
            let t = rms_norm_rope(
                &proj.forward_input(&h)?,
                norm,
                eps,
                rope_cos,
                rope_sin,
                heads,
            )?;
            mark("q/k norm + rope");
            Ok(t)
        };
        let o = attn.attend_staged(&mut operand)?.reshape(&[b, l, d])?;
        mark("self-attention");
        let x = a.to_out.forward_residual(&o, x, Some(&m[2]))?;

        // Cross-attention to the text: no RoPE, no mask, no gate; its keys and values come from
        // `embed`, once per request.
        let a = &blk.attn2;
        let h = match &blk.norm2 {
            Some((w, bias)) => a.to_q.layer_norm_input(&x, (w, bias), eps)?,
            None => a.to_q.input(&x)?,
        };
        mark("norm");
        let q =
            rms_norm(&a.to_q.forward_input(&h)?, &a.norm_q, eps)?.reshape(&[b, l, heads, hd])?;
        mark("q/k norm");
        let (k, v) = &cond.cross_kv[i];
        let o = attention(&q, k, v, AttentionOptions::default())?
            .0
            .reshape(&[b, l, d])?;
        mark("cross-attention");
        let x = a.to_out.forward_residual(&o, &x, None)?;

        // Feed-forward: h = LN(x)·(1 + m4) + m3; x + W2·GELU(W1·h)·m5 (the residual in W2's GEMM).
        let h = blk
            .ffn_in
            .norm_modulate_input(&x, (&m[3], &m[4]), eps, self.dtype)?;
        mark("norm + modulate");
        let f = blk.ffn_in.forward_gelu(&h)?;
        blk.ffn_out.forward_residual(&f, &x, Some(&m[5]))
    }

    /// Output norm, projection and unpatchify: tokens [B, L, D] (all of them, in order) and temb
    /// ([B, D] or [B, L, D]) → [B, C_out, T, H, W].
    pub fn head(&self, x: &Tensor, temb: &Tensor, grid: [usize; 3]) -> Result<Tensor, ModelError> {
        let cfg = &self.cfg;
        let d = cfg.dim();
        let (b, l) = (x.shape()[0], x.shape()[1]);
        // shift, scale = table [1, 2, D] + temb, per sample or per token.
        let (shift, scale) = if temb.rank() == 3 {
            let sum = ditstream_kernels::add(
                &temb.to_dtype(DType::F32)?.reshape(&[b, l, 1, d])?,
                &self.scale_shift_table.reshape(&[1, 1, 2, d])?,
            )?;
            (
                sum.narrow(2, 0, 1)?.reshape(&[b, l, d])?,
                sum.narrow(2, 1, 1)?.reshape(&[b, l, d])?,
            )
        } else {
            let sum = ditstream_kernels::add(
                &temb.to_dtype(DType::F32)?.reshape(&[b, 1, d])?,
                &self.scale_shift_table,
            )?;
            (sum.narrow(1, 0, 1)?, sum.narrow(1, 1, 1)?)
        };
        let h =
            self.proj_out
                .norm_modulate_input(x, (&shift, &scale), cfg.eps as f32, self.dtype)?;
        mark("head");
        let out = self.proj_out.forward_input(&h)?;
        // [B, F', H', W', pt, ph, pw, C] → [B, C, F', pt, H', ph, W', pw] → [B, C, T, H, W].
        let [pt, ph, pw] = cfg.patch_size;
        let [f, hh, ww] = grid;
        let c = cfg.out_channels;
        let out = out
            .reshape(&[b, f, hh, ww, pt, ph, pw, c])?
            .permute(&[0, 7, 1, 4, 2, 5, 3, 6])?;
        Ok(out.reshape(&[b, c, f * pt, hh * ph, ww * pw])?)
    }
}

/// Diffusers' `Timesteps(flip_sin_to_cos=True, downscale_freq_shift=0)` in f32:
/// ω_j = exp(−ln(10⁴)·j/half), e = [cos(t·ω) ‖ sin(t·ω)] per timestep → [N, dim] row-major.
pub fn timestep_sinusoid(timesteps: &[f32], dim: usize) -> Vec<f32> {
    let half = dim / 2;
    let freqs: Vec<f32> = (0..half)
        .map(|j| (-(10_000f32.ln()) * j as f32 / half as f32).exp())
        .collect();
    let mut out = Vec::with_capacity(timesteps.len() * dim);
    for &t in timesteps {
        out.extend(freqs.iter().map(|w| (t * w).cos()));
        out.extend(freqs.iter().map(|w| (t * w).sin()));
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use ditstream_common::config::Preset;
    use ditstream_kernels::weights::RandomWeights;

    use super::*;

    fn tiny() -> WanTransformer {
        let cfg = WanConfig::preset(Preset::Tiny);
        WanTransformer::new(cfg, &RandomWeights::new(7), DType::F32, Device::Cpu).unwrap()
    }

    /// The text side is computed once per context tensor, and a new context (even one reusing
    /// nothing but the shape) gets its own: forwards through a model that has seen other contexts
    /// equal those of a fresh model, bit for bit.
    #[test]
    fn text_states_are_computed_once_per_context() {
        let model = tiny();
        let cfg = model.config().clone();
        let x = Tensor::randn(&[2, cfg.in_channels, 1, 4, 4], DType::F32, 1, Device::Cpu).unwrap();
        let t = Tensor::from_vec(vec![500.0, 500.0], &[2]).unwrap();
        let ctx =
            |seed| Tensor::randn(&[2, 3, cfg.text_dim], DType::F32, seed, Device::Cpu).unwrap();
        let (a, b, c) = (ctx(2), ctx(3), ctx(4));
        let run = |m: &WanTransformer, ctx: &Tensor| {
            m.forward(&x, &t, ctx).unwrap().to_vec_f32().unwrap()
        };

        let first = model.embed(&x, &t, &a).unwrap().1;
        let again = model.embed(&x, &t, &a.clone()).unwrap().1;
        assert!(
            Arc::ptr_eq(&first.cross_kv, &again.cross_kv),
            "the same context tensor reuses its keys and values"
        );
        let equal_values = Tensor::from_vec(a.to_vec_f32().unwrap(), a.shape()).unwrap();
        let copy = model.embed(&x, &t, &equal_values).unwrap().1;
        assert!(
            !Arc::ptr_eq(&first.cross_kv, &copy.cross_kv),
            "another tensor is computed"
        );

        // Contexts a, b, c in turn (the cache keeps two): each forward equals a fresh model's.
        for ctx in [&a, &b, &a, &c, &b, &a] {
            assert_eq!(run(&model, ctx), run(&tiny(), ctx));
        }
        assert_ne!(run(&model, &b), run(&model, &c), "the contexts matter");
    }

    /// ‖b − a‖ / ‖a‖.
    fn rel_rms_change(a: &[f32], b: &[f32]) -> f64 {
        let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
        let den: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum();
        (num / den).sqrt()
    }

    /// `with_fp8_linears` quantises the blocks' linears: the forward moves by about what e4m3
    /// rounding of both operands of each GEMM makes of it, and no more. Each operand of an FP8
    /// product is off by a relative ≤ 2⁻⁴ (uniform within the half-ulp, RMS ≤ 2⁻⁴/√3 ≈ 0.036), so
    /// one linear's output by a relative RMS of about √2·0.036 ≈ 0.05; the residual stream sums
    /// the branches' errors over the blocks, so the bound allows five linears' worth (0.25) and
    /// asks for at least a tenth of one (0.005: quantisation did happen). Text states computed by
    /// the dense model before are not reused by the FP8 one.
    #[test]
    fn fp8_linears_move_the_forward_by_the_quantisation_error() {
        let dense = tiny();
        let cfg = dense.config().clone();
        let x = Tensor::randn(&[1, cfg.in_channels, 1, 4, 4], DType::F32, 1, Device::Cpu).unwrap();
        let t = Tensor::from_vec(vec![500.0], &[1]).unwrap();
        let ctx = Tensor::randn(&[1, 3, cfg.text_dim], DType::F32, 2, Device::Cpu).unwrap();
        let y = dense.forward(&x, &t, &ctx).unwrap().to_vec_f32().unwrap();
        let fp8 = dense.clone().with_fp8_linears().unwrap();
        let y8 = fp8.forward(&x, &t, &ctx).unwrap().to_vec_f32().unwrap();
        let fresh = tiny().with_fp8_linears().unwrap();
        assert_eq!(
            y8,
            fresh.forward(&x, &t, &ctx).unwrap().to_vec_f32().unwrap(),
            "the dense model's cached text states leaked into the FP8 one"
        );
        let rel = rel_rms_change(&y, &y8);
        assert!((0.005..0.25).contains(&rel), "relative RMS change {rel}");
        assert_eq!(
            y,
            dense.forward(&x, &t, &ctx).unwrap().to_vec_f32().unwrap(),
            "the dense model is unchanged"
        );
    }

    /// `with_fp8_attention` runs the blocks' self-attention by the FP8 recipe: e4m3 rounding of
    /// Q, K, V (each ≤ 2⁻⁴ relative) and of P (the same) moves an attention output by a relative
    /// RMS of a few 2⁻⁴/√3 ≈ 0.036 at most, which the residual stream carries through the blocks
    /// diluted by the unchanged branches: the same window as the linears' test, (0.001, 0.25).
    /// The linears stay dense and the flag is what the parallel wrappers read.
    #[test]
    fn fp8_attention_moves_the_forward_by_the_quantisation_error() {
        let dense = tiny();
        let cfg = dense.config().clone();
        let x = Tensor::randn(&[1, cfg.in_channels, 2, 8, 8], DType::F32, 3, Device::Cpu).unwrap();
        let t = Tensor::from_vec(vec![700.0], &[1]).unwrap();
        let ctx = Tensor::randn(&[1, 3, cfg.text_dim], DType::F32, 4, Device::Cpu).unwrap();
        let y = dense.forward(&x, &t, &ctx).unwrap().to_vec_f32().unwrap();
        let fp8 = dense.clone().with_fp8_attention();
        assert!(fp8.fp8_attention() && !dense.fp8_attention());
        let y8 = fp8.forward(&x, &t, &ctx).unwrap().to_vec_f32().unwrap();
        let rel = rel_rms_change(&y, &y8);
        assert!((0.001..0.25).contains(&rel), "relative RMS change {rel}");
    }
}
