//! [`WanVaeDecoder`]: the Wan 2.1 VAE decoder (diffusers `AutoencoderKLWan.decode`), run chunk by chunk
//! with the caller's [`DecodeStream`] holding all per-request state (the convs' frame caches).
//!
//! Pipeline per chunk: z·std + mean → post_quant_conv (1×1×1) → conv_in → mid block → up blocks →
//! RMS norm, SiLU, conv_out → clamp to [−1, 1]. Latent frame 0 decodes to 1 video frame, every later
//! latent frame to `temporal_scale` (4) frames, and each is final as soon as its chunk is decoded.
//!
//! Placement: a decoder lives on one device in one dtype (weights converted and moved once, when it is
//! built); chunks are moved there on entry, so a stream's caches and the decoded frames live there too.

use std::path::Path;

use ditstream_kernels::weights::{Checkpoint, WeightSource};
use ditstream_kernels::{DType, Device, Tensor, add, clamp, mul};

use super::config::VaeConfig;
use super::error::{Result, VaeError};
use super::layers::{CausalConv, MidBlock, Pass, RmsNorm, SlotCounter, UpBlock};
use super::spatial::{SpatialOps, Unsharded};
use super::weights::Prefixed;

/// The Wan 2.1 VAE decoder with its weights, on one device in one dtype. Immutable while decoding: any
/// number of streams can be decoded with one decoder, each with its own [`DecodeStream`].
pub struct WanVaeDecoder {
    config: VaeConfig,
    /// Where the weights live and every chunk runs.
    device: Device,
    /// Storage dtype of the weights and activations (maths in f32 either way).
    dtype: DType,
    /// [1, z_dim, 1, 1, 1], f32 (the de-normalisation is computed in f32 in every dtype).
    latents_mean: Tensor,
    /// [1, z_dim, 1, 1, 1], f32.
    latents_std: Tensor,
    post_quant_conv: CausalConv,
    conv_in: CausalConv,
    mid_block: MidBlock,
    up_blocks: Vec<UpBlock>,
    norm_out: RmsNorm,
    conv_out: CausalConv,
    /// Cache slots a stream needs (one per conv with a time extent: 32 for Wan 2.1).
    cache_slots: usize,
}

/// Per-request decode state, owned by the caller: the latent size, how many latent frames have been
/// decoded, and each causal conv's last ≤ 2 input frames. Its size is bounded by the caches (a few
/// frames per layer), never the video decoded so far.
#[derive(Debug, Clone)]
pub struct DecodeStream {
    latent_height: usize,
    latent_width: usize,
    /// Batch size, fixed by the first chunk.
    batch: Option<usize>,
    latent_frames_decoded: usize,
    caches: Vec<Option<Tensor>>,
}

impl DecodeStream {
    /// Latent rows and columns of every chunk of this stream.
    pub fn latent_size(&self) -> (usize, usize) {
        (self.latent_height, self.latent_width)
    }

    /// Latent frames decoded so far.
    pub fn latent_frames_decoded(&self) -> usize {
        self.latent_frames_decoded
    }

    /// Bytes held by the frame caches (the whole state between chunks).
    pub fn cache_bytes(&self) -> usize {
        self.caches
            .iter()
            .flatten()
            .map(|t| t.numel() * t.dtype().size_in_bytes())
            .sum()
    }
}

impl WanVaeDecoder {
    /// Loads a diffusers VAE folder (a checkpoint's `vae/`) for the CPU in f32:
    /// [`load_on`](Self::load_on)`(folder, Device::Cpu, DType::F32)`.
    pub fn load(folder: &Path) -> Result<Self> {
        Self::load_on(folder, Device::Cpu, DType::F32)
    }

    /// Loads a diffusers VAE folder (a checkpoint's `vae/`): `config.json` and
    /// `diffusion_pytorch_model.safetensors` (or its sharded index), memory-mapped, with the weights
    /// converted to `dtype` and moved to `device` once.
    pub fn load_on(folder: &Path, device: Device, dtype: DType) -> Result<Self> {
        let config = VaeConfig::from_file(&folder.join("config.json"))?;
        let checkpoint = Checkpoint::open_dir(folder, "diffusion_pytorch_model")?;
        Self::from_weights_on(config, &checkpoint, device, dtype)
    }

    /// [`from_weights_on`](Self::from_weights_on) for the CPU in f32.
    pub fn from_weights(config: VaeConfig, weights: &dyn WeightSource) -> Result<Self> {
        Self::from_weights_on(config, weights, Device::Cpu, DType::F32)
    }

    /// Builds the decoder from any weight source (a checkpoint, or random weights for benchmarks),
    /// checking every tensor's presence and shape against the config, with every weight in `dtype` on
    /// `device`. Reads `post_quant_conv.*` and `decoder.*` (diffusers' checkpoint names).
    pub fn from_weights_on(
        config: VaeConfig,
        weights: &dyn WeightSource,
        device: Device,
        dtype: DType,
    ) -> Result<Self> {
        let root = Prefixed::root(weights, dtype, device);
        let w = root.pp("decoder");
        let mut slots = SlotCounter::default();
        let z = config.z_dim;
        let dims = config.decoder_dims();
        let channel_vector = |values: &[f32]| -> Result<Tensor> {
            Ok(Tensor::from_vec(values.to_vec(), &[1, z, 1, 1, 1])?.to_device(device)?)
        };
        let post_quant_conv =
            CausalConv::load(&root.pp("post_quant_conv"), z, z, [1, 1, 1], &mut slots)?;
        let conv_in = CausalConv::load(&w.pp("conv_in"), z, dims[0], [3, 3, 3], &mut slots)?;
        let mid_block = MidBlock::load(&w.pp("mid_block"), dims[0], &mut slots)?;
        let up_blocks = config
            .up_blocks()
            .into_iter()
            .enumerate()
            .map(|(i, layout)| {
                UpBlock::load(
                    &w.pp("up_blocks").pp(i),
                    layout,
                    config.num_res_blocks,
                    &mut slots,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let last = *dims.last().unwrap_or(&dims[0]);
        let norm_out = RmsNorm::load(&w.pp("norm_out"), &[last, 1, 1, 1])?;
        let conv_out = CausalConv::load(
            &w.pp("conv_out"),
            last,
            config.out_channels,
            [3, 3, 3],
            &mut slots,
        )?;
        Ok(WanVaeDecoder {
            device,
            dtype,
            latents_mean: channel_vector(&config.latents_mean)?,
            latents_std: channel_vector(&config.latents_std)?,
            config,
            post_quant_conv,
            conv_in,
            mid_block,
            up_blocks,
            norm_out,
            conv_out,
            cache_slots: slots.count(),
        })
    }

    /// The validated config.
    pub fn config(&self) -> &VaeConfig {
        &self.config
    }

    /// The device the weights live on and chunks run on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The storage dtype of weights, activations and decoded frames.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Frame-cache slots a stream holds: one per conv with a time extent (32 for Wan 2.1: conv_in,
    /// 4 in the mid block, 6 + 1 time_conv in each upsample3d block, 6 in the others, conv_out).
    pub fn cache_slots(&self) -> usize {
        self.cache_slots
    }

    /// Starts a request: latents of `latent_height` × `latent_width` (any size ≥ 1; the video is
    /// `spatial_scale` times larger).
    pub fn new_stream(&self, latent_height: usize, latent_width: usize) -> Result<DecodeStream> {
        if latent_height == 0 || latent_width == 0 {
            return Err(VaeError::EmptyLatentSize {
                height: latent_height,
                width: latent_width,
            });
        }
        Ok(DecodeStream {
            latent_height,
            latent_width,
            batch: None,
            latent_frames_decoded: 0,
            caches: vec![None; self.cache_slots],
        })
    }

    /// Decodes the next latent frames of a stream: latent [B, z_dim, n, h, w] in the DiT's normalised
    /// space (n ≥ 1, any device and dtype: it is moved to the decoder's) → video
    /// [B, out_channels, F, 8h, 8w] in [−1, 1] on the decoder's device in its dtype, with
    /// F = 1 + 4(n − 1) when the chunk starts the stream and 4n after. The frames returned are
    /// final. The result does not depend on how the latent is cut into chunks: the decoder runs one
    /// pass per latent frame, as diffusers does, so memory is bounded by one latent frame's
    /// activations (plus the F frames returned), and the passes are queued back to back (on a GPU
    /// the host never waits between them). On error the stream is left as it was.
    pub fn decode_chunk(&self, stream: &mut DecodeStream, latent: &Tensor) -> Result<Tensor> {
        self.decode_chunk_with(stream, latent, &Unsharded)
    }

    /// [`decode_chunk`](Self::decode_chunk) with the convolutions and attention run by `ops` (a spatially
    /// sharded decode passes its halo-exchanging implementation; `latent` is then this rank's rows).
    pub fn decode_chunk_with(
        &self,
        stream: &mut DecodeStream,
        latent: &Tensor,
        ops: &dyn SpatialOps,
    ) -> Result<Tensor> {
        self.check_chunk(stream, latent)?;
        let latent = latent.to_device(self.device)?.to_dtype(self.dtype)?;
        let frames = latent.shape()[2];
        let _span = tracing::debug_span!(
            "vae_decode_chunk",
            first_latent_frame = stream.latent_frames_decoded,
            latent_frames = frames
        )
        .entered();
        // Work on a copy of the slots (tensor clones share storage) and commit only on success.
        let mut caches = stream.caches.clone();
        let mut videos = Vec::with_capacity(frames);
        for t in 0..frames {
            let mut pass = Pass {
                ops,
                caches: &mut caches,
                first_chunk: stream.latent_frames_decoded + t == 0,
            };
            let frame = if frames == 1 {
                latent.clone()
            } else {
                latent.narrow(2, t, 1)?
            };
            videos.push(self.forward(&mut pass, &frame)?);
        }
        let video = match videos.len() {
            1 => videos.swap_remove(0),
            _ => Tensor::concat(&videos.iter().collect::<Vec<_>>(), 2)?,
        };
        stream.caches = caches;
        stream.batch = Some(latent.shape()[0]);
        stream.latent_frames_decoded += frames;
        Ok(video)
    }

    /// Decodes a whole latent [B, z_dim, T, h, w] → [B, out_channels, 1 + 4(T − 1), 8h, 8w]: one
    /// chunk of a fresh stream (one pass per latent frame, as diffusers does).
    pub fn decode(&self, latent: &Tensor) -> Result<Tensor> {
        let shape = latent.shape();
        if shape.len() != 5 {
            return Err(VaeError::LatentRank {
                z_dim: self.config.z_dim,
                shape: shape.to_vec(),
            });
        }
        self.decode_chunk(&mut self.new_stream(shape[3], shape[4])?, latent)
    }

    fn check_chunk(&self, stream: &DecodeStream, latent: &Tensor) -> Result<()> {
        let shape = latent.shape();
        let z_dim = self.config.z_dim;
        let &[batch, channels, frames, height, width] = shape else {
            return Err(VaeError::LatentRank {
                z_dim,
                shape: shape.to_vec(),
            });
        };
        if channels != z_dim {
            return Err(VaeError::LatentChannels {
                expected: z_dim,
                got: channels,
                shape: shape.to_vec(),
            });
        }
        if frames == 0 || batch == 0 {
            return Err(VaeError::EmptyChunk {
                shape: shape.to_vec(),
            });
        }
        let stream_batch = stream.batch.unwrap_or(batch);
        if (batch, height, width) != (stream_batch, stream.latent_height, stream.latent_width) {
            return Err(VaeError::ChunkMismatch {
                batch: stream_batch,
                height: stream.latent_height,
                width: stream.latent_width,
                got_batch: batch,
                got_height: height,
                got_width: width,
            });
        }
        if stream.caches.len() != self.cache_slots {
            return Err(VaeError::ForeignStream {
                expected: self.cache_slots,
                got: stream.caches.len(),
            });
        }
        Ok(())
    }

    /// latent [B, z, n, h, w] (normalised) → video [B, out_channels, F, 8h, 8w], clamped.
    fn forward(&self, pass: &mut Pass, latent: &Tensor) -> Result<Tensor> {
        // De-normalise as the pipeline does (latent · std + mean, per channel).
        let z = add(&mul(latent, &self.latents_std)?, &self.latents_mean)?;
        let z = self.post_quant_conv.forward(pass, &z)?;
        let mut x = self.conv_in.forward(pass, &z)?;
        x = self.mid_block.forward(pass, &x)?;
        for block in &self.up_blocks {
            x = block.forward(pass, &x)?;
        }
        let x = self.norm_out.forward_silu(&x)?;
        let x = self.conv_out.forward(pass, &x)?;
        Ok(clamp(&x, -1.0, 1.0)?)
    }
}
