//! The deployment config: one YAML file per deployment shape (see `configs/`), parsed with
//! `serde_yaml_ng` and validated before any work starts.
//!
//! Every struct rejects unknown keys, and every validation error names the key, the value and the
//! rule it broke, in one line, so an operator can fix a file without reading code.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::mesh::{CpLayout, LatentGeometry, Mesh, VaeLayout, VideoShape};

/// Why a config could not be used. Each variant's message is one line naming the key and value.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Io {
        /// The file that was asked for.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The YAML is malformed or does not fit the schema (unknown key, wrong type).
    #[error("{origin}: {message}")]
    Parse {
        /// The file name, or `<string>`.
        origin: String,
        /// serde's message: names the key path, and the line and column.
        message: String,
    },
    /// A value breaks a rule.
    #[error("{key} = {value}: {rule}")]
    Invalid {
        /// Dotted path of the key, e.g. `parallel_config.ulysses_size`.
        key: &'static str,
        /// The offending value as written.
        value: String,
        /// The rule, phrased so the fix is obvious.
        rule: String,
    },
}

fn invalid(key: &'static str, value: impl fmt::Display, rule: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key,
        value: value.to_string(),
        rule: rule.into(),
    }
}

/// The whole deployment config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Which model, where its weights come from, and the compute dtype.
    pub model: ModelConfig,
    /// How the denoiser pool's ranks and the decoder pool's VAE ranks are laid out.
    #[serde(default)]
    pub parallel_config: ParallelConfig,
    /// Attention kernel choice.
    #[serde(default)]
    pub attention: AttentionConfig,
    /// The CUDA backend's settings (kernel cache, headers, cuDNN algorithm search).
    #[serde(default)]
    pub cuda: CudaSettings,
    /// Scheduler defaults for requests that do not set them.
    #[serde(default)]
    pub sampler: SamplerConfig,
    /// Where the service listens, which device it runs on, and its request limits.
    #[serde(default)]
    pub serving: ServingConfig,
    /// The disaggregated deployment: where the pools listen, find the gateway, and their TLS
    /// identities for the control plane and the latent link.
    #[serde(default)]
    pub pools: PoolsConfig,
    /// Limits every listener of this process applies to its connections.
    #[serde(default)]
    pub connections: ConnectionLimits,
    /// The folder relative paths in the file start from (the file's own folder; the working
    /// directory for a config parsed from a string).
    #[serde(skip)]
    pub base_dir: PathBuf,
}

/// `connections:`: what every listener (the public API, the gateway's registry, each pool's
/// service) allows a connection, so no client can hold a server's sockets or memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConnectionLimits {
    /// Open connections per listener; beyond it a new connection is refused at once (HTTP/2
    /// GOAWAY `ENHANCE_YOUR_CALM` naming the limit, on plaintext listeners; closed on TLS ones).
    pub max_connections: usize,
    /// Seconds a new connection has for its TLS handshake and the HTTP/2 preface.
    pub handshake_timeout_s: f64,
    /// Seconds a connection may stay open with no request in flight.
    pub idle_timeout_s: f64,
    /// Seconds a call's request body (its gRPC message, an HTTP body) has to arrive in full
    /// once its headers have; a slower one ends the call with DEADLINE_EXCEEDED (HTTP 408).
    pub request_timeout_s: f64,
    /// Seconds a response may wait for the client to read (an HTTP/2 window left at 0, a
    /// socket left full) before the connection is closed; a `Generate` whose client reads
    /// nothing loses its request sooner, at `serving.client_send_timeout_s`.
    pub send_timeout_s: f64,
    /// Seconds between HTTP/2 keepalive pings on a connection.
    pub keepalive_interval_s: f64,
    /// Seconds a ping may go unanswered before the connection is closed as dead.
    pub keepalive_timeout_s: f64,
    /// Concurrent HTTP/2 streams (calls) per connection (`SETTINGS_MAX_CONCURRENT_STREAMS`);
    /// streams beyond it are refused (`REFUSED_STREAM`).
    pub max_streams: u32,
    /// Largest request message, in bytes (larger ones get RESOURCE_EXHAUSTED); request headers
    /// are capped at 16 KiB.
    pub max_request_bytes: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: 4096,
            handshake_timeout_s: 10.0,
            idle_timeout_s: 300.0,
            request_timeout_s: 30.0,
            send_timeout_s: 30.0,
            keepalive_interval_s: 30.0,
            keepalive_timeout_s: 20.0,
            max_streams: 64,
            max_request_bytes: 1 << 20,
        }
    }
}

/// `serving.tls`: the public API's certificate (chain) and private key, PEM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// Certificate chain (PEM), relative to the config file's folder.
    pub cert: String,
    /// Private key (PEM).
    pub key: String,
}

/// `serving.per_key`: what one API key may have in flight (unset: only the global limits).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct PerKeyLimits {
    /// Requests of one key denoising or decoding at once; more wait in the queue.
    pub max_running: Option<usize>,
    /// Requests of one key waiting in the queue; beyond it admission answers
    /// RESOURCE_EXHAUSTED naming this key.
    pub max_queued: Option<usize>,
}

/// Transport of the latent link between denoiser and decoder pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LinkKind {
    /// QUIC with mutual TLS (quinn): any IP network.
    #[default]
    Quic,
    /// UCX active messages (builds with `--features ucx`): RDMA-capable fabrics.
    Ucx,
    /// NCCL point-to-point, GPU to GPU (builds with `--features cuda`; both pools on GPUs):
    /// NVLink within a node. Chunk headers travel over QUIC beside it.
    Nccl,
}

/// `pools:` section, read by `ditstream gateway`, `denoiser` and `decoder`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolsConfig {
    /// Where the gateway's pool registry listens (mutual TLS, certificates from `tls_ca`): a
    /// listener of its own, apart from the public API.
    pub registry_listen: String,
    /// Where pools reach the registry (the gateway's `registry_listen` as seen from the pools;
    /// its host must be on the gateway's certificate).
    pub gateway: String,
    /// A denoiser pool's gRPC address (port 0: any free port; the pool registers the real one).
    pub denoiser_listen: String,
    /// A decoder instance's gRPC address.
    pub decoder_listen: String,
    /// The latent link's transport, chosen by each decoder instance (denoisers follow it).
    pub link: LinkKind,
    /// A decoder instance's latent-link address.
    pub link_listen: String,
    /// The host name or IP on the decoders' certificate, which denoisers check.
    pub link_host: String,
    /// Seconds without a heartbeat after which the gateway drops a pool.
    pub heartbeat_timeout_s: u64,
    /// The pool CA certificate (PEM): every internal hop (registry, pool services, latent link)
    /// accepts only peers whose certificate it signed.
    pub tls_ca: String,
    /// This member's certificate (PEM), presented on every internal hop; it must name the
    /// addresses the member registers (its gRPC host and, for a decoder, `link_host`).
    pub tls_cert: String,
    /// Its private key (PEM).
    pub tls_key: String,
}

impl Default for PoolsConfig {
    fn default() -> Self {
        PoolsConfig {
            registry_listen: "127.0.0.1:50052".to_string(),
            gateway: "127.0.0.1:50052".to_string(),
            denoiser_listen: "127.0.0.1:0".to_string(),
            decoder_listen: "127.0.0.1:0".to_string(),
            link: LinkKind::Quic,
            link_listen: "127.0.0.1:0".to_string(),
            link_host: "localhost".to_string(),
            heartbeat_timeout_s: 5,
            tls_ca: "certs/ca.pem".to_string(),
            tls_cert: "certs/pool.pem".to_string(),
            tls_key: "certs/pool-key.pem".to_string(),
        }
    }
}

/// Built-in model presets: transformer dimensions known without reading a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Preset {
    /// The built-in tiny model of the embedded default (random weights; CPU-friendly).
    #[serde(rename = "tiny")]
    Tiny,
    /// Wan2.1-T2V-1.3B.
    #[serde(rename = "wan2.1-t2v-1.3b")]
    Wan21T2v1_3b,
    /// Wan2.1-T2V-14B.
    #[serde(rename = "wan2.1-t2v-14b")]
    Wan21T2v14b,
    /// Wan2.2-T2V-A14B (two 14B experts).
    #[serde(rename = "wan2.2-t2v-a14b")]
    Wan22T2vA14b,
    /// Wan2.2-TI2V-5B.
    #[serde(rename = "wan2.2-ti2v-5b")]
    Wan22Ti2v5b,
}

impl Preset {
    /// Every preset, in the order `ditstream plan` lists them.
    pub const ALL: [Preset; 5] = [
        Preset::Tiny,
        Preset::Wan21T2v1_3b,
        Preset::Wan21T2v14b,
        Preset::Wan22T2vA14b,
        Preset::Wan22Ti2v5b,
    ];

    /// The preset's row of the table: everything the crates know about a built-in model
    /// without reading a checkpoint (reference/wan.md §1.1).
    pub fn spec(self) -> &'static PresetSpec {
        // The variants are declared in the table's order (a test checks every row's name).
        &PRESETS[self as usize]
    }

    /// The name used in YAML and on the wire.
    pub fn name(self) -> &'static str {
        self.spec().name
    }

    /// Self-attention heads of the transformer (`num_attention_heads`).
    pub fn num_heads(self) -> usize {
        self.spec().heads
    }
}

/// The VAE a preset decodes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PresetVae {
    /// The Wan 2.1 VAE's topology at base width 16 (the real one is 96): the embedded default's.
    Tiny,
    /// The Wan 2.1 VAE (z 16, 8×8 spatial, 4× temporal).
    Wan21,
    /// The Wan 2.2 VAE (z 48, 16×16 spatial, 4× temporal).
    Wan22,
}

impl PresetVae {
    /// How this VAE maps video to latents (under Wan's 1×2×2 patch).
    pub fn geometry(self) -> LatentGeometry {
        match self {
            PresetVae::Tiny | PresetVae::Wan21 => LatentGeometry::WAN21,
            PresetVae::Wan22 => LatentGeometry::WAN22,
        }
    }
}

/// One built-in model, as the transformer, the text encoder and the VAE are built for it; every
/// crate reads a preset's numbers from here ([`Preset::spec`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PresetSpec {
    /// The name used in YAML and on the wire.
    pub name: &'static str,
    /// Self-attention heads (head dim 128 throughout).
    pub heads: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// The feed-forward's hidden width.
    pub ffn_dim: usize,
    /// Latent channels in and out of the transformer (the VAE's z).
    pub latent_channels: usize,
    /// Width of the text encoder's states (umT5-XXL's 4096; the tiny encoder's 64).
    pub text_dim: usize,
    /// Transformers that share the steps (Wan 2.2 A14B: a high-noise and a low-noise expert).
    pub experts: usize,
    /// Whether the text encoder is the built-in tiny one (else umT5-XXL at its real size).
    pub tiny_text_encoder: bool,
    /// The VAE.
    pub vae: PresetVae,
    /// Whether random weights of this size may run on the CPU (only the tiny model is small
    /// enough to finish there).
    pub runs_on_cpu: bool,
}

/// The table, one row per [`Preset`] in [`Preset::ALL`]'s order.
const PRESETS: [PresetSpec; 5] = [
    PresetSpec {
        name: "tiny",
        // Head dim 128 like the real ones, so the tiny model exercises the same kernels.
        heads: 2,
        layers: 2,
        ffn_dim: 256,
        latent_channels: 16,
        text_dim: 64,
        experts: 1,
        tiny_text_encoder: true,
        vae: PresetVae::Tiny,
        runs_on_cpu: true,
    },
    PresetSpec {
        name: "wan2.1-t2v-1.3b",
        heads: 12,
        layers: 30,
        ffn_dim: 8960,
        latent_channels: 16,
        text_dim: 4096,
        experts: 1,
        tiny_text_encoder: false,
        vae: PresetVae::Wan21,
        runs_on_cpu: false,
    },
    PresetSpec {
        name: "wan2.1-t2v-14b",
        heads: 40,
        layers: 40,
        ffn_dim: 13824,
        latent_channels: 16,
        text_dim: 4096,
        experts: 1,
        tiny_text_encoder: false,
        vae: PresetVae::Wan21,
        runs_on_cpu: false,
    },
    PresetSpec {
        name: "wan2.2-t2v-a14b",
        heads: 40,
        layers: 40,
        ffn_dim: 13824,
        latent_channels: 16,
        text_dim: 4096,
        experts: 2,
        tiny_text_encoder: false,
        vae: PresetVae::Wan21,
        runs_on_cpu: false,
    },
    PresetSpec {
        name: "wan2.2-ti2v-5b",
        heads: 24,
        layers: 30,
        ffn_dim: 14336,
        latent_channels: 48,
        text_dim: 4096,
        experts: 1,
        tiny_text_encoder: false,
        vae: PresetVae::Wan22,
        runs_on_cpu: false,
    },
];

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Compute dtype of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 32-bit float: the CPU reference path.
    #[default]
    F32,
    /// bfloat16 storage with f32 accumulation: the GPU path.
    Bf16,
    /// bf16, with the transformer blocks' linear layers in FP8 (e4m3: weights quantised per
    /// output channel at load, activations per token on the fly; norms, modulation, embeddings,
    /// the head and the text encoder stay bf16). GPUs of compute capability 8.9 or later only
    /// (Ada, Hopper, Blackwell): refused on the CPU and on older GPUs.
    Fp8,
}

/// Where weights come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum WeightSource {
    /// Diffusers-format safetensors under `model.checkpoint`.
    Checkpoint,
    /// Seeded random weights of the preset's size (benchmarks, the embedded default).
    #[default]
    Random,
}

/// `model:` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// A built-in preset; with `weights: checkpoint` it may be left out and read from the checkpoint.
    #[serde(default)]
    pub preset: Option<Preset>,
    /// A diffusers checkpoint folder (the one holding `transformer/`, `vae/`, `text_encoder/`).
    #[serde(default)]
    pub checkpoint: Option<PathBuf>,
    /// Compute dtype.
    #[serde(default)]
    pub dtype: Dtype,
    /// Weight source.
    #[serde(default)]
    pub weights: WeightSource,
}

/// Which dimension of the latent the parallel VAE splits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum VaeSplitDim {
    /// Split along the latent height (rows).
    Height,
    /// Split along the latent width (columns); TensorRT-LLM's default.
    #[default]
    Width,
}

/// `parallel_config:` section; keys follow TensorRT-LLM VisualGen's `parallel_config`.
/// Sizes are signed so a negative value reaches validation, which names the key and the rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ParallelConfig {
    /// Classifier-free-guidance parallelism: 1, or 2 (the two branches on two halves of the mesh).
    pub cfg_size: i64,
    /// Tensor parallelism; only 1 is supported for now.
    pub tp_size: i64,
    /// Ulysses (all-to-all head/sequence) degree; must divide the head count.
    pub ulysses_size: i64,
    /// Ring attention degree; exclusive with `attn2d_size`.
    pub ring_size: i64,
    /// Attention2D grid `[row, col]`; exclusive with `ring_size`.
    pub attn2d_size: [i64; 2],
    /// Async Ulysses: each Ulysses all-to-all (V, then Q, then K) runs under the next projection
    /// (needs `ulysses_size > 1`; any inner Ring or Attention2D runs after the exchanges as usual).
    pub async_ulysses: bool,
    /// Ranks of one decoder instance (spatially sharded VAE); 1 = no parallel VAE.
    pub parallel_vae_size: i64,
    /// Which latent dimension the parallel VAE splits.
    pub parallel_vae_split_dim: VaeSplitDim,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig {
            cfg_size: 1,
            tp_size: 1,
            ulysses_size: 1,
            ring_size: 1,
            attn2d_size: [1, 1],
            async_ulysses: false,
            parallel_vae_size: 1,
            parallel_vae_split_dim: VaeSplitDim::Width,
        }
    }
}

/// Attention kernel choice (on GPUs; the CPU has one reference kernel).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum AttentionBackend {
    /// The fastest kernel that applies to each call: the Hopper wgmma kernel for bf16 at head dim
    /// 128 on sm_90a, else the tensor-core FlashAttention-2-class kernel for bf16 on sm_80+, else
    /// the portable one.
    #[default]
    Auto,
    /// The portable kernel (any GPU, dtype and head dim up to 512; f32 CUDA-core maths), for
    /// checking the faster ones.
    Portable,
}

/// `cuda:` section: the CUDA backend's settings, read with `serving.device: cuda`; the one place a
/// deployment sets them (no environment variable overrides them; the GPU scripts' `DITSTREAM_*`
/// variables set them for tests and benchmarks only, through their GPU gate).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct CudaSettings {
    /// Folder of the compiled kernels (CUBIN) cache, and of the cuBLASLt algorithms chosen; unset:
    /// `ditstream-kernels` in the temp dir, which a reboot may empty (the first request after it
    /// then compiles again).
    pub kernel_cache: Option<PathBuf>,
    /// Folder holding `cuda_bf16.h` for NVRTC; unset: `/usr/local/cuda/include` when it holds it.
    pub include_dir: Option<PathBuf>,
    /// How each convolution shape's cuDNN algorithm is chosen on first use: `find` measures
    /// every candidate (the default; ~20 s per GPU on the first 480p decode, decodes ~1.15×
    /// faster), `heuristic` ranks without running.
    pub cudnn_search: AlgoSearch,
    /// How each large GEMM shape's cuBLASLt algorithm is chosen on first use: `find` times the
    /// heuristic's first eight candidates on the call's buffers and keeps one that is clearly
    /// faster than its first (the default; up to ~1.5 s per shape, once per GPU model and cuBLASLt
    /// version: the choice is kept in the kernel cache), `heuristic` takes its first.
    pub gemm_search: AlgoSearch,
}

/// `cuda.cudnn_search` and `cuda.gemm_search`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum AlgoSearch {
    /// Run and time the candidates.
    #[default]
    Find,
    /// The library's heuristic ranking, nothing run.
    Heuristic,
}

/// `attention:` section.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct AttentionConfig {
    /// Which kernel runs self-attention.
    pub backend: AttentionBackend,
}

/// Flow-matching scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum SamplerKind {
    /// Flow-matching UniPC multistep (diffusers' default for Wan).
    #[default]
    Unipc,
    /// Flow-matching Euler.
    Euler,
}

/// `sampler:` section: defaults for requests that leave these unset.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SamplerConfig {
    /// Scheduler.
    pub kind: SamplerKind,
    /// Denoising steps.
    pub steps: usize,
    /// Flow shift (5.0 for 720p Wan2.1, 3.0 for 480p).
    pub shift: f64,
    /// CFG scale (for A14B: the high-noise expert's).
    pub guidance_scale: f64,
    /// CFG scale of the low-noise expert (A14B); defaults to `guidance_scale`.
    pub guidance_scale_2: Option<f64>,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            kind: SamplerKind::Unipc,
            steps: 50,
            shift: 5.0,
            guidance_scale: 5.0,
            guidance_scale_2: None,
        }
    }
}

/// Device family the pools run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// CPU threads, one per rank (the embedded default and CI).
    #[default]
    Cpu,
    /// One NVIDIA GPU per rank.
    Cuda,
}

/// H.264 encoder backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum EncoderKind {
    /// The vendored static openh264 (runs anywhere; the GPU hosts have no FFmpeg).
    #[default]
    Openh264,
    /// x264 through the system FFmpeg (binaries built with `--features ffmpeg`).
    X264,
}

/// `serving:` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServingConfig {
    /// gRPC listen address.
    pub listen: String,
    /// Device family.
    pub device: DeviceKind,
    /// With `device: cuda`: the GPU ordinals this process uses (CUDA's numbering, as
    /// `nvidia-smi -L` lists them under the process's `CUDA_VISIBLE_DEVICES`), one per rank:
    /// rank r of the denoiser mesh runs on `gpus[r]`, rank r of a decoder instance's VAE on
    /// `gpus[r]`, and `ditstream serve` puts both halves on the same list. Empty (the default):
    /// 0, 1, … as many as the process needs. Each GPU is listed at most once.
    pub gpus: Vec<usize>,
    /// Default video width in pixels (multiple of 16).
    pub width: usize,
    /// Default video height in pixels (multiple of 16).
    pub height: usize,
    /// Default frame count (4k+1).
    pub num_frames: usize,
    /// Frames per second of the output video.
    pub fps: u32,
    /// Largest accepted frame count.
    pub max_frames: usize,
    /// Largest accepted width or height in pixels.
    pub max_side: usize,
    /// Largest accepted step count.
    pub max_steps: usize,
    /// Largest accepted prompt, in bytes.
    pub max_prompt_bytes: usize,
    /// Requests that may wait for a denoiser before new ones are refused.
    pub queue_depth: usize,
    /// H.264 encoder backend.
    pub encoder: EncoderKind,
    /// Threads that encode segments beside the VAE, shared by a decoder instance's requests.
    /// Unset: one per core (at most 16). 0: segments encode on the VAE's thread, one after the
    /// other (the sequential path; same bytes, slower tail).
    pub encoder_threads: Option<usize>,
    /// Seconds a client may leave its stream unread (its window full) before it loses its
    /// request: the request is cancelled and its slot freed, so nobody else waits on it.
    pub client_send_timeout_s: f64,
    /// Longest deadline honoured, in seconds: a `grpc-timeout` beyond it is clamped to it.
    pub max_deadline_s: u64,
    /// Seconds a stopping server lets running requests finish before it cancels them.
    pub shutdown_grace_s: u64,
    /// What admission refuses as beyond the serving devices (see [`AdmissionConfig`]).
    pub admission: AdmissionConfig,
    /// TLS for the public API (unset: plaintext, allowed on loopback only).
    pub tls: Option<TlsFiles>,
    /// A file of API keys (`ditstream keys add`): each line `<name> sha256:<hex>`; reloaded on
    /// SIGHUP. Unset: no authentication (loopback only), every caller one principal.
    pub api_keys: Option<String>,
    /// Allows a non-loopback `listen` without `tls` and `api_keys` (logged as a warning).
    pub insecure: bool,
    /// Limits per API key.
    pub per_key: PerKeyLimits,
    /// Where the HTTP API keeps finished videos, and for how long.
    pub videos: VideoStore,
    /// Video shapes to run once at start, before the pools report ready, so that every kernel is
    /// compiled and every GEMM and convolution planned before the first request (a first decode
    /// at 480p otherwise pays ~12 s of cuDNN search). Unset: the default shape (`width`,
    /// `height`, `num_frames`) on GPUs, nothing on the CPU (nothing to plan there). A list:
    /// exactly those shapes (`[]`: none).
    pub warmup: Option<Vec<WarmupShape>>,
}

/// One `serving.warmup` entry: a video shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WarmupShape {
    /// Width in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
    /// Frames (4k+1).
    pub num_frames: usize,
}

/// `serving.videos`: the HTTP API's video files: a folder, bounded by count and bytes (the
/// oldest go first), each file kept `ttl_s` after it completes; a restart lists what is left.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VideoStore {
    /// The folder (relative to the config file's folder), made on first use.
    pub dir: String,
    /// Most videos kept.
    pub max_count: usize,
    /// Most bytes kept.
    pub max_bytes: u64,
    /// Seconds a finished video is kept (its `expires_at`).
    pub ttl_s: u64,
}

impl Default for VideoStore {
    fn default() -> Self {
        VideoStore {
            dir: "ditstream-videos".to_string(),
            max_count: 1000,
            max_bytes: 20 << 30,
            ttl_s: 24 * 3600,
        }
    }
}

/// `serving.admission`: the cost model that refuses, at once, a request the serving devices
/// cannot do. A request's cost is estimated from its tokens, frames and steps (see the
/// gateway's `cost` module); `None` takes the default for `serving.device`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdmissionConfig {
    /// Longest estimated run, in seconds, a request may need (denoise and decode).
    pub max_request_s: f64,
    /// Sustained dense throughput of one rank, in TFLOP/s (default: 0.01 on the CPU, which the
    /// 2-core build machine sustains on the tiny model's f32 reference ops; 400 on a GPU, an
    /// H200's measured bf16 DiT rate).
    pub device_tflops: Option<f64>,
    /// Memory one rank may fill with a request's activations, in GiB (default: 8 on the CPU,
    /// 100 on a GPU, an H200's 141 GB less the largest model and the workspaces).
    pub device_memory_gib: Option<f64>,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            max_request_s: 1800.0,
            device_tflops: None,
            device_memory_gib: None,
        }
    }
}

impl AdmissionConfig {
    /// One rank's throughput in FLOP/s on `device`.
    pub fn flops_per_s(&self, device: DeviceKind) -> f64 {
        let tflops = self.device_tflops.unwrap_or(match device {
            DeviceKind::Cpu => 0.01,
            DeviceKind::Cuda => 400.0,
        });
        tflops * 1e12
    }

    /// One rank's activation budget in bytes on `device`.
    pub fn memory_bytes(&self, device: DeviceKind) -> f64 {
        let gib = self.device_memory_gib.unwrap_or(match device {
            DeviceKind::Cpu => 8.0,
            DeviceKind::Cuda => 100.0,
        });
        gib * f64::from(1u32 << 30)
    }
}

impl Default for ServingConfig {
    fn default() -> Self {
        ServingConfig {
            listen: "127.0.0.1:50051".to_string(),
            device: DeviceKind::Cpu,
            gpus: Vec::new(),
            width: 832,
            height: 480,
            num_frames: 81,
            fps: 16,
            max_frames: 241,
            max_side: 1920,
            max_steps: 100,
            max_prompt_bytes: 8192,
            queue_depth: 16,
            encoder: EncoderKind::Openh264,
            encoder_threads: None,
            client_send_timeout_s: 10.0,
            max_deadline_s: 24 * 3600,
            shutdown_grace_s: 30,
            admission: AdmissionConfig::default(),
            tls: None,
            api_keys: None,
            insecure: false,
            per_key: PerKeyLimits::default(),
            videos: VideoStore::default(),
            warmup: None,
        }
    }
}

/// Most encoder threads chosen by default: beyond the ~12 segments a second a GPU's VAE
/// produces at 480p, more threads only hold more frames in memory.
const MAX_DEFAULT_ENCODER_THREADS: usize = 16;

/// Most encoder threads a config may ask for (each holds up to two segments of frames).
const MAX_ENCODER_THREADS: usize = 256;

impl ServingConfig {
    /// The shapes to warm up at start (see `warmup`).
    pub fn warmup_shapes(&self) -> Vec<WarmupShape> {
        match (&self.warmup, self.device) {
            (Some(shapes), _) => shapes.clone(),
            (None, DeviceKind::Cuda) => vec![WarmupShape {
                width: self.width,
                height: self.height,
                num_frames: self.num_frames,
            }],
            (None, DeviceKind::Cpu) => Vec::new(),
        }
    }

    /// `encoder_threads`, or one per core of this host (at most 16) when unset.
    pub fn encoder_threads(&self) -> usize {
        self.encoder_threads.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map_or(1, usize::from)
                .min(MAX_DEFAULT_ENCODER_THREADS)
        })
    }

    /// The public API may listen on `addr` as configured: anywhere with TLS and API keys, on
    /// loopback without them, elsewhere without them only with `serving.insecure: true`.
    pub fn check_exposure(&self, addr: std::net::SocketAddr) -> Result<(), ConfigError> {
        if addr.ip().is_loopback() || (self.tls.is_some() && self.api_keys.is_some()) {
            return Ok(());
        }
        if self.insecure {
            return Ok(());
        }
        let missing = match (&self.tls, &self.api_keys) {
            (None, None) => "serving.tls and serving.api_keys",
            (None, Some(_)) => "serving.tls",
            _ => "serving.api_keys",
        };
        Err(invalid(
            "serving.listen",
            addr,
            format!(
                "a non-loopback address needs {missing} (or serving.insecure: true to serve \
                 unencrypted or unauthenticated anyway)"
            ),
        ))
    }
}

/// Parses an address-valued config key, naming the key when it is not an address.
pub fn socket_addr(key: &'static str, value: &str) -> Result<std::net::SocketAddr, ConfigError> {
    value.parse().map_err(|_| {
        invalid(
            key,
            format!("{value:?}"),
            "must be an address like 127.0.0.1:50051",
        )
    })
}

/// A validated size as a count; negative values (rejected by validation) count as 0.
fn count(size: i64) -> usize {
    usize::try_from(size).unwrap_or(0)
}

impl Config {
    /// Reads and parses a YAML file; does not validate (see [`Config::validate`]).
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mut cfg = Self::parse(&text, &path.display().to_string())?;
        cfg.base_dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Ok(cfg)
    }

    /// A path from the file (`pools.tls_ca`, `serving.api_keys`, …): relative ones start at the
    /// config file's folder.
    pub fn path(&self, p: &str) -> PathBuf {
        self.base_dir.join(p)
    }

    /// Parses YAML text; `origin` names it in errors (a file name or `<string>`).
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        serde_yaml_ng::from_str(text).map_err(|e| ConfigError::Parse {
            origin: origin.to_string(),
            message: e.to_string(),
        })
    }

    /// How the served model maps video to latents and tokens: its preset's VAE's
    /// ([`PresetSpec::vae`]); for a checkpoint, its
    /// `vae/config.json` scale factors (`scale_factor_spatial`, `scale_factor_temporal`) where it
    /// names them, else Wan 2.1's (the decoder checks its VAE against this at start-up).
    pub fn geometry(&self) -> LatentGeometry {
        match (
            self.model.weights,
            &self.model.checkpoint,
            self.model.preset,
        ) {
            (WeightSource::Checkpoint, Some(dir), _) => {
                let factors = std::fs::read_to_string(dir.join("vae").join("config.json"))
                    .ok()
                    .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok());
                let factor = |key: &str, default: usize| {
                    factors
                        .as_ref()
                        .and_then(|v| v.get(key))
                        .and_then(serde_json::Value::as_u64)
                        .map_or(default, |f| f as usize)
                };
                let wan21 = LatentGeometry::WAN21;
                LatentGeometry {
                    spatial: factor("scale_factor_spatial", wan21.spatial),
                    temporal: factor("scale_factor_temporal", wan21.temporal),
                    patch: wan21.patch,
                }
            }
            (_, _, Some(preset)) => preset.spec().vae.geometry(),
            _ => LatentGeometry::WAN21,
        }
    }

    /// The model name the config serves: the preset, or the checkpoint folder's name.
    pub fn model_name(&self) -> String {
        match (&self.model.checkpoint, self.model.weights) {
            (Some(dir), WeightSource::Checkpoint) => dir.file_name().map_or_else(
                || dir.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            ),
            _ => self
                .model
                .preset
                .map_or_else(|| "?".to_string(), |p| p.name().to_string()),
        }
    }

    /// The denoiser pool's world size the config describes: cfg × tp × cp × ulysses.
    pub fn denoiser_world_size(&self) -> usize {
        let p = &self.parallel_config;
        count(p.cfg_size) * count(p.tp_size) * self.cp_layout().size() * count(p.ulysses_size)
    }

    /// Context-parallel layout (ring or Attention2D) from the config, unvalidated.
    pub fn cp_layout(&self) -> CpLayout {
        let p = &self.parallel_config;
        let [rows, cols] = p.attn2d_size.map(count);
        match count(p.ring_size) {
            r if r > 1 => CpLayout::Ring(r),
            _ if rows * cols > 1 => CpLayout::Attn2d { rows, cols },
            _ => CpLayout::None,
        }
    }

    /// One decoder instance's VAE layout (`parallel_vae_size` ranks).
    pub fn vae_layout(&self) -> VaeLayout {
        VaeLayout::new(count(self.parallel_config.parallel_vae_size))
    }

    /// The GPU ordinals of `ranks` ranks (`serving.gpus[..ranks]`, or 0..ranks when the list is
    /// empty); `what` names who needs them in the error (e.g. "the denoiser mesh"). Whether the
    /// machine has these GPUs is checked where they are opened.
    pub fn rank_gpus(&self, what: &str, ranks: usize) -> Result<Vec<usize>, ConfigError> {
        let gpus = &self.serving.gpus;
        if gpus.is_empty() {
            return Ok((0..ranks).collect());
        }
        if gpus.len() < ranks {
            return Err(invalid(
                "serving.gpus",
                format!("{gpus:?}"),
                format!(
                    "lists {} GPU(s) but {what} has {ranks} ranks, one GPU each; list {ranks} \
                     ordinals or leave the list out (0..{ranks})",
                    gpus.len()
                ),
            ));
        }
        Ok(gpus[..ranks].to_vec())
    }

    /// Self-attention head count: the preset's, or `num_attention_heads` from the checkpoint's
    /// `transformer/config.json`.
    pub fn num_heads(&self) -> Result<usize, ConfigError> {
        if let Some(preset) = self.model.preset {
            return Ok(preset.num_heads());
        }
        let Some(dir) = &self.model.checkpoint else {
            return Err(invalid(
                "model",
                "{}",
                "set `preset`, `checkpoint`, or both",
            ));
        };
        let path = dir.join("transformer").join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Io {
            path: path.clone(),
            source,
        })?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| ConfigError::Parse {
                origin: path.display().to_string(),
                message: e.to_string(),
            })?;
        json.get("num_attention_heads")
            .and_then(|v| v.as_u64())
            .map(|h| h as usize)
            .ok_or_else(|| ConfigError::Parse {
                origin: path.display().to_string(),
                message: "no integer `num_attention_heads`".to_string(),
            })
    }

    /// Checks every rule before any work starts. `world_size` is the number of denoiser ranks the
    /// launcher provides (GPUs, or `WORLD_SIZE`); `None` accepts the config's own product.
    /// Returns the validated denoiser mesh.
    pub fn validate(&self, world_size: Option<usize>) -> Result<Mesh, ConfigError> {
        self.validate_model()?;
        let p = &self.parallel_config;
        for (key, value) in [
            ("parallel_config.cfg_size", p.cfg_size),
            ("parallel_config.tp_size", p.tp_size),
            ("parallel_config.ulysses_size", p.ulysses_size),
            ("parallel_config.ring_size", p.ring_size),
            ("parallel_config.attn2d_size[0]", p.attn2d_size[0]),
            ("parallel_config.attn2d_size[1]", p.attn2d_size[1]),
            ("parallel_config.parallel_vae_size", p.parallel_vae_size),
        ] {
            if value < 1 {
                return Err(invalid(key, value, "must be at least 1"));
            }
        }
        if p.cfg_size > 2 {
            return Err(invalid(
                "parallel_config.cfg_size",
                p.cfg_size,
                "must be 1 or 2 (there are two guidance branches)",
            ));
        }
        if p.tp_size != 1 {
            return Err(invalid(
                "parallel_config.tp_size",
                p.tp_size,
                "tensor parallelism is not supported yet; use 1 (scale with ulysses/ring/attn2d)",
            ));
        }
        let attn2d = p.attn2d_size[0] * p.attn2d_size[1];
        if p.ring_size > 1 && attn2d > 1 {
            return Err(invalid(
                "parallel_config.ring_size",
                p.ring_size,
                format!(
                    "ring and attn2d_size {:?} are exclusive; set one of them to 1",
                    p.attn2d_size
                ),
            ));
        }
        if p.async_ulysses && p.ulysses_size < 2 {
            return Err(invalid(
                "parallel_config.async_ulysses",
                true,
                format!(
                    "overlaps the Ulysses all-to-alls with the projections, so it needs \
                     ulysses_size > 1 (have {})",
                    p.ulysses_size
                ),
            ));
        }
        let heads = self.num_heads()?;
        if heads % count(p.ulysses_size) != 0 {
            return Err(invalid(
                "parallel_config.ulysses_size",
                p.ulysses_size,
                format!("must divide the model's head count {heads}"),
            ));
        }
        let product = self.denoiser_world_size();
        if let Some(world) = world_size
            && world != product
        {
            return Err(invalid(
                "parallel_config",
                format!(
                    "cfg {} x tp {} x cp {} x ulysses {} = {product}",
                    p.cfg_size,
                    p.tp_size,
                    self.cp_layout().size(),
                    p.ulysses_size
                ),
                format!("the product of the axes must equal the world size {world}"),
            ));
        }
        self.validate_serving()?;
        self.validate_pools()?;
        let s = &self.sampler;
        if s.steps < 1 || s.steps > self.serving.max_steps {
            return Err(invalid(
                "sampler.steps",
                s.steps,
                format!(
                    "must be in 1..={} (serving.max_steps)",
                    self.serving.max_steps
                ),
            ));
        }
        if !(s.shift.is_finite() && s.shift > 0.0) {
            return Err(invalid(
                "sampler.shift",
                s.shift,
                "must be a positive number",
            ));
        }
        for (key, g) in [
            ("sampler.guidance_scale", Some(s.guidance_scale)),
            ("sampler.guidance_scale_2", s.guidance_scale_2),
        ] {
            if let Some(g) = g
                && !(g.is_finite() && g >= 0.0)
            {
                return Err(invalid(key, g, "must be a finite number ≥ 0"));
            }
        }
        Ok(Mesh::new(
            count(p.cfg_size),
            count(p.tp_size),
            self.cp_layout(),
            count(p.ulysses_size),
        ))
    }

    fn validate_model(&self) -> Result<(), ConfigError> {
        let m = &self.model;
        if m.dtype == Dtype::Fp8 && self.serving.device == DeviceKind::Cpu {
            return Err(invalid(
                "model.dtype",
                "fp8",
                "FP8 runs on GPUs only (serving.device: cuda, compute capability 8.9 or later); \
                 the CPU computes in f32 or bf16",
            ));
        }
        match (m.weights, &m.checkpoint, m.preset) {
            (WeightSource::Checkpoint, None, _) => Err(invalid(
                "model.checkpoint",
                "(unset)",
                "`weights: checkpoint` needs a checkpoint folder",
            )),
            (WeightSource::Checkpoint, Some(dir), _) if !dir.is_dir() => Err(invalid(
                "model.checkpoint",
                dir.display(),
                "must be an existing diffusers checkpoint folder",
            )),
            (WeightSource::Random, _, None) => Err(invalid(
                "model.preset",
                "(unset)",
                "`weights: random` needs a preset to know the model's size",
            )),
            _ => Ok(()),
        }
    }

    fn validate_pools(&self) -> Result<(), ConfigError> {
        let p = &self.pools;
        for (key, addr) in [
            ("pools.gateway", &p.gateway),
            ("pools.denoiser_listen", &p.denoiser_listen),
            ("pools.decoder_listen", &p.decoder_listen),
            ("pools.link_listen", &p.link_listen),
        ] {
            if addr.parse::<std::net::SocketAddr>().is_err() {
                return Err(invalid(
                    key,
                    addr,
                    "must be an address like 127.0.0.1:50061",
                ));
            }
        }
        if p.heartbeat_timeout_s == 0 {
            return Err(invalid(
                "pools.heartbeat_timeout_s",
                0,
                "must be at least 1",
            ));
        }
        if p.link == LinkKind::Nccl && self.serving.device != DeviceKind::Cuda {
            return Err(invalid(
                "pools.link",
                "nccl",
                "moves latents GPU to GPU and needs serving.device = cuda (on the CPU use quic or ucx)",
            ));
        }
        Ok(())
    }

    fn validate_serving(&self) -> Result<(), ConfigError> {
        let s = &self.serving;
        if !s.gpus.is_empty() && s.device != DeviceKind::Cuda {
            return Err(invalid(
                "serving.gpus",
                format!("{:?}", s.gpus),
                "is only read with `device: cuda`; set serving.device: cuda or remove the list",
            ));
        }
        for (i, gpu) in s.gpus.iter().enumerate() {
            if s.gpus[..i].contains(gpu) {
                return Err(invalid(
                    "serving.gpus",
                    format!("{:?}", s.gpus),
                    format!("GPU {gpu} is listed twice; every rank needs a GPU of its own"),
                ));
            }
        }
        if s.listen.parse::<std::net::SocketAddr>().is_err() {
            return Err(invalid(
                "serving.listen",
                &s.listen,
                "must be an address like 127.0.0.1:50051",
            ));
        }
        let g = self.geometry();
        let m = g.pixel_multiple();
        for (key, side) in [("serving.width", s.width), ("serving.height", s.height)] {
            if side == 0 || side % m != 0 || side > s.max_side {
                return Err(invalid(
                    key,
                    side,
                    format!(
                        "must be a positive multiple of {m} up to {} (serving.max_side)",
                        s.max_side
                    ),
                ));
            }
        }
        if !g.frames_fit(s.num_frames) || s.num_frames > s.max_frames {
            return Err(invalid(
                "serving.num_frames",
                s.num_frames,
                format!(
                    "must be {t}k+1 (1, {}, {}, …) and at most {} (serving.max_frames)",
                    g.temporal + 1,
                    2 * g.temporal + 1,
                    s.max_frames,
                    t = g.temporal
                ),
            ));
        }
        if s.fps == 0 || s.fps > 240 {
            return Err(invalid("serving.fps", s.fps, "must be in 1..=240"));
        }
        for (i, w) in s.warmup.iter().flatten().enumerate() {
            if let Err((field, value, rule)) = g.check_size(w.width, w.height, w.num_frames) {
                return Err(invalid(
                    "serving.warmup",
                    format!("[{i}].{field} = {value}"),
                    rule,
                ));
            }
            if w.width > s.max_side || w.height > s.max_side || w.num_frames > s.max_frames {
                return Err(invalid(
                    "serving.warmup",
                    format!("[{i}] = {}x{}x{}", w.width, w.height, w.num_frames),
                    "must be within serving.max_side and serving.max_frames",
                ));
            }
        }
        if let Some(n) = s.encoder_threads
            && n > MAX_ENCODER_THREADS
        {
            return Err(invalid(
                "serving.encoder_threads",
                n,
                format!("must be at most {MAX_ENCODER_THREADS}"),
            ));
        }
        if s.queue_depth == 0 {
            return Err(invalid("serving.queue_depth", 0, "must be at least 1"));
        }
        if !(s.client_send_timeout_s.is_finite() && s.client_send_timeout_s > 0.0) {
            return Err(invalid(
                "serving.client_send_timeout_s",
                s.client_send_timeout_s,
                "must be a positive number of seconds",
            ));
        }
        if s.max_deadline_s == 0 {
            return Err(invalid("serving.max_deadline_s", 0, "must be at least 1"));
        }
        for (key, value) in [
            ("serving.per_key.max_running", s.per_key.max_running),
            ("serving.per_key.max_queued", s.per_key.max_queued),
        ] {
            if value == Some(0) {
                return Err(invalid(key, 0, "must be at least 1 (or unset)"));
            }
        }
        for (key, value) in [
            ("serving.videos.max_count", s.videos.max_count as u64),
            ("serving.videos.max_bytes", s.videos.max_bytes),
            ("serving.videos.ttl_s", s.videos.ttl_s),
        ] {
            if value == 0 {
                return Err(invalid(key, 0, "must be at least 1"));
            }
        }
        let c = &self.connections;
        for (key, value) in [
            ("connections.handshake_timeout_s", c.handshake_timeout_s),
            ("connections.idle_timeout_s", c.idle_timeout_s),
            ("connections.request_timeout_s", c.request_timeout_s),
            ("connections.send_timeout_s", c.send_timeout_s),
            ("connections.keepalive_interval_s", c.keepalive_interval_s),
            ("connections.keepalive_timeout_s", c.keepalive_timeout_s),
        ] {
            if !(value.is_finite() && value > 0.0 && value <= 86_400.0) {
                return Err(invalid(
                    key,
                    value,
                    "must be a number of seconds in (0, 86400]",
                ));
            }
        }
        if c.send_timeout_s <= s.client_send_timeout_s {
            // A relay blocked on a slow client stops reading its pool's stream; the client must
            // lose its request before the pool's connection, shared by every request, looks
            // stalled.
            return Err(invalid(
                "connections.send_timeout_s",
                c.send_timeout_s,
                format!(
                    "must be more than serving.client_send_timeout_s ({}): a client too slow to \
                     read loses its request before a pool's connection to the gateway is closed \
                     as stalled",
                    s.client_send_timeout_s
                ),
            ));
        }
        for (key, value) in [
            ("connections.max_connections", c.max_connections),
            ("connections.max_streams", c.max_streams as usize),
            ("connections.max_request_bytes", c.max_request_bytes),
        ] {
            if value == 0 {
                return Err(invalid(key, 0, "must be at least 1"));
            }
        }
        let a = &s.admission;
        for (key, value) in [
            ("serving.admission.max_request_s", Some(a.max_request_s)),
            ("serving.admission.device_tflops", a.device_tflops),
            ("serving.admission.device_memory_gib", a.device_memory_gib),
        ] {
            if let Some(v) = value
                && !(v.is_finite() && v > 0.0)
            {
                return Err(invalid(key, v, "must be a positive number"));
            }
        }
        Ok(())
    }

    /// The default video shape from `serving` (width, height, frames).
    pub fn default_video(&self) -> VideoShape {
        VideoShape {
            geometry: self.geometry(),
            width: self.serving.width,
            height: self.serving.height,
            frames: self.serving.num_frames,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(parallel: &str) -> Result<Mesh, ConfigError> {
        let text = format!("model:\n  preset: wan2.1-t2v-14b\nparallel_config:\n{parallel}");
        Config::parse(&text, "<test>")?.validate(None)
    }

    fn err(parallel: &str) -> String {
        match cfg(parallel) {
            Ok(m) => panic!("expected an error for {parallel:?}, got mesh {m:?}"),
            Err(e) => e.to_string(),
        }
    }

    /// Each preset reads its own row: the YAML name it parses from is its row's name, and
    /// the geometry follows the row's VAE.
    #[test]
    fn every_preset_reads_its_own_row() {
        for preset in Preset::ALL {
            let yaml = format!("model:\n  preset: {}\n", preset.spec().name);
            let c = Config::parse(&yaml, "<t>").unwrap();
            assert_eq!(c.model.preset, Some(preset), "{yaml}");
            assert_eq!(c.geometry(), preset.spec().vae.geometry());
        }
        assert_eq!(
            Preset::Wan22Ti2v5b.spec().vae.geometry(),
            LatentGeometry::WAN22
        );
        assert_eq!(Preset::Wan22T2vA14b.spec().experts, 2);
        assert_eq!(Preset::Wan21T2v1_3b.num_heads(), 12);
    }

    #[test]
    fn minimal_config_takes_defaults() {
        let c = Config::parse("model:\n  preset: tiny\n", "<t>").unwrap();
        assert_eq!(c.parallel_config, ParallelConfig::default());
        assert_eq!(c.validate(Some(1)).unwrap().world_size(), 1);
    }

    #[test]
    fn a_public_address_needs_tls_and_keys_or_insecure() {
        let serving = |extra: &str| {
            Config::parse(
                &format!("model: {{preset: tiny}}\nserving:\n{extra}"),
                "<t>",
            )
            .unwrap()
            .serving
        };
        let public: std::net::SocketAddr = "0.0.0.0:50051".parse().unwrap();
        let loopback: std::net::SocketAddr = "127.0.0.1:50051".parse().unwrap();
        assert!(serving("  fps: 16\n").check_exposure(loopback).is_ok());
        let e = serving("  fps: 16\n")
            .check_exposure(public)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("serving.listen = 0.0.0.0:50051:")
                && e.contains("serving.tls and serving.api_keys"),
            "{e}"
        );
        let e = serving("  api_keys: keys.txt\n")
            .check_exposure(public)
            .unwrap_err();
        assert!(e.to_string().contains("needs serving.tls "), "{e}");
        let both = "  api_keys: keys.txt\n  tls: {cert: c.pem, key: k.pem}\n";
        assert!(serving(both).check_exposure(public).is_ok());
        assert!(serving("  insecure: true\n").check_exposure(public).is_ok());
    }

    /// FP8 is a GPU precision: the CPU is refused with the key, the value and the rule; on
    /// `device: cuda` the config is valid (the GPU's FP8 support is checked when the devices
    /// are opened, `devices::rank_devices`).
    #[test]
    fn fp8_is_refused_on_the_cpu() {
        let e = validation_error("model: {preset: tiny, dtype: fp8}\n");
        assert!(
            e.starts_with("model.dtype = fp8: FP8 runs on GPUs only"),
            "{e}"
        );
        let gpu = Config::parse(
            "model: {preset: tiny, dtype: fp8}
serving: {device: cuda}
",
            "<t>",
        )
        .unwrap();
        assert_eq!(gpu.model.dtype, Dtype::Fp8);
        assert!(gpu.validate(None).is_ok());
    }

    /// What validating `yaml` says is wrong with it.
    fn validation_error(yaml: &str) -> String {
        Config::parse(yaml, "<t>")
            .unwrap()
            .validate(None)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn connection_limits_are_checked() {
        let e = validation_error("model: {preset: tiny}\nconnections: {max_streams: 0}\n");
        assert_eq!(e, "connections.max_streams = 0: must be at least 1");
        let e = validation_error("model: {preset: tiny}\nconnections: {idle_timeout_s: -1}\n");
        assert!(e.starts_with("connections.idle_timeout_s = -1:"), "{e}");
        let e = validation_error("model: {preset: tiny}\nconnections: {send_timeout_s: 5}\n");
        assert!(
            e.starts_with(
                "connections.send_timeout_s = 5: must be more than serving.client_send_timeout_s (10)"
            ),
            "{e}"
        );
    }

    #[test]
    fn unknown_key_is_named() {
        let e = err("  cfg_size: 2\n  ulysess_size: 2\n");
        assert!(e.contains("unknown field `ulysess_size`"), "{e}");
        let e = Config::parse("model:\n  preset: tiny\n  heads: 3\n", "f.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("f.yaml: ") && e.contains("unknown field `heads`"),
            "{e}"
        );
    }

    #[test]
    fn malformed_yaml_names_the_place() {
        let e = Config::parse("model: [preset: tiny\n", "bad.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("bad.yaml: ") && e.contains("line"), "{e}");
    }

    #[test]
    fn negative_and_zero_sizes() {
        let e = err("  ulysses_size: -2\n");
        assert_eq!(e, "parallel_config.ulysses_size = -2: must be at least 1");
        let e = err("  attn2d_size: [2, -1]\n");
        assert_eq!(e, "parallel_config.attn2d_size[1] = -1: must be at least 1");
        let e = err("  ring_size: 0\n");
        assert_eq!(e, "parallel_config.ring_size = 0: must be at least 1");
    }

    #[test]
    fn ulysses_must_divide_heads() {
        let e = err("  ulysses_size: 3\n");
        assert_eq!(
            e,
            "parallel_config.ulysses_size = 3: must divide the model's head count 40"
        );
        cfg("  ulysses_size: 8\n").unwrap();
    }

    #[test]
    fn ring_and_attn2d_are_exclusive() {
        let e = err("  ring_size: 2\n  attn2d_size: [2, 1]\n");
        assert!(
            e.starts_with("parallel_config.ring_size = 2: ring and attn2d_size [2, 1]"),
            "{e}"
        );
    }

    #[test]
    fn axis_product_must_equal_world() {
        let c = Config::parse(
            "model:\n  preset: wan2.1-t2v-14b\nparallel_config:\n  cfg_size: 2\n  ulysses_size: 4\n",
            "<t>",
        )
        .unwrap();
        let e = c.validate(Some(6)).unwrap_err().to_string();
        assert_eq!(
            e,
            "parallel_config = cfg 2 x tp 1 x cp 1 x ulysses 4 = 8: \
             the product of the axes must equal the world size 6"
        );
        assert_eq!(c.validate(Some(8)).unwrap().world_size(), 8);
    }

    #[test]
    fn cfg_and_tp_limits() {
        assert!(err("  cfg_size: 3\n").starts_with("parallel_config.cfg_size = 3: must be 1 or 2"));
        assert!(
            err("  tp_size: 2\n").starts_with("parallel_config.tp_size = 2: tensor parallelism")
        );
        let e = err("  async_ulysses: true\n");
        assert!(
            e.starts_with("parallel_config.async_ulysses = true") && e.contains("ulysses_size > 1"),
            "{e}"
        );
        let mesh = cfg("  ulysses_size: 2\n  async_ulysses: true\n").unwrap();
        assert_eq!(mesh.ulysses_size(), 2);
        let mesh = cfg("  ulysses_size: 2\n  ring_size: 2\n  async_ulysses: true\n").unwrap();
        assert_eq!(mesh.world_size(), 4);
        // `auto` picks the Hopper kernel where it applies; naming it is not a choice.
        let e = Config::parse(
            "model:\n  preset: tiny\nattention:\n  backend: hopper\n",
            "<t>",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("unknown variant `hopper`, expected `auto` or `portable`"),
            "{e}"
        );
    }

    #[test]
    fn the_models_geometry_sets_the_size_rules() {
        let wan21 = Config::parse("model: {preset: wan2.1-t2v-1.3b}\n", "<t>").unwrap();
        assert_eq!(wan21.geometry(), LatentGeometry::WAN21);
        assert_eq!(wan21.geometry().pixel_multiple(), 16);
        // The TI2V-5B's Wan 2.2 VAE compresses 16x: sides must be multiples of 32.
        let e = Config::parse(
            "model: {preset: wan2.2-ti2v-5b}\nserving: {width: 848, height: 480}\n",
            "<t>",
        )
        .unwrap()
        .validate(None)
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("serving.width = 848: must be a positive multiple of 32"),
            "{e}"
        );
        assert_eq!(
            LatentGeometry::WAN22.latent_grid(121, 704, 1280),
            (31, 44, 80)
        );
    }

    #[test]
    fn cuda_settings_parse_and_refuse_unknown_values() {
        let c = Config::parse(
            "model: {preset: tiny}\ncuda: {kernel_cache: /var/cache/k, cudnn_search: heuristic, gemm_search: heuristic}\n",
            "<t>",
        )
        .unwrap();
        assert_eq!(
            c.cuda.kernel_cache.as_deref(),
            Some(Path::new("/var/cache/k"))
        );
        assert_eq!(c.cuda.cudnn_search, AlgoSearch::Heuristic);
        assert_eq!(c.cuda.gemm_search, AlgoSearch::Heuristic);
        assert_eq!(c.cuda.include_dir, None);
        assert_eq!(
            Config::parse("model: {preset: tiny}\n", "<t>")
                .unwrap()
                .cuda
                .gemm_search,
            AlgoSearch::Find
        );
        let e = Config::parse("model: {preset: tiny}\ncuda: {cudnn_search: fast}\n", "<t>")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown variant `fast`"), "{e}");
    }

    #[test]
    fn model_source_rules() {
        let e = Config::parse("model:\n  weights: random\n", "<t>")
            .unwrap()
            .validate(None);
        assert!(
            e.unwrap_err()
                .to_string()
                .starts_with("model.preset = (unset)")
        );
        let e = Config::parse("model:\n  preset: tiny\n  weights: checkpoint\n", "<t>")
            .unwrap()
            .validate(None);
        assert!(
            e.unwrap_err()
                .to_string()
                .starts_with("model.checkpoint = (unset)")
        );
        let e = Config::parse("model:\n  preset: foo\n", "<t>")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown variant `foo`"), "{e}");
    }

    #[test]
    fn heads_come_from_checkpoint_config() {
        let dir = std::env::temp_dir().join(format!("ditstream-ckpt-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("transformer")).unwrap();
        std::fs::write(
            dir.join("transformer/config.json"),
            r#"{"num_attention_heads": 12}"#,
        )
        .unwrap();
        let text = format!(
            "model:\n  checkpoint: {}\n  weights: checkpoint\nparallel_config:\n  ulysses_size: 8\n",
            dir.display()
        );
        let e = Config::parse(&text, "<t>")
            .unwrap()
            .validate(None)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "parallel_config.ulysses_size = 8: must divide the model's head count 12"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_nccl_link_needs_gpus() {
        let parse = |text: &str| Config::parse(text, "<t>").unwrap().validate(None);
        let e = parse("model: {preset: tiny}\npools: {link: nccl}\n")
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "pools.link = nccl: moves latents GPU to GPU and needs serving.device = cuda (on the CPU \
             use quic or ucx)"
        );
        parse("model: {preset: tiny}\nserving: {device: cuda}\npools: {link: nccl}\n").unwrap();
    }

    #[test]
    fn gpu_lists() {
        let parse = |serving: &str| {
            Config::parse(
                &format!("model:\n  preset: tiny\nserving:\n{serving}"),
                "<t>",
            )
            .unwrap()
        };
        let e = parse("  gpus: [0]\n")
            .validate(None)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("serving.gpus = [0]: is only read with `device: cuda`"),
            "{e}"
        );
        let e = parse("  device: cuda\n  gpus: [1, 0, 1]\n")
            .validate(None)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "serving.gpus = [1, 0, 1]: GPU 1 is listed twice; every rank needs a GPU of its own"
        );
        let c = parse("  device: cuda\n  gpus: [3, 1]\n");
        c.validate(None).unwrap();
        assert_eq!(c.rank_gpus("the denoiser mesh", 2).unwrap(), vec![3, 1]);
        assert_eq!(c.rank_gpus("a decoder instance", 1).unwrap(), vec![3]);
        let e = c.rank_gpus("the denoiser mesh", 4).unwrap_err().to_string();
        assert_eq!(
            e,
            "serving.gpus = [3, 1]: lists 2 GPU(s) but the denoiser mesh has 4 ranks, one GPU \
             each; list 4 ordinals or leave the list out (0..4)"
        );
        let c = parse("  device: cuda\n");
        assert_eq!(c.rank_gpus("the denoiser mesh", 3).unwrap(), vec![0, 1, 2]);
    }

    #[test]
    fn serving_rules() {
        let bad = |serving: &str| {
            Config::parse(
                &format!("model:\n  preset: tiny\nserving:\n{serving}"),
                "<t>",
            )
            .unwrap()
            .validate(None)
            .unwrap_err()
            .to_string()
        };
        assert!(
            bad("  width: 100\n")
                .starts_with("serving.width = 100: must be a positive multiple of 16")
        );
        assert!(bad("  num_frames: 80\n").starts_with("serving.num_frames = 80: must be 4k+1"));
        assert!(bad("  listen: nowhere\n").starts_with("serving.listen = nowhere"));
    }

    #[test]
    fn warmup_defaults_to_the_default_shape_on_gpus_and_names_a_bad_shape() {
        let cpu = Config::parse("model: {preset: tiny}\n", "<t>").unwrap();
        assert!(cpu.serving.warmup_shapes().is_empty());
        let gpu = Config::parse(
            "model: {preset: tiny}\nserving: {device: cuda, width: 64, height: 48, num_frames: 9}\n",
            "<t>",
        )
        .unwrap();
        assert_eq!(
            gpu.serving.warmup_shapes(),
            vec![WarmupShape {
                width: 64,
                height: 48,
                num_frames: 9
            }]
        );
        let none = Config::parse(
            "model: {preset: tiny}\nserving: {device: cuda, warmup: []}\n",
            "<t>",
        )
        .unwrap();
        assert!(none.serving.warmup_shapes().is_empty());
        let bad = Config::parse(
            "model: {preset: tiny}\nserving:\n  warmup: [{width: 64, height: 48, num_frames: 9}, {width: 64, height: 50, num_frames: 9}]\n",
            "<t>",
        )
        .unwrap();
        let err = bad.validate(Some(1)).unwrap_err().to_string();
        assert!(
            err.contains("serving.warmup") && err.contains("[1].height = 50"),
            "{err}"
        );
        let threads = Config::parse(
            "model: {preset: tiny}\nserving: {encoder_threads: 1000}\n",
            "<t>",
        )
        .unwrap();
        let err = threads.validate(Some(1)).unwrap_err().to_string();
        assert!(
            err.contains("serving.encoder_threads") && err.contains("1000"),
            "{err}"
        );
    }
}
