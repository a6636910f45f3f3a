//! [`ParallelVaeDecoder`]: one rank of a parallel-VAE instance. It decodes the rank's band of each
//! latent chunk with the shared [`WanVaeDecoder`] and [`HaloOps`], and gathers the decoded bands to
//! the encoding rank (group rank 0) only.
//!
//! **Agreement before each chunk.** Every rank checks its own chunk, then the ranks all-gather a
//! six-number description of it (accepted?, batch, latent frames, latent size, stream position). If
//! any rank rejected its chunk, or the ranks hold different chunks, every rank returns an error
//! before any halo is exchanged, and the instance stays usable: bad input gives a clear error on
//! every rank, never one rank waiting for a peer that already gave up.
//!
//! **Failure inside a step that communicates** (a peer died, timed out, a kernel failed half-way):
//! the rank drops its communicator, which fails the same step on every peer at once (the
//! [`Communicator`](ditstream_common::collectives::Communicator) contract), and the decoder is unusable afterwards ([`ParallelVaeError::Broken`]).
//! Never a hang: the worst case is the communicator's timeout. Halo exchanges under NCCL do not wait
//! on the host (`halo`'s "No host wait per conv"), so before `decode_chunk` returns frames it waits
//! for the communicator (`synchronize`, with its timeout): a transfer stuck on a vanished peer fails
//! the chunk there, never a later host read of the frames.
//!
//! **Gather to rank 0 only.** Each other rank sends its band with one point-to-point `send_recv`
//! (the return direction is empty), so only the encoding rank receives the video ((P − 1)/P of
//! it), rather than every rank receiving all of it as an all-gather would (TensorRT-LLM's choice,
//! `reference/visualgen.md` §4).

use std::borrow::{Borrow, BorrowMut};
use std::sync::{Arc, Mutex};

use ditstream_common::collectives::wire::{self, TensorWire};
use ditstream_common::config::VaeSplitDim;
use ditstream_kernels::Tensor;

use super::error::{ParallelVaeError, Result};
use super::halo::HaloOps;
use super::shard::Shard;
use crate::vae::{DecodeStream, VaeError, WanVaeDecoder};

/// One rank of a parallel-VAE instance of `comm.size()` ranks (`parallel_vae_size`): the shared
/// decoder weights, the instance's communicator and the split dimension. Driven by one thread;
/// every rank calls the same methods with the same streams' chunks in the same order.
pub struct ParallelVaeDecoder<C> {
    decoder: Arc<WanVaeDecoder>,
    /// `None` once a step that communicates failed on this rank (dropping it failed the peers).
    comm: Option<C>,
    split_dim: VaeSplitDim,
    rank: usize,
    size: usize,
    ranks: Vec<usize>,
}

/// Per-request state of one rank, owned by the caller: the band geometry and the decode stream of
/// the band (its frame caches hold only the band's rows).
#[derive(Debug, Clone)]
pub struct ParallelDecodeStream {
    shard: Shard,
    inner: DecodeStream,
    /// Batch size, fixed by the first chunk.
    batch: Option<usize>,
}

/// Numbers in a chunk's description for the agreement step: accepted (1/0), batch, latent frames,
/// the whole latent's height and width, latent frames decoded before it.
const DESCRIPTION_LEN: usize = 6;

impl ParallelDecodeStream {
    /// The band geometry (split dimension, rank, latent bands).
    pub fn shard(&self) -> &Shard {
        &self.shard
    }

    /// This rank's [B, C, T, h, w] band of the whole latent chunk [B, C, T, H, W]: what
    /// [`ParallelVaeDecoder::decode_chunk`] takes when every rank holds the whole latent.
    pub fn band_of(&self, whole: &Tensor) -> Result<Tensor> {
        self.shard.narrow(whole)
    }

    /// Latent frames decoded so far.
    pub fn latent_frames_decoded(&self) -> usize {
        self.inner.latent_frames_decoded()
    }

    /// Bytes held by this rank's frame caches (about 1/P of an unsharded stream's).
    pub fn cache_bytes(&self) -> usize {
        self.inner.cache_bytes()
    }
}

impl<C: TensorWire + Send> ParallelVaeDecoder<C> {
    /// The rank `comm.rank()` of an instance of `comm.size()` ranks, splitting latents along
    /// `split_dim`. The decoder is shared (weights are read-only while decoding).
    pub fn new(decoder: Arc<WanVaeDecoder>, comm: C, split_dim: VaeSplitDim) -> Self {
        ParallelVaeDecoder {
            decoder,
            rank: comm.rank(),
            size: comm.size(),
            ranks: comm.ranks().to_vec(),
            comm: Some(comm),
            split_dim,
        }
    }

    /// The shared decoder.
    pub fn decoder(&self) -> &WanVaeDecoder {
        &self.decoder
    }

    /// This rank's group rank in the instance (0 encodes).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the instance.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Hands the communicator back, or `None` if a failure dropped it. Dropping a communicator
    /// fails whatever its group still has in flight (the [`Communicator`](ditstream_common::collectives::Communicator) contract; the thread
    /// backend treats it as this rank leaving), so a rank that finishes early must not drop it while
    /// a peer may still be gathering: end with a barrier on it, or keep it.
    pub fn into_communicator(self) -> Option<C> {
        self.comm
    }

    /// Starts a request of `latent_height` × `latent_width` (the whole latent). Fails with
    /// [`ParallelVaeError::SplitTooFine`] (the same on every rank) when the split dimension has
    /// fewer latent rows than there are ranks. No communication.
    pub fn new_stream(
        &self,
        latent_height: usize,
        latent_width: usize,
    ) -> Result<ParallelDecodeStream> {
        let shard = Shard::new(
            self.split_dim,
            self.size,
            self.rank,
            latent_height,
            latent_width,
        )?;
        let (band_height, band_width) = band_size(&shard);
        Ok(ParallelDecodeStream {
            inner: self.decoder.new_stream(band_height, band_width)?,
            shard,
            batch: None,
        })
    }

    /// Decodes this rank's band of the next latent frames: latent [B, z_dim, n, h, w] (the rank's
    /// band, see [`ParallelDecodeStream::band_of`]) → its band of the video [B, 3, F, 8h, 8w], with
    /// F as in [`WanVaeDecoder::decode_chunk`]. Equals the unsharded decode's rows of the band.
    /// Collective: every rank of the instance calls it with its band of the same chunk. A rejected
    /// chunk (here or on a peer) leaves the stream as it was.
    ///
    /// One agreement before the chunk and one wait for the communicator after it; between them the
    /// decoder's passes (one per latent frame) and their transfers queue back to back on the GPU.
    /// So a caller holding several latent frames gets the most out of the GPUs by handing them over
    /// in one call: a call per latent frame drains every rank's GPU at each frame's end (the host
    /// waits, then queues the next frame's first kernels while its GPU idles).
    pub fn decode_chunk(
        &mut self,
        stream: &mut ParallelDecodeStream,
        latent: &Tensor,
    ) -> Result<Tensor> {
        let _span = tracing::debug_span!(
            "parallel_vae_decode_chunk",
            vae_rank = self.rank,
            vae_size = self.size,
            first_latent_frame = stream.latent_frames_decoded(),
        )
        .entered();
        self.agree(stream, latent)?;
        let decoder = self.decoder.clone();
        let shard = stream.shard;
        let frames = self.communicate(|comm| {
            let ops = HaloOps::new(comm, shard).stream_ordered();
            let frames = decoder
                .decode_chunk_with(&mut stream.inner, latent, &ops)
                .map_err(ParallelVaeError::from)?;
            // The chunk's last halo transfers are done (or failed, or timed out) before anyone can
            // wait for the frames on the GPU (module docs).
            let comm = comm.lock().unwrap_or_else(|p| p.into_inner());
            let _wait =
                tracing::debug_span!("parallel_vae_sync", vae_rank = shard.rank()).entered();
            comm.synchronize()?;
            Ok(frames)
        })?;
        stream.batch = Some(latent.shape()[0]);
        Ok(frames)
    }

    /// Gathers a chunk's decoded bands to group rank 0: `frames` is this rank's output of
    /// [`ParallelVaeDecoder::decode_chunk`] for `stream`; rank 0 gets `Some` of the whole video
    /// chunk [B, 3, F, 8H, 8W], every other rank `None` (it only sends). Collective.
    pub fn gather_frames(
        &mut self,
        stream: &ParallelDecodeStream,
        frames: &Tensor,
    ) -> Result<Option<Tensor>> {
        let shard = stream.shard;
        let scale = self.decoder.config().spatial_scale();
        let axis = shard.axis();
        let shape = frames.shape();
        let expected_rows = shard.band_len(self.rank, scale);
        let other_axis = 7 - axis; // 3 ↔ 4
        if shape.len() != 5
            || shape[axis] != expected_rows
            || shape[other_axis] != shard.latent_other_extent() * scale
        {
            // The peers are already waiting in the gather: fail them too (see the module docs).
            self.comm = None;
            return Err(ParallelVaeError::FramesShape {
                rank: self.rank,
                scale,
                expected_rows,
                shape: shape.to_vec(),
            });
        }
        let _span = tracing::debug_span!(
            "parallel_vae_gather",
            vae_rank = self.rank,
            vae_size = self.size
        )
        .entered();
        let rank = self.rank;
        self.communicate(|comm| {
            let comm = comm.lock().unwrap_or_else(|p| p.into_inner());
            // One-way transfers in the frames' dtype, device to device under NCCL (`wire`).
            if rank != 0 {
                wire::send(&*comm, frames, 0)?;
                return Ok(None);
            }
            let mut bands = vec![frames.clone()];
            for peer in 1..shard.size() {
                let mut band_shape = shape.to_vec();
                band_shape[axis] = shard.band_len(peer, scale);
                bands.push(wire::recv(
                    &*comm,
                    &band_shape,
                    frames.dtype(),
                    frames.device(),
                    peer,
                )?);
            }
            Ok(Some(Tensor::concat(
                &bands.iter().collect::<Vec<_>>(),
                axis,
            )?))
        })
    }

    /// The agreement step (module docs): checks this rank's chunk, learns every rank's verdict and
    /// description, and fails on every rank alike if any rank rejected or the chunks differ.
    fn agree(&mut self, stream: &ParallelDecodeStream, latent: &Tensor) -> Result<()> {
        let _span = tracing::debug_span!("parallel_vae_agree", vae_rank = self.rank).entered();
        let checked = self.check_chunk(stream, latent);
        let (batch, frames) = match (checked.is_ok(), latent.shape()) {
            (true, &[batch, _, frames, _, _]) => (batch, frames),
            _ => (0, 0),
        };
        // The whole latent's size, not the band's, so that agreeing ranks describe a chunk alike.
        let (latent_height, latent_width) = stream.shard.latent_size();
        let ours = [
            usize::from(checked.is_ok()),
            batch,
            frames,
            latent_height,
            latent_width,
            stream.latent_frames_decoded(),
        ]
        .map(|v| i64::try_from(v).unwrap_or(i64::MAX)); // sizes beyond i64 compare as MAX: harmless
        let all = self.communicate(|comm| {
            let comm = comm.lock().unwrap_or_else(|p| p.into_inner());
            let send = comm.upload(&ours)?;
            let mut recv = comm.alloc::<i64>(DESCRIPTION_LEN * comm.size())?;
            comm.all_gather(send.borrow(), recv.borrow_mut())?;
            Ok(comm.download(recv.borrow())?)
        })?;
        checked?;
        let descriptions: Vec<&[i64]> = all.chunks(DESCRIPTION_LEN).collect();
        if let Some(peer) = descriptions.iter().position(|d| d[0] == 0) {
            return Err(ParallelVaeError::PeerRejected {
                peer,
                ranks: self.ranks.clone(),
            });
        }
        if let Some(peer) = descriptions.iter().position(|d| *d != ours.as_slice()) {
            return Err(ParallelVaeError::RanksDisagree {
                rank: self.rank,
                ours: ours[1..].to_vec(),
                peer,
                theirs: descriptions[peer][1..].to_vec(),
            });
        }
        Ok(())
    }

    /// This rank's checks of its chunk, before any communication.
    fn check_chunk(&self, stream: &ParallelDecodeStream, latent: &Tensor) -> Result<()> {
        let shard = &stream.shard;
        if (shard.rank(), shard.size(), shard.split_dim()) != (self.rank, self.size, self.split_dim)
        {
            return Err(ParallelVaeError::ForeignStream {
                stream_rank: shard.rank(),
                stream_size: shard.size(),
                stream_split: shard.split_dim(),
                rank: self.rank,
                size: self.size,
                split: self.split_dim,
            });
        }
        let shape = latent.shape();
        let z_dim = self.decoder.config().z_dim;
        let &[batch, channels, frames, height, width] = shape else {
            return Err(VaeError::LatentRank {
                z_dim,
                shape: shape.to_vec(),
            }
            .into());
        };
        if channels != z_dim {
            return Err(VaeError::LatentChannels {
                expected: z_dim,
                got: channels,
                shape: shape.to_vec(),
            }
            .into());
        }
        if frames == 0 || batch == 0 {
            return Err(VaeError::EmptyChunk {
                shape: shape.to_vec(),
            }
            .into());
        }
        let (expected_height, expected_width) = band_size(shard);
        if (height, width) != (expected_height, expected_width) {
            let (band_start, band_end) = shard.latent_band(self.rank);
            let (latent_height, latent_width) = shard.latent_size();
            return Err(ParallelVaeError::BandShape {
                rank: self.rank,
                split_dim: self.split_dim,
                band_start,
                band_end,
                latent_height,
                latent_width,
                expected_height,
                expected_width,
                shape: shape.to_vec(),
            });
        }
        if let Some(stream_batch) = stream.batch.filter(|&b| b != batch) {
            return Err(VaeError::ChunkMismatch {
                batch: stream_batch,
                height: expected_height,
                width: expected_width,
                got_batch: batch,
                got_height: height,
                got_width: width,
            }
            .into());
        }
        Ok(())
    }

    /// Runs a step that communicates. On failure the communicator is dropped, which fails the
    /// peers' same step at once, and this decoder becomes [`ParallelVaeError::Broken`].
    fn communicate<R>(&mut self, step: impl FnOnce(&Mutex<C>) -> Result<R>) -> Result<R> {
        let comm = self.comm.take().ok_or_else(|| ParallelVaeError::Broken {
            rank: self.rank,
            ranks: self.ranks.clone(),
        })?;
        let comm = Mutex::new(comm);
        match step(&comm) {
            Ok(out) => {
                self.comm = Some(comm.into_inner().unwrap_or_else(|p| p.into_inner()));
                Ok(out)
            }
            Err(err) => {
                tracing::warn!(vae_rank = self.rank, error = %err, "parallel VAE step failed; leaving the group");
                drop(comm); // fails the peers' pending step (the Communicator contract)
                Err(err)
            }
        }
    }
}

/// (height, width) of the shard's own latent band.
fn band_size(shard: &Shard) -> (usize, usize) {
    let (latent_height, latent_width) = shard.latent_size();
    let rows = shard.band_len(shard.rank(), 1);
    match shard.split_dim() {
        VaeSplitDim::Height => (rows, latent_width),
        VaeSplitDim::Width => (latent_height, rows),
    }
}
