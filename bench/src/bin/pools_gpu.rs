//! The request pipeline on GPUs (issue 10's GPU benchmark):
//! - serve: `serve` on one GPU (the gateway, a denoiser pool and a decoder instance in one process,
//!   the denoiser taking request N+1 once N's latent is handed over; both stages queue their kernels
//!   on the GPU's one stream, so the GPU work of the two interleaves rather than overlaps, while the
//!   host-side encoding overlaps), K requests submitted at once after a warm-up request;
//! - pools: a gateway, one denoiser pool on `--denoiser-gpu` and one decoder instance on
//!   `--decoder-gpu`, as tokio tasks of this process talking gRPC and the latent link (`--link`)
//!   over loopback, exactly as `ditstream gateway|denoiser|decoder` run them; the same K requests;
//! - per run: throughput measured (K / wall, which includes one pipeline fill and one drain: with
//!   few requests it stays below the steady state), and the steady state that the measured stage
//!   times imply (1 / (T_denoise + T_decode) sequential, 1 / max(T_denoise, T_decode) pipelined;
//!   completion spacing is no estimator here, since a decoder instance decodes its requests
//!   concurrently and a backlog bunches them), each × T_denoise (issue 10's target ≥ 0.95), with
//!   T_denoise = text + loop and T_decode = decode + encode (medians); and the time to the first
//!   segment after the loop ends (first segment − queue − text − loop, median; target ≤ 150 ms at
//!   480p);
//! - per latent-link kind in `--latency-links`: one 480p latent frame [1, 16, 1, 60, 104] f32 per
//!   request (send → delivered to the decoder's request, median of `--chunks`), and a whole 480p
//!   81-frame latent (21 chunks: first and last chunk delivered), through the pools' own link code
//!   (`ditstream_common::link::pool`), so a new kind in `pools.link` is measured by naming it.
//!
//! Model: `--preset` (Wan2.1-T2V-1.3B) with random weights in bf16, the umT5-XXL text encoder at
//! its real size (drawn on the GPU). Each request has its own prompt and seed.
//! Lines starting with `RESULT` and `LINK` are for scripts/gpu-serve.sh's table.
//!
//! `pools_gpu --requests 4 --steps 4` (scripts/gpu-serve.sh runs it on 2× H200).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use ditstream::gateway;
use ditstream::roles::write_certs;
use ditstream_bench::median;
use ditstream_common::config::{Config, LinkKind};
use ditstream_common::link::pool::{self as link, Pending};
use ditstream_decoder::service as decoder;
use ditstream_denoiser::service as denoiser;
use ditstream_kernels::Tensor;
use ditstream_proto::v1 as pb;
use ditstream_proto::v1::video_service_client::VideoServiceClient;

#[derive(Parser)]
#[command(about = "serve on one GPU and the disaggregated pools on two (issue 10)")]
struct Args {
    /// Back-to-back requests per run (after one warm-up request).
    #[arg(long, default_value_t = 4)]
    requests: usize,
    /// Sampler steps per request.
    #[arg(long, default_value_t = 4)]
    steps: u32,
    /// Video width, height and frames.
    #[arg(long, default_value_t = 832)]
    width: usize,
    #[arg(long, default_value_t = 480)]
    height: usize,
    #[arg(long, default_value_t = 81)]
    frames: usize,
    /// Model preset (random weights, bf16).
    #[arg(long, default_value = "wan2.1-t2v-1.3b")]
    preset: String,
    /// GPU of `serve` and of the denoiser pool.
    #[arg(long, default_value_t = 0)]
    denoiser_gpu: usize,
    /// GPU of the decoder instance.
    #[arg(long, default_value_t = 1)]
    decoder_gpu: usize,
    /// Latent link of the pools run (any `pools.link` value).
    #[arg(long, default_value = "quic")]
    link: String,
    /// Latent links whose per-chunk latency is measured (comma-separated `pools.link` values).
    #[arg(long, default_value = "quic,ucx,nccl", value_delimiter = ',')]
    latency_links: Vec<String>,
    /// Samples per link for the one-frame latency.
    #[arg(long, default_value_t = 30)]
    chunks: usize,
    /// `cuda`, or `cpu` for a smoke run of this driver itself (with `--preset tiny`; the GPU
    /// options are then ignored).
    #[arg(long, default_value = "cuda")]
    device: String,
    /// Skip the `serve` run on one GPU.
    #[arg(long)]
    skip_sequential: bool,
    /// Skip the pools run.
    #[arg(long)]
    skip_pools: bool,
    /// `model.dtype` (bf16 or fp8 on the GPU; unset: bf16 there, f32 for the CPU smoke run).
    #[arg(long)]
    dtype: Option<String>,
}

impl Args {
    /// A config for one process: the model, the video size, `gpu`, the pools section.
    /// The config of one process on `gpu`; `certs` holds what `ditstream certs` writes.
    fn config(
        &self,
        gpu: usize,
        gateway: &str,
        link: &str,
        certs: &Path,
    ) -> anyhow::Result<Config> {
        let c = certs.display();
        let gpus = if self.device == "cuda" {
            format!("  gpus: [{gpu}]\n")
        } else {
            String::new()
        };
        let yaml = format!(
            "model:\n  preset: {preset}\n  weights: random\n  dtype: {dtype}\nsampler:\n  \
             steps: {steps}\n  shift: 3.0\n  guidance_scale: 5.0\nserving:\n  device: {device}\n\
             {gpus}  width: {w}\n  height: {h}\n  num_frames: {f}\n  queue_depth: 64\npools:\n  \
             gateway: {gateway}\n  registry_listen: 127.0.0.1:0\n  link: {link}\n  tls_ca: {c}/ca.pem\n  \
             tls_cert: {c}/pool.pem\n  tls_key: {c}/pool-key.pem\n",
            preset = self.preset,
            // bf16 on the GPU; the CPU smoke run keeps the CPU's reference f32.
            dtype = match (&self.dtype, self.device.as_str()) {
                (Some(d), _) => d.as_str(),
                (None, "cuda") => "bf16",
                (None, _) => "f32",
            },
            steps = self.steps,
            device = self.device,
            w = self.width,
            h = self.height,
            f = self.frames,
        );
        let mut cfg = Config::parse(&yaml, "<pools_gpu>")?;
        // The GPU script's CUDA settings, as the `cuda:` section `serve` fixes for the process.
        if self.device == "cuda" {
            cfg.cuda = (&ditstream_kernels::testing::cuda_settings_from_env()?).into();
        }
        cfg.validate(None)?;
        Ok(cfg)
    }
}

/// What one request reported, and when it completed.
struct Outcome {
    timings: pb::Timings,
    done: Instant,
}

/// Submits `k` requests at once (prompts `{tag} {i}`, seeds i; `steps` overrides the config's)
/// and waits for all of them.
async fn run_all(
    addr: &str,
    tag: &str,
    k: usize,
    steps: Option<u32>,
) -> anyhow::Result<(Duration, Vec<Outcome>)> {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..k {
        let endpoint = format!("http://{addr}");
        let prompt = format!("{tag} {i}: a lighthouse in a storm, waves breaking");
        tasks.push(tokio::spawn(async move {
            let mut client = VideoServiceClient::connect(endpoint)
                .await?
                .max_decoding_message_size(256 << 20);
            let req = pb::GenerateRequest {
                prompt,
                seed: Some(i as u64),
                steps,
                ..Default::default()
            };
            let mut stream = client.generate(req).await?.into_inner();
            while let Some(e) = stream.message().await? {
                if let Some(pb::generate_event::Event::Completed(done)) = e.event {
                    return Ok::<_, anyhow::Error>(Outcome {
                        timings: done.timings.unwrap_or_default(),
                        done: Instant::now(),
                    });
                }
            }
            bail!("stream ended without Completed")
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await??);
    }
    Ok((start.elapsed(), out))
}

/// Prints a run's line (and its `RESULT` line) from its outcomes. `pipelined`: the denoiser and
/// the decoder work on different requests at once (the pools), so the steady-state period is the
/// slower of the two; sequential, it is their sum.
fn summary(name: &str, elapsed: Duration, outcomes: &[Outcome], pipelined: bool) {
    let k = outcomes.len();
    let med = |f: &dyn Fn(&pb::Timings) -> f64| {
        median(&outcomes.iter().map(|o| f(&o.timings)).collect::<Vec<_>>()).unwrap_or(0.0)
    };
    let t_denoise = med(&|t| t.text_ms + t.denoise_ms) / 1e3;
    let t_decode = med(&|t| t.decode_ms + t.encode_ms) / 1e3;
    let after_loop = med(&|t| t.first_segment_ms - t.queue_ms - t.text_ms - t.denoise_ms);
    let decode = med(&|t| t.decode_ms);
    let encode = med(&|t| t.encode_ms);
    // Measured: K requests over the wall time, one pipeline fill and one drain included.
    let overall = k as f64 / elapsed.as_secs_f64();
    // Steady state from the measured stage times: what a long stream of requests would reach.
    let period = if pipelined {
        t_denoise.max(t_decode)
    } else {
        t_denoise + t_decode
    };
    let steady = 1.0 / period.max(f64::MIN_POSITIVE);
    let last = outcomes.iter().map(|o| o.done).max();
    let first = outcomes.iter().map(|o| o.done).min();
    let spread = match (first, last) {
        (Some(a), Some(b)) => (b - a).as_secs_f64(),
        _ => 0.0,
    };
    println!(
        "{name:<12} {k} requests in {:.2} s ({spread:.2} s from first to last completion): \
         {overall:.3} req/s measured ({:.2} × 1/T_denoise), {steady:.3} req/s steady state from \
         the stage times ({:.2} × 1/T_denoise; target ≥ 0.95); T_denoise {t_denoise:.2} s, decode \
         + encode {t_decode:.2} s; first segment {after_loop:.0} ms after the loop (target ≤ \
         150); decode {decode:.0} ms, encode {encode:.0} ms (medians)",
        elapsed.as_secs_f64(),
        overall * t_denoise,
        steady * t_denoise,
    );
    println!(
        "RESULT\t{name}\t{k}\t{:.2}\t{overall:.4}\t{:.3}\t{steady:.4}\t{:.3}\t{t_denoise:.3}\t\
         {after_loop:.1}\t{decode:.0}\t{encode:.0}",
        elapsed.as_secs_f64(),
        overall * t_denoise,
        steady * t_denoise
    );
}

/// A latent of `frames` latent frames at 480p (values do not matter to the link, but are not
/// zeros, so no transport can take a shortcut).
fn latent(frames: usize) -> anyhow::Result<Tensor> {
    Ok(Tensor::randn(
        &[1, 16, frames, 60, 104],
        ditstream_kernels::DType::F32,
        9,
        ditstream_kernels::Device::Cpu,
    )?)
}

/// Registers request `id` with the decoder side and stamps each chunk's delivery; resolves to
/// the delivery times once the last chunk has arrived (or the stream failed).
fn expect(pending: &Pending, id: &str) -> tokio::task::JoinHandle<anyhow::Result<Vec<Instant>>> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<link::Delivery>(64);
    pending
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(id.to_string(), tx);
    tokio::spawn(async move {
        let mut times = Vec::new();
        while let Some(delivery) = rx.recv().await {
            times.push(Instant::now());
            if delivery?.header.last {
                break;
            }
        }
        Ok(times)
    })
}

/// GPUs of the two ends of a link: the denoiser's (sends) and the decoder's (receives).
#[derive(Clone, Copy)]
struct Ends {
    denoiser_gpu: usize,
    decoder_gpu: usize,
}

/// (one-frame latency median ms, whole latent: first chunk ms, last chunk ms) of one link kind.
/// The latent starts where the denoiser leaves it: on the host for QUIC and UCX, on the
/// denoiser's GPU for NCCL.
async fn link_latency(
    base: &Config,
    kind: LinkKind,
    identity: &ditstream_common::tls::Identity,
    samples: usize,
    ends: Ends,
) -> anyhow::Result<(f64, f64, f64)> {
    let mut cfg = base.clone();
    cfg.pools.link = kind;
    cfg.pools.link_listen = "127.0.0.1:0".to_string();
    let pending: Pending = Arc::default();
    let (addr, listener) =
        link::listen(&cfg, identity, Arc::clone(&pending), ends.decoder_gpu).await?;
    let conn = link::connect(
        link::wire_kind(kind),
        addr,
        "localhost",
        identity,
        ends.denoiser_gpu,
    )
    .await?;
    let place = |t: Tensor| -> anyhow::Result<Tensor> {
        Ok(match kind {
            LinkKind::Nccl => t.to_device(ditstream_kernels::Device::Cuda(ends.denoiser_gpu))?,
            _ => t,
        })
    };
    let one = place(latent(1)?)?;
    let mut lat = Vec::new();
    for i in 0..samples + 1 {
        let id = format!("one-{i}");
        let arrived = expect(&pending, &id);
        let sent = Instant::now();
        conn.send_latent(&id, &one).await?;
        let times = arrived.await??;
        let at = times.first().context("no chunk delivered")?;
        if i > 0 {
            // The first is a warm-up (connection set-up, first stream).
            lat.push((*at - sent).as_secs_f64() * 1e3);
        }
    }
    let whole = place(latent(21)?)?;
    let (mut first, mut last) = (Vec::new(), Vec::new());
    for i in 0..5 {
        let id = format!("whole-{i}");
        let arrived = expect(&pending, &id);
        let sent = Instant::now();
        conn.send_latent(&id, &whole).await?;
        let times = arrived.await??;
        if times.len() != 21 {
            bail!("{} of 21 chunks delivered", times.len());
        }
        first.push((times[0] - sent).as_secs_f64() * 1e3);
        last.push((times[20] - sent).as_secs_f64() * 1e3);
    }
    listener.abort();
    Ok((
        median(&lat).unwrap_or(0.0),
        median(&first).unwrap_or(0.0),
        median(&last).unwrap_or(0.0),
    ))
}

/// The link kind a `pools.link` value names (whatever kinds this build's config knows).
fn link_kind(name: &str) -> anyhow::Result<LinkKind> {
    let cfg = Config::parse(
        &format!("model:\n  preset: tiny\npools:\n  link: {name}\n"),
        "--link",
    )?;
    Ok(cfg.pools.link)
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
    let dir =
        std::env::temp_dir().join(format!("ditstream-bench-pools-gpu-{}", std::process::id()));
    write_certs(
        &dir.join("certs"),
        &["localhost".to_string(), "127.0.0.1".to_string()],
    )?;
    println!(
        "model {} (random weights, {}; {}), \
         {}x{} {} frames, {} steps, {} requests after a warm-up; serve on GPU {}, pools: \
         denoiser GPU {}, decoder GPU {}, link {}",
        args.preset,
        if args.device == "cuda" {
            "bf16"
        } else {
            "f32 on the CPU"
        },
        if args.preset == "tiny" {
            "the tiny text encoder"
        } else {
            "umT5-XXL text encoder at its real size on the first GPU"
        },
        args.width,
        args.height,
        args.frames,
        args.steps,
        args.requests,
        args.denoiser_gpu,
        args.denoiser_gpu,
        args.decoder_gpu,
        args.link
    );

    if !args.skip_sequential {
        let cfg = args.config(
            args.denoiser_gpu,
            "127.0.0.1:1",
            &args.link,
            &dir.join("certs"),
        )?;
        let t = Instant::now();
        let serve = ditstream::serve::start(cfg, "127.0.0.1:0".parse()?).await?;
        println!("serve        built in {:.1} s", t.elapsed().as_secs_f64());
        let addr = serve.addr.to_string();
        // Warm-up: every kernel compiled and every GEMM planned at these shapes, VAE included.
        run_all(&addr, "warm-up", 1, Some(1)).await?;
        let (elapsed, outcomes) = run_all(&addr, "serve", args.requests, None).await?;
        // One GPU does both stages: the sequential formula bounds its steady state.
        summary("serve-1gpu", elapsed, &outcomes, false);
        serve.stop().await?;
    }

    if !args.skip_pools {
        let certs = dir.join("certs");
        let gw = gateway::start(
            &args.config(args.denoiser_gpu, "127.0.0.1:1", &args.link, &certs)?,
            "127.0.0.1:0".parse()?,
            None,
        )
        .await?;
        let gw_addr = gw.addr.to_string();
        let registry = gw
            .registry_addr
            .context("the gateway has a registry")?
            .to_string();
        let t = Instant::now();
        let dn_cfg = args.config(args.denoiser_gpu, &registry, &args.link, &certs)?;
        let dc_cfg = args.config(args.decoder_gpu, &registry, &args.link, &certs)?;
        let (dn, dc) = tokio::try_join!(
            async { anyhow::Ok(denoiser::start(&dn_cfg).await?) },
            async { anyhow::Ok(decoder::start(&dc_cfg).await?) },
        )?;
        println!("pools        built in {:.1} s", t.elapsed().as_secs_f64());
        let mut client = VideoServiceClient::connect(format!("http://{gw_addr}")).await?;
        let ready = Instant::now();
        while !client
            .health(pb::HealthRequest {})
            .await?
            .into_inner()
            .serving
        {
            if ready.elapsed() > Duration::from_secs(60) {
                bail!("the pools did not register with the gateway within 60 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        run_all(&gw_addr, "warm-up", 1, Some(1)).await?;
        let (elapsed, outcomes) = run_all(&gw_addr, "pools", args.requests, None).await?;
        summary(&format!("pools-{}", args.link), elapsed, &outcomes, true);
        drop((dn, dc, gw));
    }

    let dc_cfg = args.config(
        args.decoder_gpu,
        "127.0.0.1:1",
        &args.link,
        &dir.join("certs"),
    )?;
    let identity = ditstream_common::tls::PoolCa::generate("bench")?.issue("localhost")?;
    for name in &args.latency_links {
        let outcome = match link_kind(name) {
            Ok(kind) => {
                let ends = Ends {
                    denoiser_gpu: args.denoiser_gpu,
                    decoder_gpu: args.decoder_gpu,
                };
                link_latency(&dc_cfg, kind, &identity, args.chunks, ends).await
            }
            Err(e) => Err(e),
        };
        match outcome {
            Ok((one, first, last)) => {
                println!(
                    "link {name:<6}  one 480p latent frame (399 KB): {one:.2} ms (median of {}); \
                     a whole 480p 81-frame latent (21 chunks, 8.4 MB): first chunk {first:.2} ms, \
                     last {last:.2} ms (median of 5)",
                    args.chunks
                );
                println!("LINK\t{name}\t{one:.3}\t{first:.3}\t{last:.3}");
            }
            Err(e) => {
                println!("link {name:<6}  not measured: {e:#}");
                println!("LINK\t{name}\t-\t-\t-");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
