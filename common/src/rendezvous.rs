//! Multi-process start-up: who am I ([`LaunchEnv`], from `MASTER_ADDR`, `MASTER_PORT`,
//! `WORLD_SIZE`, `RANK`, `LOCAL_RANK` or Slurm's `SLURM_PROCID`, `SLURM_NTASKS`,
//! `SLURM_LOCALID`), and a small TCP exchange among the processes ([`Rendezvous`]): rank 0
//! listens on `MASTER_PORT` and, round by round, collects one message from every other rank
//! and answers each with a blob of its own (the 128-byte NCCL unique id, a config digest …)
//! plus every rank's message (hostnames, device lists …).
//!
//! Wire format of one round (all integers little-endian), one short TCP connection per rank:
//! ```text
//! rank → 0:  magic "DSRZ" | round u64 | rank u32 | world u32 | len u64 | bytes
//! 0 → rank:  magic "DSRZ" | round u64 | blob len u64 | blob | world × (len u64 | bytes)
//! ```
//! Every connect, accept, read and write is bounded by the rendezvous timeout: a missing or
//! dead rank turns into an error naming it, never a hang. std::net only (no async runtime).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// How long ranks wait for each other at start-up: other ranks may still be loading.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// Largest message a rank may send in one round; anything larger is treated as garbage.
const MAX_MESSAGE: u64 = 64 << 20;
const MAGIC: &[u8; 4] = b"DSRZ";

/// Errors of the start-up exchange. Each variant names the variable, address or rank at fault.
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    /// A required environment variable is not set.
    #[error("environment variable {name} is not set ({hint})")]
    MissingVar {
        /// Variable name.
        name: &'static str,
        /// What sets it.
        hint: &'static str,
    },
    /// An environment variable has a value that breaks its rule.
    #[error("environment variable {name}={value:?} is invalid: {rule}")]
    BadVar {
        /// Variable name.
        name: &'static str,
        /// Its value.
        value: String,
        /// The rule it breaks.
        rule: String,
    },
    /// rank ≥ world size (or local rank ≥ world size).
    #[error("{name}={rank} is out of range for a world of {world_size} ranks")]
    RankOutOfRange {
        /// The variable the rank came from.
        name: &'static str,
        /// The rank.
        rank: usize,
        /// The world size.
        world_size: usize,
    },
    /// The master address does not resolve.
    #[error("cannot resolve master address {addr:?}: {detail}")]
    Resolve {
        /// `host:port`.
        addr: String,
        /// Resolver error.
        detail: String,
    },
    /// Rank 0 cannot listen on the master port.
    #[error("rank 0 cannot listen on {addr}: {source}")]
    Bind {
        /// The address it tried.
        addr: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A rank could not reach rank 0 before the deadline.
    #[error(
        "rank {rank} could not reach rank 0 at {addr} within {after:?} (last error: {last_error})"
    )]
    Connect {
        /// The connecting rank.
        rank: usize,
        /// Rank 0's address.
        addr: String,
        /// How long it tried.
        after: Duration,
        /// The last connection error.
        last_error: String,
    },
    /// Rank 0 did not hear from every rank before the deadline.
    #[error(
        "rank 0 heard from {arrived} of {expected} ranks within {after:?} in round {round}; missing ranks {missing:?}"
    )]
    Incomplete {
        /// Round number.
        round: u64,
        /// Ranks that did connect (rank 0 counted).
        arrived: usize,
        /// World size.
        expected: usize,
        /// Ranks never heard from.
        missing: Vec<usize>,
        /// The timeout.
        after: Duration,
    },
    /// A read or write on an established connection failed (or timed out).
    #[error("rendezvous {what} failed: {source}")]
    Io {
        /// What was being done, with the peer.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A peer sent something that is not this protocol, or disagrees with us.
    #[error("rendezvous protocol error: {detail}")]
    Protocol {
        /// What was wrong.
        detail: String,
    },
    /// Rank 0 reported a failure of the round to this rank.
    #[error("rank 0 aborted round {round}: {reason}")]
    Aborted {
        /// Round number.
        round: u64,
        /// Rank 0's reason.
        reason: String,
    },
}

/// Result alias of the rendezvous.
pub type Result<T, E = RendezvousError> = std::result::Result<T, E>;

/// Where the rank and world size came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaunchSource {
    /// `RANK` / `WORLD_SIZE` / `LOCAL_RANK` (torchrun and friends, or set by hand).
    Torch,
    /// `SLURM_PROCID` / `SLURM_NTASKS` / `SLURM_LOCALID`.
    Slurm,
}

/// This process's place in a multi-process launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank of this process, `0..world_size`.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// Rank among the processes of this node (picks the first local GPU); 0 when unset.
    pub local_rank: usize,
    /// Host of rank 0 (`MASTER_ADDR`).
    pub master_addr: String,
    /// Port rank 0 listens on (`MASTER_PORT`).
    pub master_port: u16,
    /// Which variables were used.
    pub source: LaunchSource,
}

impl LaunchEnv {
    /// Reads the launch variables of this process.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the launch variables through `get` (tests pass a map). The torch-style names win;
    /// Slurm's are used only when `RANK` and `WORLD_SIZE` are both absent.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let torch = get("RANK").is_some() || get("WORLD_SIZE").is_some();
        let slurm = get("SLURM_PROCID").is_some();
        let (source, rank_var, world_var, local_var) = if torch || !slurm {
            (LaunchSource::Torch, "RANK", "WORLD_SIZE", "LOCAL_RANK")
        } else {
            (
                LaunchSource::Slurm,
                "SLURM_PROCID",
                "SLURM_NTASKS",
                "SLURM_LOCALID",
            )
        };
        let hint = "set by the launcher (torchrun, srun) or by hand";
        let required =
            |name: &'static str| get(name).ok_or(RendezvousError::MissingVar { name, hint });
        let number = |name: &'static str, value: String| {
            value
                .trim()
                .parse::<usize>()
                .map_err(|e| RendezvousError::BadVar {
                    name,
                    value: value.clone(),
                    rule: format!("must be a non-negative integer ({e})"),
                })
        };
        let world_size = number(world_var, required(world_var)?)?;
        if world_size == 0 {
            return Err(RendezvousError::BadVar {
                name: world_var,
                value: "0".into(),
                rule: "must be at least 1".into(),
            });
        }
        let rank = number(rank_var, required(rank_var)?)?;
        if rank >= world_size {
            return Err(RendezvousError::RankOutOfRange {
                name: rank_var,
                rank,
                world_size,
            });
        }
        let local_rank = match get(local_var) {
            Some(v) => number(local_var, v)?,
            None => 0,
        };
        if local_rank >= world_size {
            return Err(RendezvousError::RankOutOfRange {
                name: local_var,
                rank: local_rank,
                world_size,
            });
        }
        let master_addr = required("MASTER_ADDR")?;
        if master_addr.trim().is_empty() {
            return Err(RendezvousError::BadVar {
                name: "MASTER_ADDR",
                value: master_addr,
                rule: "must name rank 0's host".into(),
            });
        }
        let port_value = required("MASTER_PORT")?;
        let master_port =
            port_value
                .trim()
                .parse::<u16>()
                .map_err(|e| RendezvousError::BadVar {
                    name: "MASTER_PORT",
                    value: port_value.clone(),
                    rule: format!("must be a TCP port 0..=65535 ({e})"),
                })?;
        Ok(Self {
            rank,
            world_size,
            local_rank,
            master_addr: master_addr.trim().to_string(),
            master_port,
            source,
        })
    }
}

/// What one round delivers to every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exchange {
    /// Rank 0's blob.
    pub blob: Vec<u8>,
    /// Every rank's message, in rank order.
    pub per_rank: Vec<Vec<u8>>,
}

/// A rank's end of the start-up exchange. Rank 0 holds the listener for its lifetime, so
/// rounds never race a re-bind.
#[derive(Debug)]
pub struct Rendezvous {
    rank: usize,
    world_size: usize,
    master: String,
    timeout: Duration,
    listener: Option<TcpListener>,
    round: u64,
}

impl Rendezvous {
    /// Joins the rendezvous described by `env` with the default timeout. Rank 0 binds
    /// `0.0.0.0:MASTER_PORT` now; the others connect lazily in each round.
    pub fn new(env: &LaunchEnv) -> Result<Self> {
        Self::with_timeout(env, DEFAULT_RENDEZVOUS_TIMEOUT)
    }

    /// [`Rendezvous::new`] with another bound on every wait.
    pub fn with_timeout(env: &LaunchEnv, timeout: Duration) -> Result<Self> {
        let master = format!("{}:{}", env.master_addr, env.master_port);
        let listener = if env.rank == 0 {
            let bind = format!("0.0.0.0:{}", env.master_port);
            let listener = TcpListener::bind(&bind).map_err(|source| RendezvousError::Bind {
                addr: bind.clone(),
                source,
            })?;
            listener
                .set_nonblocking(true)
                .map_err(|source| RendezvousError::Io {
                    what: "set_nonblocking on the listener".into(),
                    source,
                })?;
            Some(listener)
        } else {
            None
        };
        Ok(Self {
            rank: env.rank,
            world_size: env.world_size,
            master,
            timeout,
            listener,
            round: 0,
        })
    }

    /// The port rank 0 actually listens on (useful with `MASTER_PORT=0` in tests); `None` on
    /// other ranks.
    pub fn local_port(&self) -> Option<u16> {
        self.listener
            .as_ref()
            .and_then(|l| l.local_addr().ok())
            .map(|a| a.port())
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of processes.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// One round: every rank contributes `mine`; rank 0 also contributes `blob` (ignored on
    /// other ranks; `None` on rank 0 means an empty blob). Every rank gets rank 0's blob and all
    /// messages in rank order.
    pub fn exchange(&mut self, blob: Option<&[u8]>, mine: &[u8]) -> Result<Exchange> {
        let round = self.round;
        self.round += 1;
        let span = tracing::debug_span!("rendezvous", rank = self.rank, round);
        let _enter = span.enter();
        if self.rank == 0 {
            self.serve(round, blob.unwrap_or(&[]), mine)
        } else {
            self.join(round, mine)
        }
    }

    /// Rank 0's `blob` to every rank (e.g. the NCCL unique id).
    pub fn broadcast(&mut self, blob: Option<&[u8]>) -> Result<Vec<u8>> {
        Ok(self.exchange(blob, &[])?.blob)
    }

    /// Every rank's `mine`, in rank order, on every rank (e.g. hostnames).
    pub fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(self.exchange(None, mine)?.per_rank)
    }

    fn serve(&mut self, round: u64, blob: &[u8], mine: &[u8]) -> Result<Exchange> {
        let deadline = Instant::now() + self.timeout;
        let mut per_rank: Vec<Option<Vec<u8>>> = vec![None; self.world_size];
        per_rank[0] = Some(mine.to_vec());
        let mut streams: Vec<(usize, TcpStream)> = Vec::new();
        let Some(listener) = self.listener.as_ref() else {
            return Err(RendezvousError::Protocol {
                detail: "rank 0 has no listener".into(),
            });
        };
        while streams.len() + 1 < self.world_size {
            let (stream, peer) = match listener.accept() {
                Ok(conn) => conn,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing = (0..self.world_size)
                            .filter(|&r| per_rank[r].is_none())
                            .collect();
                        let err = RendezvousError::Incomplete {
                            round,
                            arrived: streams.len() + 1,
                            expected: self.world_size,
                            missing,
                            after: self.timeout,
                        };
                        abort_all(&mut streams, round, &err.to_string());
                        return Err(err);
                    }
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                Err(source) => {
                    return Err(RendezvousError::Io {
                        what: "accept".into(),
                        source,
                    });
                }
            };
            let hello = (|| {
                configure(&stream, deadline, &format!("connection from {peer}"))?;
                read_hello(&stream, round, self.world_size, &peer)
            })();
            let (rank, msg) = match hello {
                Ok(h) => h,
                Err(e) => {
                    // A stray connection (port scanner, a rank of an older round) must not
                    // kill the round: log it and keep accepting.
                    tracing::warn!(%peer, error = %e, "rendezvous: ignoring a bad connection");
                    continue;
                }
            };
            if per_rank[rank].is_some() {
                let err = RendezvousError::Protocol {
                    detail: format!("two processes claim rank {rank} (the second from {peer})"),
                };
                streams.push((rank, stream));
                abort_all(&mut streams, round, &err.to_string());
                return Err(err);
            }
            per_rank[rank] = Some(msg);
            streams.push((rank, stream));
        }
        let per_rank: Vec<Vec<u8>> = per_rank
            .into_iter()
            .map(Option::unwrap_or_default)
            .collect();
        let mut reply = Vec::new();
        reply.extend_from_slice(MAGIC);
        reply.extend_from_slice(&round.to_le_bytes());
        push_bytes(&mut reply, blob);
        for m in &per_rank {
            push_bytes(&mut reply, m);
        }
        for (rank, stream) in &mut streams {
            stream
                .write_all(&reply)
                .map_err(|source| RendezvousError::Io {
                    what: format!("reply to rank {rank}"),
                    source,
                })?;
        }
        tracing::debug!(ranks = self.world_size, "rendezvous round served");
        Ok(Exchange {
            blob: blob.to_vec(),
            per_rank,
        })
    }

    fn join(&mut self, round: u64, mine: &[u8]) -> Result<Exchange> {
        let start = Instant::now();
        let deadline = start + self.timeout;
        let addrs: Vec<SocketAddr> = self
            .master
            .to_socket_addrs()
            .map_err(|e| RendezvousError::Resolve {
                addr: self.master.clone(),
                detail: e.to_string(),
            })?
            .collect();
        let mut last_error = String::from("no address");
        let mut stream = loop {
            let mut connected = None;
            for addr in &addrs {
                let left = deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1));
                match TcpStream::connect_timeout(addr, left.min(Duration::from_secs(5))) {
                    Ok(s) => {
                        connected = Some(s);
                        break;
                    }
                    Err(e) => last_error = e.to_string(),
                }
            }
            if let Some(s) = connected {
                break s;
            }
            if Instant::now() >= deadline {
                return Err(RendezvousError::Connect {
                    rank: self.rank,
                    addr: self.master.clone(),
                    after: self.timeout,
                    last_error,
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        configure(&stream, deadline, "connection to rank 0")?;
        let mut hello = Vec::with_capacity(28 + mine.len());
        hello.extend_from_slice(MAGIC);
        hello.extend_from_slice(&round.to_le_bytes());
        hello.extend_from_slice(&(self.rank as u32).to_le_bytes());
        hello.extend_from_slice(&(self.world_size as u32).to_le_bytes());
        push_bytes(&mut hello, mine);
        stream
            .write_all(&hello)
            .map_err(|source| RendezvousError::Io {
                what: "hello to rank 0".into(),
                source,
            })?;
        let what = "reply from rank 0";
        let mut magic = [0u8; 4];
        read_exact(&mut stream, &mut magic, what)?;
        if &magic != MAGIC {
            return Err(RendezvousError::Protocol {
                detail: format!("{what}: bad magic {magic:?}"),
            });
        }
        let their_round = read_u64(&mut stream, what)?;
        if their_round == u64::MAX {
            let reason = String::from_utf8_lossy(&read_bytes(&mut stream, what)?).into_owned();
            return Err(RendezvousError::Aborted { round, reason });
        }
        if their_round != round {
            return Err(RendezvousError::Protocol {
                detail: format!(
                    "rank 0 is in round {their_round}, rank {} in round {round}",
                    self.rank
                ),
            });
        }
        let blob = read_bytes(&mut stream, what)?;
        let per_rank = (0..self.world_size)
            .map(|_| read_bytes(&mut stream, what))
            .collect::<Result<Vec<_>>>()?;
        Ok(Exchange { blob, per_rank })
    }
}

/// Tells every connected rank that the round failed (best effort: they may be gone).
fn abort_all(streams: &mut [(usize, TcpStream)], _round: u64, reason: &str) {
    let mut msg = Vec::new();
    msg.extend_from_slice(MAGIC);
    msg.extend_from_slice(&u64::MAX.to_le_bytes());
    push_bytes(&mut msg, reason.as_bytes());
    for (_, s) in streams.iter_mut() {
        let _ = s.write_all(&msg);
    }
}

fn configure(stream: &TcpStream, deadline: Instant, what: &str) -> Result<()> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(10));
    let io = |source| RendezvousError::Io {
        what: format!("configuring {what}"),
        source,
    };
    stream.set_nonblocking(false).map_err(io)?;
    stream.set_read_timeout(Some(left)).map_err(io)?;
    stream.set_write_timeout(Some(left)).map_err(io)?;
    stream.set_nodelay(true).map_err(io)?;
    Ok(())
}

fn read_hello(
    stream: &TcpStream,
    round: u64,
    world_size: usize,
    peer: &SocketAddr,
) -> Result<(usize, Vec<u8>)> {
    let what = format!("hello from {peer}");
    let mut s = stream;
    let mut magic = [0u8; 4];
    read_exact(&mut s, &mut magic, &what)?;
    if &magic != MAGIC {
        return Err(RendezvousError::Protocol {
            detail: format!("{what}: bad magic {magic:?}"),
        });
    }
    let their_round = read_u64(&mut s, &what)?;
    let mut b4 = [0u8; 4];
    read_exact(&mut s, &mut b4, &what)?;
    let rank = u32::from_le_bytes(b4) as usize;
    read_exact(&mut s, &mut b4, &what)?;
    let their_world = u32::from_le_bytes(b4) as usize;
    let msg = read_bytes(&mut s, &what)?;
    if their_round != round {
        return Err(RendezvousError::Protocol {
            detail: format!("{what}: round {their_round}, expected {round}"),
        });
    }
    if their_world != world_size {
        return Err(RendezvousError::Protocol {
            detail: format!(
                "{what}: rank {rank} has WORLD_SIZE={their_world}, rank 0 has {world_size}"
            ),
        });
    }
    if rank == 0 || rank >= world_size {
        return Err(RendezvousError::Protocol {
            detail: format!("{what}: claims rank {rank} in a world of {world_size}"),
        });
    }
    Ok((rank, msg))
}

fn push_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

fn read_exact(stream: &mut impl Read, buf: &mut [u8], what: &str) -> Result<()> {
    stream
        .read_exact(buf)
        .map_err(|source| RendezvousError::Io {
            what: what.to_string(),
            source,
        })
}

fn read_u64(stream: &mut impl Read, what: &str) -> Result<u64> {
    let mut b = [0u8; 8];
    read_exact(stream, &mut b, what)?;
    Ok(u64::from_le_bytes(b))
}

fn read_bytes(stream: &mut impl Read, what: &str) -> Result<Vec<u8>> {
    let len = read_u64(stream, what)?;
    if len > MAX_MESSAGE {
        return Err(RendezvousError::Protocol {
            detail: format!("{what}: message of {len} bytes exceeds the {MAX_MESSAGE}-byte limit"),
        });
    }
    let mut buf = vec![0u8; len as usize];
    read_exact(stream, &mut buf, what)?;
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<LaunchEnv> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn torch_variables() {
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ]);
        assert_eq!(
            e.ok(),
            Some(LaunchEnv {
                rank: 3,
                world_size: 8,
                local_rank: 1,
                master_addr: "node0".into(),
                master_port: 29500,
                source: LaunchSource::Torch,
            })
        );
    }

    #[test]
    fn slurm_variables_when_torch_absent() {
        let e = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
        ])
        .ok();
        assert_eq!(
            e.as_ref().map(|e| (e.rank, e.world_size, e.local_rank)),
            Some((5, 16, 1))
        );
        assert_eq!(e.map(|e| e.source), Some(LaunchSource::Slurm));
    }

    #[test]
    fn errors_name_the_variable_and_value() {
        let base = [("MASTER_ADDR", "h"), ("MASTER_PORT", "1")];
        let msg = |pairs: &[(&str, &str)]| {
            let mut all = base.to_vec();
            all.extend_from_slice(pairs);
            env(&all).err().map(|e| e.to_string()).unwrap_or_default()
        };
        assert!(msg(&[("RANK", "0")]).contains("WORLD_SIZE is not set"));
        assert!(msg(&[("RANK", "x"), ("WORLD_SIZE", "2")]).contains("RANK=\"x\""));
        assert!(msg(&[("RANK", "2"), ("WORLD_SIZE", "2")]).contains("RANK=2 is out of range"));
        assert!(msg(&[("RANK", "0"), ("WORLD_SIZE", "0")]).contains("WORLD_SIZE=\"0\""));
        let no_port = env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "h")]);
        assert!(
            no_port
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
                .contains("MASTER_PORT")
        );
        let bad_port = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "70000"),
        ]);
        assert!(
            bad_port
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
                .contains("MASTER_PORT=\"70000\"")
        );
    }

    #[test]
    fn single_rank_round_needs_no_network() {
        let e = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "0"),
        ]);
        let mut rdzv = e.and_then(|e| Rendezvous::new(&e)).ok();
        let out = rdzv
            .as_mut()
            .and_then(|r| r.exchange(Some(b"id"), b"host0").ok());
        assert_eq!(
            out,
            Some(Exchange {
                blob: b"id".to_vec(),
                per_rank: vec![b"host0".to_vec()]
            })
        );
    }
}
