//! The disaggregated deployment as an operator runs it: `ditstream gateway`, `ditstream denoiser`
//! and `ditstream decoder` as separate processes on loopback (gRPC between them and the latent
//! over QUIC, every internal hop on mutual TLS with the pool CA), a real client, the MP4 checked with ffprobe. Also: the denoiser takes
//! request N+1 while the decoder still works on N, and a decoder that dies is dropped from the
//! registry and a new one takes over.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ditstream_proto::v1 as pb;
use ditstream_proto::v1::generate_event::Event as E;
use ditstream_proto::v1::video_service_client::VideoServiceClient;

/// A child process killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ditstream"))
}

struct Deployment {
    dir: PathBuf,
    gateway: String,
    _gateway: Proc,
    pools: Vec<Proc>,
}

fn config(gateway: &str, parallel: &str) -> String {
    config_with_link(gateway, parallel, "quic")
}

fn config_with_link(gateway: &str, parallel: &str, link: &str) -> String {
    format!(
        "model:\n  preset: tiny\nsampler:\n  steps: 3\nserving:\n  width: 128\n  height: 96\n  num_frames: 17\n  \
         fps: 16\n  queue_depth: 4\nparallel_config:\n{parallel}pools:\n  gateway: {gateway}\n  heartbeat_timeout_s: 2\n  \
         link: {link}\n  tls_ca: certs/ca.pem\n  tls_cert: certs/pool.pem\n  tls_key: certs/pool-key.pem\n"
    )
}

const ONE_RANK: &str = "  cfg_size: 1\n";

impl Deployment {
    /// Certificates, a gateway on a free port, one denoiser pool and one decoder instance.
    fn start(name: &str) -> Deployment {
        Self::start_with(name, ONE_RANK, 1)
    }

    /// As [`Deployment::start`], with the denoiser's `parallel_config` and `decoders` instances.
    fn start_with(name: &str, parallel: &str, decoders: usize) -> Deployment {
        Self::start_full(name, parallel, decoders, "quic")
    }

    /// As [`Deployment::start_with`], over the latent link `link` ("quic" or "ucx").
    fn start_full(name: &str, parallel: &str, decoders: usize, link: &str) -> Deployment {
        let dir =
            std::env::temp_dir().join(format!("ditstream-pools-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let status = bin()
            .args(["certs", "--out"])
            .arg(dir.join("certs"))
            .status()
            .unwrap();
        assert!(status.success());
        std::fs::write(
            dir.join("gateway.yaml"),
            config_with_link("127.0.0.1:1", parallel, link),
        )
        .unwrap();
        let mut gateway = bin()
            .args([
                "gateway",
                "--listen",
                "127.0.0.1:0",
                "--registry-listen",
                "127.0.0.1:0",
            ])
            .arg("--config")
            .arg(dir.join("gateway.yaml"))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(gateway.stdout.take().unwrap());
        let mut read = |prefix: &str| {
            let mut line = String::new();
            out.read_line(&mut line).unwrap();
            line.trim()
                .strip_prefix(prefix)
                .unwrap_or_else(|| panic!("the gateway prints {prefix:?}, not {line:?}"))
                .to_string()
        };
        let addr = read("gateway listening on ");
        let registry = read("pool registry listening on ");
        // The pools register over mutual TLS at the registry, not at the public address.
        std::fs::write(
            dir.join("pools.yaml"),
            config_with_link(&registry, parallel, link),
        )
        .unwrap();
        let mut d = Deployment {
            dir,
            gateway: addr,
            _gateway: Proc(gateway),
            pools: Vec::new(),
        };
        d.spawn_pool("denoiser");
        for _ in 0..decoders {
            d.spawn_pool("decoder");
        }
        d
    }

    fn spawn_pool(&mut self, role: &str) {
        let child = bin()
            .args([role, "--config"])
            .arg(self.dir.join("pools.yaml"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.pools.push(Proc(child));
    }

    async fn client(&self) -> VideoServiceClient<tonic::transport::Channel> {
        VideoServiceClient::connect(format!("http://{}", self.gateway))
            .await
            .unwrap()
            .max_decoding_message_size(64 << 20)
    }

    /// Waits until the gateway has both a denoiser and a decoder.
    async fn ready(&self) {
        let mut client = self.client().await;
        let start = Instant::now();
        while !client
            .health(pb::HealthRequest {})
            .await
            .unwrap()
            .into_inner()
            .serving
        {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the pools never registered"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Every event of one request with its arrival time, or the final error status.
async fn run(
    client: &mut VideoServiceClient<tonic::transport::Channel>,
    prompt: &str,
    t0: Instant,
) -> Result<Vec<(f64, E)>, tonic::Status> {
    run_seeded(client, prompt, 9, t0).await
}

async fn run_seeded(
    client: &mut VideoServiceClient<tonic::transport::Channel>,
    prompt: &str,
    seed: u64,
    t0: Instant,
) -> Result<Vec<(f64, E)>, tonic::Status> {
    let req = pb::GenerateRequest {
        prompt: prompt.into(),
        seed: Some(seed),
        ..Default::default()
    };
    let mut stream = client.generate(req).await?.into_inner();
    let mut out = Vec::new();
    while let Some(e) = stream.message().await? {
        out.push((t0.elapsed().as_secs_f64(), e.event.unwrap()));
    }
    Ok(out)
}

fn mp4(events: &[(f64, E)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (_, e) in events {
        match e {
            E::InitSegment(i) => out.extend_from_slice(&i.data),
            E::MediaSegment(s) => out.extend_from_slice(&s.data),
            _ => {}
        }
    }
    out
}

fn probe(path: &Path) -> String {
    let out = Command::new("ffprobe")
        .args([
            "-v",
            "error",
            "-count_frames",
            "-show_entries",
            "stream=width,height,nb_read_frames",
            "-of",
            "csv=p=0",
        ])
        .arg(path)
        .output()
        .expect("ffprobe is required (scripts/install-deps.sh installs ffmpeg)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_stream_a_playable_video_and_pipeline_requests() {
    let d = Deployment::start("main");
    d.ready().await;
    let t0 = Instant::now();
    let (mut c1, mut c2) = (d.client().await, d.client().await);
    let (first, second) = tokio::join!(run(&mut c1, "first", t0), async {
        // Queued behind the first (one denoiser pool).
        tokio::time::sleep(Duration::from_millis(50)).await;
        run(&mut c2, "second", t0).await
    });
    let (first, second) = (first.unwrap(), second.unwrap());
    for (name, events) in [("first", &first), ("second", &second)] {
        let Some((_, E::Completed(done))) = events.last() else {
            panic!("{name}: {:?}", events.last())
        };
        assert_eq!((done.frames, done.segments), (17, 6), "{name}");
        let t = done.timings.unwrap();
        assert!(
            t.denoise_ms > 0.0 && t.decode_ms > 0.0 && t.first_segment_ms <= t.total_ms,
            "{name}: {t:?}"
        );
        let path = d.dir.join(format!("{name}.mp4"));
        std::fs::write(&path, mp4(events)).unwrap();
        assert_eq!(probe(&path), "128,96,17", "{name}");
    }
    // Pipelining: the second request's denoising starts while the first is still decoding.
    let first_done = first.last().unwrap().0;
    let second_denoise = second
        .iter()
        .find(|(_, e)| matches!(e, E::Progress(p) if p.phase == pb::Phase::Denoise as i32))
        .expect("the second request denoised")
        .0;
    let first_latent_handed = first
        .iter()
        .rfind(|(_, e)| matches!(e, E::Progress(p) if p.phase == pb::Phase::Denoise as i32))
        .unwrap()
        .0;
    eprintln!(
        "request 1: latent handed over at {first_latent_handed:.3} s, done at {first_done:.3} s; \
         request 2: first denoising step at {second_denoise:.3} s"
    );
    assert!(
        second_denoise < first_done,
        "request 2 began denoising at {second_denoise:.3} s, after request 1 finished at {first_done:.3} s"
    );
    assert!(
        second_denoise > first_latent_handed,
        "one denoiser pool runs one loop at a time"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_decoder_is_dropped_and_a_new_one_serves() {
    let mut d = Deployment::start("failover");
    d.ready().await;
    // Kill the decoder: after the heartbeat timeout the gateway no longer counts it.
    d.pools.remove(1);
    let mut client = d.client().await;
    let start = Instant::now();
    while client
        .health(pb::HealthRequest {})
        .await
        .unwrap()
        .into_inner()
        .serving
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the dead decoder was never dropped"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let models = client
        .list_models(pb::ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        models.models[0].description,
        "1 denoiser pool(s), 0 decoder instance(s) registered"
    );
    // A request waits in the queue until a decoder registers, then completes.
    let t0 = Instant::now();
    let mut c = d.client().await;
    let pending = tokio::spawn(async move { run(&mut c, "after failover", t0).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    d.spawn_pool("decoder");
    let events = pending.await.unwrap().unwrap();
    assert!(
        matches!(events.last(), Some((_, E::Completed(_)))),
        "{:?}",
        events.last()
    );
}

/// Several clients at once against a two-rank denoiser pool and two decoder instances: every
/// video is byte for byte the one the single-process server makes for the same request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_get_the_single_process_videos() {
    let parallel = "  ulysses_size: 2\n";
    let d = Deployment::start_with("concurrent", parallel, 2);
    d.ready().await;
    let requests = [("a fox", 1u64), ("a boat", 2), ("a lighthouse", 3)];
    let t0 = Instant::now();
    let mut handles = Vec::new();
    for (prompt, seed) in requests {
        let mut c = d.client().await;
        handles.push(tokio::spawn(async move {
            run_seeded(&mut c, prompt, seed, t0).await
        }));
    }
    let mut videos = Vec::new();
    for h in handles {
        let events = h.await.unwrap().unwrap();
        assert!(
            matches!(events.last(), Some((_, E::Completed(_)))),
            "{:?}",
            events.last()
        );
        videos.push(mp4(&events));
    }
    // The same requests through `ditstream serve`'s single process, same config.
    let cfg = ditstream_common::config::Config::parse(&config("127.0.0.1:1", parallel), "<test>")
        .unwrap();
    let server = ditstream::serve::start(cfg, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let mut c = VideoServiceClient::connect(format!("http://{}", server.addr))
        .await
        .unwrap();
    for ((prompt, seed), video) in requests.iter().zip(&videos) {
        let events = run_seeded(&mut c, prompt, *seed, t0).await.unwrap();
        assert!(
            mp4(&events) == *video,
            "{prompt}: the pools' video differs from the single-process one"
        );
    }
    server.stop().await.unwrap();
}

/// A decoder killed while it decodes: that request ends with an error status (the client keeps the
/// segments it already has), the denoiser is released, and the next request runs on a new decoder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_killed_mid_request_fails_that_request_only() {
    let mut d = Deployment::start("midrequest");
    d.ready().await;
    let mut client = d.client().await;
    let req = pb::GenerateRequest {
        prompt: "doomed".into(),
        seed: Some(4),
        num_frames: Some(41),
        ..Default::default()
    };
    let mut stream = client.generate(req).await.unwrap().into_inner();
    // Wait for the first media segment: the decoder is mid-request.
    loop {
        match stream.message().await.unwrap().and_then(|e| e.event) {
            Some(E::MediaSegment(_)) => break,
            Some(_) => continue,
            None => panic!("the stream ended before any segment"),
        }
    }
    d.pools.remove(1); // the decoder
    let status = loop {
        match stream.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the request completed although its decoder died"),
            Err(s) => break s,
        }
    };
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        status
            .message()
            .starts_with("decoder instance at 127.0.0.1:")
            && status.message().contains("was lost mid-request"),
        "{}",
        status.message()
    );
    d.spawn_pool("decoder");
    let events = run(&mut client, "after", Instant::now()).await.unwrap();
    assert!(
        matches!(events.last(), Some((_, E::Completed(_)))),
        "{:?}",
        events.last()
    );
}

/// kill -9 of the denoiser mid-denoise: that request ends UNAVAILABLE naming the pool; the
/// request queued behind it is not failed but waits for a live pool, and completes as soon as a
/// new denoiser registers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denoiser_killed_mid_request_fails_that_request_and_the_queued_one_waits() {
    let mut d = Deployment::start("denoiser-killed");
    d.ready().await;
    let mut client = d.client().await;
    let long = |prompt: &str| pb::GenerateRequest {
        prompt: prompt.into(),
        seed: Some(4),
        steps: Some(100),
        ..Default::default()
    };
    let mut doomed = client.generate(long("doomed")).await.unwrap().into_inner();
    loop {
        match doomed.message().await.unwrap().and_then(|e| e.event) {
            Some(E::Progress(p)) if p.phase == pb::Phase::Denoise as i32 => break,
            Some(_) => continue,
            None => panic!("the stream ended before denoising"),
        }
    }
    let mut queued = client
        .generate(pb::GenerateRequest {
            steps: Some(3),
            ..long("queued behind")
        })
        .await
        .unwrap()
        .into_inner();
    let Some(E::Accepted(a)) = queued.message().await.unwrap().and_then(|e| e.event) else {
        panic!("no Accepted");
    };
    assert_eq!(a.queue_position, 1);
    d.pools.remove(0); // the denoiser, SIGKILL
    let status = loop {
        match doomed.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the request completed although its denoiser died"),
            Err(s) => break s,
        }
    };
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        status.message().starts_with("denoiser pool at 127.0.0.1:")
            && status.message().contains("was lost mid-request"),
        "{}",
        status.message()
    );
    // The queued request is still waiting, not failed.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let h = client
        .health(pb::HealthRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!((h.serving, h.queued, h.running), (false, 1, 0), "{h:?}");
    let revived = Instant::now();
    d.spawn_pool("denoiser");
    let mut last = None;
    loop {
        match queued.message().await {
            Ok(Some(e)) => last = e.event,
            Ok(None) => break,
            Err(s) => panic!("the queued request failed: {s:?}"),
        }
    }
    assert!(matches!(last, Some(E::Completed(_))), "{last:?}");
    println!(
        "queued request done {:?} after the new denoiser started",
        revived.elapsed()
    );
}

/// The same deployment over the UCX latent link (host memory, tcp/sm/self transports): the
/// videos equal the QUIC ones byte for byte.
#[cfg(feature = "ucx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ucx_link_carries_the_same_videos() {
    let quic = Deployment::start_full("link-quic", ONE_RANK, 1, "quic");
    let ucx = Deployment::start_full("link-ucx", ONE_RANK, 1, "ucx");
    quic.ready().await;
    ucx.ready().await;
    let t0 = Instant::now();
    let over_quic = run_seeded(&mut quic.client().await, "a heron", 11, t0)
        .await
        .unwrap();
    let over_ucx = run_seeded(&mut ucx.client().await, "a heron", 11, t0)
        .await
        .unwrap();
    assert!(
        matches!(over_ucx.last(), Some((_, E::Completed(_)))),
        "{:?}",
        over_ucx.last()
    );
    assert!(
        mp4(&over_ucx) == mp4(&over_quic),
        "UCX and QUIC deliver different videos"
    );
}
