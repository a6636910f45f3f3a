//! The umT5 text path against transformers and diffusers (fixtures from `scripts/make_fixtures.py
//! text`, fp32 CPU): token ids and masks, relative-position buckets, raw encoder states (umT5 and T5),
//! the pipeline's cut-and-zero-pad layout at max lengths 16, 64 and 512, the prompt cache, sharded
//! checkpoints, and an error naming the file for each broken folder.
//!
//! Tolerance for the states: both sides compute in f32 and differ only in summation order (GEMM
//! blocking, softmax sums) and in the libm of exp/tanh/rsqrt, each a few ulp (≈ 1e-7 relative) per op.
//! Through two blocks of ~10 ops each, with K ≤ 96 products per dot and residual adds that keep the
//! values O(1), the expected error is ~1e-6 of the values' scale; the final RMS norm scales every row
//! to RMS ≈ |weight| ≈ 1. We allow |ours − theirs| ≤ 1e-5 + 1e-4·|theirs| (the 1e-4 relative,
//! plus an absolute floor of 1e-5 — ten times the expected error at scale 1 — for the elements that
//! happen to be near zero, where a relative bound means nothing). The measured worst case is printed.

// The fixture helpers below sit outside `#[test]` functions, where clippy.toml's test exemption does
// not reach; in a test a failed unwrap is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use ditstream_denoiser::text::{
    PromptTokenizer, T5Encoder, TextEncoder, TextError, relative_position_bucket,
};
use ditstream_kernels::testing::{assert_close, max_abs_diff};
use ditstream_kernels::{DType, Device, Tensor};
use safetensors::{Dtype, SafeTensors};

const ATOL: f32 = 1e-5;
const RTOL: f32 = 1e-4;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/text_umt5")
}

fn tokenizer_json() -> PathBuf {
    fixture_dir().join("tokenizer/tokenizer.json")
}

struct Io(Vec<u8>);

impl Io {
    fn load() -> Self {
        Io(std::fs::read(fixture_dir().join("io.safetensors")).unwrap())
    }

    fn view(&self, name: &str) -> (Dtype, Vec<usize>, Vec<u8>) {
        let st = SafeTensors::deserialize(&self.0).unwrap();
        let v = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        (v.dtype(), v.shape().to_vec(), v.data().to_vec())
    }

    fn f32(&self, name: &str) -> Tensor {
        let (dtype, shape, data) = self.view(name);
        assert_eq!(dtype, Dtype::F32, "{name}");
        let values = data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Tensor::from_vec(values, &shape).unwrap()
    }

    /// An int64 tensor as (values, shape).
    fn i64(&self, name: &str) -> (Vec<i64>, Vec<usize>) {
        let (dtype, shape, data) = self.view(name);
        assert_eq!(dtype, Dtype::I64, "{name}");
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

#[test]
fn token_ids_and_masks_match_transformers() {
    let io = Io::load();
    let prompts = prompts();
    for max_len in [16, 64] {
        let tok = PromptTokenizer::from_file(&tokenizer_json(), max_len).unwrap();
        let (ids, shape) = io.i64(&format!("umt5.max{max_len}.input_ids"));
        let (mask, _) = io.i64(&format!("umt5.max{max_len}.attention_mask"));
        assert_eq!(shape, [prompts.len(), max_len]);
        for (b, prompt) in prompts.iter().enumerate() {
            let t = tok.tokenize(prompt).unwrap();
            let row = b * max_len..(b + 1) * max_len;
            let want_ids: Vec<u32> = ids[row.clone()].iter().map(|&i| i as u32).collect();
            let want_mask: Vec<u32> = mask[row].iter().map(|&m| m as u32).collect();
            assert_eq!(t.ids, want_ids, "ids of {prompt:?} at max {max_len}");
            assert_eq!(t.attention_mask, want_mask, "mask of {prompt:?}");
            assert_eq!(t.len, want_mask.iter().sum::<u32>() as usize);
        }
    }
    // The cases cover what they claim: "" is `</s>` alone, the long prompt is cut with `</s>` kept,
    // the emoji is `<unk>` (2).
    let tok = PromptTokenizer::from_file(&tokenizer_json(), 16).unwrap();
    assert_eq!(tok.tokenize("").unwrap().real_ids(), [1]);
    let long = tok.tokenize(&prompts[3]).unwrap();
    assert_eq!((long.len, long.ids[15]), (16, 1));
    assert!(tok.tokenize("🎹").unwrap().real_ids().contains(&2));
}

#[test]
fn buckets_match_transformers() {
    let io = Io::load();
    let (rel, _) = io.i64("relative_positions");
    for (buckets, distance) in [(32, 128), (10, 20)] {
        let (want, _) = io.i64(&format!("buckets_{buckets}_{distance}"));
        for (&r, &w) in rel.iter().zip(&want) {
            assert_eq!(
                relative_position_bucket(r, buckets, distance),
                w as usize,
                "relative position {r}, ({buckets}, {distance})"
            );
        }
    }
}

/// The raw `last_hidden_state` of a padded batch with its attention mask, padded rows included.
fn check_raw_states(kind: &str, encoder_dir: &str) {
    let io = Io::load();
    let encoder =
        T5Encoder::from_dir(&fixture_dir().join(encoder_dir), DType::F32, Device::Cpu).unwrap();
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
        let want = io.f32(&format!("{case}.raw"));
        eprintln!(
            "{case}: max |ours − transformers| = {:e}",
            max_abs_diff(&ours, &want).unwrap()
        );
        assert_close(&ours, &want, ATOL, RTOL);
    }
}

#[test]
fn umt5_states_match_transformers() {
    check_raw_states("umt5", "text_encoder");
}

#[test]
fn t5_states_match_transformers() {
    // T5: the bias table of layer 0 serves every layer.
    check_raw_states("t5", "text_encoder_t5");
}

fn text_encoder(encoder_dir: &str, max_len: usize) -> TextEncoder {
    let tokenizer = PromptTokenizer::from_file(&tokenizer_json(), max_len).unwrap();
    let encoder =
        T5Encoder::from_dir(&fixture_dir().join(encoder_dir), DType::F32, Device::Cpu).unwrap();
    TextEncoder::new(tokenizer, encoder).unwrap()
}

#[test]
fn prompt_embeds_match_the_wan_pipeline() {
    let io = Io::load();
    let prompts = prompts();
    let refs: Vec<&str> = prompts.iter().map(String::as_str).collect();
    for (kind, dir) in [("umt5", "text_encoder"), ("t5", "text_encoder_t5")] {
        for max_len in [16, 64] {
            let case = format!("{kind}.max{max_len}");
            let out = text_encoder(dir, max_len).encode(&refs).unwrap();
            let want = io.f32(&format!("{case}.prompt_embeds"));
            let (mask, _) = io.i64(&format!("{case}.attention_mask"));
            let want_lens: Vec<usize> = mask
                .chunks_exact(max_len)
                .map(|row| row.iter().sum::<i64>() as usize)
                .collect();
            assert_eq!(out.lengths, want_lens, "{case}");
            eprintln!(
                "{case}: max |ours − pipeline| = {:e}",
                max_abs_diff(&out.states, &want).unwrap()
            );
            assert_close(&out.states, &want, ATOL, RTOL);
            // Rows past each prompt's length are exactly zero, as the pipeline's `new_zeros`.
            let d = out.states.shape()[2];
            let v = out.states.to_vec_f32().unwrap();
            for (b, &len) in out.lengths.iter().enumerate() {
                let tail = &v[(b * max_len + len) * d..(b + 1) * max_len * d];
                assert!(tail.iter().all(|&x| x == 0.0), "{case} prompt {b}");
            }
        }
        // Wan's own maximum for a short prompt: 13 token rows, then 499 zero rows.
        let out = text_encoder(dir, 512).encode(&[refs[1]]).unwrap();
        let want = io.f32(&format!("{kind}.max512.prompt_embeds"));
        assert_eq!(out.states.shape(), [1, 512, want.shape()[2]]);
        assert_close(&out.states, &want, ATOL, RTOL);
    }
}

#[test]
fn repeated_prompts_hit_the_cache() {
    let text = text_encoder("text_encoder", 64);
    let negative = "Bright colors, overexposed, static, blurred details";
    let first = text.encode(&["A cat plays the piano.", negative]).unwrap();
    let stats = text.cache_stats();
    assert_eq!((stats.hits, stats.misses, stats.entries), (0, 2, 2));
    // A new prompt with the same negative prompt: one miss, one hit.
    let second = text.encode(&["A red fox in the snow.", negative]).unwrap();
    let stats = text.cache_stats();
    assert_eq!((stats.hits, stats.misses, stats.entries), (1, 3, 3));
    let neg_first = first.states.narrow(0, 1, 1).unwrap().to_vec_f32().unwrap();
    let neg_second = second.states.narrow(0, 1, 1).unwrap().to_vec_f32().unwrap();
    assert_eq!(neg_first, neg_second);
    // The cached answer equals a fresh encode.
    let uncached = text_encoder("text_encoder", 64).with_cache_capacity(0);
    let fresh = uncached.encode(&[negative]).unwrap();
    assert_eq!(fresh.states.to_vec_f32().unwrap(), neg_second);
    assert_eq!(uncached.cache_stats().entries, 0);
}

/// A scratch folder under the system temp dir, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("ditstream-text-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    /// A copy of the fixture's umT5 encoder folder.
    fn with_encoder(name: &str) -> Self {
        let s = Scratch::new(name);
        for file in ["config.json", "model.safetensors"] {
            std::fs::copy(
                fixture_dir().join("text_encoder").join(file),
                s.0.join(file),
            )
            .unwrap();
        }
        s
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Every tensor of the fixture's umT5 checkpoint as (name, dtype, shape, bytes).
fn checkpoint_tensors() -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(fixture_dir().join("text_encoder/model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| (name, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn write_safetensors(path: &Path, tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap();
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn sharded_checkpoint_loads_like_the_single_file() {
    let scratch = Scratch::new("sharded");
    std::fs::copy(
        fixture_dir().join("text_encoder/config.json"),
        scratch.0.join("config.json"),
    )
    .unwrap();
    let tensors = checkpoint_tensors();
    let (first, second) = tensors.split_at(tensors.len() / 2);
    let shards = [
        ("model-00001-of-00002.safetensors", first),
        ("model-00002-of-00002.safetensors", second),
    ];
    let mut weight_map = serde_json::Map::new();
    for (file, part) in shards {
        write_safetensors(&scratch.0.join(file), part);
        for (name, ..) in part {
            weight_map.insert(name.clone(), file.into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    let index_path = scratch.0.join("model.safetensors.index.json");
    std::fs::write(&index_path, index.to_string()).unwrap();

    let sharded = T5Encoder::from_dir(&scratch.0, DType::F32, Device::Cpu).unwrap();
    let single =
        T5Encoder::from_dir(&fixture_dir().join("text_encoder"), DType::F32, Device::Cpu).unwrap();
    let ids = [24u32, 37, 9, 1];
    assert_eq!(
        sharded
            .forward(&ids, [1, 4], &[4])
            .unwrap()
            .to_vec_f32()
            .unwrap(),
        single
            .forward(&ids, [1, 4], &[4])
            .unwrap()
            .to_vec_f32()
            .unwrap()
    );

    // An index naming a shard that is not there: the error names the shard.
    std::fs::remove_file(scratch.0.join(shards[1].0)).unwrap();
    let e = T5Encoder::from_dir(&scratch.0, DType::F32, Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains(shards[1].0), "{e}");
    // A malformed index names the index.
    std::fs::write(&index_path, "{\"weight_map\": 3}").unwrap();
    let e = T5Encoder::from_dir(&scratch.0, DType::F32, Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("model.safetensors.index.json"), "{e}");
}

fn encoder_error(dir: &Path) -> String {
    match T5Encoder::from_dir(dir, DType::F32, Device::Cpu) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn broken_tokenizer_files_are_named() {
    let scratch = Scratch::new("tokenizer");
    let missing = scratch.0.join("tokenizer.json");
    let e = PromptTokenizer::from_file(&missing, 16).err().unwrap();
    assert!(matches!(e, TextError::Io { .. }), "{e}");
    assert!(e.to_string().contains("tokenizer.json"), "{e}");

    std::fs::write(&missing, "{\"version\": \"1.0\", \"model\": 42}").unwrap();
    let e = PromptTokenizer::from_file(&missing, 16).err().unwrap();
    assert!(matches!(e, TextError::Tokenizer { .. }), "{e}");
    assert!(e.to_string().contains("tokenizer.json"), "{e}");

    // The whole checkpoint: a folder without `tokenizer/` names the tokenizer file.
    let e = TextEncoder::from_pretrained(&scratch.0, 16).err().unwrap();
    assert!(e.to_string().contains("tokenizer/tokenizer.json"), "{e}");
}

#[test]
fn broken_encoder_folders_are_named() {
    // No config.json.
    let s = Scratch::with_encoder("no-config");
    std::fs::remove_file(s.0.join("config.json")).unwrap();
    let e = encoder_error(&s.0);
    assert!(e.contains("config.json"), "{e}");

    // config.json that is not JSON, and one with a bad value.
    let s = Scratch::with_encoder("bad-config");
    std::fs::write(s.0.join("config.json"), "{ not json").unwrap();
    let e = encoder_error(&s.0);
    assert!(e.contains("config.json") && e.contains("JSON"), "{e}");
    let config = std::fs::read_to_string(fixture_dir().join("text_encoder/config.json")).unwrap();
    std::fs::write(
        s.0.join("config.json"),
        config.replace("\"d_model\": 64", "\"d_model\": -1"),
    )
    .unwrap();
    let e = encoder_error(&s.0);
    assert!(e.contains("config.json") && e.contains("d_model"), "{e}");

    // No weights at all.
    let s = Scratch::with_encoder("no-weights");
    std::fs::remove_file(s.0.join("model.safetensors")).unwrap();
    let e = encoder_error(&s.0);
    assert!(e.contains("model.safetensors"), "{e}");

    // Weights that are not safetensors.
    let s = Scratch::with_encoder("garbage-weights");
    std::fs::write(s.0.join("model.safetensors"), b"\x08\0\0\0\0\0\0\0garbage!").unwrap();
    let e = encoder_error(&s.0);
    assert!(
        e.contains("model.safetensors") && e.contains("safetensors file"),
        "{e}"
    );

    // A tensor missing, and a tensor of the wrong shape: both named with the file.
    let s = Scratch::with_encoder("missing-tensor");
    let name = "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight";
    let tensors: Vec<_> = checkpoint_tensors()
        .into_iter()
        .filter(|t| t.0 != name)
        .collect();
    write_safetensors(&s.0.join("model.safetensors"), &tensors);
    let e = encoder_error(&s.0);
    assert!(
        e.contains(name) && e.contains("missing") && e.contains("model.safetensors"),
        "{e}"
    );

    let mut tensors = checkpoint_tensors();
    let q = "encoder.block.0.layer.0.SelfAttention.q.weight";
    let entry = tensors.iter_mut().find(|t| t.0 == q).unwrap();
    entry.2 = vec![entry.2[1], entry.2[0]]; // [48, 64] stored as [64, 48]
    write_safetensors(&s.0.join("model.safetensors"), &tensors);
    let e = encoder_error(&s.0);
    assert!(
        e.contains(q) && e.contains("[64, 48]") && e.contains("[48, 64]"),
        "{e}"
    );
}

#[test]
fn tokenizer_larger_than_the_embedding_is_refused() {
    // The T5 fixture's table has 320 rows; a tokenizer of 209 fits, so build a mismatch from the
    // tiny config instead: the fixture's tokenizer against a 100-row random encoder.
    let mut config = ditstream_denoiser::text::T5Config::tiny();
    config.vocab_size = 100;
    let encoder = T5Encoder::random(&config, 0, DType::F32, Device::Cpu).unwrap();
    let tokenizer = PromptTokenizer::from_file(&tokenizer_json(), 16).unwrap();
    let e = TextEncoder::new(tokenizer, encoder).err().unwrap();
    assert!(
        matches!(
            e,
            TextError::VocabMismatch {
                tokenizer: 209,
                encoder: 100
            }
        ),
        "{e}"
    );
}
