//! The start-up exchange on loopback: real child processes (this test binary re-executed with
//! `DITSTREAM_RDZV_CHILD=1`, which selects the child role in [`child_role`]), threads, and the
//! failure paths (a missing rank, no rank 0) that must end in an error within the timeout.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ditstream_common::rendezvous::{LaunchEnv, LaunchSource, Rendezvous, RendezvousError};

const CHILD_VAR: &str = "DITSTREAM_RDZV_CHILD";

/// The 128-byte blob rank 0 serves (stands in for the NCCL unique id).
fn id_blob() -> Vec<u8> {
    (0..128u32).map(|i| (i * 7 + 3) as u8).collect()
}

fn host_message(rank: usize, round: usize) -> Vec<u8> {
    format!("host-of-rank-{rank}-round-{round}").into_bytes()
}

/// Two rounds, as a real start-up does: the NCCL id plus hostnames, then a second exchange.
fn play(env: &LaunchEnv, rdzv: &mut Rendezvous) -> Result<(), String> {
    for round in 0..2 {
        let blob = (env.rank == 0).then(id_blob);
        let out = rdzv
            .exchange(blob.as_deref(), &host_message(env.rank, round))
            .map_err(|e| format!("rank {} round {round}: {e}", env.rank))?;
        if out.blob != id_blob() {
            return Err(format!("rank {} round {round}: wrong blob", env.rank));
        }
        let want: Vec<Vec<u8>> = (0..env.world_size)
            .map(|r| host_message(r, round))
            .collect();
        if out.per_rank != want {
            return Err(format!(
                "rank {} round {round}: wrong per-rank messages",
                env.rank
            ));
        }
    }
    Ok(())
}

/// The child role. In a normal test run the variable is absent and this returns at once.
#[test]
fn child_role() {
    if std::env::var_os(CHILD_VAR).is_none() {
        return;
    }
    let env = LaunchEnv::from_env().expect("child launch env");
    let mut rdzv =
        Rendezvous::with_timeout(&env, Duration::from_secs(30)).expect("child rendezvous");
    match play(&env, &mut rdzv) {
        Ok(()) => println!("CHILD_OK rank {}", env.rank),
        Err(e) => panic!("{e}"),
    }
}

fn spawn_child(rank: usize, world_size: usize, port: u16, source: LaunchSource) -> Child {
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", "child_role", "--nocapture", "--test-threads=1"])
        .env(CHILD_VAR, "1")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
    ] {
        cmd.env_remove(var);
    }
    match source {
        LaunchSource::Torch => cmd
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_RANK", rank.to_string()),
        LaunchSource::Slurm => cmd
            .env("SLURM_PROCID", rank.to_string())
            .env("SLURM_NTASKS", world_size.to_string())
            .env("SLURM_LOCALID", "0"),
    };
    cmd.spawn().expect("spawn child rank")
}

/// Waits for a child with a deadline; kills it (by its own handle) if it overruns.
fn wait_child(mut child: Child, deadline: Instant) -> (bool, String) {
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                break;
            }
        }
    }
    match child.wait_with_output() {
        Ok(out) => (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        ),
        Err(e) => (false, e.to_string()),
    }
}

fn rank0_env(world_size: usize, port: u16) -> LaunchEnv {
    LaunchEnv {
        rank: 0,
        world_size,
        local_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        source: LaunchSource::Torch,
    }
}

fn processes(world_size: usize, source: LaunchSource) {
    // This process is rank 0 on a port the OS picks; the children learn it from MASTER_PORT.
    let env = rank0_env(world_size, 0);
    let mut rdzv = Rendezvous::with_timeout(&env, Duration::from_secs(30)).expect("rank 0 bind");
    let port = rdzv.local_port().expect("rank 0 port");
    let children: Vec<Child> = (1..world_size)
        .map(|r| spawn_child(r, world_size, port, source))
        .collect();
    let ours = play(&env, &mut rdzv);
    let deadline = Instant::now() + Duration::from_secs(60);
    for (i, child) in children.into_iter().enumerate() {
        let (ok, output) = wait_child(child, deadline);
        assert!(
            ok && output.contains("CHILD_OK"),
            "child rank {} failed:\n{output}",
            i + 1
        );
    }
    ours.expect("rank 0");
}

#[test]
fn four_processes_exchange_the_id_and_hostnames() {
    processes(4, LaunchSource::Torch);
}

#[test]
fn slurm_variables_work_across_processes() {
    processes(3, LaunchSource::Slurm);
}

#[test]
fn eight_ranks_as_threads() {
    let world_size = 8;
    let mut rank0 =
        Rendezvous::with_timeout(&rank0_env(world_size, 0), Duration::from_secs(30)).expect("bind");
    let port = rank0.local_port().expect("port");
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = (1..world_size)
            .map(|rank| {
                s.spawn(move || {
                    let env = LaunchEnv {
                        rank,
                        ..rank0_env(world_size, port)
                    };
                    let mut rdzv = Rendezvous::with_timeout(&env, Duration::from_secs(30))
                        .map_err(|e| e.to_string())?;
                    play(&env, &mut rdzv)
                })
            })
            .collect();
        let ours = play(&rank0_env(world_size, port), &mut rank0);
        let mut all = vec![ours];
        all.extend(
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("panicked".into()))),
        );
        all
    });
    for (r, res) in results.iter().enumerate() {
        assert!(res.is_ok(), "rank {r}: {res:?}");
    }
}

#[test]
fn a_missing_rank_fails_rank_0_and_the_others_in_time() {
    let world_size = 3;
    let timeout = Duration::from_millis(500);
    let mut rank0 = Rendezvous::with_timeout(&rank0_env(world_size, 0), timeout).expect("bind");
    let port = rank0.local_port().expect("port");
    let start = Instant::now();
    let (r0, r1) = std::thread::scope(|s| {
        let one = s.spawn(move || {
            let env = LaunchEnv {
                rank: 1,
                ..rank0_env(world_size, port)
            };
            Rendezvous::with_timeout(&env, Duration::from_secs(5))
                .and_then(|mut r| r.all_gather(b"one"))
        });
        // Rank 2 never shows up.
        let r0 = rank0.all_gather(b"zero");
        (r0, one.join().expect("rank 1 thread"))
    });
    match r0 {
        Err(RendezvousError::Incomplete {
            missing,
            arrived: 2,
            ..
        }) => assert_eq!(missing, vec![2]),
        other => panic!("rank 0: {other:?}"),
    }
    assert!(
        matches!(r1, Err(RendezvousError::Aborted { .. })),
        "rank 1: {r1:?}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "took {:?}",
        start.elapsed()
    );
}

#[test]
fn no_rank_0_is_a_connect_error_naming_the_address() {
    // A port nobody listens on: bind one, note it, close it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port");
    let env = LaunchEnv {
        rank: 1,
        ..rank0_env(2, port)
    };
    let start = Instant::now();
    let err = Rendezvous::with_timeout(&env, Duration::from_millis(300))
        .and_then(|mut r| r.broadcast(None))
        .expect_err("nobody listens");
    assert!(
        matches!(err, RendezvousError::Connect { rank: 1, .. }),
        "{err:?}"
    );
    assert!(
        err.to_string().contains(&format!("127.0.0.1:{port}")),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(3));
}
