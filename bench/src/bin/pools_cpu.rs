//! The disaggregated pipeline on the CPU, measured against the sequential one:
//! - back-to-back throughput: K requests submitted at once to `serve`'s single engine (denoise then
//!   decode, one request after the other) and to a gateway with one denoiser pool and one decoder
//!   instance (the denoiser takes request N+1 as soon as N's latent is handed over);
//! - time to first segment after the denoising loop ends (first segment − queue − text − denoise);
//! - per-chunk latency of each latent-link backend on loopback, for one 480p latent frame.
//!
//! `cargo run --release -p ditstream-bench --bin pools_cpu [--features ucx] -- --requests 4`
//! Pools and engine share the machine's cores here, so this shows the mechanism, not GPU numbers.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use ditstream::gateway;
use ditstream::roles::{decoder, denoiser, write_certs};
use ditstream_bench::median;
use ditstream_common::config::Config;
use ditstream_common::link::LatentChunk;
use ditstream_common::link::quic;
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
}

fn config(gateway: &str) -> anyhow::Result<Config> {
    let yaml = format!(
        "model:\n  preset: tiny\nsampler:\n  steps: 8\n  shift: 3.0\nserving:\n  width: 256\n  height: 160\n  \
         num_frames: 17\n  queue_depth: 64\npools:\n  gateway: {gateway}\n  tls_ca: certs/ca.pem\n  \
         tls_cert: certs/pool.pem\n  tls_key: certs/pool-key.pem\n"
    );
    let cfg = Config::parse(&yaml, "<bench>")?;
    cfg.validate(None)?;
    Ok(cfg)
}

/// What one request reported.
struct Outcome {
    /// Gateway/engine timings.
    timings: pb::Timings,
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

fn summary(name: &str, k: usize, elapsed: Duration, outcomes: &[Outcome]) -> (f64, f64) {
    let denoise: Vec<f64> = outcomes
        .iter()
        .map(|o| o.timings.denoise_ms + o.timings.text_ms)
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
    let t_denoise = median(&denoise).unwrap_or(0.0) / 1e3;
    let throughput = k as f64 / elapsed.as_secs_f64();
    println!(
        "{name:<12} {k} requests in {:.2} s: {throughput:.3} req/s; T_denoise {t_denoise:.2} s → {:.2} × 1/T_denoise; \
         first segment {:.0} ms after the loop ends (median)",
        elapsed.as_secs_f64(),
        throughput * t_denoise,
        median(&after).unwrap_or(0.0),
    );
    (throughput, t_denoise)
}

/// One-way latency of one chunk over QUIC on loopback (same clock on both ends).
async fn quic_latency(chunk: &LatentChunk, n: usize) -> anyhow::Result<f64> {
    let ca = quic::PoolCa::generate("bench")?;
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

    // Sequential: one engine, denoise then decode per request.
    let cfg = config("127.0.0.1:1")?;
    let serve = ditstream::serve::start(cfg, "127.0.0.1:0".parse()?).await?;
    run_all(&serve.addr.to_string(), 1).await?; // warm-up (weights, caches)
    let (elapsed, outcomes) = run_all(&serve.addr.to_string(), args.requests).await?;
    let (seq, _) = summary("sequential", args.requests, elapsed, &outcomes);
    serve.stop().await?;

    // Pools: gateway + one denoiser pool + one decoder instance, QUIC link.
    let gw = gateway::start(&config("127.0.0.1:1")?, "127.0.0.1:0".parse()?).await?;
    let cfg = config(&gw.addr.to_string())?;
    let _dn = denoiser::start(&cfg, Path::new(&dir)).await?;
    let _dc = decoder::start(&cfg, Path::new(&dir)).await?;
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
    run_all(&addr, 1).await?; // warm-up
    let (elapsed, outcomes) = run_all(&addr, args.requests).await?;
    let (pools, _) = summary("pools", args.requests, elapsed, &outcomes);
    println!("pools / sequential throughput: {:.2}×", pools / seq);

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
