//! The service end to end, as a client sees it: a real server on a loopback port, a real gRPC
//! client (tonic's, and grpcio from PyPI with stubs generated from our .proto), the built-in
//! tiny model on the CPU, and the MP4 checked with ffprobe/ffmpeg.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ditstream::pipeline::Pipeline;
use ditstream::request::RawRequest;
use ditstream::serve::{RunningServer, start, start_with};
use ditstream_common::config::Config;
use ditstream_decoder::encode::{
    AccessUnit, EncodeError, EncoderBackend, OpenEncoder, ParameterSets, VideoEncoder, VideoParams,
    Yuv420Frame,
};
use ditstream_proto::v1 as pb;
use ditstream_proto::v1::generate_event::Event as E;
use ditstream_proto::v1::video_service_client::VideoServiceClient;
use tonic::Code;
use tonic::transport::Channel;

/// The tiny model at a small size so each request takes about a second on two cores.
fn config(encoder: &str, queue_depth: usize) -> Config {
    let yaml = format!(
        "model:\n  preset: tiny\nsampler:\n  steps: 3\n  shift: 3.0\nserving:\n  width: 64\n  height: 48\n  \
         num_frames: 9\n  fps: 12\n  queue_depth: {queue_depth}\n  encoder: {encoder}\n"
    );
    let cfg = Config::parse(&yaml, "<test>").unwrap();
    cfg.validate(Some(1)).unwrap();
    cfg
}

async fn server(cfg: Config) -> (RunningServer, VideoServiceClient<Channel>) {
    let server = start(cfg, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let client = VideoServiceClient::connect(format!("http://{}", server.addr))
        .await
        .unwrap();
    (server, client)
}

fn request(prompt: &str, seed: u64) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt: prompt.into(),
        seed: Some(seed),
        ..Default::default()
    }
}

/// Runs one request to the end; returns every event, or the status it ended with.
async fn collect(
    client: &mut VideoServiceClient<Channel>,
    req: pb::GenerateRequest,
) -> (Vec<E>, Option<tonic::Status>) {
    let mut stream = match client.generate(req).await {
        Ok(s) => s.into_inner(),
        Err(status) => return (Vec::new(), Some(status)),
    };
    let mut events = Vec::new();
    loop {
        match stream.message().await {
            Ok(Some(e)) => events.push(e.event.expect("every event carries a payload")),
            Ok(None) => return (events, None),
            Err(status) => return (events, Some(status)),
        }
    }
}

/// Init segment followed by every media segment, in order.
fn mp4_of(events: &[E]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in events {
        match e {
            E::InitSegment(i) => out.extend_from_slice(&i.data),
            E::MediaSegment(s) => out.extend_from_slice(&s.data),
            _ => {}
        }
    }
    out
}

fn temp_file(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ditstream-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn tool(name: &str, args: &[&str]) -> String {
    let out = Command::new(name).args(args).output().unwrap_or_else(|e| {
        panic!("{name} is required for these tests (scripts/install-deps.sh installs ffmpeg): {e}")
    });
    assert!(
        out.status.success(),
        "{name} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// Checks the file as a player would: stream parameters, every frame decodable, keyframes.
fn probe(path: &Path, frames: usize, width: u32, height: u32, fps: &str, keyframes: &[usize]) {
    let p = path.to_str().unwrap();
    let stream = tool(
        "ffprobe",
        &[
            "-v",
            "error",
            "-count_frames",
            "-select_streams",
            "v:0",
            "-show_entries",
            "stream=codec_name,width,height,r_frame_rate,nb_read_frames",
            "-of",
            "default=nw=1",
            p,
        ],
    );
    for want in [
        "codec_name=h264".to_string(),
        format!("width={width}"),
        format!("height={height}"),
        format!("r_frame_rate={fps}"),
        format!("nb_read_frames={frames}"),
    ] {
        assert!(
            stream.lines().any(|l| l == want),
            "ffprobe: expected {want} in\n{stream}"
        );
    }
    let flags = tool(
        "ffprobe",
        &[
            "-v",
            "error",
            "-select_streams",
            "v:0",
            "-show_entries",
            "packet=flags",
            "-of",
            "csv=p=0",
            p,
        ],
    );
    let key: Vec<usize> = flags
        .lines()
        .enumerate()
        .filter(|(_, f)| f.starts_with('K'))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(key, keyframes, "keyframes");
    let errors = tool("ffmpeg", &["-v", "error", "-i", p, "-f", "null", "-"]);
    assert!(
        errors.trim().is_empty(),
        "a full decode reported errors: {errors}"
    );
}

/// Decoded pictures as raw RGB.
fn pixels(path: &Path) -> Vec<u8> {
    let out = Command::new("ffmpeg")
        .args([
            "-v",
            "error",
            "-i",
            path.to_str().unwrap(),
            "-f",
            "rawvideo",
            "-pix_fmt",
            "rgb24",
            "-",
        ])
        .output()
        .expect("ffmpeg");
    assert!(out.status.success());
    out.stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_arrive_in_order_and_form_a_playable_mp4() {
    let (server, mut client) = server(config("openh264", 4)).await;
    let (events, status) = collect(&mut client, request("a red fox in the snow", 7)).await;
    assert!(status.is_none(), "{status:?}");

    // Accepted, text 0/1 and 1/1, denoise 1..3, init, then segments and decode progress, Completed.
    let E::Accepted(a) = &events[0] else {
        panic!("first event {:?}", events[0])
    };
    assert_eq!(
        (a.width, a.height, a.num_frames, a.fps, a.steps, a.seed),
        (64, 48, 9, 12, 3, 7)
    );
    let phases: Vec<(i32, u32, u32)> = events
        .iter()
        .filter_map(|e| match e {
            E::Progress(p) => Some((p.phase, p.done, p.total)),
            _ => None,
        })
        .collect();
    let (t, d, v) = (
        pb::Phase::Text as i32,
        pb::Phase::Denoise as i32,
        pb::Phase::Decode as i32,
    );
    assert_eq!(
        phases,
        vec![
            (t, 0, 1),
            (t, 1, 1),
            (d, 1, 3),
            (d, 2, 3),
            (d, 3, 3),
            (v, 1, 9),
            (v, 5, 9),
            (v, 9, 9)
        ]
    );
    let init_at = events
        .iter()
        .position(|e| matches!(e, E::InitSegment(_)))
        .unwrap();
    let last_denoise = events
        .iter()
        .rposition(|e| matches!(e, E::Progress(p) if p.phase == d))
        .unwrap();
    assert!(
        init_at > last_denoise,
        "the init segment comes after denoising"
    );
    let segments: Vec<&pb::MediaSegment> = events
        .iter()
        .filter_map(|e| {
            if let E::MediaSegment(s) = e {
                Some(s)
            } else {
                None
            }
        })
        .collect();
    let layout: Vec<(u32, u32, u32)> = segments
        .iter()
        .map(|s| (s.sequence_number, s.first_frame, s.frame_count))
        .collect();
    assert_eq!(layout, vec![(1, 0, 1), (2, 1, 4), (3, 5, 2), (4, 7, 2)]);
    // Streaming: the first segment leaves before the last latent frame is decoded.
    let first_segment = events
        .iter()
        .position(|e| matches!(e, E::MediaSegment(_)))
        .unwrap();
    let last_decode = events
        .iter()
        .rposition(|e| matches!(e, E::Progress(p) if p.phase == v))
        .unwrap();
    assert!(first_segment < last_decode);
    let E::Completed(done) = events.last().unwrap() else {
        panic!("last event {:?}", events.last())
    };
    assert_eq!((done.frames, done.segments), (9, 4));

    let path = temp_file("ordered.mp4", &mp4_of(&events));
    probe(&path, 9, 64, 48, "12/1", &[0, 1, 5, 7]);
    server.stop().await.unwrap();
}

/// grpcio, the version the test installs (pinned), and the protoc that generates its stubs.
const GRPCIO: [&str; 2] = ["grpcio==1.68.1", "grpcio-tools==1.68.1"];

/// A client we did not write: grpcio with stubs generated from `proto/ditstream/v1/video.proto`
/// (tests/grpc/grpcio_client.py) streams a video, gets the documented statuses (limits, a
/// 100 kB model name, a deadline, Cancel), Health and ListModels; ffprobe plays the video.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpcio_client_from_our_proto_is_served() {
    let python = tokio::task::spawn_blocking(|| support::python_venv("venv-grpcio", &GRPCIO))
        .await
        .unwrap();
    let dir = std::env::temp_dir().join(format!("ditstream-grpcio-{}", std::process::id()));
    let stubs = dir.join("stubs");
    std::fs::create_dir_all(&stubs).unwrap();
    let protos = concat!(env!("CARGO_MANIFEST_DIR"), "/proto");
    let out = Command::new(&python)
        .args(["-m", "grpc_tools.protoc", "-I", protos])
        .arg(format!("--python_out={}", stubs.display()))
        .arg(format!("--grpc_python_out={}", stubs.display()))
        .arg(format!("{protos}/ditstream/v1/video.proto"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (server, _) = server(config("openh264", 4)).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/grpc/grpcio_client.py");
    let args = vec![
        server.addr.to_string(),
        stubs.display().to_string(),
        dir.display().to_string(),
    ];
    let report = support::run_script(python, script, args).await;
    assert_eq!(report["frames"], 9, "{report}");
    probe(&dir.join("grpcio.mp4"), 9, 64, 48, "12/1", &[0, 1, 5, 7]);
    server.stop().await.unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

/// The embedded default's video for one seed, pinned: CRC-32 of the MP4 that `ditstream generate`
/// writes for this request on the build machine (x86-64; the f32 reference ops pick their GEMM
/// kernels by CPU features, so another instruction set may round differently). It stayed byte for
/// byte the same when the service layer was rebuilt around the gateway (commit 13f2c8e's engine
/// before, (6332, 0x1881_c0d1)); it changed on purpose when every segment got an encoder of its
/// own (issue 22: segments encode in parallel, no rate-control state crosses a segment; same
/// latent, same VAE frames). `pools_e2e.rs` checks the pools against `serve`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_default_video_is_pinned() {
    let cfg = ditstream::serve::load_config(None).unwrap();
    let (server, mut client) = server(cfg).await;
    let req = pb::GenerateRequest {
        width: Some(64),
        height: Some(48),
        num_frames: Some(9),
        steps: Some(3),
        ..request("a pinned fox", 7)
    };
    let (events, status) = collect(&mut client, req).await;
    assert!(status.is_none(), "{status:?}");
    let mp4 = mp4_of(&events);
    assert_eq!(
        (mp4.len(), crc32fast::hash(&mp4)),
        (6552, 0x3610_3665),
        "the embedded default's video changed"
    );
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_segments_equal_the_non_streamed_encode() {
    let cfg = config("openh264", 4);
    let (server, mut client) = server(cfg.clone()).await;
    let (events, status) = collect(&mut client, request("a lighthouse at dusk", 11)).await;
    assert!(status.is_none(), "{status:?}");
    server.stop().await.unwrap();
    let streamed = temp_file("streamed.mp4", &mp4_of(&events));

    // The same request through the non-streamed path: whole decode, one fragment.
    let pipeline = Pipeline::from_config(&cfg).unwrap();
    let raw = RawRequest {
        prompt: "a lighthouse at dusk".into(),
        seed: Some(11),
        ..RawRequest::default()
    };
    let params = raw.validate(&cfg, "tiny").unwrap();
    let whole = temp_file("whole.mp4", &pipeline.render_whole(&params).unwrap());
    let (a, b) = (pixels(&streamed), pixels(&whole));
    assert_eq!(a.len(), 9 * 64 * 48 * 3);
    assert!(a == b, "streamed and non-streamed videos differ");
}

#[cfg(feature = "ffmpeg")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x264_backend_streams_a_playable_mp4() {
    let (server, mut client) = server(config("x264", 4)).await;
    let (events, status) = collect(&mut client, request("a paper boat", 3)).await;
    assert!(status.is_none(), "{status:?}");
    let path = temp_file("x264.mp4", &mp4_of(&events));
    probe(&path, 9, 64, 48, "12/1", &[0, 1, 5, 7]);
    server.stop().await.unwrap();
}

#[test]
fn x264_without_its_feature_is_a_clear_startup_error() {
    if cfg!(feature = "ffmpeg") {
        return; // built with FFmpeg: the backend exists (tested above)
    }
    let err = Pipeline::from_config(&config("x264", 4))
        .err()
        .expect("x264 needs --features ffmpeg");
    assert!(
        format!("{err:#}").starts_with("serving.encoder = X264"),
        "{err:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timings_are_measured_and_add_up() {
    let (server, mut client) = server(config("openh264", 4)).await;
    let (events, _) = collect(&mut client, request("timings", 1)).await;
    let Some(E::Completed(done)) = events.last() else {
        panic!("no Completed")
    };
    let t = done.timings.unwrap();
    let parts = t.queue_ms + t.text_ms + t.denoise_ms + t.decode_ms + t.encode_ms;
    for (name, v) in [
        ("text", t.text_ms),
        ("denoise", t.denoise_ms),
        ("decode", t.decode_ms),
        ("encode", t.encode_ms),
    ] {
        assert!(v > 0.0, "{name} took {v} ms");
    }
    // Queue, text, denoise and decode run one after another inside the request: their sum cannot
    // exceed the total. Encoding runs beside the decode on the encoder threads (summed over
    // segments, it may overlap anything after the first chunk), so it only bounds what is left
    // (noise generation, handing events to the stream, the last segment's encode), which is small.
    let serial = parts - t.encode_ms;
    assert!(
        serial <= t.total_ms,
        "stages {serial} ms > total {} ms",
        t.total_ms
    );
    assert!(
        t.total_ms - parts < 0.2 * t.total_ms + 50.0,
        "unaccounted {} ms of {}",
        t.total_ms - parts,
        t.total_ms
    );
    // The first segment leaves after denoising and before the end.
    assert!(
        t.first_segment_ms >= t.queue_ms + t.text_ms + t.denoise_ms
            && t.first_segment_ms <= t.total_ms
    );
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_requests_get_invalid_argument_naming_the_rule() {
    let (server, mut client) = server(config("openh264", 4)).await;
    let cases = [
        (
            pb::GenerateRequest {
                num_frames: Some(0),
                ..request("x", 1)
            },
            "num_frames = 0: must be 4k+1",
        ),
        (
            pb::GenerateRequest {
                width: Some(7),
                height: Some(7),
                ..request("x", 1)
            },
            "width = 7: must be a positive multiple of 16",
        ),
        (
            pb::GenerateRequest {
                steps: Some(5000),
                ..request("x", 1)
            },
            "steps = 5000: must be in 1..=100",
        ),
        (
            pb::GenerateRequest {
                model: "sora".into(),
                ..request("x", 1)
            },
            "model = \"sora\": unknown",
        ),
        (request("   ", 1), "prompt = \"\": must not be empty"),
    ];
    for (req, want) in cases {
        let (events, status) = collect(&mut client, req).await;
        let status = status.expect("an error status");
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(
            status.message().starts_with(want),
            "{:?} does not start with {want:?}",
            status.message()
        );
        assert!(events.is_empty());
    }
    server.stop().await.unwrap();
}

/// Reads events until the first denoising step is reported; returns the request id.
async fn until_first_step(stream: &mut tonic::Streaming<pb::GenerateEvent>) -> String {
    let mut id = String::new();
    loop {
        match stream.message().await.unwrap().unwrap().event.unwrap() {
            E::Accepted(a) => id = a.request_id,
            E::Progress(p) if p.phase == pb::Phase::Denoise as i32 => return id,
            _ => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_disconnect_and_deadline_stop_the_work_and_the_next_request_runs() {
    let (server, mut client) = server(config("openh264", 4)).await;
    let long = || pb::GenerateRequest {
        steps: Some(100),
        ..request("a long one", 5)
    };

    // Cancel by id mid-denoise: the stream ends with CANCELLED.
    let mut stream = client.generate(long()).await.unwrap().into_inner();
    let id = until_first_step(&mut stream).await;
    let cancelled = client
        .cancel(pb::CancelRequest {
            request_id: id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(cancelled.cancelled);
    let status = loop {
        match stream.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("stream ended without a status"),
            Err(s) => break s,
        }
    };
    assert_eq!(status.code(), Code::Cancelled, "{status:?}");

    // A client that goes away mid-denoise: the engine notices at its next step.
    let mut stream = client.generate(long()).await.unwrap().into_inner();
    until_first_step(&mut stream).await;
    drop(stream);

    // A deadline that passes mid-denoise (81 frames: several seconds even in a release build,
    // where 9 frames of 100 steps finish inside the deadline).
    let mut req = tonic::Request::new(pb::GenerateRequest {
        num_frames: Some(81),
        ..long()
    });
    req.set_timeout(Duration::from_millis(1500));
    let (_, status) = match client.generate(req).await {
        Ok(s) => {
            let mut s = s.into_inner();
            loop {
                match s.message().await {
                    Ok(Some(_)) => continue,
                    Ok(None) => break ((), None),
                    Err(e) => break ((), Some(e)),
                }
            }
        }
        Err(e) => ((), Some(e)),
    };
    assert_eq!(status.expect("deadline").code(), Code::DeadlineExceeded);

    // Everything was released: the next request completes, and nothing is left running.
    let (events, status) = collect(&mut client, request("after", 2)).await;
    assert!(status.is_none(), "{status:?}");
    assert!(matches!(events.last(), Some(E::Completed(_))));
    let health = client
        .health(pb::HealthRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!((health.queued, health.running), (0, 0));
    // A request that ended is no longer known.
    let e = client
        .cancel(pb::CancelRequest { request_id: id })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_is_resource_exhausted() {
    let (server, mut client) = server(config("openh264", 1)).await;
    let long = || pb::GenerateRequest {
        steps: Some(100),
        ..request("busy", 5)
    };
    let mut running = client.generate(long()).await.unwrap().into_inner();
    let running_id = until_first_step(&mut running).await;
    // One may wait…
    let mut queued = client.generate(long()).await.unwrap().into_inner();
    let E::Accepted(a) = queued.message().await.unwrap().unwrap().event.unwrap() else {
        panic!()
    };
    assert_eq!(a.queue_position, 1);
    // …the next is refused.
    let (_, status) = collect(&mut client, long()).await;
    assert_eq!(status.expect("refused").code(), Code::ResourceExhausted);
    let models = client
        .list_models(pb::ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(models.models[0].name, "tiny");
    for id in [running_id, a.request_id] {
        assert!(
            client
                .cancel(pb::CancelRequest { request_id: id })
                .await
                .unwrap()
                .into_inner()
                .cancelled
        );
    }
    server.stop().await.unwrap();
}

/// A diffusers-layout checkpoint folder assembled from the parity fixtures (the head-dim-128
/// mini transformer, the tiny umT5 and its tokenizer, the base-16 VAE), served through
/// `weights: checkpoint`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_diffusers_checkpoint_folder_serves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let ckpt = std::env::temp_dir().join(format!("ditstream-e2e-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&ckpt).unwrap();
    for (link, target) in [
        (
            "transformer",
            "denoiser/tests/fixtures/dit_mini128/transformer",
        ),
        (
            "text_encoder",
            "denoiser/tests/fixtures/text_umt5/text_encoder",
        ),
        ("tokenizer", "denoiser/tests/fixtures/text_umt5/tokenizer"),
        ("vae", "decoder/tests/fixtures/vae_base16/vae"),
    ] {
        let _ = std::fs::remove_file(ckpt.join(link));
        std::os::unix::fs::symlink(root.join(target), ckpt.join(link)).unwrap();
    }
    let yaml = format!(
        "model:\n  checkpoint: {}\n  weights: checkpoint\nsampler:\n  steps: 2\nserving:\n  width: 64\n  \
         height: 48\n  num_frames: 5\n",
        ckpt.display()
    );
    let cfg = Config::parse(&yaml, "<test>").unwrap();
    cfg.validate(Some(1)).unwrap();
    let (server, mut client) = server(cfg).await;
    let models = client
        .list_models(pb::ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    let name = models.models[0].name.clone();
    assert!(name.starts_with("ditstream-e2e-ckpt"), "{name}");
    let (events, status) = collect(
        &mut client,
        pb::GenerateRequest {
            model: name,
            ..request("a checkpoint", 4)
        },
    )
    .await;
    assert!(status.is_none(), "{status:?}");
    let path = temp_file("checkpoint.mp4", &mp4_of(&events));
    probe(&path, 5, 64, 48, "16/1", &[0, 1, 3]);
    server.stop().await.unwrap();
}

/// `ditstream generate` as the README runs it (here at a small size): its stderr is its own
/// progress, with none of OpenH264's raw log lines (they go through `tracing`, target `openh264`).
#[test]
fn the_client_prints_no_raw_encoder_log() {
    let dir = std::env::temp_dir().join(format!("ditstream-quiet-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("small.yaml");
    std::fs::write(
        &config,
        "model: {preset: tiny}\nsampler: {steps: 2}\nserving: {width: 64, height: 48, num_frames: 9}\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ditstream"))
        .args(["generate", "--prompt", "quiet", "--config"])
        .arg(&config)
        .arg("--output")
        .arg(dir.join("quiet.mp4"))
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("decode 9/9"), "{stderr}");
    assert!(!stderr.contains("OpenH264"), "{stderr}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// `ditstream generate` against a server that accepts the connection and never answers: it
/// fails with the reason (its HTTP/2 pings unanswered) instead of waiting for ever.
#[test]
fn the_client_gives_up_on_a_server_that_never_answers() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    // Accepts, holds and never reads or writes.
    std::thread::spawn(move || {
        let held: Vec<_> = silent.incoming().collect();
        drop(held);
    });
    let output = std::env::temp_dir().join(format!("ditstream-silent-{}.mp4", std::process::id()));
    let started = std::time::Instant::now();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ditstream"))
        .args(["generate", "--prompt", "anyone there", "--server"])
        .arg(addr.to_string())
        .arg("--output")
        .arg(&output)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Pings every 10 s, each given 10 s: it gives up after about 20 s.
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("still waiting after {:?}", started.elapsed());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("keep-alive timed out"), "{stderr}");
    let _ = std::fs::remove_file(output);
}

/// An encoder that fails once, at frame 5 (the first of segment 3), and otherwise is OpenH264.
struct FailsOnce(EncoderBackend, Arc<AtomicBool>);

struct FailingEncoder(Box<dyn VideoEncoder>, Arc<AtomicBool>);

impl OpenEncoder for FailsOnce {
    fn name(&self) -> &'static str {
        "fails-once"
    }
    fn parameter_sets(&self, params: VideoParams) -> Result<ParameterSets, EncodeError> {
        self.0.parameter_sets(params)
    }
    fn open_segment(
        &self,
        params: VideoParams,
        sets: &ParameterSets,
        first_frame: u64,
    ) -> Result<Box<dyn VideoEncoder>, EncodeError> {
        let inner = self.0.open_segment(params, sets, first_frame)?;
        Ok(Box::new(FailingEncoder(inner, Arc::clone(&self.1))))
    }
}

impl VideoEncoder for FailingEncoder {
    fn backend(&self) -> &'static str {
        "fails-once"
    }
    fn parameter_sets(&self) -> &ParameterSets {
        self.0.parameter_sets()
    }
    fn encode(
        &mut self,
        frame: &Yuv420Frame,
        frame_index: u64,
        force_keyframe: bool,
    ) -> Result<Vec<AccessUnit>, EncodeError> {
        if frame_index == 5 && self.1.swap(false, Ordering::SeqCst) {
            return Err(EncodeError::Backend {
                backend: "fails-once",
                during: format!("encoding frame {frame_index}"),
                message: "injected failure".into(),
            });
        }
        self.0.encode(frame, frame_index, force_keyframe)
    }
    fn flush(&mut self) -> Result<Vec<AccessUnit>, EncodeError> {
        self.0.flush()
    }
}

/// A failing encoder fails its request with INTERNAL naming the segment, after the segments
/// before it were delivered; the encoder threads survive and the next request completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_encoder_that_fails_fails_its_request_and_the_next_runs() {
    let cfg = config("openh264", 4);
    let armed = Arc::new(AtomicBool::new(true));
    let pipeline = Pipeline::from_config(&cfg)
        .unwrap()
        .with_encoder(Arc::new(FailsOnce(
            EncoderBackend::default(),
            Arc::clone(&armed),
        )));
    let server = start_with(cfg, pipeline, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let mut client = VideoServiceClient::connect(format!("http://{}", server.addr))
        .await
        .unwrap();

    let (events, status) = collect(&mut client, request("a broken encoder", 5)).await;
    let status = status.expect("the failed encode ends the stream with a status");
    assert_eq!(status.code(), Code::Internal, "{status:?}");
    assert!(
        status
            .message()
            .contains("encoding segment 3 (frames 5..=6)")
            && status.message().contains("injected failure"),
        "{}",
        status.message()
    );
    assert!(!armed.load(Ordering::SeqCst), "the encoder never failed");
    // Segments 1 and 2 (frames 0 and 1–4) were encoded before it and were delivered.
    let delivered: Vec<u32> = events
        .iter()
        .filter_map(|e| match e {
            E::MediaSegment(s) => Some(s.sequence_number),
            _ => None,
        })
        .collect();
    assert_eq!(delivered, vec![1, 2]);

    let (events, status) = collect(&mut client, request("the next one", 6)).await;
    assert!(status.is_none(), "{status:?}");
    let path = temp_file("after-failure.mp4", &mp4_of(&events));
    probe(&path, 9, 64, 48, "12/1", &[0, 1, 5, 7]);
    server.stop().await.unwrap();
}

/// `serving.warmup`: the server listens at once but is not ready (Health says not serving) until
/// every listed shape has run once; then it serves, and a request of a warmed shape completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_is_not_ready_until_warm() {
    let mut cfg = config("openh264", 4);
    cfg.serving.warmup = Some(vec![
        ditstream_common::config::WarmupShape {
            width: 64,
            height: 48,
            num_frames: 9,
        };
        3
    ]);
    cfg.validate(Some(1)).unwrap();
    // A free port, known before the server starts (start returns only once it is warm).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    let starting = tokio::spawn(start(cfg, addr));
    let mut answers = Vec::new();
    while !starting.is_finished() {
        if let Ok(mut client) = VideoServiceClient::connect(format!("http://{addr}")).await
            && let Ok(h) = client.health(pb::HealthRequest {}).await
        {
            answers.push(h.into_inner().serving);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let server = starting.await.unwrap().unwrap();
    // Not serving until warm: false first, and once true never false again (the pools are added
    // just before `start` returns, so the last polls may already see them).
    let warm_from = answers.iter().position(|&s| s).unwrap_or(answers.len());
    assert!(
        answers.first() == Some(&false) && answers[warm_from..].iter().all(|&s| s),
        "Health while warming up: {answers:?}"
    );
    let mut client = VideoServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let health = client
        .health(pb::HealthRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(health.serving, "not serving after the warm-up");
    let (_, status) = collect(&mut client, request("after the warm-up", 2)).await;
    assert!(status.is_none(), "{status:?}");
    server.stop().await.unwrap();
}
