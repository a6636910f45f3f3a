//! The parallel VAE on two GPUs over NCCL (feature `cuda`) against the one-GPU decode of the same
//! weights: halos, gathered keys/values and the decoded bands cross NCCL device to device
//! (`common/src/collectives/wire.rs`), one thread per GPU in one process, latent frame 0 alone and
//! then the rest in one chunk (the one-GPU reference: one latent frame per chunk), the video
//! gathered to rank 0 on cuda:0.
//!
//! Cases, each in f32 and bf16, each split along the height and along the width:
//! - base16 (the diffusers fixture's topology: base 16, channels up to 64) on the fixture's latent
//!   (T = 5, 6 × 10: even bands, 3 + 3 rows or 5 + 5 columns) and on a random latent (T = 3, 7 × 9:
//!   uneven bands, 4 + 3 rows or 5 + 4 columns);
//! - the real Wan 2.1 VAE (base 96, channels up to 384, so the mid-block attention is one head of 384)
//!   with seeded random weights on a small random latent (T = 4, 9 × 12: 5 + 4 rows, 6 + 6 columns).
//!
//! Halo exchanges run stream-ordered (no host wait) once their conv shapes have run in the process:
//! from a case's fourth pass (latent frame) on (the caches grow to their 2 frames over passes 1 and
//! 2; no two cases share a shape); the attention's key/value gather from its second pass on. So
//! every case checks the stream-ordered gather, and the T = 5 fixture and the T = 4 Wan latent the
//! stream-ordered halos too, against one GPU, with no host wait between the passes of the second
//! chunk; a race between the kernels' and NCCL's streams there shows as garbage, far outside the
//! bounds below.
//!
//! Skips (with a message) with fewer than 2 GPUs or without libcuda/libnccl, but fails when the
//! environment sets `DITSTREAM_REQUIRE_GPUS` ≥ 2, as `scripts/gpu-vae-bench.sh` does. Each comparison
//! prints an `VAE_NCCL` line that the script summarises.
//!
//! ## Tolerances
//! The two-GPU decode computes the same function as the one-GPU decode: every conv sees the same input
//! values (neighbour rows, or zeros exactly where the unsharded conv pads), the attention every key in
//! the frame's order (the CPU thread backend shows it bitwise: `parallel_vae.rs`). What may differ on
//! the GPU is f32 summation order: cuBLASLt picks its algorithm (and split-K) per GEMM shape, and a
//! rank's convs have about half the pixels of the unsharded ones.
//! - f32: a reordered K-term f32 sum differs by ~√K·2⁻²⁴ relative (K ≤ 384·27 ≈ 10⁴: ≈ 6e-6); about 40
//!   layers lie in series, the RMS norms keep activations O(1), and the errors add roughly in quadrature
//!   (≈ 4e-5) on outputs within [−1, 1]: **max |2 GPUs − 1 GPU| ≤ 1e-4** per element, the bound
//!   `vae_cuda.rs` uses against diffusers for the same reason.
//! - bf16: each side stores every activation in bf16 (u = 2⁻⁸ relative). A tiny f32 difference flips a
//!   value to the neighbouring bf16 only when it lies that close to a rounding boundary, and the flip
//!   then propagates like a rounding error. So the gap is at most that of two *independent* bf16
//!   rounding chains: with N ≈ 115 roundings on the latent → video path (per residual block: 2 norms,
//!   2 SiLUs, 2 convs, the add; 14 blocks, plus attention, upsamplers, conv_in/out, norm_out, clamp),
//!   each uniform within ±u (RMS u/√3), in quadrature, two chains give RMS(diff)/RMS(want) ≤
//!   √2·(u/√3)·√N ≈ 0.034; a factor 2 covers amplification the count ignores (as in the denoiser's
//!   `parallel_nccl.rs`): **RMS(diff) ≤ 0.068·RMS(want), max ≤ 5× that** (a Gaussian's largest of
//!   ≤ 10⁶ draws is < 5σ). Most values see identical inputs on both paths, so measured gaps sit far
//!   below; what the bounds catch is what the device path can break — a race between the kernels' and
//!   NCCL's streams, a stale or unwritten receive buffer, a wrong row — garbage with RMS error ≳ 0.3.

#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, ensure};
use ditstream_common::collectives::nccl::{NcclComm, NcclWorld};
use ditstream_common::collectives::{CommWorld, Communicator};
use ditstream_common::config::VaeSplitDim;
use ditstream_decoder::parallel::ParallelVaeDecoder;
use ditstream_decoder::vae::{VaeConfig, WanVaeDecoder};
use ditstream_kernels::weights::{Checkpoint, RandomWeights, WeightSource};
use ditstream_kernels::{DType, Device, Tensor};

/// f32: max |2 GPUs − 1 GPU| per element (derivation above).
const F32_MAX: f64 = 1e-4;
/// bf16: RMS(diff)/RMS(want) bound 2·√2·(u/√3)·√N (derivation above); the max is 5× that.
const BF16_U: f64 = 1.0 / 256.0;
const BF16_ROUNDINGS: f64 = 115.0;
/// Per-collective timeout (the first chunks compile kernels on both GPUs).
const TIMEOUT: Duration = Duration::from_secs(180);

fn bf16_rms_bound() -> f64 {
    2.0 * 2f64.sqrt() * BF16_U / 3f64.sqrt() * BF16_ROUNDINGS.sqrt()
}

/// The fixture folder: under the crate as built, or, for an executable carried to another machine
/// (the GPU scripts run it from the repository root), under `decoder/` of the working directory.
fn fixture_dir(name: &str) -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let fixtures = if built.is_dir() {
        built
    } else {
        PathBuf::from("decoder/tests/fixtures")
    };
    fixtures.join(name)
}

/// Which weights a case decodes with; each rank builds its own copy on its GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Model {
    /// `vae_base16`: base 16, dim_mult [1, 2, 4, 4], 2 residual blocks (diffusers' weights).
    Base16,
    /// The Wan 2.1 VAE (diffusers' defaults: base 96) with `RandomWeights::new(7)`.
    Wan21Random,
}

impl Model {
    fn load(self, device: Device, dtype: DType) -> Result<WanVaeDecoder> {
        Ok(match self {
            Model::Base16 => {
                WanVaeDecoder::load_on(&fixture_dir("vae_base16").join("vae"), device, dtype)?
            }
            Model::Wan21Random => WanVaeDecoder::from_weights_on(
                VaeConfig::wan21(),
                &RandomWeights::new(7),
                device,
                dtype,
            )?,
        })
    }

    /// The latents this model decodes: (label, [1, 16, T, h, w] on the host).
    fn latents(self) -> Result<Vec<(&'static str, Tensor)>> {
        Ok(match self {
            Model::Base16 => {
                let io = Checkpoint::open_dir(&fixture_dir("vae_base16"), "io")?;
                vec![
                    (
                        "fixture 5x6x10",
                        io.tensor("t5.latent", &[1, 16, 5, 6, 10], DType::F32)?,
                    ),
                    (
                        "random 3x7x9",
                        Tensor::randn(&[1, 16, 3, 7, 9], DType::F32, 31, Device::Cpu)?,
                    ),
                ]
            }
            Model::Wan21Random => vec![(
                "random 4x9x12",
                Tensor::randn(&[1, 16, 4, 9, 12], DType::F32, 32, Device::Cpu)?,
            )],
        })
    }
}

const MODELS: [Model; 2] = [Model::Base16, Model::Wan21Random];
const DTYPES: [DType; 2] = [DType::F32, DType::BF16];
const SPLITS: [VaeSplitDim; 2] = [VaeSplitDim::Height, VaeSplitDim::Width];

/// One latent frame per chunk on one decoder → the whole video as f32 values.
fn decode_one_gpu(decoder: &WanVaeDecoder, latent: &Tensor) -> Result<Vec<f32>> {
    let shape = latent.shape();
    let mut stream = decoder.new_stream(shape[3], shape[4])?;
    let mut chunks = Vec::new();
    for t in 0..shape[2] {
        chunks.push(decoder.decode_chunk(&mut stream, &latent.narrow(2, t, 1)?)?);
    }
    Ok(Tensor::concat(&chunks.iter().collect::<Vec<_>>(), 2)?.to_vec_f32()?)
}

/// Decodes `latent` on this rank's band in two chunks, latent frame 0 alone and then the rest in
/// one call (its passes and their transfers queued back to back), gathering each chunk on rank 0;
/// rank 0 returns the whole video. Hands the communicator back (after a barrier, so that no rank
/// leaves while the other still gathers).
fn decode_two_gpus(
    decoder: Arc<WanVaeDecoder>,
    comm: NcclComm,
    split: VaeSplitDim,
    latent: &Tensor,
) -> Result<(NcclComm, Option<Vec<f32>>)> {
    let shape = latent.shape();
    let device = decoder.device();
    let dtype = decoder.dtype();
    let mut vae = ParallelVaeDecoder::new(decoder, comm, split);
    let mut stream = vae.new_stream(shape[3], shape[4])?;
    let mut chunks = Vec::new();
    let calls = [(0, 1), (1, shape[2] - 1)];
    for (t, n) in calls.into_iter().filter(|&(_, n)| n > 0) {
        let band = stream.band_of(&latent.narrow(2, t, n)?)?;
        let frames = vae.decode_chunk(&mut stream, &band)?;
        ensure!(
            frames.device() == device && frames.dtype() == dtype,
            "rank {}: frames on {} as {:?}",
            vae.rank(),
            frames.device(),
            frames.dtype()
        );
        let gathered = vae.gather_frames(&stream, &frames)?;
        ensure!(
            gathered.is_some() == (vae.rank() == 0),
            "only rank 0 gathers"
        );
        if let Some(video) = gathered {
            ensure!(video.device() == device && video.dtype() == dtype);
            chunks.push(video);
        }
    }
    let comm = vae
        .into_communicator()
        .context("the decoder failed earlier")?;
    comm.barrier()?;
    let video = (!chunks.is_empty())
        .then(|| -> Result<Vec<f32>> {
            Ok(Tensor::concat(&chunks.iter().collect::<Vec<_>>(), 2)?.to_vec_f32()?)
        })
        .transpose()?;
    Ok((comm, video))
}

/// A case's key: (model, dtype, latent label, split).
type CaseKey = (Model, DType, &'static str, VaeSplitDim);

/// Every case on both GPUs; rank 0's videos in case order.
fn two_gpu_runs() -> Result<Vec<(CaseKey, Vec<f32>)>> {
    let results = NcclWorld::run_local(2, TIMEOUT, |world| -> Result<Vec<(CaseKey, Vec<f32>)>> {
        let rank = world.rank();
        let mut comm = world
            .split(&[vec![0, 1]])?
            .context("rank not in its own group")?;
        let mut videos = Vec::new();
        for model in MODELS {
            for dtype in DTYPES {
                let decoder = Arc::new(model.load(Device::Cuda(rank), dtype)?);
                for (label, latent) in model.latents()? {
                    for split in SPLITS {
                        let (back, video) = decode_two_gpus(decoder.clone(), comm, split, &latent)
                            .with_context(|| format!("{model:?} {dtype:?} {label} {split:?}"))?;
                        comm = back;
                        if let Some(video) = video {
                            videos.push(((model, dtype, label, split), video));
                        }
                    }
                }
            }
        }
        Ok(videos)
    })?;
    let mut rank0 = None;
    for (r, result) in results.into_iter().enumerate() {
        let videos = result
            .map_err(|e| anyhow!("rank {r} did not start or panicked: {e}"))?
            .with_context(|| format!("rank {r}"))?;
        if r == 0 {
            rank0 = Some(videos);
        } else {
            ensure!(videos.is_empty(), "rank {r} gathered frames");
        }
    }
    rank0.context("no rank 0")
}

/// (max |got − want|, RMS(got − want) / RMS(want)).
fn errors(got: &[f32], want: &[f32]) -> (f64, f64) {
    assert_eq!(got.len(), want.len());
    let n = want.len().max(1) as f64;
    let rms_want = (want.iter().map(|&w| f64::from(w).powi(2)).sum::<f64>() / n)
        .sqrt()
        .max(f64::MIN_POSITIVE);
    let (mut max, mut sum_sq) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let d = (f64::from(g) - f64::from(w)).abs();
        if d.is_nan() {
            return (f64::NAN, f64::NAN);
        }
        max = max.max(d);
        sum_sq += d * d;
    }
    (max, (sum_sq / n).sqrt() / rms_want)
}

#[test]
fn two_gpu_decode_matches_one_gpu() -> Result<()> {
    if !ditstream_kernels::testing::test_gpus(2) {
        return Ok(());
    }
    let started = Instant::now();
    // One-GPU references on cuda:0, per (model, dtype, latent).
    let mut want = Vec::new();
    for model in MODELS {
        for dtype in DTYPES {
            let decoder = model.load(Device::Cuda(0), dtype)?;
            for (label, latent) in model.latents()? {
                want.push(((model, dtype, label), decode_one_gpu(&decoder, &latent)?));
            }
        }
    }
    let got = two_gpu_runs()?;
    ensure!(
        got.len() == want.len() * SPLITS.len(),
        "{} two-GPU videos for {} cases",
        got.len(),
        want.len() * SPLITS.len()
    );
    let mut failures = Vec::new();
    for ((model, dtype, label, split), video) in &got {
        let (_, reference) = want
            .iter()
            .find(|(key, _)| *key == (*model, *dtype, *label))
            .context("no one-GPU reference")?;
        let (max, rel_rms) = errors(video, reference);
        let (ok, bound) = match dtype {
            DType::F32 => (max <= F32_MAX, format!("max {F32_MAX:.0e}")),
            DType::BF16 => {
                let rms = bf16_rms_bound();
                let rms_want = (reference.iter().map(|&w| f64::from(w).powi(2)).sum::<f64>()
                    / reference.len().max(1) as f64)
                    .sqrt();
                (
                    rel_rms <= rms && max <= 5.0 * rms * rms_want,
                    format!("rms/rms {rms:.3} max {:.3}", 5.0 * rms * rms_want),
                )
            }
        };
        println!(
            "VAE_NCCL\t{model:?}\t{dtype:?}\t{label}\t{split:?}\t{max:.3e}\t{rel_rms:.3e}\t{bound}\t{}",
            if ok { "ok" } else { "FAIL" }
        );
        if !ok {
            failures.push(format!(
                "{model:?} {dtype:?} {label} {split:?}: max {max:e}, rms/rms {rel_rms:e} ({bound})"
            ));
        }
    }
    eprintln!(
        "{} cases on 2 GPUs in {:.1} s",
        got.len(),
        started.elapsed().as_secs_f32()
    );
    ensure!(
        failures.is_empty(),
        "outside tolerance:\n{}",
        failures.join("\n")
    );
    Ok(())
}

#[test]
fn bf16_bound_is_the_derived_one() {
    let b = bf16_rms_bound();
    assert!((b - 0.0684).abs() < 1e-3, "{b}");
}
