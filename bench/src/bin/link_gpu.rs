//! Per-chunk latency of each latent-link backend between two GPUs of one host, through the pools'
//! own link layer (`ditstream::roles::link`): a denoiser-side connection sends a latent that lives on
//! `cuda:0`, a decoder-side listener hands it to its request, and the time runs until the frames are
//! on `cuda:1`, where the decoder's VAE reads them. So QUIC and UCX (host-staged) pay the device →
//! host copy on the sender and the host → device copy on the receiver, as in the service; NCCL sends
//! GPU to GPU (plus its checksum copies, see `roles::nccl_link`). Both ends are in this process
//! (one clock), on loopback.
//!
//! Per link: one 480p latent frame ([1, 16, 1, 60, 104] f32, 399 KB) per chunk, median and p90 of
//! `--chunks` sends, each waited for before the next; and a whole 81-frame latent (21 chunks) handed
//! over in one request.
//!
//! `target/gpu/link_gpu [--chunks 50]` (built by scripts/build-gpu-link.sh; 2 GPUs).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Parser;
use ditstream::roles::link::{self, Delivery, Pending};
use ditstream_bench::median;
use ditstream_common::config::Config;
use ditstream_common::link::quic::PoolCa;
use ditstream_kernels::{DType, Device, Tensor};
use tokio::sync::mpsc;

#[derive(Parser)]
struct Args {
    /// Single-frame chunks timed per link.
    #[arg(long, default_value_t = 50)]
    chunks: usize,
}

/// The frames of `arrived` on `cuda:1`, complete (the decoder's input).
fn on_decoder_gpu(d: Delivery) -> anyhow::Result<Tensor> {
    let t = d?.latent.to_device(Device::Cuda(1))?;
    ditstream_kernels::cuda::synchronize(1)?;
    Ok(t)
}

struct Timing {
    median_ms: f64,
    p90_ms: f64,
    whole_ms: f64,
}

async fn time_link(kind: &str, args: &Args) -> anyhow::Result<Timing> {
    let ca = PoolCa::generate("bench")?;
    let identity = ca.issue("localhost")?;
    let cfg = Config::parse(
        &format!("model: {{preset: tiny}}\npools: {{link: {kind}}}\n"),
        "bench",
    )?;
    let pending: Pending = Arc::default();
    let (at, _task) = link::listen(&cfg, &identity, Arc::clone(&pending), 1).await?;
    let conn = link::Connection::connect(kind, at, "localhost", &identity, 0).await?;
    let register = |id: &str| {
        let (tx, rx) = mpsc::channel::<Delivery>(64);
        pending
            .lock()
            .map_err(|_| anyhow::anyhow!("pending map poisoned"))?
            .insert(id.to_string(), tx);
        Ok::<_, anyhow::Error>(rx)
    };
    let frame = Tensor::randn(&[1, 16, 1, 60, 104], DType::F32, 7, Device::Cuda(0))?;
    let whole = Tensor::randn(&[1, 16, 21, 60, 104], DType::F32, 8, Device::Cuda(0))?;
    ditstream_kernels::cuda::synchronize(0)?;

    let mut samples = Vec::with_capacity(args.chunks);
    for i in 0..args.chunks + 3 {
        let id = format!("c{i}");
        let mut rx = register(&id)?;
        let sent = Instant::now();
        conn.send_latent(&id, &frame).await?;
        let got = on_decoder_gpu(rx.recv().await.context("link closed")?)?;
        let ms = sent.elapsed().as_secs_f64() * 1e3;
        if i >= 3 {
            samples.push(ms); // the first sends warm the connection and the allocators
        }
        if i == 0 && got.to_vec_f32()? != frame.to_vec_f32()? {
            bail!("{kind}: the frame arrived changed");
        }
    }
    let mut rx = register("whole")?;
    let sent = Instant::now();
    conn.send_latent("whole", &whole).await?;
    for _ in 0..21 {
        on_decoder_gpu(rx.recv().await.context("link closed")?)?;
    }
    let whole_ms = sent.elapsed().as_secs_f64() * 1e3;
    samples.sort_by(f64::total_cmp);
    Ok(Timing {
        median_ms: median(&samples).unwrap_or(f64::NAN),
        p90_ms: samples[(samples.len() * 9 / 10).min(samples.len() - 1)],
        whole_ms,
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.chunks == 0 {
        bail!("--chunks = 0: time at least one chunk");
    }
    let found = ditstream_kernels::cuda::cuda_device_count()?;
    if found < 2 {
        bail!("link_gpu needs 2 GPUs (cuda:0 sends, cuda:1 receives); found {found}");
    }
    let kinds: &[&str] = if cfg!(feature = "ucx") {
        &["quic", "ucx", "nccl"]
    } else {
        &["quic", "nccl"]
    };
    let mut rows = Vec::new();
    for kind in kinds {
        match time_link(kind, &args).await {
            Ok(t) => rows.push((kind, Some(t), String::new())),
            Err(e) => rows.push((kind, None, format!("{e:#}"))),
        }
    }
    println!(
        "\nlatent link, cuda:0 → cuda:1 (f32 latent; 1 frame = 399 KB; {} chunks)",
        args.chunks
    );
    println!(
        "{:<6} {:>12} {:>12} {:>22}",
        "link", "median ms", "p90 ms", "81f latent (21 ch) ms"
    );
    for (kind, t, err) in &rows {
        match t {
            Some(t) => println!(
                "{kind:<6} {:>12.3} {:>12.3} {:>22.2}",
                t.median_ms, t.p90_ms, t.whole_ms
            ),
            None => println!("{kind:<6} failed: {err}"),
        }
    }
    if rows.iter().any(|(_, t, _)| t.is_none()) {
        bail!("a link failed");
    }
    Ok(())
}
