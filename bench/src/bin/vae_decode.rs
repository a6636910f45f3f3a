//! The Wan 2.1 VAE decode at its real size (diffusers `AutoencoderKLWan` defaults: base 96,
//! dim_mult [1, 2, 4, 4], 2 residual blocks, z 16) with seeded random weights on the GPU, decoded
//! chunk by chunk, one latent frame per chunk, as the streaming decoder does (issue 7's benchmark).
//! `bench/vae_decode_torch.py` times diffusers' `AutoencoderKLWan.decode` at the same shapes and
//! `scripts/gpu-vae-bench.sh` runs both and compares the `RESULT` lines.
//!
//! Reported per configuration:
//! - **total**: CUDA events on the kernels' stream from before the first chunk to after the last
//!   (every chunk queued back to back, as a stream of latent frames already there would be), median of
//!   `--iters`; and the host wall clock of the same span (equal unless the host cannot keep the GPU
//!   busy);
//! - **first frame**: from the start to the end of chunk 0 (latent frame 0 → video frame 0);
//! - **per chunk**: chunk 0, and the median and max of the later chunks (4 video frames each);
//! - **peak memory**: the high-water marks of the device's default memory pool, which every
//!   allocation of ours goes through (the kernels allocate with `cuMemAllocAsync` on their stream:
//!   weights, activations, caches, the cuBLASLt workspace), reset after warm-up:
//!   `CU_MEMPOOL_ATTR_USED_MEM_HIGH` (bytes in live tensors at the peak: what torch's
//!   `max_memory_allocated` reports) and `RESERVED_MEM_HIGH` (what the pool held from the driver).
//!   NCCL's own buffers and the CUDA context are outside both, as they are outside torch's.
//!
//! `--gpus 2` also decodes on two GPUs over NCCL (one thread per GPU, one process; the latent split
//! along `--split`, halos and keys/values device to device, every chunk's frames gathered to rank 0,
//! which is what the timing ends on) and reports the speedup over the 1-GPU run of the same process.
//! The 2-GPU decode hands latent frame 0 to `decode_chunk` alone (the first frame out early), then
//! `--chunk-frames` latent frames per call (a list: one timed decode per entry, the last is the
//! headline): each call waits for the communicator once at its end, so 1 drains both GPUs after every
//! latent frame and 20 queues the remaining passes back to back, as the 1-GPU decode always does (it
//! never waits).
//! `--profile` decodes once more with CUDA events around every convolution and the frame attention
//! (through the decoder's `SpatialOps` seam, no model change): time per conv shape with its
//! TFLOP/s (labels "+up2" / "+res": the upsamplers' conv reading the ×2 upsampling in place, the
//! residual blocks' last conv with the add in its epilogue), attention, and the rest (RMS norms with
//! their SiLU, the remaining adds, concatenations, clamp, and any GPU idle time between ops). `--attention` times the mid-block attention kernels alone at the
//! frame's token count (one head of 384).
//!
//! **Per-rank breakdown** (always printed, `BREAKDOWN` lines, summed over the chunks of the median
//! timed decode; for the 1-GPU run and each rank of the 2-GPU run): the host's time in each step,
//! read from the decoder's `tracing` spans by a layer installed here (the library only marks its
//! steps): queueing the chunk's work (decode_chunk less the waits below), the agreement step, the
//! key/value gather of the mid-block attention, host-waited halo exchanges (a conv shape's first run
//! only), the wait for the communicator at the chunk's end, and the gather of the frames to rank 0;
//! plus the GPU's span from CUDA events, and the GPU's backlog when the host finished queueing each
//! chunk: the GPU clock of an event recorded at that moment less the host clock then, both from the
//! decode's start (the stream drained, so they start together). A backlog near 0 means the GPU had
//! already run everything queued, i.e. it waited for the host (launch-bound); a large one means the
//! host was ahead and its waits cost nothing. With `--profile`, the 2-GPU decode also runs once with
//! CUDA events at the edges of every sharded conv, halo exchange and attention (`OP2` lines per
//! rank, comparable with the 1-GPU `OP` lines) and prints cuDNN's plan per conv shape and GPU (`PLAN`:
//! the band shapes' algorithms beside the full shapes'). `--launches` counts the GPU work items of
//! one steady-state 1-GPU chunk by type (kernels, memsets, allocations…; a stream capture into a CUDA
//! graph that never runs, so it runs last and the process exits after it).
//!
//! `--profiler-chunk N` decodes once more on 1 GPU with latent frame N alone between
//! `cuProfilerStart` and `cuProfilerStop`: `scripts/gpu-vae-ncu.sh` runs it under Nsight Compute
//! (capture off until then) for the time of every kernel of one chunk, cuDNN's included.
//!
//! Warm-up (`--warmup N`): N decodes of the first min(3, T) latent frames of a fresh stream: chunks 0,
//! 1 and 2 hit every distinct shape (cache of 0, 1, 2 frames; time_conv skipped, zero-padded, cached),
//! so they compile every kernel, plan every GEMM and grow the memory pool to the per-chunk peak; later
//! chunks repeat chunk 2's shapes. The pool keeps its memory between iterations (release threshold
//! raised to the maximum, as torch's caching allocator keeps its blocks) unless `--release-pool`:
//! with the driver's default (0) the pool returns all free memory at every synchronisation and the next
//! chunk maps it again.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use cudarc::driver::CudaEvent;
use cudarc::driver::sys::{self as cu, CUevent_flags, CUmemPool_attribute, CUresult};
use ditstream_bench::median;
use ditstream_common::collectives::nccl::{NcclComm, NcclWorld};
use ditstream_common::collectives::{CommWorld, Communicator};
use ditstream_common::config::VaeSplitDim;
use ditstream_decoder::parallel::ParallelVaeDecoder;
use ditstream_decoder::vae::{SpatialOps, Unsharded, VaeConfig, VaeError, WanVaeDecoder};
use ditstream_kernels::cuda::{
    AttentionKernel, FLASH_VARIANTS, cuda_stream, cudnn_conv_plans, synchronize,
    with_attention_kernel,
};
use ditstream_kernels::weights::RandomWeights;
use ditstream_kernels::{AttentionOptions, DType, Device, Tensor, attention};

#[derive(Parser, Debug)]
#[command(about = "Time the Wan 2.1 VAE decode at real size with random weights, chunk by chunk")]
struct Args {
    /// Video height in pixels (the latent is /8).
    #[arg(long, default_value_t = 480)]
    height: usize,
    /// Video width in pixels.
    #[arg(long, default_value_t = 832)]
    width: usize,
    /// Video frames (4k + 1; the latent has (frames − 1)/4 + 1).
    #[arg(long, default_value_t = 81)]
    frames: usize,
    /// Storage dtype of weights and activations: bf16 or f32.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// 1, or 2: also the parallel decode on 2 GPUs over NCCL, with its speedup over 1.
    #[arg(long, default_value_t = 1)]
    gpus: usize,
    /// Split dimension of the 2-GPU decode: height or width.
    #[arg(long, default_value = "height")]
    split: String,
    /// Warm-up decodes of the first min(3, T) latent frames (see the module docs).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Timed whole decodes (the median is reported).
    #[arg(long, default_value_t = 2)]
    iters: usize,
    /// Also decode once with CUDA events around every conv and the attention (where the time goes).
    #[arg(long)]
    profile: bool,
    /// Also time the mid-block attention kernels alone at this frame's size.
    #[arg(long)]
    attention: bool,
    /// Leave the memory pool's release threshold at the driver's default (0).
    #[arg(long)]
    release_pool: bool,
    /// Seed of the random weights (the latent uses seed + 1).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Latent frames per `decode_chunk` call of the 2-GPU decode after the first (latent frame 0
    /// alone, for the first frame), comma-separated for several timed decodes: 1 waits for the
    /// communicator after every latent frame; more queue that many passes back to back.
    #[arg(long, default_value = "1", value_delimiter = ',')]
    chunk_frames: Vec<usize>,
    /// Count the GPU work items of one 1-GPU chunk (a CUDA graph capture; runs last, then exits).
    #[arg(long)]
    launches: bool,
    /// Decode once more on 1 GPU with chunk N alone between cuProfilerStart and cuProfilerStop, for
    /// a kernel profiler started with its capture off (`ncu --profile-from-start off`).
    #[arg(long)]
    profiler_chunk: Option<usize>,
}

const GIB: f64 = (1u64 << 30) as f64;
/// Per-collective timeout of the 2-GPU run (the first chunks compile kernels on both GPUs).
const NCCL_TIMEOUT: Duration = Duration::from_secs(300);

/// The default memory pool of one GPU: every `cuMemAllocAsync` of ours comes from it.
struct Pool {
    ordinal: usize,
    pool: cu::CUmemoryPool,
}

impl Pool {
    fn of(ordinal: usize) -> Result<Pool> {
        let stream = cuda_stream(ordinal)?;
        let ctx = stream.context();
        ctx.bind_to_thread().context("cuCtxSetCurrent")?;
        let mut pool: cu::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: valid out-pointer and device handle; the context is current.
        let code = unsafe { cu::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) };
        check(code, "cuDeviceGetDefaultMemPool")?;
        Ok(Pool { ordinal, pool })
    }

    fn get(&self, attr: CUmemPool_attribute) -> Result<u64> {
        let mut value: u64 = 0;
        // SAFETY: the pool handle is the device's default pool; these attributes are cuuint64_t.
        let code =
            unsafe { cu::cuMemPoolGetAttribute(self.pool, attr, (&mut value as *mut u64).cast()) };
        check(code, "cuMemPoolGetAttribute")?;
        Ok(value)
    }

    fn set(&self, attr: CUmemPool_attribute, mut value: u64) -> Result<()> {
        // SAFETY: as in `get`; the high-water marks accept only 0 (reset), the threshold any value.
        let code =
            unsafe { cu::cuMemPoolSetAttribute(self.pool, attr, (&mut value as *mut u64).cast()) };
        check(code, "cuMemPoolSetAttribute")
    }

    /// Restarts both high-water marks from the current usage.
    fn reset_peaks(&self) -> Result<()> {
        synchronize(self.ordinal)?;
        self.set(CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)?;
        self.set(CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0)
    }

    /// (used, reserved) high-water marks in GiB.
    fn peaks_gib(&self) -> Result<(f64, f64)> {
        synchronize(self.ordinal)?;
        Ok((
            self.get(CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)? as f64 / GIB,
            self.get(CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)? as f64 / GIB,
        ))
    }

    /// Keeps freed memory in the pool (`true`) or lets the driver take it back at every sync.
    fn keep(&self, keep: bool) -> Result<()> {
        let threshold = if keep { u64::MAX } else { 0 };
        self.set(
            CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            threshold,
        )
    }
}

fn check(code: CUresult, call: &str) -> Result<()> {
    ensure!(code == CUresult::CUDA_SUCCESS, "{call}: {code:?}");
    Ok(())
}

fn event(ordinal: usize) -> Result<CudaEvent> {
    cuda_stream(ordinal)?
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .context("cuEventRecord")
}

fn ms_between(a: &CudaEvent, b: &CudaEvent) -> Result<f64> {
    Ok(f64::from(a.elapsed_ms(b).context("cuEventElapsedTime")?))
}

/// One timed decode: events at the start and after each chunk, and the host wall clock.
#[derive(Debug, Clone)]
struct Run {
    /// Start → end of the last chunk, events (ms).
    total_ms: f64,
    /// Host wall clock of the same span, to the last chunk's completion (ms).
    wall_ms: f64,
    /// Per chunk (ms).
    chunk_ms: Vec<f64>,
    /// Where the host's time went (see the module docs).
    breakdown: Breakdown,
}

impl Run {
    fn from_events(
        start: &CudaEvent,
        ends: &[CudaEvent],
        wall_ms: f64,
        breakdown: Breakdown,
    ) -> Result<Run> {
        let mut chunk_ms = Vec::with_capacity(ends.len());
        let mut prev = start;
        for end in ends {
            chunk_ms.push(ms_between(prev, end)?);
            prev = end;
        }
        Ok(Run {
            total_ms: ms_between(start, prev)?,
            wall_ms,
            chunk_ms,
            breakdown: Breakdown {
                gpu_ms: ms_between(start, prev)?,
                ..breakdown
            },
        })
    }
}

/// One decode's host and GPU time, summed over its chunks (module docs, "Per-rank breakdown").
#[derive(Debug, Clone, Default)]
struct Breakdown {
    chunks: usize,
    /// Host: the decode's start to the last chunk's end (its frames gathered).
    wall_ms: f64,
    /// GPU: start event to the last chunk's end event.
    gpu_ms: f64,
    /// Host inside decode_chunk (1 GPU: `vae_decode_chunk`; 2 GPUs: `parallel_vae_decode_chunk`).
    decode_ms: f64,
    agree_ms: f64,
    attention_gather_ms: f64,
    /// Host-waited halo exchanges: (count, ms).
    halo_waited: (usize, f64),
    /// Stream-ordered halo exchanges: (count, host ms to queue them).
    halo_queued: (usize, f64),
    sync_ms: f64,
    gather_ms: f64,
    /// Sharded convs run.
    convs: usize,
    /// Σ over chunks of the GPU's backlog when the host finished queueing the chunk; `None` when the
    /// marks are missing.
    backlog_ms: Option<f64>,
}

impl Breakdown {
    /// From this thread's span records, the decode's start (`t0`, `start`, together) and, per chunk,
    /// where the host finished queueing it: its clock and an event recorded then.
    fn new(
        records: &clock::Thread,
        (t0, start): (Instant, &CudaEvent),
        queued: &[(Instant, &CudaEvent)],
        end: Instant,
        chunks: usize,
    ) -> Result<Breakdown> {
        let host = |name: &str| records.host.get(name).copied().unwrap_or((0, 0.0));
        let backlog_ms = if queued.len() == chunks {
            let mut sum = 0.0;
            for (at, e) in queued {
                let host_ms = at.duration_since(t0).as_secs_f64() * 1e3;
                sum += ms_between(start, e)? - host_ms;
            }
            Some(sum)
        } else {
            None
        };
        let parallel = host("parallel_vae_decode_chunk");
        Ok(Breakdown {
            chunks,
            wall_ms: end.duration_since(t0).as_secs_f64() * 1e3,
            gpu_ms: 0.0,
            decode_ms: if parallel.0 > 0 {
                parallel.1
            } else {
                host("vae_decode_chunk").1
            },
            agree_ms: host("parallel_vae_agree").1,
            attention_gather_ms: host("parallel_vae_attention_gather").1,
            halo_waited: host("parallel_vae_halo_waited"),
            halo_queued: host("parallel_vae_halo"),
            sync_ms: host("parallel_vae_sync").1,
            gather_ms: host("parallel_vae_gather").1,
            convs: host("parallel_vae_conv").0,
            backlog_ms,
        })
    }

    /// Host time queueing work: decode_chunk less its waits.
    fn enqueue_ms(&self) -> f64 {
        self.decode_ms
            - self.agree_ms
            - self.attention_gather_ms
            - self.halo_waited.1
            - self.sync_ms
    }

    /// Host time outside decode_chunk and the gather (the loop, the latent's narrowing, events).
    fn other_ms(&self) -> f64 {
        self.wall_ms - self.decode_ms - self.gather_ms
    }

    /// The `BREAKDOWN` line of run `name` (scripts/gpu-vae-bench.sh prints it as a table).
    fn print(&self, name: &str) {
        let backlog = self
            .backlog_ms
            .map_or_else(|| "-".to_string(), |b| format!("{b:.1}"));
        println!(
            "BREAKDOWN\t{name}\t{}\t{:.1}\t{:.1}\t{:.1}\t{:.1}\t{:.1}\t{:.1}\t{}\t{:.1}\t{:.1}\t{:.1}\t{backlog}\t{}\t{:.1}\t{}",
            self.chunks,
            self.wall_ms,
            self.gpu_ms,
            self.enqueue_ms(),
            self.agree_ms,
            self.attention_gather_ms,
            self.halo_waited.1,
            self.halo_waited.0,
            self.sync_ms,
            self.gather_ms,
            self.other_ms(),
            self.halo_queued.0,
            self.halo_queued.1,
            self.convs,
        );
    }
}

/// The median run's numbers over several runs: (total, wall, first chunk, later chunks' median and
/// max), the per-chunk figures taken from the run with the median total.
struct Summary {
    total_ms: f64,
    wall_ms: f64,
    first_ms: f64,
    later_median_ms: f64,
    later_max_ms: f64,
    /// The median run's breakdown.
    breakdown: Breakdown,
}

fn summarise(runs: &[Run]) -> Result<Summary> {
    let totals: Vec<f64> = runs.iter().map(|r| r.total_ms).collect();
    let total_ms = median(&totals).context("no runs")?;
    let mid = runs
        .iter()
        .min_by(|a, b| {
            (a.total_ms - total_ms)
                .abs()
                .total_cmp(&(b.total_ms - total_ms).abs())
        })
        .context("no runs")?;
    let later = &mid.chunk_ms[1.min(mid.chunk_ms.len())..];
    Ok(Summary {
        total_ms,
        wall_ms: median(&runs.iter().map(|r| r.wall_ms).collect::<Vec<_>>()).unwrap_or(0.0),
        first_ms: mid.chunk_ms.first().copied().unwrap_or(0.0),
        later_median_ms: median(later).unwrap_or(0.0),
        later_max_ms: later.iter().copied().fold(0.0, f64::max),
        breakdown: mid.breakdown.clone(),
    })
}

/// Decodes the first `frames` latent frames of `latent` with `ops`, one per chunk, timing each.
fn decode_timed(
    decoder: &WanVaeDecoder,
    latent: &Tensor,
    frames: usize,
    ops: &dyn SpatialOps,
    ordinal: usize,
) -> Result<Run> {
    let shape = latent.shape();
    let mut stream = decoder.new_stream(shape[3], shape[4])?;
    synchronize(ordinal)?;
    clock::start(ordinal, false);
    let t0 = Instant::now();
    let start = event(ordinal)?;
    let mut ends = Vec::with_capacity(frames);
    let mut queued = Vec::with_capacity(frames);
    for t in 0..frames {
        let chunk = latent.narrow(2, t, 1)?;
        // The frames would go to the encoder; dropping them frees their memory, stream-ordered.
        drop(decoder.decode_chunk_with(&mut stream, &chunk, ops)?);
        // Queued: on one GPU the chunk's end is where the host finished queueing it.
        queued.push(Instant::now());
        ends.push(event(ordinal)?);
    }
    let end = Instant::now();
    synchronize(ordinal)?;
    let wall_ms = t0.elapsed().as_secs_f64() * 1e3;
    let queued: Vec<_> = queued.into_iter().zip(&ends).collect();
    let breakdown = Breakdown::new(&clock::take(), (t0, &start), &queued, end, frames)?;
    Run::from_events(&start, &ends, wall_ms, breakdown)
}

/// The `decode_chunk` calls of a decode of `frames` latent frames, as (first frame, frames): latent
/// frame 0 alone (the first video frame out as early as possible), then `per_call` at a time.
fn chunk_starts(frames: usize, per_call: usize) -> Vec<(usize, usize)> {
    let mut calls = vec![(0, frames.min(1))];
    let mut t = 1;
    while t < frames {
        let len = per_call.max(1).min(frames - t);
        calls.push((t, len));
        t += len;
    }
    calls
}

/// One decode with latent frame `chunk` alone inside the CUDA profiler's capture range (the GPU drained
/// at both edges, so the range holds exactly that chunk's work).
fn profiler_chunk(decoder: &WanVaeDecoder, latent: &Tensor, chunk: usize) -> Result<()> {
    let shape = latent.shape();
    ensure!(
        chunk < shape[2],
        "--profiler-chunk {chunk}: the latent has {} frames",
        shape[2]
    );
    let mut stream = decoder.new_stream(shape[3], shape[4])?;
    for t in 0..=chunk {
        let x = latent.narrow(2, t, 1)?;
        if t == chunk {
            synchronize(0)?;
            cuda_stream(0)?
                .context()
                .bind_to_thread()
                .context("cuCtxSetCurrent")?;
            // SAFETY: no arguments; the context of cuda:0 is current on this thread.
            check(unsafe { cu::cuProfilerStart() }, "cuProfilerStart")?;
        }
        drop(decoder.decode_chunk_with(&mut stream, &x, &Unsharded)?);
    }
    synchronize(0)?;
    // SAFETY: as above.
    check(unsafe { cu::cuProfilerStop() }, "cuProfilerStop")?;
    println!("profiler range: chunk {chunk} of a fresh stream");
    Ok(())
}

/// `SpatialOps` that times every call on the kernels' stream (CUDA events around it) and groups the
/// times by op and shape.
struct TimedOps {
    ordinal: usize,
    /// (label, FLOPs, start, end) per call.
    calls: Mutex<Vec<(String, f64, CudaEvent, CudaEvent)>>,
}

impl TimedOps {
    fn timed(
        &self,
        label: String,
        flops: f64,
        f: impl FnOnce() -> ditstream_decoder::vae::Result<Tensor>,
    ) -> ditstream_decoder::vae::Result<Tensor> {
        let cuda = |e: anyhow::Error| {
            VaeError::Kernel(ditstream_kernels::KernelError::Cuda {
                op: "profile",
                call: "cuEventRecord",
                device: Device::Cuda(self.ordinal),
                detail: format!("{e:#}"),
            })
        };
        let start = event(self.ordinal).map_err(cuda)?;
        let out = f()?;
        let end = event(self.ordinal).map_err(cuda)?;
        self.calls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((label, flops, start, end));
        Ok(out)
    }

    /// (label, calls, ms, FLOPs) per label, most time first.
    fn table(&self) -> Result<Vec<(String, usize, f64, f64)>> {
        let calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        let mut by_label: HashMap<&str, (usize, f64, f64)> = HashMap::new();
        for (label, flops, start, end) in calls.iter() {
            let entry = by_label.entry(label).or_default();
            entry.0 += 1;
            entry.1 += ms_between(start, end)?;
            entry.2 += flops;
        }
        let mut rows: Vec<_> = by_label
            .into_iter()
            .map(|(l, (n, ms, f))| (l.to_string(), n, ms, f))
            .collect();
        rows.sort_by(|a, b| b.2.total_cmp(&a.2));
        Ok(rows)
    }
}

/// Label and FLOPs of a conv of weight shape `ws` over an input of shape `xs` (the upsampled shape
/// for the upsamplers' fused conv), `what` appended to the label ("" / " +up2" / " +res").
fn conv_label(xs: &[usize], ws: &[usize], what: &str) -> (String, f64) {
    if xs.len() == 5 && ws.len() == 5 {
        let per_out = 2.0 * (ws[1] * ws[2] * ws[3] * ws[4]) as f64;
        let outputs = (xs[0] * ws[0] * xs[2] * xs[3] * xs[4]) as f64;
        (
            format!(
                "conv {}x{}x{} {:>3}->{:<3} {}x{}{what}",
                ws[2], ws[3], ws[4], ws[1], ws[0], xs[3], xs[4]
            ),
            per_out * outputs,
        )
    } else {
        (format!("conv (other){what}"), 0.0)
    }
}

impl SpatialOps for TimedOps {
    fn causal_conv3d(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        cache: Option<&Tensor>,
    ) -> ditstream_decoder::vae::Result<Tensor> {
        let (label, flops) = conv_label(x.shape(), weight.shape(), "");
        self.timed(label, flops, || {
            Unsharded.causal_conv3d(x, weight, bias, cache)
        })
    }

    // The decoder's fused paths are timed as convs too (labelled), so the profile runs what a plain
    // decode runs: the upsampling read inside the conv, the residual add in its epilogue.
    fn causal_conv3d_upsampled(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> ditstream_decoder::vae::Result<Tensor> {
        let mut up = x.shape().to_vec();
        if up.len() == 5 {
            up[3] *= 2;
            up[4] *= 2;
        }
        let (label, flops) = conv_label(&up, weight.shape(), " +up2");
        self.timed(label, flops, || {
            Unsharded.causal_conv3d_upsampled(x, weight, bias)
        })
    }

    fn causal_conv3d_residual(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        cache: Option<&Tensor>,
        residual: &Tensor,
    ) -> ditstream_decoder::vae::Result<Tensor> {
        let (label, flops) = conv_label(x.shape(), weight.shape(), " +res");
        self.timed(label, flops, || {
            Unsharded.causal_conv3d_residual(x, weight, bias, cache, residual)
        })
    }

    fn frame_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> ditstream_decoder::vae::Result<Tensor> {
        let s = q.shape();
        let flops = if s.len() == 4 {
            4.0 * (s[0] * s[1] * s[1] * s[2] * s[3]) as f64
        } else {
            0.0
        };
        let label = format!("attention {:?}", s);
        self.timed(label, flops, || Unsharded.frame_attention(q, k, v))
    }
}

/// Per-rank accounting from the decoder's `tracing` spans (`vae_decode_chunk`, `parallel_vae_*`): the
/// library only marks its steps; this layer times them. Everything is kept per thread (each rank is
/// one thread driving one GPU), so the ranks never share a lock here while they decode.
mod clock {
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::time::Instant;

    use cudarc::driver::CudaEvent;
    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id};
    use tracing::subscriber::Interest;
    use tracing::{Metadata, Subscriber};
    use tracing_subscriber::layer::Context;
    use tracing_subscriber::registry::LookupSpan;

    /// The spans timed: the 1-GPU chunk, and every step of the parallel decode.
    const WATCHED: [&str; 11] = [
        "vae_decode_chunk",
        "parallel_vae_decode_chunk",
        "parallel_vae_agree",
        "parallel_vae_sync",
        "parallel_vae_gather",
        "parallel_vae_conv",
        "parallel_vae_halo",
        "parallel_vae_halo_waited",
        "parallel_vae_halo_nccl",
        "parallel_vae_attention",
        "parallel_vae_attention_gather",
    ];

    /// Spans with CUDA events at their edges in a profiling decode.
    const EVENTED: [&str; 5] = [
        "parallel_vae_conv",
        "parallel_vae_halo",
        "parallel_vae_halo_nccl",
        "parallel_vae_attention",
        "parallel_vae_attention_gather",
    ];

    /// One thread's (rank's) records.
    #[derive(Default)]
    pub struct Thread {
        /// The GPU this thread drives (events go on its kernels' stream).
        pub ordinal: Option<usize>,
        /// Record CUDA events around the `EVENTED` spans (a profiling decode only: ~2 µs each).
        pub events: bool,
        /// Per span name: (count, host ms).
        pub host: HashMap<&'static str, (usize, f64)>,
        /// Where the host finished queueing a chunk (entering `parallel_vae_sync`): its clock and an
        /// event recorded there on the kernels' stream.
        pub marks: Vec<(Instant, CudaEvent)>,
        /// (span name, conv label, FLOPs, start, end) per evented span.
        pub timed: Vec<(&'static str, String, f64, CudaEvent, CudaEvent)>,
    }

    thread_local! {
        static THREAD: RefCell<Thread> = RefCell::default();
    }

    /// This thread drives GPU `ordinal`; clears its records.
    pub fn start(ordinal: usize, events: bool) {
        THREAD.with_borrow_mut(|t| {
            *t = Thread {
                ordinal: Some(ordinal),
                events,
                ..Thread::default()
            }
        });
    }

    /// This thread's records (cleared).
    pub fn take() -> Thread {
        THREAD.with_borrow_mut(|t| {
            let ordinal = t.ordinal;
            let out = std::mem::take(t);
            t.ordinal = ordinal;
            out
        })
    }

    fn event(ordinal: usize) -> Option<CudaEvent> {
        super::event(ordinal).ok()
    }

    /// The conv span's fields, as a label and FLOPs (the same form as the 1-GPU profile's).
    #[derive(Default)]
    struct ConvFields {
        n: HashMap<&'static str, u64>,
        kind: String,
    }

    impl Visit for ConvFields {
        fn record_u64(&mut self, field: &Field, value: u64) {
            self.n.insert(field.name(), value);
        }
        fn record_i64(&mut self, field: &Field, value: i64) {
            self.n.insert(field.name(), value.max(0) as u64);
        }
        fn record_str(&mut self, field: &Field, value: &str) {
            if field.name() == "kind" {
                self.kind = value.to_string();
            }
        }
        fn record_debug(&mut self, _field: &Field, _value: &dyn std::fmt::Debug) {}
    }

    impl ConvFields {
        fn label(&self) -> (String, f64) {
            let g = |k: &str| self.n.get(k).copied().unwrap_or(0) as usize;
            let xs = [1, g("c_in"), g("t"), g("h"), g("w")];
            let ws = [g("c_out"), g("c_in"), g("kt"), g("kh"), g("kw")];
            super::conv_label(&xs, &ws, &format!(" {}", self.kind).replace("  ", " "))
        }
    }

    /// Per-span state: when it was entered, its start event and conv label.
    struct Open {
        at: Instant,
        start: Option<CudaEvent>,
        label: Option<(String, f64)>,
    }

    /// The layer: host time per watched span, per thread; events where asked.
    pub struct Layer;

    impl<S: Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for Layer {
        fn register_callsite(&self, meta: &'static Metadata<'static>) -> Interest {
            if meta.is_span() && WATCHED.contains(&meta.name()) {
                Interest::always()
            } else {
                Interest::never()
            }
        }

        fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
            // Labels only for a profiling decode: the timed ones skip the field visit.
            if attrs.metadata().name() != "parallel_vae_conv" || !THREAD.with_borrow(|t| t.events) {
                return;
            }
            let mut fields = ConvFields::default();
            attrs.record(&mut fields);
            if let Some(span) = ctx.span(id) {
                span.extensions_mut().insert(fields.label());
            }
        }

        fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
            let Some(span) = ctx.span(id) else { return };
            let name = span.name();
            let (ordinal, events) = THREAD.with_borrow(|t| (t.ordinal, t.events));
            if name == "parallel_vae_sync"
                && let Some(ordinal) = ordinal
                && let Some(e) = event(ordinal)
            {
                THREAD.with_borrow_mut(|t| t.marks.push((Instant::now(), e)));
            }
            let start = match ordinal {
                Some(ordinal) if events && EVENTED.contains(&name) => event(ordinal),
                _ => None,
            };
            let label = span.extensions().get::<(String, f64)>().cloned();
            span.extensions_mut().insert(Open {
                at: Instant::now(),
                start,
                label,
            });
        }

        fn on_exit(&self, id: &Id, ctx: Context<'_, S>) {
            let Some(span) = ctx.span(id) else { return };
            let name = span.name();
            let Some(open) = span.extensions_mut().remove::<Open>() else {
                return;
            };
            let ms = open.at.elapsed().as_secs_f64() * 1e3;
            THREAD.with_borrow_mut(|t| {
                let entry = t.host.entry(name).or_default();
                entry.0 += 1;
                entry.1 += ms;
                if let (Some(start), Some(ordinal)) = (open.start, t.ordinal)
                    && let Some(end) = event(ordinal)
                {
                    let (label, flops) = open.label.unwrap_or_else(|| (name.to_string(), 0.0));
                    t.timed.push((name, label, flops, start, end));
                }
            });
        }
    }
}

fn parse_dtype(name: &str) -> Result<DType> {
    match name {
        "bf16" => Ok(DType::BF16),
        "f32" => Ok(DType::F32),
        other => bail!("--dtype {other:?}: bf16 or f32"),
    }
}

fn parse_split(name: &str) -> Result<VaeSplitDim> {
    match name {
        "height" => Ok(VaeSplitDim::Height),
        "width" => Ok(VaeSplitDim::Width),
        other => bail!("--split {other:?}: height or width"),
    }
}

/// The Wan 2.1 VAE with `RandomWeights::new(seed)` on GPU `ordinal` in `dtype`.
fn build(ordinal: usize, dtype: DType, seed: u64) -> Result<WanVaeDecoder> {
    Ok(WanVaeDecoder::from_weights_on(
        VaeConfig::wan21(),
        &RandomWeights::new(seed),
        Device::Cuda(ordinal),
        dtype,
    )?)
}

/// The 1-GPU measurement on cuda:0; returns the summary and the pool peaks.
fn one_gpu(args: &Args, dtype: DType, latent_shape: &[usize]) -> Result<(Summary, (f64, f64))> {
    let pool = Pool::of(0)?;
    pool.keep(!args.release_pool)?;
    let t0 = Instant::now();
    let decoder = build(0, dtype, args.seed)?;
    let latent = Tensor::randn(latent_shape, dtype, args.seed + 1, Device::Cuda(0))?;
    println!(
        "Wan 2.1 VAE (base 96, z 16) {dtype:?} on cuda:0 from random weights in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    let frames = latent_shape[2];
    let warm = frames.min(3);
    for _ in 0..args.warmup {
        let t = Instant::now();
        decode_timed(&decoder, &latent, warm, &Unsharded, 0)?;
        println!(
            "warm-up: {warm} chunks in {:.1} s",
            t.elapsed().as_secs_f64()
        );
    }
    pool.reset_peaks()?;
    let mut runs = Vec::new();
    for i in 0..args.iters.max(1) {
        let run = decode_timed(&decoder, &latent, frames, &Unsharded, 0)?;
        println!(
            "iter {i}: {:.1} ms (wall {:.1} ms), first chunk {:.1} ms",
            run.total_ms, run.wall_ms, run.chunk_ms[0]
        );
        runs.push(run);
    }
    let peaks = pool.peaks_gib()?;
    if args.attention {
        attention_alone(latent_shape[3] * latent_shape[4], dtype)?;
    }
    if args.profile {
        profile(&decoder, &latent)?;
    }
    if let Some(chunk) = args.profiler_chunk {
        profiler_chunk(&decoder, &latent, chunk)?;
    }
    Ok((summarise(&runs)?, peaks))
}

/// One decode with every conv and the attention timed; prints where the time goes.
fn profile(decoder: &WanVaeDecoder, latent: &Tensor) -> Result<()> {
    let ops = TimedOps {
        ordinal: 0,
        calls: Mutex::new(Vec::new()),
    };
    let run = decode_timed(decoder, latent, latent.shape()[2], &ops, 0)?;
    let rows = ops.table()?;
    let total = run.total_ms;
    println!("profile (one decode with events around every conv and the attention: {total:.1} ms)");
    println!(
        "OP\top (weight kt x kh x kw, C_in->C_out, input H x W)\tcalls\tms\t% of decode\tTFLOP/s"
    );
    let (mut conv_ms, mut attn_ms) = (0.0, 0.0);
    for (label, calls, ms, flops) in &rows {
        if label.starts_with("attention") {
            attn_ms += ms;
        } else {
            conv_ms += ms;
        }
        println!(
            "OP\t{label}\t{calls}\t{ms:.1}\t{:.1}\t{:.1}",
            100.0 * ms / total,
            flops / (ms / 1e3) / 1e12
        );
    }
    let other = total - conv_ms - attn_ms;
    for (what, ms) in [
        ("convolutions (incl. their padding/cache copies)", conv_ms),
        ("mid-block attention", attn_ms),
        (
            "everything else (norms, SiLU, adds, upsample, concat, clamp, idle)",
            other,
        ),
    ] {
        println!("PROFILE\t{what}\t{ms:.1}\tms\t{:.1}\t%", 100.0 * ms / total);
    }
    Ok(())
}

/// The mid-block attention alone at one frame (q = k = v [1, S, 1, 384]): every kernel that takes it.
fn attention_alone(tokens: usize, dtype: DType) -> Result<()> {
    let dev = Device::Cuda(0);
    let q = Tensor::randn(&[1, tokens, 1, 384], dtype, 5, dev)?;
    let k = Tensor::randn(&[1, tokens, 1, 384], dtype, 6, dev)?;
    let v = Tensor::randn(&[1, tokens, 1, 384], dtype, 7, dev)?;
    let mut kernels = vec![(AttentionKernel::Portable, "portable".to_string())];
    if dtype == DType::BF16 {
        kernels.extend(
            FLASH_VARIANTS
                .iter()
                .enumerate()
                .filter(|(_, v)| v.head_dim == 384)
                .map(|(i, v)| (AttentionKernel::Flash(i), v.name.to_string())),
        );
        kernels.push((AttentionKernel::Auto, "auto".to_string()));
    }
    let flops = 4.0 * (tokens * tokens * 384) as f64;
    for (kernel, name) in kernels {
        let mut samples = Vec::new();
        for i in 0..6 {
            let start = event(0)?;
            with_attention_kernel(kernel, || {
                attention(&q, &k, &v, AttentionOptions::default())
            })?;
            let end = event(0)?;
            if i > 0 {
                samples.push(ms_between(&start, &end)?);
            }
        }
        let ms = median(&samples).context("no samples")?;
        println!(
            "ATTENTION\t{name}\t{dtype:?}\t(1,{tokens},1,384)\t{ms:.3}\tms/frame\t{:.1}\tTFLOP/s",
            flops / (ms / 1e3) / 1e12
        );
    }
    Ok(())
}

/// One rank's 2-GPU result.
struct RankRun {
    /// Per `--chunk-frames` entry, in order.
    summaries: Vec<Summary>,
    peaks: (f64, f64),
    /// `--profile`: the evented decode's total (ms) and its per-label rows (label, calls, ms, FLOPs).
    profile: Option<(f64, OpRows)>,
}

/// (label, calls, ms, FLOPs) per op label.
type OpRows = Vec<(String, usize, f64, f64)>;

/// (label, calls, ms, FLOPs) per conv label (convs) or span name (the rest), most time first, from
/// one evented decode's records.
fn evented_table(records: &clock::Thread) -> Result<OpRows> {
    let mut by_label: HashMap<String, (usize, f64, f64)> = HashMap::new();
    for (name, label, flops, start, end) in &records.timed {
        let key = match *name {
            "parallel_vae_conv" => label.clone(),
            "parallel_vae_halo" => "halo exchange + copies (inside the convs above)".to_string(),
            "parallel_vae_halo_nccl" => "halo NCCL swap alone (inside the above)".to_string(),
            "parallel_vae_attention" => "attention (incl. k/v gather)".to_string(),
            "parallel_vae_attention_gather" => {
                "attention k/v gather (inside the above)".to_string()
            }
            other => other.to_string(),
        };
        let entry = by_label.entry(key).or_default();
        entry.0 += 1;
        entry.1 += ms_between(start, end)?;
        entry.2 += flops;
    }
    let mut rows: Vec<_> = by_label
        .into_iter()
        .map(|(l, (n, ms, f))| (l, n, ms, f))
        .collect();
    rows.sort_by(|a, b| b.2.total_cmp(&a.2));
    Ok(rows)
}

/// The parallel decode on 2 GPUs; rank 0's and rank 1's results.
fn two_gpus(
    args: &Args,
    dtype: DType,
    split: VaeSplitDim,
    latent_shape: &[usize],
) -> Result<Vec<RankRun>> {
    let results = NcclWorld::run_local(2, NCCL_TIMEOUT, |world| -> Result<RankRun> {
        let rank = world.rank();
        let pool = Pool::of(rank)?;
        pool.keep(!args.release_pool)?;
        let decoder = Arc::new(build(rank, dtype, args.seed)?);
        let latent = Tensor::randn(latent_shape, dtype, args.seed + 1, Device::Cuda(rank))?;
        let comm = world.split(&[vec![0, 1]])?.context("not in the group")?;
        let frames = latent_shape[2];
        let (h, w) = (latent_shape[3], latent_shape[4]);
        // One decode of the first `n` latent frames. The ranks start together (the kernels' stream
        // drained, then a barrier); rank 0's events and wall clock end with its last gather.
        // `evented`: CUDA events at the edges of the sharded ops (the per-rank profile).
        let decode = |comm: NcclComm,
                      n: usize,
                      per_call: usize,
                      evented: bool|
         -> Result<(NcclComm, Run, clock::Thread)> {
            synchronize(rank)?;
            comm.barrier()?;
            let mut vae = ParallelVaeDecoder::new(decoder.clone(), comm, split);
            let mut stream = vae.new_stream(h, w)?;
            clock::start(rank, evented);
            let t0 = Instant::now();
            let start = event(rank)?;
            let calls = chunk_starts(n, per_call);
            let mut ends = Vec::with_capacity(calls.len());
            for &(t, len) in &calls {
                let band = stream.band_of(&latent.narrow(2, t, len)?)?;
                let frames = vae.decode_chunk(&mut stream, &band)?;
                drop(vae.gather_frames(&stream, &frames)?);
                ends.push(event(rank)?);
            }
            let end = Instant::now();
            synchronize(rank)?;
            let wall_ms = t0.elapsed().as_secs_f64() * 1e3;
            let records = clock::take();
            // Where the host finished queueing each chunk: the `parallel_vae_sync` span's entry.
            let queued: Vec<_> = records.marks.iter().map(|(at, e)| (*at, e)).collect();
            let breakdown = Breakdown::new(&records, (t0, &start), &queued, end, calls.len())?;
            let comm = vae
                .into_communicator()
                .context("the decoder failed earlier")?;
            comm.barrier()?; // no rank leaves while the other still gathers
            Ok((
                comm,
                Run::from_events(&start, &ends, wall_ms, breakdown)?,
                records,
            ))
        };
        let mut comm = comm;
        for _ in 0..args.warmup {
            comm = decode(comm, frames.min(3), 1, false)?.0;
        }
        pool.reset_peaks()?;
        let mut summaries = Vec::new();
        for &per_call in &args.chunk_frames {
            let mut runs = Vec::new();
            for _ in 0..args.iters.max(1) {
                let (back, run, _) = decode(comm, frames, per_call, false)?;
                comm = back;
                runs.push(run);
            }
            summaries.push(summarise(&runs)?);
        }
        let peaks = pool.peaks_gib()?;
        let profile = if args.profile {
            let per_call = args.chunk_frames.last().copied().unwrap_or(1);
            let (back, run, records) = decode(comm, frames, per_call, true)?;
            comm = back;
            Some((run.total_ms, evented_table(&records)?))
        } else {
            None
        };
        drop(comm);
        Ok(RankRun {
            summaries,
            peaks,
            profile,
        })
    })?;
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| {
            res.map_err(|e| anyhow::anyhow!("rank {r} did not start or panicked: {e}"))?
                .with_context(|| format!("rank {r}"))
        })
        .collect()
}

fn main() -> Result<()> {
    let args = Args::parse();
    // The GPU script's CUDA settings (kernel cache, CUDA headers, algorithm searches).
    ditstream_kernels::testing::configure_cuda()?;
    {
        use tracing_subscriber::layer::SubscriberExt;
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(clock::Layer))
            .context("installing the span clock")?;
    }
    let dtype = parse_dtype(&args.dtype)?;
    let split = parse_split(&args.split)?;
    if args.frames % 4 != 1 || args.height % 8 != 0 || args.width % 8 != 0 || args.frames == 0 {
        bail!(
            "--frames {} --height {} --width {}: frames must be 4k + 1 and height, width multiples of 8",
            args.frames,
            args.height,
            args.width
        );
    }
    if !(1..=2).contains(&args.gpus) {
        bail!("--gpus {}: 1 or 2", args.gpus);
    }
    let latent_shape = [
        1,
        16,
        (args.frames - 1) / 4 + 1,
        args.height / 8,
        args.width / 8,
    ];
    let label = format!(
        "{}x{}x{}f {}{}",
        args.height,
        args.width,
        args.frames,
        args.dtype,
        if args.release_pool {
            " release-pool"
        } else {
            ""
        }
    );
    println!("video {label} → latent {latent_shape:?}, one latent frame per chunk");

    let (one, (used, reserved)) = one_gpu(&args, dtype, &latent_shape)?;
    println!(
        "1 GPU: total {:.1} ms (wall {:.1} ms), first frame {:.1} ms, later chunks median {:.1} ms \
         (max {:.1}), peak {used:.2} GiB used / {reserved:.2} GiB reserved",
        one.total_ms, one.wall_ms, one.first_ms, one.later_median_ms, one.later_max_ms
    );
    println!(
        "RESULT\tours\t{label}\t1\t{:.1}\t{:.1}\t{:.1}\t{used:.2}\t{reserved:.2}",
        one.total_ms, one.first_ms, one.later_median_ms
    );
    println!(
        "BREAKDOWN\trun\tchunks\twall ms\tGPU ms\tqueueing\tagree\tattention k/v gather\t\
         waited halos\twaited halo count\tsync\tgather\tother\tGPU backlog\tqueued halos\t\
         queued halo host ms\tsharded convs"
    );
    one.breakdown.print("1gpu");

    if args.gpus == 2 {
        let ranks = two_gpus(&args, dtype, split, &latent_shape)?;
        // One block per --chunk-frames entry; the last is the headline (the script's summary keeps
        // the last RESULT and SPEEDUP line of a configuration).
        for (i, per_call) in args.chunk_frames.iter().enumerate() {
            let r0 = &ranks[0].summaries[i];
            for (r, rank) in ranks.iter().enumerate() {
                let run = &rank.summaries[i];
                println!(
                    "2 GPUs ({split:?} split, latent frame 0 alone, then {per_call} per call), rank {r}: \
                     total {:.1} ms (wall {:.1} ms), first frame {:.1} ms, later calls median {:.1} ms \
                     (max {:.1}), peak {:.2} GiB used / {:.2} GiB reserved",
                    run.total_ms,
                    run.wall_ms,
                    run.first_ms,
                    run.later_median_ms,
                    run.later_max_ms,
                    rank.peaks.0,
                    rank.peaks.1
                );
            }
            println!(
                "RESULT\tours\t{label}\t2\t{:.1}\t{:.1}\t{:.1}\t{:.2}\t{:.2}\t{per_call}",
                r0.total_ms, r0.first_ms, r0.later_median_ms, ranks[0].peaks.0, ranks[0].peaks.1
            );
            println!(
                "SPEEDUP\t{label}\t{:.1}\t{:.1}\t{:.2}\t{per_call}",
                one.total_ms,
                r0.total_ms,
                one.total_ms / r0.total_ms
            );
            for (r, rank) in ranks.iter().enumerate() {
                rank.summaries[i]
                    .breakdown
                    .print(&format!("2gpu-rank{r}-x{per_call}"));
            }
        }
        for (r, rank) in ranks.iter().enumerate() {
            let Some((total, rows)) = &rank.profile else {
                continue;
            };
            print_profile2(r, *total, rows);
        }
        if args.profile {
            // cuDNN's choice per conv shape: GPU 0 holds the full shapes (1 GPU) and rank 0's bands,
            // GPU 1 rank 1's bands.
            for ordinal in 0..2 {
                for plan in cudnn_conv_plans(ordinal)? {
                    println!("PLAN\tcuda:{ordinal}\t{plan}");
                }
            }
        }
    }
    if args.launches {
        // Last: the capture leaves allocations of a graph that never runs (see count_launches).
        let code = match count_launches(&args, dtype, &latent_shape) {
            Ok(()) => 0,
            Err(e) => {
                println!("LAUNCHES\tunavailable\t{e:#}");
                0
            }
        };
        std::process::exit(code);
    }
    Ok(())
}

/// The per-rank profile of the evented 2-GPU decode (`OP2` lines, most time first).
fn print_profile2(rank: usize, total: f64, rows: &[(String, usize, f64, f64)]) {
    println!(
        "profile, 2 GPUs, rank {rank} (one decode with events around every sharded conv, halo \
         exchange and the attention: {total:.1} ms)"
    );
    let (mut conv_ms, mut attn_ms, mut halo_ms, mut kv_ms) = (0.0, 0.0, 0.0, 0.0);
    let mut nccl_ms = 0.0;
    for (label, calls, ms, flops) in rows {
        if label.starts_with("conv") {
            conv_ms += ms;
        } else if label.starts_with("attention (") {
            attn_ms += ms;
        } else if label.starts_with("halo NCCL") {
            nccl_ms += ms;
        } else if label.starts_with("halo") {
            halo_ms += ms;
        } else if label.starts_with("attention k/v") {
            kv_ms += ms;
        }
        let tflops = if *flops > 0.0 {
            format!("{:.1}", flops / (ms / 1e3) / 1e12)
        } else {
            "-".to_string()
        };
        println!(
            "OP2\trank{rank}\t{label}\t{calls}\t{ms:.1}\t{:.1}\t{tflops}",
            100.0 * ms / total
        );
    }
    let other = total - conv_ms - attn_ms;
    for (what, ms) in [
        ("convolutions (incl. halo exchange and copies)", conv_ms),
        ("  of which halo exchange + copies", halo_ms),
        ("    of which the NCCL swap alone", nccl_ms),
        ("mid-block attention (incl. k/v gather)", attn_ms),
        ("  of which k/v gather", kv_ms),
        (
            "everything else (norms, SiLU, upsample, concat, clamp, idle)",
            other,
        ),
    ] {
        println!(
            "PROFILE2\trank{rank}\t{what}\t{ms:.1}\tms\t{:.1}\t%",
            100.0 * ms / total
        );
    }
}

/// The GPU work items of one steady-state 1-GPU chunk (module docs): the chunk after three warm
/// chunks (every shape planned, caches full) is queued under a relaxed stream capture of the kernels'
/// stream into a CUDA graph, whose nodes are counted by type (`LAUNCHES` lines). The graph never
/// runs: the capture's allocations are graph memory that must not be freed outside it, so the
/// chunk's outputs are leaked and the caller exits right after.
fn count_launches(args: &Args, dtype: DType, latent_shape: &[usize]) -> Result<()> {
    let decoder = build(0, dtype, args.seed)?;
    let latent = Tensor::randn(latent_shape, dtype, args.seed + 1, Device::Cuda(0))?;
    let frames = latent_shape[2];
    ensure!(frames >= 2, "--launches needs at least 2 latent frames");
    let warm = (frames - 1).min(3);
    let mut stream = decoder.new_stream(latent_shape[3], latent_shape[4])?;
    for t in 0..warm {
        drop(decoder.decode_chunk(&mut stream, &latent.narrow(2, t, 1)?)?);
    }
    let chunk = latent.narrow(2, warm, 1)?;
    synchronize(0)?;
    let cu_stream = cuda_stream(0)?.cu_stream();
    // SAFETY: the kernels' stream of cuda:0, drained; this thread queues the chunk and ends the
    // capture itself, and nothing else uses the GPU meanwhile.
    let code = unsafe {
        cu::cuStreamBeginCapture_v2(
            cu_stream,
            cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        )
    };
    check(code, "cuStreamBeginCapture")?;
    let mut probe = stream.clone(); // the captured caches go into the probe, never freed
    let t = Instant::now();
    let out = decoder.decode_chunk(&mut probe, &chunk);
    let host_ms = t.elapsed().as_secs_f64() * 1e3;
    let mut graph: cu::CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above on the same stream; `graph` is a valid out-pointer.
    let end = unsafe { cu::cuStreamEndCapture(cu_stream, &mut graph) };
    std::mem::forget(probe);
    let out = out?;
    std::mem::forget(out);
    check(end, "cuStreamEndCapture")?;
    let mut n: usize = 0;
    // SAFETY: a null node array asks for the count only.
    let code = unsafe { cu::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) };
    check(code, "cuGraphGetNodes")?;
    let mut nodes: Vec<cu::CUgraphNode> = vec![std::ptr::null_mut(); n];
    // SAFETY: `nodes` has room for `n` handles.
    let code = unsafe { cu::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) };
    check(code, "cuGraphGetNodes")?;
    let mut by_type: BTreeMap<String, usize> = BTreeMap::new();
    for node in nodes.iter().take(n) {
        let mut kind = cu::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` is a node of `graph`; `kind` a valid out-pointer.
        let code = unsafe { cu::cuGraphNodeGetType(*node, &mut kind) };
        check(code, "cuGraphNodeGetType")?;
        *by_type.entry(format!("{kind:?}")).or_default() += 1;
    }
    println!(
        "one steady-state 1-GPU chunk (latent frame {warm}): {n} GPU work items, queued in {host_ms:.1} ms \
         of host time under capture"
    );
    for (kind, count) in &by_type {
        println!("LAUNCHES\t{kind}\t{count}");
    }
    Ok(())
}
