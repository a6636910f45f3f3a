//! Prompt text → the conditioning states Wan's DiT cross-attends to: the umT5 tokenizer and encoder,
//! laid out exactly as diffusers' `WanPipeline._get_t5_prompt_embeds` lays them out.
//!
//! The pipeline's path, and where each step lives:
//! 1. `prompt_clean` (HTML unescape, whitespace collapse), tokenise with `</s>` appended, truncate to
//!    `max_len` (512 for Wan) keeping `</s>`, pad with `<pad>` — [`tokenizer`].
//! 2. The umT5 encoder's last hidden states — [`t5`] (T5 and umT5; config in [`config`], weights by
//!    checkpoint name in `checkpoint`).
//! 3. The states of the real tokens kept, the rest set to zero: [B, max_len, d_model] — [`TextEncoder`].
//!
//! Because padded keys get zero attention weight, a prompt's real-token states do not depend on how
//! much padding follows; [`TextEncoder`] therefore encodes each prompt at its real length (no padded
//! positions at all) and caches the result by prompt text ([`CacheStats`]), so the default negative
//! prompt is encoded once per process.
//!
//! Devices: the encoder runs where its weights live (CPU or one GPU, f32 or bf16) and the states stay
//! there — the denoiser consumes them on its device. The host only tokenises and decides the layout
//! (which rows are real, which are zeros); the zero rows come from a device-resident block made once.

mod cache;
pub mod config;
pub mod t5;
pub mod tokenizer;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ditstream_kernels::{DType, Device, KernelError, Tensor};

pub use cache::CacheStats;
pub use config::{T5Activation, T5Config, T5Variant};
pub use t5::{T5Encoder, relative_buckets, relative_position_bucket};
pub use tokenizer::{PromptTokenizer, TokenizedPrompt, prompt_clean};

use cache::{CachedPrompt, PromptCache};

/// Wan's prompt length in tokens (`max_sequence_length` of the Wan pipelines).
pub const WAN_MAX_LEN: usize = 512;

/// The tokenizer of the built-in tiny model: the `text_umt5` test fixture's `tokenizer.json`, a
/// SentencePiece-style Unigram of 209 tokens (pad 0, `</s>` 1, unk 2) trained by
/// `scripts/make_fixtures.py text` on a few dozen English, French, German, Spanish, Japanese and Chinese
/// prompts. Unseen characters (e.g. emoji) become `<unk>`.
const TINY_TOKENIZER_JSON: &str =
    include_str!("../../tests/fixtures/text_umt5/tokenizer/tokenizer.json");

/// Errors of the text path. Each names the file, tensor, key or prompt at fault.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A file could not be read (missing, unreadable).
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// `config.json` is malformed or has a value outside its rule.
    #[error("{path}: `{key}` {message}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// The key at fault (`(file)` when the file itself is not JSON).
        key: String,
        /// The value and the rule.
        message: String,
    },
    /// The weights are missing, malformed, or a tensor is absent or misshapen (names the file
    /// and the tensor).
    #[error(transparent)]
    Weights(#[from] ditstream_kernels::weights::WeightsError),
    /// `tokenizer.json` cannot be parsed or lacks what the pipeline needs.
    #[error("{path}: not a usable tokenizer: {message}")]
    Tokenizer {
        /// The tokenizer file (or an origin like `<built-in tiny>`).
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// Tokenising a prompt failed.
    #[error("tokenizing prompt {prompt:?}: {message}")]
    Encode {
        /// The prompt.
        prompt: String,
        /// The tokenizer's message.
        message: String,
    },
    /// The tokenizer can produce ids the encoder's embedding table does not have.
    #[error("the tokenizer has {tokenizer} tokens but the encoder's embedding only {encoder} rows")]
    VocabMismatch {
        /// Tokens of the tokenizer (added tokens included).
        tokenizer: usize,
        /// Rows of `shared.weight`.
        encoder: usize,
    },
    /// Inputs to the encoder break its contract.
    #[error("encoder input: {message}")]
    Input {
        /// The values and the rule.
        message: String,
    },
    /// A tensor op failed.
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

/// Encoded prompts in the pipeline's layout.
#[derive(Debug, Clone)]
pub struct PromptEmbeds {
    /// [B, max_len, d_model] in the encoder's dtype on its device: each prompt's real-token states,
    /// then zero rows.
    pub states: Tensor,
    /// `[B]` real tokens per prompt (`</s>` included; ≤ max_len).
    pub lengths: Vec<usize>,
}

/// Tokenizer + encoder + prompt cache: prompts in, [B, max_len, d_model] conditioning out.
pub struct TextEncoder {
    tokenizer: PromptTokenizer,
    encoder: T5Encoder,
    cache: Mutex<PromptCache>,
    /// [max_len, d_model] zeros on the encoder's device, in its dtype: the padding rows are cut from
    /// it, so assembling a batch never uploads zeros from the host.
    zeros: Tensor,
}

impl TextEncoder {
    /// Prompts kept by the cache unless [`with_cache_capacity`](Self::with_cache_capacity) says otherwise.
    pub const DEFAULT_CACHE_CAPACITY: usize = 32;

    /// Pairs a tokenizer with an encoder; every id the tokenizer can emit must have an embedding row.
    pub fn new(tokenizer: PromptTokenizer, encoder: T5Encoder) -> Result<Self, TextError> {
        let (tokens, rows) = (tokenizer.vocab_size(), encoder.config().vocab_size);
        if tokens > rows {
            return Err(TextError::VocabMismatch {
                tokenizer: tokens,
                encoder: rows,
            });
        }
        let zeros = Tensor::zeros(
            &[tokenizer.max_len(), encoder.config().d_model],
            encoder.dtype(),
            encoder.device(),
        )?;
        Ok(TextEncoder {
            tokenizer,
            encoder,
            cache: Mutex::new(PromptCache::new(Self::DEFAULT_CACHE_CAPACITY)),
            zeros,
        })
    }

    /// From a diffusers checkpoint folder as the Wan repositories ship it: `tokenizer/tokenizer.json`
    /// and `text_encoder/` (`config.json`, `model.safetensors` or a sharded index), on the CPU in f32.
    pub fn from_pretrained(root: &Path, max_len: usize) -> Result<Self, TextError> {
        Self::from_pretrained_on(root, max_len, DType::F32, Device::Cpu)
    }

    /// [`from_pretrained`](Self::from_pretrained) with the encoder's weights (and so its states) stored
    /// as `dtype` on `device`.
    pub fn from_pretrained_on(
        root: &Path,
        max_len: usize,
        dtype: DType,
        device: Device,
    ) -> Result<Self, TextError> {
        let tokenizer =
            PromptTokenizer::from_file(&root.join("tokenizer").join("tokenizer.json"), max_len)?;
        let encoder = T5Encoder::from_dir(&root.join("text_encoder"), dtype, device)?;
        Self::new(tokenizer, encoder)
    }

    /// The built-in tiny model of the embedded default (no files needed): the tiny umT5 of
    /// [`T5Config::tiny`] (width 64) with seeded random weights ([`T5Encoder::random`]) and the embedded
    /// tokenizer (see `TINY_TOKENIZER_JSON` in this file's source), prompts padded to Wan's 512 tokens.
    /// The states are noise, the path is the real one.
    pub fn tiny(seed: u64) -> Result<Self, TextError> {
        let tokenizer = PromptTokenizer::from_json_bytes(
            TINY_TOKENIZER_JSON.as_bytes(),
            WAN_MAX_LEN,
            "<built-in tiny tokenizer>",
        )?;
        let encoder = T5Encoder::random(&T5Config::tiny(), seed, DType::F32, Device::Cpu)?;
        Self::new(tokenizer, encoder)
    }

    /// The same encoder with a cache of `capacity` prompts (0 turns caching off). Empties the cache.
    pub fn with_cache_capacity(self, capacity: usize) -> Self {
        TextEncoder {
            cache: Mutex::new(PromptCache::new(capacity)),
            ..self
        }
    }

    /// The tokenizer (with its `max_len`).
    pub fn tokenizer(&self) -> &PromptTokenizer {
        &self.tokenizer
    }

    /// The encoder.
    pub fn encoder(&self) -> &T5Encoder {
        &self.encoder
    }

    /// Width of the output states (`d_model`; the DiT's `text_dim`).
    pub fn d_model(&self) -> usize {
        self.encoder.config().d_model
    }

    /// Cache hits and misses so far.
    pub fn cache_stats(&self) -> CacheStats {
        self.lock_cache().stats()
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, PromptCache> {
        // A panic while holding the lock cannot leave the cache half-updated (each method makes one
        // whole change), so a poisoned lock is still usable.
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The pipeline's `_get_t5_prompt_embeds` for these prompts:
    /// prompts `[B]` → states [B, max_len, d_model] in the encoder's dtype on its device (real-token
    /// states, then zeros) and the real lengths. Prompts seen recently come from the cache.
    pub fn encode(&self, prompts: &[&str]) -> Result<PromptEmbeds, TextError> {
        let max_len = self.tokenizer.max_len();
        let d = self.d_model();
        let (dtype, device) = (self.encoder.dtype(), self.encoder.device());
        let mut pieces = Vec::with_capacity(2 * prompts.len());
        let mut lengths = Vec::with_capacity(prompts.len());
        for prompt in prompts {
            let cached = self.lock_cache().get(prompt);
            let encoded = match cached {
                Some(hit) => hit,
                None => {
                    let fresh = Arc::new(self.encode_one(prompt)?);
                    self.lock_cache().insert(prompt, Arc::clone(&fresh));
                    fresh
                }
            };
            if encoded.len > 0 {
                pieces.push(encoded.states.clone());
            }
            if encoded.len < max_len {
                pieces.push(self.zeros.narrow(0, 0, max_len - encoded.len)?);
            }
            lengths.push(encoded.len);
        }
        let states = if pieces.is_empty() {
            Tensor::zeros(&[0, max_len, d], dtype, device)?
        } else {
            Tensor::concat(&pieces.iter().collect::<Vec<_>>(), 0)?.reshape(&[
                prompts.len(),
                max_len,
                d,
            ])?
        };
        Ok(PromptEmbeds { states, lengths })
    }

    /// One prompt at its real length (no padding): states [len, d_model].
    fn encode_one(&self, prompt: &str) -> Result<CachedPrompt, TextError> {
        let tokens = self.tokenizer.tokenize(prompt)?;
        let len = tokens.len;
        let states = if len == 0 {
            self.zeros.narrow(0, 0, 0)?
        } else {
            self.encoder
                .forward(tokens.real_ids(), [1, len], &[len])?
                .reshape(&[len, self.d_model()])?
        };
        Ok(CachedPrompt { states, len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_encodes_without_files_and_caches() {
        let text = TextEncoder::tiny(0).unwrap();
        let out = text.encode(&["a cat", "", "a cat"]).unwrap();
        assert_eq!(out.states.shape(), [3, WAN_MAX_LEN, 64]);
        // "" is `</s>` alone.
        assert_eq!(out.lengths[1], 1);
        let v = out.states.to_vec_f32().unwrap();
        let row = |b: usize, s: usize| &v[(b * WAN_MAX_LEN + s) * 64..][..64];
        assert!(row(0, 0).iter().any(|&x| x != 0.0));
        assert!(row(0, out.lengths[0]).iter().all(|&x| x == 0.0));
        assert_eq!(row(0, 0), row(2, 0));
        let stats = text.cache_stats();
        assert_eq!((stats.hits, stats.misses, stats.entries), (1, 2, 2));
        // Seeded: the same seed gives the same states.
        let again = TextEncoder::tiny(0).unwrap().encode(&["a cat"]).unwrap();
        assert_eq!(
            again.states.to_vec_f32().unwrap(),
            v[..WAN_MAX_LEN * 64].to_vec()
        );
    }
}
