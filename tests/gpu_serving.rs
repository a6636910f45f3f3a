//! Serving on NVIDIA GPUs (`serving.device: cuda`, feature `cuda`): `serve` over a real gRPC socket
//! on the GPU streams a playable MP4 that is the GPU pipeline's own output, whose latent and frames
//! match the CPU run of the same request; a 2-GPU denoiser mesh (cfg 2, Ulysses 2) over NCCL equals
//! the 1-GPU run, on communicators formed once; a 2-GPU parallel-VAE instance equals one GPU; a GPU
//! the machine lacks is a clear start-up error.
//!
//! GPU tests skip (with a message) without a usable GPU, or with one GPU for the 2-GPU tests, but
//! fail when `DITSTREAM_REQUIRE_GPUS` asks for them (scripts/gpu-serve.sh sets it to 2), so a skip
//! never hides a failure. Each comparison prints a `SERVEPARITY` line that the script summarises.
//! "Playable" is checked without FFmpeg (the GPU hosts have none): every frame of the MP4 decodes
//! with OpenH264's decoder; the CPU tests (`e2e_grpc.rs`) check the same muxer with ffprobe.
//!
//! ## Tolerances (f32 on the GPU against f32 on the CPU, the built-in tiny model)
//! - **Latent** (3 UniPC steps, guidance g = 5): one DiT forward on the GPU is within
//!   ε = 1e-4·(1 + |want|) of the CPU's (the f32 bound of `denoiser/tests/wan_cuda.rs`: reordered
//!   f32 sums, measured ≤ 1.2e-6 on an H200). A step moves the latent by dt·v with
//!   v = (1 − g)·u + g·c, so a forward error reaches v amplified by |1 − g| + g = 2g − 1 = 9, and
//!   Σ dt = 1 over the schedule; errors of earlier steps pass through the later forwards and the
//!   multistep sampler's coefficients (≤ 2 in magnitude), which we cover with a factor S (steps):
//!   **max|Δ| / (1 + max|want|) ≤ S·(2g − 1)·1e-4 = 2.7e-3.** A wrong op, layout or device transfer
//!   moves the latent by O(0.1–1).
//! - **Frames** (VAE output in [−1, 1], the CPU's latent decoded chunk by chunk on both): the f32
//!   bound of `decoder/tests/vae_cuda.rs`, **max|Δ| ≤ 1e-4** per value (≈ 36 reductions in series,
//!   each ≈ √K·2⁻²⁴ relative, in quadrature ≈ 1.5e-5; the tiny VAE has fewer and narrower layers).
//! - **2 GPUs vs 1** (both f32 on GPUs): the same maths with sums cut differently (half the tokens
//!   per GPU for Ulysses; batch 1 instead of 2 under CFG parallel): the bound of the CPU mesh test
//!   (`mesh_serving.rs`), **max|Δ| ≤ 5e-5·max|want|**, which catches a wrong shard or a lost padding
//!   mask (27 tokens pad on every 2-way mesh).
//! - **Parallel VAE on 2 GPUs vs 1**: halo exchange reproduces the unsharded convolution's inputs
//!   exactly, so only f32 summation order can differ (cuBLASLt's algorithm for another M): the
//!   bound of `decoder/tests/parallel_vae_nccl.rs`, **max|Δ| ≤ 1e-4**.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test

use ditstream_common::config::Config;

/// The built-in tiny model in f32 at a small size: 3 steps, 64×48, 9 frames (3 latent frames).
fn config(device: &str, gpus: &str, parallel: &str) -> Config {
    let gpus = if gpus.is_empty() {
        String::new()
    } else {
        format!("  gpus: {gpus}\n")
    };
    let yaml = format!(
        "model:\n  preset: tiny\n  dtype: f32\nsampler:\n  steps: 3\n  shift: 3.0\nserving:\n  \
         device: {device}\n{gpus}  width: 64\n  height: 48\n  num_frames: 9\n  fps: 12\n\
         parallel_config:\n{parallel}"
    );
    let cfg = Config::parse(&yaml, "<test>").unwrap();
    // The GPU script's CUDA settings, the same the gate fixes for the process.
    #[cfg(feature = "cuda")]
    let cfg = {
        let mut cfg = cfg;
        if device == "cuda" {
            cfg.cuda = (&ditstream_kernels::testing::cuda_settings_from_env().unwrap()).into();
        }
        cfg
    };
    cfg.validate(None).unwrap();
    cfg
}

/// Top-level boxes of `buf`: (type, body).
fn boxes(buf: &[u8]) -> Vec<([u8; 4], &[u8])> {
    let mut out = Vec::new();
    let mut i = 0;
    while i + 8 <= buf.len() {
        let size = u32::from_be_bytes(buf[i..i + 4].try_into().unwrap()) as usize;
        assert!(
            size >= 8 && i + size <= buf.len(),
            "box at {i} of size {size}"
        );
        out.push((buf[i + 4..i + 8].try_into().unwrap(), &buf[i + 8..i + size]));
        i += size;
    }
    assert_eq!(i, buf.len(), "trailing bytes after the last box");
    out
}

fn child<'a>(buf: &'a [u8], path: &[&[u8; 4]]) -> &'a [u8] {
    let mut cur = buf;
    for name in path {
        cur = boxes(cur)
            .into_iter()
            .find(|(t, _)| t == *name)
            .unwrap_or_else(|| panic!("no {}", String::from_utf8_lossy(*name)))
            .1;
    }
    cur
}

/// Annex-B (start-code) form of length-prefixed NAL units.
fn annex_b(mut nals: &[u8], out: &mut Vec<u8>) {
    while !nals.is_empty() {
        let len = u32::from_be_bytes(nals[..4].try_into().unwrap()) as usize;
        out.extend_from_slice(&[0, 0, 0, 1]);
        out.extend_from_slice(&nals[4..4 + len]);
        nals = &nals[4 + len..];
    }
}

/// Decodes every frame of a fragmented MP4 with OpenH264 (the player's job, without FFmpeg):
/// returns (width, height) of each decoded picture.
pub fn decode_mp4(mp4: &[u8]) -> Vec<(usize, usize)> {
    use openh264::formats::YUVSource;
    let top = boxes(mp4);
    assert_eq!(&top[0].0, b"ftyp");
    assert_eq!(&top[1].0, b"moov");
    // The avcC record: SPS and PPS (the sample entry's child boxes follow 78 bytes of fields).
    let stsd = child(top[1].1, &[b"trak", b"mdia", b"minf", b"stbl", b"stsd"]);
    let avc1 = &boxes(&stsd[8..])[0];
    assert_eq!(&avc1.0, b"avc1");
    let avcc = child(&avc1.1[78..], &[b"avcC"]);
    // avcC: version, profile, compatibility, level, length size, then the SPS count (low 5
    // bits) and SPSs, the PPS count and PPSs, each with a 16-bit length.
    let mut params = Vec::new();
    let mut at = 6;
    let mut take = |at: &mut usize| {
        let len = usize::from(u16::from_be_bytes([avcc[*at], avcc[*at + 1]]));
        params.extend_from_slice(&[0, 0, 0, 1]);
        params.extend_from_slice(&avcc[*at + 2..*at + 2 + len]);
        *at += 2 + len;
    };
    for _ in 0..(avcc[5] & 0x1f) {
        take(&mut at);
    }
    let pps_count = avcc[at];
    at += 1;
    for _ in 0..pps_count {
        take(&mut at);
    }
    let mut decoder = openh264::decoder::Decoder::new().unwrap();
    let mut pictures = Vec::new();
    let mut first = true;
    for pair in top[2..].chunks(2) {
        assert_eq!((&pair[0].0, &pair[1].0), (b"moof", b"mdat"));
        let trun = child(pair[0].1, &[b"traf", b"trun"]);
        let count = u32::from_be_bytes(trun[4..8].try_into().unwrap()) as usize;
        // flags 0x701: data offset, then (duration, size, flags) per sample.
        let sizes: Vec<usize> = (0..count)
            .map(|i| {
                u32::from_be_bytes(trun[12 + 12 * i + 4..12 + 12 * i + 8].try_into().unwrap())
                    as usize
            })
            .collect();
        let mut data = pair[1].1;
        for size in sizes {
            let mut packet = if first { params.clone() } else { Vec::new() };
            first = false;
            annex_b(&data[..size], &mut packet);
            data = &data[size..];
            if let Some(picture) = decoder.decode(&packet).unwrap() {
                pictures.push(picture.dimensions());
            }
        }
        assert!(data.is_empty(), "mdat holds more than its samples");
    }
    for picture in decoder.flush_remaining().unwrap() {
        pictures.push(picture.dimensions());
    }
    pictures
}

/// The MP4 check the GPU test relies on, exercised on the CPU: the embedded-style pipeline's video
/// decodes frame by frame with OpenH264.
#[test]
fn the_mp4_check_decodes_every_frame_of_a_cpu_run() {
    let cfg = config("cpu", "", "  cfg_size: 1\n");
    let pipeline = ditstream::pipeline::Pipeline::from_config(&cfg).unwrap();
    let p = ditstream::request::RawRequest {
        prompt: "a checked file".into(),
        seed: Some(2),
        ..Default::default()
    }
    .validate(&cfg, "tiny")
    .unwrap();
    let mp4 = pipeline.render_streamed(&p).unwrap();
    assert_eq!(decode_mp4(&mp4), vec![(64, 48); 9]);
    // A truncated file is not playable: the check fails.
    let cut = mp4.len() - 10;
    assert!(std::panic::catch_unwind(|| decode_mp4(&mp4[..cut])).is_err());
}

#[cfg(not(feature = "cuda"))]
#[tokio::test]
async fn cuda_in_a_build_without_cuda_is_a_clear_startup_error() {
    let cfg = config("cuda", "", "  cfg_size: 1\n");
    let err = ditstream::serve::start(cfg, "127.0.0.1:0".parse().unwrap())
        .await
        .err()
        .expect("a build without CUDA cannot serve on a GPU");
    let msg = format!("{err:#}");
    assert!(
        msg.contains("serving.device = cuda: this binary was built without CUDA"),
        "{msg}"
    );
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::time::Instant;

    use std::sync::atomic::AtomicBool;

    use ditstream::pipeline::{Pipeline, decode_job, denoise_job};
    use ditstream::request::{GenerateParams, RawRequest};
    use ditstream_common::config::Config;
    use ditstream_decoder::stage::DecodeStage;
    use ditstream_denoiser::denoise::Control;
    use ditstream_denoiser::stage::DenoiseStage;
    use ditstream_kernels::{Device, Tensor};
    use ditstream_proto::v1 as pb;
    use ditstream_proto::v1::generate_event::Event as E;
    use ditstream_proto::v1::video_service_client::VideoServiceClient;

    use super::{config, decode_mp4};

    /// Guidance scale of the requests (the sampler default).
    const GUIDANCE: f64 = 5.0;
    /// Steps of the requests (the config's).
    const STEPS: f64 = 3.0;
    /// Per-forward f32 bound of the DiT on a GPU against the CPU (wan_cuda.rs).
    const FORWARD_F32: f64 = 1e-4;
    /// VAE output, f32, GPU against CPU (vae_cuda.rs).
    const FRAMES_F32: f64 = 1e-4;
    /// 2 GPUs against 1, relative to max|want| (mesh_serving.rs).
    const MESH_F32: f64 = 5e-5;

    /// Latent bound on max|Δ| / (1 + max|want|): S·(2g − 1)·ε (module docs).
    fn latent_bound() -> f64 {
        STEPS * (2.0 * GUIDANCE - 1.0) * FORWARD_F32
    }

    fn params(cfg: &Config, seed: u64) -> GenerateParams {
        RawRequest {
            prompt: "a lantern on a pier".into(),
            seed: Some(seed),
            ..RawRequest::default()
        }
        .validate(cfg, "tiny")
        .unwrap()
    }

    fn latent(stage: &DenoiseStage, p: &GenerateParams) -> Vec<f32> {
        let (cond, uncond) = stage.text_states(&denoise_job(p)).unwrap();
        let latent = stage
            .denoise_latent(
                &denoise_job(p),
                &cond,
                &uncond,
                &AtomicBool::new(false),
                |_| Control::Continue,
            )
            .unwrap();
        assert_eq!(
            latent.device(),
            Device::Cpu,
            "the finished latent is handed over on the host"
        );
        latent.to_vec_f32().unwrap()
    }

    /// (max|Δ|, max|want|), asserting equal lengths and no NaN.
    fn diff(got: &[f32], want: &[f32]) -> (f64, f64) {
        assert_eq!(got.len(), want.len());
        let mut worst = 0f64;
        let mut scale = 0f64;
        for (&g, &w) in got.iter().zip(want) {
            let d = (f64::from(g) - f64::from(w)).abs();
            assert!(!d.is_nan(), "NaN in the comparison");
            worst = worst.max(d);
            scale = scale.max(f64::from(w).abs());
        }
        (worst, scale)
    }

    /// Prints the `SERVEPARITY` line and returns whether `error ≤ bound`.
    fn report(what: &str, error: f64, bound: f64) -> bool {
        let ok = error <= bound;
        println!(
            "SERVEPARITY\t{what}\t{error:.3e}\t{bound:.1e}\t{}",
            if ok { "ok" } else { "FAIL" }
        );
        ok
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn serve_on_a_gpu_streams_the_gpu_pipelines_video_matching_the_cpu_run() {
        if !ditstream_kernels::testing::test_gpus(1) {
            return;
        }
        let started = Instant::now();
        let gpu_cfg = config("cuda", "[0]", "  cfg_size: 1\n");
        let cpu_cfg = config("cpu", "", "  cfg_size: 1\n");
        let p = params(&gpu_cfg, 7);

        // `serve` on the GPU, over a real socket.
        let server = ditstream::serve::start(gpu_cfg.clone(), "127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let mut client = VideoServiceClient::connect(format!("http://{}", server.addr))
            .await
            .unwrap();
        let models = client
            .list_models(pb::ListModelsRequest {})
            .await
            .unwrap()
            .into_inner();
        assert!(
            models.models[0].description.contains("= 1 ranks on cuda:0"),
            "{models:?}"
        );
        let request = pb::GenerateRequest {
            prompt: p.prompt.clone(),
            seed: Some(p.seed),
            ..Default::default()
        };
        let mut stream = client.generate(request).await.unwrap().into_inner();
        let mut served = Vec::new();
        let mut completed = None;
        while let Some(e) = stream.message().await.unwrap() {
            match e.event.unwrap() {
                E::InitSegment(i) => served.extend(i.data),
                E::MediaSegment(s) => served.extend(s.data),
                E::Completed(c) => completed = Some(c),
                _ => {}
            }
        }
        server.stop().await.unwrap();
        let completed = completed.expect("the stream ends with Completed");
        assert_eq!((completed.frames, completed.segments), (9, 4));

        // Playable: every frame decodes, at the request's size.
        assert_eq!(decode_mp4(&served), vec![(64, 48); 9]);

        // The served video is the GPU pipeline's output for this request (same process, same
        // kernels: the GPU path is deterministic run to run).
        let (gpu, cpu) = tokio::task::spawn_blocking(move || {
            (
                Pipeline::from_config(&gpu_cfg).unwrap(),
                Pipeline::from_config(&cpu_cfg).unwrap(),
            )
        })
        .await
        .unwrap();
        let gpu = std::sync::Arc::new(gpu);
        let again = {
            let (gpu, p) = (std::sync::Arc::clone(&gpu), p.clone());
            tokio::task::spawn_blocking(move || gpu.render_streamed(&p).unwrap())
                .await
                .unwrap()
        };
        assert!(
            served == again,
            "the served MP4 differs from the GPU pipeline's own run"
        );

        // Its latent and frames match the CPU run of the same request.
        let (latent_ok, frames_ok) = tokio::task::spawn_blocking(move || {
            let want = latent(cpu.denoise_stage(), &p);
            let got = latent(gpu.denoise_stage(), &p);
            let (err, scale) = diff(&got, &want);
            let latent_ok = report(
                "latent gpu-f32 vs cpu-f32",
                err / (1.0 + scale),
                latent_bound(),
            );
            let cpu_latent = Tensor::from_vec(want, &[1, 16, 3, 6, 8]).unwrap();
            let mut on_cpu = cpu.decode_stage().start(&decode_job(&p)).unwrap();
            let mut on_gpu = gpu.decode_stage().start(&decode_job(&p)).unwrap();
            let mut worst = 0f64;
            for t in 0..3 {
                let chunk = cpu_latent.narrow(2, t, 1).unwrap();
                let want = on_cpu.decode(&chunk).unwrap().to_vec_f32().unwrap();
                // A device chunk too: the decoder takes latents wherever they are.
                let chunk = chunk.to_device(Device::Cuda(0)).unwrap();
                let got = on_gpu.decode(&chunk).unwrap();
                assert_eq!(
                    got.device(),
                    Device::Cpu,
                    "frames come back to the host to encode"
                );
                worst = worst.max(diff(&got.to_vec_f32().unwrap(), &want).0);
            }
            (
                latent_ok,
                report("frames gpu-f32 vs cpu-f32", worst, FRAMES_F32),
            )
        })
        .await
        .unwrap();
        assert!(
            latent_ok && frames_ok,
            "out of bounds (see the SERVEPARITY lines)"
        );
        eprintln!("serve on the GPU: {:.1} s", started.elapsed().as_secs_f64());
    }

    #[test]
    fn a_two_gpu_mesh_equals_one_gpu_on_communicators_formed_once() {
        if !ditstream_kernels::testing::test_gpus(2) {
            return;
        }
        let one = config("cuda", "[0]", "  cfg_size: 1\n");
        let p = params(&one, 3);
        let want = latent(&DenoiseStage::from_config(&one).unwrap(), &p);
        let mut ok = true;
        for parallel in ["  cfg_size: 2\n", "  ulysses_size: 2\n"] {
            let cfg = config("cuda", "[0, 1]", parallel);
            let stage = DenoiseStage::from_config(&cfg).unwrap();
            assert_eq!(stage.devices(), [Device::Cuda(0), Device::Cuda(1)]);
            assert_eq!(
                stage.connections(),
                1,
                "NCCL communicators formed at start-up"
            );
            let got = latent(&stage, &p);
            let (err, scale) = diff(&got, &want);
            ok &= report(
                &format!("latent 2 GPUs {} vs 1 GPU", parallel.trim()),
                err / scale.max(f64::MIN_POSITIVE),
                MESH_F32,
            );
            // A cancel after step 1 ends every rank (agreed), and the next request runs on the
            // same communicators with the same result.
            let (cond, uncond) = stage.text_states(&denoise_job(&p)).unwrap();
            let cancelled = stage.denoise_latent(
                &denoise_job(&p),
                &cond,
                &uncond,
                &AtomicBool::new(false),
                |s| {
                    if s.step == 1 {
                        Control::Cancel
                    } else {
                        Control::Continue
                    }
                },
            );
            assert!(cancelled.is_err());
            assert_eq!(
                latent(&stage, &p),
                got,
                "{}: reused communicators",
                parallel.trim()
            );
            assert_eq!(
                stage.connections(),
                1,
                "{}: never re-formed",
                parallel.trim()
            );
        }
        assert!(ok, "out of bounds (see the SERVEPARITY lines)");
    }

    /// The stage's persistent 2-GPU instance (its communicator formed once) decodes what one GPU
    /// does; `decoder/tests/parallel_vae_nccl.rs` checks the instance itself on more shapes.
    #[test]
    fn a_two_gpu_vae_instance_equals_one_gpu() {
        if !ditstream_kernels::testing::test_gpus(2) {
            return;
        }
        let one =
            DecodeStage::from_config(&config("cuda", "[0]", "  parallel_vae_size: 1\n")).unwrap();
        let cfg = config(
            "cuda",
            "[0, 1]",
            "  parallel_vae_size: 2\n  parallel_vae_split_dim: width\n",
        );
        let two = DecodeStage::from_config(&cfg).unwrap();
        assert_eq!(two.connections(), 1);
        let p = params(&cfg, 5);
        let latent = ditstream_denoiser::denoise::initial_noise([1, 16, 3, 6, 8], 5).unwrap();
        let (mut a, mut b) = (
            one.start(&decode_job(&p)).unwrap(),
            two.start(&decode_job(&p)).unwrap(),
        );
        let mut worst = 0f64;
        for t in 0..3 {
            let chunk = latent.narrow(2, t, 1).unwrap();
            let want = a.decode(&chunk).unwrap().to_vec_f32().unwrap();
            let got = b.decode(&chunk).unwrap().to_vec_f32().unwrap();
            worst = worst.max(diff(&got, &want).0);
        }
        assert!(report("frames vae 2 GPUs vs 1 GPU", worst, FRAMES_F32));
        assert_eq!(two.connections(), 1);
    }

    #[tokio::test]
    async fn a_gpu_the_machine_lacks_is_a_clear_startup_error() {
        // Runs with or without GPUs: with them the ordinal does not exist; without, the GPUs
        // cannot be opened. Either way the error names the key and the value, and nothing panics.
        let cfg = config("cuda", "[99]", "  cfg_size: 1\n");
        let err = ditstream::serve::start(cfg.clone(), "127.0.0.1:0".parse().unwrap())
            .await
            .err()
            .expect("GPU 99 does not exist");
        let msg = format!("{err:#}");
        assert!(msg.contains("serving.gpus = [99]"), "{msg}");
        if ditstream_kernels::cuda::cuda_device_count().is_ok() {
            assert!(
                msg.contains("GPU 99 does not exist; this machine has"),
                "{msg}"
            );
        }
        let err = DecodeStage::from_config(&cfg)
            .err()
            .expect("GPU 99 does not exist");
        assert!(
            format!("{err:#}").contains("serving.gpus = [99]"),
            "{err:#}"
        );

        // More ranks than listed GPUs.
        let cfg = config("cuda", "[0]", "  cfg_size: 2\n");
        let err = DenoiseStage::from_config(&cfg)
            .err()
            .expect("two ranks, one GPU");
        assert!(
            format!("{err:#}")
                .contains("serving.gpus = [0]: lists 1 GPU(s) but the denoiser mesh has 2 ranks"),
            "{err:#}"
        );
    }
}
