//! Where a stage's ranks run: the devices that `serving.device` and `serving.gpus` name, checked
//! against this build and this machine; the compute dtype (`model.dtype`); the rule that random
//! real-size weights need a GPU; and how one model copy per device is built (on a thread per
//! device) and shared by the ranks of that device.

use std::sync::Arc;

use ditstream_kernels::{DType, Device};

use crate::config::{Config, ConfigError, DeviceKind, Dtype, Preset};

/// Why a stage's ranks cannot be placed on the devices the config names.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The GPUs listed do not cover the ranks.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The CUDA backend's settings could not be resolved (an invalid environment override).
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Kernel(#[from] ditstream_kernels::KernelError),
    /// The process's CUDA backend already runs with other settings.
    #[cfg(feature = "cuda")]
    #[error("cuda: settings: {source}")]
    CudaSettings {
        /// The kernels' refusal.
        source: ditstream_kernels::KernelError,
    },
    /// The CUDA driver could not count the devices.
    #[cfg(feature = "cuda")]
    #[error("serving.device = cuda: {} cannot be opened: {source}", listed(.configured, .gpus))]
    Unopenable {
        /// `serving.gpus` as configured (empty: unset).
        configured: Vec<usize>,
        /// The GPU of each rank.
        gpus: Vec<usize>,
        /// The driver's failure (boxed: it is large, and this error is rare).
        source: Box<ditstream_kernels::KernelError>,
    },
    /// `model.dtype: fp8` on a GPU without FP8 tensor cores.
    #[cfg(feature = "cuda")]
    #[error(
        "model.dtype = fp8: GPU {gpu} has no FP8 tensor cores (compute capability 8.9 or later \
         is needed: Ada, Hopper, Blackwell); use bf16"
    )]
    NoFp8 {
        /// The GPU.
        gpu: usize,
    },
    /// A rank's GPU is not on this machine.
    #[cfg(feature = "cuda")]
    #[error(
        "{}: GPU {missing} does not exist; this machine has {count} CUDA device(s){}",
        listed(.configured, .gpus),
        ordinals(.count)
    )]
    NoSuchGpu {
        /// `serving.gpus` as configured (empty: unset).
        configured: Vec<usize>,
        /// The GPU of each rank.
        gpus: Vec<usize>,
        /// The first GPU that does not exist.
        missing: usize,
        /// CUDA devices on this machine.
        count: usize,
    },
    /// `device: cuda` in a build without the `cuda` feature.
    #[cfg(not(feature = "cuda"))]
    #[error(
        "serving.device = cuda: this binary was built without CUDA; build it with \
         `--features cuda` (scripts/build-gpu-serve.sh) or set `device: cpu`"
    )]
    NoCuda,
    /// Random weights of a real-size preset asked for on the CPU.
    #[error(
        "model.preset = {preset} with random weights: the CPU backend only runs `tiny` this \
         way; set `serving.device: cuda`, or point model.checkpoint at a checkpoint"
    )]
    RandomOnCpu {
        /// The preset.
        preset: Preset,
    },
    /// A rank of a group meant for NCCL sits on the CPU.
    #[cfg(feature = "cuda")]
    #[error("a rank of a CUDA group was placed on the CPU")]
    CpuRank {
        /// The rank.
        rank: usize,
    },
}

/// How `serving.gpus` reads in an error: as configured, or the default it stands for.
#[cfg(feature = "cuda")]
fn listed(configured: &[usize], gpus: &[usize]) -> String {
    if configured.is_empty() {
        format!("serving.gpus (unset, so {gpus:?})")
    } else {
        format!("serving.gpus = {configured:?}")
    }
}

/// The valid ordinals of `count` devices, for an error (nothing when there are none).
#[cfg(feature = "cuda")]
fn ordinals(count: &usize) -> String {
    match *count {
        0 => String::new(),
        n => format!(" (ordinals 0..={})", n - 1),
    }
}

/// Why [`on_each`] built nothing: the build's own error `E`, with the device when several were
/// built at once.
#[derive(Debug, thiserror::Error)]
pub enum BuildError<E> {
    /// The only device's build failed.
    #[error(transparent)]
    Build(E),
    /// The build on `device` failed (one of several).
    #[error("building on {device}: {source}")]
    On {
        /// The device.
        device: Device,
        /// The build's error.
        source: E,
    },
    /// A build thread panicked.
    #[error("a model-building thread panicked")]
    Panicked {
        /// The device it built for.
        device: Device,
    },
}

/// Seed of every random weight (the tiny model's and the random real-size presets'): fixed, so
/// every process of a deployment (gateway, denoiser and decoder pools) serves the same model.
pub const WEIGHT_SEED: u64 = 0;

/// The compute dtype the config names (weights and activations are stored in it; maths in f32):
/// bf16 for `fp8`, whose FP8 linears read and write bf16 activations.
pub fn dtype(cfg: &Config) -> DType {
    match cfg.model.dtype {
        Dtype::F32 => DType::F32,
        Dtype::Bf16 | Dtype::Fp8 => DType::BF16,
    }
}

/// The device of each of `ranks` ranks: the CPU for every rank, or with `device: cuda` the GPUs
/// of `serving.gpus` (one each; see [`Config::rank_gpus`]), checked to exist, with the CUDA
/// backend set up as the config's `cuda:` section says. `what` names the ranks' owner in errors
/// ("the denoiser mesh", "a decoder instance").
pub fn rank_devices(cfg: &Config, what: &str, ranks: usize) -> Result<Vec<Device>, DeviceError> {
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

/// The CUDA backend's settings from `cuda:`, fixed for the process before its first kernel; both
/// stages of `serve` ask for the same.
#[cfg(feature = "cuda")]
fn configure_cuda(cfg: &Config) -> Result<(), DeviceError> {
    use ditstream_kernels::cuda::{AlgoSearch, CudaConfig, ensure_cuda_config};
    let c = &cfg.cuda;
    let search = |s| match s {
        crate::config::AlgoSearch::Find => AlgoSearch::Find,
        crate::config::AlgoSearch::Heuristic => AlgoSearch::Heuristic,
    };
    let settings = CudaConfig::resolve(
        c.kernel_cache.clone(),
        c.include_dir.clone(),
        Some(search(c.cudnn_search)),
        Some(search(c.gemm_search)),
    );
    ensure_cuda_config(settings).map_err(|source| DeviceError::CudaSettings { source })?;
    Ok(())
}

/// The `cuda:` section that asks for `settings` (a test or benchmark that fixed its settings from
/// its GPU script's variables serves with the same).
#[cfg(feature = "cuda")]
impl From<&ditstream_kernels::cuda::CudaConfig> for crate::config::CudaSettings {
    fn from(settings: &ditstream_kernels::cuda::CudaConfig) -> Self {
        use ditstream_kernels::cuda::AlgoSearch;
        let search = |s| match s {
            AlgoSearch::Find => crate::config::AlgoSearch::Find,
            AlgoSearch::Heuristic => crate::config::AlgoSearch::Heuristic,
        };
        crate::config::CudaSettings {
            kernel_cache: Some(settings.cache_dir.clone()),
            include_dir: settings.include_dir.clone(),
            cudnn_search: search(settings.cudnn_search),
            gemm_search: search(settings.gemm_search),
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn configure_cuda(_: &Config) -> Result<(), DeviceError> {
    Ok(())
}

#[cfg(feature = "cuda")]
fn check_gpus(cfg: &Config, gpus: &[usize]) -> Result<(), DeviceError> {
    let count =
        ditstream_kernels::cuda::cuda_device_count().map_err(|source| DeviceError::Unopenable {
            configured: cfg.serving.gpus.clone(),
            gpus: gpus.to_vec(),
            source: Box::new(source),
        })?;
    if let Some(&missing) = gpus.iter().find(|&&g| g >= count) {
        return Err(DeviceError::NoSuchGpu {
            configured: cfg.serving.gpus.clone(),
            gpus: gpus.to_vec(),
            missing,
            count,
        });
    }
    if cfg.model.dtype == Dtype::Fp8 {
        for &gpu in gpus {
            if !ditstream_kernels::cuda::supports_fp8(gpu)? {
                return Err(DeviceError::NoFp8 { gpu });
            }
        }
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn check_gpus(_: &Config, _: &[usize]) -> Result<(), DeviceError> {
    Err(DeviceError::NoCuda)
}

/// Random weights of a real-size preset need a GPU: the CPU reference would take minutes per step.
pub fn check_random_on(preset: Preset, devices: &[Device]) -> Result<(), DeviceError> {
    if !preset.spec().runs_on_cpu && devices.contains(&Device::Cpu) {
        return Err(DeviceError::RandomOnCpu { preset });
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
pub fn on_each<T: Send, E: Send>(
    devices: &[Device],
    build: impl Fn(Device) -> Result<T, E> + Sync,
) -> Result<Vec<T>, BuildError<E>> {
    if let [only] = devices {
        return Ok(vec![build(*only).map_err(BuildError::Build)?]);
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = devices
            .iter()
            .map(|&device| {
                let build = &build;
                let handle = scope.spawn(move || {
                    build(device).map_err(|source| BuildError::On { device, source })
                });
                (device, handle)
            })
            .collect();
        handles
            .into_iter()
            .map(|(device, h)| {
                h.join()
                    .unwrap_or_else(|_| Err(BuildError::Panicked { device }))
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
pub fn gpu_ordinals(devices: &[Device]) -> Result<Vec<usize>, DeviceError> {
    devices
        .iter()
        .enumerate()
        .map(|(rank, d)| match d {
            Device::Cuda(g) => Ok(*g),
            Device::Cpu => Err(DeviceError::CpuRank { rank }),
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

    #[test]
    fn a_failed_build_names_its_device_when_there_are_several() {
        let fail = |_| Err::<(), _>("no weights");
        let e = on_each(&[Device::Cpu], fail).err().unwrap();
        assert_eq!(e.to_string(), "no weights");
        let e = on_each(&[Device::Cpu, Device::Cpu], fail).err().unwrap();
        assert_eq!(e.to_string(), "building on cpu: no weights");
        // The first device's thread panics (the second builds nothing real).
        let e = on_each(&[Device::Cpu, Device::Cuda(0)], |d| -> Result<(), &str> {
            assert!(d != Device::Cpu, "on purpose");
            Ok(())
        })
        .err()
        .unwrap();
        assert_eq!(e.to_string(), "a model-building thread panicked");
    }
}
