//! Attention2D (arXiv 2503.15758) over an R × C grid of the cp axis, chunk index
//! `cp_rank = row·C + col`:
//! 1. Q is all-gathered over the row group (fixed row, C ranks): every rank of row `row` holds
//!    the queries of chunks `row·C .. row·C + C`, [B, C·S_c, H, D].
//! 2. K and V, packed in one buffer, are all-gathered over the column group (fixed col, R
//!    ranks): the keys of chunks `r·C + col` for every r.
//! 3. One attention pass gives a partial (out, LSE) of the row's queries over the column's keys.
//! 4. Two all-to-alls over the row group (out, then LSE) send each query chunk's partial to the
//!    rank that owns it; every rank then holds C partials of its queries, whose key sets cover
//!    the whole sequence,
//! 5. merged with the LSE combine.
//!
//! Communication per rank is O(N/√P) against Ring's O(N). Overlap: the model's projections run
//! when asked ([`ChunkAttention::attend_chunk_staged`]), V and K first, so the K/V gather over the
//! column group is posted before Q exists and travels while Q is projected and gathered over the
//! row group (on NCCL both gathers share the communicators' stream, so they overlap Q's
//! projection, not each other). The values are those of the unstaged order.
//!
//! Padding: the gathered key chunks are strided (`r·C + col`), so their real keys are not one
//! prefix; the real prefix of each chunk is packed to the front before the attention (keys carry
//! their RoPE already, and attention does not care about key order). A column with no real key
//! contributes a partial with LSE −∞, which the combine ignores.

use ditstream_common::collectives::wire::{self, TensorWire};
use ditstream_kernels::{AttentionOptions, DType, Tensor, lse_combine};

use super::attention::{ChunkAttention, StagedOperand, given, local_attention};
use super::{ParallelError, Result, valid_in_chunk};
use crate::model::Operand;

/// Attention2D over `row` (fixed row; group rank = col) and `col` (fixed col; group rank = row).
/// A group of one rank is `None`.
pub struct Attention2d<'c, C> {
    row: Option<&'c C>,
    col: Option<&'c C>,
    tokens: usize,
    fp8: bool,
}

impl<'c, C: TensorWire> Attention2d<'c, C> {
    /// Attention2D for a sequence of `tokens` real tokens.
    pub fn new(row: Option<&'c C>, col: Option<&'c C>, tokens: usize) -> Self {
        Self {
            row,
            col,
            tokens,
            fp8: false,
        }
    }

    /// The same layout with FP8 attention on each gathered block (`model.dtype: fp8`).
    pub fn with_fp8(self, fp8: bool) -> Self {
        Self { fp8, ..self }
    }

    /// (R, C, row, col) of this rank.
    fn grid(&self) -> (usize, usize, usize, usize) {
        let (rows, row) = self.col.map_or((1, 0), |c| (c.size(), c.rank()));
        let (cols, col) = self.row.map_or((1, 0), |c| (c.size(), c.rank()));
        (rows, cols, row, col)
    }
}

fn shape_error(t: &Tensor) -> ParallelError {
    ParallelError::Shape {
        what: "attention2d input",
        shape: t.shape().to_vec(),
        rule: "q, k and v must be [B, S, H, D] of one shape",
    }
}

/// t [G, B, S, ..] (G gathered pieces of consecutive sequence chunks) → [B, G·S, ..].
fn join_gathered(t: &Tensor) -> Result<Tensor> {
    let s = t.shape();
    let mut joined = s[1..].to_vec();
    joined[1] *= s[0];
    if s[1] == 1 {
        return Ok(t.reshape(&joined)?);
    }
    let mut perm: Vec<usize> = (0..s.len()).collect();
    perm.swap(0, 1);
    Ok(t.permute(&perm)?.reshape(&joined)?)
}

impl<C: TensorWire> ChunkAttention for Attention2d<'_, C> {
    fn attend_chunk(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        self.attend_chunk_staged(&mut given(q, k, v))
    }

    /// V and K first: their gather over the column group is posted, and Q is projected and
    /// gathered over the row group while it travels.
    fn attend_chunk_staged(&self, operand: &mut StagedOperand<'_>) -> Result<Tensor> {
        let v = operand(Operand::V)?;
        let k = operand(Operand::K)?;
        let &[b, s, h, d] = k.shape() else {
            return Err(shape_error(&k));
        };
        if v.shape() != k.shape() {
            return Err(shape_error(&v));
        }
        let (rows, cols, _, col) = self.grid();

        // 1. The row's queries, [B, C·S, H, D].
        let mut row_queries = || -> Result<Tensor> {
            let q = operand(Operand::Q)?;
            if q.shape() != k.shape() {
                return Err(shape_error(&q));
            }
            match self.row {
                Some(row) => join_gathered(&wire::all_gather(row, &q)?),
                None => Ok(q),
            }
        };

        // 2. The column's keys and values (gathered under step 1), real prefixes first:
        // [B, Σ valid, H, D].
        let kv = Tensor::concat(
            &[&k.reshape(&[1, b, s, h, d])?, &v.reshape(&[1, b, s, h, d])?],
            0,
        )?;
        let (kv_col, q_row) = match self.col {
            Some(c) => wire::all_gather_during(c, &kv, row_queries)?,
            None => (kv.reshape(&[1, 2, b, s, h, d])?, row_queries()?),
        };
        let mut keys = Vec::new();
        let mut values = Vec::new();
        for r in 0..rows {
            let valid = valid_in_chunk(self.tokens, r * cols + col, s);
            if valid > 0 {
                let chunk = kv_col.narrow(0, r, 1)?.reshape(&[2, b, s, h, d])?;
                let chunk = chunk.narrow(2, 0, valid)?;
                keys.push(chunk.narrow(0, 0, 1)?.reshape(&[b, valid, h, d])?);
                values.push(chunk.narrow(0, 1, 1)?.reshape(&[b, valid, h, d])?);
            }
        }

        // 3. One pass: the row's queries over the column's keys.
        let (out, lse) = if keys.is_empty() {
            (
                Tensor::zeros(q_row.shape(), q_row.dtype(), q_row.device())?,
                Tensor::full(
                    &[b, h, cols * s],
                    f32::NEG_INFINITY,
                    DType::F32,
                    q_row.device(),
                )?,
            )
        } else {
            let keys = Tensor::concat(&keys.iter().collect::<Vec<_>>(), 1)?;
            let values = Tensor::concat(&values.iter().collect::<Vec<_>>(), 1)?;
            local_attention(
                self.fp8,
                &q_row,
                &keys,
                &values,
                AttentionOptions::default(),
            )?
        };
        let Some(row) = self.row else {
            return Ok(out); // C = 1: the column's keys are the whole sequence
        };

        // 4. Query chunk j's partial to column j: out [C, B, S, H, D], lse [C, B, H, S].
        let out_send = out
            .reshape(&[b, cols, s, h, d])?
            .permute(&[1, 0, 2, 3, 4])?;
        let lse_send = lse.reshape(&[b, h, cols, s])?.permute(&[2, 0, 1, 3])?;
        let out_parts = wire::all_to_all(row, &out_send)?;
        let lse_parts = wire::all_to_all(row, &lse_send)?;

        // 5. Combine the C partials of this rank's queries.
        let parts = (0..cols)
            .map(|j| -> Result<(Tensor, Tensor)> {
                Ok((
                    out_parts.narrow(0, j, 1)?.reshape(&[b, s, h, d])?,
                    lse_parts.narrow(0, j, 1)?.reshape(&[b, h, s])?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<(&Tensor, &Tensor)> = parts.iter().map(|(o, l)| (o, l)).collect();
        Ok(lse_combine(&refs)?.0)
    }
}
