//! Where a stage's ranks run: the devices that `serving.device` and `serving.gpus` name, checked
//! against this build and this machine; the compute dtype (`model.dtype`); the rule that random
//! real-size weights need a GPU; and how one model copy per device is built (on a thread per
//! device) and shared by the ranks of that device.

use std::sync::Arc;

use anyhow::{Context, bail};
use ditstream_kernels::{DType, Device};

use crate::config::{Config, DeviceKind, Dtype, Preset};

/// Seed of every random weight (the tiny model's and the random real-size presets'): fixed, so
/// every process of a deployment (gateway, denoiser and decoder pools) serves the same model.
pub const WEIGHT_SEED: u64 = 0;

/// The compute dtype the config names (weights and activations are stored in it; maths in f32).
pub fn dtype(cfg: &Config) -> DType {
    match cfg.model.dtype {
        Dtype::F32 => DType::F32,
        Dtype::Bf16 => DType::BF16,
    }
}

/// The device of each of `ranks` ranks: the CPU for every rank, or with `device: cuda` the GPUs
/// of `serving.gpus` (one each; see [`Config::rank_gpus`]), checked to exist, with the CUDA
/// backend set up as the config's `cuda:` section says. `what` names the ranks' owner in errors
/// ("the denoiser mesh", "a decoder instance").
pub fn rank_devices(cfg: &Config, what: &str, ranks: usize) -> anyhow::Result<Vec<Device>> {
    match cfg.serving.device {
        DeviceKind::Cpu => Ok(vec![Device::Cpu; ranks]),
        DeviceKind::Cuda => {
            let gpus = cfg.rank_gpus(what, ranks)?;
            check_gpus(cfg, &gpus)?;
            configure_cuda(cfg)?;
            Ok(gpus.into_iter().map(Device::Cuda).collect())
        }
    }
}

/// The CUDA backend's settings from `cuda:` (the environment overriding each), fixed for the
/// process before its first kernel; both stages of `serve` ask for the same.
#[cfg(feature = "cuda")]
fn configure_cuda(cfg: &Config) -> anyhow::Result<()> {
    use ditstream_kernels::cuda::{CudaConfig, CudnnSearch, ensure_cuda_config};
    let c = &cfg.cuda;
    let search = match c.cudnn_search {
        crate::config::CudnnSearch::Find => CudnnSearch::Find,
        crate::config::CudnnSearch::Heuristic => CudnnSearch::Heuristic,
    };
    let settings =
        CudaConfig::resolve(c.kernel_cache.clone(), c.include_dir.clone(), Some(search))?;
    ensure_cuda_config(settings).context("cuda: settings")?;
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn configure_cuda(_: &Config) -> anyhow::Result<()> {
    Ok(())
}

#[cfg(feature = "cuda")]
fn check_gpus(cfg: &Config, gpus: &[usize]) -> anyhow::Result<()> {
    let listed = if cfg.serving.gpus.is_empty() {
        format!("serving.gpus (unset, so {gpus:?})")
    } else {
        format!("serving.gpus = {:?}", cfg.serving.gpus)
    };
    let count = ditstream_kernels::cuda::cuda_device_count()
        .with_context(|| format!("serving.device = cuda: {listed} cannot be opened"))?;
    if let Some(missing) = gpus.iter().find(|&&g| g >= count) {
        bail!(
            "{listed}: GPU {missing} does not exist; this machine has {count} CUDA device(s){}",
            match count {
                0 => String::new(),
                n => format!(" (ordinals 0..={})", n - 1),
            }
        );
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn check_gpus(_: &Config, _: &[usize]) -> anyhow::Result<()> {
    bail!(
        "serving.device = cuda: this binary was built without CUDA; build it with \
         `--features cuda` (scripts/build-gpu-serve.sh) or set `device: cpu`"
    )
}

/// Random weights of a real-size preset need a GPU: the CPU reference would take minutes per step.
pub fn check_random_on(preset: Preset, devices: &[Device]) -> anyhow::Result<()> {
    if !preset.spec().runs_on_cpu && devices.contains(&Device::Cpu) {
        bail!(
            "model.preset = {preset} with random weights: the CPU backend only runs `tiny` this \
             way; set `serving.device: cuda`, or point model.checkpoint at a checkpoint"
        );
    }
    Ok(())
}

/// The distinct devices of `devices`, in first-seen order.
pub fn distinct(devices: &[Device]) -> Vec<Device> {
    let mut out: Vec<Device> = Vec::new();
    for d in devices {
        if !out.contains(d) {
            out.push(*d);
        }
    }
    out
}

/// Builds one value per device, each on its own thread (uploads to several GPUs overlap).
pub fn on_each<T: Send>(
    devices: &[Device],
    build: impl Fn(Device) -> anyhow::Result<T> + Sync,
) -> anyhow::Result<Vec<T>> {
    if let [only] = devices {
        return Ok(vec![build(*only)?]);
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = devices
            .iter()
            .map(|&device| {
                let build = &build;
                scope.spawn(move || build(device).with_context(|| format!("building on {device}")))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a model-building thread panicked")))
            })
            .collect()
    })
}

/// Rank r gets the copy built for its device.
pub fn per_rank<T>(devices: &[Device], distinct: &[Device], copies: Vec<T>) -> Vec<Arc<T>> {
    let copies: Vec<Arc<T>> = copies.into_iter().map(Arc::new).collect();
    devices
        .iter()
        .map(|d| {
            let i = distinct.iter().position(|x| x == d).unwrap_or(0); // every device is in `distinct`
            Arc::clone(&copies[i])
        })
        .collect()
}

/// The GPU of rank 0 (where the text states and, over an NCCL latent link, the latent leave
/// from, or where chunks arrive), or 0 on the CPU, where no link uses it.
pub fn first_gpu(devices: &[Device]) -> usize {
    match devices.first() {
        Some(Device::Cuda(g)) => *g,
        _ => 0,
    }
}

/// The GPU ordinals of `devices` (all `Device::Cuda` with `device: cuda`).
#[cfg(feature = "cuda")]
pub fn gpu_ordinals(devices: &[Device]) -> anyhow::Result<Vec<usize>> {
    devices
        .iter()
        .map(|d| match d {
            Device::Cuda(g) => Ok(*g),
            Device::Cpu => bail!("a rank of a CUDA group was placed on the CPU"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_is_a_clear_error() {
        let cfg =
            Config::parse("model:\n  preset: tiny\nserving:\n  device: cuda\n", "<t>").unwrap();
        let e = rank_devices(&cfg, "the denoiser mesh", 1).unwrap_err();
        assert!(
            format!("{e:#}").starts_with(
                "serving.device = cuda: this binary was built without CUDA; build it with \
                 `--features cuda`"
            ),
            "{e:#}"
        );
    }

    #[test]
    fn too_few_listed_gpus_name_the_list() {
        let cfg = Config::parse(
            "model:\n  preset: tiny\nserving:\n  device: cuda\n  gpus: [0]\n",
            "<t>",
        )
        .unwrap();
        let e = rank_devices(&cfg, "the denoiser mesh", 2).unwrap_err();
        assert!(
            format!("{e:#}").starts_with(
                "serving.gpus = [0]: lists 1 GPU(s) but the denoiser mesh has 2 ranks"
            ),
            "{e:#}"
        );
    }
}
