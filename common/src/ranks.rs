//! Persistent rank threads for the parts of the pipeline that run on several ranks (the denoiser
//! mesh; a parallel-VAE decoder instance): one thread per rank for the life of the stage, each
//! holding its models and its communicators, over either collective backend.
//!
//! - [`Backend`]: how ranks join a fresh communicator world: [`Threads`] (the in-process CPU
//!   backend) or `Nccl` (feature `cuda`: one GPU per rank, `ncclCommInitRank` on the rank's
//!   thread, which is where NCCL wants it).
//! - [`RankState`]: what one rank keeps (models, communicators, per-request state) and how it runs
//!   a job.
//! - [`RankGroup`]: the threads, started once; the communicators are formed once, when the group
//!   starts, and used by every request after it.
//!
//! Failure. A job that fails on any rank (other than an agreed cancel) leaves the group's
//! communicators in an unknown state. The failing rank drops its communicators at once, so its
//! peers' next collective fails (the CPU backend poisons the group immediately; NCCL's peers
//! abort after the communicator's timeout): every rank's job ends with an error, never a hang.
//! [`RankGroup::reply`] sees the failure and the next job first forms fresh communicators on every
//! rank (a new [`Backend::tickets`] round), while the models stay where they are. A panic inside a
//! job is caught on its rank and counts as a failed job; a rank thread that is gone takes the
//! group out of service ([`RankGroup::out_of_service`]).

use std::error::Error;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

use crate::collectives::cpu::{CpuRank, CpuWorld};
use crate::collectives::{CollectiveError, CommWorld};

/// Why a [`RankGroup`] could not start, form its communicators or take a job.
#[derive(Debug, thiserror::Error)]
pub enum RankError {
    /// A rank's thread could not be started.
    #[error("spawning {name} rank {rank}'s thread: {source}")]
    Spawn {
        /// The group's name (`denoise`, `vae`).
        name: String,
        /// The rank.
        rank: usize,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A rank's thread has stopped: the group can run nothing more.
    #[error("rank {rank}'s thread has stopped; restart the process")]
    Gone {
        /// The first rank found gone.
        rank: usize,
    },
    /// [`RankGroup::run`] was given a job count other than one per rank.
    #[error("{jobs} jobs for {ranks} ranks")]
    JobCount {
        /// Jobs given.
        jobs: usize,
        /// Ranks in the group.
        ranks: usize,
    },
    /// Forming the group's communicators failed (`source`: the first rank's failure).
    #[error("forming the communicators of {ranks} ranks: {source}")]
    Forming {
        /// Ranks in the group.
        ranks: usize,
        /// The first failure: a rank that could not join, or a thread gone.
        source: Box<RankError>,
    },
    /// A rank could not join the fresh world or connect its communicators.
    #[error("rank {rank} could not join: {source}")]
    Join {
        /// The rank.
        rank: usize,
        /// Why, as the rank reported it.
        source: Box<RankError>,
    },
    /// Joining or connecting panicked on the rank's thread.
    #[error("panicked: {message}")]
    Panicked {
        /// The panic's message.
        message: String,
    },
    /// An NCCL rank has no GPU in the backend's list.
    #[cfg(feature = "cuda")]
    #[error("rank {rank} has no GPU in {gpus:?}")]
    NoGpu {
        /// The rank.
        rank: usize,
        /// GPU ordinal of each rank.
        gpus: Vec<usize>,
    },
    /// The backend could not make or join a world.
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// A rank state could not build its communicators from a joined world, for a reason of its
    /// own (the stage's error type, boxed: [`RankState::connect`] serves every stage).
    #[error(transparent)]
    Connect(Box<dyn Error + Send + Sync>),
}

/// How the ranks of a group join a fresh communicator world.
pub trait Backend: Send + Sync + 'static {
    /// A rank's handle on the world (made and kept on the rank's own thread).
    type World: CommWorld;
    /// What the coordinator hands each rank so that it can join the same fresh world.
    type Ticket: Send + 'static;
    /// One ticket per rank of a fresh world of `ranks` ranks (on the coordinator's thread).
    fn tickets(&self, ranks: usize) -> Result<Vec<Self::Ticket>, RankError>;
    /// Joins the world as `rank` of `ranks` (on the rank's thread; collective: every rank of the
    /// group calls it with its ticket of the same round).
    fn join(
        &self,
        rank: usize,
        ranks: usize,
        ticket: Self::Ticket,
    ) -> Result<Self::World, RankError>;
}

/// The in-process CPU backend: ranks are threads of this process.
pub struct Threads;

impl Backend for Threads {
    type World = CpuRank;
    type Ticket = CpuRank;

    fn tickets(&self, ranks: usize) -> Result<Vec<CpuRank>, RankError> {
        Ok(CpuWorld::new(ranks).ranks())
    }

    fn join(&self, _rank: usize, _ranks: usize, ticket: CpuRank) -> Result<CpuRank, RankError> {
        Ok(ticket)
    }
}

/// NCCL: rank r on GPU `gpus[r]`, one thread per GPU, every collective bounded by `timeout`
/// (a peer that never arrives makes the others abort: see `common/src/collectives/nccl.rs`).
#[cfg(feature = "cuda")]
pub struct Nccl {
    /// GPU ordinal of each rank.
    pub gpus: Vec<usize>,
    /// How long a rank waits for its peers in any collective before aborting.
    pub timeout: std::time::Duration,
}

#[cfg(feature = "cuda")]
impl Backend for Nccl {
    type World = crate::collectives::nccl::NcclWorld;
    type Ticket = crate::collectives::nccl::NcclId;

    fn tickets(&self, ranks: usize) -> Result<Vec<Self::Ticket>, RankError> {
        let id = crate::collectives::nccl::NcclId::new()?;
        Ok(vec![id; ranks])
    }

    fn join(&self, rank: usize, ranks: usize, id: Self::Ticket) -> Result<Self::World, RankError> {
        let gpu = *self.gpus.get(rank).ok_or_else(|| RankError::NoGpu {
            rank,
            gpus: self.gpus.clone(),
        })?;
        Ok(crate::collectives::nccl::NcclWorld::init(
            gpu,
            rank,
            ranks,
            &id,
            self.timeout,
        )?)
    }
}

/// One rank's state in a [`RankGroup`], generic over the world type `W` of its backend.
pub trait RankState<W: CommWorld>: Send + 'static {
    /// A unit of work, one per rank per request step.
    type Job: Send + 'static;
    /// What a job gives back.
    type Out: Send + 'static;
    /// Builds the communicators this rank needs from a freshly joined world (collective: every
    /// rank of the group calls it); per-request state from earlier communicators is dropped.
    /// A failure of the state's own goes in [`RankError::Connect`].
    fn connect(&mut self, world: &W) -> Result<(), RankError>;
    /// Drops the communicators and everything that depends on them.
    fn disconnect(&mut self);
    /// Runs one job.
    fn run(&mut self, job: Self::Job) -> Self::Out;
    /// Whether `out` is a failure that may have left the communicators mid-collective: the rank
    /// then drops them at once (which fails its peers' pending collectives instead of letting
    /// them wait for the timeout) and the group reconnects before its next job.
    fn failed(out: &Self::Out) -> bool;
}

/// A message to a rank thread.
enum Msg<T, J, O> {
    /// Join a fresh world with this ticket and connect.
    Join(T, Sender<Result<(), RankError>>),
    /// Run a job; the reply is the job's output, or the panic message if it panicked.
    Run(J, Sender<Result<O, String>>),
}

/// A rank's reply to a job: its output, or why the job produced none (it panicked).
pub type Reply<O> = Result<O, String>;

type Sent<B, S> = Msg<
    <B as Backend>::Ticket,
    <S as RankState<<B as Backend>::World>>::Job,
    <S as RankState<<B as Backend>::World>>::Out,
>;

/// What others may read about a group while it runs a job (without waiting for it).
#[derive(Debug, Default)]
pub struct GroupStatus {
    connections: AtomicU64,
    /// The first rank found gone, and why the group is out of service.
    out_of_service: OnceLock<(usize, String)>,
}

impl GroupStatus {
    /// How many times the communicators have been formed: 1 after start, one more before the
    /// first job after each failed one.
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::SeqCst)
    }

    /// Why the group can run nothing more (a rank thread is gone), if it cannot.
    pub fn out_of_service(&self) -> Option<&str> {
        self.out_of_service.get().map(|(_, why)| why.as_str())
    }
}

/// Persistent threads, one per rank, each running jobs on its [`RankState`].
pub struct RankGroup<B: Backend, S: RankState<B::World>> {
    backend: Arc<B>,
    senders: Vec<Sender<Sent<B, S>>>,
    threads: Vec<JoinHandle<()>>,
    connected: bool,
    status: Arc<GroupStatus>,
}

impl<B: Backend, S: RankState<B::World>> RankGroup<B, S> {
    /// Starts one thread per state (rank r owns `states[r]`, thread `{name}-rank-{r}`) and forms
    /// the communicators; an error if any rank cannot join.
    pub fn start(name: &str, backend: B, states: Vec<S>) -> Result<Self, RankError> {
        let backend = Arc::new(backend);
        let ranks = states.len();
        let mut group = RankGroup {
            backend: Arc::clone(&backend),
            senders: Vec::with_capacity(ranks),
            threads: Vec::with_capacity(ranks),
            connected: false,
            status: Arc::default(),
        };
        for (rank, state) in states.into_iter().enumerate() {
            let (tx, rx) = channel::<Sent<B, S>>();
            let backend = Arc::clone(&backend);
            let thread = std::thread::Builder::new()
                .name(format!("{name}-rank-{rank}"))
                .spawn(move || rank_loop(&*backend, rank, ranks, state, &rx))
                .map_err(|source| RankError::Spawn {
                    name: name.to_string(),
                    rank,
                    source,
                })?;
            group.senders.push(tx);
            group.threads.push(thread);
        }
        group.connect()?;
        Ok(group)
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.senders.len()
    }

    /// How many times the communicators have been formed: 1 after start, one more after every
    /// failed job that was followed by another job.
    pub fn connections(&self) -> u64 {
        self.status.connections()
    }

    /// Why the group can run nothing more (a rank thread is gone), if it cannot.
    pub fn out_of_service(&self) -> Option<&str> {
        self.status.out_of_service()
    }

    /// The group's status, readable while it runs a job.
    pub fn status(&self) -> Arc<GroupStatus> {
        Arc::clone(&self.status)
    }

    /// Whether the communicators formed by the last connection are in use (no failure since).
    pub fn is_connected(&self) -> bool {
        self.connected
    }

    /// Every rank joins a fresh world and connects; waits for all of them.
    fn connect(&mut self) -> Result<(), RankError> {
        if let Some(&(rank, _)) = self.status.out_of_service.get() {
            return Err(RankError::Gone { rank });
        }
        let tickets = self.backend.tickets(self.size())?;
        let mut replies = Vec::with_capacity(self.size());
        for (rank, (tx, ticket)) in self.senders.iter().zip(tickets).enumerate() {
            let (reply_tx, reply_rx) = channel();
            if tx.send(Msg::Join(ticket, reply_tx)).is_err() {
                return Err(self.gone(rank));
            }
            replies.push(reply_rx);
        }
        // Every rank answers (a rank whose peers never arrive times out in the backend).
        let mut first_error = None;
        for (rank, rx) in replies.into_iter().enumerate() {
            let outcome = rx.recv().map_err(|_| self.gone(rank)).and_then(|r| {
                r.map_err(|e| RankError::Join {
                    rank,
                    source: Box::new(e),
                })
            });
            if let Err(e) = outcome {
                first_error.get_or_insert(e);
            }
        }
        self.status.connections.fetch_add(1, Ordering::SeqCst);
        match first_error {
            None => {
                self.connected = true;
                Ok(())
            }
            Some(e) => Err(RankError::Forming {
                ranks: self.size(),
                source: Box::new(e),
            }),
        }
    }

    /// Sends `jobs[r]` to rank r (forming fresh communicators first if the last job failed) and
    /// returns where each rank's reply will arrive, in rank order.
    pub fn run(&mut self, jobs: Vec<S::Job>) -> Result<Vec<Receiver<Reply<S::Out>>>, RankError> {
        if jobs.len() != self.size() {
            return Err(RankError::JobCount {
                jobs: jobs.len(),
                ranks: self.size(),
            });
        }
        if !self.connected {
            self.connect()?;
        }
        let mut replies = Vec::with_capacity(jobs.len());
        for (rank, job) in jobs.into_iter().enumerate() {
            let (reply_tx, reply_rx) = channel();
            if self.senders[rank].send(Msg::Run(job, reply_tx)).is_err() {
                // The ranks already sent a job are now waiting for a peer that will not come:
                // their collectives fail (poisoned or timed out), and the group must reconnect.
                self.connected = false;
                return Err(self.gone(rank));
            }
            replies.push(reply_rx);
        }
        Ok(replies)
    }

    /// Waits for rank `rank`'s reply to the last [`RankGroup::run`]; a failed one (a panic, a
    /// vanished thread, or an output [`RankState::failed`] calls a failure) marks the group for
    /// reconnection before its next job.
    pub fn reply(&mut self, rank: usize, rx: &Receiver<Reply<S::Out>>) -> Reply<S::Out> {
        let reply = match rx.recv() {
            Ok(reply) => reply,
            Err(_) => Err(self.gone(rank).to_string()),
        };
        if failed::<B, S>(&reply) {
            self.connected = false;
        }
        reply
    }

    /// Every rank's reply, in rank order (see [`RankGroup::reply`]).
    pub fn replies(&mut self, rxs: &[Receiver<Reply<S::Out>>]) -> Vec<Reply<S::Out>> {
        rxs.iter()
            .enumerate()
            .map(|(rank, rx)| self.reply(rank, rx))
            .collect()
    }

    fn gone(&mut self, rank: usize) -> RankError {
        let gone = RankError::Gone { rank };
        let _ = self.status.out_of_service.set((rank, gone.to_string())); // the first cause stays
        gone
    }
}

/// A [`RankGroup`] seen through its jobs and outputs only, whatever its backend: what a stage
/// holds, so one stage type serves the CPU and NCCL backends.
pub trait Ranks<J, O>: Send {
    /// See [`RankGroup::run`].
    fn run(&mut self, jobs: Vec<J>) -> Result<Vec<Receiver<Reply<O>>>, RankError>;
    /// See [`RankGroup::replies`].
    fn replies(&mut self, rxs: &[Receiver<Reply<O>>]) -> Vec<Reply<O>>;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// See [`RankGroup::connections`].
    fn connections(&self) -> u64;
    /// See [`RankGroup::is_connected`].
    fn is_connected(&self) -> bool;
    /// See [`RankGroup::status`].
    fn status(&self) -> Arc<GroupStatus>;
}

impl<B: Backend, S: RankState<B::World>> Ranks<S::Job, S::Out> for RankGroup<B, S> {
    fn run(&mut self, jobs: Vec<S::Job>) -> Result<Vec<Receiver<Reply<S::Out>>>, RankError> {
        RankGroup::run(self, jobs)
    }
    fn replies(&mut self, rxs: &[Receiver<Reply<S::Out>>]) -> Vec<Reply<S::Out>> {
        RankGroup::replies(self, rxs)
    }
    fn size(&self) -> usize {
        RankGroup::size(self)
    }
    fn connections(&self) -> u64 {
        RankGroup::connections(self)
    }
    fn is_connected(&self) -> bool {
        RankGroup::is_connected(self)
    }
    fn status(&self) -> Arc<GroupStatus> {
        RankGroup::status(self)
    }
}

impl<B: Backend, S: RankState<B::World>> Drop for RankGroup<B, S> {
    fn drop(&mut self) {
        // Closing the channels ends every rank's loop; each drops its communicators (all ranks at
        // once, which NCCL's collective destroy needs) and its models.
        self.senders.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// A rank thread: runs messages until the group is dropped.
fn rank_loop<B: Backend, S: RankState<B::World>>(
    backend: &B,
    rank: usize,
    ranks: usize,
    mut state: S,
    rx: &Receiver<Sent<B, S>>,
) {
    let _span = tracing::info_span!("rank", rank).entered();
    let mut world: Option<B::World> = None;
    for msg in rx {
        match msg {
            Msg::Join(ticket, reply) => {
                state.disconnect();
                world = None;
                let joined = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    let fresh = backend.join(rank, ranks, ticket)?;
                    state.connect(&fresh)?;
                    Ok(fresh)
                }))
                .unwrap_or_else(|panic| {
                    Err(RankError::Panicked {
                        message: panic_message(&*panic),
                    })
                });
                let outcome = joined.map(|fresh| world = Some(fresh));
                if let Err(e) = &outcome {
                    tracing::warn!(error = %e, "rank could not join");
                }
                let _ = reply.send(outcome);
            }
            Msg::Run(job, reply) => {
                let out = std::panic::catch_unwind(AssertUnwindSafe(|| state.run(job)))
                    .map_err(|panic| format!("rank {rank} panicked: {}", panic_message(&*panic)));
                if failed::<B, S>(&out) {
                    state.disconnect();
                }
                let _ = reply.send(out);
            }
        }
    }
    // Communicators before the world they were split from.
    state.disconnect();
    drop(world);
}

/// A reply that leaves the communicators in doubt: a panic, or an output the state calls failed.
fn failed<B: Backend, S: RankState<B::World>>(reply: &Reply<S::Out>) -> bool {
    match reply {
        Ok(out) => S::failed(out),
        Err(_) => true,
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_string()))
        .unwrap_or_else(|| "(no message)".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collectives::cpu::CpuComm;
    use crate::collectives::{Communicator, ReduceOp};
    use anyhow::{Context, bail};

    /// Each rank adds its input over the group; rank 1 can be told to fail or panic.
    struct Summer {
        comm: Option<CpuComm>,
    }

    enum Job {
        Add(f32),
        Fail,
        Panic,
    }

    impl RankState<CpuRank> for Summer {
        type Job = Job;
        type Out = anyhow::Result<f32>;
        fn connect(&mut self, world: &CpuRank) -> Result<(), RankError> {
            let all: Vec<usize> = (0..world.world_size()).collect();
            self.comm = world.split(&[all])?;
            Ok(())
        }
        fn disconnect(&mut self) {
            self.comm = None;
        }
        fn failed(out: &anyhow::Result<f32>) -> bool {
            out.is_err()
        }
        fn run(&mut self, job: Job) -> anyhow::Result<f32> {
            let comm = self.comm.as_ref().context("not connected")?;
            match job {
                Job::Add(v) => {
                    let mut buf = [v];
                    comm.all_reduce_in_place(&mut buf[..], ReduceOp::Sum)?;
                    Ok(buf[0])
                }
                Job::Fail => bail!("failed on purpose"),
                Job::Panic => panic!("panicked on purpose"),
            }
        }
    }

    fn group() -> RankGroup<Threads, Summer> {
        let states = (0..3).map(|_| Summer { comm: None }).collect();
        RankGroup::start("test", Threads, states).unwrap()
    }

    fn outcomes(g: &mut RankGroup<Threads, Summer>, jobs: Vec<Job>) -> Vec<Result<f32, String>> {
        let rxs = g.run(jobs).unwrap();
        g.replies(&rxs)
            .into_iter()
            .map(|reply| match reply {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => Err(format!("{e:#}")),
                Err(e) => Err(e),
            })
            .collect()
    }

    #[test]
    fn communicators_persist_across_jobs_and_reform_after_a_failure() {
        let mut g = group();
        for _ in 0..3 {
            let out = outcomes(&mut g, vec![Job::Add(1.0), Job::Add(2.0), Job::Add(3.0)]);
            assert_eq!(out, vec![Ok(6.0); 3]);
        }
        assert_eq!(g.connections(), 1, "formed once, used by every job");

        // A failing rank fails every rank at once (it leaves the group: no wait for a timeout),
        // and the next job reconnects.
        let t = std::time::Instant::now();
        let out = outcomes(&mut g, vec![Job::Add(1.0), Job::Fail, Job::Add(1.0)]);
        assert!(out.iter().all(Result::is_err), "{out:?}");
        assert!(t.elapsed() < std::time::Duration::from_secs(10));
        assert!(!g.is_connected());
        let out = outcomes(&mut g, vec![Job::Add(1.0), Job::Add(1.0), Job::Add(1.0)]);
        assert_eq!(out, vec![Ok(3.0); 3]);
        assert_eq!(g.connections(), 2);

        // A panic is caught on its rank; its peers fail; the group reconnects and serves on.
        let out = outcomes(&mut g, vec![Job::Add(1.0), Job::Add(1.0), Job::Panic]);
        assert!(out.iter().all(Result::is_err), "{out:?}");
        assert!(
            out[2]
                .as_ref()
                .is_err_and(|e| e.contains("rank 2 panicked: panicked on purpose")),
            "{out:?}"
        );
        let out = outcomes(&mut g, vec![Job::Add(2.0), Job::Add(2.0), Job::Add(2.0)]);
        assert_eq!(out, vec![Ok(6.0); 3]);
        assert_eq!(g.connections(), 3);
        assert!(g.out_of_service().is_none());
    }

    /// Fails (or panics) while connecting on one rank.
    enum BadJoin {
        Fails,
        Panics,
    }

    impl RankState<CpuRank> for Option<BadJoin> {
        type Job = ();
        type Out = ();
        fn connect(&mut self, _: &CpuRank) -> Result<(), RankError> {
            match self {
                None => Ok(()),
                Some(BadJoin::Fails) => Err(RankError::Connect("no communicators here".into())),
                Some(BadJoin::Panics) => panic!("connect panicked on purpose"),
            }
        }
        fn disconnect(&mut self) {}
        fn failed(_: &()) -> bool {
            false
        }
        fn run(&mut self, _: ()) {}
    }

    #[test]
    fn a_failed_join_names_the_group_size_the_rank_and_the_cause() {
        for (bad, cause) in [
            (BadJoin::Fails, "no communicators here"),
            (BadJoin::Panics, "panicked: connect panicked on purpose"),
        ] {
            let states = vec![None, Some(bad), None];
            let e = RankGroup::start("test", Threads, states).err().unwrap();
            assert_eq!(
                e.to_string(),
                format!("forming the communicators of 3 ranks: rank 1 could not join: {cause}")
            );
        }
    }

    #[test]
    fn one_job_per_rank() {
        let mut g = group();
        let e = g.run(vec![Job::Add(1.0), Job::Add(1.0)]).err().unwrap();
        assert_eq!(e.to_string(), "2 jobs for 3 ranks");
        assert!(g.is_connected(), "a refused run leaves the group as it was");
    }
}
