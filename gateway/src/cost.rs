//! Admission's cost model: what a request will take, in time and memory per rank, estimated
//! from its tokens, frames and steps and the served model's dimensions, against what the serving
//! devices can do (`serving.admission`). A request beyond either limit is refused at once
//! (RESOURCE_EXHAUSTED naming the limit), instead of being accepted and then running for hours or
//! growing memory until the process dies.
//!
//! The estimates are first-order and deliberately simple:
//! - **Denoise time**: steps × CFG branches × the transformer's FLOPs per forward
//!   (`reference/wan.md` §5: per block 12·L·D² + 4·L·D·F + 4·S·D² of linears, 4·L²·D of
//!   self-attention, 4·L·S·D of cross-attention, S = 512 text tokens), spread evenly over the
//!   denoiser mesh's ranks, at `device_tflops` per rank.
//! - **Decode time**: output pixels × frames × the VAE's FLOPs per output pixel. The Wan 2.1 VAE
//!   (base width 96) decodes 720p 81 frames in ≈ 0.64 PFLOP (`reference/wan.md` §5), 8.6 MFLOP a
//!   pixel; convolutions scale with the square of the width, so a base width b costs
//!   8.6 MFLOP · (b/96)².
//! - **Memory**: the larger of one transformer forward's live activations (per token of the
//!   rank's shard and per branch: about ten model-width vectors — the residual stream, the
//!   normalised and modulated input, q, k, v, the attention output and the projections — and two
//!   FFN-width ones) and one VAE pass at full resolution (4 output frames × the base width × ~6
//!   live buffers: input, halo-joined copy, residual, norm, conv output, the causal caches),
//!   in the compute dtype.

use ditstream_common::config::{AdmissionConfig, Config, DeviceKind, Dtype};
use ditstream_decoder::vae::VaeConfig;
use ditstream_denoiser::model::WanConfig;

use crate::request::GenerateParams;

/// Text tokens every prompt is padded to (umT5's 512).
const TEXT_TOKENS: f64 = 512.0;
/// The Wan 2.1 VAE's FLOPs per decoded pixel at base width 96 (0.64 PFLOP / (1280·720·81)).
const VAE_FLOPS_PER_PIXEL_AT_96: f64 = 0.64e15 / (1280.0 * 720.0 * 81.0);

/// What a request is estimated to cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    /// Denoise and decode, seconds.
    pub seconds: f64,
    /// Peak activation bytes on one rank.
    pub bytes_per_rank: f64,
}

/// Why admission refused a request: the estimate, the limit and the key that sets it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OverBudget {
    /// Too slow.
    #[error(
        "{width}x{height}, {frames} frames, {steps} steps is estimated at {seconds:.0} s on this \
         server, over serving.admission.max_request_s = {limit:.0} s; ask for fewer frames, \
         pixels or steps"
    )]
    Time {
        /// Request size.
        width: usize,
        /// Request size.
        height: usize,
        /// Request size.
        frames: usize,
        /// Request size.
        steps: usize,
        /// The estimate.
        seconds: f64,
        /// The limit.
        limit: f64,
    },
    /// Too big.
    #[error(
        "{width}x{height}, {frames} frames needs an estimated {gib:.1} GiB per rank, over \
         serving.admission.device_memory_gib = {limit:.1} GiB; ask for fewer frames or pixels"
    )]
    Memory {
        /// Request size.
        width: usize,
        /// Request size.
        height: usize,
        /// Request size.
        frames: usize,
        /// The estimate.
        gib: f64,
        /// The limit.
        limit: f64,
    },
}

/// The served model's dimensions and the devices' limits.
#[derive(Debug, Clone)]
pub struct CostModel {
    dit: WanConfig,
    geometry: ditstream_common::mesh::LatentGeometry,
    vae_base_dim: usize,
    denoiser_ranks: f64,
    vae_ranks: f64,
    value_bytes: f64,
    flops_per_s: f64,
    memory_bytes: f64,
    limits: AdmissionConfig,
}

impl CostModel {
    /// The model the config serves (preset dimensions, or a checkpoint's configs) on the
    /// devices it names.
    pub fn new(cfg: &Config, dit: WanConfig, vae: &VaeConfig) -> CostModel {
        let device = cfg.serving.device;
        let value_bytes = match (device, cfg.model.dtype) {
            // The CPU computes in f32 whatever the storage dtype.
            (DeviceKind::Cpu, _) | (_, Dtype::F32) => 4.0,
            // FP8 weights are half the linears' bytes, but activations stay bf16: the estimate
            // keeps bf16's (an upper bound).
            (DeviceKind::Cuda, Dtype::Bf16 | Dtype::Fp8) => 2.0,
        };
        CostModel {
            dit,
            geometry: cfg.geometry(),
            vae_base_dim: vae.base_dim,
            denoiser_ranks: cfg.denoiser_world_size().max(1) as f64,
            vae_ranks: cfg.vae_layout().size().max(1) as f64,
            value_bytes,
            flops_per_s: cfg.serving.admission.flops_per_s(device),
            memory_bytes: cfg.serving.admission.memory_bytes(device),
            limits: cfg.serving.admission.clone(),
        }
    }

    /// The transformer's tokens for a request: latent frames × (H/16) × (W/16).
    fn tokens(&self, p: &GenerateParams) -> f64 {
        let (lt, lh, lw) = self.geometry.latent_grid(p.num_frames, p.height, p.width);
        let [pt, ph, pw] = self.dit.patch_size;
        ((lt / pt.max(1)) * (lh / ph.max(1)) * (lw / pw.max(1))) as f64
    }

    /// One transformer forward, one branch, in FLOPs (reference/wan.md §5).
    fn forward_flops(&self, tokens: f64) -> f64 {
        let d = self.dit.dim() as f64;
        let f = self.dit.ffn_dim as f64;
        let per_block = 12.0 * tokens * d * d
            + 4.0 * tokens * d * f
            + 4.0 * TEXT_TOKENS * d * d
            + 4.0 * tokens * tokens * d
            + 4.0 * tokens * TEXT_TOKENS * d;
        per_block * self.dit.num_layers as f64
    }

    /// The estimate for a validated request.
    pub fn estimate(&self, p: &GenerateParams) -> Estimate {
        let tokens = self.tokens(p);
        let branches = if p.guidance_scale > 1.0 { 2.0 } else { 1.0 };
        let denoise = p.steps as f64 * branches * self.forward_flops(tokens);
        let pixels = (p.width * p.height) as f64;
        let width = self.vae_base_dim as f64 / 96.0;
        let decode = pixels * p.num_frames as f64 * VAE_FLOPS_PER_PIXEL_AT_96 * width * width;
        let seconds = denoise / (self.flops_per_s * self.denoiser_ranks)
            + decode / (self.flops_per_s * self.vae_ranks);
        let d = self.dit.dim() as f64;
        let f = self.dit.ffn_dim as f64;
        let dit_bytes =
            branches * (tokens / self.denoiser_ranks) * (10.0 * d + 2.0 * f) * self.value_bytes;
        let vae_bytes =
            4.0 * pixels * self.vae_base_dim as f64 * 6.0 * self.value_bytes / self.vae_ranks;
        Estimate {
            seconds,
            bytes_per_rank: dit_bytes.max(vae_bytes),
        }
    }

    /// The estimate, or why the request is beyond the devices.
    pub fn admit(&self, p: &GenerateParams) -> Result<Estimate, OverBudget> {
        let e = self.estimate(p);
        let gib = |b: f64| b / f64::from(1u32 << 30);
        if e.bytes_per_rank > self.memory_bytes {
            return Err(OverBudget::Memory {
                width: p.width,
                height: p.height,
                frames: p.num_frames,
                gib: gib(e.bytes_per_rank),
                limit: gib(self.memory_bytes),
            });
        }
        if e.seconds > self.limits.max_request_s {
            return Err(OverBudget::Time {
                width: p.width,
                height: p.height,
                frames: p.num_frames,
                steps: p.steps,
                seconds: e.seconds,
                limit: self.limits.max_request_s,
            });
        }
        Ok(e)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::request::RawRequest;
    use ditstream_common::config::Preset;

    fn model(cfg: &Config) -> CostModel {
        let vae = VaeConfig {
            base_dim: 16,
            ..VaeConfig::wan21()
        };
        CostModel::new(cfg, WanConfig::preset(Preset::Tiny), &vae)
    }

    fn params(cfg: &Config, w: u32, h: u32, frames: u32, steps: u32) -> GenerateParams {
        RawRequest {
            prompt: "p".into(),
            width: Some(w),
            height: Some(h),
            num_frames: Some(frames),
            steps: Some(steps),
            ..RawRequest::default()
        }
        .validate(cfg, "tiny")
        .unwrap()
    }

    #[test]
    fn the_1_3b_forward_matches_the_reference_table() {
        // reference/wan.md §5: 1.3B at 480p 81 frames (32,760 tokens) is 283 TFLOP a forward.
        let cfg = Config::parse("model: {preset: wan2.1-t2v-1.3b}\n", "<t>").unwrap();
        let m = CostModel::new(
            &cfg,
            WanConfig::preset(Preset::Wan21T2v1_3b),
            &VaeConfig::wan21(),
        );
        let tf = m.forward_flops(32_760.0) / 1e12;
        assert!((tf - 283.0).abs() < 2.0, "{tf} TFLOP");
        let p = params(&cfg, 832, 480, 81, 1);
        assert_eq!(m.tokens(&p), 32_760.0);
    }

    #[test]
    fn the_default_request_fits_and_huge_ones_are_refused_naming_the_limit() {
        let cfg = Config::parse(include_str!("../../configs/cpu-tiny.yaml"), "<embedded>").unwrap();
        let m = model(&cfg);
        let ok = m.admit(&params(&cfg, 256, 160, 17, 8)).unwrap();
        assert!(ok.seconds < 60.0, "{ok:?}");
        let big = m.admit(&params(&cfg, 1920, 1920, 241, 100)).unwrap_err();
        assert!(
            big.to_string()
                .contains("serving.admission.device_memory_gib"),
            "{big}"
        );
        let slow = m.admit(&params(&cfg, 1280, 720, 81, 8)).unwrap_err();
        assert!(
            slow.to_string()
                .contains("serving.admission.max_request_s = 1800 s"),
            "{slow}"
        );
    }

    #[test]
    fn more_ranks_share_the_time_and_the_memory() {
        let one = Config::parse("model: {preset: tiny}\n", "<t>").unwrap();
        let four = Config::parse(
            "model: {preset: tiny}\nparallel_config: {cfg_size: 2, ulysses_size: 2, parallel_vae_size: 4}\n",
            "<t>",
        )
        .unwrap();
        let p = params(&one, 512, 320, 33, 8);
        let (a, b) = (model(&one).estimate(&p), model(&four).estimate(&p));
        assert!(b.seconds < a.seconds / 2.0, "{a:?} {b:?}");
        assert!(b.bytes_per_rank <= a.bytes_per_rank, "{a:?} {b:?}");
    }
}
