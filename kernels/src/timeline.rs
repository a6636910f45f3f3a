//! Where the time of a real run goes, op by op: a model calls [`mark`] after each of its ops, and
//! [`record`] runs a closure (a forward, a step) with those marks turned into points on the
//! device's timeline, a CUDA event on the GPU's one stream (on the CPU, the clock, the ops being
//! synchronous there). The time between two points is the op marked at the second, queue gaps and
//! launch latency included, so the intervals add up to the closure's GPU time and nothing is
//! left unattributed.
//!
//! Why in the run, not op by op alone: a GPU held at full load runs power-limited (an H200 at
//! 650–700 W, 1.53–1.70 GHz against 1.98 GHz idle), and ops timed alone in short bursts run at
//! other clocks and with other caches than inside a forward, so a forward's time minus the sum of its
//! ops timed alone says little about what is left.
//!
//! Off unless [`record`] is running on the calling thread: then a mark is one event record (~2 µs of
//! host time, nothing the GPU waits for); otherwise it is one thread-local read. Each thread records
//! its own timeline (a parallel rank's thread, its rank's).

use std::cell::RefCell;
use std::time::Instant;

use crate::{Device, KernelError, Result};

/// One point of a timeline.
enum Point {
    #[cfg(feature = "cuda")]
    Cuda(cudarc::driver::CudaEvent),
    Cpu(Instant),
}

/// A recorded timeline: each interval's label (the mark that ended it) and seconds, in order.
pub type Intervals = Vec<(&'static str, f64)>;

/// The timeline being recorded on this thread.
struct Recording {
    device: Device,
    points: Vec<(&'static str, Point)>,
}

thread_local! {
    static RECORDING: RefCell<Option<Recording>> = const { RefCell::new(None) };
}

/// A point on `device` now: an event on its stream, or the clock.
fn point(device: Device) -> Result<Point> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => {
            let backend = crate::cuda::CudaBackend::get(ordinal)?;
            let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
            let event = backend
                .stream
                .record_event(flags)
                .map_err(|e| backend.err("timeline", "cuEventRecord", e))?;
            Ok(Point::Cuda(event))
        }
        _ => Ok(Point::Cpu(Instant::now())),
    }
}

/// Ends the op `label` on this thread's timeline, if one is being recorded (else nothing).
/// Labels name what ran since the previous mark; the same label may close many intervals (every
/// block's self-attention), and [`record`] reports each interval in order.
pub fn mark(label: &'static str) {
    RECORDING.with(|r| {
        if let Some(rec) = r.borrow_mut().as_mut() {
            // A failed event record loses one point (the interval joins the next); it must not fail
            // the op being timed.
            if let Ok(p) = point(rec.device) {
                rec.points.push((label, p));
            }
        }
    });
}

/// Runs `f` with this thread's [`mark`]s recorded on `device`, then waits for the device and
/// returns `f`'s result and the intervals in order: (label, seconds). The time after the last mark
/// is reported as `"unmarked"`. Not re-entrant: a `record` inside `f` is an error.
pub fn record<T, E: From<KernelError>>(
    device: Device,
    f: impl FnOnce() -> std::result::Result<T, E>,
) -> std::result::Result<(T, Intervals), E> {
    let busy = RECORDING.with(|r| r.borrow().is_some());
    if busy {
        return Err(KernelError::arg(
            "timeline::record",
            "f",
            "a nested record",
            "one timeline is recorded per thread at a time",
        )
        .into());
    }
    let start = point(device)?;
    RECORDING.with(|r| {
        *r.borrow_mut() = Some(Recording {
            device,
            points: vec![("start", start)],
        })
    });
    // Ends the recording however `f` ends: a panic unwinding through here must not leave this
    // thread recording (every later mark would then pile up, and every later record be refused).
    struct Stop;
    impl Drop for Stop {
        fn drop(&mut self) {
            RECORDING.with(|r| r.borrow_mut().take());
        }
    }
    let stop = Stop;
    let out = f();
    mark("unmarked");
    let points = RECORDING
        .with(|r| r.borrow_mut().take())
        .map(|rec| rec.points)
        .unwrap_or_default();
    drop(stop);
    let out = out?;
    let mut intervals = Vec::with_capacity(points.len());
    for pair in points.windows(2) {
        let secs = match (&pair[0].1, &pair[1].1) {
            #[cfg(feature = "cuda")]
            (Point::Cuda(a), Point::Cuda(b)) => {
                let ms = a.elapsed_ms(b).map_err(|e| {
                    E::from(KernelError::Cuda {
                        op: "timeline",
                        call: "cuEventElapsedTime",
                        device,
                        detail: format!("{e:?}"),
                    })
                })?;
                f64::from(ms) / 1e3
            }
            (Point::Cpu(a), Point::Cpu(b)) => b.duration_since(*a).as_secs_f64(),
            #[cfg(feature = "cuda")]
            _ => unreachable!("one device per recording"),
        };
        intervals.push((pair[1].0, secs));
    }
    Ok((out, intervals))
}

/// Sums `intervals` per label, in the order labels first appear.
pub fn totals(intervals: &[(&'static str, f64)]) -> Vec<(&'static str, f64, usize)> {
    let mut out: Vec<(&'static str, f64, usize)> = Vec::new();
    for &(label, secs) in intervals {
        match out.iter_mut().find(|(l, _, _)| *l == label) {
            Some((_, total, n)) => {
                *total += secs;
                *n += 1;
            }
            None => out.push((label, secs, 1)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_outside_a_recording_are_ignored_and_intervals_add_up() -> Result<()> {
        mark("nothing records this");
        let t0 = Instant::now();
        let (v, intervals) = record(Device::Cpu, || -> Result<i32> {
            std::thread::sleep(std::time::Duration::from_millis(5));
            mark("a");
            std::thread::sleep(std::time::Duration::from_millis(2));
            mark("b");
            mark("a");
            Ok(7)
        })?;
        let wall = t0.elapsed().as_secs_f64();
        assert_eq!(v, 7);
        let labels: Vec<_> = intervals.iter().map(|(l, _)| *l).collect();
        assert_eq!(labels, ["a", "b", "a", "unmarked"]);
        assert!(intervals[0].1 >= 0.005 && intervals[1].1 >= 0.002);
        let sum: f64 = intervals.iter().map(|(_, s)| s).sum();
        assert!(sum <= wall && sum >= 0.007);
        let t = totals(&intervals);
        assert_eq!(t[0].0, "a");
        assert_eq!(t[0].2, 2);
        assert_eq!(t[1], ("b", intervals[1].1, 1));
        // Nothing is left recording: a later mark is ignored and a new record starts clean.
        mark("after");
        let (_, again) = record(Device::Cpu, || Ok::<_, KernelError>(()))?;
        assert_eq!(again.len(), 1);
        Ok(())
    }

    #[test]
    fn a_nested_record_is_refused_and_an_error_or_a_panic_still_ends_the_recording() {
        let nested: Result<_> = record(Device::Cpu, || {
            record(Device::Cpu, || Ok::<_, KernelError>(())).map(drop)
        });
        assert!(nested.is_err());
        let failed: Result<((), _)> = record(Device::Cpu, || {
            Err(KernelError::arg("test", "x", 1, "fails"))
        });
        assert!(failed.is_err());
        assert!(record(Device::Cpu, || Ok::<_, KernelError>(())).is_ok());
        // A panic inside the recording ends it too.
        let panicked = std::panic::catch_unwind(|| {
            let _ = record(Device::Cpu, || -> Result<()> {
                panic!("inside the recording")
            });
        });
        assert!(panicked.is_err());
        assert!(RECORDING.with(|r| r.borrow().is_none()));
        assert!(record(Device::Cpu, || Ok::<_, KernelError>(())).is_ok());
    }
}
