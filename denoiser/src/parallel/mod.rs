//! Sequence and CFG parallelism for the denoiser (DESIGN.md §3): the attention wrappers that
//! exchange shards around an inner attention, the sequence-parallel forward, and the
//! CFG-parallel denoise loop. Every piece is generic over the collectives backend
//! ([`Communicator`]), so the in-process CPU backend (tests, CI) and NCCL run the same code.
//!
//! Where things live:
//! - [`MeshComms`] (this file): one rank's communicators, one per mesh group it needs, and the
//!   check that a mesh fits the model ([`check_mesh`]).
//! - Tensors cross the communicators through common's [`wire`] ([`TensorWire`]: host copies on the
//!   CPU backend; on NCCL, feature `cuda`, device tensors handed to NCCL in place, ordered against
//!   the kernels' stream with events), shared with the parallel VAE and the NCCL latent link.
//! - [`attention`]: the [`ChunkAttention`] trait the wrappers share, the local (innermost)
//!   attention, and the adapter that hands a wrapper to the model as its `SelfAttention`.
//! - [`ulysses`], [`ring`], [`attn2d`]: the three wrappers. Ulysses wraps any inner wrapper
//!   (Ring × Ulysses, Attention2D × Ulysses: Ulysses outer, as in TensorRT-LLM).
//! - [`mod@forward`]: embed → shard → blocks → gather → head, on every rank of a sequence group.
//! - [`mod@cfg`]: the denoise loop with the guidance branches on the two halves of the mesh.
//!
//! Padding: the token count L need not divide by the sequence degree P. Every rank holds
//! `shard_len = ceil(L/P)` tokens ([`SeqShard`]); padding sits at the end of the padded sequence,
//! so the valid keys of any contiguous chunk are a prefix of it, and every wrapper masks the
//! padded keys (`kv_len`), knowing L. Padded queries compute finite garbage that the final
//! gather drops. The output equals the unpadded single-rank run.
//!
//! [`wire`]: ditstream_common::collectives::wire
//! [`TensorWire`]: ditstream_common::collectives::wire::TensorWire

pub mod attention;
pub mod attn2d;
pub mod cfg;
pub mod forward;
pub mod ring;
pub mod ulysses;

use ditstream_common::collectives::wire::WireError;
use ditstream_common::collectives::{CollectiveError, CommWorld, Communicator};
use ditstream_common::mesh::{CpLayout, GroupKind, Mesh, SeqShard};
use ditstream_kernels::{KernelError, Tensor};

use crate::denoise::DenoiseError;
use crate::model::{ModelError, WanConfig};

pub use attention::{ChunkAttention, LocalChunk};
pub use attn2d::Attention2d;
pub use cfg::denoise;
pub use forward::{forward, forward_with, seq_attention};
pub use ring::RingAttention;
pub use ulysses::UlyssesAttention;

/// Why a parallel forward or denoise failed.
#[derive(Debug, thiserror::Error)]
pub enum ParallelError {
    /// The mesh does not fit the model or the world (checked before any work).
    #[error("mesh {mesh}: {what} = {value}: {rule}")]
    Mesh {
        /// The mesh, printed.
        mesh: String,
        /// Which quantity is wrong (`ulysses_size`, `world_size`, …).
        what: &'static str,
        /// Its value.
        value: usize,
        /// The rule it breaks.
        rule: String,
    },
    /// A tensor reached a wrapper in the wrong layout (a bug in the caller).
    #[error("{what} shape {shape:?}: {rule}")]
    Shape {
        /// Which tensor.
        what: &'static str,
        /// Its shape.
        shape: Vec<usize>,
        /// The layout it must have.
        rule: &'static str,
    },
    /// A collective failed: this rank's own error, or another rank of the group failed, left or
    /// timed out (`Poisoned`, `Timeout`).
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// A tensor could not cross a communicator for a reason of its own (dtype, device); the
    /// collective and tensor failures of a transfer are [`Self::Collective`] and [`Self::Model`].
    #[error(transparent)]
    Wire(WireError),
    /// The model (or an op) failed on this rank.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The loop failed as the single-rank loop would (sampler, inputs, cancellation).
    #[error(transparent)]
    Denoise(#[from] DenoiseError),
}

impl From<KernelError> for ParallelError {
    fn from(e: KernelError) -> Self {
        ParallelError::Model(ModelError::Kernel(e))
    }
}

impl From<WireError> for ParallelError {
    /// A transfer's collective failure stays a collective failure (peers failing is one variant,
    /// wherever it surfaced), its tensor failure a model failure.
    fn from(e: WireError) -> Self {
        match e {
            WireError::Collective(e) => ParallelError::Collective(e),
            WireError::Kernel(e) => e.into(),
            e => ParallelError::Wire(e),
        }
    }
}

/// Result alias of this module.
pub type Result<T, E = ParallelError> = std::result::Result<T, E>;

/// Tensor-parallel degree of `mesh` (the mesh keeps it private; it is what the other axes leave).
fn tp_size(mesh: &Mesh) -> usize {
    mesh.world_size() / (mesh.cfg_size() * mesh.cp().size() * mesh.ulysses_size())
}

/// Checks that `mesh` can run `model` on a world of `world_size` ranks: the world matches, no
/// tensor parallelism (not implemented), Ulysses divides the head count. Config validation
/// checks the same against the config's head count; this repeats it against the loaded model so
/// a mismatched checkpoint fails before any collective.
pub fn check_mesh(mesh: &Mesh, model: &WanConfig, world_size: usize) -> Result<()> {
    let fail = |what, value, rule: String| {
        Err(ParallelError::Mesh {
            mesh: mesh.to_string(),
            what,
            value,
            rule,
        })
    };
    if mesh.world_size() != world_size {
        return fail(
            "world_size",
            world_size,
            format!("the mesh needs {} ranks", mesh.world_size()),
        );
    }
    if tp_size(mesh) != 1 {
        return fail(
            "tp_size",
            tp_size(mesh),
            "tensor parallelism is not implemented; use 1".into(),
        );
    }
    let heads = model.num_attention_heads;
    if !heads.is_multiple_of(mesh.ulysses_size()) {
        return fail(
            "ulysses_size",
            mesh.ulysses_size(),
            format!("must divide the model's {heads} attention heads"),
        );
    }
    if mesh.cfg_size() > 2 {
        return fail(
            "cfg_size",
            mesh.cfg_size(),
            "must be 1 or 2 (two guidance branches)".into(),
        );
    }
    Ok(())
}

/// One rank's communicators over the mesh groups it uses; a group of one rank has none (its
/// collectives are identities). Built collectively: every rank of the world calls
/// [`MeshComms::new`] with the same mesh.
#[derive(Debug)]
pub struct MeshComms<C> {
    mesh: Mesh,
    rank: usize,
    /// The two guidance branches (size 2 when cfg_size = 2).
    pub cfg: Option<C>,
    /// Ulysses all-to-alls.
    pub ulysses: Option<C>,
    /// Ring's send/recv ring (the cp tile, Ring layouts only).
    pub ring: Option<C>,
    /// Attention2D row group: Q gather and the output all-to-all.
    pub row: Option<C>,
    /// Attention2D column group: K/V gather.
    pub col: Option<C>,
    /// The sequence group (cp × ulysses in `seq_rank` order): the gather before unpatchify.
    pub seq: Option<C>,
    /// Every rank: agreement on cancellation after each step.
    pub world: Option<C>,
    /// Async Ulysses (`parallel_config.async_ulysses`): each exchange under the next projection.
    async_ulysses: bool,
}

impl<C: Communicator> MeshComms<C> {
    /// Splits `world` into the mesh's groups. Every rank calls it with the same `mesh`, in the
    /// same order relative to its other `split` calls.
    pub fn new<W: CommWorld<Comm = C>>(world: &W, mesh: Mesh) -> Result<MeshComms<C>> {
        if mesh.world_size() != world.world_size() {
            return Err(ParallelError::Mesh {
                mesh: mesh.to_string(),
                what: "world_size",
                value: world.world_size(),
                rule: format!("the mesh needs {} ranks", mesh.world_size()),
            });
        }
        let split = |kind: GroupKind| -> Result<Option<C>> {
            let groups = mesh.groups(kind);
            // Groups of one kind all have the same size, so every rank takes the same branch.
            if groups.first().is_none_or(|g| g.len() < 2) {
                return Ok(None);
            }
            Ok(world.split(&groups)?)
        };
        let ring = match mesh.cp() {
            CpLayout::Ring(_) => split(GroupKind::Cp)?,
            _ => None,
        };
        let (row, col) = match mesh.cp() {
            CpLayout::Attn2d { .. } => (split(GroupKind::Row)?, split(GroupKind::Col)?),
            _ => (None, None),
        };
        let everyone = (0..mesh.world_size()).collect::<Vec<_>>();
        let world_comm = if everyone.len() > 1 {
            world.split(&[everyone])?
        } else {
            None
        };
        Ok(MeshComms {
            cfg: split(GroupKind::Cfg)?,
            ulysses: split(GroupKind::Ulysses)?,
            ring,
            row,
            col,
            seq: split(GroupKind::Seq)?,
            world: world_comm,
            async_ulysses: false,
            mesh,
            rank: world.rank(),
        })
    }
}

impl<C> MeshComms<C> {
    /// The same communicators with async Ulysses on or off (`parallel_config.async_ulysses`;
    /// see [`UlyssesAttention::with_async`]). Off by default.
    pub fn with_async_ulysses(mut self, on: bool) -> Self {
        self.async_ulysses = on;
        self
    }

    /// Whether the Ulysses exchanges run under the projections (async Ulysses).
    pub fn async_ulysses(&self) -> bool {
        self.async_ulysses
    }

    /// The mesh.
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// This rank's global rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Guidance branch of this rank: 0 conditional, 1 unconditional.
    pub fn cfg_rank(&self) -> usize {
        self.mesh.coord(self.rank).cfg
    }

    /// This rank's shard of a sequence of `tokens`.
    pub fn shard(&self, tokens: usize) -> SeqShard {
        SeqShard::new(tokens, self.mesh.seq_size(), self.mesh.seq_rank(self.rank))
    }
}

/// Real tokens in chunk `index` of a padded sequence of `tokens` real tokens cut into chunks of
/// `chunk_len` (padding at the end, so they are the chunk's first ones).
pub(crate) fn valid_in_chunk(tokens: usize, index: usize, chunk_len: usize) -> usize {
    tokens.saturating_sub(index * chunk_len).min(chunk_len)
}

/// Rows `start..start + valid` of `t` along `axis`, then zero rows up to `len`: a padded shard.
pub(crate) fn padded_rows(
    t: &Tensor,
    axis: usize,
    start: usize,
    valid: usize,
    len: usize,
) -> Result<Tensor> {
    let dim = t.shape()[axis];
    let rows = t.narrow(axis, start.min(dim), valid)?;
    if valid == len {
        return Ok(rows);
    }
    let mut pad_shape = t.shape().to_vec();
    pad_shape[axis] = len - valid;
    let pad = Tensor::zeros(&pad_shape, t.dtype(), t.device())?;
    Ok(Tensor::concat(&[&rows, &pad], axis)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_counts_cover_the_sequence_once() {
        for tokens in [1usize, 9, 105, 180] {
            for p in 1..=8 {
                let len = tokens.div_ceil(p);
                let total: usize = (0..p).map(|i| valid_in_chunk(tokens, i, len)).sum();
                assert_eq!(total, tokens);
            }
        }
        assert_eq!(valid_in_chunk(9, 4, 2), 1);
        assert_eq!(valid_in_chunk(9, 5, 2), 0);
    }

    #[test]
    fn padded_rows_pads_at_the_end() -> Result<()> {
        let t = Tensor::from_vec((0..6).map(|i| i as f32).collect(), &[1, 3, 2])?;
        let s = padded_rows(&t, 1, 2, 1, 2)?;
        assert_eq!(s.shape(), &[1, 2, 2]);
        assert_eq!(s.to_vec_f32()?, vec![4.0, 5.0, 0.0, 0.0]);
        let empty = padded_rows(&t, 1, 4, 0, 2)?;
        assert_eq!(empty.to_vec_f32()?, vec![0.0; 4]);
        Ok(())
    }

    #[test]
    fn meshes_the_model_cannot_use_are_rejected() {
        let cfg = WanConfig::preset(ditstream_common::config::Preset::Tiny); // 2 heads
        let m = Mesh::new(1, 1, CpLayout::None, 4);
        let err = check_mesh(&m, &cfg, 4).err().map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("ulysses_size = 4")),
            "{err:?}"
        );
        let m = Mesh::new(2, 1, CpLayout::Ring(2), 1);
        assert!(check_mesh(&m, &cfg, 2).is_err());
        assert!(check_mesh(&m, &cfg, 4).is_ok());
    }
}
