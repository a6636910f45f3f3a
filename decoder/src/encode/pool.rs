//! The encoder pool: worker threads that encode segments beside the VAE. The VAE's thread hands
//! each complete segment's frames to [`EncoderPool::submit`] and goes on with the next latent
//! chunk; the segment's result comes back on its [`Ticket`], and whoever sends segments waits on
//! the tickets in the order they were issued, so segments leave in order whichever worker
//! finishes first (the order-preserving hand-off).
//!
//! Bounds: at most `threads` segments wait in the queue beside the `threads` being encoded; a
//! submit beyond that blocks the VAE's thread until a worker takes one, so a slow encoder slows
//! the decode instead of filling memory. With no threads (`serving.encoder_threads: 0`) a submit
//! runs the work on the caller's thread: the sequential path, which the benchmark measures
//! beside the pool and the tests compare with it byte for byte.
//!
//! A panic in the work fails that segment's ticket and leaves the worker running.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use tokio::sync::oneshot;

type Task = Box<dyn FnOnce() + Send>;

/// Encoder threads shared by every request of a decoder instance.
pub struct EncoderPool {
    queue: Option<SyncSender<Task>>,
    workers: Vec<JoinHandle<()>>,
}

/// The result of one submitted piece of work, to wait for (blocking or async).
pub struct Ticket<T>(oneshot::Receiver<Result<T, String>>);

impl<T> Ticket<T> {
    /// Waits on this (non-async) thread.
    pub fn wait(self) -> Result<T, String> {
        self.0
            .blocking_recv()
            .unwrap_or_else(|_| Err(STOPPED.to_string()))
    }

    /// Waits in an async task.
    pub async fn recv(self) -> Result<T, String> {
        self.0.await.unwrap_or_else(|_| Err(STOPPED.to_string()))
    }
}

const STOPPED: &str = "the encoder pool stopped before encoding this segment";

impl EncoderPool {
    /// `threads` workers (0: every submit runs on the caller's thread).
    pub fn new(threads: usize) -> std::io::Result<EncoderPool> {
        if threads == 0 {
            return Ok(EncoderPool {
                queue: None,
                workers: Vec::new(),
            });
        }
        let (queue, jobs) = sync_channel::<Task>(threads);
        let jobs = Arc::new(Mutex::new(jobs));
        let workers = (0..threads)
            .map(|i| {
                let jobs = Arc::clone(&jobs);
                std::thread::Builder::new()
                    .name(format!("encoder-{i}"))
                    .spawn(move || work(&jobs))
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(EncoderPool {
            queue: Some(queue),
            workers,
        })
    }

    /// Worker threads (0: the caller's thread encodes).
    pub fn threads(&self) -> usize {
        self.workers.len()
    }

    /// Runs `work` on a worker, waiting while the queue is full, or here when the pool has no
    /// threads. Its result (or its panic's message) arrives on the ticket.
    pub fn submit<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Ticket<T> {
        let (done, ticket) = oneshot::channel();
        let task: Task = Box::new(move || {
            let result = catch_unwind(AssertUnwindSafe(work)).map_err(|panic| {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "no message".into());
                format!("the encoder panicked: {message}")
            });
            // The ticket's holder may be gone (its request ended): nothing to tell.
            let _ = done.send(result);
        });
        match &self.queue {
            None => task(),
            // A send fails only when every worker is gone, which cannot happen while the pool
            // lives (workers end when the queue closes); the dropped task then fails its ticket.
            Some(queue) => {
                let _ = queue.send(task);
            }
        }
        Ticket(ticket)
    }
}

fn work(jobs: &Mutex<Receiver<Task>>) {
    loop {
        // The lock is held only while taking the next task; a poisoned lock cannot happen (no
        // task runs under it), and would still hold a usable receiver.
        let next = jobs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .recv();
        match next {
            Ok(task) => task(),
            Err(_) => return, // the pool was dropped
        }
    }
}

impl Drop for EncoderPool {
    fn drop(&mut self) {
        self.queue = None; // workers finish the queued tasks, then see the closed queue
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[test]
    fn tickets_resolve_in_any_order_and_are_read_in_issue_order() {
        let pool = EncoderPool::new(3).unwrap();
        // Later tasks finish first: the reader still gets them in issue order.
        let tickets: Vec<_> = (0..6u64)
            .map(|i| {
                pool.submit(move || {
                    std::thread::sleep(Duration::from_millis(60 - 10 * i));
                    i
                })
            })
            .collect();
        let got: Vec<u64> = tickets.into_iter().map(|t| t.wait().unwrap()).collect();
        assert_eq!(got, vec![0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn no_threads_runs_on_the_caller() {
        let pool = EncoderPool::new(0).unwrap();
        let caller = std::thread::current().id();
        let ticket = pool.submit(move || std::thread::current().id() == caller);
        assert!(ticket.wait().unwrap());
    }

    #[test]
    fn a_panic_fails_its_ticket_and_the_worker_goes_on() {
        let pool = EncoderPool::new(1).unwrap();
        let bad = pool.submit(|| -> u32 { panic!("broken frame") });
        let good = pool.submit(|| 7u32);
        let err = bad.wait().unwrap_err();
        assert!(err.contains("broken frame"), "{err}");
        assert_eq!(good.wait().unwrap(), 7);
    }

    #[test]
    fn the_queue_is_bounded() {
        // One worker held busy, one slot in the queue: the third submit waits for the worker.
        let pool = Arc::new(EncoderPool::new(1).unwrap());
        let (release, hold) = std::sync::mpsc::channel::<()>();
        let hold = Mutex::new(hold);
        let _busy = pool.submit(move || hold.lock().unwrap().recv().ok());
        let _queued = pool.submit(|| None::<()>);
        let submitted = Arc::new(AtomicUsize::new(0));
        let (p, s) = (Arc::clone(&pool), Arc::clone(&submitted));
        let third = std::thread::spawn(move || {
            let t = p.submit(|| None::<()>);
            s.fetch_add(1, Ordering::SeqCst);
            t.wait()
        });
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            submitted.load(Ordering::SeqCst),
            0,
            "the third submit did not wait"
        );
        release.send(()).unwrap();
        third.join().unwrap().unwrap();
        assert_eq!(submitted.load(Ordering::SeqCst), 1);
    }
}
