//! The Wan 2.1 VAE decoder against diffusers 0.42.1, and chunked decoding against whole decoding.
//!
//! Fixtures (`scripts/make_fixtures.py vae`, diffusers on CPU, fp32): diffusers' own test config
//! (base_dim 3, dim_mult [1, 1, 1, 1], 1 res block: 1-channel layers; latent 2×2) and the real topology at
//! base_dim 16 (dim_mult [1, 2, 4, 4], 2 res blocks: channel halving, the shortcut conv, two upsample3d
//! stages; latent 6×10), each with latent T ∈ {1, 2, 3, 5}, which covers chunk 0, chunk 1 and later
//! chunks of upsample3d's first-chunk rule. The video is `vae.decode(latent·std + mean)`, clamped.
//!
//! Tolerances.
//! - Against diffusers: |ours − diffusers| ≤ 1e-4 per element on outputs in [−1, 1] (5e-5 of the range).
//!   Both sides are fp32 with different summation orders (im2col + GEMM here, oneDNN there). A
//!   reduction of length K carries a relative rounding error of about √K·u (u = 2⁻²⁴ ≈ 6e-8); the
//!   longest is 64·27 = 1728 terms (base16's 3×3×3 convs at width 64), so ≈ 2.5e-6 per conv, and about
//!   36 reductions lie in series (conv_in, 4 mid convs and the attention, 24 residual convs, 3 upsample
//!   convs, 2 time_convs, conv_out). The RMS norms keep activations O(1), so errors add roughly in
//!   quadrature: ≈ 1.5e-5 expected, with headroom for layer gains. Measured: 3.4e-6 (base16, T = 5) and
//!   4.2e-7 (diffusers test config). A semantic error (wrong padding, cache or first-chunk rule, swapped
//!   q/k/v) moves outputs by 1e-2 to 1 (see `without_the_cache_later_frames_differ`).
//! - Chunked against whole: the same ops on the same frames, so the only freedom is GEMM blocking;
//!   ≤ 1e-6 is asserted, and the measured difference is 0 (bitwise identical).
//!
//! Timing (debug build, 2 cores): one base16 T = 5 decode takes ≈ 2.4 s; this file ≈ 7–11 s in all.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result, ensure};
use ditstream_decoder::vae::{VaeConfig, VaeError, WanVaeDecoder};
use ditstream_kernels::testing::{assert_close, max_abs_diff};
use ditstream_kernels::weights::{Checkpoint, WeightSource, WeightsError};
use ditstream_kernels::{DType, Device, Tensor};

/// |ours − diffusers| per element (derivation above).
const DIFFUSERS_ATOL: f32 = 1e-4;
/// |chunked − whole| per element: the same arithmetic, so identical up to GEMM blocking.
const CHUNKED_ATOL: f32 = 1e-6;

fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A fixture: its decoder, its latent size and its inputs/outputs.
struct Fixture {
    decoder: WanVaeDecoder,
    height: usize,
    width: usize,
    io: Checkpoint,
}

impl Fixture {
    fn open(name: &str, height: usize, width: usize) -> Result<Self> {
        let dir = fixture_dir(name);
        Ok(Fixture {
            decoder: WanVaeDecoder::load(&dir.join("vae"))?,
            height,
            width,
            io: Checkpoint::open_dir(&dir, "io")?,
        })
    }

    fn diffusers_test() -> Result<Self> {
        Self::open("vae_diffusers_test", 2, 2)
    }

    fn base16() -> Result<Self> {
        Self::open("vae_base16", 6, 10)
    }

    /// Latent [1, 16, t, h, w] (the DiT's normalised space).
    fn latent(&self, t: usize) -> Result<Tensor> {
        let shape = [1, 16, t, self.height, self.width];
        Ok(self
            .io
            .tensor(&format!("t{t}.latent"), &shape, DType::F32)?)
    }

    /// diffusers' video [1, 3, 1 + 4(t − 1), 8h, 8w].
    fn video(&self, t: usize) -> Result<Tensor> {
        let shape = [1, 3, 1 + 4 * (t - 1), 8 * self.height, 8 * self.width];
        Ok(self.io.tensor(&format!("t{t}.video"), &shape, DType::F32)?)
    }

    /// Decodes `latent` as one stream fed in chunks of the given latent frame counts, checking each
    /// chunk's frame count, and returns the frames joined along T.
    fn decode_in_chunks(&self, latent: &Tensor, chunks: &[usize]) -> Result<Tensor> {
        let mut stream = self.decoder.new_stream(self.height, self.width)?;
        let mut start = 0;
        let mut parts = Vec::new();
        for &n in chunks {
            let frames = self
                .decoder
                .decode_chunk(&mut stream, &latent.narrow(2, start, n)?)?;
            let expected = if start == 0 { 1 + 4 * (n - 1) } else { 4 * n };
            ensure!(
                frames.shape() == [1, 3, expected, 8 * self.height, 8 * self.width],
                "chunk {chunks:?} at latent frame {start}: got shape {:?}",
                frames.shape()
            );
            start += n;
            parts.push(frames);
        }
        ensure!(stream.latent_frames_decoded() == start);
        Ok(Tensor::concat(&parts.iter().collect::<Vec<_>>(), 2)?)
    }

    /// The whole latent in one pass equals diffusers; every chunking of it equals the one pass.
    fn check(&self, t: usize) -> Result<()> {
        let latent = self.latent(t)?;
        let whole = self.decode_in_chunks(&latent, &[t])?;
        let expected = self.video(t)?;
        eprintln!(
            "T = {t}: max |ours − diffusers| = {:e}",
            max_abs_diff(&whole, &expected)?
        );
        assert_close(&whole, &expected, DIFFUSERS_ATOL, 0.0);

        let mut chunkings: Vec<Vec<usize>> = vec![
            vec![1; t],                                        // one latent frame at a time
            (0..t).step_by(2).map(|s| 2.min(t - s)).collect(), // chunks of 2 (a 2-frame first chunk)
        ];
        match t {
            5 => chunkings.push(vec![1, 3, 1]), // uneven
            3 => chunkings.push(vec![1, 2]),    // a multi-frame later chunk
            _ => {}
        }
        chunkings.dedup(); // T = 1: [1] twice
        for chunks in chunkings {
            let chunked = self.decode_in_chunks(&latent, &chunks)?;
            let diff = max_abs_diff(&chunked, &whole)?;
            eprintln!("T = {t}, chunks {chunks:?}: max |chunked − whole| = {diff:e}");
            ensure!(diff <= CHUNKED_ATOL, "chunks {chunks:?}: {diff:e}");
        }
        // `decode` (the whole-latent convenience, one latent frame per pass) is the same function.
        ensure!(max_abs_diff(&self.decoder.decode(&latent)?, &whole)? <= CHUNKED_ATOL);
        Ok(())
    }
}

#[test]
fn diffusers_test_config_matches_diffusers() -> Result<()> {
    let fixture = Fixture::diffusers_test()?;
    for t in [1, 2, 3, 5] {
        fixture.check(t).with_context(|| format!("T = {t}"))?;
    }
    Ok(())
}

#[test]
fn base16_t1_t2_match_diffusers() -> Result<()> {
    let fixture = Fixture::base16()?;
    fixture.check(1)?;
    fixture.check(2)
}

#[test]
fn base16_t3_matches_diffusers() -> Result<()> {
    Fixture::base16()?.check(3)
}

#[test]
fn base16_t5_matches_diffusers() -> Result<()> {
    Fixture::base16()?.check(5)
}

/// The cache carries real information: restarting the stream mid-video changes the later frames by
/// far more than the parity tolerance (so that tolerance would catch a broken cache).
#[test]
fn without_the_cache_later_frames_differ() -> Result<()> {
    let fixture = Fixture::diffusers_test()?;
    let latent = fixture.latent(3)?;
    let expected = fixture.video(3)?;
    let mut restarted = fixture.decoder.new_stream(2, 2)?;
    let tail = fixture
        .decoder
        .decode_chunk(&mut restarted, &latent.narrow(2, 2, 1)?)?;
    // A fresh stream treats latent frame 2 as frame 0: 1 frame out, unlike the 4 it owes in context.
    ensure!(tail.shape()[2] == 1);
    let diff = max_abs_diff(&tail, &expected.narrow(2, 5, 1)?)?;
    eprintln!("frame decoded without its history differs by {diff:e}");
    ensure!(diff > 100.0 * DIFFUSERS_ATOL, "{diff:e}");
    Ok(())
}

/// A [`WeightSource`] that records every name asked for.
struct Recording<S> {
    inner: S,
    asked: Mutex<Vec<(String, Vec<usize>)>>,
}

impl<S: WeightSource> WeightSource for Recording<S> {
    fn tensor(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor, WeightsError> {
        if let Ok(mut asked) = self.asked.lock() {
            asked.push((name.to_string(), shape.to_vec()));
        }
        self.inner.tensor(name, shape, dtype)
    }
}

/// Zeros of any requested shape (allocation only: lets the full-size layout be built cheaply).
struct Zeros;

impl WeightSource for Zeros {
    fn tensor(&self, _: &str, shape: &[usize], dtype: DType) -> Result<Tensor, WeightsError> {
        Ok(Tensor::zeros(shape, dtype, Device::Cpu)?)
    }
}

/// The decoder reads every tensor of the fixtures' checkpoints (decoder.* and post_quant_conv.*), and
/// nothing else.
#[test]
fn every_checkpoint_tensor_is_read() -> Result<()> {
    for name in ["vae_diffusers_test", "vae_base16"] {
        let folder = fixture_dir(name).join("vae");
        let source = Recording {
            inner: Checkpoint::open_dir(&folder, "diffusion_pytorch_model")?,
            asked: Mutex::new(Vec::new()),
        };
        let config = VaeConfig::from_file(&folder.join("config.json"))?;
        WanVaeDecoder::from_weights(config, &source)?;
        let asked: BTreeSet<String> = source
            .asked
            .into_inner()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        let stored: BTreeSet<String> = source.inner.names().map(str::to_string).collect();
        ensure!(
            asked == stored,
            "{name}: asked {asked:?}, stored {stored:?}"
        );
    }
    Ok(())
}

/// At the real Wan 2.1 size the decoder asks for the names and shapes of the diffusers checkpoint
/// (`reference/wan.md` §2.3) and holds the 32 cache slots listed there.
#[test]
fn wan21_layout_matches_the_checkpoint_names() -> Result<()> {
    let source = Recording {
        inner: Zeros,
        asked: Mutex::new(Vec::new()),
    };
    let decoder = WanVaeDecoder::from_weights(VaeConfig::wan21(), &source)?;
    ensure!(decoder.cache_slots() == 32, "{}", decoder.cache_slots());
    let asked = source
        .asked
        .into_inner()
        .map_err(|_| anyhow::anyhow!("poisoned"))?;
    let shape_of = |name: &str| {
        asked
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, s)| s.clone())
    };
    let expected: [(&str, &[usize]); 14] = [
        ("post_quant_conv.weight", &[16, 16, 1, 1, 1]),
        ("decoder.conv_in.weight", &[384, 16, 3, 3, 3]),
        ("decoder.conv_out.weight", &[3, 96, 3, 3, 3]),
        ("decoder.norm_out.gamma", &[96, 1, 1, 1]),
        ("decoder.mid_block.attentions.0.norm.gamma", &[384, 1, 1]),
        (
            "decoder.mid_block.attentions.0.to_qkv.weight",
            &[1152, 384, 1, 1],
        ),
        (
            "decoder.mid_block.attentions.0.proj.weight",
            &[384, 384, 1, 1],
        ),
        (
            "decoder.up_blocks.1.resnets.0.conv_shortcut.weight",
            &[384, 192, 1, 1, 1],
        ),
        (
            "decoder.up_blocks.0.upsamplers.0.time_conv.weight",
            &[768, 384, 3, 1, 1],
        ),
        (
            "decoder.up_blocks.1.upsamplers.0.time_conv.weight",
            &[768, 384, 3, 1, 1],
        ),
        (
            "decoder.up_blocks.0.upsamplers.0.resample.1.weight",
            &[192, 384, 3, 3],
        ),
        (
            "decoder.up_blocks.1.upsamplers.0.resample.1.weight",
            &[192, 384, 3, 3],
        ),
        (
            "decoder.up_blocks.2.upsamplers.0.resample.1.weight",
            &[96, 192, 3, 3],
        ),
        (
            "decoder.up_blocks.3.resnets.2.conv2.weight",
            &[96, 96, 3, 3, 3],
        ),
    ];
    for (name, shape) in expected {
        ensure!(
            shape_of(name).as_deref() == Some(shape),
            "{name}: {:?}",
            shape_of(name)
        );
    }
    // Only up block 1 changes width (192 → 384) inside its residual blocks; up_blocks.2 has none.
    let shortcuts: Vec<&String> = asked
        .iter()
        .map(|(n, _)| n)
        .filter(|n| n.contains("conv_shortcut.weight"))
        .collect();
    ensure!(shortcuts.len() == 1, "{shortcuts:?}");
    ensure!(shape_of("decoder.up_blocks.3.upsamplers.0.resample.1.weight").is_none());
    Ok(())
}

#[test]
fn bad_latents_are_refused_with_their_values() -> Result<()> {
    let fixture = Fixture::diffusers_test()?;
    let decoder = &fixture.decoder;
    let latent = fixture.latent(2)?;
    let mut stream = decoder.new_stream(2, 2)?;

    let wrong_channels = Tensor::zeros(&[1, 15, 1, 2, 2], DType::F32, Device::Cpu)?;
    let err = decoder
        .decode_chunk(&mut stream, &wrong_channels)
        .unwrap_err();
    ensure!(
        matches!(
            err,
            VaeError::LatentChannels {
                expected: 16,
                got: 15,
                ..
            }
        ),
        "{err}"
    );

    let rank4 = Tensor::zeros(&[1, 16, 2, 2], DType::F32, Device::Cpu)?;
    let err = decoder.decode_chunk(&mut stream, &rank4).unwrap_err();
    ensure!(matches!(err, VaeError::LatentRank { .. }), "{err}");

    let no_frames = Tensor::zeros(&[1, 16, 0, 2, 2], DType::F32, Device::Cpu)?;
    let err = decoder.decode_chunk(&mut stream, &no_frames).unwrap_err();
    ensure!(matches!(err, VaeError::EmptyChunk { .. }), "{err}");

    let err = decoder.new_stream(0, 4).unwrap_err();
    ensure!(
        matches!(
            err,
            VaeError::EmptyLatentSize {
                height: 0,
                width: 4
            }
        ),
        "{err}"
    );

    // A chunk of another spatial size than the stream's, after a good first chunk.
    decoder.decode_chunk(&mut stream, &latent.narrow(2, 0, 1)?)?;
    let wider = Tensor::zeros(&[1, 16, 1, 2, 3], DType::F32, Device::Cpu)?;
    let err = decoder.decode_chunk(&mut stream, &wider).unwrap_err();
    ensure!(
        matches!(
            err,
            VaeError::ChunkMismatch {
                height: 2,
                width: 2,
                got_height: 2,
                got_width: 3,
                ..
            }
        ),
        "{err}"
    );
    ensure!(err.to_string().contains("w=3"), "{err}");

    // Errors leave the stream as it was: the next good chunk continues the video exactly.
    let second = decoder.decode_chunk(&mut stream, &latent.narrow(2, 1, 1)?)?;
    let expected = decoder.decode(&latent)?.narrow(2, 1, 4)?;
    ensure!(max_abs_diff(&second, &expected)? <= CHUNKED_ATOL);

    // A stream belongs to the decoder that opened it.
    let other = Fixture::base16()?;
    let mut foreign = decoder.new_stream(6, 10)?;
    let err = other
        .decoder
        .decode_chunk(&mut foreign, &other.latent(1)?)
        .unwrap_err();
    ensure!(
        matches!(
            err,
            VaeError::ForeignStream {
                expected: 32,
                got: 24
            }
        ),
        "{err}"
    );
    Ok(())
}

/// A missing tensor, or one whose shape disagrees with the config, is named with both shapes.
#[test]
fn bad_checkpoints_name_the_tensor() -> Result<()> {
    struct Without<'a>(&'a Checkpoint, &'static str);
    impl WeightSource for Without<'_> {
        fn tensor(
            &self,
            name: &str,
            shape: &[usize],
            dtype: DType,
        ) -> Result<Tensor, WeightsError> {
            if name == self.1 {
                return Err(WeightsError::Missing {
                    origin: "test checkpoint".into(),
                    name: name.into(),
                });
            }
            self.0.tensor(name, shape, dtype)
        }
    }
    let folder = fixture_dir("vae_base16").join("vae");
    let checkpoint = Checkpoint::open_dir(&folder, "diffusion_pytorch_model")?;
    let config = VaeConfig::from_file(&folder.join("config.json"))?;

    let missing = "decoder.up_blocks.1.resnets.0.conv_shortcut.weight";
    let err = WanVaeDecoder::from_weights(config.clone(), &Without(&checkpoint, missing))
        .err()
        .context("a missing tensor must fail")?;
    ensure!(err.to_string().contains(missing), "{err}");

    // A config of another width than the checkpoint: the first tensor read names both shapes.
    let narrower = VaeConfig {
        base_dim: 8,
        ..config
    };
    let err = WanVaeDecoder::from_weights(narrower, &checkpoint)
        .err()
        .context("a shape mismatch must fail")?
        .to_string();
    ensure!(
        err.contains("decoder.conv_in.weight") && err.contains("[64, 16, 3, 3, 3]"),
        "{err}"
    );
    ensure!(err.contains("[32, 16, 3, 3, 3]"), "{err}");
    Ok(())
}

/// Loading a folder whose config the decoder cannot run names the file and the key.
#[test]
fn bad_config_files_name_the_file_and_key() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("ditstream-vae-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let cases = [
        (r#"{"is_residual": true, "z_dim": 16}"#, "is_residual"),
        (
            r#"{"z_dim": 16, "temperal_upsample": [true]}"#,
            "temperal_upsample",
        ),
        (r#"{"dim_mult": [1, 2]}"#, "temperal_downsample"),
    ];
    for (json, key) in cases {
        std::fs::write(dir.join("config.json"), json)?;
        let err = WanVaeDecoder::load(&dir)
            .err()
            .context("a bad config must fail")?
            .to_string();
        ensure!(
            err.contains(key) && err.contains("config.json"),
            "{json}: {err}"
        );
    }
    // A valid config without weights: the error names the folder and the file looked for.
    std::fs::write(dir.join("config.json"), "{}")?;
    let err = WanVaeDecoder::load(&dir)
        .err()
        .context("missing weights must fail")?
        .to_string();
    ensure!(err.contains("diffusion_pytorch_model"), "{err}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
