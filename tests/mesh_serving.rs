//! `parallel_config` in the product: the denoiser stage runs its loop on the config's mesh (ranks
//! are threads on the CPU) and produces the single-rank latent, and a multi-rank config serves a
//! playable video end to end. The ranks' communicators are formed once, when a stage is built,
//! and serve every request after it.
//!
//! Tolerance: the parallel wrappers reorder reductions only (see
//! denoiser/tests/parallel_vs_single.rs: ≤ 1.2e-6 of the latent's scale measured over a CFG
//! denoise); 5e-5 of the scale leaves margin and catches a wrong shard or a lost padding mask.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test

use std::sync::atomic::AtomicBool;

use ditstream::pipeline::{decode_job, denoise_job};
use ditstream::request::RawRequest;
use ditstream_common::config::Config;
use ditstream_denoiser::denoise::Control;
use ditstream_denoiser::stage::DenoiseStage;

fn config(parallel: &str) -> Config {
    let yaml = format!(
        "model:\n  preset: tiny\nsampler:\n  steps: 2\nserving:\n  width: 64\n  height: 48\n  num_frames: 9\n\
         parallel_config:\n{parallel}"
    );
    Config::parse(&yaml, "<test>").unwrap()
}

#[test]
fn every_mesh_gives_the_single_rank_latent() {
    let single = DenoiseStage::from_config(&config("  cfg_size: 1\n")).unwrap();
    let cfg = config("  cfg_size: 1\n");
    let raw = RawRequest {
        prompt: "a mesh".into(),
        seed: Some(5),
        ..RawRequest::default()
    };
    let params = raw.validate(&cfg, "tiny").unwrap();
    let (cond, uncond) = single.text_states(&denoise_job(&params)).unwrap();
    let want = single
        .denoise_latent(
            &denoise_job(&params),
            &cond,
            &uncond,
            &AtomicBool::new(false),
            |_| Control::Continue,
        )
        .unwrap()
        .to_vec_f32()
        .unwrap();
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    // 27 tokens (3 × 3 × 3 after patchify at 64×48): no degree below divides it, so every mesh pads.
    for parallel in [
        "  ulysses_size: 2\n",
        "  cfg_size: 2\n",
        "  ring_size: 2\n",
        "  attn2d_size: [2, 2]\n",
        "  cfg_size: 2\n  ulysses_size: 2\n  ring_size: 2\n",
    ] {
        let stage = DenoiseStage::from_config(&config(parallel)).unwrap();
        assert!(stage.mesh().world_size() > 1);
        let mut steps = Vec::new();
        let got = stage
            .denoise_latent(
                &denoise_job(&params),
                &cond,
                &uncond,
                &AtomicBool::new(false),
                |s| {
                    steps.push(s.step);
                    Control::Continue
                },
            )
            .unwrap()
            .to_vec_f32()
            .unwrap();
        assert_eq!(
            steps,
            vec![1, 2],
            "{parallel}: progress comes from rank 0, once per step"
        );
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            worst <= 5e-5 * scale,
            "{}: worst difference {worst} (scale {scale})",
            parallel.trim()
        );
    }
}

#[test]
fn a_cancel_on_rank_zero_stops_every_rank() {
    let stage = DenoiseStage::from_config(&config("  cfg_size: 2\n  ulysses_size: 2\n")).unwrap();
    let cfg = config("  cfg_size: 2\n  ulysses_size: 2\n");
    let raw = RawRequest {
        prompt: "stop".into(),
        steps: Some(5),
        seed: Some(1),
        ..RawRequest::default()
    };
    let params = raw.validate(&cfg, "tiny").unwrap();
    let (cond, uncond) = stage.text_states(&denoise_job(&params)).unwrap();
    let err = stage.denoise_latent(
        &denoise_job(&params),
        &cond,
        &uncond,
        &AtomicBool::new(false),
        |s| {
            if s.step == 2 {
                Control::Cancel
            } else {
                Control::Continue
            }
        },
    );
    assert!(
        matches!(
            err,
            Err(ditstream_denoiser::denoise::DenoiseError::Cancelled { after_step: 2, .. })
        ),
        "{err:?}"
    );
    // And the stage is usable again at once (an agreed cancel leaves the communicators intact).
    assert!(
        stage
            .denoise_latent(
                &denoise_job(&params),
                &cond,
                &uncond,
                &AtomicBool::new(false),
                |_| Control::Continue
            )
            .is_ok()
    );
}

#[test]
fn a_mesh_that_does_not_fit_the_model_is_refused_at_start() {
    // The tiny model has 2 heads: Ulysses 4 cannot split them.
    let err = DenoiseStage::from_config(&config("  ulysses_size: 4\n"))
        .err()
        .unwrap();
    assert!(
        format!("{err:#}")
            .contains("parallel_config.ulysses_size = 4: must divide the model's head count 2"),
        "{err:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_rank_config_serves_a_video() {
    use ditstream_proto::v1 as pb;
    use ditstream_proto::v1::video_service_client::VideoServiceClient;
    let cfg = config("  cfg_size: 2\n  ring_size: 2\n");
    let server = ditstream::serve::start(cfg, "127.0.0.1:0".parse().unwrap())
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
        models.models[0]
            .description
            .contains("cfg 2 x tp 1 x cp ring 2 x ulysses 1 = 4 ranks"),
        "{models:?}"
    );
    let req = pb::GenerateRequest {
        prompt: "four ranks".into(),
        seed: Some(2),
        ..Default::default()
    };
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let mut last = None;
    while let Some(e) = stream.message().await.unwrap() {
        last = e.event;
    }
    let Some(pb::generate_event::Event::Completed(done)) = last else {
        panic!("{last:?}")
    };
    assert_eq!((done.frames, done.segments), (9, 4));
    server.stop().await.unwrap();
}

#[test]
fn a_sharded_vae_gives_the_same_video() {
    let video = |parallel: &str| {
        let cfg = config(parallel);
        let pipeline = ditstream::pipeline::Pipeline::from_config(&cfg).unwrap();
        let raw = RawRequest {
            prompt: "bands".into(),
            seed: Some(8),
            ..RawRequest::default()
        };
        let params = raw.validate(&cfg, "tiny").unwrap();
        pipeline.render_streamed(&params).unwrap()
    };
    let whole = video("  parallel_vae_size: 1\n");
    // 48×64 video: latent 6 × 8; 2 bands of rows, 3 uneven bands of columns, 5 bands (1-row ones).
    for parallel in [
        "  parallel_vae_size: 2\n  parallel_vae_split_dim: height\n",
        "  parallel_vae_size: 3\n  parallel_vae_split_dim: width\n",
        "  parallel_vae_size: 5\n  parallel_vae_split_dim: height\n",
    ] {
        assert!(
            video(parallel) == whole,
            "{}: the sharded decode changed the video",
            parallel.trim()
        );
    }
}

#[test]
fn the_mesh_keeps_its_communicators_across_requests() {
    let cfg = config("  cfg_size: 2\n  ulysses_size: 2\n");
    let stage = DenoiseStage::from_config(&cfg).unwrap();
    assert_eq!(stage.connections(), 1, "formed when the stage is built");
    let raw = RawRequest {
        prompt: "again".into(),
        steps: Some(3),
        seed: Some(4),
        ..RawRequest::default()
    };
    let params = raw.validate(&cfg, "tiny").unwrap();
    let (cond, uncond) = stage.text_states(&denoise_job(&params)).unwrap();
    let run = |cancel_at: Option<usize>| {
        stage.denoise_latent(
            &denoise_job(&params),
            &cond,
            &uncond,
            &AtomicBool::new(false),
            |s| {
                if Some(s.step) == cancel_at {
                    Control::Cancel
                } else {
                    Control::Continue
                }
            },
        )
    };
    let first = run(None).unwrap().to_vec_f32().unwrap();
    assert!(run(Some(1)).is_err());
    let again = run(None).unwrap().to_vec_f32().unwrap();
    assert_eq!(
        first, again,
        "the same request gives the same latent on reused communicators"
    );
    assert_eq!(stage.connections(), 1, "no request re-formed them");
}

#[test]
fn a_sharded_vae_instance_decodes_interleaved_requests() {
    use ditstream_decoder::stage::DecodeStage;
    let cfg = config("  parallel_vae_size: 2\n  parallel_vae_split_dim: width\n");
    let sharded = DecodeStage::from_config(&cfg).unwrap();
    let single = DecodeStage::from_config(&config("  parallel_vae_size: 1\n")).unwrap();
    assert_eq!(sharded.connections(), 1);
    let params = RawRequest {
        prompt: "two at once".into(),
        ..RawRequest::default()
    }
    .validate(&cfg, "tiny")
    .unwrap();
    let latent = |seed| ditstream_denoiser::denoise::initial_noise([1, 16, 3, 6, 8], seed).unwrap();
    let (a, b) = (latent(1), latent(2));
    let decode_alone = |latent: &ditstream_kernels::Tensor| {
        let mut s = single.start(&decode_job(&params)).unwrap();
        (0..3)
            .map(|t| {
                s.decode(&latent.narrow(2, t, 1).unwrap())
                    .unwrap()
                    .to_vec_f32()
                    .unwrap()
            })
            .collect::<Vec<_>>()
    };
    let (want_a, want_b) = (decode_alone(&a), decode_alone(&b));
    // Two requests' chunks alternate on one instance: each keeps its own causal caches.
    let mut sa = sharded.start(&decode_job(&params)).unwrap();
    let mut sb = sharded.start(&decode_job(&params)).unwrap();
    for t in 0..3 {
        let got_a = sa
            .decode(&a.narrow(2, t, 1).unwrap())
            .unwrap()
            .to_vec_f32()
            .unwrap();
        let got_b = sb
            .decode(&b.narrow(2, t, 1).unwrap())
            .unwrap()
            .to_vec_f32()
            .unwrap();
        assert!(got_a == want_a[t], "request a, latent frame {t}");
        assert!(got_b == want_b[t], "request b, latent frame {t}");
    }
    drop((sa, sb));
    assert_eq!(sharded.connections(), 1);
}
