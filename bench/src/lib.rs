//! Shared helpers for the benchmark binaries in `bench/src/bin/`: timing statistics, the
//! NCCL-tests bandwidth conventions, and large random inputs, so every driver reports numbers the same way.

use ditstream_kernels::{DType, Device, Tensor};

/// Most seeded normals drawn on the host for one benchmark input (16 Mi; the draw is ~30 ns each).
const RANDOM_BLOCK: usize = 1 << 24;

/// A tensor of seeded normals on `device`. Up to 16 Mi elements they are `Tensor::randn`'s; a larger
/// tensor repeats one such block (copied on the device), since drawing ~10⁹ normals on the host would
/// take longer than the benchmark. Speed does not depend on the values, only on their not being zeros.
pub fn random_input(
    shape: &[usize],
    dtype: DType,
    seed: u64,
    device: Device,
) -> ditstream_kernels::Result<Tensor> {
    tiled_randn(shape, dtype, seed, device, RANDOM_BLOCK)
}

/// [`random_input`] with a given block size.
fn tiled_randn(
    shape: &[usize],
    dtype: DType,
    seed: u64,
    device: Device,
    block_len: usize,
) -> ditstream_kernels::Result<Tensor> {
    let numel: usize = shape.iter().product();
    if numel <= block_len {
        return Tensor::randn(shape, dtype, seed, device);
    }
    let block = Tensor::randn(&[block_len], dtype, seed, device)?;
    let copies = vec![&block; numel.div_ceil(block_len)];
    Tensor::concat(&copies, 0)?
        .narrow(0, 0, numel)?
        .reshape(shape)
}

/// Median of `samples` (mean of the middle two for an even count); `None` when empty.
pub fn median(samples: &[f64]) -> Option<f64> {
    if samples.is_empty() {
        return None;
    }
    let mut v = samples.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    })
}

/// Seconds `f` takes on `device`: CUDA events recorded on the GPU's kernels stream before and after
/// it (from the first op it queues to the last one finishing; GPU.md's method), or the wall clock on
/// the CPU. `f`'s result is dropped after the end is recorded, so its freeing is not timed.
pub fn time_on<T>(
    device: ditstream_kernels::Device,
    f: impl FnOnce() -> anyhow::Result<T>,
) -> anyhow::Result<f64> {
    match device {
        #[cfg(feature = "cuda")]
        ditstream_kernels::Device::Cuda(ordinal) => {
            use anyhow::Context;
            let stream = ditstream_kernels::cuda::cuda_stream(ordinal)?;
            let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
            let start = stream.record_event(flags).context("cuEventRecord")?;
            let out = f()?;
            let end = stream.record_event(flags).context("cuEventRecord")?;
            let ms = start.elapsed_ms(&end).context("cuEventElapsedTime")?;
            drop(out);
            Ok(f64::from(ms) / 1e3)
        }
        _ => {
            let t0 = std::time::Instant::now();
            let out = f()?;
            let secs = t0.elapsed().as_secs_f64();
            drop(out);
            Ok(secs)
        }
    }
}

/// Median seconds per call of `f` on `device`: `warmup` untimed calls, then `batches` timed batches
/// of `reps` back-to-back calls each ([`time_on`] around the batch, divided by `reps`: short calls
/// are timed without an event pair each).
pub fn median_per_call<T>(
    device: ditstream_kernels::Device,
    warmup: usize,
    batches: usize,
    reps: usize,
    mut f: impl FnMut() -> anyhow::Result<T>,
) -> anyhow::Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    let reps = reps.max(1);
    let samples = (0..batches.max(1))
        .map(|_| {
            time_on(device, || {
                for _ in 1..reps {
                    f()?;
                }
                f()
            })
            .map(|secs| secs / reps as f64)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    median(&samples).ok_or_else(|| anyhow::anyhow!("no timed batches"))
}

/// Collective kinds, for the bus-bandwidth factor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    /// all-gather: size = the gathered (output) bytes per rank.
    AllGather,
    /// all-to-all: size = the bytes each rank sends (= receives).
    AllToAll,
    /// all-reduce: size = the buffer bytes per rank.
    AllReduce,
}

/// NCCL-tests convention: bus bandwidth = algorithm bandwidth × factor, with factor
/// (P−1)/P for all-gather and all-to-all and 2(P−1)/P for all-reduce (`P` ranks).
pub fn bus_factor(kind: Collective, p: usize) -> f64 {
    let p = p as f64;
    match kind {
        Collective::AllGather | Collective::AllToAll => (p - 1.0) / p,
        Collective::AllReduce => 2.0 * (p - 1.0) / p,
    }
}

/// Algorithm bandwidth in GB/s (10⁹ bytes per second) of `bytes` moved in `seconds`.
pub fn algbw_gbs(bytes: usize, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

/// Relative RMS difference ‖a − b‖ / ‖b‖ over every element (any devices, one shape), in f64:
/// the size of a disagreement against the values'.
pub fn rel_rms(a: &Tensor, b: &Tensor) -> ditstream_kernels::Result<f64> {
    let (a, b) = (a.to_vec_f32()?, b.to_vec_f32()?);
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(&b) {
        num += f64::from(x - y).powi(2);
        den += f64::from(*y).powi(2);
    }
    Ok((num / den.max(f64::MIN_POSITIVE)).sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn random_inputs_repeat_one_block_beyond_it() -> ditstream_kernels::Result<()> {
        let small = random_input(&[3, 5], DType::F32, 1, Device::Cpu)?;
        assert_eq!(
            small.to_vec_f32()?,
            Tensor::randn(&[3, 5], DType::F32, 1, Device::Cpu)?.to_vec_f32()?
        );
        let (block, n) = (64, 2 * 64 + 7);
        let big = tiled_randn(&[1, n], DType::BF16, 2, Device::Cpu, block)?;
        assert_eq!(big.shape(), [1, n]);
        let v = big.to_vec_f32()?;
        assert_eq!(v[block..2 * block], v[..block]);
        assert_eq!(v[2 * block..], v[..7]);
        assert!(v[..7].iter().any(|&x| x != 0.0));
        Ok(())
    }

    #[test]
    fn bus_factors_follow_nccl_tests() {
        assert_eq!(bus_factor(Collective::AllGather, 2), 0.5);
        assert_eq!(bus_factor(Collective::AllToAll, 4), 0.75);
        assert_eq!(bus_factor(Collective::AllReduce, 2), 1.0);
        assert_eq!(bus_factor(Collective::AllGather, 1), 0.0);
    }
}
