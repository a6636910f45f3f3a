//! The collective suite on real GPUs through NCCL (feature `cuda`), one thread per GPU: the same
//! body as the CPU run (`suite/mod.rs`) on every group layout of every world size up to the
//! visible GPU count, plus a timeout test (a rank that never arrives fails the other in bounded
//! time). Tests skip, with a line on stderr, when too few GPUs are visible, unless
//! `DITSTREAM_REQUIRE_GPUS=N` says N GPUs are required: then a shortfall (or missing
//! CUDA/NCCL) is a failure. `scripts/gpu-collectives.sh` sets it.
#![cfg(feature = "cuda")]

mod suite;

use std::time::{Duration, Instant};

use ditstream_common::collectives::nccl::{self, NcclWorld};
use ditstream_common::collectives::{CollectiveError, CommWorld, Communicator};

/// Returns the number of visible GPUs if at least `needed`, `None` to skip; panics when
/// `DITSTREAM_REQUIRE_GPUS` demands more than are usable.
fn gpus(needed: usize, test: &str) -> Option<usize> {
    let required: Option<usize> = std::env::var("DITSTREAM_REQUIRE_GPUS").ok().map(|v| {
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("DITSTREAM_REQUIRE_GPUS={v:?} is not a number"))
    });
    let found = match nccl::device_count() {
        Ok(n) => n,
        Err(e) => {
            if let Some(req) = required.filter(|&r| r > 0) {
                panic!("DITSTREAM_REQUIRE_GPUS={req} but CUDA/NCCL is unusable: {e}");
            }
            eprintln!("SKIP {test}: CUDA/NCCL unusable: {e}");
            return None;
        }
    };
    if let Some(req) = required {
        assert!(
            found >= req,
            "DITSTREAM_REQUIRE_GPUS={req} but only {found} GPUs are visible"
        );
    }
    if found < needed {
        eprintln!("SKIP {test}: needs {needed} GPUs, {found} visible");
        return None;
    }
    Some(found)
}

#[test]
fn every_op_every_layout_on_all_gpus() {
    let Some(found) = gpus(1, "every_op_every_layout_on_all_gpus") else {
        return;
    };
    for n in 1..=found.min(8) {
        let start = Instant::now();
        let layouts = suite::group_layouts(n);
        let results = NcclWorld::run_local(
            n,
            Duration::from_secs(60),
            |world| -> Result<usize, String> {
                let mut checked = 0;
                for (name, groups) in &layouts {
                    let comm = world
                        .split(groups)
                        .map_err(|e| format!("split {name}: {e}"))?;
                    if let Some(comm) = comm {
                        suite::check_group(&comm, 2000 + n as u64)
                            .map_err(|e| format!("layout {name}: {e}"))?;
                        checked += 1;
                    }
                }
                Ok(checked)
            },
        )
        .unwrap_or_else(|e| panic!("world of {n} GPUs: {e}"));
        for (r, res) in results.iter().enumerate() {
            match res {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => panic!("world {n}, rank {r}: {e}"),
                Err(e) => panic!("world {n}, rank {r} failed to start: {e}"),
            }
        }
        eprintln!(
            "NCCL suite: world of {n} GPUs, {} layouts, all ops passed in {:.1?}",
            layouts.len(),
            start.elapsed()
        );
    }
}

#[test]
fn a_rank_that_never_arrives_times_out_the_other() {
    let Some(_) = gpus(2, "a_rank_that_never_arrives_times_out_the_other") else {
        return;
    };
    let timeout = Duration::from_secs(3);
    let results = NcclWorld::run_local(2, timeout, |world| -> Result<(), CollectiveError> {
        let comm = world
            .split(&[vec![0, 1]])?
            .ok_or_else(|| CollectiveError::NotInGroup {
                rank: world.rank(),
                ranks: vec![0, 1],
            })?;
        comm.barrier()?;
        if world.rank() == 1 {
            // Rank 1 skips the all-reduce; rank 0 must time out and abort, not hang.
            std::thread::sleep(timeout * 2);
            return Ok(());
        }
        let mut buf = comm.alloc::<f32>(1024)?;
        let start = Instant::now();
        let out = comm.all_reduce_in_place(&mut buf, ditstream_common::collectives::ReduceOp::Sum);
        assert!(start.elapsed() < timeout * 3, "took {:?}", start.elapsed());
        match out {
            Err(CollectiveError::Timeout { .. }) => {}
            other => panic!("rank 0 expected a timeout, got {other:?}"),
        }
        // The communicator is aborted now: further use fails at once.
        assert!(matches!(
            comm.barrier(),
            Err(CollectiveError::Poisoned { .. })
        ));
        Ok(())
    })
    .unwrap_or_else(|e| panic!("{e}"));
    for (r, res) in results.iter().enumerate() {
        assert!(matches!(res, Ok(Ok(()))), "rank {r}: {res:?}");
    }
}

#[test]
fn nccl_id_round_trips_through_bytes() {
    let Some(_) = gpus(1, "nccl_id_round_trips_through_bytes") else {
        return;
    };
    let id = nccl::NcclId::new().unwrap_or_else(|e| panic!("{e}"));
    let back = nccl::NcclId::from_bytes(id.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(id, back);
    assert!(nccl::NcclId::from_bytes(&[0u8; 12]).is_err());
}
