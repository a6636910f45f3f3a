//! `ditstream generate`: the gRPC client. Sends one request, shows progress, writes the init
//! segment and each media segment to the output file the moment it arrives (so an interrupted
//! run leaves a playable file up to its last complete segment), and prints the timings.
//! Without `--server` it starts the embedded server in-process and talks to it over a real
//! loopback socket, exactly as a remote client would.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use ditstream_proto::v1 as pb;
use ditstream_proto::v1::generate_event::Event as E;
use ditstream_proto::v1::video_service_client::VideoServiceClient;

use crate::serve;

/// `ditstream generate` options.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// What to show.
    #[arg(long)]
    pub prompt: String,
    /// Where to write the MP4.
    #[arg(long)]
    pub output: PathBuf,
    /// A running server (`http://host:port` or `host:port`); omitted: start the embedded one.
    #[arg(long)]
    pub server: Option<String>,
    /// Config of the embedded server (default: the built-in cpu-tiny config).
    #[arg(long, conflicts_with = "server")]
    pub config: Option<PathBuf>,
    /// What to steer away from (default: the server's).
    #[arg(long, default_value = "")]
    pub negative_prompt: String,
    /// Width in pixels (default: the server's).
    #[arg(long)]
    pub width: Option<u32>,
    /// Height in pixels (default: the server's).
    #[arg(long)]
    pub height: Option<u32>,
    /// Frames, 4k+1 (default: the server's).
    #[arg(long)]
    pub frames: Option<u32>,
    /// Frames per second (default: the server's).
    #[arg(long)]
    pub fps: Option<u32>,
    /// Denoising steps (default: the server's).
    #[arg(long)]
    pub steps: Option<u32>,
    /// CFG scale.
    #[arg(long)]
    pub guidance_scale: Option<f64>,
    /// Seed of the initial noise (default: random).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Frames per segment after the first (default: 4, one latent frame).
    #[arg(long)]
    pub segment_frames: Option<u32>,
    /// Seconds before the request is abandoned (0: none).
    #[arg(long, default_value_t = 0)]
    pub timeout: u64,
    /// The API key, sent as `authorization: Bearer <key>` (better from the environment than
    /// on the command line, where other users of the host can read it).
    #[arg(long, env = "DITSTREAM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// For an `https://` server: the CA certificate (PEM) to trust; default: the system's roots.
    #[arg(long)]
    pub tls_ca: Option<std::path::PathBuf>,
}

/// Progress on stderr: one rewritten line on a terminal, one line per phase change otherwise.
struct ProgressLine {
    tty: bool,
    last_phase: i32,
}

impl ProgressLine {
    fn show(&mut self, p: &pb::Progress) {
        let name = match pb::Phase::try_from(p.phase) {
            Ok(pb::Phase::Text) => "text",
            Ok(pb::Phase::Denoise) => "denoise",
            Ok(pb::Phase::Decode) => "decode",
            _ => "work",
        };
        if self.tty {
            let width = 30;
            let filled = if p.total == 0 {
                0
            } else {
                (p.done as usize * width) / p.total as usize
            };
            eprint!(
                "\r{name:>8} [{}{}] {}/{}   ",
                "#".repeat(filled),
                " ".repeat(width - filled),
                p.done,
                p.total
            );
            let _ = std::io::stderr().flush();
        } else if p.phase != self.last_phase || p.done == p.total {
            eprintln!("{name:>8} {}/{}", p.done, p.total);
        }
        self.last_phase = p.phase;
    }

    fn clear(&self) {
        if self.tty {
            eprint!("\r{:60}\r", "");
        }
    }
}

/// Runs the client; returns once the file is complete (or the request failed).
pub async fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let (endpoint, embedded) = match &args.server {
        Some(s) if s.starts_with("http://") || s.starts_with("https://") => (s.clone(), None),
        Some(s) => (format!("http://{s}"), None),
        None => {
            let cfg = serve::load_config(args.config.as_deref())?;
            eprintln!(
                "starting the embedded server (CPU, {} model)…",
                cfg.model.preset.map_or("checkpoint", |p| p.name())
            );
            let server = serve::start(cfg, "127.0.0.1:0".parse()?).await?;
            (format!("http://{}", server.addr), Some(server))
        }
    };
    let result = request(&args, &endpoint).await;
    if let Some(server) = embedded {
        server.stop().await?;
    }
    result
}

/// A channel to `endpoint`; over TLS for `https://`, trusting `--tls-ca` or the system's roots.
async fn connect(args: &GenerateArgs, endpoint: &str) -> anyhow::Result<tonic::transport::Channel> {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
    let mut e = Endpoint::from_shared(endpoint.to_string())
        .with_context(|| format!("--server {endpoint}: not a URL"))?;
    if endpoint.starts_with("https://") {
        let tls = match &args.tls_ca {
            Some(path) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(
                std::fs::read(path).with_context(|| format!("--tls-ca {}", path.display()))?,
            )),
            None => ClientTlsConfig::new().with_native_roots(),
        };
        e = e.tls_config(tls)?;
    }
    // A server that never answers must not hang the client: TCP and TLS within the connect
    // timeout, then HTTP/2 pings, so a connection whose server fell silent (at the start or
    // mid-stream, a host gone without a reset) fails within KEEPALIVE + PING_TIMEOUT.
    e.connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(KEEPALIVE)
        .keep_alive_timeout(PING_TIMEOUT)
        .keep_alive_while_idle(true)
        .connect()
        .await
        .with_context(|| format!("cannot connect to {endpoint}"))
}

/// How long the TCP connection and the TLS handshake to `--server` may take.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// How often the client pings the server while a call waits.
const KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(10);
/// How long a ping may go unanswered before the connection is given up.
const PING_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

async fn request(args: &GenerateArgs, endpoint: &str) -> anyhow::Result<()> {
    let mut client =
        VideoServiceClient::new(connect(args, endpoint).await?).max_decoding_message_size(64 << 20);
    let mut request = tonic::Request::new(pb::GenerateRequest {
        prompt: args.prompt.clone(),
        negative_prompt: args.negative_prompt.clone(),
        width: args.width,
        height: args.height,
        num_frames: args.frames,
        fps: args.fps,
        steps: args.steps,
        guidance_scale: args.guidance_scale,
        guidance_scale_2: None,
        seed: args.seed,
        model: String::new(),
        segment_frames: args.segment_frames,
    });
    if args.timeout > 0 {
        request.set_timeout(std::time::Duration::from_secs(args.timeout));
    }
    if let Some(key) = &args.api_key {
        let value = format!("Bearer {key}")
            .parse()
            .context("--api-key: not a valid header value")?;
        request.metadata_mut().insert("authorization", value);
    }
    let start = Instant::now();
    let mut stream = client
        .generate(request)
        .await
        .map_err(status_error)?
        .into_inner();
    let mut file = std::fs::File::create(&args.output)
        .with_context(|| format!("cannot create {}", args.output.display()))?;
    let mut progress = ProgressLine {
        tty: std::io::stderr().is_terminal(),
        last_phase: -1,
    };
    let mut frames_written = 0u32;
    let mut first_segment_ms = None;
    loop {
        let event = match stream.message().await {
            Ok(Some(e)) => e,
            Ok(None) => bail!("the server closed the stream before Completed"),
            Err(status) => {
                progress.clear();
                if frames_written > 0 {
                    eprintln!(
                        "{} keeps the {frames_written} frames received",
                        args.output.display()
                    );
                }
                return Err(status_error(status));
            }
        };
        let at_ms = start.elapsed().as_secs_f64() * 1e3;
        match event.event {
            Some(E::Accepted(a)) => eprintln!(
                "accepted {} ({}x{}, {} frames at {} fps, {} steps, seed {}), {} ahead",
                a.request_id,
                a.width,
                a.height,
                a.num_frames,
                a.fps,
                a.steps,
                a.seed,
                a.queue_position
            ),
            Some(E::Progress(p)) => progress.show(&p),
            Some(E::InitSegment(init)) => {
                file.write_all(&init.data)?;
                progress.clear();
                eprintln!(
                    "{at_ms:8.0} ms  init segment ({} bytes, {})",
                    init.data.len(),
                    init.mime_type
                );
            }
            Some(E::MediaSegment(seg)) => {
                // Written and flushed at once: the file is playable up to here.
                file.write_all(&seg.data)?;
                file.flush()?;
                frames_written += seg.frame_count;
                first_segment_ms.get_or_insert(at_ms);
                progress.clear();
                eprintln!(
                    "{at_ms:8.0} ms  segment {:>3}: frames {}..{} ({} bytes)",
                    seg.sequence_number,
                    seg.first_frame,
                    seg.first_frame + seg.frame_count,
                    seg.data.len()
                );
            }
            Some(E::Completed(done)) => {
                progress.clear();
                file.sync_all()?;
                let t = done.timings.unwrap_or_default();
                println!(
                    "wrote {} ({} frames, {} segments)",
                    args.output.display(),
                    done.frames,
                    done.segments
                );
                println!(
                    "time to first segment: {:.0} ms here, {:.0} ms on the server",
                    first_segment_ms.unwrap_or(0.0),
                    t.first_segment_ms
                );
                println!(
                    "timings: queue {:.0} ms, text {:.0} ms, denoise {:.0} ms, decode {:.0} ms, encode {:.0} ms, total {:.0} ms",
                    t.queue_ms, t.text_ms, t.denoise_ms, t.decode_ms, t.encode_ms, t.total_ms
                );
                return Ok(());
            }
            None => {}
        }
    }
}

/// The call's status as an error; a transport failure's causes too (tonic's own message for
/// a dead connection is only "http2 error").
fn status_error(status: tonic::Status) -> anyhow::Error {
    let mut text = format!("{:?}: {}", status.code(), status.message());
    let mut source = std::error::Error::source(&status);
    while let Some(e) = source {
        let cause = e.to_string();
        if !text.ends_with(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
        source = e.source();
    }
    anyhow::anyhow!(text)
}
