//! The engine: a bounded admission queue in front of one worker thread that owns the pipeline
//! (the models and their devices) and runs requests one at a time, streaming each request's
//! events back through a channel.
//!
//! A request stops at its next step when its client goes away (the event channel is closed),
//! when `Cancel` names it, or when its deadline passes; the worker then takes the next request.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use tokio::sync::mpsc;

use crate::pipeline::{Pipeline, RunError, Sink, Stop};
use crate::request::GenerateParams;

/// Which part of the work a progress event counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Prompt encoding.
    Text,
    /// Denoising steps.
    Denoise,
    /// Decoded and encoded frames.
    Decode,
}

/// Wall-clock durations of one request, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timings {
    /// Accepted to start of work.
    pub queue_ms: f64,
    /// Text encoding.
    pub text_ms: f64,
    /// Denoising loop.
    pub denoise_ms: f64,
    /// VAE decode, summed over chunks.
    pub decode_ms: f64,
    /// Encoding and muxing, summed.
    pub encode_ms: f64,
    /// Accepted to the first media segment handed to the client's stream.
    pub first_segment_ms: f64,
    /// Accepted to completion.
    pub total_ms: f64,
}

/// One fragmented-MP4 media segment.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    /// 1-based sequence number.
    pub sequence_number: u32,
    /// First frame index.
    pub first_frame: u32,
    /// Frames in it.
    pub frame_count: u32,
    /// moof + mdat bytes.
    pub data: Vec<u8>,
}

/// What a request's stream carries, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Work done so far in a phase.
    Progress {
        /// The phase.
        phase: Phase,
        /// Units done.
        done: u32,
        /// Units in the phase.
        total: u32,
    },
    /// The init segment.
    Init {
        /// ftyp + moov.
        data: Vec<u8>,
        /// MIME type with codecs.
        mime_type: String,
    },
    /// A media segment.
    Segment(Segment),
    /// Finished.
    Completed {
        /// Measured durations.
        timings: Timings,
        /// Frames delivered.
        frames: u32,
        /// Segments delivered.
        segments: u32,
    },
    /// Ended without finishing.
    Failed(Failure),
}

/// Why a request ended early.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// `Cancel` or the client went away.
    Cancelled,
    /// Its deadline passed.
    DeadlineExceeded,
    /// The pipeline failed; the message says where.
    Internal(String),
}

/// Admission refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    /// The queue holds `depth` requests already.
    #[error("the queue is full ({depth} requests waiting); retry later")]
    QueueFull {
        /// Queue capacity.
        depth: usize,
    },
    /// The engine is shutting down.
    #[error("the server is shutting down")]
    ShuttingDown,
}

/// A queued or running request's handle on the worker side.
struct Job {
    id: String,
    params: GenerateParams,
    events: mpsc::Sender<Event>,
    cancel: Arc<AtomicBool>,
    deadline: Option<Instant>,
    accepted: Instant,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Job>,
    running: Option<String>,
    /// Cancel flags of queued and running requests, by id.
    cancels: HashMap<String, Arc<AtomicBool>>,
    shutdown: bool,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    depth: usize,
    next_id: AtomicU64,
}

/// The admission queue and its worker thread. Dropping the engine stops the worker after the
/// running request.
pub struct Engine {
    shared: Arc<Shared>,
    worker: Option<std::thread::JoinHandle<()>>,
    model_name: String,
}

/// What `submit` hands back.
pub struct Submitted {
    /// The request's id.
    pub id: String,
    /// Requests ahead of it.
    pub queue_position: usize,
    /// Its events.
    pub events: mpsc::Receiver<Event>,
}

impl Engine {
    /// Starts the worker thread around `pipeline`, admitting at most `depth` waiting requests.
    pub fn start(pipeline: Pipeline, depth: usize) -> Engine {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
            depth,
            next_id: AtomicU64::new(1),
        });
        let model_name = pipeline.model_name().to_string();
        let worker_shared = Arc::clone(&shared);
        let worker = std::thread::Builder::new()
            .name("ditstream-engine".into())
            .spawn(move || worker_loop(&worker_shared, &pipeline))
            .expect("spawning the engine thread (only fails when the OS is out of threads)");
        Engine {
            shared,
            worker: Some(worker),
            model_name,
        }
    }

    /// The served model's name.
    pub fn model_name(&self) -> &str {
        &self.model_name
    }

    /// Queues a request. Its events arrive on the returned channel, ending with `Completed` or
    /// `Failed`.
    pub fn submit(
        &self,
        params: GenerateParams,
        deadline: Option<Instant>,
    ) -> Result<Submitted, Rejected> {
        let mut state = lock(&self.shared.state);
        if state.shutdown {
            return Err(Rejected::ShuttingDown);
        }
        if state.queue.len() >= self.shared.depth {
            return Err(Rejected::QueueFull {
                depth: self.shared.depth,
            });
        }
        let id = format!(
            "req-{}",
            self.shared.next_id.fetch_add(1, Ordering::Relaxed)
        );
        // Enough room that the worker never waits on a reader that is keeping up.
        let (tx, rx) = mpsc::channel(256);
        let cancel = Arc::new(AtomicBool::new(false));
        state.cancels.insert(id.clone(), Arc::clone(&cancel));
        let queue_position = state.queue.len() + usize::from(state.running.is_some());
        state.queue.push_back(Job {
            id: id.clone(),
            params,
            events: tx,
            cancel,
            deadline,
            accepted: Instant::now(),
        });
        drop(state);
        self.shared.wake.notify_one();
        Ok(Submitted {
            id,
            queue_position,
            events: rx,
        })
    }

    /// Cancels a queued or running request; false if no such request.
    pub fn cancel(&self, id: &str) -> bool {
        let state = lock(&self.shared.state);
        match state.cancels.get(id) {
            Some(flag) => {
                flag.store(true, Ordering::SeqCst);
                true
            }
            None => false,
        }
    }

    /// (queued, running) counts.
    pub fn load(&self) -> (usize, usize) {
        let state = lock(&self.shared.state);
        (state.queue.len(), usize::from(state.running.is_some()))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let mut state = lock(&self.shared.state);
        state.shutdown = true;
        for job in state.queue.drain(..) {
            let _ = job.events.try_send(Event::Failed(Failure::Cancelled));
        }
        for flag in state.cancels.values() {
            flag.store(true, Ordering::SeqCst);
        }
        drop(state);
        self.shared.wake.notify_all();
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

/// Locks, recovering from a poisoned lock: the state stays consistent because every critical
/// section is a few field updates that cannot panic halfway.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn worker_loop(shared: &Shared, pipeline: &Pipeline) {
    loop {
        let job = {
            let mut state = lock(&shared.state);
            loop {
                if state.shutdown {
                    return;
                }
                if let Some(job) = state.queue.pop_front() {
                    state.running = Some(job.id.clone());
                    break job;
                }
                state = shared
                    .wake
                    .wait(state)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        };
        let span = tracing::info_span!("request", id = %job.id);
        let _enter = span.enter();
        let mut sink = JobSink {
            job: &job,
            first_segment: None,
        };
        let outcome = pipeline.run(&job.params, job.accepted, &mut sink);
        let last = match outcome {
            Ok(mut done) => {
                done.timings.first_segment_ms = sink.first_segment.unwrap_or(0.0);
                done.timings.total_ms = ms(job.accepted.elapsed());
                tracing::info!(
                    total_ms = done.timings.total_ms,
                    frames = done.frames,
                    "completed"
                );
                Event::Completed {
                    timings: done.timings,
                    frames: done.frames,
                    segments: done.segments,
                }
            }
            Err(RunError::Stopped(Stop::Cancelled)) => Event::Failed(Failure::Cancelled),
            Err(RunError::Stopped(Stop::Deadline)) => Event::Failed(Failure::DeadlineExceeded),
            Err(RunError::Failed(message)) => {
                tracing::error!(%message, "request failed");
                Event::Failed(Failure::Internal(message))
            }
        };
        // The request is over before its last event leaves: a client that sees `Completed` and
        // asks for the load next must not find it still running.
        {
            let mut state = lock(&shared.state);
            state.running = None;
            state.cancels.remove(&job.id);
        }
        // The client may be gone; nothing more to do for it then.
        let _ = job.events.blocking_send(last);
    }
}

/// Milliseconds of a duration, as f64.
pub fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Delivers a running job's events, and tells the pipeline to stop when it should.
struct JobSink<'a> {
    job: &'a Job,
    first_segment: Option<f64>,
}

impl Sink for JobSink<'_> {
    fn check(&mut self) -> Result<(), Stop> {
        if self.job.cancel.load(Ordering::SeqCst) || self.job.events.is_closed() {
            return Err(Stop::Cancelled);
        }
        if self.job.deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(Stop::Deadline);
        }
        Ok(())
    }

    fn send(&mut self, event: Event) -> Result<(), Stop> {
        self.check()?;
        let is_segment = matches!(event, Event::Segment(_));
        // A closed channel is the client going away: stop the work.
        self.job
            .events
            .blocking_send(event)
            .map_err(|_| Stop::Cancelled)?;
        if is_segment && self.first_segment.is_none() {
            self.first_segment = Some(ms(self.job.accepted.elapsed()));
        }
        Ok(())
    }
}
