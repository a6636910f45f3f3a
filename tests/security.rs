//! The service's security over real sockets, as an attacker would try it:
//!
//! - the pool registry and the pool services speak only mutual TLS with the pool CA: plaintext,
//!   TLS without a client certificate and a certificate from another CA are refused, and nothing
//!   is ever routed to them; a pool can register only addresses its certificate names, and only
//!   the certificate that registered a pool speaks for it;
//! - with API keys configured, no key or a wrong key is UNAUTHENTICATED, a valid key works over
//!   TLS, one key cannot cancel another's request, and a key's queue share is bounded;
//! - a public address without TLS and keys is refused;
//! - connections that never speak are closed at the handshake deadline, and a thousand of them
//!   do not keep a real client waiting; connections beyond the cap are refused with the reason;
//!   streams beyond the per-connection cap are refused; idle connections are closed;
//! - an operator sees each of these at `/metrics`: connections refused, closed and why, calls
//!   whose request came too slowly.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test

mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ditstream::gateway::{self, Gateway, RunningGateway};
use ditstream_common::config::Config;
use ditstream_common::tls::PoolCa;
use ditstream_proto::v1 as pb;
use ditstream_proto::v1::denoiser_pool_client::DenoiserPoolClient;
use ditstream_proto::v1::generate_event::Event as E;
use ditstream_proto::v1::pool_registry_client::PoolRegistryClient;
use ditstream_proto::v1::video_service_client::VideoServiceClient;
use support::{metric_passes, metric_reaches};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// A scratch folder with a pool CA, the members' certificate (localhost, 127.0.0.1), a second
/// member certificate from the same CA, and a certificate from another CA.
struct Certs {
    dir: PathBuf,
    ca: String,
}

impl Certs {
    fn new(name: &str) -> Certs {
        let dir = std::env::temp_dir().join(format!("ditstream-sec-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let hosts = ["localhost".to_string(), "127.0.0.1".to_string()];
        let ca = PoolCa::generate("test pools").unwrap();
        let stranger = PoolCa::generate("someone else").unwrap();
        std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
        for (name, issuer) in [("pool", &ca), ("other", &ca), ("stranger", &stranger)] {
            let (cert, key) = issuer.issue_pem(&hosts).unwrap();
            std::fs::write(dir.join(format!("{name}.pem")), cert).unwrap();
            std::fs::write(dir.join(format!("{name}-key.pem")), key).unwrap();
        }
        Certs { ca: ca.pem(), dir }
    }

    fn read(&self, file: &str) -> String {
        std::fs::read_to_string(self.dir.join(file)).unwrap()
    }

    /// Client TLS trusting the pool CA, presenting `member`'s certificate (or none).
    fn client_tls(&self, member: Option<&str>) -> ClientTlsConfig {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca))
            .domain_name("localhost");
        match member {
            Some(m) => tls.identity(Identity::from_pem(
                self.read(&format!("{m}.pem")),
                self.read(&format!("{m}-key.pem")),
            )),
            None => tls,
        }
    }

    /// A channel to `addr` over TLS as `member` (or plaintext when `tls` is false).
    async fn channel(&self, addr: &str, tls: Option<Option<&str>>) -> Result<Channel, String> {
        let endpoint = match tls {
            Some(member) => Endpoint::from_shared(format!("https://{addr}"))
                .unwrap()
                .tls_config(self.client_tls(member))
                .unwrap(),
            None => Endpoint::from_shared(format!("http://{addr}")).unwrap(),
        };
        endpoint
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await
            .map_err(|e| format!("{e:?}"))
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The tiny model at 64×48, 9 frames, 3 steps, plus `extra` YAML (top-level sections).
fn config(certs: &Path, serving: &str, extra: &str) -> Config {
    let c = certs.display();
    let yaml = format!(
        "model:\n  preset: tiny\nsampler:\n  steps: 3\nserving:\n  width: 64\n  height: 48\n  \
         num_frames: 9\n  fps: 12\n  queue_depth: 8\n{serving}pools:\n  tls_ca: {c}/ca.pem\n  \
         tls_cert: {c}/pool.pem\n  tls_key: {c}/pool-key.pem\n  denoiser_listen: 127.0.0.1:0\n{extra}"
    );
    let cfg = Config::parse(&yaml, "<test>").unwrap();
    cfg.validate(Some(1)).unwrap();
    cfg
}

async fn registry_gateway(certs: &Certs) -> RunningGateway {
    let cfg = config(&certs.dir, "", "");
    let any = "127.0.0.1:0".parse().unwrap();
    gateway::start(&cfg, any, Some(any)).await.unwrap()
}

fn registration(address: &str) -> pb::RegisterRequest {
    pb::RegisterRequest {
        role: pb::PoolRole::Denoiser as i32,
        address: address.to_string(),
        model: "tiny".to_string(),
        ..Default::default()
    }
}

async fn register(
    certs: &Certs,
    registry: &str,
    tls: Option<Option<&str>>,
    address: &str,
) -> Result<String, String> {
    let channel = certs.channel(registry, tls).await?;
    PoolRegistryClient::new(channel)
        .register(registration(address))
        .await
        .map(|r| r.into_inner().pool_id)
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
}

async fn registered(gw: &RunningGateway) -> String {
    let mut client = VideoServiceClient::connect(format!("http://{}", gw.addr))
        .await
        .unwrap();
    let models = client.list_models(pb::ListModelsRequest {}).await.unwrap();
    models.into_inner().models[0].description.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_needs_a_pool_ca_certificate_naming_its_address() {
    let certs = Certs::new("register");
    let gw = registry_gateway(&certs).await;
    let registry = gw.registry_addr.unwrap().to_string();
    // Plaintext, TLS without a client certificate, a certificate from another CA: refused.
    let failed = closed_by("pools.registry_listen", "handshake_failed");
    for (what, tls) in [
        ("plaintext", None),
        ("TLS without a client certificate", Some(None)),
        ("a certificate from another CA", Some(Some("stranger"))),
    ] {
        let before = support::sample(&support::scrape(gw.addr).await, &failed);
        let r = register(&certs, &registry, tls, "127.0.0.1:1").await;
        assert!(r.is_err(), "{what} registered: {r:?}");
        // Its TLS handshake failed, which the operator sees (tonic's client, its first
        // connection reset, may try a second: 3 attempts counted 3 to 5 failures).
        metric_passes(gw.addr, &failed, before).await;
    }
    // The public port has no registry at all.
    let r = register(&certs, &gw.addr.to_string(), None, "127.0.0.1:1").await;
    assert!(r.unwrap_err().starts_with("Unimplemented"));
    // A valid certificate, but an address it does not name.
    let e = register(&certs, &registry, Some(Some("pool")), "10.1.2.3:7000").await;
    let e = e.unwrap_err();
    assert!(
        e.starts_with("PermissionDenied") && e.contains("\"10.1.2.3\""),
        "{e}"
    );
    // None of them is known, so nothing can be routed to them.
    assert_eq!(
        registered(&gw).await,
        "0 denoiser pool(s), 0 decoder instance(s) registered"
    );
    // A pool-CA certificate naming its address registers.
    register(&certs, &registry, Some(Some("pool")), "127.0.0.1:1")
        .await
        .unwrap();
    assert_eq!(
        registered(&gw).await,
        "1 denoiser pool(s), 0 decoder instance(s) registered"
    );
    gw.stop(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_registering_certificate_speaks_for_a_pool() {
    let certs = Certs::new("owner");
    let gw = registry_gateway(&certs).await;
    let registry = gw.registry_addr.unwrap().to_string();
    let id = register(&certs, &registry, Some(Some("pool")), "127.0.0.1:1")
        .await
        .unwrap();
    let mut other =
        PoolRegistryClient::new(certs.channel(&registry, Some(Some("other"))).await.unwrap());
    let beat = pb::HeartbeatRequest {
        pool_id: id.clone(),
        active: 0,
    };
    let e = other.heartbeat(beat.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let e = other
        .deregister(pb::DeregisterRequest {
            pool_id: id.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let mut owner =
        PoolRegistryClient::new(certs.channel(&registry, Some(Some("pool"))).await.unwrap());
    assert!(owner.heartbeat(beat).await.unwrap().into_inner().known);
    gw.stop(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_service_refuses_callers_without_a_certificate() {
    let certs = Certs::new("poolsvc");
    // A real denoiser pool (it keeps trying to register with a gateway that is not there).
    let mut cfg = config(&certs.dir, "", "");
    cfg.pools.gateway = "127.0.0.1:1".to_string();
    let pool = ditstream_denoiser::service::start(&cfg).await.unwrap();
    let addr = pool.addr.to_string();
    let call = |channel: Channel| async move {
        DenoiserPoolClient::new(channel)
            .denoise(pb::DenoiseRequest::default())
            .await
            .map(|_| ())
    };
    for (what, tls) in [
        ("plaintext", None),
        ("TLS without a client certificate", Some(None)),
        ("a certificate from another CA", Some(Some("stranger"))),
    ] {
        // Refused in the handshake: the connection or the call fails in transport, never
        // reaching the service (which would judge the empty request INVALID_ARGUMENT).
        if let Ok(channel) = certs.channel(&addr, tls).await {
            let e = call(channel).await.unwrap_err();
            assert!(
                e.code() != Code::InvalidArgument && std::error::Error::source(&e).is_some(),
                "{what}: {e:?}"
            );
        }
    }
    // With a pool-CA certificate the call reaches the service, which judges the request.
    let e = call(certs.channel(&addr, Some(Some("pool"))).await.unwrap())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    pool.stop().await;
}

fn authed<T>(message: T, key: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {key}").parse().unwrap());
    r
}

fn request(steps: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt: "a guarded fox".into(),
        seed: Some(1),
        steps: Some(steps),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_over_tls_own_their_requests() {
    let certs = Certs::new("keys");
    let keys = certs.dir.join("keys.txt");
    let alice = gateway::keys::add(&keys, "alice").unwrap();
    let bob = gateway::keys::add(&keys, "bob").unwrap();
    let c = certs.dir.display();
    let serving = format!(
        "  api_keys: {}\n  tls: {{cert: {c}/pool.pem, key: {c}/pool-key.pem}}\n  per_key: {{max_queued: 1}}\n",
        keys.display()
    );
    let server = ditstream::serve::start(
        config(&certs.dir, &serving, ""),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let addr = server.addr.to_string();
    // Plaintext to a TLS listener gets nowhere.
    if let Ok(channel) = certs.channel(&addr, None).await {
        let e = VideoServiceClient::new(channel)
            .list_models(authed(pb::ListModelsRequest {}, &alice))
            .await
            .unwrap_err();
        assert_ne!(e.code(), Code::Ok);
    }
    let mut client = VideoServiceClient::new(certs.channel(&addr, Some(None)).await.unwrap())
        .max_decoding_message_size(64 << 20);
    // Health answers without a key (for probes); everything else needs one.
    assert!(
        client
            .health(pb::HealthRequest {})
            .await
            .unwrap()
            .into_inner()
            .serving
    );
    let e = client.generate(request(2)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    let e = client
        .generate(authed(request(2), "ds-0000"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    let e = client
        .list_models(pb::ListModelsRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");

    // A valid key works, end to end.
    let mut stream = client
        .generate(authed(request(2), &alice))
        .await
        .unwrap()
        .into_inner();
    let mut last = None;
    let mut ids = Vec::new();
    while let Some(event) = stream.message().await.unwrap() {
        if let Some(E::Accepted(a)) = &event.event {
            ids.push(a.request_id.clone());
        }
        last = event.event;
    }
    assert!(matches!(last, Some(E::Completed(_))), "{last:?}");

    // Bob's long request: Alice can neither cancel it nor tell it from a missing one.
    let mut bobs = client
        .generate(authed(request(100), &bob))
        .await
        .unwrap()
        .into_inner();
    let Some(E::Accepted(a)) = bobs.message().await.unwrap().unwrap().event else {
        panic!("no Accepted")
    };
    ids.push(a.request_id.clone());
    let cancel = |id: &str, key: &str| {
        authed(
            pb::CancelRequest {
                request_id: id.to_string(),
            },
            key,
        )
    };
    let foreign = client
        .cancel(cancel(&a.request_id, &alice))
        .await
        .unwrap_err();
    let missing = client
        .cancel(cancel("req-00000000000000000000000000000000", &alice))
        .await
        .unwrap_err();
    assert_eq!(foreign.code(), Code::NotFound);
    assert_eq!(missing.code(), Code::NotFound);
    // Bob's share of the queue is one request: his second waits, his third is refused.
    let mut second = client
        .generate(authed(request(2), &bob))
        .await
        .unwrap()
        .into_inner();
    let Some(E::Accepted(queued)) = second.message().await.unwrap().unwrap().event else {
        panic!("no Accepted")
    };
    ids.push(queued.request_id.clone());
    let refused = client.generate(authed(request(2), &bob)).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(
        refused.message().contains("serving.per_key.max_queued = 1")
            && refused.message().contains("\"bob\""),
        "{refused:?}"
    );
    // Bob cancels his own.
    for id in [&a.request_id, &queued.request_id] {
        assert!(
            client
                .cancel(cancel(id, &bob))
                .await
                .unwrap()
                .into_inner()
                .cancelled
        );
    }
    // Request ids are 128 random bits.
    for id in &ids {
        let hex = id.strip_prefix("req-").unwrap();
        assert!(
            hex.len() == 32 && hex.chars().all(|c| c.is_ascii_hexdigit()),
            "{id}"
        );
    }
    let mut unique = ids.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), ids.len());

    // The CLI client speaks TLS and keys too: with Alice's key it writes the video, without
    // one it says why it was refused.
    let cli = |key: Option<String>| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_ditstream"));
        c.args([
            "generate",
            "--server",
            &format!("https://{addr}"),
            "--tls-ca",
        ])
        .arg(certs.dir.join("ca.pem"))
        .args(["--prompt", "from the cli", "--steps", "2", "--output"])
        .arg(certs.dir.join("cli.mp4"))
        .env_remove("DITSTREAM_API_KEY");
        if let Some(k) = key {
            c.env("DITSTREAM_API_KEY", k);
        }
        c
    };
    let (mut with, mut without) = (cli(Some(alice.clone())), cli(None));
    let ok = tokio::task::spawn_blocking(move || with.output().unwrap())
        .await
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(std::fs::metadata(certs.dir.join("cli.mp4")).unwrap().len() > 0);
    let refused = tokio::task::spawn_blocking(move || without.output().unwrap())
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains("API key"),
        "{stderr}"
    );
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_public_address_needs_tls_and_keys() {
    let certs = Certs::new("public");
    let e = ditstream::serve::start(config(&certs.dir, "", ""), "0.0.0.0:0".parse().unwrap())
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("serving.listen = 0.0.0.0:0") && e.contains("serving.tls and serving.api_keys"),
        "{e}"
    );
}

/// The `/metrics` sample counting `listener`'s connections the server closed for `reason`.
fn closed_by(listener: &str, reason: &str) -> String {
    format!(r#"ditstream_connections_closed_total{{listener="{listener}",reason="{reason}"}}"#)
}

/// A gateway with no pools (nothing to build) and these connection limits.
async fn bare_gateway(connections: &str) -> RunningGateway {
    let certs = std::env::temp_dir();
    let cfg = config(&certs, "", &format!("connections:\n{connections}"));
    gateway::serve(
        Gateway::new(&cfg, None).unwrap(),
        "127.0.0.1:0".parse().unwrap(),
        None,
    )
    .await
    .unwrap()
}

/// Reads until EOF or an error; how long that took.
async fn until_closed(stream: &mut TcpStream, within: Duration) -> Option<Duration> {
    let start = Instant::now();
    let mut buf = [0u8; 256];
    tokio::time::timeout(within, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return start.elapsed(),
                Ok(_) => {}
            }
        }
    })
    .await
    .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_are_closed_and_do_not_block_clients() {
    let gw = bare_gateway("  handshake_timeout_s: 2\n").await;
    let mut silent = Vec::new();
    for _ in 0..1000 {
        silent.push(TcpStream::connect(gw.addr).await.unwrap());
    }
    // A real client is served while the thousand sit there.
    let asked = Instant::now();
    let mut client = VideoServiceClient::connect(format!("http://{}", gw.addr))
        .await
        .unwrap();
    client.health(pb::HealthRequest {}).await.unwrap();
    assert!(
        asked.elapsed() < Duration::from_secs(2),
        "{:?}",
        asked.elapsed()
    );
    // Each silent one is closed at the handshake deadline.
    for s in silent.iter_mut().step_by(100) {
        let closed = until_closed(s, Duration::from_secs(10)).await;
        assert!(closed.is_some(), "a silent connection stayed open");
    }
    let closed = closed_by("serving.listen", "handshake_timeout");
    metric_reaches(gw.addr, &closed, 1000.0).await;
    gw.stop(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_are_refused_with_the_reason() {
    let gw = bare_gateway("  max_connections: 4\n").await;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(TcpStream::connect(gw.addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut fifth = TcpStream::connect(gw.addr).await.unwrap();
    fifth
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), fifth.read_to_end(&mut got)).await;
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.contains("connection limit reached (connections.max_connections = 4)"),
        "{got:?}"
    );
    // GOAWAY (type 7) with ENHANCE_YOUR_CALM (0xb).
    assert_eq!(got[9 + 3], 7);
    assert_eq!(&got[9 + 13..9 + 17], &[0, 0, 0, 0xb]);
    // Once one leaves, a client is served again.
    drop(held.pop());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut client = VideoServiceClient::connect(format!("http://{}", gw.addr))
        .await
        .unwrap();
    client.health(pb::HealthRequest {}).await.unwrap();
    // With the others gone, a scraper finds the one refusal (and its own, if it came while the
    // server was still closing them) and only itself open.
    drop((client, held));
    let refused = r#"ditstream_connections_refused_total{listener="serving.listen"}"#;
    let mut own = 0.0;
    let text = loop {
        let text = support::scrape(gw.addr).await;
        if !text.contains("connection limit reached") {
            break text;
        }
        own += 1.0;
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(support::sample(&text, refused), 1.0 + own, "{text}");
    metric_reaches(
        gw.addr,
        r#"ditstream_connections{listener="serving.listen"}"#,
        1.0,
    )
    .await;
    gw.stop(Duration::from_secs(1)).await;
}

/// One HTTP/2 frame: 9-byte header and payload.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len();
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// Reads one frame: (type, flags, stream, payload).
async fn read_frame(s: &mut TcpStream) -> (u8, u8, u32, Vec<u8>) {
    let mut head = [0u8; 9];
    s.read_exact(&mut head).await.unwrap();
    let len = (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload).await.unwrap();
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    (head[3], head[4], stream, payload)
}

/// A gRPC request's headers, HPACK-encoded without Huffman or the dynamic table.
fn health_headers() -> Vec<u8> {
    let mut h = vec![0x83, 0x86]; // :method POST, :scheme http (static table)
    let literal = |h: &mut Vec<u8>, name_index: &[u8], value: &str| {
        h.extend_from_slice(name_index);
        h.push(value.len() as u8);
        h.extend_from_slice(value.as_bytes());
    };
    literal(&mut h, &[0x04], "/ditstream.v1.VideoService/Health"); // :path
    literal(&mut h, &[0x01], "localhost"); // :authority
    literal(&mut h, &[0x0f, 0x10], "application/grpc"); // content-type (index 31)
    h.extend_from_slice(&[0x00, 2]);
    h.extend_from_slice(b"te");
    h.push(8);
    h.extend_from_slice(b"trailers");
    h
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_beyond_the_per_connection_cap_are_refused() {
    let gw = bare_gateway("  max_streams: 2\n").await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend(frame(4, 0, 0, &[]));
    s.write_all(&hello).await.unwrap();
    // The server's SETTINGS advertise the cap (MAX_CONCURRENT_STREAMS = 2).
    let settings = loop {
        let (kind, flags, _, payload) = read_frame(&mut s).await;
        if kind == 4 && flags & 1 == 0 {
            break payload;
        }
    };
    let advertised = settings
        .chunks(6)
        .find(|p| p[..2] == [0, 3])
        .map(|p| u32::from_be_bytes([p[2], p[3], p[4], p[5]]));
    assert_eq!(advertised, Some(2));
    // Three open streams (headers, no body yet): the third is refused.
    let mut streams = frame(4, 1, 0, &[]); // SETTINGS ACK
    for id in [1, 3, 5] {
        streams.extend(frame(1, 0x4, id, &health_headers())); // HEADERS, END_HEADERS
    }
    s.write_all(&streams).await.unwrap();
    let refused = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let (kind, _, stream, payload) = read_frame(&mut s).await;
            if kind == 3 {
                return (
                    stream,
                    u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]),
                );
            }
        }
    })
    .await
    .expect("no RST_STREAM");
    assert_eq!(refused, (5, 0x7), "RST_STREAM(stream, REFUSED_STREAM)");
    gw.stop(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed() {
    let gw = bare_gateway("  idle_timeout_s: 1\n").await;
    let tcp = TcpStream::connect(gw.addr).await.unwrap();
    let (mut h2, connection) = h2::client::handshake(tcp).await.unwrap();
    let connection = tokio::spawn(connection);
    // One call, then nothing: the server closes the connection about a second later.
    let request = http::Request::post(format!(
        "http://{}/ditstream.v1.VideoService/Health",
        gw.addr
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(())
    .unwrap();
    h2 = h2.ready().await.unwrap();
    let (response, mut body) = h2.send_request(request, false).unwrap();
    body.send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 0]), true)
        .unwrap();
    let response = response.await.unwrap();
    let mut body = response.into_body();
    while body.data().await.is_some() {}
    let _ = body.trailers().await;
    let done = Instant::now();
    let ended = tokio::time::timeout(Duration::from_secs(10), connection).await;
    assert!(ended.is_ok(), "the idle connection stayed open");
    let after = done.elapsed();
    assert!(
        after >= Duration::from_millis(500),
        "closed too early: {after:?}"
    );
    let idle = closed_by("serving.listen", "idle_timeout");
    metric_reaches(gw.addr, &idle, 1.0).await;
    gw.stop(Duration::from_secs(1)).await;
}

/// A client that sends its request a byte at a time gets DEADLINE_EXCEEDED at the request
/// timeout, and its connection, with no call left in flight, is closed at the idle timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_trickled_a_byte_at_a_time_are_ended() {
    let gw = bare_gateway("  request_timeout_s: 1\n  idle_timeout_s: 2\n").await;
    let tcp = TcpStream::connect(gw.addr).await.unwrap();
    let (h2, connection) = h2::client::handshake(tcp).await.unwrap();
    let connection = tokio::spawn(connection);
    let request = http::Request::post(format!(
        "http://{}/ditstream.v1.VideoService/Generate",
        gw.addr
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(())
    .unwrap();
    let mut h2 = h2.ready().await.unwrap();
    let (response, mut body) = h2.send_request(request, false).unwrap();
    let started = Instant::now();
    // A 100-byte message announced, then one byte every 100 ms: 10 s if the server waited.
    body.send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 100]), false)
        .unwrap();
    let trickle = tokio::spawn(async move {
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if body
                .send_data(bytes::Bytes::from_static(b"a"), false)
                .is_err()
            {
                return;
            }
        }
    });
    let response = tokio::time::timeout(Duration::from_secs(5), response)
        .await
        .expect("no answer to the trickled request")
        .unwrap();
    let answered = started.elapsed();
    let (parts, mut rest) = response.into_parts();
    let trailers = match parts.headers.get("grpc-status") {
        Some(_) => parts.headers,
        None => {
            while rest.data().await.is_some() {}
            rest.trailers().await.unwrap().unwrap_or_default()
        }
    };
    assert_eq!(
        trailers.get("grpc-status").map(|v| v.as_bytes()),
        Some(&b"4"[..]),
        "{trailers:?}"
    );
    let message = trailers
        .get("grpc-message")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    assert!(
        message.contains("connections.request_timeout_s"),
        "{message}"
    );
    assert!(
        answered >= Duration::from_millis(900) && answered < Duration::from_secs(4),
        "answered after {answered:?}"
    );
    trickle.abort();
    let ended = tokio::time::timeout(Duration::from_secs(10), connection).await;
    assert!(
        ended.is_ok(),
        "the connection stayed open after its call ended"
    );
    drop(h2);
    let missed = r#"ditstream_request_timeouts_total{listener="serving.listen"}"#;
    metric_reaches(gw.addr, missed, 1.0).await;
    let idle = closed_by("serving.listen", "idle_timeout");
    metric_reaches(gw.addr, &idle, 1.0).await;
    gw.stop(Duration::from_secs(1)).await;
}

/// A `grpc.health.v1.Health/Watch` call (a stream that waits for changes) on a new HTTP/2
/// connection whose receive window is `window`: the connection's task and the response.
async fn watch_health(
    addr: std::net::SocketAddr,
    window: u32,
) -> (
    tokio::task::JoinHandle<Result<(), h2::Error>>,
    h2::client::SendRequest<bytes::Bytes>,
    http::Response<h2::RecvStream>,
) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (h2, connection) = h2::client::Builder::new()
        .initial_window_size(window)
        .handshake(tcp)
        .await
        .unwrap();
    let connection = tokio::spawn(connection);
    let request = http::Request::post(format!("http://{addr}/grpc.health.v1.Health/Watch"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let mut h2 = h2.ready().await.unwrap();
    let (response, mut body) = h2.send_request(request, false).unwrap();
    body.send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 0]), true)
        .unwrap();
    (connection, h2, response.await.unwrap())
}

/// A client that takes nothing of a response (HTTP/2 window 0) loses its connection at the send
/// timeout; one that reads keeps it however long the response waits for its own next event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_never_read_lose_their_connection_waiting_ones_do_not() {
    let cfg = config(
        &std::env::temp_dir(),
        "  client_send_timeout_s: 0.5\n",
        "connections:\n  send_timeout_s: 1\n",
    );
    let any = "127.0.0.1:0".parse().unwrap();
    let gw = gateway::serve(Gateway::new(&cfg, None).unwrap(), any, None)
        .await
        .unwrap();
    let started = Instant::now();
    let (stalled, _h2, _response) = watch_health(gw.addr, 0).await;
    let stalled = tokio::spawn(async move {
        let _ = stalled.await;
        started.elapsed()
    });
    let (reading, _h2_reading, response) = watch_health(gw.addr, 65_535).await;
    let mut body = response.into_body();
    let first = body.data().await.unwrap().unwrap();
    body.flow_control().release_capacity(first.len()).unwrap();
    // The health status does not change: the reading client's stream waits, open.
    let next = tokio::time::timeout(Duration::from_secs(4), body.data()).await;
    assert!(next.is_err(), "the waiting stream ended: {next:?}");
    assert!(
        !reading.is_finished(),
        "a reading client's connection was closed"
    );
    // Looked at every second, closed at the first look a second after its response was handed.
    let closed = tokio::time::timeout(Duration::from_secs(6), stalled).await;
    let after = closed
        .expect("a client that never reads kept its connection")
        .unwrap();
    assert!(
        after >= Duration::from_millis(900) && after < Duration::from_secs(3),
        "closed after {after:?}"
    );
    let unread = closed_by("serving.listen", "send_timeout");
    metric_reaches(gw.addr, &unread, 1.0).await;
    gw.stop(Duration::from_secs(1)).await;
}

/// `ditstream serve` as an operator runs it, with a keys file named relative to its config: a
/// key added while it runs works after SIGHUP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_api_keys() {
    use std::io::BufRead;
    let certs = Certs::new("sighup");
    let file = certs.dir.join("keys.txt");
    let alice = gateway::keys::add(&file, "alice").unwrap();
    let config = certs.dir.join("serve.yaml");
    std::fs::write(
        &config,
        "model: {preset: tiny}\nserving: {width: 64, height: 48, num_frames: 9, api_keys: keys.txt}\n",
    )
    .unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ditstream"))
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&config)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("serve exited").unwrap();
        if let Some(rest) = line.strip_prefix("ditstream serving on ") {
            break rest.split_whitespace().next().unwrap().to_string();
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    let mut client = VideoServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let list = |key: &str| authed(pb::ListModelsRequest {}, key);
    client.list_models(list(&alice)).await.unwrap();
    let bob = gateway::keys::add(&file, "bob").unwrap();
    let e = client.list_models(list(&bob)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let hup = std::process::Command::new("kill")
        .args(["-HUP", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(hup.success());
    let start = Instant::now();
    while client.list_models(list(&bob)).await.is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "bob's key never loaded"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    client.list_models(list(&alice)).await.unwrap();
    let _ = child.kill();
    let _ = child.wait();
}
