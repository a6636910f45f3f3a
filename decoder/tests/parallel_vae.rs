//! The parallel VAE on the CPU thread backend against the unsharded decode and against diffusers.
//!
//! Every case decodes the base16 fixture (latent 6 × 10, T = 5, real topology: three spatial
//! upsamples, two temporal) one latent frame per chunk on every rank, gathers each chunk's frames on
//! rank 0, and compares the whole video with `WanVaeDecoder::decode`. Splits: 2, 3, 4, 5 and 6 ranks
//! along the height (6 rows: 3+3, 2+2+2, 2+2+1+1 and 2+1+1+1+1 uneven, 6 single-row bands) and 2, 3,
//! 4, 5 along the width (10 columns: 4+3+3 and 3+3+2+2 uneven).
//!
//! Tolerances.
//! - Sharded against unsharded: ≤ 1e-6 per element. The halo gives each conv the same input values as
//!   the unsharded conv (neighbour rows, or zeros exactly where the unsharded conv zero-pads), and the
//!   CPU conv builds the same im2col column for each output pixel and reduces it with the same GEMM
//!   (its summation order depends on the reduction length, not on how many pixels a call computes).
//!   The attention sees all keys in the frame's order. So the result should be bitwise identical, as
//!   chunked decoding is (`vae_decode.rs`); 1e-6 leaves room for a GEMM whose blocking depends on the
//!   problem size (e.g. a future multithreaded CPU GEMM) and is still 10⁴ below the 1e-2 that a wrong
//!   halo row, a missing border zero or a misordered key produces. Measured: 0 (bitwise) in every case.
//! - Against diffusers: the 1e-4 of `vae_decode.rs` (derivation there), since sharded = unsharded.
//!
//! Timing (debug build, 2 shared cores): one unsharded base16 T = 5 decode ≈ 0.9 s; each sharded case
//! 0.6–0.8 s (the same arithmetic spread over P threads, plus the exchanges); the file ≈ 7.5 s.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, ensure};
use ditstream_common::collectives::cpu::{CpuComm, CpuWorld};
use ditstream_common::collectives::{CollectiveError, Communicator};
use ditstream_common::config::VaeSplitDim;
use ditstream_decoder::parallel::{ParallelVaeDecoder, ParallelVaeError};
use ditstream_decoder::vae::{VaeError, WanVaeDecoder};
use ditstream_kernels::testing::max_abs_diff;
use ditstream_kernels::weights::{Checkpoint, WeightSource};
use ditstream_kernels::{DType, Tensor};

/// |sharded − unsharded| per element (derivation above).
const SHARDED_ATOL: f32 = 1e-6;
/// |ours − diffusers| per element (derivation in `vae_decode.rs`).
const DIFFUSERS_ATOL: f32 = 1e-4;
/// The thread backend's wait limit: generous for a loaded 2-core box; a failing rank poisons its
/// group at once, so the failure tests finish far sooner.
const COMM_TIMEOUT: Duration = Duration::from_secs(60);

/// A fixture: the shared decoder, the latent size and diffusers' inputs/outputs.
struct Fixture {
    decoder: Arc<WanVaeDecoder>,
    height: usize,
    width: usize,
    io: Checkpoint,
}

impl Fixture {
    fn open(name: &str, height: usize, width: usize) -> Result<Self> {
        let dir: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name);
        Ok(Fixture {
            decoder: Arc::new(WanVaeDecoder::load(&dir.join("vae"))?),
            height,
            width,
            io: Checkpoint::open_dir(&dir, "io")?,
        })
    }

    fn base16() -> Result<Self> {
        Self::open("vae_base16", 6, 10)
    }

    fn diffusers_test() -> Result<Self> {
        Self::open("vae_diffusers_test", 2, 2)
    }

    /// Latent [1, 16, t, h, w].
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

    /// Decodes `latent` on `size` thread ranks split along `split`, one latent frame per chunk, and
    /// returns rank 0's gathered video (checking that the other ranks got none and that every band
    /// has the expected shape).
    fn decode_parallel(&self, latent: &Tensor, size: usize, split: VaeSplitDim) -> Result<Tensor> {
        let world = CpuWorld::new(size).with_timeout(COMM_TIMEOUT);
        let group: Vec<usize> = (0..size).collect();
        let results = world.run(|rank| -> Result<Option<Tensor>> {
            let comm = rank.group(&group)?;
            let mut vae = ParallelVaeDecoder::new(self.decoder.clone(), comm, split);
            let mut stream = vae.new_stream(self.height, self.width)?;
            let mut chunks = Vec::new();
            for t in 0..latent.shape()[2] {
                let band = stream.band_of(&latent.narrow(2, t, 1)?)?;
                let frames = vae.decode_chunk(&mut stream, &band)?;
                let axis = stream.shard().axis();
                ensure!(
                    frames.shape()[axis] == 8 * band.shape()[axis]
                        && frames.shape()[7 - axis] == 8 * band.shape()[7 - axis],
                    "rank {}: band {:?} decoded to {:?}",
                    vae.rank(),
                    band.shape(),
                    frames.shape()
                );
                let gathered = vae.gather_frames(&stream, &frames)?;
                ensure!(
                    gathered.is_some() == (vae.rank() == 0),
                    "only rank 0 gathers"
                );
                chunks.extend(gathered);
            }
            finish(vae)?;
            if chunks.is_empty() {
                return Ok(None);
            }
            Ok(Some(Tensor::concat(&chunks.iter().collect::<Vec<_>>(), 2)?))
        });
        // Every rank's failure, so that the one that failed first is in the message too.
        let mut failures = Vec::new();
        let mut video = None;
        for (r, result) in results.into_iter().enumerate() {
            match result {
                Ok(Ok(out)) if r == 0 => video = out,
                Ok(Ok(_)) => {}
                Ok(Err(e)) => failures.push(format!("rank {r}: {e:#}")),
                Err(panic) => failures.push(format!("rank {r} panicked: {panic}")),
            }
        }
        ensure!(
            failures.is_empty(),
            "{size} ranks split along {split:?}:\n{}",
            failures.join("\n")
        );
        video.context("rank 0 returned no video")
    }
}

/// Ends a rank's work: a barrier, so that no rank drops its communicator (which the thread backend
/// treats as leaving the group) while rank 0 is still gathering from the others.
fn finish(vae: ParallelVaeDecoder<CpuComm>) -> Result<()> {
    let comm = vae
        .into_communicator()
        .context("the decoder failed earlier")?;
    comm.barrier()?;
    Ok(())
}

/// Every split of base16 equals the unsharded decode (and therefore diffusers).
#[test]
fn sharded_decode_equals_unsharded_for_every_split() -> Result<()> {
    let fixture = Fixture::base16()?;
    let latent = fixture.latent(5)?;
    let started = Instant::now();
    let whole = fixture.decoder.decode(&latent)?;
    eprintln!("unsharded decode: {:.2?}", started.elapsed());
    let diffusers = fixture.video(5)?;
    ensure!(max_abs_diff(&whole, &diffusers)? <= DIFFUSERS_ATOL);
    let cases = [
        (VaeSplitDim::Height, [2, 3, 4, 5, 6].as_slice()),
        (VaeSplitDim::Width, [2, 3, 4, 5].as_slice()),
    ];
    for (split, sizes) in cases {
        for &size in sizes {
            let started = Instant::now();
            let sharded = fixture.decode_parallel(&latent, size, split)?;
            let elapsed = started.elapsed();
            ensure!(sharded.shape() == whole.shape(), "{:?}", sharded.shape());
            let diff = max_abs_diff(&sharded, &whole)?;
            let vs_diffusers = max_abs_diff(&sharded, &diffusers)?;
            eprintln!(
                "{size} ranks along {split:?}: max |sharded − unsharded| = {diff:e}, \
                 |sharded − diffusers| = {vs_diffusers:e} ({elapsed:.2?})"
            );
            ensure!(
                diff <= SHARDED_ATOL,
                "{size} ranks along {split:?}: {diff:e}"
            );
            ensure!(vs_diffusers <= DIFFUSERS_ATOL, "{size} × {split:?}");
        }
    }
    Ok(())
}

/// diffusers' own test config (1-channel layers, latent 2 × 2) over 2 ranks, both splits, for every
/// T of the fixture: single-row bands at the latent, against diffusers' output.
#[test]
fn diffusers_test_config_over_two_ranks() -> Result<()> {
    let fixture = Fixture::diffusers_test()?;
    for t in [1, 2, 3, 5] {
        let latent = fixture.latent(t)?;
        let whole = fixture.decoder.decode(&latent)?;
        for split in [VaeSplitDim::Height, VaeSplitDim::Width] {
            let sharded = fixture.decode_parallel(&latent, 2, split)?;
            let diff = max_abs_diff(&sharded, &whole)?;
            let vs_diffusers = max_abs_diff(&sharded, &fixture.video(t)?)?;
            eprintln!(
                "T = {t}, 2 ranks along {split:?}: |sharded − unsharded| = {diff:e}, \
                 |sharded − diffusers| = {vs_diffusers:e}"
            );
            ensure!(diff <= SHARDED_ATOL && vs_diffusers <= DIFFUSERS_ATOL);
        }
    }
    Ok(())
}

/// One rank given a bad chunk: every rank errors (the bad one with its reason, the others naming
/// it), at once, and the instance still decodes the next, good chunk.
#[test]
fn a_bad_chunk_on_one_rank_fails_every_rank_and_the_instance_recovers() -> Result<()> {
    let fixture = Fixture::diffusers_test()?;
    let latent = fixture.latent(2)?;
    let whole = fixture.decoder.decode(&latent)?;
    let world = CpuWorld::new(2).with_timeout(COMM_TIMEOUT);
    let started = Instant::now();
    let results = world.run(|rank| -> Result<Option<Tensor>> {
        let comm = rank.group(&[0, 1])?;
        let mut vae = ParallelVaeDecoder::new(fixture.decoder.clone(), comm, VaeSplitDim::Width);
        let mut stream = vae.new_stream(2, 2)?;
        let mut chunks = Vec::new();
        for t in 0..2 {
            let band = stream.band_of(&latent.narrow(2, t, 1)?)?;
            if t == 1 {
                // Rank 1 first sends 15 channels instead of 16.
                let bad = band.narrow(1, 0, 15)?;
                let given = if vae.rank() == 1 { &bad } else { &band };
                match vae.decode_chunk(&mut stream, given) {
                    Err(ParallelVaeError::Vae(VaeError::LatentChannels { got: 15, .. }))
                        if vae.rank() == 1 => {}
                    Err(ParallelVaeError::PeerRejected { peer: 1, .. }) if vae.rank() == 0 => {}
                    other => anyhow::bail!("rank {}: {other:?}", vae.rank()),
                }
                ensure!(stream.latent_frames_decoded() == 1, "stream moved on");
            }
            let frames = vae.decode_chunk(&mut stream, &band)?;
            chunks.extend(vae.gather_frames(&stream, &frames)?);
        }
        finish(vae)?;
        Ok((!chunks.is_empty())
            .then(|| Tensor::concat(&chunks.iter().collect::<Vec<_>>(), 2))
            .transpose()?)
    });
    let mut video = None;
    for (r, result) in results.into_iter().enumerate() {
        let out = result.map_err(|p| anyhow!("rank {r} panicked: {p}"))??;
        if r == 0 {
            video = out;
        }
    }
    let video = video.context("rank 0 gathered nothing")?;
    ensure!(max_abs_diff(&video, &whole)? <= SHARDED_ATOL);
    ensure!(started.elapsed() < COMM_TIMEOUT / 2, "waited for a timeout");
    Ok(())
}

/// A rank that dies mid-stream (a panic after its first chunk) makes the others fail their next
/// collective at once: an error, not a hang, and never a wait for the timeout.
#[test]
fn a_dying_rank_fails_the_others_without_a_hang() -> Result<()> {
    let fixture = Fixture::base16()?;
    let latent = fixture.latent(3)?;
    let size = 3;
    let world = CpuWorld::new(size).with_timeout(COMM_TIMEOUT);
    let started = Instant::now();
    let results = world.run(|rank| -> Result<(), ParallelVaeError> {
        let comm: CpuComm = rank.group(&[0, 1, 2]).map_err(ParallelVaeError::from)?;
        let mut vae = ParallelVaeDecoder::new(fixture.decoder.clone(), comm, VaeSplitDim::Height);
        let mut stream = vae.new_stream(6, 10)?;
        for t in 0..3 {
            if t == 1 && vae.rank() == 1 {
                panic!("rank 1 dies");
            }
            let band = stream.band_of(&latent.narrow(2, t, 1).map_err(VaeError::from)?)?;
            let frames = vae.decode_chunk(&mut stream, &band)?;
            vae.gather_frames(&stream, &frames)?;
        }
        Ok(())
    });
    let elapsed = started.elapsed();
    ensure!(results[1].is_err(), "rank 1 should have panicked");
    for r in [0, 2] {
        match &results[r] {
            Ok(Err(ParallelVaeError::Collective(CollectiveError::Poisoned { .. }))) => {}
            other => anyhow::bail!("rank {r}: expected a poisoned group, got {other:?}"),
        }
    }
    eprintln!("the others failed after {elapsed:.2?}");
    ensure!(
        elapsed < COMM_TIMEOUT / 2,
        "waited for a timeout: {elapsed:.2?}"
    );
    Ok(())
}

/// More ranks than latent rows: the same clear error on every rank, before any communication.
#[test]
fn a_split_finer_than_the_latent_is_refused_on_every_rank() -> Result<()> {
    let fixture = Fixture::diffusers_test()?;
    let results = CpuWorld::new(3).run(|rank| -> Result<()> {
        let comm = rank.group(&[0, 1, 2])?;
        let vae = ParallelVaeDecoder::new(fixture.decoder.clone(), comm, VaeSplitDim::Height);
        match vae.new_stream(2, 2) {
            Err(ParallelVaeError::SplitTooFine {
                extent: 2, size: 3, ..
            }) => Ok(()),
            other => anyhow::bail!("{:?}", other.map(|_| ())),
        }
    });
    for (r, result) in results.into_iter().enumerate() {
        result.map_err(|p| anyhow!("rank {r} panicked: {p}"))??;
    }
    Ok(())
}
