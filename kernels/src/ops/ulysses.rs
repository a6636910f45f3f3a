//! Ulysses sequence-parallel layout permutes, as plain tensor ops around an all-to-all.
//!
//! Each rank of P holds S/P tokens of every head before attention and all S tokens of H/P heads during
//! it. The all-to-all moves chunk p of a packed buffer [P, ..] to rank p, and rank r receives chunk r of
//! every rank's buffer, stacked in source-rank order: the same [P, ..] shape. The pack functions give that
//! send buffer (each chunk contiguous), the unpack functions turn the receive buffer into the layout the
//! next step wants. Forward: `pack_heads` → all-to-all → `unpack_seq`; back: `pack_seq` → all-to-all →
//! `unpack_heads`. The stacked-QKV pair moves q, k and v in one all-to-all.

use crate::{KernelError, Result, Tensor};

use super::dims;

/// Splits `dim` into `world` equal parts, or explains why it cannot.
fn part(op: &'static str, name: &'static str, dim: usize, world: usize) -> Result<usize> {
    // checked_rem is None for world = 0, which is as wrong as a remainder.
    if dim.checked_rem(world) != Some(0) {
        return Err(KernelError::arg(
            op,
            "world",
            world,
            format!("it must divide {name} = {dim}"),
        ));
    }
    Ok(dim / world)
}

/// Send buffer before attention: x [B, S/P, H, D] → [P, B, S/P, H/P, D]; chunk p holds heads
/// p·H/P..(p+1)·H/P. H must divide by P.
pub fn ulysses_pack_heads(x: &Tensor, world: usize) -> Result<Tensor> {
    const OP: &str = "ulysses_pack_heads";
    let [b, s, h, d] = dims(OP, "x [B, S/P, H, D]", x)?;
    let h_local = part(OP, "H", h, world)?;
    x.reshape(&[b, s, world, h_local, d])?
        .permute(&[2, 0, 1, 3, 4])
}

/// Receive buffer before attention → full sequence of this rank's heads: [P, B, S/P, H/P, D] →
/// [B, S, H/P, D], where chunk p held tokens p·S/P..(p+1)·S/P.
pub fn ulysses_unpack_seq(recv: &Tensor) -> Result<Tensor> {
    const OP: &str = "ulysses_unpack_seq";
    let [p, b, s, h, d] = dims(OP, "recv [P, B, S/P, H/P, D]", recv)?;
    recv.permute(&[1, 0, 2, 3, 4])?.reshape(&[b, p * s, h, d])
}

/// Send buffer after attention: out [B, S, H/P, D] → [P, B, S/P, H/P, D]; chunk p holds tokens
/// p·S/P..(p+1)·S/P. S must divide by P.
pub fn ulysses_pack_seq(x: &Tensor, world: usize) -> Result<Tensor> {
    const OP: &str = "ulysses_pack_seq";
    let [b, s, h, d] = dims(OP, "x [B, S, H/P, D]", x)?;
    let s_local = part(OP, "S", s, world)?;
    x.reshape(&[b, world, s_local, h, d])?
        .permute(&[1, 0, 2, 3, 4])
}

/// Receive buffer after attention → this rank's tokens with every head: [P, B, S/P, H/P, D] →
/// [B, S/P, H, D], where chunk p held heads p·H/P..(p+1)·H/P.
pub fn ulysses_unpack_heads(recv: &Tensor) -> Result<Tensor> {
    const OP: &str = "ulysses_unpack_heads";
    let [p, b, s, h, d] = dims(OP, "recv [P, B, S/P, H/P, D]", recv)?;
    recv.permute(&[1, 2, 0, 3, 4])?.reshape(&[b, s, p * h, d])
}

/// Send buffer of stacked QKV: x [B, S/P, 3, H, D] → [P, B, S/P, 3, H/P, D]; chunk p holds heads
/// p·H/P..(p+1)·H/P of q, k and v.
pub fn ulysses_pack_qkv(x: &Tensor, world: usize) -> Result<Tensor> {
    const OP: &str = "ulysses_pack_qkv";
    let [b, s, three, h, d] = dims(OP, "x [B, S/P, 3, H, D]", x)?;
    if three != 3 {
        return Err(KernelError::shape(OP, "x [B, S/P, 3, H, D]", &[x.shape()]));
    }
    let h_local = part(OP, "H", h, world)?;
    x.reshape(&[b, s, 3, world, h_local, d])?
        .permute(&[3, 0, 1, 2, 4, 5])
}

/// Receive buffer of stacked QKV → (q, k, v), each [B, S, H/P, D]: [P, B, S/P, 3, H/P, D], chunk p
/// holding tokens p·S/P..(p+1)·S/P.
pub fn ulysses_unpack_qkv(recv: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "ulysses_unpack_qkv";
    let [p, b, s, three, h, d] = dims(OP, "recv [P, B, S/P, 3, H/P, D]", recv)?;
    if three != 3 {
        return Err(KernelError::shape(
            OP,
            "recv [P, B, S/P, 3, H/P, D]",
            &[recv.shape()],
        ));
    }
    let stacked = recv
        .permute(&[1, 0, 2, 3, 4, 5])?
        .reshape(&[b, p * s, 3, h, d])?;
    let q = stacked.narrow(2, 0, 1)?.reshape(&[b, p * s, h, d])?;
    let k = stacked.narrow(2, 1, 1)?.reshape(&[b, p * s, h, d])?;
    let v = stacked.narrow(2, 2, 1)?.reshape(&[b, p * s, h, d])?;
    Ok((q, k, v))
}

#[cfg(test)]
mod tests {
    //! Simulates P ranks in one process: an all-to-all is "rank r's receive chunk p = rank p's send
    //! chunk r". The permutes are copies, so every comparison is exact.

    use super::*;
    use crate::{DType, Device};

    /// All-to-all over P ranks' send buffers [P, ..] → their receive buffers [P, ..].
    fn all_to_all(sends: &[Tensor]) -> Result<Vec<Tensor>> {
        let world = sends.len();
        (0..world)
            .map(|r| {
                let chunks = sends
                    .iter()
                    .map(|send| send.narrow(0, r, 1))
                    .collect::<Result<Vec<_>>>()?;
                Tensor::concat(&chunks.iter().collect::<Vec<_>>(), 0)
            })
            .collect()
    }

    #[test]
    fn heads_then_seq_round_trip() -> Result<()> {
        let (b, s, h, d, world) = (2, 12, 6, 4, 3);
        let full = Tensor::randn(&[b, s, h, d], DType::F32, 9, Device::Cpu)?;
        let local = full.chunk(1, world)?; // rank r's tokens
        let sends = local
            .iter()
            .map(|x| ulysses_pack_heads(x, world))
            .collect::<Result<Vec<_>>>()?;
        let recvs = all_to_all(&sends)?;
        let head_groups = full.chunk(2, world)?;
        let mut back_sends = Vec::new();
        for (r, recv) in recvs.iter().enumerate() {
            // Rank r now holds every token of heads r·H/P..(r+1)·H/P.
            let by_heads = ulysses_unpack_seq(recv)?;
            assert_eq!(by_heads.to_vec_f32()?, head_groups[r].to_vec_f32()?);
            back_sends.push(ulysses_pack_seq(&by_heads, world)?);
        }
        for (r, recv) in all_to_all(&back_sends)?.iter().enumerate() {
            assert_eq!(
                ulysses_unpack_heads(recv)?.to_vec_f32()?,
                local[r].to_vec_f32()?
            );
        }
        Ok(())
    }

    #[test]
    fn stacked_qkv_round_trip() -> Result<()> {
        let (b, s, h, d, world) = (1, 8, 4, 3, 2);
        let qkv = Tensor::randn(&[b, s, 3, h, d], DType::F32, 10, Device::Cpu)?;
        let sends = qkv
            .chunk(1, world)?
            .iter()
            .map(|x| ulysses_pack_qkv(x, world))
            .collect::<Result<Vec<_>>>()?;
        for (r, recv) in all_to_all(&sends)?.iter().enumerate() {
            let (q, k, v) = ulysses_unpack_qkv(recv)?;
            for (i, got) in [q, k, v].iter().enumerate() {
                let expect = qkv
                    .narrow(2, i, 1)?
                    .reshape(&[b, s, h, d])?
                    .chunk(2, world)?
                    .swap_remove(r);
                assert_eq!(got.to_vec_f32()?, expect.to_vec_f32()?);
            }
        }
        Ok(())
    }

    #[test]
    fn indivisible_world_is_an_error() -> Result<()> {
        let x = Tensor::zeros(&[1, 4, 6, 2], DType::F32, Device::Cpu)?;
        assert!(ulysses_pack_heads(&x, 4).is_err());
        assert!(ulysses_pack_seq(&x, 3).is_err());
        assert!(ulysses_pack_heads(&x, 0).is_err());
        Ok(())
    }
}
