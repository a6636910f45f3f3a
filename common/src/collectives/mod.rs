//! Collective communication over one group of ranks: the [`Communicator`] trait every backend
//! implements, the element types it moves ([`Element`]), group validation shared by the
//! backends, the [`CommWorld`] trait that turns a mesh partition into communicators, and
//! [`CollectiveError`].
//!
//! A *group* is the ordered list of global ranks the mesh produces (`&[usize]`, e.g. the
//! Ulysses group `[4, 5, 6, 7]` or a strided CFG group `[1, 37]`); a rank's index in that list is
//! its *group rank*, and every operation below speaks in group ranks.
//!
//! Backends:
//! - [`cpu`]: in-process, ranks are threads (CI, the embedded default, every multi-rank test);
//! - `nccl` (feature `cuda`): NCCL through cudarc, one thread per GPU.
//!
//! The Ulysses sequence ↔ heads layouts built on top of the plain operations live in
//! [`ulysses`]; kernels tensors cross a communicator through [`wire`] (host copies on CPU, device
//! storage handed to NCCL in place, and the stream ordering that makes that safe). Every operation returns only when its result is in the output buffer, and a
//! failing, vanished or panicking rank makes every other rank of its group return an error:
//! never a hang.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod ulysses;
pub mod wire;

use std::borrow::BorrowMut;
use std::time::Duration;

pub use ulysses::{UlyssesExt, UlyssesShape};

/// How long a rank waits for the rest of its group before it gives up (and makes every other
/// rank of the group give up too). Long enough for a slow first step (weight loading, NVRTC
/// compiles on some ranks), short enough that a dead rank fails the request within a minute.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Errors of the collective layer. Each variant carries the offending values.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// A group given to a communicator is empty.
    #[error("group {group_index} is empty: every group needs at least one rank")]
    EmptyGroup {
        /// Index of the group in the list passed to `split`.
        group_index: usize,
    },
    /// A rank in a group is not a rank of the world.
    #[error("rank {rank} in group {ranks:?} is outside the world of {world_size} ranks")]
    RankOutOfRange {
        /// The offending rank.
        rank: usize,
        /// The group that holds it.
        ranks: Vec<usize>,
        /// Number of ranks in the world.
        world_size: usize,
    },
    /// A rank appears twice in one group or in two groups of one partition.
    #[error("rank {rank} appears more than once in the groups {groups:?}")]
    DuplicateRank {
        /// The repeated rank.
        rank: usize,
        /// All groups as given.
        groups: Vec<Vec<usize>>,
    },
    /// The caller is not a member of the group it asked a communicator for.
    #[error("rank {rank} is not a member of group {ranks:?}")]
    NotInGroup {
        /// The caller's global rank.
        rank: usize,
        /// The group.
        ranks: Vec<usize>,
    },
    /// A buffer has the wrong number of elements for the operation.
    #[error("{op}: {what} has {actual} elements, expected {expected}")]
    LengthMismatch {
        /// Operation name.
        op: &'static str,
        /// Which buffer (`"send"`, `"recv"`, …).
        what: &'static str,
        /// Elements the operation needs.
        expected: usize,
        /// Elements the buffer has.
        actual: usize,
    },
    /// A buffer cannot be split into equal per-rank chunks.
    #[error("{op}: {what} has {len} elements, not divisible into {parts} equal chunks")]
    NotDivisible {
        /// Operation name.
        op: &'static str,
        /// Which buffer.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The group size.
        parts: usize,
    },
    /// A per-rank count list has the wrong number of entries.
    #[error("{op}: {what} has {actual} entries, expected one per rank of the group ({expected})")]
    CountsLength {
        /// Operation name.
        op: &'static str,
        /// Which list.
        what: &'static str,
        /// Group size.
        expected: usize,
        /// Entries given.
        actual: usize,
    },
    /// A root or peer group rank is not in the group.
    #[error("{op}: {what} {value} is not a group rank (group size {size})")]
    PeerOutOfRange {
        /// Operation name.
        op: &'static str,
        /// `"root"`, `"to"` or `"from"`.
        what: &'static str,
        /// The offending group rank.
        value: usize,
        /// Group size.
        size: usize,
    },
    /// A strided copy reads or writes outside its buffer.
    #[error(
        "copy_2d: {what} needs {needed} elements (offset {offset}, pitch {pitch}, width {width}, \
         height {height}) but the buffer has {len}"
    )]
    CopyOutOfBounds {
        /// `"src"` or `"dst"`.
        what: &'static str,
        /// Elements the copy touches (one past the last).
        needed: usize,
        /// Start offset.
        offset: usize,
        /// Row pitch.
        pitch: usize,
        /// Row width.
        width: usize,
        /// Rows.
        height: usize,
        /// Buffer length.
        len: usize,
    },
    /// A Ulysses layout whose head count the group size does not divide.
    #[error("ulysses: {heads} heads are not divisible by the group size {size}")]
    HeadsNotDivisible {
        /// Head count H.
        heads: usize,
        /// Group size P.
        size: usize,
    },
    /// The ranks of a group called different operations (or the same one with different
    /// element types or sizes) at the same point of their sequence.
    #[error("ranks of group {ranks:?} disagree at collective #{seq}: {detail}")]
    Mismatch {
        /// The group.
        ranks: Vec<usize>,
        /// Sequence number of the collective on this communicator.
        seq: u64,
        /// What differed.
        detail: String,
    },
    /// Another rank of the group failed, left, or panicked; this group can no longer be used.
    #[error("group {ranks:?} is poisoned: {reason}")]
    Poisoned {
        /// The group.
        ranks: Vec<usize>,
        /// What happened first.
        reason: String,
    },
    /// Fewer devices are visible than a run asked for.
    #[error("{wanted} GPUs wanted, {found} visible")]
    NotEnoughDevices {
        /// Devices asked for.
        wanted: usize,
        /// Devices visible.
        found: usize,
    },
    /// The rest of the group did not arrive in time.
    #[error("{op} on group {ranks:?} (group rank {group_rank}) timed out after {after:?}")]
    Timeout {
        /// Operation name.
        op: &'static str,
        /// The group.
        ranks: Vec<usize>,
        /// The caller's group rank.
        group_rank: usize,
        /// The timeout that passed.
        after: Duration,
    },
    /// A backend does not offer this operation for this element type.
    #[error("{op} is not supported for {dtype:?} by the {backend} backend")]
    Unsupported {
        /// Operation name.
        op: &'static str,
        /// Element type.
        dtype: DType,
        /// Backend name.
        backend: &'static str,
    },
    /// A CUDA or NCCL shared library could not be loaded.
    #[error("{library} could not be loaded ({detail}); put it on LD_LIBRARY_PATH (see GPU.md)")]
    LibraryMissing {
        /// Library name, e.g. `"libnccl.so"`.
        library: &'static str,
        /// What was tried.
        detail: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA {call} failed: {detail}")]
    Cuda {
        /// The failing call.
        call: &'static str,
        /// Driver error text.
        detail: String,
    },
    /// An NCCL call failed.
    #[error("NCCL {call} failed on group {ranks:?}: {detail}")]
    Nccl {
        /// The failing call.
        call: &'static str,
        /// The group.
        ranks: Vec<usize>,
        /// NCCL's error string.
        detail: String,
    },
}

/// Result alias of the collective layer.
pub type Result<T, E = CollectiveError> = std::result::Result<T, E>;

/// Element types a collective can move, tagged for the backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// `f32`.
    F32,
    /// `half::bf16`.
    Bf16,
    /// `half::f16`.
    F16,
    /// `f64`.
    F64,
    /// `i32`.
    I32,
    /// `i64`.
    I64,
    /// `u8`.
    U8,
}

/// Reduction operators of `all_reduce` and `reduce_scatter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum (wrapping for integers).
    Sum,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

mod sealed {
    pub trait Sealed {}
}

/// Extra bounds a backend needs on elements: the CUDA traits when the `cuda` feature is on,
/// nothing otherwise. Blanket-implemented; never implement it by hand.
#[cfg(feature = "cuda")]
pub trait DeviceElement: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits {}
#[cfg(feature = "cuda")]
impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits> DeviceElement for T {}
/// Extra bounds a backend needs on elements: the CUDA traits when the `cuda` feature is on,
/// nothing otherwise. Blanket-implemented; never implement it by hand.
#[cfg(not(feature = "cuda"))]
pub trait DeviceElement {}
#[cfg(not(feature = "cuda"))]
impl<T> DeviceElement for T {}

/// A type the collectives can move and reduce: `f32`, `half::bf16`, `half::f16`, `f64`, `i32`,
/// `i64`, `u8`. Sealed: backends rely on the exact list.
pub trait Element:
    sealed::Sealed
    + bytemuck::Pod
    + Default
    + PartialEq
    + PartialOrd
    + std::fmt::Debug
    + Send
    + Sync
    + DeviceElement
    + 'static
{
    /// The tag backends dispatch on.
    const DTYPE: DType;
    /// `a op b`, as the CPU backend computes it (half types through `f32`, integers wrapping).
    fn combine(a: Self, b: Self, op: ReduceOp) -> Self;
}

macro_rules! element_float {
    ($t:ty, $dtype:expr, $to:expr, $from:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $dtype;
            fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
                let (x, y) = ($to(a), $to(b));
                $from(match op {
                    ReduceOp::Sum => x + y,
                    ReduceOp::Max => x.max(y),
                    ReduceOp::Min => x.min(y),
                })
            }
        }
    };
}
element_float!(f32, DType::F32, |v: f32| v, |v: f32| v);
element_float!(f64, DType::F64, |v: f64| v, |v: f64| v);
element_float!(
    half::bf16,
    DType::Bf16,
    half::bf16::to_f32,
    half::bf16::from_f32
);
element_float!(
    half::f16,
    DType::F16,
    half::f16::to_f32,
    half::f16::from_f32
);

macro_rules! element_int {
    ($t:ty, $dtype:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $dtype;
            fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum => a.wrapping_add(b),
                    ReduceOp::Max => a.max(b),
                    ReduceOp::Min => a.min(b),
                }
            }
        }
    };
}
element_int!(i32, DType::I32);
element_int!(i64, DType::I64);
element_int!(u8, DType::U8);

/// A communicator over ONE group of ranks. Operations are collective: every rank of the group
/// calls the same operations in the same order (the CPU backend checks this and fails all
/// ranks on a mismatch; NCCL would hang, so it times out instead). Every operation returns when
/// its output is complete; any failure of any rank makes every rank of the group return an
/// error, and the communicator is unusable afterwards.
///
/// Buffers are the backend's own ([`Communicator::Buf`]): host slices `[T]` on the CPU backend,
/// `CudaSlice<T>` on NCCL. All lengths and offsets are in elements. "P" below is
/// [`Communicator::size`], "r" the caller's [`Communicator::rank`].
pub trait Communicator {
    /// A borrowed buffer of `T` (`[T]` on CPU, `CudaSlice<T>` on CUDA).
    type Buf<T: Element>: ?Sized;
    /// An owned buffer of `T` that lends out a [`Communicator::Buf`] (`Vec<T>` / `CudaSlice<T>`).
    type Owned<T: Element>: BorrowMut<Self::Buf<T>>;
    /// A posted send/recv pair; it borrows both buffers until [`Pending::wait`].
    type Pending<'a>: Pending
    where
        Self: 'a;

    /// The caller's group rank, in `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group (P).
    fn size(&self) -> usize;
    /// The group as global ranks, in group-rank order.
    fn ranks(&self) -> &[usize];

    /// Number of elements in `buf`.
    fn len<T: Element>(&self, buf: &Self::Buf<T>) -> usize;
    /// A zero-filled buffer of `len` elements.
    fn alloc<T: Element>(&self, len: usize) -> Result<Self::Owned<T>>;
    /// A buffer holding a copy of `host`.
    fn upload<T: Element>(&self, host: &[T]) -> Result<Self::Owned<T>>;
    /// The contents of `buf` copied to the host.
    fn download<T: Element>(&self, buf: &Self::Buf<T>) -> Result<Vec<T>>;

    /// send: `[n]` → recv: `[P·n]`, concatenated along the leading (outermost) axis in group-rank
    /// order: `recv[i·n .. (i+1)·n]` is rank i's `send`.
    fn all_gather<T: Element>(&self, send: &Self::Buf<T>, recv: &mut Self::Buf<T>) -> Result<()>;
    /// [`Communicator::all_gather`], posted as [`Communicator::all_to_all_posted`] is (same
    /// contract: the result is in `recv` once the handle is waited).
    fn all_gather_posted<'a, T: Element>(
        &'a self,
        send: &'a Self::Buf<T>,
        recv: &'a mut Self::Buf<T>,
    ) -> Result<Self::Pending<'a>>;
    /// Uneven all-gather: send: `[counts[r]]` → recv: `[Σ counts]`, rank i's part at offset
    /// `Σ_{j<i} counts[j]`. Every rank passes the same `counts`.
    fn all_gather_v<T: Element>(
        &self,
        send: &Self::Buf<T>,
        recv: &mut Self::Buf<T>,
        counts: &[usize],
    ) -> Result<()>;
    /// send: `[P·n]` split into P contiguous chunks, chunk j goes to rank j → recv: `[P·n]`,
    /// chunk i came from rank i.
    fn all_to_all<T: Element>(&self, send: &Self::Buf<T>, recv: &mut Self::Buf<T>) -> Result<()>;
    /// [`Communicator::all_to_all`], posted: the sends leave (or are queued on the backend's
    /// stream) and the call returns at once; `recv` holds the result once [`Pending::wait`]
    /// returns. The transfer overlaps whatever the caller does meanwhile (async Ulysses moves V
    /// under Q's projection). Both buffers stay borrowed until then. Every rank posts the same
    /// exchanges in the same order, and waits them in that order (the CPU backend matches
    /// messages between two ranks by their order). Dropping the handle without waiting waits (and
    /// logs a failure).
    fn all_to_all_posted<'a, T: Element>(
        &'a self,
        send: &'a Self::Buf<T>,
        recv: &'a mut Self::Buf<T>,
    ) -> Result<Self::Pending<'a>>;
    /// Uneven all-to-all: send chunk j (`send_counts[j]` elements, packed in order) goes to rank j;
    /// recv chunk i (`recv_counts[i]` elements, packed in order) came from rank i. Rank i's
    /// `send_counts[j]` must equal rank j's `recv_counts[i]`.
    fn all_to_all_v<T: Element>(
        &self,
        send: &Self::Buf<T>,
        send_counts: &[usize],
        recv: &mut Self::Buf<T>,
        recv_counts: &[usize],
    ) -> Result<()>;
    /// send: `[n]` → recv: `[n]`, `recv[k] = op over ranks of send[k]` (the same bits on every
    /// rank).
    fn all_reduce<T: Element>(
        &self,
        send: &Self::Buf<T>,
        recv: &mut Self::Buf<T>,
        op: ReduceOp,
    ) -> Result<()>;
    /// In-place [`Communicator::all_reduce`]: buf: `[n]` → `[n]`.
    fn all_reduce_in_place<T: Element>(&self, buf: &mut Self::Buf<T>, op: ReduceOp) -> Result<()>;
    /// send: `[P·n]` → recv: `[n]`, `recv = op over ranks of chunk r of their send`.
    fn reduce_scatter<T: Element>(
        &self,
        send: &Self::Buf<T>,
        recv: &mut Self::Buf<T>,
        op: ReduceOp,
    ) -> Result<()>;
    /// buf: `[n]` on every rank; afterwards every rank holds group rank `root`'s contents.
    fn broadcast<T: Element>(&self, buf: &mut Self::Buf<T>, root: usize) -> Result<()>;
    /// Returns once every rank of the group has called it.
    fn barrier(&self) -> Result<()>;
    /// Posts "send `send` to group rank `to`, receive into `recv` from group rank `from`"
    /// (Ring attention: to = r+1, from = r−1) and returns at once; the transfer overlaps the
    /// caller's work until [`Pending::wait`]. Both buffers stay borrowed until then. The peer
    /// must post a matching pair (its `recv` as long as this `send`). Dropping the handle
    /// without waiting waits (and logs a failure).
    fn send_recv<'a, T: Element>(
        &'a self,
        send: &'a Self::Buf<T>,
        to: usize,
        recv: &'a mut Self::Buf<T>,
        from: usize,
    ) -> Result<Self::Pending<'a>>;
    /// Local strided block copy (no communication): for every row `y < height`,
    /// `dst[dst_offset + y·dst_pitch ..][..width] = src[src_offset + y·src_pitch ..][..width]`.
    /// Host loops on CPU, `cuMemcpy2DAsync` on CUDA. Used to pack and unpack the Ulysses layouts.
    /// Unlike the collectives it may return before the copy is done (CUDA: it is enqueued on the
    /// communicator's stream); it is complete once any later operation, `download` or
    /// [`Communicator::synchronize`] returns.
    #[allow(clippy::too_many_arguments)]
    fn copy_2d<T: Element>(
        &self,
        src: &Self::Buf<T>,
        src_offset: usize,
        src_pitch: usize,
        dst: &mut Self::Buf<T>,
        dst_offset: usize,
        dst_pitch: usize,
        width: usize,
        height: usize,
    ) -> Result<()>;
    /// Waits until all work this rank enqueued on the communicator (e.g. `copy_2d`) is done.
    fn synchronize(&self) -> Result<()>;
}

/// A posted non-blocking operation (see [`Communicator::send_recv`]).
pub trait Pending {
    /// Blocks until the posted transfer is complete (or failed, or timed out).
    fn wait(self) -> Result<()>;
}

/// A rank's handle on the whole world: turns mesh groups into communicators.
pub trait CommWorld {
    /// The communicator type of this backend.
    type Comm: Communicator;
    /// The caller's global rank.
    fn rank(&self) -> usize;
    /// Number of ranks in the world.
    fn world_size(&self) -> usize;
    /// Collective over the whole world: every rank calls it with the same list of disjoint
    /// groups (e.g. every Ulysses group of the mesh); each rank gets the communicator of the
    /// group that contains it, or `None` if it is in none of them.
    fn split(&self, groups: &[Vec<usize>]) -> Result<Option<Self::Comm>>;
}

/// Checks a list of groups against a world (non-empty, in range, no rank twice) and returns the
/// caller's group index and group rank, if it is in one.
pub fn locate_in_groups(
    groups: &[Vec<usize>],
    rank: usize,
    world_size: usize,
) -> Result<Option<(usize, usize)>> {
    let mut seen = vec![false; world_size];
    let mut found = None;
    for (gi, group) in groups.iter().enumerate() {
        if group.is_empty() {
            return Err(CollectiveError::EmptyGroup { group_index: gi });
        }
        for (pos, &g) in group.iter().enumerate() {
            if g >= world_size {
                return Err(CollectiveError::RankOutOfRange {
                    rank: g,
                    ranks: group.clone(),
                    world_size,
                });
            }
            if std::mem::replace(&mut seen[g], true) {
                return Err(CollectiveError::DuplicateRank {
                    rank: g,
                    groups: groups.to_vec(),
                });
            }
            if g == rank {
                found = Some((gi, pos));
            }
        }
    }
    Ok(found)
}

/// Element offsets of packed chunks: `[0, c0, c0+c1, …]` (P+1 entries).
pub(crate) fn prefix_offsets(counts: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(counts.len() + 1);
    let mut acc = 0;
    out.push(0);
    for &c in counts {
        acc += c;
        out.push(acc);
    }
    out
}

/// Argument checks shared by the backends, so both reject the same calls with the same errors.
pub(crate) mod check {
    use super::{CollectiveError, Result};

    pub fn len(op: &'static str, what: &'static str, expected: usize, actual: usize) -> Result<()> {
        if expected == actual {
            Ok(())
        } else {
            Err(CollectiveError::LengthMismatch {
                op,
                what,
                expected,
                actual,
            })
        }
    }

    /// `len / parts`, or an error if it does not divide.
    pub fn chunk(op: &'static str, what: &'static str, len: usize, parts: usize) -> Result<usize> {
        if len.checked_rem(parts) == Some(0) {
            Ok(len / parts)
        } else {
            Err(CollectiveError::NotDivisible {
                op,
                what,
                len,
                parts,
            })
        }
    }

    pub fn counts(
        op: &'static str,
        what: &'static str,
        counts: &[usize],
        size: usize,
    ) -> Result<()> {
        if counts.len() == size {
            Ok(())
        } else {
            Err(CollectiveError::CountsLength {
                op,
                what,
                expected: size,
                actual: counts.len(),
            })
        }
    }

    pub fn peer(op: &'static str, what: &'static str, value: usize, size: usize) -> Result<()> {
        if value < size {
            Ok(())
        } else {
            Err(CollectiveError::PeerOutOfRange {
                op,
                what,
                value,
                size,
            })
        }
    }

    /// Bounds of a strided copy: the last row ends at `offset + (height-1)·pitch + width`.
    #[allow(clippy::too_many_arguments)]
    pub fn copy_bounds(
        what: &'static str,
        offset: usize,
        pitch: usize,
        width: usize,
        height: usize,
        len: usize,
    ) -> Result<()> {
        let needed = if height == 0 || width == 0 {
            0
        } else {
            offset + (height - 1) * pitch + width
        };
        if needed <= len && (height <= 1 || width <= pitch) {
            Ok(())
        } else {
            Err(CollectiveError::CopyOutOfBounds {
                what,
                needed,
                offset,
                pitch,
                width,
                height,
                len,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locate_finds_group_and_position() {
        let groups = vec![vec![0, 2, 4, 6], vec![1, 3, 5, 7]];
        assert_eq!(locate_in_groups(&groups, 5, 8).ok(), Some(Some((1, 2))));
        assert_eq!(locate_in_groups(&groups[..1], 5, 8).ok(), Some(None));
    }

    #[test]
    fn locate_rejects_bad_groups() {
        assert!(matches!(
            locate_in_groups(&[vec![0], vec![]], 0, 2),
            Err(CollectiveError::EmptyGroup { group_index: 1 })
        ));
        assert!(matches!(
            locate_in_groups(&[vec![0, 9]], 0, 2),
            Err(CollectiveError::RankOutOfRange { rank: 9, .. })
        ));
        assert!(matches!(
            locate_in_groups(&[vec![0, 1], vec![1]], 0, 2),
            Err(CollectiveError::DuplicateRank { rank: 1, .. })
        ));
    }

    #[test]
    fn combine_matches_reduce_ops() {
        assert_eq!(f32::combine(1.0, 2.0, ReduceOp::Sum), 3.0);
        assert_eq!(i32::combine(-1, 2, ReduceOp::Max), 2);
        assert_eq!(u8::combine(250, 10, ReduceOp::Sum), 4);
        let b = half::bf16::from_f32;
        assert_eq!(half::bf16::combine(b(1.0), b(-3.0), ReduceOp::Min), b(-3.0));
    }

    #[test]
    fn copy_bounds_checks_last_row() {
        assert!(check::copy_bounds("src", 2, 10, 4, 3, 26).is_ok());
        assert!(check::copy_bounds("src", 2, 10, 4, 3, 25).is_err());
        assert!(check::copy_bounds("src", 0, 2, 4, 3, 100).is_err());
    }
}
