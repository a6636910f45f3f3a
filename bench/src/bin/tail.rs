//! The streaming tail (issue 22's benchmark), in one process on one GPU:
//!
//! - `--mode start`: `serve` started at the first of `--sizes` (warm-up included,
//!   `serving.warmup` = the default shape),
//!   then two requests one after the other: the first after start against the second (target:
//!   within 1.1×), and the start time itself. Run it twice in a row on a machine whose plan
//!   cache is empty (`scripts/gpu-tail.sh` does): the first start searches cuDNN's plans and
//!   writes them, the second (a restart) reads them.
//! - `--mode tail`: the decoder stage alone at each of `--sizes`, 81 frames, a seeded random
//!   latent already there (as when the denoising loop has just ended), decoded one latent frame
//!   per chunk: **decode alone** (the VAE, frames copied to the host, nothing encoded),
//!   **sequential** (`serving.encoder_threads: 0`: each segment encoded on the VAE's thread as
//!   it completes, today's path before the pool) and **pool** (the default: segments encoded on
//!   the encoder threads beside the VAE). For each: the wall time from the first chunk to the
//!   last segment encoded (the streaming tail, since the latent is all there) and to the first
//!   segment (time to first segment after the loop), median of `--iters` after one warm-up.
//!   Targets: pool ≤ 1.1× decode alone.
//!
//! Model: `--preset` (Wan2.1-T2V-1.3B) with random weights in bf16 (its VAE for `tail`).
//! Lines starting with `TAIL` and `START` are for scripts/gpu-tail.sh's table.

use std::sync::mpsc;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Parser;
use ditstream_bench::median;
use ditstream_common::config::Config;
use ditstream_decoder::stage::{DecodeJob, DecodeStage};
use ditstream_kernels::{DType, Device, Tensor};
use ditstream_proto::v1 as pb;
use ditstream_proto::v1::video_service_client::VideoServiceClient;

#[derive(Parser)]
#[command(about = "the streaming tail and the first request after start (issue 22)")]
struct Args {
    /// `start` (serve: start time, first request against the second) or `tail` (the decoder).
    #[arg(long)]
    mode: String,
    /// Video sizes for `tail`, WxH, comma-separated.
    #[arg(long, default_value = "832x480,1280x720", value_delimiter = ',')]
    sizes: Vec<String>,
    /// Frames per video.
    #[arg(long, default_value_t = 81)]
    frames: usize,
    /// Timed runs per configuration (`tail`), after one warm-up.
    #[arg(long, default_value_t = 3)]
    iters: usize,
    /// Sampler steps per request (`start`).
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Model preset (random weights).
    #[arg(long, default_value = "wan2.1-t2v-1.3b")]
    preset: String,
    /// `cuda`, or `cpu` for a smoke run of this driver (with `--preset tiny`).
    #[arg(long, default_value = "cuda")]
    device: String,
    /// Encoder threads of the pool (unset: the config's default, one per core up to 16).
    #[arg(long)]
    encoder_threads: Option<usize>,
}

impl Args {
    fn config(
        &self,
        width: usize,
        height: usize,
        encoder_threads: Option<usize>,
    ) -> anyhow::Result<Config> {
        let (dtype, gpus) = if self.device == "cuda" {
            ("bf16", "  gpus: [0]\n")
        } else {
            ("f32", "")
        };
        let threads =
            encoder_threads.map_or(String::new(), |n| format!("  encoder_threads: {n}\n"));
        let yaml = format!(
            "model:\n  preset: {preset}\n  weights: random\n  dtype: {dtype}\nsampler:\n  \
             steps: {steps}\n  shift: 3.0\n  guidance_scale: 5.0\nserving:\n  device: {device}\n\
             {gpus}{threads}  width: {width}\n  height: {height}\n  num_frames: {frames}\n  \
             max_side: 1920\n",
            preset = self.preset,
            steps = self.steps,
            device = self.device,
            frames = self.frames,
        );
        let cfg = Config::parse(&yaml, "<tail>")?;
        // The GPU script's CUDA settings, as the `cuda:` section `serve` fixes for the process.
        #[cfg(feature = "cuda")]
        let cfg = {
            let mut cfg = cfg;
            if self.device == "cuda" {
                cfg.cuda = (&ditstream_kernels::testing::cuda_settings_from_env()?).into();
            }
            cfg
        };
        cfg.validate(None)?;
        Ok(cfg)
    }
}

/// `WxH` → (width, height).
fn size(text: &str) -> anyhow::Result<(usize, usize)> {
    text.split_once('x')
        .and_then(|(w, h)| Some((w.parse().ok()?, h.parse().ok()?)))
        .with_context(|| format!("--sizes entry {text:?} is not WxH"))
}

/// One decode of `latent`, chunk by chunk: (ms to the first segment, ms to the last), or with
/// `encode` false the VAE alone (first chunk's frames on the host, last chunk's).
fn run_once(
    stage: &DecodeStage,
    job: &DecodeJob,
    latent: &Tensor,
    encode: bool,
) -> anyhow::Result<(f64, f64)> {
    let start = Instant::now();
    let mut session = stage.start(job)?;
    let chunks = latent.shape()[2];
    if !encode {
        let mut first = None;
        for t in 0..chunks {
            session.decode(&latent.narrow(2, t, 1)?)?;
            first.get_or_insert(start.elapsed().as_secs_f64() * 1e3);
        }
        return Ok((first.unwrap_or(0.0), start.elapsed().as_secs_f64() * 1e3));
    }
    // Segments are waited for in order on another thread, as the service's forwarder does, so
    // each one's time is when it was ready, not when the decode loop came back to it.
    let (tickets, waiting) = mpsc::channel();
    let waiter = std::thread::spawn(move || -> anyhow::Result<Vec<f64>> {
        let mut ready = Vec::new();
        for ticket in waiting {
            let ticket: ditstream_decoder::stage::SegmentTicket = ticket;
            ticket.wait()?;
            ready.push(start.elapsed().as_secs_f64() * 1e3);
        }
        Ok(ready)
    });
    for t in 0..chunks {
        for ticket in session.push(&latent.narrow(2, t, 1)?)? {
            tickets.send(ticket).context("the waiter stopped")?;
        }
    }
    drop(tickets);
    let ready = waiter
        .join()
        .map_err(|_| anyhow::anyhow!("the waiter panicked"))??;
    match (ready.first(), ready.last()) {
        (Some(&first), Some(&last)) => Ok((first, last)),
        _ => bail!("no segment"),
    }
}

fn tail(args: &Args) -> anyhow::Result<()> {
    for size in &args.sizes {
        let (w, h) = self::size(size)?;
        let sequential = DecodeStage::from_config(&args.config(w, h, Some(0))?)?;
        let pool = DecodeStage::from_config(&args.config(w, h, args.encoder_threads)?)?;
        let job = DecodeJob {
            width: w,
            height: h,
            num_frames: args.frames,
            fps: 16,
            segment_frames: 4,
        };
        let (lt, lh, lw) = sequential.geometry().latent_grid(args.frames, h, w);
        let latent = Tensor::randn(
            &[1, sequential.latent_channels(), lt, lh, lw],
            DType::F32,
            7,
            Device::Cpu,
        )?;
        let mut rows = Vec::new();
        for (name, stage, encode) in [
            ("decode-alone", &sequential, false),
            ("sequential", &sequential, true),
            ("pool", &pool, true),
        ] {
            run_once(stage, &job, &latent, encode)?; // warm-up: plans, kernels, memory pool
            let mut firsts = Vec::new();
            let mut lasts = Vec::new();
            for _ in 0..args.iters {
                let (first, last) = run_once(stage, &job, &latent, encode)?;
                firsts.push(first);
                lasts.push(last);
            }
            let (first, last) = (
                median(&firsts).unwrap_or(0.0),
                median(&lasts).unwrap_or(0.0),
            );
            println!(
                "{size} {name:<13} first segment {first:8.1} ms, last {last:8.1} ms (runs {lasts:.1?})"
            );
            rows.push((name, first, last));
        }
        let alone = rows[0].2;
        for (name, first, last) in rows {
            println!(
                "TAIL\t{size}\t{name}\t{last:.1}\t{:.3}\t{first:.1}\t{}",
                last / alone,
                if name == "pool" {
                    pool.encoder_threads()
                } else {
                    0
                }
            );
        }
    }
    Ok(())
}

/// One request alone: its timings.
async fn request(addr: &str, prompt: &str, seed: u64) -> anyhow::Result<pb::Timings> {
    let mut client = VideoServiceClient::connect(format!("http://{addr}"))
        .await?
        .max_decoding_message_size(256 << 20);
    let req = pb::GenerateRequest {
        prompt: prompt.into(),
        seed: Some(seed),
        ..Default::default()
    };
    let mut stream = client.generate(req).await?.into_inner();
    while let Some(e) = stream.message().await? {
        if let Some(pb::generate_event::Event::Completed(done)) = e.event {
            return Ok(done.timings.unwrap_or_default());
        }
    }
    bail!("stream ended without Completed")
}

async fn start(args: &Args) -> anyhow::Result<()> {
    let (w, h) = size(&args.sizes[0])?;
    let cfg = args.config(w, h, args.encoder_threads)?;
    let t = Instant::now();
    let server = ditstream::serve::start(cfg, "127.0.0.1:0".parse()?).await?;
    let start_s = t.elapsed().as_secs_f64();
    let addr = server.addr.to_string();
    let first = request(&addr, "first: a lighthouse in a storm", 1).await?;
    let second = request(&addr, "second: a fox in the snow", 2).await?;
    server.stop().await?;
    for (name, t) in [("first", &first), ("second", &second)] {
        println!(
            "{name:<7} total {:8.1} ms: text {:7.1}, denoise {:8.1}, decode {:7.1}, encode {:7.1} \
             (threads), first segment {:8.1}",
            t.total_ms, t.text_ms, t.denoise_ms, t.decode_ms, t.encode_ms, t.first_segment_ms
        );
    }
    println!(
        "START\t{start_s:.1}\t{:.1}\t{:.1}\t{:.3}\t{:.1}\t{:.1}",
        first.total_ms,
        second.total_ms,
        first.total_ms / second.total_ms,
        first.decode_ms,
        second.decode_ms
    );
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,ditstream=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    match args.mode.as_str() {
        "start" => start(&args).await,
        "tail" => tokio::task::block_in_place(|| tail(&args)),
        other => bail!("--mode {other:?}: expected `start` or `tail`"),
    }
}
