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
//! `--profile` decodes once more with CUDA events around every convolution and the frame attention
//! (through the decoder's `SpatialOps` seam, no model change): time per conv shape with its
//! TFLOP/s (labels "+up2" / "+res": the upsamplers' conv reading the ×2 upsampling in place, the
//! residual blocks' last conv with the add in its epilogue), attention, and the rest (RMS norms with
//! their SiLU, the remaining adds, concatenations, clamp, and any GPU idle time between ops). `--attention` times the mid-block attention kernels alone at the
//! frame's token count (one head of 384).
//!
//! Warm-up (`--warmup N`): N decodes of the first min(3, T) latent frames of a fresh stream: chunks 0,
//! 1 and 2 hit every distinct shape (cache of 0, 1, 2 frames; time_conv skipped, zero-padded, cached),
//! so they compile every kernel, plan every GEMM and grow the memory pool to the per-chunk peak; later
//! chunks repeat chunk 2's shapes. The pool keeps its memory between iterations (release threshold
//! raised to the maximum, as torch's caching allocator keeps its blocks) unless `--release-pool`:
//! with the driver's default (0) the pool returns all free memory at every synchronisation and the next
//! chunk maps it again.

use std::collections::HashMap;
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
    AttentionKernel, FLASH_VARIANTS, cuda_stream, synchronize, with_attention_kernel,
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
}

impl Run {
    fn from_events(start: &CudaEvent, ends: &[CudaEvent], wall_ms: f64) -> Result<Run> {
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
        })
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
    let t0 = Instant::now();
    let start = event(ordinal)?;
    let mut ends = Vec::with_capacity(frames);
    for t in 0..frames {
        let chunk = latent.narrow(2, t, 1)?;
        // The frames would go to the encoder; dropping them frees their memory, stream-ordered.
        drop(decoder.decode_chunk_with(&mut stream, &chunk, ops)?);
        ends.push(event(ordinal)?);
    }
    synchronize(ordinal)?;
    let wall_ms = t0.elapsed().as_secs_f64() * 1e3;
    Run::from_events(&start, &ends, wall_ms)
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
    summary: Summary,
    peaks: (f64, f64),
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
        let decode = |comm: NcclComm, n: usize| -> Result<(NcclComm, Run)> {
            synchronize(rank)?;
            comm.barrier()?;
            let mut vae = ParallelVaeDecoder::new(decoder.clone(), comm, split);
            let mut stream = vae.new_stream(h, w)?;
            let t0 = Instant::now();
            let start = event(rank)?;
            let mut ends = Vec::with_capacity(n);
            for t in 0..n {
                let band = stream.band_of(&latent.narrow(2, t, 1)?)?;
                let frames = vae.decode_chunk(&mut stream, &band)?;
                drop(vae.gather_frames(&stream, &frames)?);
                ends.push(event(rank)?);
            }
            synchronize(rank)?;
            let wall_ms = t0.elapsed().as_secs_f64() * 1e3;
            let comm = vae
                .into_communicator()
                .context("the decoder failed earlier")?;
            comm.barrier()?; // no rank leaves while the other still gathers
            Ok((comm, Run::from_events(&start, &ends, wall_ms)?))
        };
        let mut comm = comm;
        for _ in 0..args.warmup {
            comm = decode(comm, frames.min(3))?.0;
        }
        pool.reset_peaks()?;
        let mut runs = Vec::new();
        for _ in 0..args.iters.max(1) {
            let (back, run) = decode(comm, frames)?;
            comm = back;
            runs.push(run);
        }
        drop(comm);
        Ok(RankRun {
            summary: summarise(&runs)?,
            peaks: pool.peaks_gib()?,
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

    if args.gpus == 2 {
        let ranks = two_gpus(&args, dtype, split, &latent_shape)?;
        let r0 = &ranks[0];
        let speedup = one.total_ms / r0.summary.total_ms;
        for (r, rank) in ranks.iter().enumerate() {
            println!(
                "2 GPUs ({:?} split), rank {r}: total {:.1} ms (wall {:.1} ms), first frame {:.1} ms, \
                 later chunks median {:.1} ms (max {:.1}), peak {:.2} GiB used / {:.2} GiB reserved",
                split,
                rank.summary.total_ms,
                rank.summary.wall_ms,
                rank.summary.first_ms,
                rank.summary.later_median_ms,
                rank.summary.later_max_ms,
                rank.peaks.0,
                rank.peaks.1
            );
        }
        println!(
            "RESULT\tours\t{label}\t2\t{:.1}\t{:.1}\t{:.1}\t{:.2}\t{:.2}",
            r0.summary.total_ms,
            r0.summary.first_ms,
            r0.summary.later_median_ms,
            r0.peaks.0,
            r0.peaks.1
        );
        println!(
            "SPEEDUP\t{label}\t{:.1}\t{:.1}\t{speedup:.2}",
            one.total_ms, r0.summary.total_ms
        );
    }
    Ok(())
}
