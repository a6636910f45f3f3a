//! The Wan transformer against diffusers 0.42.1 `WanTransformer3DModel` (fixtures from
//! `scripts/make_fixtures.py dit`): the checkpoint folder loads as users have it, and the
//! conditioning, every block's output and the final velocity match, for a scalar timestep and for
//! Wan2.2-style per-token timesteps.
//!
//! Tolerance: both sides run f32 on the CPU; they differ only in summation order (GEMMs over
//! K ≤ 256, attention over ≤ 180 keys, norms over D = 256), about √K·2⁻²⁴ ≈ 1e-6 relative per op.
//! Two blocks chain ~30 such ops and LayerNorm/RMSNorm rescale by up to ~10×, so differences stay
//! below ~1e-5·(1 + |x|); 1e-4·(1 + |x|) leaves margin and still catches any wrong op (a swapped
//! RoPE band or modulation row changes outputs at 1e-2 or more).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test

use std::path::{Path, PathBuf};

use ditstream_denoiser::model::{LocalAttention, WanTransformer};
use ditstream_kernels::weights::Checkpoint;
use ditstream_kernels::{DType, Device, Tensor};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn io(ck: &Checkpoint, name: &str) -> Tensor {
    ck.stored(name, DType::F32)
        .unwrap_or_else(|e| panic!("{e}"))
}

fn assert_close(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let (g, w) = (got.to_vec_f32().unwrap(), want.to_vec_f32().unwrap());
    let mut worst = 0.0f32;
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let err = (a - b).abs() / (1.0 + b.abs());
        assert!(err <= 1e-4, "{what}: element {i}: got {a}, diffusers {b}");
        worst = worst.max(err);
    }
    eprintln!("{what}: worst scaled error {worst:.2e}");
}

fn check(name: &str) {
    let dir = fixture(name);
    let model =
        WanTransformer::from_dir(&dir.join("transformer"), DType::F32, Device::Cpu).unwrap();
    let ck = Checkpoint::open_dir(&dir, "io").unwrap();
    let x = io(&ck, "hidden_states");
    let ctx = io(&ck, "encoder_hidden_states");
    for case in ["t500", "t999", "per_token"] {
        let t = io(&ck, &format!("{case}.timestep"));
        let (tokens, cond) = model.embed(&x, &t, &ctx).unwrap();
        let temb = io(&ck, &format!("{case}.temb"));
        assert_close(
            &format!("{name} {case} temb"),
            &cond.temb,
            &temb.reshape(cond.temb.shape()).unwrap(),
        );
        let tproj = io(&ck, &format!("{case}.timestep_proj"));
        let want_tproj = tproj.reshape(cond.timestep_proj.shape()).unwrap();
        assert_close(
            &format!("{name} {case} timestep_proj"),
            &cond.timestep_proj,
            &want_tproj,
        );
        assert_close(
            &format!("{name} {case} context"),
            &cond.context,
            &io(&ck, &format!("{case}.context")),
        );
        let mut h = tokens;
        for i in 0..model.num_blocks() {
            let local = LocalAttention::default();
            h = model
                .block(
                    i,
                    &h,
                    &cond,
                    &cond.rope_cos,
                    &cond.rope_sin,
                    &cond.timestep_proj,
                    &local,
                )
                .unwrap();
            assert_close(
                &format!("{name} {case} block {i}"),
                &h,
                &io(&ck, &format!("{case}.block{i}")),
            );
        }
        let out = model.head(&h, &cond.temb, cond.grid).unwrap();
        let want = io(&ck, &format!("{case}.output"));
        assert_close(&format!("{name} {case} output"), &out, &want);
        // The one-call forward is the same computation.
        let direct = model.forward(&x, &t, &ctx).unwrap();
        assert_eq!(
            direct.to_vec_f32().unwrap(),
            out.to_vec_f32().unwrap(),
            "{name} {case}: forward"
        );
    }
    // RoPE tables: diffusers stores each angle twice (interleaved pairs) as [1, L, 1, hd].
    let cos = io(&ck, "rope_cos").to_vec_f32().unwrap();
    let (_, cond) = model.embed(&x, &io(&ck, "t500.timestep"), &ctx).unwrap();
    let ours = cond.rope_cos.to_vec_f32().unwrap();
    for (i, &c) in ours.iter().enumerate() {
        assert!(
            (c - cos[2 * i]).abs() < 1e-6,
            "{name}: rope cos {i}: {c} vs {}",
            cos[2 * i]
        );
    }
}

#[test]
fn diffusers_test_config_matches() {
    check("dit_diffusers_test");
}

#[test]
fn head_dim_128_mini_model_matches() {
    check("dit_mini128");
}

#[test]
fn bad_inputs_and_checkpoints_are_named() {
    let dir = fixture("dit_diffusers_test");
    let model =
        WanTransformer::from_dir(&dir.join("transformer"), DType::F32, Device::Cpu).unwrap();
    let x = Tensor::zeros(&[1, 4, 2, 15, 16], DType::F32, Device::Cpu).unwrap();
    let t = Tensor::from_vec(vec![500.0], &[1]).unwrap();
    let ctx = Tensor::zeros(&[1, 12, 16], DType::F32, Device::Cpu).unwrap();
    let e = model.forward(&x, &t, &ctx).unwrap_err().to_string();
    assert_eq!(
        e,
        "latent shape [1, 4, 2, 15, 16]: must be [B, 4, T, H, W] with H divisible by 2 and W by 2"
    );
    let x = Tensor::zeros(&[1, 4, 2, 16, 16], DType::F32, Device::Cpu).unwrap();
    let e = model
        .forward(&x, &Tensor::from_vec(vec![1.0, 2.0], &[2]).unwrap(), &ctx)
        .unwrap_err()
        .to_string();
    assert_eq!(e, "timestep shape [2]: must be [1] or [1, 128] (per token)");
    // A folder without weights, and one whose config asks for image conditioning.
    let tmp = std::env::temp_dir().join(format!("ditstream-wan-bad-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::copy(dir.join("transformer/config.json"), tmp.join("config.json")).unwrap();
    let e = WanTransformer::from_dir(&tmp, DType::F32, Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no `diffusion_pytorch_model.safetensors`"),
        "{e}"
    );
    let cfg = std::fs::read_to_string(tmp.join("config.json"))
        .unwrap()
        .replace("\"image_dim\": null", "\"image_dim\": 1280");
    std::fs::write(tmp.join("config.json"), cfg).unwrap();
    let e = WanTransformer::from_dir(&tmp, DType::F32, Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("config.json: image_dim/added_kv_proj_dim are set"),
        "{e}"
    );
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// A copy of the head-dim-12 fixture's transformer folder with its weights rewritten by `edit`
/// and its config by `config`; returns the folder.
fn broken_checkpoint(
    name: &str,
    edit: impl Fn(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
    config: impl Fn(String) -> String,
) -> PathBuf {
    let src = fixture("dit_diffusers_test").join("transformer");
    let dir = std::env::temp_dir().join(format!("ditstream-wan-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = std::fs::read_to_string(src.join("config.json")).unwrap();
    std::fs::write(dir.join("config.json"), config(text)).unwrap();
    let bytes = std::fs::read(src.join("diffusion_pytorch_model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(
        views,
        None,
        &dir.join("diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    dir
}

#[test]
fn broken_checkpoints_name_the_tensor_or_field() {
    let keep = |t: String| t;
    let load = |dir: &Path| {
        WanTransformer::from_dir(dir, DType::F32, ditstream_kernels::Device::Cpu)
            .unwrap_err()
            .to_string()
    };

    let missing = broken_checkpoint(
        "missing",
        |t| t.retain(|(n, ..)| n != "blocks.1.attn2.to_k.weight"),
        keep,
    );
    let e = load(&missing);
    assert!(
        e.ends_with("tensor `blocks.1.attn2.to_k.weight` is missing"),
        "{e}"
    );

    let shape = broken_checkpoint(
        "shape",
        |t| {
            let p = t.iter_mut().find(|(n, ..)| n == "proj_out.bias").unwrap();
            p.2 = vec![p.2[0] / 2];
            p.3.truncate(p.3.len() / 2);
        },
        keep,
    );
    let e = load(&shape);
    assert!(
        e.contains("tensor `proj_out.bias` has shape [8], the config implies [16]"),
        "{e}"
    );

    let dtype = broken_checkpoint(
        "dtype",
        |t| {
            let p = t
                .iter_mut()
                .find(|(n, ..)| n == "scale_shift_table")
                .unwrap();
            p.1 = safetensors::Dtype::I32;
        },
        keep,
    );
    let e = load(&dtype);
    assert!(
        e.contains("tensor `scale_shift_table` has dtype I32; only F32, F16 and BF16 load"),
        "{e}"
    );

    let field = broken_checkpoint(
        "field",
        |_| {},
        |c| c.replacen('{', "{\n  \"num_atention_heads\": 2,", 1),
    );
    let e = load(&field);
    assert!(
        e.contains("config.json: unknown field `num_atention_heads`"),
        "{e}"
    );

    for dir in [missing, shape, dtype, field] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}
