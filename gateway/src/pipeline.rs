//! Both stages in one process, for `ditstream serve` (which hands them to its in-process pools)
//! and for parity tests and benchmarks that compare layouts without a service: the streamed path
//! ([`Pipeline::render_streamed`]) and the non-streamed reference ([`Pipeline::render_whole`]).
//! Each request is split here into the denoiser's and the decoder's job (the gateway's one
//! domain → job conversion).

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::bail;
use ditstream_common::config::Config;
use ditstream_decoder::encode::OpenEncoder;
use ditstream_decoder::stage::{DecodeJob, DecodeStage};
use ditstream_denoiser::denoise::Control;
use ditstream_denoiser::stage::{DenoiseJob, DenoiseStage};

use crate::request::GenerateParams;

/// The denoising half of a validated request.
pub fn denoise_job(p: &GenerateParams) -> DenoiseJob {
    DenoiseJob {
        prompt: p.prompt.clone(),
        negative_prompt: p.negative_prompt.clone(),
        width: p.width,
        height: p.height,
        num_frames: p.num_frames,
        steps: p.steps,
        guidance_scale: p.guidance_scale,
        guidance_scale_2: p.guidance_scale_2,
        seed: p.seed,
    }
}

/// The decoding half of a validated request.
pub fn decode_job(p: &GenerateParams) -> DecodeJob {
    DecodeJob {
        width: p.width,
        height: p.height,
        num_frames: p.num_frames,
        fps: p.fps,
        segment_frames: p.segment_frames,
    }
}

/// Both halves in one process (`ditstream serve`, the embedded default).
pub struct Pipeline {
    name: String,
    denoise: DenoiseStage,
    decode: DecodeStage,
}

impl Pipeline {
    /// Builds every model the config names (validated already). Both halves use the GPUs of
    /// `serving.gpus`: denoiser rank r and VAE rank r on `gpus[r]`.
    pub fn from_config(cfg: &Config) -> anyhow::Result<Pipeline> {
        let denoise = DenoiseStage::from_config(cfg)?;
        let decode = DecodeStage::from_config(cfg)?;
        if denoise.latent_channels() != decode.latent_channels() {
            bail!(
                "the transformer's in_channels {} differ from the VAE's z_dim {}",
                denoise.latent_channels(),
                decode.latent_channels()
            );
        }
        Ok(Pipeline {
            name: cfg.model_name(),
            denoise,
            decode,
        })
    }

    /// The served model's name.
    pub fn model_name(&self) -> &str {
        &self.name
    }

    /// The denoising half.
    pub fn denoise_stage(&self) -> &DenoiseStage {
        &self.denoise
    }

    /// The decoding half.
    pub fn decode_stage(&self) -> &DecodeStage {
        &self.decode
    }

    /// The streamed path without a service, for parity tests and benchmarks: text, the loop,
    /// then every latent frame decoded and encoded as a stream would be; returns the init
    /// segment and every media segment concatenated (a whole fragmented MP4).
    pub fn render_streamed(&self, p: &GenerateParams) -> anyhow::Result<Vec<u8>> {
        let job = denoise_job(p);
        let (cond, uncond) = self.denoise.text_states(&job)?;
        let never = AtomicBool::new(false);
        let latent = self
            .denoise
            .denoise_latent(&job, &cond, &uncond, &never, |_| Control::Continue)?;
        Ok(self.decode.render_streamed(&decode_job(p), &latent)?)
    }

    /// The non-streamed path, for reference (see [`DecodeStage::render_whole`]).
    pub fn render_whole(&self, p: &GenerateParams) -> anyhow::Result<Vec<u8>> {
        let job = denoise_job(p);
        let (cond, uncond) = self.denoise.text_states(&job)?;
        let never = AtomicBool::new(false);
        let latent = self
            .denoise
            .denoise_latent(&job, &cond, &uncond, &never, |_| Control::Continue)?;
        Ok(self.decode.render_whole(&decode_job(p), &latent)?)
    }

    /// The pipeline with `encoder` in place of the configured backend (see
    /// [`DecodeStage::with_encoder`]).
    pub fn with_encoder(mut self, encoder: Arc<dyn OpenEncoder>) -> Pipeline {
        self.decode = self.decode.with_encoder(encoder);
        self
    }

    /// The two halves, for `serve` to hand to its pools.
    pub fn into_stages(self) -> (DenoiseStage, DecodeStage) {
        (self.denoise, self.decode)
    }
}
