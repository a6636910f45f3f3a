//! The collective suite on the CPU backend (ranks are threads): every operation on every
//! group layout for worlds of 1–8 ranks, plus the failure semantics: an erroring, vanishing,
//! panicking or absent rank makes every other rank of its group return an error, in bounded time.

mod suite;

use std::time::{Duration, Instant};

use ditstream_common::collectives::cpu::CpuWorld;
use ditstream_common::collectives::{CollectiveError, CommWorld, Communicator, Pending, ReduceOp};

/// Generous for a loaded 2-core CI box; the failure tests below finish far sooner because a
/// failing rank poisons its group at once.
const SUITE_TIMEOUT: Duration = Duration::from_secs(30);

#[test]
fn every_op_every_layout_worlds_1_to_8() {
    for n in 1..=8 {
        for (name, groups) in suite::group_layouts(n) {
            let world = CpuWorld::new(n).with_timeout(SUITE_TIMEOUT);
            let results = world.run(|rank| -> Result<bool, String> {
                let Some(comm) = rank.split(&groups).map_err(|e| e.to_string())? else {
                    return Ok(false);
                };
                suite::check_group(&comm, 1000 + n as u64).map(|()| true)
            });
            let mut members = 0;
            for (r, res) in results.into_iter().enumerate() {
                match res {
                    Ok(Ok(member)) => members += usize::from(member),
                    Ok(Err(e)) => panic!("world {n}, layout {name}, rank {r}: {e}"),
                    Err(p) => panic!("world {n}, layout {name}, rank {r} panicked: {p}"),
                }
            }
            let expected: usize = groups.iter().map(Vec::len).sum();
            assert_eq!(members, expected, "world {n}, layout {name}");
        }
    }
}

#[test]
fn groups_can_be_used_concurrently_and_recreated() {
    // Two overlapping families of groups (rows and columns of a 2×4 grid) used in interleaved
    // order, then dropped and created again.
    let world = CpuWorld::new(8).with_timeout(SUITE_TIMEOUT);
    let results = world.run(|rank| -> Result<(), String> {
        for round in 0..2u64 {
            let rows = rank
                .split(&[vec![0, 1, 2, 3], vec![4, 5, 6, 7]])
                .map_err(|e| e.to_string())?
                .ok_or("not in a row")?;
            let cols = rank
                .split(&[vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]])
                .map_err(|e| e.to_string())?
                .ok_or("not in a column")?;
            suite::check_group(&rows, 7 + round)?;
            suite::check_group(&cols, 8 + round)?;
            let mut x = [rank.rank() as f32];
            rows.all_reduce_in_place(&mut x, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            cols.all_reduce_in_place(&mut x, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            if x[0] != 28.0 {
                return Err(format!("sum over rows then columns = {}, want 28", x[0]));
            }
        }
        Ok(())
    });
    for (r, res) in results.into_iter().enumerate() {
        assert!(matches!(res, Ok(Ok(()))), "rank {r}: {res:?}");
    }
}

/// Runs `f` on every rank of a world of `n` with a short timeout; returns each rank's result
/// and the wall time.
/// Each rank's outcome: `Err(panic message)` or the closure's result.
type RankOutcomes = Vec<Result<Result<(), CollectiveError>, String>>;

fn run_failing<F>(n: usize, timeout: Duration, f: F) -> (RankOutcomes, Duration)
where
    F: Fn(usize, ditstream_common::collectives::cpu::CpuComm) -> Result<(), CollectiveError> + Sync,
{
    let world = CpuWorld::new(n).with_timeout(timeout);
    let start = Instant::now();
    let out = world.run(|rank| {
        let comm = rank.group(&(0..n).collect::<Vec<_>>())?;
        f(rank.rank(), comm)
    });
    (out, start.elapsed())
}

fn gather(comm: &ditstream_common::collectives::cpu::CpuComm) -> Result<(), CollectiveError> {
    let send = [comm.rank() as f32; 4];
    let mut recv = vec![0.0; 4 * comm.size()];
    comm.all_gather(&send, &mut recv)
}

#[test]
fn a_rank_that_errors_fails_every_rank() {
    let (out, elapsed) = run_failing(4, Duration::from_secs(20), |rank, comm| {
        gather(&comm)?;
        if rank == 2 {
            // Wrong recv length: a local argument error.
            let mut recv = vec![0.0f32; 3];
            comm.all_gather(&[1.0f32; 4], &mut recv)
        } else {
            gather(&comm)
        }
    });
    assert!(
        matches!(out[2], Ok(Err(CollectiveError::LengthMismatch { .. }))),
        "{:?}",
        out[2]
    );
    for r in [0, 1, 3] {
        assert!(
            matches!(out[r], Ok(Err(CollectiveError::Poisoned { .. }))),
            "rank {r}: {:?}",
            out[r]
        );
    }
    assert!(
        elapsed < Duration::from_secs(10),
        "took {elapsed:?}: waited for the timeout"
    );
}

#[test]
fn a_rank_that_drops_its_communicator_fails_every_rank() {
    let (out, elapsed) = run_failing(3, Duration::from_secs(20), |rank, comm| {
        gather(&comm)?;
        if rank == 0 {
            drop(comm);
            return Ok(());
        }
        gather(&comm)
    });
    assert!(matches!(out[0], Ok(Ok(()))));
    for r in [1, 2] {
        let msg = format!("{:?}", out[r]);
        assert!(
            msg.contains("Poisoned") && msg.contains("dropped"),
            "rank {r}: {msg}"
        );
    }
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
}

#[test]
fn a_rank_that_panics_fails_every_rank() {
    let (out, elapsed) = run_failing(4, Duration::from_secs(20), |rank, comm| {
        gather(&comm)?;
        if rank == 3 {
            panic!("rank 3 exploded on purpose");
        }
        gather(&comm)?;
        gather(&comm)
    });
    assert!(
        matches!(&out[3], Err(m) if m.contains("exploded")),
        "{:?}",
        out[3]
    );
    for (r, res) in out.iter().enumerate().take(3) {
        let msg = format!("{res:?}");
        assert!(
            msg.contains("Poisoned") && msg.contains("panicked"),
            "rank {r}: {msg}"
        );
    }
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
}

#[test]
fn a_rank_that_never_arrives_times_out_every_rank() {
    let timeout = Duration::from_millis(300);
    let (out, elapsed) = run_failing(3, timeout, |rank, comm| {
        if rank == 1 {
            // Holds its communicator but does not call; then calls too late.
            std::thread::sleep(Duration::from_millis(800));
            return gather(&comm);
        }
        gather(&comm)
    });
    let timeouts = out
        .iter()
        .filter(|r| matches!(r, Ok(Err(CollectiveError::Timeout { .. }))))
        .count();
    assert!(timeouts >= 1, "{out:?}");
    for (r, res) in out.iter().enumerate() {
        assert!(
            matches!(
                res,
                Ok(Err(
                    CollectiveError::Timeout { .. } | CollectiveError::Poisoned { .. }
                ))
            ),
            "rank {r}: {res:?}"
        );
    }
    assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}");
}

#[test]
fn a_member_that_never_joins_times_out() {
    let world = CpuWorld::new(2).with_timeout(Duration::from_millis(200));
    let start = Instant::now();
    let out = world.run(|rank| {
        if rank.rank() == 1 {
            return Ok(());
        }
        let comm = rank.group(&[0, 1])?;
        comm.barrier()
    });
    assert!(
        matches!(out[0], Ok(Err(CollectiveError::Timeout { .. }))),
        "{:?}",
        out[0]
    );
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn mismatched_operations_fail_every_rank() {
    let (out, _) = run_failing(3, Duration::from_secs(20), |rank, comm| {
        if rank == 1 {
            comm.barrier()
        } else {
            gather(&comm)
        }
    });
    for (r, res) in out.iter().enumerate() {
        assert!(
            matches!(
                res,
                Ok(Err(
                    CollectiveError::Mismatch { .. } | CollectiveError::Poisoned { .. }
                ))
            ),
            "rank {r}: {res:?}"
        );
    }
    // Differing element types or sizes of the same operation are a mismatch too.
    let (out, _) = run_failing(2, Duration::from_secs(20), |rank, comm| {
        let mut recv = vec![0u8; 2 * (rank + 1)];
        comm.all_gather(&vec![1u8; rank + 1], &mut recv)
    });
    assert!(out.iter().all(|r| matches!(r, Ok(Err(_)))), "{out:?}");
}

#[test]
fn inconsistent_all_to_all_v_counts_fail_every_rank() {
    let (out, _) = run_failing(2, Duration::from_secs(20), |rank, comm| {
        // Rank 0 sends 2 to rank 1, but rank 1 expects 3.
        let (send_counts, recv_counts) = if rank == 0 {
            ([1, 2], [1, 1])
        } else {
            ([1, 1], [3, 1])
        };
        let send = vec![0f32; send_counts.iter().sum()];
        let mut recv = vec![0f32; recv_counts.iter().sum()];
        comm.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts)
    });
    assert!(out.iter().all(|r| matches!(r, Ok(Err(_)))), "{out:?}");
    assert!(format!("{out:?}").contains("expects 3"), "{out:?}");
}

#[test]
fn a_missing_send_times_out_the_receiver() {
    let (out, elapsed) = run_failing(2, Duration::from_millis(200), |rank, comm| {
        let send = [1.0f32; 4];
        let mut recv = [0.0f32; 4];
        if rank == 0 {
            let pending = comm.send_recv(&send, 1, &mut recv, 1)?;
            pending.wait()
        } else {
            // Rank 1 never posts its send; it waits long enough for rank 0 to time out.
            std::thread::sleep(Duration::from_millis(600));
            Ok(())
        }
    });
    assert!(
        matches!(out[0], Ok(Err(CollectiveError::Timeout { .. }))),
        "{:?}",
        out[0]
    );
    assert!(elapsed < Duration::from_secs(5));
}

#[test]
fn a_posted_all_to_all_does_not_wait_for_its_peers() {
    // Rank 1 posts its all-to-all only after it has received a token that rank 0 sends, over a
    // second group of the same ranks, after posting its own: if posting waited for the peers,
    // the two would deadlock (and time out).
    let world = CpuWorld::new(2).with_timeout(Duration::from_secs(20));
    let out = world.run(|rank| -> Result<[f32; 4], CollectiveError> {
        let comm = rank.group(&[0, 1])?;
        let side = rank.group(&[0, 1])?;
        let send = [rank.rank() as f32 + 1.0; 4];
        let mut recv = [0.0f32; 4];
        let (mut token, mut nothing) = ([0.0f32], [0.0f32; 0]);
        if rank.rank() == 0 {
            let posted = comm.all_to_all_posted(&send, &mut recv)?;
            side.send_recv(&[7.0], 1, &mut nothing, 1)?.wait()?;
            posted.wait()?;
        } else {
            side.send_recv(&[], 0, &mut token, 0)?.wait()?;
            assert_eq!(token, [7.0]);
            comm.all_to_all_posted(&send, &mut recv)?.wait()?;
        }
        Ok(recv)
    });
    // Chunk i came from rank i, which sent rank + 1 everywhere.
    for res in out {
        assert!(matches!(res, Ok(Ok([1.0, 1.0, 2.0, 2.0]))), "{res:?}");
    }
}

#[test]
fn poisoned_group_fails_fast_afterwards() {
    let (out, _) = run_failing(2, Duration::from_secs(20), |rank, comm| {
        if rank == 0 {
            let _ = comm.broadcast(&mut [0f32; 2], 7); // root out of range: poisons
            let start = Instant::now();
            let again = comm.barrier();
            assert!(start.elapsed() < Duration::from_secs(1));
            again
        } else {
            comm.barrier()
        }
    });
    assert!(
        out.iter()
            .all(|r| matches!(r, Ok(Err(CollectiveError::Poisoned { .. })))),
        "{out:?}"
    );
}

#[test]
fn ulysses_rejects_heads_not_divisible() {
    use ditstream_common::collectives::{UlyssesExt, UlyssesShape};
    let (out, _) = run_failing(2, Duration::from_secs(20), |_, comm| {
        let shape = UlyssesShape::bshd(1, 2, 3, 4);
        let input = vec![0f32; shape.numel()];
        let (mut o, mut s) = (input.clone(), input.clone());
        comm.seq_to_heads(&input, &mut o, &mut s, shape)
    });
    for res in &out {
        assert!(
            matches!(
                res,
                Ok(Err(CollectiveError::HeadsNotDivisible {
                    heads: 3,
                    size: 2
                }))
            ),
            "{res:?}"
        );
    }
}
