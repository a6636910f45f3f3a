//! Collective benchmark through ditstream's own layer (`collectives::nccl`): all-gather (and,
//! for reference, NCCL's own ring `ncclAllGather` called directly on the same communicator),
//! all-to-all, the two Ulysses layouts (pack/unpack + all-to-all) and all-reduce, bf16,
//! 256 MiB per rank by default, on all local GPUs with one thread per GPU.
//!
//! Timing: per iteration, a barrier, then host wall-clock around the call (every call returns
//! after its stream is done, so launch, sync and our polling are all inside); the slowest rank
//! counts; the median over `--iters` iterations after `--warmup`. Bandwidths follow NCCL-tests:
//! algbw = size / time, busbw = algbw·(P−1)/P (all-gather, all-to-all, Ulysses) or ·2(P−1)/P
//! (all-reduce); "size" is the output bytes per rank for all-gather, the bytes each rank sends
//! for all-to-all and Ulysses, the buffer for all-reduce. `bench/collectives_torch.py` measures
//! the same operations the same way with torch.distributed; `scripts/gpu-collectives.sh` runs
//! both and compares the `RESULT` lines.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use clap::Parser;
use cudarc::driver::{DevicePtr, DevicePtrMut};
use cudarc::nccl::sys::ncclDataType_t;
use ditstream_bench::{Collective, algbw_gbs, bus_factor, median};
use ditstream_common::collectives::nccl::{self, NcclComm, NcclWorld};
use ditstream_common::collectives::{CommWorld, Communicator, ReduceOp, UlyssesExt, UlyssesShape};
use half::bf16;

#[derive(Parser, Debug)]
#[command(about = "Time NCCL collectives through ditstream's collective layer on all local GPUs")]
struct Args {
    /// Bytes per rank, in MiB (see the module docs for what "size" means per operation).
    #[arg(long, default_value_t = 256)]
    size_mib: usize,
    /// Timed iterations (the median is reported).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Untimed warm-up iterations.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Number of GPUs (default: all visible).
    #[arg(long)]
    gpus: Option<usize>,
    /// Per-operation timeout in seconds (a hung peer fails the run instead of hanging it).
    #[arg(long, default_value_t = 120)]
    timeout_s: u64,
}

/// One operation's per-iteration times on one rank.
struct Timing {
    name: &'static str,
    kind: Collective,
    bytes: usize,
    seconds: Vec<f64>,
}

/// Deterministic pseudo-random bf16 in [-1, 1) (never time zeros).
fn random_bf16(n: usize, seed: u64) -> Vec<bf16> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bf16::from_f32((x >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        })
        .collect()
}

fn time_op(comm: &NcclComm, args: &Args, mut op: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    for _ in 0..args.warmup {
        comm.barrier()?;
        op()?;
    }
    let mut samples = Vec::with_capacity(args.iters);
    for _ in 0..args.iters {
        comm.barrier()?;
        let t = Instant::now();
        op()?;
        samples.push(t.elapsed().as_secs_f64());
    }
    Ok(samples)
}

/// Heads for the Ulysses shapes: Wan 14B's 40 when P divides it, else 8·P; D = 128.
fn ulysses_heads(p: usize) -> usize {
    if 40 % p == 0 { 40 } else { 8 * p }
}

fn rank_main(world: &NcclWorld, args: &Args) -> Result<(String, Vec<Timing>)> {
    let p = world.world_size();
    let r = world.rank();
    let comm = world
        .split(&[(0..p).collect()])?
        .context("this rank is not in the world group")?;
    let device = world
        .context()
        .name()
        .unwrap_or_else(|_| "unknown GPU".into());
    let el = std::mem::size_of::<bf16>();
    let elems = (args.size_mib << 20) / el / p * p; // a multiple of P
    let mut out = Vec::new();

    {
        let per = elems / p;
        let send = comm.upload(&random_bf16(per, 1 + r as u64))?;
        let mut recv = comm.alloc::<bf16>(per * p)?;
        let seconds = time_op(&comm, args, || Ok(comm.all_gather(&send, &mut recv)?))?;
        out.push(Timing {
            name: "all_gather",
            kind: Collective::AllGather,
            bytes: per * p * el,
            seconds,
        });
        // Reference: NCCL's own all-gather (`ncclAllGather`, ring) on the same communicator,
        // buffers and stream, finished the same way (our synchronize polls the stream).
        let seconds = time_op(&comm, args, || {
            let (s, _gs) = send.device_ptr(comm.stream());
            let (d, _gd) = recv.device_ptr_mut(comm.stream());
            // SAFETY: `send` holds `per` and `recv` P·per bf16 elements, alive until the
            // synchronize below; the raw handle is used on the communicator's own stream.
            unsafe {
                cudarc::nccl::result::all_gather(
                    s as *const c_void,
                    d as *mut c_void,
                    per,
                    ncclDataType_t::ncclBfloat16,
                    comm.as_raw(),
                    comm.stream().cu_stream() as cudarc::nccl::sys::cudaStream_t,
                )
            }
            .map_err(|e| anyhow!("ncclAllGather: {:?}", e.0))?;
            Ok(comm.synchronize()?)
        })?;
        out.push(Timing {
            name: "nccl_all_gather_ring",
            kind: Collective::AllGather,
            bytes: per * p * el,
            seconds,
        });
    }
    {
        let send = comm.upload(&random_bf16(elems, 11 + r as u64))?;
        let mut recv = comm.alloc::<bf16>(elems)?;
        let seconds = time_op(&comm, args, || Ok(comm.all_to_all(&send, &mut recv)?))?;
        out.push(Timing {
            name: "all_to_all",
            kind: Collective::AllToAll,
            bytes: elems * el,
            seconds,
        });
    }
    {
        // Stacked QKV [1, S/P, 3, H, 128] → [1, S, 3, H/P, 128]: pack (2-D copies) + all-to-all.
        let h = ulysses_heads(p);
        let s_local = elems / (3 * h * 128);
        let shape = UlyssesShape::qkv(1, s_local, h, 128);
        let input = comm.upload(&random_bf16(shape.numel(), 21 + r as u64))?;
        let mut output = comm.alloc::<bf16>(shape.numel())?;
        let mut scratch = comm.alloc::<bf16>(shape.numel())?;
        let seconds = time_op(&comm, args, || {
            Ok(comm.seq_to_heads(&input, &mut output, &mut scratch, shape)?)
        })?;
        out.push(Timing {
            name: "ulysses_qkv_seq_to_heads",
            kind: Collective::AllToAll,
            bytes: shape.numel() * el,
            seconds,
        });
    }
    {
        // Attention output [1, S, H/P, 128] → [1, S/P, H, 128]: all-to-all + unpack (2-D copies).
        let h = ulysses_heads(p);
        let s_local = elems / (h * 128);
        let shape = UlyssesShape::bshd(1, s_local, h, 128);
        let input = comm.upload(&random_bf16(shape.numel(), 31 + r as u64))?;
        let mut output = comm.alloc::<bf16>(shape.numel())?;
        let mut scratch = comm.alloc::<bf16>(shape.numel())?;
        let seconds = time_op(&comm, args, || {
            Ok(comm.heads_to_seq(&input, &mut output, &mut scratch, shape)?)
        })?;
        out.push(Timing {
            name: "ulysses_bshd_heads_to_seq",
            kind: Collective::AllToAll,
            bytes: shape.numel() * el,
            seconds,
        });
    }
    {
        let send = comm.upload(&random_bf16(elems, 41 + r as u64))?;
        let mut recv = comm.alloc::<bf16>(elems)?;
        let seconds = time_op(&comm, args, || {
            Ok(comm.all_reduce(&send, &mut recv, ReduceOp::Sum)?)
        })?;
        out.push(Timing {
            name: "all_reduce",
            kind: Collective::AllReduce,
            bytes: elems * el,
            seconds,
        });
    }
    comm.barrier()?;
    Ok((device, out))
}

fn main() -> Result<()> {
    let args = Args::parse();
    // The GPU script's CUDA settings (kernel cache, CUDA headers, algorithm searches).
    ditstream_kernels::testing::configure_cuda()?;
    let visible = nccl::device_count()?;
    let p = args.gpus.unwrap_or(visible);
    anyhow::ensure!(p >= 1, "no GPUs visible");
    anyhow::ensure!(args.iters >= 1, "--iters must be at least 1");
    let version = cudarc::nccl::result::get_nccl_version()
        .map_err(|e| anyhow!("ncclGetVersion: {:?}", e.0))?;
    let timeout = Duration::from_secs(args.timeout_s);
    let per_rank = NcclWorld::run_local(p, timeout, |world| {
        rank_main(&world, &args).map_err(|e| format!("{e:#}"))
    })?;
    let mut ranks = Vec::new();
    for (r, res) in per_rank.into_iter().enumerate() {
        match res {
            Ok(Ok(t)) => ranks.push(t),
            Ok(Err(e)) | Err(e) => return Err(anyhow!("rank {r}: {e}")),
        }
    }
    let device = ranks[0].0.clone();
    println!(
        "ditstream collectives (our layer over NCCL {}.{}.{}), {p} × {device}, bf16, median of {} after {} warm-up",
        version / 10000,
        (version / 100) % 100,
        version % 100,
        args.iters,
        args.warmup
    );
    println!(
        "{:<28} {:>10} {:>10} {:>12} {:>12}",
        "op", "MiB/rank", "median ms", "algbw GB/s", "busbw GB/s"
    );
    for (i, t0) in ranks[0].1.iter().enumerate() {
        // Per iteration the slowest rank counts.
        let slowest: Vec<f64> = (0..t0.seconds.len())
            .map(|k| {
                ranks
                    .iter()
                    .map(|(_, t)| t[i].seconds[k])
                    .fold(0.0, f64::max)
            })
            .collect();
        let med = median(&slowest).context("no samples")?;
        let alg = algbw_gbs(t0.bytes, med);
        let bus = alg * bus_factor(t0.kind, p);
        println!(
            "{:<28} {:>10.1} {:>10.3} {:>12.1} {:>12.1}",
            t0.name,
            t0.bytes as f64 / (1 << 20) as f64,
            med * 1e3,
            alg,
            bus
        );
        println!(
            "RESULT\tours\t{}\t{p}\t{}\t{:.6}\t{:.2}\t{:.2}",
            t0.name,
            t0.bytes,
            med * 1e3,
            alg,
            bus
        );
    }
    Ok(())
}
