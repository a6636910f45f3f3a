//! The QUIC latent link on loopback: chunks arrive in order and intact, requests run side by
//! side on one connection, and a peer without a certificate from the pool CA is refused.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test

use ditstream_common::link::LatentChunk;
use ditstream_common::link::quic::{ChunkReceiver, ChunkSender, connect, listen};
use ditstream_common::tls::PoolCa;

/// A request's latent, [1, 16, 5, 30, 52] f32 (480p/2), cut into chunks of `frames` latent frames.
fn chunks(request: &str, frames: u32) -> Vec<LatentChunk> {
    let (c, t, h, w) = (16u64, 5u32, 30u64, 52u64);
    let frame_len = (c * h * w) as usize;
    let mut out = Vec::new();
    let mut first = 0;
    while first < t {
        let n = frames.min(t - first);
        let values: Vec<f32> = (0..frame_len * n as usize)
            .map(|i| ((i as f32) * 0.001 + first as f32 + request.len() as f32).sin())
            .collect();
        let last = first + n == t;
        out.push(
            LatentChunk::from_f32(
                request,
                out.len() as u32,
                first,
                last,
                &[1, c, n as u64, h, w],
                &values,
            )
            .unwrap(),
        );
        first += n;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_cross_intact_and_in_order_with_mutual_tls() {
    let ca = PoolCa::generate("test pools").unwrap();
    let server = listen(
        "127.0.0.1:0".parse().unwrap(),
        &ca.issue("localhost").unwrap(),
    )
    .unwrap();
    let addr = server.local_addr().unwrap();
    let sent_a = chunks("req-a", 1);
    let sent_b = chunks("req-b", 2);
    let (want_a, want_b) = (sent_a.clone(), sent_b.clone());

    let receiver = tokio::spawn(async move {
        let conn = server.accept().await.unwrap().await.unwrap();
        let mut got = Vec::new();
        for _ in 0..2 {
            let mut rx = ChunkReceiver::accept(&conn).await.unwrap().unwrap();
            let mut chunks = Vec::new();
            while let Some(c) = rx.next().await.unwrap() {
                chunks.push(c);
            }
            got.push(chunks);
        }
        got
    });

    let conn = connect(addr, "localhost", &ca.issue("denoiser-0").unwrap())
        .await
        .unwrap();
    // Two requests interleaved on one connection.
    let mut a = ChunkSender::open(&conn).await.unwrap();
    let mut b = ChunkSender::open(&conn).await.unwrap();
    for i in 0..sent_a.len().max(sent_b.len()) {
        if let Some(c) = sent_a.get(i) {
            a.send(c).await.unwrap();
        }
        if let Some(c) = sent_b.get(i) {
            b.send(c).await.unwrap();
        }
    }
    a.finish().unwrap();
    b.finish().unwrap();
    let mut got = receiver.await.unwrap();
    got.sort_by_key(|chunks| chunks[0].header.request_id.clone());
    assert_eq!(got[0], want_a);
    assert_eq!(got[1], want_b);
    assert!(got[0].last().unwrap().header.last && !got[0][0].header.last);
    conn.close(0u32.into(), b"done");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_from_another_ca_is_refused() {
    let ca = PoolCa::generate("pools").unwrap();
    let stranger = PoolCa::generate("someone else").unwrap();
    let server = listen(
        "127.0.0.1:0".parse().unwrap(),
        &ca.issue("localhost").unwrap(),
    )
    .unwrap();
    let addr = server.local_addr().unwrap();
    tokio::spawn(async move {
        while let Some(incoming) = server.accept().await {
            let _ = incoming.await; // the handshake fails on the server side too
        }
    });
    // The client does not trust the server's CA: refused.
    let e = connect(addr, "localhost", &stranger.issue("d").unwrap())
        .await
        .unwrap_err();
    assert!(e.to_string().starts_with("latent link: connect to"), "{e}");
    // A server name the certificate does not carry: refused.
    let e = connect(addr, "decoder.example", &ca.issue("d").unwrap())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("decoder.example"), "{e}");
}

#[test]
fn identities_load_from_pem_files() {
    let ca = PoolCa::generate("pem").unwrap();
    let dir = std::env::temp_dir().join(format!("ditstream-link-pem-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    let e = ditstream_common::tls::Identity::from_pem_files(
        &dir.join("missing.pem"),
        &dir.join("key.pem"),
        &dir.join("ca.pem"),
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("missing.pem"), "{e}");
    // What `ditstream certs` writes loads back and connects.
    let (cert, key) = ca.issue_pem(&["localhost".to_string()]).unwrap();
    std::fs::write(dir.join("pool.pem"), cert).unwrap();
    std::fs::write(dir.join("pool-key.pem"), key).unwrap();
    let identity = ditstream_common::tls::Identity::from_pem_files(
        &dir.join("pool.pem"),
        &dir.join("pool-key.pem"),
        &dir.join("ca.pem"),
    )
    .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let server = listen("127.0.0.1:0".parse().unwrap(), &identity).unwrap();
        let addr = server.local_addr().unwrap();
        let accept = tokio::spawn(async move { server.accept().await.unwrap().await.map(|_| ()) });
        connect(addr, "localhost", &identity).await.unwrap();
        accept.await.unwrap().unwrap();
    });
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_chunk_is_detected_by_the_receiver() {
    let ca = PoolCa::generate("corruption").unwrap();
    let server = listen(
        "127.0.0.1:0".parse().unwrap(),
        &ca.issue("localhost").unwrap(),
    )
    .unwrap();
    let addr = server.local_addr().unwrap();
    let receiver = tokio::spawn(async move {
        let conn = server.accept().await.unwrap().await.unwrap();
        let mut rx = ChunkReceiver::accept(&conn).await.unwrap().unwrap();
        let first = rx.next().await;
        let second = rx.next().await;
        (first.map(|c| c.is_some()), second.map(|c| c.is_some()))
    });
    let conn = connect(addr, "localhost", &ca.issue("d").unwrap())
        .await
        .unwrap();
    let mut tx = ChunkSender::open(&conn).await.unwrap();
    let mut sent = chunks("req-c", 1);
    tx.send(&sent[0]).await.unwrap();
    // A bit flipped after the checksum was taken (as a faulty NIC or buffer would).
    sent[1].payload[17] ^= 0x01;
    tx.send(&sent[1]).await.unwrap();
    tx.finish().unwrap();
    let (first, second) = receiver.await.unwrap();
    assert!(first.unwrap(), "the intact chunk arrives");
    let e = second.unwrap_err().to_string();
    assert!(
        e.starts_with("latent link: chunk 1 of request req-c: checksum"),
        "{e}"
    );
}
