//! The HTTP API and the operator's endpoints, judged by clients we did not write: the official
//! `openai` Python SDK (from PyPI, in a venv under target/) drives the Videos API against
//! `serve`; `curl` streams a running job's content; ffprobe decodes what they got; a
//! grpc.health.v1 client and a reflection client (tonic's generated ones, from the standard
//! protos) check the probes; `/metrics` is parsed before and after a request, and by the Prometheus
//! project's OpenMetrics parser (`prometheus_client`, PyPI, in a venv). Storage bounds and
//! a restart are checked over the same HTTP API.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use ditstream::serve::{RunningServer, start};
use ditstream_common::config::Config;
use ditstream_proto::v1 as pb;
use ditstream_proto::v1::video_service_client::VideoServiceClient;

/// The openai SDK version the test installs (pinned, so a new release cannot change the
/// verdict silently).
const OPENAI_SDK: &str = "openai==3.57.0";
/// The Prometheus project's Python client, whose OpenMetrics parser judges `/metrics`.
const PROMETHEUS_CLIENT: &str = "prometheus-client==0.21.1";

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ditstream-http-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The tiny model, its videos in `videos` with `bounds` (e.g. `max_count: 1`).
fn config(videos: &Path, bounds: &str) -> Config {
    let yaml = format!(
        "model:\n  preset: tiny\nsampler:\n  steps: 2\nserving:\n  width: 64\n  height: 48\n  \
         num_frames: 9\n  fps: 16\n  queue_depth: 8\n  videos: {{dir: {}, {bounds}}}\n",
        videos.display()
    );
    let cfg = Config::parse(&yaml, "<test>").unwrap();
    cfg.validate(Some(1)).unwrap();
    cfg
}

async fn serve(cfg: Config) -> (RunningServer, String) {
    let server = start(cfg, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let base = format!("http://{}", server.addr);
    (server, base)
}

/// `curl` (a blocking call, off the runtime): the body and the HTTP status.
async fn curl(args: &[&str]) -> (String, u16) {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let out = tokio::task::spawn_blocking(move || {
        Command::new("curl")
            .args(["-s", "-w", "\n%{http_code}"])
            .args(&args)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap();
    (body.to_string(), code.trim().parse().unwrap())
}

async fn post_video(base: &str, body: &str) -> serde_json::Value {
    let (text, code) = curl(&[
        "-X",
        "POST",
        &format!("{base}/v1/videos"),
        "-H",
        "content-type: application/json",
        "-d",
        body,
    ])
    .await;
    assert_eq!(code, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

async fn video(base: &str, id: &str) -> (serde_json::Value, u16) {
    let (text, code) = curl(&[&format!("{base}/v1/videos/{id}")]).await;
    (serde_json::from_str(&text).unwrap(), code)
}

async fn until_finished(base: &str, id: &str) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let (v, _) = video(base, id).await;
        if v["status"] == "completed" || v["status"] == "failed" {
            return v;
        }
        assert!(start.elapsed() < Duration::from_secs(300), "{v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Frames ffprobe decodes in `file`.
fn frames(file: &Path) -> usize {
    let out = Command::new("ffprobe")
        .args(["-v", "error", "-count_frames", "-select_streams", "v:0"])
        .args(["-show_entries", "stream=nb_read_frames", "-of", "csv=p=0"])
        .arg(file)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or(0)
}

/// A venv under target/ with the openai SDK; its python.
fn sdk_python() -> PathBuf {
    support::python_venv("venv-openai", &[OPENAI_SDK])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_drives_the_videos_api() {
    let dir = scratch("sdk");
    let python = tokio::task::spawn_blocking(sdk_python).await.unwrap();
    let (server, base) = serve(config(&dir.join("videos"), "ttl_s: 3600")).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/http/openai_videos.py");
    let args = vec![format!("{base}/v1"), dir.display().to_string()];
    let report = support::run_script(python, script, args).await;
    // seconds "1" at 16 fps is 17 frames (4k+1); the thumbnail is frame 0 at the video's size.
    assert_eq!(frames(&dir.join("sdk.mp4")), 17);
    let probe = Command::new("ffprobe")
        .args([
            "-v",
            "error",
            "-show_entries",
            "stream=codec_name,width,height",
            "-of",
            "csv=p=0",
        ])
        .arg(dir.join("thumbnail.png"))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&probe.stdout).trim(), "png,256,160");
    // The job behind a deleted one started within a fraction of a second (the tiny model's
    // transformer block takes milliseconds; polling adds its 10 ms).
    assert!(report["next_started_s"].as_f64().unwrap() < 2.0, "{report}");
    server.stop().await.unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_streams_a_running_job_playable_to_its_last_segment() {
    let dir = scratch("curl");
    let (server, base) = serve(config(&dir.join("videos"), "ttl_s: 3600")).await;
    // 33 frames: 9 segments, streamed while they are made.
    let v = post_video(&base, r#"{"prompt": "streamed", "num_frames": 33}"#).await;
    let id = v["id"].as_str().unwrap().to_string();
    let file = dir.join("streamed.mp4");
    let url = format!("{base}/v1/videos/{id}/content");
    let (f, u) = (file.clone(), url.clone());
    let streaming = tokio::task::spawn_blocking(move || {
        Command::new("curl")
            .args(["-sN", "-o"])
            .arg(&f)
            .arg(&u)
            .status()
            .unwrap()
    });
    let done = until_finished(&base, &id).await;
    assert_eq!(done["status"], "completed");
    assert!(streaming.await.unwrap().success());
    assert_eq!(frames(&file), 33);

    // A job deleted mid-decode: what curl got so far plays, up to its last whole segment.
    let v = post_video(&base, r#"{"prompt": "cut short", "num_frames": 81}"#).await;
    let id = v["id"].as_str().unwrap().to_string();
    let cut = dir.join("cut.mp4");
    let (f, u) = (cut.clone(), format!("{base}/v1/videos/{id}/content"));
    let streaming = tokio::task::spawn_blocking(move || {
        Command::new("curl")
            .args(["-sN", "-o"])
            .arg(&f)
            .arg(&u)
            .status()
            .unwrap()
    });
    let start = Instant::now();
    loop {
        let (v, _) = video(&base, &id).await;
        if v["progress"].as_u64().unwrap() >= 85 {
            break; // decoding, segments out
        }
        assert!(start.elapsed() < Duration::from_secs(120), "{v}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (text, code) = curl(&["-X", "DELETE", &format!("{base}/v1/videos/{id}")]).await;
    assert_eq!(code, 200, "{text}");
    let _ = streaming.await.unwrap();
    let got = frames(&cut);
    assert!(got > 0 && got < 81, "{got} frames");
    let (_, code) = video(&base, &id).await;
    assert_eq!(code, 404);
    server.stop().await.unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn videos_survive_a_restart_within_their_bounds() {
    let dir = scratch("store");
    let store = dir.join("videos");
    let (server, base) = serve(config(&store, "ttl_s: 3600")).await;
    let mut ids = Vec::new();
    for prompt in ["first", "second"] {
        let v = post_video(&base, &format!(r#"{{"prompt": "{prompt}"}}"#)).await;
        let id = v["id"].as_str().unwrap().to_string();
        assert_eq!(until_finished(&base, &id).await["status"], "completed");
        ids.push(id);
    }
    server.stop().await.unwrap();
    // An unfinished video of an earlier run (no metadata beside it) is deleted at start.
    let orphan = store.join("req-0123.mp4");
    std::fs::write(&orphan, b"half a video").unwrap();

    // A restart lists both, newest first, and serves their content.
    let (server, base) = serve(config(&store, "ttl_s: 3600")).await;
    let (text, _) = curl(&[&format!("{base}/v1/videos")]).await;
    let list: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(!orphan.exists());
    let listed: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["id"].as_str().unwrap())
        .collect();
    assert_eq!(listed, [ids[1].as_str(), ids[0].as_str()]);
    let file = dir.join("again.mp4");
    let (_, code) = curl(&[
        "-o",
        file.to_str().unwrap(),
        &format!("{base}/v1/videos/{}/content", ids[0]),
    ])
    .await;
    assert_eq!(code, 200);
    assert_eq!(frames(&file), 9);
    server.stop().await.unwrap();

    // With room for one video the oldest goes at start-up, and the next goes when a newer one
    // finishes; a video made with a 1 s lifetime is gone once that has passed.
    let (server, base) = serve(config(&store, "max_count: 1, ttl_s: 1")).await;
    let (_, code) = video(&base, &ids[0]).await;
    assert_eq!(code, 404);
    assert!(!store.join(format!("{}.mp4", ids[0])).exists());
    let (_, code) = video(&base, &ids[1]).await;
    assert_eq!(code, 200);
    let v = post_video(&base, r#"{"prompt": "short-lived"}"#).await;
    let short = v["id"].as_str().unwrap().to_string();
    until_finished(&base, &short).await;
    let (_, code) = video(&base, &ids[1]).await;
    assert_eq!(code, 404);
    server.stop().await.unwrap();
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let (server, base) = serve(config(&store, "ttl_s: 1")).await;
    let (_, code) = video(&base, &short).await;
    assert_eq!(code, 404);
    assert!(!store.join(format!("{short}.mp4")).exists());
    server.stop().await.unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

/// `name{labels} value` in the text format, 0 when absent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_health_and_reflection() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let dir = scratch("metrics");
    let (server, base) = serve(config(&dir.join("videos"), "ttl_s: 3600")).await;
    let (before, code) = curl(&[&format!("{base}/metrics")]).await;
    assert_eq!(code, 200);
    let v = post_video(&base, r#"{"prompt": "counted"}"#).await;
    until_finished(&base, v["id"].as_str().unwrap()).await;
    let (after, _) = curl(&[&format!("{base}/metrics")]).await;
    for (name, grows_by) in [
        ("ditstream_requests_total{outcome=\"completed\"}", 1.0),
        ("ditstream_time_to_first_segment_seconds_count", 1.0),
        ("ditstream_phase_seconds_count{phase=\"denoise\"}", 1.0),
        ("ditstream_phase_seconds_count{phase=\"queue\"}", 1.0),
        ("ditstream_request_seconds_count", 1.0),
        ("ditstream_segment_gap_seconds_count", 3.0), // 9 frames: 4 segments (the last in halves), 3 gaps
    ] {
        assert_eq!(
            support::sample(&after, name) - support::sample(&before, name),
            grows_by,
            "{name}\n{after}"
        );
    }
    assert!(
        support::sample(&after, "ditstream_streamed_bytes_total")
            > support::sample(&before, "ditstream_streamed_bytes_total")
    );
    assert!(
        after.contains("ditstream_pool_up{pool=\"denoiser-1\",role=\"denoiser\"} 1"),
        "{after}"
    );

    // The Prometheus project's own OpenMetrics parser takes the whole text, types and all.
    let python = tokio::task::spawn_blocking(|| {
        support::python_venv("venv-prometheus", &[PROMETHEUS_CLIENT])
    })
    .await
    .unwrap();
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/http/prometheus_scrape.py"
    );
    let report = support::run_script(python, script, vec![base.clone()]).await;
    let content_type = report["content_type"].as_str().unwrap();
    assert!(
        content_type.starts_with("application/openmetrics-text"),
        "{content_type}"
    );
    let families = &report["families"];
    let value = |family: &str, kind: &str, labels: serde_json::Value| -> f64 {
        let f = &families[family];
        assert_eq!(f["type"], kind, "{family}: {f}");
        let samples = f["samples"].as_array().unwrap();
        let found = samples.iter().find(|s| s[1] == labels);
        found.unwrap_or_else(|| panic!("{family} {labels}: {f}"))[2]
            .as_f64()
            .unwrap()
    };
    let completed = serde_json::json!({"outcome": "completed"});
    assert!(value("ditstream_requests", "counter", completed) >= 1.0);
    let created = serde_json::json!({"route": "/v1/videos", "code": "200"});
    assert!(value("ditstream_http_responses", "counter", created) >= 1.0);
    let public = serde_json::json!({"listener": "serving.listen"});
    assert!(value("ditstream_connections", "gauge", public) >= 1.0);
    let unread = serde_json::json!({"listener": "serving.listen", "reason": "send_timeout"});
    assert_eq!(
        value("ditstream_connections_closed", "counter", unread),
        0.0
    );
    for histogram in [
        "ditstream_request_seconds",
        "ditstream_time_to_first_segment_seconds",
        "ditstream_phase_seconds",
    ] {
        assert_eq!(families[histogram]["type"], "histogram", "{histogram}");
    }

    // grpc.health.v1 on the same port: SERVING with both pools.
    let channel = tonic::transport::Endpoint::from_shared(base.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let check = |service: &str| tonic_health::pb::HealthCheckRequest {
        service: service.to_string(),
    };
    let mut health = HealthClient::new(channel.clone());
    for service in ["", "ditstream.v1.VideoService"] {
        let s = health
            .check(check(service))
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(s, ServingStatus::Serving as i32, "{service:?}");
    }

    // Reflection lists the public service.
    let mut reflection = ServerReflectionClient::new(channel);
    let ask = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = reflection
        .server_reflection_info(tokio_stream::iter([ask]))
        .await
        .unwrap()
        .into_inner();
    let Some(MessageResponse::ListServicesResponse(list)) =
        answers.message().await.unwrap().unwrap().message_response
    else {
        panic!("no service list")
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"ditstream.v1.VideoService".to_string()),
        "{names:?}"
    );
    server.stop().await.unwrap();

    // A gateway with no pools registered is NOT_SERVING.
    let cfg = config(&dir.join("videos"), "ttl_s: 3600");
    let gw = ditstream::gateway::serve(
        ditstream::gateway::Gateway::new(&cfg, None).unwrap(),
        "127.0.0.1:0".parse().unwrap(),
        None,
    )
    .await
    .unwrap();
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", gw.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let s = health.check(check("")).await.unwrap().into_inner().status;
    assert_eq!(s, ServingStatus::NotServing as i32);
    gw.stop(Duration::from_secs(1)).await;
    std::fs::remove_dir_all(dir).unwrap();
}

/// Requests no handler should see are answered in OpenAI's error shape with the HTTP status
/// that says why: a body trickled past `connections.request_timeout_s` (408), one over
/// `max_request_bytes` (413), a query that does not parse (400), a method a route does not
/// serve (405), and a clip longer than the server makes, named by the field the client sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_slow_requests_get_openai_errors() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = scratch("malformed");
    let mut cfg = config(&dir.join("videos"), "ttl_s: 3600");
    cfg.connections.request_timeout_s = 1.0;
    cfg.connections.max_request_bytes = 4096;
    let (server, base) = serve(cfg).await;
    let videos = format!("{base}/v1/videos");
    let error = |text: &str| -> serde_json::Value {
        let v: serde_json::Value = serde_json::from_str(text).unwrap();
        v["error"].clone()
    };

    // 1000 bytes announced, one sent every 100 ms: answered at the request timeout.
    let mut tcp = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let head = "POST /v1/videos HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                content-length: 1000\r\n\r\n{";
    tcp.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let (mut read, mut write) = tcp.into_split();
    let trickle = tokio::spawn(async move {
        while write.write_all(b" ").await.is_ok() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), read.read(&mut answer))
        .await
        .expect("no answer to a trickled body")
        .unwrap();
    let answered = started.elapsed();
    trickle.abort();
    let answer = String::from_utf8_lossy(&answer[..n]).to_string();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    let (_, body) = answer.split_once("\r\n\r\n").unwrap();
    let e = error(body);
    assert_eq!(e["code"], "request_timeout", "{e}");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("connections.request_timeout_s"),
        "{e}"
    );
    assert!(
        answered >= Duration::from_millis(900) && answered < Duration::from_secs(4),
        "answered after {answered:?}"
    );

    let big = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(5000));
    let json = ["-H", "content-type: application/json", "-d"];
    let (text, code) = curl(&[&[videos.as_str()][..], &json, &[&big]].concat()).await;
    assert_eq!(code, 413, "{text}");
    let e = error(&text);
    assert_eq!(e["code"], "request_too_large", "{e}");
    assert!(e["message"].as_str().unwrap().contains("4096"), "{e}");

    let (text, code) = curl(&[&format!("{videos}?limit=-5")]).await;
    assert_eq!(code, 400, "{text}");
    assert_eq!(error(&text)["param"], "query", "{text}");

    let (text, code) = curl(&["-X", "PUT", &videos]).await;
    assert_eq!(code, 405, "{text}");
    assert_eq!(error(&text)["code"], "method_not_allowed", "{text}");

    // 100 s at 16 fps is 1601 frames, past the server's limit: the error names `seconds`.
    let long = r#"{"prompt": "x", "seconds": "100"}"#;
    let (text, code) = curl(&[&[videos.as_str()][..], &json, &[long]].concat()).await;
    assert_eq!(code, 400, "{text}");
    let e = error(&text);
    assert_eq!(e["param"], "seconds", "{e}");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .starts_with("seconds \"100\" is 1601 frames at 16 fps; num_frames = 1601:"),
        "{e}"
    );
    let (_, code) = curl(&[&format!("{base}/v2/videos")]).await;
    assert_eq!(code, 404);

    // Each answer is counted by its route and status, also those no handler saw.
    let text = support::scrape(server.addr).await;
    for (route, code, count) in [
        ("/v1/videos", 408, 1.0),
        ("/v1/videos", 413, 1.0),
        ("/v1/videos", 400, 2.0),
        ("/v1/videos", 405, 1.0),
        ("unmatched", 404, 1.0),
    ] {
        let name = format!(r#"ditstream_http_responses_total{{route="{route}",code="{code}"}}"#);
        assert_eq!(support::sample(&text, &name), count, "{name}\n{text}");
    }
    server.stop().await.unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_needs_the_api_key_and_hides_other_keys_videos() {
    let dir = scratch("keys");
    let keys = dir.join("keys.txt");
    let alice = ditstream::gateway::keys::add(&keys, "alice").unwrap();
    let bob = ditstream::gateway::keys::add(&keys, "bob").unwrap();
    let mut cfg = config(&dir.join("videos"), "ttl_s: 3600");
    cfg.serving.api_keys = Some(keys.display().to_string());
    let (server, base) = serve(cfg).await;
    let videos = format!("{base}/v1/videos");
    let body = r#"{"prompt": "mine"}"#;
    let (text, code) = curl(&[
        "-X",
        "POST",
        &videos,
        "-H",
        "content-type: application/json",
        "-d",
        body,
    ])
    .await;
    assert_eq!(code, 401, "{text}");
    let e: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(e["error"]["type"], "authentication_error", "{e}");
    // A wrong key, and a gRPC call with none: the operator sees each refusal.
    let (_, code) = curl(&[&videos, "-H", "authorization: Bearer not-a-key"]).await;
    assert_eq!(code, 401);
    let mut grpc = VideoServiceClient::connect(base.clone()).await.unwrap();
    let e = grpc
        .list_models(pb::ListModelsRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    let text = support::scrape(server.addr).await;
    let failures = support::sample(&text, "ditstream_auth_failures_total");
    assert_eq!(failures, 3.0, "{text}");
    let auth = |key: &str| format!("authorization: Bearer {key}");
    let (text, code) = curl(&[
        "-X",
        "POST",
        &videos,
        "-H",
        "content-type: application/json",
        "-H",
        &auth(&alice),
        "-d",
        body,
    ])
    .await;
    assert_eq!(code, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let id = v["id"].as_str().unwrap();
    // Bob sees neither the video nor its content, and cannot delete it.
    for args in [
        vec![format!("{videos}/{id}")],
        vec![format!("{videos}/{id}/content")],
        vec!["-X".into(), "DELETE".into(), format!("{videos}/{id}")],
    ] {
        let mut a: Vec<&str> = args.iter().map(String::as_str).collect();
        let h = auth(&bob);
        a.extend(["-H", &h]);
        let (text, code) = curl(&a).await;
        assert_eq!(code, 404, "{args:?}: {text}");
    }
    let (text, _) = curl(&[&videos, "-H", &auth(&bob)]).await;
    let list: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(list["data"].as_array().unwrap().len(), 0, "{list}");
    let (text, code) = curl(&[&format!("{videos}/{id}"), "-H", &auth(&alice)]).await;
    assert_eq!(code, 200, "{text}");
    server.stop().await.unwrap();
    // Stopping waits for the job's relay (its request done or cancelled): its last state is on
    // disk, and nothing writes into the folder any more (the removal below once raced it).
    let sidecar = dir.join("videos").join(format!("{id}.json"));
    assert!(sidecar.is_file(), "{} after stop", sidecar.display());
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_plays_the_video_while_it_is_made() {
    let dir = scratch("page");
    let (server, base) = serve(config(&dir.join("videos"), "ttl_s: 3600")).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/http/browser.py");
    let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("page.png");
    // 81 frames: 21 segments, decoded over seconds, so the first plays long before the last
    // exists (the script checks that while the job is in progress).
    let args = vec![format!("{base}/"), shot.display().to_string(), "81".into()];
    let report = support::run_script("python3".into(), script, args).await;
    assert_eq!(report["end"]["frames"], 81, "{report}");
    assert!(std::fs::metadata(&shot).unwrap().len() > 1000);
    server.stop().await.unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}
