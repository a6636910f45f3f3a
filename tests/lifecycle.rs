//! The request lifecycle rules, over real sockets against `serve` (the gateway and both pools in
//! one process): a queued Cancel ends its stream at once; queued clients that leave free their
//! slots at once; a client that never reads (HTTP/2 window 0) loses its request and delays nobody;
//! an absurd `grpc-timeout` gets a clean answer; a request beyond the devices is refused at
//! admission; the events come in the documented order. Killing pool processes is in
//! `pools_e2e.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test

use std::time::{Duration, Instant};

use ditstream::serve::{RunningServer, start};
use ditstream_common::config::Config;
use ditstream_proto::v1 as pb;
use ditstream_proto::v1::generate_event::Event as E;
use ditstream_proto::v1::video_service_client::VideoServiceClient;
use prost::Message;
use tonic::Code;
use tonic::transport::Channel;

/// The tiny model at 64×48, 9 frames, 3 steps (about a second a request on two cores); a client
/// that reads nothing for 1 s loses its request.
fn config() -> Config {
    let yaml = "model:\n  preset: tiny\nsampler:\n  steps: 3\n  shift: 3.0\nserving:\n  width: 64\n  \
                height: 48\n  num_frames: 9\n  fps: 12\n  queue_depth: 8\n  client_send_timeout_s: 1\n";
    let cfg = Config::parse(yaml, "<test>").unwrap();
    cfg.validate(Some(1)).unwrap();
    cfg
}

async fn server() -> (RunningServer, VideoServiceClient<Channel>) {
    let server = start(config(), "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let client = VideoServiceClient::connect(format!("http://{}", server.addr))
        .await
        .unwrap();
    (server, client)
}

fn request(prompt: &str, steps: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt: prompt.into(),
        seed: Some(3),
        steps: Some(steps),
        ..Default::default()
    }
}

/// A request that keeps the one denoiser busy for a long while.
fn long() -> pb::GenerateRequest {
    request("a long one", 100)
}

/// Reads until the first denoising step; returns the request id.
async fn until_denoising(stream: &mut tonic::Streaming<pb::GenerateEvent>) -> String {
    let mut id = String::new();
    loop {
        match stream.message().await.unwrap().unwrap().event.unwrap() {
            E::Accepted(a) => id = a.request_id,
            E::Progress(p) if p.phase == pb::Phase::Denoise as i32 => return id,
            _ => {}
        }
    }
}

/// Reads the Accepted event of a queued request.
async fn accepted(stream: &mut tonic::Streaming<pb::GenerateEvent>) -> pb::Accepted {
    match stream.message().await.unwrap().unwrap().event.unwrap() {
        E::Accepted(a) => a,
        other => panic!("first event {other:?}"),
    }
}

/// Reads to the end: every event, and the final status if it failed.
async fn finish(
    stream: &mut tonic::Streaming<pb::GenerateEvent>,
) -> (Vec<E>, Option<tonic::Status>) {
    let mut events = Vec::new();
    loop {
        match stream.message().await {
            Ok(Some(e)) => events.push(e.event.unwrap()),
            Ok(None) => return (events, None),
            Err(s) => return (events, Some(s)),
        }
    }
}

async fn health(client: &mut VideoServiceClient<Channel>) -> (u32, u32) {
    let h = client
        .health(pb::HealthRequest {})
        .await
        .unwrap()
        .into_inner();
    (h.queued, h.running)
}

async fn cancel(client: &mut VideoServiceClient<Channel>, id: &str) -> bool {
    client
        .cancel(pb::CancelRequest {
            request_id: id.to_string(),
        })
        .await
        .unwrap()
        .into_inner()
        .cancelled
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_cancel_ends_its_stream_within_a_second() {
    let (server, mut client) = server().await;
    let mut running = client.generate(long()).await.unwrap().into_inner();
    let running_id = until_denoising(&mut running).await;
    let mut queued = client.generate(long()).await.unwrap().into_inner();
    let a = accepted(&mut queued).await;
    assert_eq!(a.queue_position, 1);
    let t = Instant::now();
    assert!(cancel(&mut client, &a.request_id).await);
    let (_, status) = tokio::time::timeout(Duration::from_secs(1), finish(&mut queued))
        .await
        .expect("the queued stream ends within 1 s of its Cancel");
    assert_eq!(status.expect("a status").code(), Code::Cancelled);
    assert!(t.elapsed() < Duration::from_secs(1));
    assert_eq!(
        health(&mut client).await,
        (0, 1),
        "only the running one is left"
    );
    assert!(cancel(&mut client, &running_id).await);
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnected_queued_clients_leave_the_queue_within_a_second() {
    let (server, mut client) = server().await;
    let mut running = client.generate(long()).await.unwrap().into_inner();
    let running_id = until_denoising(&mut running).await;
    let mut gone = Vec::new();
    for i in 0..3 {
        // Each on its own connection, as three separate clients.
        let mut c = VideoServiceClient::connect(format!("http://{}", server.addr))
            .await
            .unwrap();
        let mut s = c.generate(long()).await.unwrap().into_inner();
        assert_eq!(accepted(&mut s).await.queue_position, i + 1);
        gone.push((c, s));
    }
    assert_eq!(health(&mut client).await, (3, 1));
    drop(gone);
    let t = Instant::now();
    while health(&mut client).await != (0, 1) {
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "the departed clients still hold {:?} (queued, running)",
            health(&mut client).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The next client is told the truth about its place.
    let mut next = client.generate(long()).await.unwrap().into_inner();
    let a = accepted(&mut next).await;
    assert_eq!(a.queue_position, 1);
    assert!(cancel(&mut client, &a.request_id).await);
    assert!(cancel(&mut client, &running_id).await);
    server.stop().await.unwrap();
}

/// A raw HTTP/2 client that sends one Generate call and then never reads: its stream window is
/// 0, so the server cannot send it a single byte of the response body.
async fn never_reading_client(
    addr: std::net::SocketAddr,
    req: pb::GenerateRequest,
) -> (
    h2::client::ResponseFuture,
    h2::client::SendRequest<bytes::Bytes>,
) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (client, connection) = h2::client::Builder::new()
        .initial_window_size(0)
        .handshake(tcp)
        .await
        .unwrap();
    tokio::spawn(connection);
    let mut client = client.ready().await.unwrap();
    let call = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}/ditstream.v1.VideoService/Generate"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (response, mut body) = client.send_request(call, false).unwrap();
    let message = req.encode_to_vec();
    let mut frame = vec![0u8];
    frame.extend((message.len() as u32).to_be_bytes());
    frame.extend(message);
    body.send_data(frame.into(), true).unwrap();
    (response, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_loses_its_request_and_delays_nobody() {
    let (server, mut client) = server().await;
    let one_frame = || pb::GenerateRequest {
        num_frames: Some(1),
        ..request("one frame", 3)
    };
    let t = Instant::now();
    let (events, status) =
        finish(&mut client.generate(one_frame()).await.unwrap().into_inner()).await;
    assert!(status.is_none() && matches!(events.last(), Some(E::Completed(_))));
    let alone = t.elapsed();

    // The stalled client's request runs first and fills its stream (a progress event a step).
    let (_response, _conn) = never_reading_client(server.addr, long()).await;
    let t = Instant::now();
    while health(&mut client).await.1 == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the stalled request never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let t = Instant::now();
    let (events, status) =
        finish(&mut client.generate(one_frame()).await.unwrap().into_inner()).await;
    let behind = t.elapsed();
    println!("1-frame request alone {alone:?}, behind a client that never reads {behind:?}");
    assert!(status.is_none(), "{status:?}");
    assert!(matches!(events.last(), Some(E::Completed(_))));
    assert!(
        behind < alone + Duration::from_secs(4),
        "behind a client that never reads, a 1-frame request took {behind:?} (alone {alone:?})"
    );
    assert_eq!(
        health(&mut client).await,
        (0, 0),
        "the stalled request was dropped"
    );
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absurd_grpc_timeout_is_clamped_not_a_panic() {
    let (server, mut client) = server().await;
    let mut req = tonic::Request::new(request("forever", 3));
    req.metadata_mut()
        .insert("grpc-timeout", "18446744073709551615S".parse().unwrap());
    let (events, status) = finish(&mut client.generate(req).await.unwrap().into_inner()).await;
    assert!(status.is_none(), "{status:?}");
    assert!(matches!(events.last(), Some(E::Completed(_))));
    // The server is still up and serves the next request.
    let (events, status) = finish(
        &mut client
            .generate(request("next", 3))
            .await
            .unwrap()
            .into_inner(),
    )
    .await;
    assert!(status.is_none() && matches!(events.last(), Some(E::Completed(_))));
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_beyond_the_devices_is_refused_at_admission_naming_the_limit() {
    let (server, mut client) = server().await;
    for (req, limit) in [
        (
            pb::GenerateRequest {
                width: Some(1920),
                height: Some(1920),
                num_frames: Some(241),
                ..request("huge", 100)
            },
            "serving.admission.device_memory_gib",
        ),
        (
            pb::GenerateRequest {
                width: Some(1280),
                height: Some(720),
                num_frames: Some(81),
                ..request("slow", 8)
            },
            "serving.admission.max_request_s",
        ),
    ] {
        let t = Instant::now();
        let status = match client.generate(req).await {
            Ok(s) => finish(&mut s.into_inner()).await.1.expect("refused"),
            Err(s) => s,
        };
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
        assert!(status.message().contains(limit), "{}", status.message());
    }
    assert_eq!(health(&mut client).await, (0, 0));
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_come_in_the_documented_order() {
    let (server, mut client) = server().await;
    let (events, status) = finish(
        &mut client
            .generate(request("order", 3))
            .await
            .unwrap()
            .into_inner(),
    )
    .await;
    assert!(status.is_none(), "{status:?}");
    // Accepted, text progress, denoise progress, then (init before any media) decode, Completed.
    let kind = |e: &E| match e {
        E::Accepted(_) => "accepted",
        E::Progress(p) if p.phase == pb::Phase::Text as i32 => "text",
        E::Progress(p) if p.phase == pb::Phase::Denoise as i32 => "denoise",
        E::Progress(_) => "decode",
        E::InitSegment(_) => "init",
        E::MediaSegment(_) => "media",
        E::Completed(_) => "completed",
    };
    let mut kinds: Vec<&str> = events.iter().map(kind).collect();
    kinds.dedup();
    assert_eq!(
        kinds[..4],
        ["accepted", "text", "denoise", "init"],
        "{kinds:?}"
    );
    assert_eq!(kinds.last(), Some(&"completed"));
    let first_media = kinds.iter().position(|k| *k == "media").unwrap();
    assert!(
        kinds[first_media..]
            .iter()
            .all(|k| ["media", "decode", "completed"].contains(k))
    );
    let ids: Vec<String> = events
        .iter()
        .filter_map(|e| match e {
            E::Accepted(a) => Some(a.request_id.clone()),
            _ => None,
        })
        .collect();
    // 128 random bits, hex.
    assert_eq!(ids[0].len(), "req-".len() + 32, "{}", ids[0]);
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_refuses_new_work_drains_then_ends_the_rest_unavailable() {
    let mut cfg = config();
    cfg.serving.shutdown_grace_s = 1;
    let server = start(cfg, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = server.addr;
    let mut client = VideoServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    // 81 frames of 100 steps: several seconds, far past the grace (9 frames took ~0.9 s on a
    // fast machine, and once finished inside it).
    let outlives_the_grace = pb::GenerateRequest {
        num_frames: Some(81),
        ..long()
    };
    let mut running = client
        .generate(outlives_the_grace)
        .await
        .unwrap()
        .into_inner();
    until_denoising(&mut running).await;
    let t = Instant::now();
    let stopping = tokio::spawn(server.stop());
    // While draining, nothing new is admitted.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let refused = match client.generate(request("too late", 3)).await {
        Ok(s) => finish(&mut s.into_inner()).await.1.expect("refused"),
        Err(s) => s,
    };
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(refused.message().contains("shutting down"), "{refused:?}");
    // The running request outlives the 1 s grace, so it is ended, with the reason.
    let (_, status) = finish(&mut running).await;
    let status = status.expect("ended");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("shutting down"), "{status:?}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    stopping.await.unwrap().unwrap();
}
