//! What the parallel attention wrappers have in common: the [`ChunkAttention`] trait (attention
//! for this rank's chunk of a padded, sequence-sharded sequence), the innermost [`LocalChunk`],
//! and [`ModelAttention`], which hands any wrapper to the model as its `SelfAttention`.

use std::cell::RefCell;

use ditstream_kernels::{AttentionOptions, Tensor, attention, attention_fp8};

use super::{ParallelError, Result, valid_in_chunk};
use crate::model::{ModelError, Operand, SelfAttention};

/// Self-attention for this rank's chunk of a sequence that is cut into equal chunks (padding at
/// the end). Each implementation knows the sequence's real token count and which chunk it holds,
/// so it masks padded keys wherever they land, and it fetches the other chunks' keys itself.
pub trait ChunkAttention {
    /// q, k, v: [B, S_c, H, D] (this rank's chunk, RoPE applied) → out [B, S_c, H, D], the
    /// attention of these queries over the whole sequence's real keys.
    fn attend_chunk(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor>;

    /// The same, with the operands produced when asked (the model's
    /// [`SelfAttention::attend_staged`]); a wrapper that sends them (async Ulysses) overrides it.
    fn attend_chunk_staged(&self, operand: &mut StagedOperand<'_>) -> Result<Tensor> {
        let q = operand(Operand::Q)?;
        let k = operand(Operand::K)?;
        let v = operand(Operand::V)?;
        self.attend_chunk(&q, &k, &v)
    }
}

/// What [`ChunkAttention::attend_chunk_staged`] calls to produce an operand ([B, S_c, H, D]).
pub type StagedOperand<'o> = dyn FnMut(Operand) -> Result<Tensor> + 'o;

/// Operands that are already there, as a [`StagedOperand`]: how a wrapper whose staged form is
/// its only one runs `attend_chunk`.
pub(crate) fn given<'t>(
    q: &'t Tensor,
    k: &'t Tensor,
    v: &'t Tensor,
) -> impl FnMut(Operand) -> Result<Tensor> + 't {
    move |which| {
        Ok(match which {
            Operand::Q => q.clone(),
            Operand::K => k.clone(),
            Operand::V => v.clone(),
        })
    }
}

impl<A: ChunkAttention + ?Sized> ChunkAttention for Box<A> {
    fn attend_chunk(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        (**self).attend_chunk(q, k, v)
    }
    fn attend_chunk_staged(&self, operand: &mut StagedOperand<'_>) -> Result<Tensor> {
        (**self).attend_chunk_staged(operand)
    }
}

/// The attention every wrapper runs on the queries, keys and values it holds: `attention` in the
/// tensors' dtype, or, for a model whose self-attention is FP8 (`model.dtype: fp8`),
/// `attention_fp8` (same arguments, same out and LSE, so the wrappers' merges are unchanged).
pub(crate) fn local_attention(
    fp8: bool,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    options: AttentionOptions,
) -> ditstream_kernels::Result<(Tensor, Tensor)> {
    if fp8 {
        attention_fp8(q, k, v, options)
    } else {
        attention(q, k, v, options)
    }
}

/// The whole (padded) sequence is local: attention over the first `tokens` keys. The inner
/// attention of Ulysses without context parallelism, and the single-rank case.
#[derive(Debug, Clone, Copy)]
pub struct LocalChunk {
    /// Real tokens of the sequence.
    pub tokens: usize,
    /// FP8 attention (`ditstream_kernels::attention_fp8`) rather than the tensors' dtype.
    pub fp8: bool,
}

impl ChunkAttention for LocalChunk {
    fn attend_chunk(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let kv_len = valid_in_chunk(self.tokens, 0, k.shape()[1]);
        let options = AttentionOptions {
            scale: None,
            kv_len: Some(kv_len),
        };
        Ok(local_attention(self.fp8, q, k, v, options)?.0)
    }
}

/// Any [`ChunkAttention`] as the model's `SelfAttention`. The model's error type cannot carry a
/// collective failure, so the typed error is kept here and the model gets a summary;
/// [`ModelAttention::take_error`] gives the typed one back.
pub struct ModelAttention<'a> {
    inner: &'a dyn ChunkAttention,
    failure: RefCell<Option<ParallelError>>,
}

impl<'a> ModelAttention<'a> {
    /// Wraps `inner`.
    pub fn new(inner: &'a dyn ChunkAttention) -> Self {
        Self {
            inner,
            failure: RefCell::new(None),
        }
    }

    /// The error a block returned, replaced by the typed error of the attention when it was the
    /// attention that failed.
    pub fn take_error(&self, from_model: ModelError) -> ParallelError {
        self.failure
            .borrow_mut()
            .take()
            .unwrap_or(ParallelError::Model(from_model))
    }

    /// The model's summary of a failure of the wrapper, whose typed error is kept for
    /// [`ModelAttention::take_error`] (an operand's own failure comes back as it was, as
    /// `ParallelError::Model`).
    fn kept(&self, result: Result<Tensor>) -> Result<Tensor, ModelError> {
        result.map_err(|e| {
            let summary = ModelError::Input {
                what: "parallel self-attention",
                value: "this rank's chunk".into(),
                rule: e.to_string(),
            };
            *self.failure.borrow_mut() = Some(e);
            summary
        })
    }
}

impl SelfAttention for ModelAttention<'_> {
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor, ModelError> {
        self.kept(self.inner.attend_chunk(q, k, v))
    }

    fn attend_staged(
        &self,
        operand: &mut dyn FnMut(Operand) -> Result<Tensor, ModelError>,
    ) -> Result<Tensor, ModelError> {
        let mut produce = |which| operand(which).map_err(ParallelError::Model);
        self.kept(self.inner.attend_chunk_staged(&mut produce))
    }
}
