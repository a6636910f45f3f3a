//! The NCCL latent link on two GPUs (feature `cuda`): a decoder-side listener receiving onto
//! `cuda:1`, a denoiser-side connection sending from `cuda:0`, over real QUIC (loopback, mutual TLS)
//! for the bootstrap and headers and real NCCL for the frames.
//!
//! - A latent sent one frame per chunk arrives as tensors on the decoder's GPU, bit for bit (the link
//!   copies bytes: no tolerance), f32 and bf16, in order, the last chunk marked.
//! - A chunk whose header checksum does not match the frames fails its request with the checksum
//!   error, and the connection goes on carrying other requests.
//!
//! Needs 2 GPUs: skips with fewer unless `DITSTREAM_REQUIRE_GPUS` ≥ 2 (then it fails).

#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use ditstream_common::config::Config;
use ditstream_common::link::nccl::NcclConnection;
use ditstream_common::link::pool::{self as link, Delivery, Pending};
use ditstream_common::link::{ChunkHeader, LinkDType};
use ditstream_common::tls::PoolCa;
use ditstream_kernels::{DType, Device, Tensor};
use tokio::sync::mpsc;

fn register(pending: &Pending, id: &str) -> mpsc::Receiver<Delivery> {
    let (tx, rx) = mpsc::channel(64);
    pending.lock().unwrap().insert(id.to_string(), tx);
    rx
}

async fn next(rx: &mut mpsc::Receiver<Delivery>) -> Delivery {
    tokio::time::timeout(Duration::from_secs(60), rx.recv())
        .await
        .expect("a delivery within 60 s")
        .expect("the request stays registered")
}

/// A [1, 16, frames, 6, 10] latent with distinct values, on `device`.
fn latent(frames: usize, dtype: DType, device: Device) -> Tensor {
    let n = 16 * frames * 6 * 10;
    let values: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
    Tensor::from_vec(values, &[1, 16, frames, 6, 10])
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to_device(device)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn latents_cross_gpu_to_gpu_exactly_and_corruption_fails_the_request() {
    if !ditstream_kernels::testing::test_gpus(2) {
        return;
    }
    let ca = PoolCa::generate("pools").unwrap();
    let identity = ca.issue("localhost").unwrap();
    let cfg = Config::parse("model: {preset: tiny}\npools: {link: nccl}\n", "test").unwrap();
    let pending: Pending = Arc::default();
    let (at, _task) = link::listen(&cfg, &identity, Arc::clone(&pending), 1)
        .await
        .unwrap();
    let conn = NcclConnection::connect(at, "localhost", &identity, 0)
        .await
        .unwrap();

    for (id, dtype) in [("f32", DType::F32), ("bf16", DType::BF16)] {
        let mut rx = register(&pending, id);
        let sent = latent(3, dtype, Device::Cuda(0));
        assert_eq!(conn.send_latent(id, &sent).await.unwrap(), 3);
        for t in 0..3 {
            let got = next(&mut rx).await.unwrap();
            assert_eq!(got.header.chunk_index, t as u32);
            assert_eq!(got.header.last, t == 2);
            assert_eq!(got.latent.device(), Device::Cuda(1));
            assert_eq!(got.latent.dtype(), dtype);
            let want = sent.narrow(2, t, 1).unwrap();
            assert_eq!(got.latent.shape(), want.shape());
            assert_eq!(
                got.latent.to_vec_f32().unwrap(),
                want.to_vec_f32().unwrap(),
                "{id} frame {t} differs"
            );
        }
    }

    // A header whose checksum does not match the frames sent.
    let mut rx = register(&pending, "bad");
    let frames = latent(1, DType::F32, Device::Cuda(0));
    let header = ChunkHeader {
        request_id: "bad".into(),
        chunk_index: 0,
        first_frame: 0,
        last: true,
        shape: frames.shape().iter().map(|&d| d as u64).collect(),
        dtype: LinkDType::F32,
        checksum: 0x1234_5678,
    };
    let mut stream = conn.open_request_stream().await.unwrap();
    conn.send_chunk(&mut stream, &header, frames).await.unwrap();
    let e = next(&mut rx).await.unwrap_err().to_string();
    assert!(
        e.starts_with("latent link: chunk 0 of request bad: checksum"),
        "{e}"
    );

    // The connection still carries requests.
    let mut rx = register(&pending, "after");
    let sent = latent(1, DType::F32, Device::Cuda(0));
    conn.send_latent("after", &sent).await.unwrap();
    let got = next(&mut rx).await.unwrap();
    assert_eq!(got.latent.to_vec_f32().unwrap(), sent.to_vec_f32().unwrap());
}
