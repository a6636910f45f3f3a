//! The Ulysses sequence ↔ heads layouts, built on any [`Communicator`] as
//! pack (strided block copy) → all_to_all → unpack.
//!
//! Shapes (P = group size, rank r holds sequence shard r before and head group r after):
//! ```text
//! seq_to_heads:  [B, S/P, G, H, D]  →  [B, S, G, H/P, D]
//! heads_to_seq:  [B, S, G, H/P, D]  →  [B, S/P, G, H, D]
//! ```
//! G = 1 is the plain 4-D `[B, S/P, H, D] ↔ [B, S, H/P, D]` (attention output); G = 3 is stacked
//! QKV `[B, S/P, 3, H, D] → [B, S, 3, H/P, D]` (one fused all-to-all for q, k and v).
//!
//! Layout math, with s = S/P, h = H/P, chunk = B·s·G·h·D (the elements one rank sends another):
//!
//! seq_to_heads
//! - pack: chunk j (for rank j) is `in[:, :, :, j·h..(j+1)·h, :]` laid out `[B, s, G, h, D]`. Seen as
//!   rows of h·D elements, `in` has B·s·G rows of pitch H·D and chunk j starts at column j·h·D:
//!   one 2-D copy per j (height B·s·G, width h·D, src pitch H·D, dst pitch h·D, dst offset j·chunk).
//! - all_to_all: recv chunk i = rank i's sequence shard of our heads, `[B, s, G, h, D]`.
//! - unpack: `out[b, i·s + t, g, k, d] = recv[i, b, t, g, k, d]`: per i, B rows of s·G·h·D elements,
//!   src pitch s·G·h·D (contiguous), dst pitch S·G·h·D, dst offset i·s·G·h·D.
//!   With B = 1 the recv layout `[P, s, G, h, D]` already is `[S, G, h, D]`: no unpack.
//!
//! heads_to_seq (exact inverse)
//! - pack: chunk j = `in[:, j·s..(j+1)·s]` = per b a contiguous run of s·G·h·D elements at
//!   `b·S·G·h·D + j·s·G·h·D`: per j, B rows (src pitch S·G·h·D, dst pitch s·G·h·D).
//!   With B = 1 the input already is packed: no pack.
//! - all_to_all: recv chunk i = head group i of our sequence shard, `[B, s, G, h, D]`.
//! - unpack: `out[b, t, g, i·h + k, d] = recv[i, b, t, g, k, d]`: per i, B·s·G rows of h·D elements,
//!   src pitch h·D, dst pitch H·D, dst offset i·h·D.
//!
//! Every variant needs one scratch buffer of the tensor's size; the output doubles as the
//! second temporary (pack into `out`, all_to_all `out → scratch`, unpack `scratch → out`).
//! A producer that writes its projection directly in packed order would save the pack copy;
//! that is the attention wrapper's business, not this layer's.

use super::{CollectiveError, Communicator, Element, Pending, Result, check};

/// Dimensions of a Ulysses layout: `b` batch, `s_local` = S/P sequence positions per rank,
/// `stack` G stacked tensors (1 for `[B, S, H, D]`, 3 for stacked QKV), `h` total heads,
/// `d` head dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UlyssesShape {
    /// Batch B.
    pub b: usize,
    /// Sequence positions per rank, S/P.
    pub s_local: usize,
    /// Stacked tensors G (1 or 3).
    pub stack: usize,
    /// Total heads H (divisible by P).
    pub h: usize,
    /// Head dimension D.
    pub d: usize,
}

impl UlyssesShape {
    /// The 4-D layout `[B, S/P, H, D] ↔ [B, S, H/P, D]`.
    pub fn bshd(b: usize, s_local: usize, h: usize, d: usize) -> Self {
        Self {
            b,
            s_local,
            stack: 1,
            h,
            d,
        }
    }

    /// The stacked-QKV layout `[B, S/P, 3, H, D] → [B, S, 3, H/P, D]`.
    pub fn qkv(b: usize, s_local: usize, h: usize, d: usize) -> Self {
        Self {
            b,
            s_local,
            stack: 3,
            h,
            d,
        }
    }

    /// Elements of the tensor on one rank (the same before and after): B·(S/P)·G·H·D.
    pub fn numel(&self) -> usize {
        self.b * self.s_local * self.stack * self.h * self.d
    }
}

/// The Ulysses layouts on every [`Communicator`]; blanket-implemented.
pub trait UlyssesExt: Communicator {
    /// input `[B, S/P, G, H, D]` (sequence shard r) → output `[B, S, G, H/P, D]` (head group r).
    /// `scratch` is any buffer of `shape.numel()` elements; its contents are overwritten.
    /// [`UlyssesExt::seq_to_heads_posted`], waited, then [`UlyssesExt::seq_to_heads_finish`].
    fn seq_to_heads<T: Element>(
        &self,
        input: &Self::Buf<T>,
        output: &mut Self::Buf<T>,
        scratch: &mut Self::Buf<T>,
        shape: UlyssesShape,
    ) -> Result<()> {
        self.seq_to_heads_posted(input, output, scratch, shape)?
            .wait()?;
        self.seq_to_heads_finish(output, scratch, shape)?;
        self.synchronize()
    }

    /// The first half of [`UlyssesExt::seq_to_heads`]: packs `input` and posts the all-to-all
    /// ([`Communicator::all_to_all_posted`]), so the caller can queue other work (the next
    /// projection) under the transfer. Once the handle is waited, `input` may be reused and
    /// [`UlyssesExt::seq_to_heads_finish`] on the same `output` and `scratch` completes the
    /// layout in `output`.
    fn seq_to_heads_posted<'a, T: Element>(
        &'a self,
        input: &Self::Buf<T>,
        output: &'a mut Self::Buf<T>,
        scratch: &'a mut Self::Buf<T>,
        shape: UlyssesShape,
    ) -> Result<Self::Pending<'a>>;

    /// The second half: after the posted handle was waited, the received chunks in their final
    /// layout in `output` (B = 1: already there, nothing to do; B > 1: one unpack copy), complete
    /// once [`Communicator::synchronize`] returns (one call can follow several of these).
    fn seq_to_heads_finish<T: Element>(
        &self,
        output: &mut Self::Buf<T>,
        scratch: &mut Self::Buf<T>,
        shape: UlyssesShape,
    ) -> Result<()>;

    /// input `[B, S, G, H/P, D]` (head group r) → output `[B, S/P, G, H, D]` (sequence shard r);
    /// the inverse of [`UlyssesExt::seq_to_heads`]. `scratch`: `shape.numel()` elements.
    fn heads_to_seq<T: Element>(
        &self,
        input: &Self::Buf<T>,
        output: &mut Self::Buf<T>,
        scratch: &mut Self::Buf<T>,
        shape: UlyssesShape,
    ) -> Result<()>;
}

/// Validated sizes: (P, h = H/P, chunk elements).
fn plan<C: Communicator + ?Sized>(
    comm: &C,
    op: &'static str,
    bufs: &[(&'static str, usize)],
    shape: UlyssesShape,
) -> Result<(usize, usize, usize)> {
    let p = comm.size();
    if shape.h.checked_rem(p) != Some(0) {
        return Err(CollectiveError::HeadsNotDivisible {
            heads: shape.h,
            size: p,
        });
    }
    for &(what, len) in bufs {
        check::len(op, what, shape.numel(), len)?;
    }
    let h_local = shape.h / p;
    let chunk = shape.b * shape.s_local * shape.stack * h_local * shape.d;
    Ok((p, h_local, chunk))
}

impl<C: Communicator + ?Sized> UlyssesExt for C {
    fn seq_to_heads_posted<'a, T: Element>(
        &'a self,
        input: &Self::Buf<T>,
        output: &'a mut Self::Buf<T>,
        scratch: &'a mut Self::Buf<T>,
        shape: UlyssesShape,
    ) -> Result<Self::Pending<'a>> {
        let lens = [
            ("input", self.len(input)),
            ("output", self.len(&*output)),
            ("scratch", self.len(&*scratch)),
        ];
        let (p, hl, chunk) = plan(self, "seq_to_heads", &lens, shape)?;
        let UlyssesShape {
            b,
            s_local: s,
            stack: g,
            h,
            d,
        } = shape;
        let row = hl * d; // one head group of one (b, t, g) position
        // Pack into `scratch` when B = 1 (all_to_all then lands directly in `output`);
        // otherwise into `output`, used as a temporary, and receive into `scratch`.
        let (packed, received): (&'a mut Self::Buf<T>, &'a mut Self::Buf<T>) = if b == 1 {
            (scratch, output)
        } else {
            (output, scratch)
        };
        for j in 0..p {
            self.copy_2d(
                input,
                j * row,
                h * d,
                packed,
                j * chunk,
                row,
                row,
                b * s * g,
            )?;
        }
        self.all_to_all_posted(packed, received)
    }

    fn seq_to_heads_finish<T: Element>(
        &self,
        output: &mut Self::Buf<T>,
        scratch: &mut Self::Buf<T>,
        shape: UlyssesShape,
    ) -> Result<()> {
        let lens = [
            ("output", self.len(&*output)),
            ("scratch", self.len(&*scratch)),
        ];
        let (p, hl, chunk) = plan(self, "seq_to_heads", &lens, shape)?;
        let UlyssesShape {
            b,
            s_local: s,
            stack: g,
            ..
        } = shape;
        if b == 1 {
            return Ok(());
        }
        // Received into `scratch`, packed in `output`: unpack scratch → output.
        let run = s * g * hl * shape.d; // one batch entry of one received chunk
        for i in 0..p {
            self.copy_2d(scratch, i * chunk, run, output, i * run, p * run, run, b)?;
        }
        Ok(())
    }

    fn heads_to_seq<T: Element>(
        &self,
        input: &Self::Buf<T>,
        output: &mut Self::Buf<T>,
        scratch: &mut Self::Buf<T>,
        shape: UlyssesShape,
    ) -> Result<()> {
        let lens = [
            ("input", self.len(input)),
            ("output", self.len(&*output)),
            ("scratch", self.len(&*scratch)),
        ];
        let (p, hl, chunk) = plan(self, "heads_to_seq", &lens, shape)?;
        let UlyssesShape {
            b,
            s_local: s,
            stack: g,
            h,
            d,
        } = shape;
        let row = hl * d;
        let run = s * g * row;
        if b == 1 {
            // The input [S, G, h, D] is already P packed chunks of [s, G, h, D].
            self.all_to_all(input, scratch)?;
        } else {
            for j in 0..p {
                self.copy_2d(input, j * run, p * run, output, j * chunk, run, run, b)?;
            }
            self.all_to_all(&*output, scratch)?;
        }
        for i in 0..p {
            self.copy_2d(
                scratch,
                i * chunk,
                row,
                output,
                i * row,
                h * d,
                row,
                b * s * g,
            )?;
        }
        self.synchronize()
    }
}
