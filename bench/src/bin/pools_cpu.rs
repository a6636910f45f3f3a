//! The request pipeline on the CPU:
//! - back-to-back throughput: K requests submitted at once to `serve` (the gateway with its
//!   denoiser pool and decoder instance in one process, in-process latent link) and to a gateway
//!   with one denoiser pool and one decoder instance talking gRPC and QUIC over loopback. Either
//!   way the denoiser takes request N+1 as soon as N's latent is handed over, so decode(N)
//!   overlaps denoise(N+1). Steady state is the rate at which requests complete after the first
//!   (K − 1 requests over the time from the first completion to the last), against 1/T_denoise
//!   with T_denoise (text + loop) of one request measured alone just before;
//! - time to first segment after the denoising loop ends (first segment − queue − text − denoise);
//! - per-chunk latency of each latent-link backend on loopback, for one 480p latent frame.
//!
//! `cargo run --release -p ditstream-bench --bin pools_cpu [--features ucx] -- --requests 4`
//! Pools and denoiser share the machine's cores here: steady state reaches 1/T_denoise only where
//! decoding a request takes less than denoising one (pick `--steps`, `--width`, `--height`,
//! `--frames` so), the work a GPU pair splits; `--encoder-threads 0` keeps the decoder on one core.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use ditstream::gateway;
use ditstream::roles::write_certs;
use ditstream_bench::median;
use ditstream_common::config::Config;
use ditstream_common::link::LatentChunk;
use ditstream_common::link::quic;
use ditstream_decoder::service as decoder;
use ditstream_denoiser::service as denoiser;
use ditstream_proto::v1 as pb;
use ditstream_proto::v1::video_service_client::VideoServiceClient;

#[derive(Parser)]
struct Args {
    /// Back-to-back requests per run.
    #[arg(long, default_value_t = 4)]
    requests: usize,
    /// Chunks timed per link backend.
    #[arg(long, default_value_t = 50)]
    chunks: usize,
    /// Denoising steps per request.
    #[arg(long, default_value_t = 8)]
    steps: usize,
    /// Video width.
    #[arg(long, default_value_t = 256)]
    width: usize,
    /// Video height.
    #[arg(long, default_value_t = 160)]
    height: usize,
    /// Video frames (4k+1).
    #[arg(long, default_value_t = 17)]
    frames: usize,
    /// The decoder's encoder threads (`serving.encoder_threads`; 0 encodes on the VAE's thread,
    /// so the decoder takes one core and the denoiser keeps the other).
    #[arg(long)]
    encoder_threads: Option<usize>,
}

/// The bench's deployment config; `certs` holds what `ditstream certs` writes.
fn config(args: &Args, gateway: &str, certs: &Path) -> anyhow::Result<Config> {
    let c = certs.display();
    let yaml = format!(
        "model:\n  preset: tiny\nsampler:\n  steps: {}\n  shift: 3.0\nserving:\n  width: {}\n  height: {}\n  \
         num_frames: {}\n  queue_depth: 64\n{}pools:\n  gateway: {gateway}\n  registry_listen: 127.0.0.1:0\n  \
         tls_ca: {c}/ca.pem\n  tls_cert: {c}/pool.pem\n  tls_key: {c}/pool-key.pem\n",
        args.steps,
        args.width,
        args.height,
        args.frames,
        args.encoder_threads
            .map_or(String::new(), |n| format!("  encoder_threads: {n}\n")),
    );
    let cfg = Config::parse(&yaml, "<bench>")?;
    cfg.validate(None)?;
    Ok(cfg)
}

/// What one request reported.
struct Outcome {
    /// The gateway's timings.
    timings: pb::Timings,
    /// When it completed, from the submission of the batch.
    done: Duration,
}

async fn run_all(addr: &str, k: usize) -> anyhow::Result<(Duration, Vec<Outcome>)> {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..k {
        let endpoint = format!("http://{addr}");
        tasks.push(tokio::spawn(async move {
            let mut client = VideoServiceClient::connect(endpoint)
                .await?
                .max_decoding_message_size(64 << 20);
            let req = pb::GenerateRequest {
                prompt: format!("request {i}"),
                seed: Some(i as u64),
                ..Default::default()
            };
            let mut stream = client.generate(req).await?.into_inner();
            while let Some(e) = stream.message().await? {
                if let Some(pb::generate_event::Event::Completed(done)) = e.event {
                    return Ok::<_, anyhow::Error>(Outcome {
                        timings: done.timings.unwrap_or_default(),
                        done: start.elapsed(),
                    });
                }
            }
            anyhow::bail!("stream ended without Completed")
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await??);
    }
    Ok((start.elapsed(), out))
}

/// Text + denoise of one request run alone (after a warm-up), seconds.
async fn alone(addr: &str) -> anyhow::Result<f64> {
    run_all(addr, 1).await?; // warm-up (weights, caches)
    let (_, one) = run_all(addr, 1).await?;
    let t = &one[0].timings;
    Ok((t.text_ms + t.denoise_ms) / 1e3)
}

/// Prints one run's line; returns its steady-state rate × T_denoise (alone).
fn summary(name: &str, k: usize, elapsed: Duration, t_alone: f64, outcomes: &[Outcome]) -> f64 {
    let mut done: Vec<f64> = outcomes.iter().map(|o| o.done.as_secs_f64()).collect();
    done.sort_by(f64::total_cmp);
    let steady = (k - 1) as f64 / (done[k - 1] - done[0]);
    let denoise: Vec<f64> = outcomes
        .iter()
        .map(|o| (o.timings.denoise_ms + o.timings.text_ms) / 1e3)
        .collect();
    let decode: Vec<f64> = outcomes
        .iter()
        .map(|o| (o.timings.decode_ms + o.timings.encode_ms) / 1e3)
        .collect();
    let after: Vec<f64> = outcomes
        .iter()
        .map(|o| {
            o.timings.first_segment_ms
                - o.timings.queue_ms
                - o.timings.text_ms
                - o.timings.denoise_ms
        })
        .collect();
    // All were accepted at once: request i held the denoiser from queue_ms to the end of its
    // loop. Busy time over the span from the first start to the last end is 1.0 exactly when
    // the denoiser never waited (every decode overlapped the next denoise).
    let spans: Vec<(f64, f64)> = outcomes
        .iter()
        .map(|o| {
            let t = &o.timings;
            (t.queue_ms, t.queue_ms + t.text_ms + t.denoise_ms)
        })
        .collect();
    let first = spans.iter().map(|s| s.0).fold(f64::INFINITY, f64::min);
    let last = spans.iter().map(|s| s.1).fold(0.0, f64::max);
    let busy = spans.iter().map(|s| s.1 - s.0).sum::<f64>() / (last - first);
    println!(
        "{name:<6} {k} requests in {:.2} s; steady state {steady:.3} req/s = {:.2} × 1/T_denoise \
         (T_denoise alone {t_alone:.2} s), {:.2} × 1/T_denoise of the run; denoiser busy {busy:.3} \
         of its span; in the run: text + denoise {:.2} s, decode + encode {:.2} s (medians); first \
         segment {:.0} ms after the loop ends",
        elapsed.as_secs_f64(),
        steady * t_alone,
        steady * median(&denoise).unwrap_or(0.0),
        median(&denoise).unwrap_or(0.0),
        median(&decode).unwrap_or(0.0),
        median(&after).unwrap_or(0.0),
    );
    steady * t_alone
}

/// One-way latency of one chunk over QUIC on loopback (same clock on both ends).
async fn quic_latency(chunk: &LatentChunk, n: usize) -> anyhow::Result<f64> {
    let ca = ditstream_common::tls::PoolCa::generate("bench")?;
    let server = quic::listen("127.0.0.1:0".parse()?, &ca.issue("localhost")?)?;
    let addr = server.local_addr()?;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Instant>(n);
    tokio::spawn(async move {
        let conn = server.accept().await.context("no connection")?.await?;
        let mut streams = quic::ChunkReceiver::accept(&conn)
            .await?
            .context("no stream")?;
        while let Some(_chunk) = streams.next().await? {
            tx.send(Instant::now()).await?;
        }
        Ok::<_, anyhow::Error>(())
    });
    let conn = quic::connect(addr, "localhost", &ca.issue("d")?).await?;
    let mut sender = quic::ChunkSender::open(&conn).await?;
    let mut samples = Vec::new();
    for _ in 0..n {
        let sent = Instant::now();
        sender.send(chunk).await?;
        let got = rx.recv().await.context("receiver stopped")?;
        samples.push((got - sent).as_secs_f64() * 1e3);
    }
    Ok(median(&samples).unwrap_or(0.0))
}

#[cfg(feature = "ucx")]
async fn ucx_latency(chunk: &LatentChunk, n: usize) -> anyhow::Result<Option<f64>> {
    use ditstream_common::link::ucx;
    let listener = ucx::listen("127.0.0.1:0".parse()?, &ucx::UcxConfig::default())?;
    let addr = listener.local_addr();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Instant>(n);
    tokio::spawn(async move {
        let conn = listener.accept().await?;
        let mut stream = ucx::ChunkReceiver::accept(&conn)
            .await?
            .context("no stream")?;
        while let Some(_chunk) = stream.next().await? {
            tx.send(Instant::now()).await?;
        }
        Ok::<_, anyhow::Error>(())
    });
    let conn = ucx::connect(addr, &ucx::UcxConfig::default()).await?;
    let mut sender = ucx::ChunkSender::open(&conn);
    let mut samples = Vec::new();
    for _ in 0..n {
        let sent = Instant::now();
        sender.send(chunk.clone()).await?;
        let got = rx.recv().await.context("receiver stopped")?;
        samples.push((got - sent).as_secs_f64() * 1e3);
    }
    Ok(Some(median(&samples).unwrap_or(0.0)))
}

#[cfg(not(feature = "ucx"))]
async fn ucx_latency(_: &LatentChunk, _: usize) -> anyhow::Result<Option<f64>> {
    Ok(None)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = std::env::temp_dir().join(format!("ditstream-bench-pools-{}", std::process::id()));
    write_certs(
        &dir.join("certs"),
        &["localhost".to_string(), "127.0.0.1".to_string()],
    )?;

    // serve: the gateway and both pools in one process.
    let serve = ditstream::serve::start(
        config(&args, "127.0.0.1:1", &dir.join("certs"))?,
        "127.0.0.1:0".parse()?,
    )
    .await?;
    let addr = serve.addr.to_string();
    let t_alone = alone(&addr).await?;
    let (elapsed, outcomes) = run_all(&addr, args.requests).await?;
    summary("serve", args.requests, elapsed, t_alone, &outcomes);
    serve.stop().await?;

    // Pools: gateway + one denoiser pool + one decoder instance, gRPC and QUIC over loopback.
    let certs = dir.join("certs");
    let gw = gateway::start(
        &config(&args, "127.0.0.1:1", &certs)?,
        "127.0.0.1:0".parse()?,
        None,
    )
    .await?;
    let registry = gw.registry_addr.context("the gateway has a registry")?;
    let cfg = config(&args, &registry.to_string(), &certs)?;
    let _dn = denoiser::start(&cfg).await?;
    let _dc = decoder::start(&cfg).await?;
    let addr = gw.addr.to_string();
    let mut client = VideoServiceClient::connect(format!("http://{addr}")).await?;
    while !client
        .health(pb::HealthRequest {})
        .await?
        .into_inner()
        .serving
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let t_alone = alone(&addr).await?;
    let (elapsed, outcomes) = run_all(&addr, args.requests).await?;
    summary("pools", args.requests, elapsed, t_alone, &outcomes);

    // Latent link, one 480p latent frame [1, 16, 1, 60, 104] f32 (399 KB).
    let values: Vec<f32> = (0..16 * 60 * 104)
        .map(|i| (i as f32 * 1e-3).sin())
        .collect();
    let chunk = LatentChunk::from_f32("bench", 0, 0, false, &[1, 16, 1, 60, 104], &values)?;
    let q = quic_latency(&chunk, args.chunks).await?;
    println!(
        "link quic    one 480p latent frame (399 KB): {q:.2} ms per chunk (median of {})",
        args.chunks
    );
    match ucx_latency(&chunk, args.chunks).await? {
        Some(u) => println!(
            "link ucx     one 480p latent frame (399 KB): {u:.2} ms per chunk (median of {})",
            args.chunks
        ),
        None => println!("link ucx     not built (run with --features ucx)"),
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
