//! The in-process collective backend: ranks are threads of one process, with real concurrency.
//! CI, the embedded CPU default and every multi-rank test run on it.
//!
//! [`CpuWorld`] hands out one [`CpuRank`] per rank (move each into its own thread);
//! [`CpuRank::group`] (or [`CommWorld::split`]) makes a [`CpuComm`] for a list of ranks.
//!
//! How an exchange works: the members of a group share one `GroupState` (a mutex, a condvar
//! and a generation counter). For collective number `seq`, each rank waits until the state's
//! generation is `seq` (the previous round has been read by everyone), deposits its
//! contribution, and the last to arrive checks that all ranks called the same operation with
//! compatible arguments and marks the round complete. Each rank then takes the contributions
//! (reference-counted, so results are computed outside the lock), and the last reader opens
//! the next generation. Send/recv pairs use per-(from, to) FIFO mailboxes in the same state.
//!
//! Failure semantics: a rank that errors, times out, or drops its communicator (including by
//! panicking) *poisons* the group; every rank waiting in, or later entering, an operation on it
//! gets [`CollectiveError::Poisoned`]. A rank that never arrives makes the others time out
//! ([`CpuWorld::with_timeout`], default [`DEFAULT_TIMEOUT`]), which poisons the group too.
//! Data that was already complete (a finished round, a delivered message) is still handed out.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{
    CollectiveError, CommWorld, Communicator, DEFAULT_TIMEOUT, DType, Element, Pending, ReduceOp,
    Result, check, locate_in_groups, prefix_offsets,
};

/// A world of `world_size` in-process ranks.
#[derive(Debug, Clone)]
pub struct CpuWorld {
    world_size: usize,
    timeout: Duration,
    registry: Arc<Registry>,
}

impl CpuWorld {
    /// A world of `world_size` ranks (≥ 1) with the default timeout.
    pub fn new(world_size: usize) -> Self {
        Self {
            world_size,
            timeout: DEFAULT_TIMEOUT,
            registry: Arc::new(Registry::default()),
        }
    }

    /// The same world with another timeout for every wait (tests use ~100 ms).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// One handle per rank, in rank order; move each into the thread that plays that rank.
    pub fn ranks(&self) -> Vec<CpuRank> {
        (0..self.world_size)
            .map(|rank| CpuRank {
                rank,
                world_size: self.world_size,
                timeout: self.timeout,
                registry: self.registry.clone(),
                instances: RefCell::new(HashMap::new()),
            })
            .collect()
    }

    /// Runs `f` once per rank, each on its own thread, and returns the results in rank order;
    /// a rank that panicked gives `Err(panic message)` (its communicators are dropped while
    /// unwinding, so the other ranks see errors, not hangs).
    pub fn run<R, F>(&self, f: F) -> Vec<std::result::Result<R, String>>
    where
        R: Send,
        F: Fn(CpuRank) -> R + Sync,
    {
        let f = &f;
        std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .ranks()
                .into_iter()
                .map(|rank| {
                    std::thread::Builder::new()
                        .name(format!("cpu-rank-{}", rank.rank))
                        .spawn_scoped(scope, move || f(rank))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| match h {
                    Ok(handle) => handle.join().map_err(|p| panic_message(p.as_ref())),
                    Err(e) => Err(format!("could not spawn rank thread: {e}")),
                })
                .collect()
        })
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_string()
    }
}

/// Groups being joined: (ranks, instance) → shared state and how many members took it.
/// The instance number lets a group be created again after an earlier communicator for the
/// same ranks was dropped: each member counts its own creations, in the same order.
#[derive(Debug, Default)]
struct Registry {
    pending: Mutex<PendingGroups>,
}

/// (ranks, instance) → (shared state, members that have taken it).
type PendingGroups = HashMap<(Vec<usize>, u64), (Arc<GroupState>, usize)>;

/// One rank's handle on a [`CpuWorld`].
#[derive(Debug)]
pub struct CpuRank {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    registry: Arc<Registry>,
    instances: RefCell<HashMap<Vec<usize>, u64>>,
}

impl CpuRank {
    /// This rank's global rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the world.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// A communicator over `ranks` (global ranks in group-rank order; must contain this rank).
    /// Only the members call it (unlike [`CommWorld::split`], which all ranks call); the first
    /// operation waits for every member to have joined.
    pub fn group(&self, ranks: &[usize]) -> Result<CpuComm> {
        let Some((_, group_rank)) = locate_in_groups(
            std::slice::from_ref(&ranks.to_vec()),
            self.rank,
            self.world_size,
        )?
        else {
            return Err(CollectiveError::NotInGroup {
                rank: self.rank,
                ranks: ranks.to_vec(),
            });
        };
        let instance = {
            let mut instances = self.instances.borrow_mut();
            let n = instances.entry(ranks.to_vec()).or_insert(0);
            *n += 1;
            *n - 1
        };
        let state = {
            let mut pending = lock_registry(&self.registry);
            let key = (ranks.to_vec(), instance);
            let (state, joined) = pending
                .entry(key.clone())
                .or_insert_with(|| (Arc::new(GroupState::new(ranks.to_vec())), 0));
            *joined += 1;
            let state = state.clone();
            if *joined == ranks.len() {
                pending.remove(&key);
            }
            state
        };
        tracing::debug!(
            rank = self.rank,
            ?ranks,
            group_rank,
            "cpu communicator created"
        );
        Ok(CpuComm {
            state,
            group_rank,
            timeout: self.timeout,
            seq: Cell::new(0),
        })
    }
}

fn lock_registry(registry: &Registry) -> MutexGuard<'_, PendingGroups> {
    // The registry's critical sections cannot panic; recover the data if one ever did.
    registry.pending.lock().unwrap_or_else(|e| e.into_inner())
}

impl CommWorld for CpuRank {
    type Comm = CpuComm;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn split(&self, groups: &[Vec<usize>]) -> Result<Option<CpuComm>> {
        match locate_in_groups(groups, self.rank, self.world_size)? {
            Some((gi, _)) => self.group(&groups[gi]).map(Some),
            None => Ok(None),
        }
    }
}

/// What every rank must agree on for one collective.
#[derive(Debug, Clone, PartialEq)]
struct OpDesc {
    op: &'static str,
    dtype: Option<DType>,
    /// Sizes, root, reduce op …: values that must be equal on every rank.
    agreed: Vec<usize>,
}

/// One rank's deposit for a collective round.
struct Contribution {
    desc: OpDesc,
    /// Per-rank values that are checked across ranks by the op's own rule (all_to_all_v counts).
    local: Vec<usize>,
    /// The rank's data, a `Vec<T>` of the op's element type.
    data: Box<dyn Any + Send + Sync>,
}

/// Cross-rank rule run by the last rank to arrive: `Err(detail)` poisons the round.
type Validate = fn(&[Arc<Contribution>]) -> std::result::Result<(), String>;

#[derive(Default)]
struct Inner {
    poisoned: Option<String>,
    generation: u64,
    arrived: usize,
    complete: bool,
    read: usize,
    slots: Vec<Option<Arc<Contribution>>>,
    mail: HashMap<(usize, usize), VecDeque<Vec<u8>>>,
}

/// The state the members of one group share.
struct GroupState {
    ranks: Vec<usize>,
    inner: Mutex<Inner>,
    cv: Condvar,
}

impl std::fmt::Debug for GroupState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupState")
            .field("ranks", &self.ranks)
            .finish_non_exhaustive()
    }
}

impl GroupState {
    fn new(ranks: Vec<usize>) -> Self {
        let n = ranks.len();
        Self {
            ranks,
            inner: Mutex::new(Inner {
                slots: (0..n).map(|_| None).collect(),
                ..Inner::default()
            }),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Nothing panics while holding this lock (no user code runs under it); if something
        // ever did, the group is poisoned through the communicator's Drop anyway.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn poison(&self, inner: &mut Inner, reason: String) {
        if inner.poisoned.is_none() {
            tracing::warn!(ranks = ?self.ranks, %reason, "collective group poisoned");
            inner.poisoned = Some(reason);
        }
        self.cv.notify_all();
    }
}

/// Which check of [`CpuComm::wait_until`] comes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// Entering an operation: poison first.
    Start,
    /// Collecting a result that may already be complete: readiness first.
    Result,
}

/// A communicator of the CPU backend (see the module docs). `Buf<T>` is `[T]`.
#[derive(Debug)]
pub struct CpuComm {
    state: Arc<GroupState>,
    group_rank: usize,
    timeout: Duration,
    /// Number of collectives this rank has completed on this communicator.
    seq: Cell<u64>,
}

impl Drop for CpuComm {
    fn drop(&mut self) {
        let why = if std::thread::panicking() {
            "panicked"
        } else {
            "dropped its communicator"
        };
        let reason = format!(
            "group rank {} (global rank {}) {why}",
            self.group_rank, self.state.ranks[self.group_rank]
        );
        let mut inner = self.state.lock();
        self.state.poison(&mut inner, reason);
    }
}

impl CpuComm {
    fn size_(&self) -> usize {
        self.state.ranks.len()
    }

    /// Waits on the group's condvar until `ready`, the group is poisoned, or the deadline.
    /// With `Wait::Result`, `ready` is checked before the poison, so data that is already
    /// complete is handed out even after a later poisoning; with `Wait::Start`, a poisoned
    /// group never starts another operation.
    fn wait_until<'g>(
        &self,
        mut guard: MutexGuard<'g, Inner>,
        op: &'static str,
        deadline: Instant,
        kind: Wait,
        mut ready: impl FnMut(&mut Inner) -> bool,
    ) -> Result<MutexGuard<'g, Inner>> {
        loop {
            if kind == Wait::Result && ready(&mut guard) {
                return Ok(guard);
            }
            if let Some(reason) = &guard.poisoned {
                return Err(CollectiveError::Poisoned {
                    ranks: self.state.ranks.clone(),
                    reason: reason.clone(),
                });
            }
            if kind == Wait::Start && ready(&mut guard) {
                return Ok(guard);
            }
            let now = Instant::now();
            if now >= deadline {
                let reason = format!(
                    "group rank {} timed out after {:?} in {op}",
                    self.group_rank, self.timeout
                );
                self.state.poison(&mut guard, reason);
                return Err(CollectiveError::Timeout {
                    op,
                    ranks: self.state.ranks.clone(),
                    group_rank: self.group_rank,
                    after: self.timeout,
                });
            }
            guard = match self.state.cv.wait_timeout(guard, deadline - now) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
    }

    /// Runs `f`; if it fails, poisons the group so the other ranks fail too.
    fn guarded<R>(&self, op: &'static str, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let out = f();
        if let Err(e) = &out {
            let mut inner = self.state.lock();
            self.state.poison(
                &mut inner,
                format!("group rank {} failed in {op}: {e}", self.group_rank),
            );
        }
        out
    }

    /// One collective round: deposit `data`, wait for everyone, return all contributions in
    /// group-rank order.
    fn exchange<T: Element>(
        &self,
        desc: OpDesc,
        local: Vec<usize>,
        data: Vec<T>,
        validate: Option<Validate>,
    ) -> Result<Vec<Arc<Contribution>>> {
        let op = desc.op;
        let seq = self.seq.get();
        let deadline = Instant::now() + self.timeout;
        let n = self.size_();
        let guard = self.state.lock();
        let mut guard =
            self.wait_until(guard, op, deadline, Wait::Start, |g| g.generation == seq)?;
        guard.slots[self.group_rank] = Some(Arc::new(Contribution {
            desc,
            local,
            data: Box::new(data),
        }));
        guard.arrived += 1;
        if guard.arrived == n {
            let all: Vec<Arc<Contribution>> = guard.slots.iter().flatten().cloned().collect();
            let verdict = check_round(&all, validate);
            if let Err(detail) = verdict {
                let reason = format!("collective #{seq} mismatch: {detail}");
                self.state.poison(&mut guard, reason);
                return Err(CollectiveError::Mismatch {
                    ranks: self.state.ranks.clone(),
                    seq,
                    detail,
                });
            }
            guard.complete = true;
            self.state.cv.notify_all();
        }
        let mut guard = self.wait_until(guard, op, deadline, Wait::Result, |g| {
            g.generation == seq && g.complete
        })?;
        let all: Vec<Arc<Contribution>> = guard.slots.iter().flatten().cloned().collect();
        guard.read += 1;
        if guard.read == n {
            guard.slots.iter_mut().for_each(|s| *s = None);
            guard.arrived = 0;
            guard.read = 0;
            guard.complete = false;
            guard.generation += 1;
            self.state.cv.notify_all();
        }
        drop(guard);
        self.seq.set(seq + 1);
        Ok(all)
    }

    /// Deposits each `(to, bytes)` in the mailbox from this rank to group rank `to` (peers
    /// checked by the caller); a poisoned group takes nothing.
    fn post<'b>(&self, messages: impl IntoIterator<Item = (usize, &'b [u8])>) -> Result<()> {
        let mut inner = self.state.lock();
        if let Some(reason) = &inner.poisoned {
            return Err(CollectiveError::Poisoned {
                ranks: self.state.ranks.clone(),
                reason: reason.clone(),
            });
        }
        for (to, bytes) in messages {
            inner
                .mail
                .entry((self.group_rank, to))
                .or_default()
                .push_back(bytes.to_vec());
        }
        self.state.cv.notify_all();
        Ok(())
    }

    fn desc<T: Element>(&self, op: &'static str, agreed: Vec<usize>) -> OpDesc {
        OpDesc {
            op,
            dtype: Some(T::DTYPE),
            agreed,
        }
    }
}

/// Same op, type and agreed values on every rank, then the op's own rule.
fn check_round(
    all: &[Arc<Contribution>],
    validate: Option<Validate>,
) -> std::result::Result<(), String> {
    let first = &all[0].desc;
    for (i, c) in all.iter().enumerate().skip(1) {
        if c.desc != *first {
            return Err(format!(
                "group rank 0 called {:?}, group rank {i} called {:?}",
                first, c.desc
            ));
        }
    }
    validate.map_or(Ok(()), |v| v(all))
}

/// The `Vec<T>` inside a contribution. The dtype was checked equal on all ranks, so the
/// downcast only fails on a bug in this file; it is still an error, not a panic.
fn data<T: Element>(c: &Contribution) -> Result<&[T]> {
    c.data
        .downcast_ref::<Vec<T>>()
        .map(|v| v.as_slice())
        .ok_or_else(|| CollectiveError::Mismatch {
            ranks: Vec::new(),
            seq: 0,
            detail: format!("contribution is not a Vec<{:?}>", T::DTYPE),
        })
}

fn reduce_op_code(op: ReduceOp) -> usize {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 1,
        ReduceOp::Min => 2,
    }
}

/// all_to_all_v rule: rank i's send_counts[j] == rank j's recv_counts[i].
fn validate_all_to_all_v(all: &[Arc<Contribution>]) -> std::result::Result<(), String> {
    let p = all.len();
    for (i, ci) in all.iter().enumerate() {
        for (j, cj) in all.iter().enumerate() {
            let sent = ci.local[j];
            let expected = cj.local[p + i];
            if sent != expected {
                return Err(format!(
                    "all_to_all_v: group rank {i} sends {sent} elements to rank {j}, which \
                     expects {expected}"
                ));
            }
        }
    }
    Ok(())
}

impl Communicator for CpuComm {
    type Buf<T: Element> = [T];
    type Owned<T: Element> = Vec<T>;
    type Pending<'a> = CpuPending<'a>;

    fn rank(&self) -> usize {
        self.group_rank
    }

    fn size(&self) -> usize {
        self.size_()
    }

    fn ranks(&self) -> &[usize] {
        &self.state.ranks
    }

    fn len<T: Element>(&self, buf: &[T]) -> usize {
        buf.len()
    }

    fn alloc<T: Element>(&self, len: usize) -> Result<Vec<T>> {
        Ok(vec![T::default(); len])
    }

    fn upload<T: Element>(&self, host: &[T]) -> Result<Vec<T>> {
        Ok(host.to_vec())
    }

    fn download<T: Element>(&self, buf: &[T]) -> Result<Vec<T>> {
        Ok(buf.to_vec())
    }

    fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.guarded("all_gather", || {
            let n = send.len();
            check::len("all_gather", "recv", n * self.size_(), recv.len())?;
            let all = self.exchange(
                self.desc::<T>("all_gather", vec![n]),
                vec![],
                send.to_vec(),
                None,
            )?;
            for (i, c) in all.iter().enumerate() {
                recv[i * n..(i + 1) * n].copy_from_slice(data::<T>(c)?);
            }
            Ok(())
        })
    }

    fn all_gather_v<T: Element>(&self, send: &[T], recv: &mut [T], counts: &[usize]) -> Result<()> {
        self.guarded("all_gather_v", || {
            check::counts("all_gather_v", "counts", counts, self.size_())?;
            check::len("all_gather_v", "send", counts[self.group_rank], send.len())?;
            let offsets = prefix_offsets(counts);
            check::len("all_gather_v", "recv", offsets[counts.len()], recv.len())?;
            let desc = self.desc::<T>("all_gather_v", counts.to_vec());
            let all = self.exchange(desc, vec![], send.to_vec(), None)?;
            for (i, c) in all.iter().enumerate() {
                recv[offsets[i]..offsets[i + 1]].copy_from_slice(data::<T>(c)?);
            }
            Ok(())
        })
    }

    fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.guarded("all_to_all", || {
            let p = self.size_();
            let n = check::chunk("all_to_all", "send", send.len(), p)?;
            check::len("all_to_all", "recv", send.len(), recv.len())?;
            let all = self.exchange(
                self.desc::<T>("all_to_all", vec![n]),
                vec![],
                send.to_vec(),
                None,
            )?;
            let r = self.group_rank;
            for (i, c) in all.iter().enumerate() {
                recv[i * n..(i + 1) * n].copy_from_slice(&data::<T>(c)?[r * n..(r + 1) * n]);
            }
            Ok(())
        })
    }

    fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        self.guarded("all_to_all_v", || {
            let p = self.size_();
            check::counts("all_to_all_v", "send_counts", send_counts, p)?;
            check::counts("all_to_all_v", "recv_counts", recv_counts, p)?;
            let send_off = prefix_offsets(send_counts);
            let recv_off = prefix_offsets(recv_counts);
            check::len("all_to_all_v", "send", send_off[p], send.len())?;
            check::len("all_to_all_v", "recv", recv_off[p], recv.len())?;
            let local = send_counts.iter().chain(recv_counts).copied().collect();
            let all = self.exchange(
                self.desc::<T>("all_to_all_v", vec![]),
                local,
                send.to_vec(),
                Some(validate_all_to_all_v),
            )?;
            let r = self.group_rank;
            for (i, c) in all.iter().enumerate() {
                let their_off = prefix_offsets(&c.local[..p]);
                recv[recv_off[i]..recv_off[i + 1]]
                    .copy_from_slice(&data::<T>(c)?[their_off[r]..their_off[r + 1]]);
            }
            Ok(())
        })
    }

    fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.guarded("all_reduce", || {
            check::len("all_reduce", "recv", send.len(), recv.len())?;
            let desc = self.desc::<T>("all_reduce", vec![send.len(), reduce_op_code(op)]);
            let all = self.exchange(desc, vec![], send.to_vec(), None)?;
            recv.copy_from_slice(data::<T>(&all[0])?);
            for c in &all[1..] {
                for (acc, &v) in recv.iter_mut().zip(data::<T>(c)?) {
                    *acc = T::combine(*acc, v, op);
                }
            }
            Ok(())
        })
    }

    fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let send = buf.to_vec();
        self.all_reduce(&send, buf, op)
    }

    fn reduce_scatter<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.guarded("reduce_scatter", || {
            let n = recv.len();
            check::len("reduce_scatter", "send", n * self.size_(), send.len())?;
            let desc = self.desc::<T>("reduce_scatter", vec![n, reduce_op_code(op)]);
            let all = self.exchange(desc, vec![], send.to_vec(), None)?;
            let r = self.group_rank;
            recv.copy_from_slice(&data::<T>(&all[0])?[r * n..(r + 1) * n]);
            for c in &all[1..] {
                for (acc, &v) in recv.iter_mut().zip(&data::<T>(c)?[r * n..(r + 1) * n]) {
                    *acc = T::combine(*acc, v, op);
                }
            }
            Ok(())
        })
    }

    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.guarded("broadcast", || {
            check::peer("broadcast", "root", root, self.size_())?;
            let mine = if self.group_rank == root {
                buf.to_vec()
            } else {
                Vec::new()
            };
            let desc = self.desc::<T>("broadcast", vec![buf.len(), root]);
            let all = self.exchange(desc, vec![], mine, None)?;
            if self.group_rank != root {
                buf.copy_from_slice(data::<T>(&all[root])?);
            }
            Ok(())
        })
    }

    fn barrier(&self) -> Result<()> {
        self.guarded("barrier", || {
            let desc = OpDesc {
                op: "barrier",
                dtype: None,
                agreed: vec![],
            };
            self.exchange::<u8>(desc, vec![], Vec::new(), None)
                .map(|_| ())
        })
    }

    fn send_recv<'a, T: Element>(
        &'a self,
        send: &'a [T],
        to: usize,
        recv: &'a mut [T],
        from: usize,
    ) -> Result<CpuPending<'a>> {
        self.guarded("send_recv", || {
            check::peer("send_recv", "to", to, self.size_())?;
            check::peer("send_recv", "from", from, self.size_())?;
            self.post([(to, bytemuck::cast_slice::<T, u8>(send))])
        })?;
        Ok(CpuPending {
            comm: self,
            op: "send_recv",
            recv: Some(bytemuck::cast_slice_mut::<T, u8>(recv)),
            sources: vec![from],
        })
    }

    fn all_gather_posted<'a, T: Element>(
        &'a self,
        send: &'a [T],
        recv: &'a mut [T],
    ) -> Result<CpuPending<'a>> {
        let p = self.size_();
        self.guarded("all_gather_posted", || {
            check::len("all_gather_posted", "recv", send.len() * p, recv.len())?;
            self.post((0..p).map(|j| (j, bytemuck::cast_slice::<T, u8>(send))))
        })?;
        Ok(CpuPending {
            comm: self,
            op: "all_gather_posted",
            recv: Some(bytemuck::cast_slice_mut::<T, u8>(recv)),
            sources: (0..p).collect(),
        })
    }

    fn all_to_all_posted<'a, T: Element>(
        &'a self,
        send: &'a [T],
        recv: &'a mut [T],
    ) -> Result<CpuPending<'a>> {
        let p = self.size_();
        self.guarded("all_to_all_posted", || {
            let n = check::chunk("all_to_all_posted", "send", send.len(), p)?;
            check::len("all_to_all_posted", "recv", send.len(), recv.len())?;
            let chunks =
                (0..p).map(|j| (j, bytemuck::cast_slice::<T, u8>(&send[j * n..(j + 1) * n])));
            self.post(chunks)
        })?;
        Ok(CpuPending {
            comm: self,
            op: "all_to_all_posted",
            recv: Some(bytemuck::cast_slice_mut::<T, u8>(recv)),
            sources: (0..p).collect(),
        })
    }

    fn copy_2d<T: Element>(
        &self,
        src: &[T],
        src_offset: usize,
        src_pitch: usize,
        dst: &mut [T],
        dst_offset: usize,
        dst_pitch: usize,
        width: usize,
        height: usize,
    ) -> Result<()> {
        check::copy_bounds("src", src_offset, src_pitch, width, height, src.len())?;
        check::copy_bounds("dst", dst_offset, dst_pitch, width, height, dst.len())?;
        for y in 0..height {
            let s = src_offset + y * src_pitch;
            let d = dst_offset + y * dst_pitch;
            dst[d..d + width].copy_from_slice(&src[s..s + width]);
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(()) // every CPU operation is complete when it returns
    }
}

/// A posted operation of the CPU backend ([`Communicator::send_recv`],
/// [`Communicator::all_gather_posted`], [`Communicator::all_to_all_posted`]): the sends were
/// deposited when posted; the receive, one equal chunk of `recv` from each of `sources` in order,
/// happens in [`Pending::wait`] (or on drop).
#[derive(Debug)]
pub struct CpuPending<'a> {
    comm: &'a CpuComm,
    op: &'static str,
    recv: Option<&'a mut [u8]>,
    sources: Vec<usize>,
}

impl CpuPending<'_> {
    fn finish(&mut self) -> Result<()> {
        let Some(recv) = self.recv.take() else {
            return Ok(());
        };
        let (comm, op) = (self.comm, self.op);
        let chunk = recv.len() / self.sources.len().max(1);
        comm.guarded(op, || {
            let deadline = Instant::now() + comm.timeout;
            for (i, &from) in self.sources.iter().enumerate() {
                let key = (from, comm.group_rank);
                let guard = comm.state.lock();
                let mut guard = comm.wait_until(guard, op, deadline, Wait::Result, |g| {
                    g.mail.get(&key).is_some_and(|q| !q.is_empty())
                })?;
                // wait_until returned because the queue is non-empty.
                let msg = guard
                    .mail
                    .get_mut(&key)
                    .and_then(|q| q.pop_front())
                    .unwrap_or_default();
                drop(guard);
                check::len(op, "recv (bytes)", msg.len(), chunk)?;
                recv[i * chunk..(i + 1) * chunk].copy_from_slice(&msg);
            }
            Ok(())
        })
    }
}

impl Pending for CpuPending<'_> {
    fn wait(mut self) -> Result<()> {
        self.finish()
    }
}

impl Drop for CpuPending<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            tracing::error!(error = %e, op = self.op, "posted operation dropped without wait, and it failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_ranks_all_gather() {
        let world = CpuWorld::new(2);
        let out = world.run(|rank| {
            let comm = rank.group(&[0, 1])?;
            let send = vec![rank.rank() as f32; 3];
            let mut recv = vec![0.0; 6];
            comm.all_gather(&send, &mut recv)?;
            Ok::<_, CollectiveError>(recv)
        });
        for r in out {
            assert_eq!(
                r.ok().and_then(|r| r.ok()),
                Some(vec![0., 0., 0., 1., 1., 1.])
            );
        }
    }

    #[test]
    fn not_in_group_is_an_error() {
        let ranks = CpuWorld::new(4).ranks();
        assert!(matches!(
            ranks[0].group(&[1, 2]),
            Err(CollectiveError::NotInGroup { rank: 0, .. })
        ));
    }

    #[test]
    fn mismatched_ops_fail_every_rank() {
        let world = CpuWorld::new(3).with_timeout(Duration::from_secs(5));
        let out = world.run(|rank| {
            let comm = rank.group(&[0, 1, 2])?;
            if rank.rank() == 1 {
                comm.barrier()
            } else {
                let mut b = [1.0f32; 2];
                comm.all_reduce_in_place(&mut b, ReduceOp::Sum)
            }
        });
        for r in out {
            assert!(matches!(r, Ok(Err(_))), "{r:?}");
        }
    }
}
