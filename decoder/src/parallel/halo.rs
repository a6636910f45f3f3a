//! [`HaloOps`]: the decoder's neighbourhood operations for one rank of a parallel-VAE instance, over
//! any [`Communicator`] backend: halo exchange before each convolution, gathered keys and values for
//! the frame attention (`reference/wan.md` §2.5, `reference/visualgen.md` §4).
//!
//! **Convolutions.** A conv whose kernel is k > 1 along the split axis needs k/2 (= 1) rows of each
//! neighbour's band at the conv's own resolution. The frame cache is per rank and holds the rank's
//! own band (the layers store the last frames of the band they were given), so the rows exchanged are
//! those of cache ++ x: one message per neighbour carries the cached frames' rows and the chunk's
//! rows together. Exchanging the cache's rows again each chunk is redundant (the neighbour sent them
//! with the previous chunk) but keeps the ops stateless; it adds ≤ 2 frames of one row per message.
//! At a true image border the "halo" is zero rows, which is exactly the unsharded conv's zero padding
//! (a missing edge: the convolution reads zeros there, none are written).
//! The conv then runs with padding 0 on the split axis (the halo is the padding), kw/2 on the other
//! spatial axis, and the causal front padding, through the kernels crate's `conv3d_cached` with the
//! received rows as its [`Halo`]: the output is the rank's band, with no rows computed and thrown
//! away, and every output pixel sees the very values the unsharded conv gives it (the same im2col
//! column, the same GEMM). Copies: only the edge rows sent. The kernels crate joins the halo rows,
//! the cache, x and the front zero frames in the one channels-last copy its cuDNN path makes anyway
//! (elsewhere by concatenation), where putting the halo rows around x and the cache here first cost a
//! full copy of both per conv: 2-GPU profiles on the H200 put that at ~245 ms of a 965 ms 480p decode
//! per rank, against 17–38 ms for the NCCL swaps themselves. The residual blocks' last conv adds its
//! shortcut in the conv's epilogue, as the unsharded decode does, rather than writing the conv's
//! output and adding in a separate pass. The upsamplers' convs read x's nearest ×2 upsampling in
//! place (`conv3d_cached_upsampled`), as the unsharded decode does: the neighbours swap their edge
//! row of x before the upsampling (which is the upsampled band's halo row, doubled along the
//! other axis), and the upsampled band is never written.
//!
//! **Spans.** The conv, its halo exchange (`waited` when host-waited; the swap itself, without the
//! edge copies around it, is `parallel_vae_halo_nccl`), the attention and its
//! key/value gather each run inside a `tracing` debug span (`parallel_vae_*`; a host-waited exchange
//! is `parallel_vae_halo_waited`), and the decoder adds the agreement
//! step, the wait at the chunk's end and the gather: the VAE benchmark's per-rank breakdown reads
//! them (host time per step, and CUDA events at their edges); without a subscriber they cost nothing.
//!
//! **Exchange order.** One [`TensorWire::transfer`] per conv swaps the edge rows with both
//! neighbours (send my edge, receive theirs). Where it runs as one waited `send_recv` per neighbour
//! (the thread backend, and NCCL for a conv shape's first run, below), even ranks swap with their
//! next neighbour first, odd ranks with their previous one first, so the pairs (0, 1), (2, 3), … run
//! together, then (1, 2), (3, 4), …: a backend whose `send_recv` blocks on its peer never waits in a
//! cycle or a chain. Stream-ordered, both swaps are one NCCL group, where order does not matter.
//!
//! **No host wait per conv (NCCL).** A waited exchange blocks the host until the transfer is done,
//! i.e. until the GPU has run every kernel before it: the GPU drains before each of the ~30 3×3
//! convs of a pass (one latent frame), and every kernel after it is queued only then (at the
//! low-resolution stages those kernels are shorter than their launches, so the GPU idles behind
//! the host). The exchange is therefore stream-ordered (common's `wire` docs): queued on the
//! kernels' stream between the edges' copy and the conv, the host going on at once. The host's
//! deadline moves to the end of the chunk
//! ([`ParallelVaeDecoder::decode_chunk`](super::ParallelVaeDecoder::decode_chunk) waits for the
//! communicator, with its timeout, before returning frames), with one exception: the first run of a
//! conv shape on a GPU in this process ([`WARM_SHAPES`]) waits as before, because the kernels crate
//! may wait on the GPU during it (cuDNN's algorithm search, once per shape and GPU), and a host wait
//! on the kernels' stream behind a transfer whose peer is gone would have no timeout. A waited
//! exchange also waits for every transfer queued before it (one communicator stream, in order), so
//! such a search never waits behind a pending one either. So the first three passes of the first
//! request of a size (new shapes: no cache, then growing caches) wait per conv, and the rest do
//! not. The values are the same either way (the same tensors reach the same kernels).
//!
//! **Attention.** The mid block attends each frame's tokens over the whole frame. Each rank sends
//! the keys and values of its band to every peer and receives theirs (one transfer step; uneven
//! bands), puts them back into the frame's row-major token order (a width split interleaves the
//! ranks' columns within each row), and attends its local queries over all keys. Every rank needs
//! every key, so this is an all-gather, not a halo; at 720p it moves 2 · 14,400 tokens × C per
//! frame, small next to the convolutions. It is stream-ordered like the halos, and waited on the
//! first run of its shape on a GPU (the same set of warm shapes): the 1×1 output projection runs
//! right after it, and that conv's first run may search cuDNN's algorithms.
//!
//! **Transfers** go through common's [`TensorWire`] in the tensors' own dtype: with
//! NCCL and the decoder on the rank's GPU, halo rows and keys/values move device to device (NCCL reads
//! the edge rows' storage and writes a fresh device tensor; no host copy, and for halos no host
//! wait either, see above); with the thread backend they are host copies.

use std::collections::HashSet;
use std::sync::{LazyLock, Mutex, MutexGuard};

use ditstream_common::collectives::CollectiveError;
use ditstream_common::collectives::wire::TensorWire;
use ditstream_common::config::VaeSplitDim;
use ditstream_kernels::{
    AttentionOptions, DType, Device, Halo, Tensor, attention, conv3d_cached,
    conv3d_cached_upsampled, halo_edges,
};

use super::shard::Shard;
use crate::vae::{Result, SpatialOps, Unsharded, VaeError};

/// The neighbourhood operations of one rank of a parallel-VAE instance, for one request's
/// [`Shard`]. The communicator sits in a mutex because [`SpatialOps`] is `Sync` while communicators
/// need not be; a rank runs its ops from one thread, so the lock is never contended.
pub struct HaloOps<'a, C> {
    comm: &'a Mutex<C>,
    shard: Shard,
    /// Whether exchanges of conv shapes in [`WARM_SHAPES`] are stream-ordered.
    ordered: bool,
}

/// The conv shapes run once already, per GPU, in this process, with a waited halo exchange (module
/// docs, "No host wait per conv"): (device, input shape, dtype, cached frames, weight shape,
/// upsampled), flattened, and likewise the attention's query shapes ([`shape_key`]). A shape's
/// first run may wait on the GPU (cuDNN's algorithm search, kept per GPU for the process, like this
/// set); its later runs do not.
static WARM_SHAPES: LazyLock<Mutex<HashSet<Vec<usize>>>> = LazyLock::new(Default::default);

fn warm_shapes() -> MutexGuard<'static, HashSet<Vec<usize>>> {
    // A poisoned lock means a panic while inserting a key; the set is still a valid set.
    WARM_SHAPES
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl<'a, C: TensorWire> HaloOps<'a, C> {
    /// The ops of `shard`'s rank; `comm` is the instance's communicator (group rank = shard rank).
    /// Every halo exchange waits for its transfer.
    pub fn new(comm: &'a Mutex<C>, shard: Shard) -> Self {
        HaloOps {
            comm,
            shard,
            ordered: false,
        }
    }

    /// Stream-ordered halo exchanges for the conv shapes run before; each other shape waits once
    /// (module docs). The caller waits for the communicator (its timeout) before it, or anyone,
    /// waits for a result on the GPU.
    pub(crate) fn stream_ordered(mut self) -> Self {
        self.ordered = true;
        self
    }

    fn comm(&self) -> MutexGuard<'a, C> {
        // A poisoned lock means a panic on this rank's own thread while communicating; the panic is
        // already unwinding (and will drop the communicator, failing the peers), so the guard is fine.
        self.comm
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl<C: TensorWire + Send> HaloOps<'_, C> {
    /// The halo convolution: `causal_conv3d(x, weight, bias, cache)` on this rank's band, plus
    /// `residual` (the output's shape, this rank's band) when given, added in the conv's epilogue
    /// as [`Unsharded`]'s `causal_conv3d_residual` adds it (the kernels crate's `conv3d_cached`: the
    /// same bits as the conv then `add`, without writing the conv's output and reading it back).
    /// With `upsampled` (no cache, no residual: the upsamplers' conv) it is
    /// `causal_conv3d_upsampled`: the conv of x's nearest ×2 upsampling (`conv3d_cached_upsampled`).
    /// `kind` labels the span ("", "+up2", "+res").
    fn conv(
        &self,
        (x, upsampled): (&Tensor, bool),
        weight: &Tensor,
        bias: Option<&Tensor>,
        cache: Option<&Tensor>,
        residual: Option<&Tensor>,
        kind: &'static str,
    ) -> Result<Tensor> {
        let ws = weight.shape();
        let axis = self.shard.axis();
        let cached = cache.and_then(|c| c.shape().get(2).copied()).unwrap_or(0);
        let plain = ws.len() != 5 || x.rank() != 5 || self.shard.size() == 1;
        let kernel = if plain {
            [1, 1, 1]
        } else {
            [ws[2], ws[3], ws[4]]
        };
        // Rows of the conv's input on each side; an upsampled conv's come from half as many of x's.
        let halo = kernel[axis - 2] / 2;
        let rows_sent = if upsampled { halo.div_ceil(2) } else { halo };
        // Host-side markers for the benchmark's per-rank breakdown (bench/src/bin/vae_decode.rs
        // reads them through a tracing layer); no cost without a subscriber. Sizes of the conv's
        // input (upsampled where it is).
        let scale = if upsampled { 2 } else { 1 };
        let _span = match (ws, x.shape()) {
            (&[c_out, c_in, kt, kh, kw], &[_, _, t, h, w]) => {
                let (h, w) = (h * scale, w * scale);
                tracing::debug_span!("parallel_vae_conv", c_in, c_out, kt, kh, kw, t, h, w, kind,)
            }
            _ => tracing::Span::none(),
        }
        .entered();
        // No neighbourhood along the split axis (1×1 convs, time_conv, a single rank), or arguments the
        // kernel's own checks reject (even kernels, too many cached frames): nothing to exchange.
        if plain || halo == 0 || kernel.iter().any(|k| k % 2 == 0) || cached >= kernel[0] {
            return match (residual, upsampled) {
                (Some(residual), _) => {
                    Unsharded.causal_conv3d_residual(x, weight, bias, cache, residual)
                }
                (None, true) => Unsharded.causal_conv3d_upsampled(x, weight, bias),
                (None, false) => Unsharded.causal_conv3d(x, weight, bias, cache),
            };
        }
        let shape_key = shape_key(x, &[&[cached], ws, &[usize::from(upsampled)]].concat());
        let ordered = self.ordered && warm_shapes().contains(&shape_key);
        let cache = cache.filter(|_| cached > 0);
        let (before, after) = {
            let _halo = if ordered {
                tracing::debug_span!("parallel_vae_halo")
            } else {
                tracing::debug_span!("parallel_vae_halo_waited")
            }
            .entered();
            exchange_halo(&*self.comm(), &self.shard, cache, x, rows_sent, ordered)?
        };
        let halo = Halo {
            axis,
            extent: halo,
            before: before.as_ref(),
            after: after.as_ref(),
        };
        // Causal front padding: kt − 1 frames, less the cached ones; none on the split axis.
        let mut front = [kernel[0] - 1 - cached, kernel[1] / 2, kernel[2] / 2];
        let mut back = [0, kernel[1] / 2, kernel[2] / 2];
        front[axis - 2] = 0;
        back[axis - 2] = 0;
        let pads = (front, back);
        let out = match upsampled {
            true => conv3d_cached_upsampled(x, weight, bias, cache, Some(&halo), pads)?,
            false => conv3d_cached(x, weight, bias, cache, Some(&halo), pads, residual)?,
        };
        if self.ordered && !ordered {
            warm_shapes().insert(shape_key); // its first run (and any GPU wait in it) is over
        }
        Ok(out)
    }
}

impl<C: TensorWire + Send> SpatialOps for HaloOps<'_, C> {
    /// See the trait; x and cache hold this rank's band, and so does the output.
    fn causal_conv3d(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        cache: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.conv((x, false), weight, bias, cache, None, "")
    }

    /// See the trait: the halo conv of the upsampled band. The neighbours swap their edge rows of x
    /// (before the upsampling: a quarter of the upsampled rows' bytes), and the kernels'
    /// `conv3d_cached_upsampled` reads the upsampling and the halo in place.
    fn causal_conv3d_upsampled(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.conv((x, true), weight, bias, None, None, "+up2")
    }

    /// See the trait; x, cache and residual hold this rank's band, and so does the output.
    fn causal_conv3d_residual(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        cache: Option<&Tensor>,
        residual: &Tensor,
    ) -> Result<Tensor> {
        self.conv((x, false), weight, bias, cache, Some(residual), "+res")
    }

    /// See the trait; q, k, v hold this rank's tokens (its band of each frame, row-major), and so
    /// does the output.
    fn frame_attention(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        if self.shard.size() == 1 || k.rank() != 4 || v.shape() != k.shape() {
            return Unsharded.frame_attention(q, k, v);
        }
        let _span = tracing::debug_span!("parallel_vae_attention").entered();
        // Stream-ordered like the halos, except on the first run of this shape on this GPU: the
        // output projection's first run right after may search cuDNN's algorithms (module docs).
        let key = shape_key(q, &[ATTENTION]);
        let ordered = self.ordered && warm_shapes().contains(&key);
        let keys = {
            let _gather = tracing::debug_span!("parallel_vae_attention_gather").entered();
            let kv = Tensor::concat(&[k, v], 0)?;
            gather_frame_tokens(&*self.comm(), &self.shard, &kv, ordered)?
        };
        let frames = k.shape()[0];
        let (k, v) = (keys.narrow(0, 0, frames)?, keys.narrow(0, frames, frames)?);
        let (out, _lse) = attention(q, &k, &v, AttentionOptions::default())?;
        if self.ordered && !ordered {
            warm_shapes().insert(key);
        }
        Ok(out)
    }
}

/// The attention's entry in [`WARM_SHAPES`]: its key ends with this (a conv's key ends with its
/// upsampled flag, 0 or 1).
const ATTENTION: usize = usize::MAX;

/// A [`WARM_SHAPES`] key: (device, x's shape, bf16?, then `rest`), flattened.
fn shape_key(x: &Tensor, rest: &[usize]) -> Vec<usize> {
    let device = match x.device() {
        Device::Cpu => 0,
        Device::Cuda(ordinal) => ordinal + 1,
    };
    [device]
        .into_iter()
        .chain(x.shape().iter().copied())
        .chain([usize::from(x.dtype() == DType::BF16)])
        .chain(rest.iter().copied())
        .collect()
}

/// cache [B, C, T_c, H, W] (optional, T_c > 0) and x [B, C, T, H, W] (this rank's band along the
/// shard's axis) → the `halo` rows of each neighbour's band (of its cache, then its x, joined along
/// T) that lie before and after this band along that axis, `None` where there is no neighbour (the
/// image's border: zeros, which the convolution reads without their being written): the edges of a
/// [`Halo`], which the convolution reads around the band in place (no copy of the band).
/// `ordered`: stream-ordered where the backend can ([`TensorWire::transfer`]). One message per
/// neighbour carries the edge rows of cache ++ x (joined along T; both edges come from one
/// `halo_edges` copy of the rows only).
fn exchange_halo<C: TensorWire>(
    comm: &C,
    shard: &Shard,
    cache: Option<&Tensor>,
    x: &Tensor,
    halo: usize,
    ordered: bool,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let axis = shard.axis();
    // Fails (an argument error) if the band is thinner than the halo.
    let (first, last) = halo_edges(cache, x, axis, halo)?;
    let edge_shape = first.shape().to_vec();
    let (prev, next) = shard.neighbours();
    // (peer, rows I send it) in the deadlock-free order of the module docs.
    let before = (prev, &first);
    let after = (next, &last);
    let order = if shard.rank().is_multiple_of(2) {
        [after, before]
    } else {
        [before, after]
    };
    let swaps: Vec<(usize, &Tensor)> = order
        .into_iter()
        .filter_map(|(peer, edge)| peer.map(|peer| (peer, edge)))
        .collect();
    let from: Vec<(usize, &[usize])> = swaps
        .iter()
        .map(|&(peer, _)| (peer, edge_shape.as_slice()))
        .collect();
    let received = {
        let _swap = tracing::debug_span!("parallel_vae_halo_nccl").entered();
        comm.transfer(&swaps, &from, x.dtype(), x.device(), ordered)?
    };
    let (mut from_prev, mut from_next) = (None, None);
    for (&(peer, _), rows) in swaps.iter().zip(received) {
        if Some(peer) == prev {
            from_prev = Some(rows);
        } else {
            from_next = Some(rows);
        }
    }
    Ok((from_prev, from_next))
}

/// kv [N, S_r, H, C] (this rank's tokens of N frames: its band, row-major) → [N, S, H, C] with every
/// rank's tokens in the whole frame's row-major order. `ordered`: stream-ordered where the backend
/// can ([`TensorWire::transfer`]); this rank sends its tokens to every peer and receives theirs, in
/// ascending peer order (with waited transfers, every pair meets: no cycle).
fn gather_frame_tokens<C: TensorWire>(
    comm: &C,
    shard: &Shard,
    kv: &Tensor,
    ordered: bool,
) -> Result<Tensor> {
    let (n, local_tokens, channels) = (kv.shape()[0], kv.shape()[1], kv.shape()[2] * kv.shape()[3]);
    // This layer's spatial scale f: local tokens = (band · f) · (other extent · f).
    let other = shard.latent_other_extent();
    let at_latent = shard.band_len(shard.rank(), 1) * other;
    let scale = (local_tokens / at_latent).isqrt();
    if scale == 0 || scale * scale * at_latent != local_tokens {
        return Err(VaeError::Collective(CollectiveError::LengthMismatch {
            op: "parallel VAE frame_attention",
            what: "local tokens (band rows × columns at a spatial scale f: f² × latent band)",
            expected: at_latent,
            actual: local_tokens,
        }));
    }
    let lines = |rank: usize| shard.band_len(rank, scale); // rows (height split) or columns (width)
    // Rank r's tokens as a grid [N, rows, cols, H·C]; the frame is the ranks' grids joined along the
    // split axis.
    let split_axis = match shard.split_dim() {
        VaeSplitDim::Height => 1,
        VaeSplitDim::Width => 2,
    };
    let grid = |r: usize| {
        let mut grid = [n, other * scale, other * scale, channels];
        grid[split_axis] = lines(r);
        grid
    };
    let me = shard.rank();
    let peers: Vec<usize> = (0..shard.size()).filter(|&r| r != me).collect();
    let grids: Vec<[usize; 4]> = (0..shard.size()).map(grid).collect();
    let sends: Vec<(usize, &Tensor)> = peers.iter().map(|&r| (r, kv)).collect();
    let recvs: Vec<(usize, &[usize])> = peers.iter().map(|&r| (r, &grids[r][..])).collect();
    let mut received = comm.transfer(&sends, &recvs, kv.dtype(), kv.device(), ordered)?;
    // The peers' parts in rank order, with this rank's own in its place.
    received.insert(me.min(received.len()), kv.reshape(&grids[me])?);
    let parts: Vec<Tensor> = received
        .iter()
        .zip(&grids)
        .map(|(part, grid)| part.reshape(grid))
        .collect::<std::result::Result<_, _>>()?;
    let frame = Tensor::concat(&parts.iter().collect::<Vec<_>>(), split_axis)?;
    let total: usize = grids.iter().map(|g| g.iter().product::<usize>()).sum();
    Ok(frame.reshape(&[
        n,
        total / (n * channels).max(1),
        kv.shape()[2],
        kv.shape()[3],
    ])?)
}
