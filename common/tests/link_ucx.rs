//! The UCX latent link on loopback (TCP and shared memory, no RDMA needed): multi-MiB chunks of
//! two interleaved requests arrive in order and intact, a corrupted or cut chunk is an error, a
//! dropped request or a closed connection ends the receiver's side cleanly, and connecting to a
//! port nobody listens on fails in bounded time.

#![cfg(feature = "ucx")]
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ditstream_common::link::ucx::{
    ChunkReceiver, ChunkSender, Connection, Listener, MemoryType, SendBuffer, UcxConfig, connect,
    listen,
};
use ditstream_common::link::{LatentChunk, LinkError};

/// The tests take turns: the idle test measures this process's CPU time, which the others'
/// transfers would inflate.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn config() -> UcxConfig {
    UcxConfig {
        connect_timeout: Duration::from_secs(5),
        ..UcxConfig::default()
    }
}

/// A request's chunks: `frames[i]` latent frames of [1, 16, t, 128, 128] f32 each (1 MiB per
/// frame), values depending on the request and position so a swap or a mix-up shows.
fn chunks(request: &str, frames: &[u64]) -> Vec<LatentChunk> {
    let mut first = 0;
    let salt = request.bytes().map(u32::from).sum::<u32>();
    frames
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            let n = (16 * t * 128 * 128) as usize;
            let values: Vec<f32> = (0..n)
                .map(|k| (k as u32 ^ salt).wrapping_mul(2_654_435_761) as f32 * 1e-9 + i as f32)
                .collect();
            let chunk = LatentChunk::from_f32(
                request,
                i as u32,
                first,
                i + 1 == frames.len(),
                &[1, 16, t, 128, 128],
                &values,
            )
            .unwrap();
            first += t as u32;
            chunk
        })
        .collect()
}

async fn pair() -> (Listener, Connection, Connection) {
    let listener = listen("127.0.0.1:0".parse().unwrap(), &config()).unwrap();
    let addr = listener.local_addr();
    assert_ne!(addr.port(), 0, "the listener reports the port it got");
    let config = config();
    let (client, server) = tokio::join!(connect(addr, &config), listener.accept());
    (listener, client.unwrap(), server.unwrap())
}

async fn receive_all(rx: &mut ChunkReceiver) -> Vec<LatentChunk> {
    let mut got = Vec::new();
    while let Some(c) = rx.next().await.unwrap() {
        got.push(c);
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_mib_chunks_of_two_interleaved_requests_arrive_in_order_and_intact() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let (_listener, client, server) = pair().await;
    // 1 frame = 1 MiB; chunks of 1–8 MiB, and one tiny chunk that UCX sends eagerly.
    let sent_a = chunks("req-a", &[1, 4, 8, 2]);
    let mut sent_b = chunks("req-b", &[3, 3, 6]);
    sent_b
        .push(LatentChunk::from_f32("req-b", 3, 12, true, &[1, 16, 1, 2, 2], &[0.5; 64]).unwrap());
    sent_b[2].header.last = false; // the checksum covers the payload only
    let (want_a, want_b) = (sent_a.clone(), sent_b.clone());

    let receiver = tokio::spawn(async move {
        let mut got = Vec::new();
        for _ in 0..2 {
            let mut rx = ChunkReceiver::accept(&server).await.unwrap().unwrap();
            got.push(tokio::spawn(async move { receive_all(&mut rx).await }));
        }
        let mut out = Vec::new();
        for g in got {
            out.push(g.await.unwrap());
        }
        // The client closes after sending: the server sees a clean end of connection.
        assert!(ChunkReceiver::accept(&server).await.unwrap().is_none());
        out
    });

    let mut a = ChunkSender::open(&client);
    let mut b = ChunkSender::open(&client);
    let (mut ia, mut ib) = (sent_a.into_iter(), sent_b.into_iter());
    loop {
        let (ca, cb) = (ia.next(), ib.next());
        if ca.is_none() && cb.is_none() {
            break;
        }
        if let Some(c) = ca {
            a.send(c).await.unwrap();
        }
        if let Some(c) = cb {
            b.send(c).await.unwrap();
        }
    }
    a.finish().await.unwrap();
    b.finish().await.unwrap();
    client.close().await.unwrap();

    let mut got = tokio::time::timeout(Duration::from_secs(60), receiver)
        .await
        .expect("the receiver finished")
        .unwrap();
    got.sort_by_key(|chunks| chunks[0].header.request_id.clone());
    assert_eq!(got[0].len(), want_a.len());
    assert_eq!(got[1].len(), want_b.len());
    assert!(
        got[0] == want_a,
        "request a arrived changed or out of order"
    );
    assert!(
        got[1] == want_b,
        "request b arrived changed or out of order"
    );
    assert!(got[0].last().unwrap().header.last && !got[0][0].header.last);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_or_cut_chunks_are_errors_and_a_dropped_request_ends_in_an_error() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let (_listener, client, server) = pair().await;
    let mut good = chunks("req-c", &[2, 1, 1, 1]);
    // A flipped bit in a rendezvous-sized payload, and a payload cut short of its shape.
    let last_byte = good[1].payload.len() - 1;
    good[1].payload[last_byte] ^= 0x40;
    good[2].payload.truncate(1000);
    let small = LatentChunk::from_f32("req-c", 4, 5, true, &[1, 16, 1, 1, 1], &[1.0; 16]);
    let mut small = small.unwrap();
    small.payload[0] ^= 1;
    good.push(small);

    let mut tx = ChunkSender::open(&client);
    for c in good.clone() {
        tx.send(c).await.unwrap();
    }
    tx.finish().await.unwrap();

    let mut rx = ChunkReceiver::accept(&server).await.unwrap().unwrap();
    assert_eq!(rx.next().await.unwrap().unwrap(), good[0]);
    let e = rx.next().await.unwrap_err();
    assert!(
        matches!(e, LinkError::Checksum { chunk_index: 1, ref request_id, .. } if request_id == "req-c"),
        "{e}"
    );
    let e = rx.next().await.unwrap_err().to_string();
    assert!(e.contains("1000 payload bytes for shape"), "{e}");
    assert_eq!(rx.next().await.unwrap().unwrap(), good[3]);
    let e = rx.next().await.unwrap_err();
    assert!(
        matches!(e, LinkError::Checksum { chunk_index: 4, .. }),
        "{e}"
    );
    assert!(rx.next().await.unwrap().is_none());

    // A request dropped after one chunk (a cancelled request): the receiver gets the chunk, then
    // an error, never a clean end.
    let mut tx = ChunkSender::open(&client);
    tx.send(chunks("req-d", &[1]).remove(0)).await.unwrap();
    drop(tx);
    let mut rx = ChunkReceiver::accept(&server).await.unwrap().unwrap();
    assert!(rx.next().await.unwrap().is_some());
    let e = rx.next().await.unwrap_err().to_string();
    assert!(e.contains("abandoned request stream"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connecting_to_a_port_nobody_listens_on_fails_in_bounded_time() {
    let _turn = ONE_AT_A_TIME.lock().await;
    // Bind and drop a socket: a port that was free a moment ago and has no listener now.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let started = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(20), connect(addr, &config()))
        .await
        .expect("connect neither failed nor timed out by itself: it hangs");
    let e = result.err().expect("connected to a port nobody listens on");
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "took {:?}",
        started.elapsed()
    );
    let text = e.to_string();
    eprintln!("refused: {text} after {:?}", started.elapsed());
    assert!(text.contains(&addr.to_string()), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_type_reaches_ucx_and_cuda_needs_a_cuda_build() {
    let _turn = ONE_AT_A_TIME.lock().await;
    struct FakeDevice(Vec<u8>);
    // SAFETY: the bytes live as long as the value; they are host bytes labelled CUDA, which is
    // only sent when this UCX cannot move CUDA memory (and refuses before touching them).
    unsafe impl SendBuffer for FakeDevice {
        fn as_ptr(&self) -> *const u8 {
            self.0.as_ptr()
        }
        fn len(&self) -> usize {
            self.0.len()
        }
        fn memory_type(&self) -> MemoryType {
            MemoryType::Cuda
        }
    }
    let (_listener, client, _server) = pair().await;
    assert!(client.supports(MemoryType::Host));
    if client.supports(MemoryType::Cuda) {
        return; // a CUDA-enabled UCX: the GPU tests cover it
    }
    let c = chunks("req-e", &[1]).remove(0);
    let mut tx = ChunkSender::open(&client);
    let e = tx
        .send_buffer(&c.header, Box::new(FakeDevice(c.payload)))
        .await
        .unwrap_err();
    assert!(matches!(e, LinkError::Unsupported(_)), "{e}");
    assert!(e.to_string().contains("Cuda memory"), "{e}");
}

/// Loopback throughput with 16 MiB chunks (`cargo test --release -- --ignored --nocapture`):
/// checksums included on both ends, as in service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement; run in release"]
async fn throughput_16_mib_chunks() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let (_listener, client, server) = pair().await;
    let count = 32;
    let chunk = chunks("bench", &[16]).remove(0);
    assert_eq!(chunk.payload.len(), 16 << 20);
    let bytes = chunk.payload.len() * count;
    let all: Vec<LatentChunk> = (0..count)
        .map(|i| {
            let mut c = chunk.clone();
            c.header.chunk_index = i as u32;
            c
        })
        .collect();
    let receiver = tokio::spawn(async move {
        let mut rx = ChunkReceiver::accept(&server).await.unwrap().unwrap();
        let mut n = 0;
        while rx.next().await.unwrap().is_some() {
            n += 1;
        }
        n
    });
    let started = Instant::now();
    let mut tx = ChunkSender::open(&client);
    for c in all {
        tx.send(c).await.unwrap();
    }
    tx.finish().await.unwrap();
    assert_eq!(receiver.await.unwrap(), count);
    let secs = started.elapsed().as_secs_f64();
    println!(
        "UCX loopback ({:?}): {count} x 16 MiB in {:.3} s = {:.2} GB/s, {:.2} ms per chunk",
        config().transports,
        secs,
        bytes as f64 / secs / 1e9,
        secs * 1e3 / count as f64
    );
}

/// User + system CPU time of this process so far (Linux `/proc/self/stat`, clock ticks of 10 ms).
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // Fields after the command name (which may hold spaces) start at its closing parenthesis.
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_link_sleeps_instead_of_spinning() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let (_listener, client, server) = pair().await;
    let before = cpu_time();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let used = cpu_time() - before;
    // Two progress threads spinning would burn ~2 s of CPU in that second.
    assert!(
        used < Duration::from_millis(300),
        "{used:?} of CPU while idle"
    );
    drop((client, server));
}
