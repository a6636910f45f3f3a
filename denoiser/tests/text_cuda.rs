//! The umT5 / T5 text encoder on a GPU (feature `cuda`) against transformers: the fixtures of
//! `text_encoder.rs` (`scripts/make_fixtures.py text`: transformers' `UMT5EncoderModel` and
//! `T5EncoderModel` run on the CPU in f32), loaded onto `cuda:0` in f32 and in bf16. Compared: the raw
//! `last_hidden_state` of padded batches (5 prompts at max lengths 16 and 64, padded rows included)
//! and the Wan pipeline's cut-and-zero-pad `prompt_embeds` made by [`TextEncoder`] on the GPU (states
//! stay on the device, padding rows exactly zero). Also: a random-weight encoder drawn on the GPU
//! (what the XXL benchmark builds) equals the same encoder drawn on the CPU.
//!
//! Skips (with a message) where no GPU or CUDA library is found, but fails when the environment sets
//! `DITSTREAM_REQUIRE_GPUS` (≥ 1), as `scripts/gpu-text.sh` does. Each comparison prints a
//! `TEXTPARITY` line (case, dtype, the error measures below, the tolerance) that the script summarises.
//!
//! ## Tolerances
//! - **f32**: the CPU test's bound, |got − want| ≤ 1e-5 + 1e-4·|want| (see `text_encoder.rs`). The GPU
//!   computes in true f32 (cuBLASLt `COMPUTE_32F`, no TF32) and differs from transformers' CPU run only
//!   in summation order and in `expf`/`tanhf`/`rsqrtf` (≤ 2 ulp): the same ~1e-6 expected error.
//! - **bf16**: every stored weight and activation is rounded to 8 significant bits (maths between
//!   stores is f32): a relative error of at most u = 2⁻⁸ per rounding, of RMS ≤ u/√3 ≈ 2.3e-3. Along
//!   the path from the ids to the output of the two-layer fixtures there are N ≈ 55 roundings: the
//!   embedding table (1); per block 26 — the attention norm's weight and output (2), q/k/v weights and
//!   outputs (6), the QKᵀ logits (1), the bias table (1), the softmax weights (1), PV (1), o's weight and
//!   output (2), the residual sum (1), the FFN norm's weight and output (2), wi_0 / wi_1 weights and
//!   outputs (4), GELU (1), the gate product (1), wo's weight and output (2), the residual sum (1);
//!   the final norm's weight and output (2). Independent roundings add in quadrature (GEMMs, norms and
//!   the softmax average them rather than line them up): the error's RMS relative to the states' RMS
//!   is about (u/√3)·√N ≈ 0.017. Norms do not amplify relative error (they divide by the RMS they
//!   measure); the softmax turns a relative logit error ε into ε·|logit| on the weights, |logit| = O(1)
//!   here (T5 logits are unscaled, but transformers' init scales q by (d_model·d_kv)^-½). So the bound
//!   on RMS(got − want)/RMS(want) is 2·(u/√3)·√N ≈ 0.033 (a factor 2 for what the estimate leaves out,
//!   e.g. residual sums that partly cancel), and on max|got − want|/RMS(want) 5× that ≈ 0.17 (a
//!   Gaussian's largest of ≤ 2·10⁴ draws is < 4.5σ). A structural bug (a wrong bucket, a mask off by
//!   one, a swapped head layout) moves the RMS error to 0.1–1; the f32 run pins every op far tighter.
//!   The CPU backend with the same bf16 storage measures RMS ≤ 1.2e-2 and max ≤ 8.2e-2 (both relative
//!   to the states' RMS) on these fixtures.

#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test

use std::path::{Path, PathBuf};

use ditstream_denoiser::text::{PromptTokenizer, T5Config, T5Encoder, TextEncoder};
use ditstream_kernels::{DType, Device, Tensor};
use safetensors::{Dtype, SafeTensors};

/// u = 2⁻⁸: the relative rounding error of one bf16 store.
const BF16_U: f64 = 1.0 / 256.0;
/// Roundings along the ids → states path of the two-layer fixtures (see the module docs).
const BF16_ROUNDINGS: f64 = 55.0;
/// f32: the CPU test's bound.
const F32_ATOL: f64 = 1e-5;
const F32_RTOL: f64 = 1e-4;

/// Bound on RMS(got − want) / RMS(want) in bf16: 2·(u/√3)·√N ≈ 0.033.
fn bf16_rms_bound() -> f64 {
    2.0 * BF16_U / 3f64.sqrt() * BF16_ROUNDINGS.sqrt()
}

/// Bound on max|got − want| / RMS(want) in bf16: 5 × the RMS bound ≈ 0.17.
fn bf16_max_bound() -> f64 {
    5.0 * bf16_rms_bound()
}

fn gpu() -> Option<Device> {
    ditstream_kernels::testing::test_gpu()
}

/// The fixture folder: under this crate's source when it is where the test was built, else under the
/// working directory (the GPU machine runs the prebuilt test from `denoiser/`, as cargo would).
fn fixture_dir() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/text_umt5");
    if built.is_dir() {
        built
    } else {
        PathBuf::from("tests/fixtures/text_umt5")
    }
}

/// The fixture's inputs and transformers' outputs (`io.safetensors`).
struct Io(Vec<u8>);

impl Io {
    fn load() -> Self {
        Io(std::fs::read(fixture_dir().join("io.safetensors")).unwrap())
    }

    fn raw(&self, name: &str, dtype: Dtype) -> (Vec<usize>, Vec<u8>) {
        let st = SafeTensors::deserialize(&self.0).unwrap();
        let v = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(v.dtype(), dtype, "{name}");
        (v.shape().to_vec(), v.data().to_vec())
    }

    fn f32(&self, name: &str) -> Tensor {
        let (shape, data) = self.raw(name, Dtype::F32);
        let values = data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Tensor::from_vec(values, &shape).unwrap()
    }

    fn i64(&self, name: &str) -> (Vec<i64>, Vec<usize>) {
        let (shape, data) = self.raw(name, Dtype::I64);
        let values = data
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        (values, shape)
    }
}

fn prompts() -> Vec<String> {
    let text = std::fs::read_to_string(fixture_dir().join("prompts.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Compares `got` (computed on the GPU) with transformers' `want`, prints the `TEXTPARITY` line and
/// asserts the tolerance of `dtype`.
fn check(label: &str, dtype: DType, dev: Device, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{label}: shape");
    assert_eq!(
        (got.device(), got.dtype()),
        (dev, dtype),
        "{label}: placement"
    );
    let (g, w) = (got.to_vec_f32().unwrap(), want.to_vec_f32().unwrap());
    assert!(
        g.iter().all(|v| v.is_finite()),
        "{label}: non-finite values"
    );
    let n = w.len().max(1) as f64;
    let rms_want = (w.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / n)
        .sqrt()
        .max(f64::MIN_POSITIVE);
    let (mut excess, mut max_abs, mut sum_sq) = (f64::NEG_INFINITY, 0.0f64, 0.0f64);
    for (&a, &b) in g.iter().zip(&w) {
        let d = (f64::from(a) - f64::from(b)).abs();
        excess = excess.max(d - (F32_ATOL + F32_RTOL * f64::from(b).abs()));
        max_abs = max_abs.max(d);
        sum_sq += d * d;
    }
    let (max_rel, rms_rel) = (max_abs / rms_want, (sum_sq / n).sqrt() / rms_want);
    let (name, tol, ok) = match dtype {
        DType::F32 => (
            "f32",
            format!("|d| ≤ {F32_ATOL:.0e} + {F32_RTOL:.0e}·|want|"),
            excess <= 0.0,
        ),
        DType::BF16 => (
            "bf16",
            format!(
                "rms ≤ {:.3}, max ≤ {:.3}",
                bf16_rms_bound(),
                bf16_max_bound()
            ),
            rms_rel <= bf16_rms_bound() && max_rel <= bf16_max_bound(),
        ),
    };
    println!(
        "TEXTPARITY\t{label}\t{name}\tmax|d| {max_abs:.3e}\tmax/rms {max_rel:.3e}\trms/rms {rms_rel:.3e}\t{tol}"
    );
    assert!(
        ok,
        "{label} {name}: max|d| {max_abs:.3e}, max/rms {max_rel:.3e}, rms/rms {rms_rel:.3e} \
         (tolerance {tol})"
    );
}

/// The raw states of both padded batches of fixture `kind` (`umt5` / `t5`) from `encoder_dir`.
fn raw_states(kind: &str, encoder_dir: &str, dev: Device, dtype: DType) {
    let io = Io::load();
    let encoder = T5Encoder::from_dir(&fixture_dir().join(encoder_dir), dtype, dev).unwrap();
    assert_eq!((encoder.device(), encoder.dtype()), (dev, dtype));
    for max_len in [16, 64] {
        let case = format!("{kind}.max{max_len}");
        let (ids, shape) = io.i64(&format!("{case}.input_ids"));
        let (mask, _) = io.i64(&format!("{case}.attention_mask"));
        let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        let lens: Vec<usize> = mask
            .chunks_exact(max_len)
            .map(|row| row.iter().sum::<i64>() as usize)
            .collect();
        let ours = encoder.forward(&ids, [shape[0], shape[1]], &lens).unwrap();
        check(
            &format!("{case}.raw"),
            dtype,
            dev,
            &ours,
            &io.f32(&format!("{case}.raw")),
        );
    }
}

/// The pipeline layout made on the GPU: real-token states, then exact zeros, still on the device.
fn prompt_embeds(kind: &str, encoder_dir: &str, dev: Device, dtype: DType) {
    let io = Io::load();
    let prompts = prompts();
    let refs: Vec<&str> = prompts.iter().map(String::as_str).collect();
    for max_len in [16, 64] {
        let case = format!("{kind}.max{max_len}");
        let tokenizer =
            PromptTokenizer::from_file(&fixture_dir().join("tokenizer/tokenizer.json"), max_len)
                .unwrap();
        let encoder = T5Encoder::from_dir(&fixture_dir().join(encoder_dir), dtype, dev).unwrap();
        let text = TextEncoder::new(tokenizer, encoder).unwrap();
        let out = text.encode(&refs).unwrap();
        check(
            &format!("{case}.prompt_embeds"),
            dtype,
            dev,
            &out.states,
            &io.f32(&format!("{case}.prompt_embeds")),
        );
        let d = out.states.shape()[2];
        let v = out.states.to_vec_f32().unwrap();
        for (b, &len) in out.lengths.iter().enumerate() {
            let tail = &v[(b * max_len + len) * d..(b + 1) * max_len * d];
            assert!(tail.iter().all(|&x| x == 0.0), "{case} prompt {b}: padding");
        }
        // A second encode of the same prompts comes from the cache, on the device, unchanged.
        let again = text.encode(&refs).unwrap();
        assert_eq!(again.states.device(), dev);
        assert_eq!(again.states.to_vec_f32().unwrap(), v, "{case}: cached");
        assert_eq!(text.cache_stats().hits, prompts.len() as u64);
    }
}

#[test]
fn umt5_f32_on_gpu() {
    let Some(dev) = gpu() else { return };
    raw_states("umt5", "text_encoder", dev, DType::F32);
    prompt_embeds("umt5", "text_encoder", dev, DType::F32);
}

#[test]
fn umt5_bf16_on_gpu() {
    let Some(dev) = gpu() else { return };
    raw_states("umt5", "text_encoder", dev, DType::BF16);
    prompt_embeds("umt5", "text_encoder", dev, DType::BF16);
}

#[test]
fn t5_f32_and_bf16_on_gpu() {
    // T5: layer 0's bias table serves every layer.
    let Some(dev) = gpu() else { return };
    for dtype in [DType::F32, DType::BF16] {
        raw_states("t5", "text_encoder_t5", dev, dtype);
    }
}

/// The random-weight encoder the benchmark builds on the GPU is the CPU's tiny random encoder: the
/// weights drawn on the device equal the host draw (up to a rare last-bit difference of the f64
/// log/cos, see the kernels' `random` tests), so the forwards agree within the f32 bound above.
#[test]
fn random_weights_drawn_on_gpu_match_the_cpu_draw() {
    let Some(dev) = gpu() else { return };
    let config = T5Config::tiny();
    let on_cpu = T5Encoder::random(&config, 5, DType::F32, Device::Cpu).unwrap();
    let on_gpu = T5Encoder::random(&config, 5, DType::F32, dev).unwrap();
    let ids = [24u32, 37, 9, 1, 0, 0, 5, 200, 1, 0];
    let want = on_cpu.forward(&ids, [2, 5], &[4, 3]).unwrap();
    let got = on_gpu.forward(&ids, [2, 5], &[4, 3]).unwrap();
    check("tiny.random", DType::F32, dev, &got, &want);
}
