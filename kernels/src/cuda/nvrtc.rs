//! Run-time compilation of the `.cu` sources with NVRTC, to CUBIN for the device's architecture, with an
//! on-disk cache.
//!
//! Why CUBIN: loading PTX makes the driver JIT it (~70 ms per module on H200), loading CUBIN costs
//! ~0.1 ms. cudarc's safe compile returns PTX, so this goes through `nvrtcGetCUBIN` in the sys layer.
//!
//! Cache: `<cache_dir>/<source>-<hash>.cubin`, the hash covering the NVRTC version, the architecture,
//! the options and the full source (prelude included); a changed kernel or toolkit is a new file. Files
//! are written to a temporary name and renamed, so concurrent processes never read half a file.
//!
//! `cuda_bf16.h` is not built into NVRTC: the include directory comes from [`CudaConfig`] (the
//! deployment config's `cuda.include_dir`, a test or benchmark run's `DITSTREAM_CUDA_INCLUDE`
//! through `testing::cuda_settings_from_env`, else `/usr/local/cuda/include` when it holds it).

use std::ffi::{CStr, CString, c_char};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::nvrtc::{result as nvrtc_result, sys as nvrtc_sys};

use super::{KernelSource, catch};
use crate::{KernelError, Result};

/// Header shared by every kernel source: bf16/f32 loads and stores in f32 registers.
const PRELUDE: &str = include_str!("prelude.cuh");

/// Settings of the CUDA backend; set once with [`set_cuda_config`] (or [`ensure_cuda_config`])
/// before the first CUDA op, or left to [`CudaConfig::resolve`] with nothing set. This crate reads
/// no environment variable for them: a deployment sets them in its config's `cuda:` section, a
/// test or benchmark run through its gate (`testing::cuda_settings_from_env`).
#[derive(Debug, Clone, PartialEq)]
pub struct CudaConfig {
    /// Where compiled CUBINs are kept.
    pub cache_dir: PathBuf,
    /// The directory holding `cuda_bf16.h` (passed to NVRTC as `-I`); `None` compiles without it (the
    /// kernels then fail to compile, and the error says so).
    pub include_dir: Option<PathBuf>,
    /// How each convolution shape's cuDNN algorithm is chosen.
    pub cudnn_search: AlgoSearch,
    /// How each large GEMM shape's cuBLASLt algorithm is chosen (`gemm.rs`).
    pub gemm_search: AlgoSearch,
}

/// How a library's algorithm for a shape is chosen on the first use of the shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AlgoSearch {
    /// Run and time the candidates on the call's buffers, keeping the fastest (the default). For
    /// cuDNN: ~1.15× faster decodes, ~20 s of search per GPU on the first 480p decode; for
    /// cuBLASLt: the heuristic's first few algorithms, for GEMMs large enough to be worth it.
    #[default]
    Find,
    /// The library's heuristic ranking, nothing run (no search cost; cuDNN: legacy algorithms
    /// only).
    Heuristic,
}

/// The standard place of the CUDA headers, used when no include directory is set.
const INCLUDE_DEFAULT: &str = "/usr/local/cuda/include";

impl CudaConfig {
    /// The settings asked for (`None`: not set): `cache_dir` = `kernel_cache`, else
    /// `<temp dir>/ditstream-kernels`; `include_dir` = `include_dir`, else
    /// `/usr/local/cuda/include` when it holds `cuda_bf16.h`; each search, else
    /// [`AlgoSearch::Find`].
    pub fn resolve(
        kernel_cache: Option<PathBuf>,
        include_dir: Option<PathBuf>,
        cudnn_search: Option<AlgoSearch>,
        gemm_search: Option<AlgoSearch>,
    ) -> Self {
        CudaConfig {
            cache_dir: kernel_cache
                .unwrap_or_else(|| std::env::temp_dir().join("ditstream-kernels")),
            include_dir: include_dir.or_else(|| {
                let d = PathBuf::from(INCLUDE_DEFAULT);
                d.join("cuda_bf16.h").is_file().then_some(d)
            }),
            cudnn_search: cudnn_search.unwrap_or_default(),
            gemm_search: gemm_search.unwrap_or_default(),
        }
    }
}

static CONFIG: OnceLock<CudaConfig> = OnceLock::new();

/// Sets the compiler settings. Must come before the first CUDA kernel is compiled; afterwards (or when
/// called twice) it fails with the settings already in force.
pub fn set_cuda_config(config: CudaConfig) -> Result<()> {
    CONFIG.set(config).map_err(|config| {
        KernelError::arg(
            "set_cuda_config",
            "config",
            format!("{config:?}"),
            format!(
                "the settings are fixed once used; in force: {:?}",
                CONFIG.get()
            ),
        )
    })
}

/// Sets the settings unless they are set already; settings already in force that differ are an
/// error naming both (two stages of one process asking for different caches, say).
pub fn ensure_cuda_config(config: CudaConfig) -> Result<()> {
    let in_force = CONFIG.get_or_init(|| config.clone());
    if *in_force == config {
        Ok(())
    } else {
        Err(KernelError::arg(
            "set_cuda_config",
            "config",
            format!("{config:?}"),
            format!("another part of this process set {in_force:?}"),
        ))
    }
}

/// The settings in force: those set by [`set_cuda_config`] or [`ensure_cuda_config`], else
/// (fixed on first use) [`CudaConfig::resolve`] with nothing set.
pub fn cuda_config() -> &'static CudaConfig {
    CONFIG.get_or_init(|| CudaConfig::resolve(None, None, None, None))
}

/// FNV-1a, 64 bits: a stable hash (unlike `DefaultHasher`) for cache file names.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &byte in part.iter().chain(&[0xff]) {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    hash
}

fn probe_nvrtc() -> Result<()> {
    // SAFETY: is_culib_present only dlopens the candidate names and drops the handles.
    if !unsafe { nvrtc_sys::is_culib_present() } {
        return Err(KernelError::CudaUnavailable {
            library: "libnvrtc",
            detail: format!("tried {:?}", cudarc::get_lib_name_candidates("nvrtc")),
        });
    }
    Ok(())
}

fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters.
    let status = catch("libnvrtc", || unsafe {
        nvrtc_sys::nvrtcVersion(&mut major, &mut minor)
    })?;
    status.result().map_err(|e| KernelError::CudaUnavailable {
        library: "libnvrtc",
        detail: format!("nvrtcVersion: {e:?}"),
    })?;
    Ok((major, minor))
}

/// The options every kernel is compiled with (exact maths: the CPU twin is the reference);
/// scripts/lib/nvrtc_sass.py repeats them to compile without a GPU: change both together.
fn options(arch: &str, config: &CudaConfig) -> Vec<String> {
    let mut options = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--fmad=true".to_string(),
    ];
    if let Some(dir) = &config.include_dir {
        options.push(format!("--include-path={}", dir.display()));
    }
    options
}

/// CUBIN of `source` for `arch`, from the disk cache or freshly compiled (and then cached).
pub(crate) fn cubin(source: &KernelSource, arch: &str) -> Result<Vec<u8>> {
    probe_nvrtc()?;
    let config = cuda_config();
    let options = options(arch, config);
    let text = format!("{PRELUDE}\n#line 1 \"{}.cu\"\n{}", source.name, source.text);
    let (major, minor) = nvrtc_version()?;
    let version = format!("nvrtc {major}.{minor}");
    let key = fnv1a(&[
        version.as_bytes(),
        arch.as_bytes(),
        options.join(" ").as_bytes(),
        text.as_bytes(),
    ]);
    let path = config
        .cache_dir
        .join(format!("{}-{arch}-{key:016x}.cubin", source.name));
    if let Ok(bytes) = std::fs::read(&path)
        && !bytes.is_empty()
    {
        return Ok(bytes);
    }
    let started = std::time::Instant::now();
    let bytes = compile(source.name, &text, arch, &options)?;
    tracing::debug!(
        source = source.name,
        arch,
        ms = started.elapsed().as_millis() as u64,
        "NVRTC compiled"
    );
    if let Err(e) = store(&path, &bytes) {
        // The cache is an optimisation: a read-only disk costs a recompile next time, nothing more.
        tracing::warn!(path = %path.display(), error = %e, "could not cache CUBIN");
    }
    Ok(bytes)
}

fn store(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// One NVRTC compile to CUBIN; a rejected source returns the program log.
fn compile(name: &'static str, text: &str, arch: &str, options: &[String]) -> Result<Vec<u8>> {
    let unavailable = |call: &str, e: nvrtc_result::NvrtcError| KernelError::CudaUnavailable {
        library: "libnvrtc",
        detail: format!("{call}: {e:?}"),
    };
    let src = CString::new(text).map_err(|_| KernelError::Compile {
        source_name: name,
        arch: arch.to_string(),
        options: options.to_vec(),
        log: "the source contains a NUL byte".into(),
    })?;
    let file_name = CString::new(format!("{name}.cu")).map_err(|_| KernelError::Compile {
        source_name: name,
        arch: arch.to_string(),
        options: options.to_vec(),
        log: "the source name contains a NUL byte".into(),
    })?;
    let prog = catch("libnvrtc", || {
        nvrtc_result::create_program(&src, Some(&file_name))
    })?
    .map_err(|e| unavailable("nvrtcCreateProgram", e))?;
    // The program is destroyed on every path below.
    let result = (|| {
        // SAFETY: `prog` was created above and is destroyed only after this closure.
        let compiled = unsafe { nvrtc_result::compile_program(prog, options) };
        if let Err(e) = compiled {
            // SAFETY: as above; the log is a NUL-terminated C string.
            let log = unsafe { nvrtc_result::get_program_log(prog) }
                .map(|raw| {
                    // SAFETY: NVRTC NUL-terminates the log it wrote into `raw`.
                    unsafe { CStr::from_ptr(raw.as_ptr()) }
                        .to_string_lossy()
                        .into_owned()
                })
                .unwrap_or_else(|log_err| format!("(no log: {log_err:?})"));
            let hint = if log.contains("cuda_bf16.h") {
                "\nhint: set the config's cuda.include_dir (a test or benchmark run: \
                 DITSTREAM_CUDA_INCLUDE) to a directory holding cuda_bf16.h"
            } else {
                ""
            };
            return Err(KernelError::Compile {
                source_name: name,
                arch: arch.to_string(),
                options: options.to_vec(),
                log: format!("{e:?}\n{log}{hint}"),
            });
        }
        let mut size = 0usize;
        // SAFETY: `prog` compiled successfully; size is an out-parameter.
        unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) }
            .result()
            .map_err(|e| unavailable("nvrtcGetCUBINSize", e))?;
        let mut cubin = vec![0u8; size];
        // SAFETY: `cubin` holds exactly the `size` bytes NVRTC reported.
        unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast::<c_char>()) }
            .result()
            .map_err(|e| unavailable("nvrtcGetCUBIN", e))?;
        Ok(cubin)
    })();
    // SAFETY: `prog` came from create_program and is destroyed exactly once, here.
    let _ = unsafe { nvrtc_result::destroy_program(prog) };
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_stable_and_separates_parts() {
        assert_eq!(fnv1a(&[b"a"]), fnv1a(&[b"a"]));
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
    }

    #[test]
    fn options_carry_arch_and_include() {
        let config = CudaConfig {
            cache_dir: PathBuf::from("/tmp/x"),
            include_dir: Some(PathBuf::from("/inc")),
            cudnn_search: AlgoSearch::Find,
            gemm_search: AlgoSearch::Find,
        };
        let opts = options("sm_90a", &config);
        assert!(opts.contains(&"--gpu-architecture=sm_90a".to_string()));
        assert!(opts.contains(&"--include-path=/inc".to_string()));
    }

    /// What is set holds; what is not takes the defaults.
    #[test]
    fn unset_settings_take_the_defaults() {
        let set = CudaConfig::resolve(
            Some(PathBuf::from("/srv/ditstream/kernels")),
            Some(PathBuf::from("/opt/cuda/include")),
            Some(AlgoSearch::Heuristic),
            Some(AlgoSearch::Heuristic),
        );
        assert_eq!(set.cache_dir, PathBuf::from("/srv/ditstream/kernels"));
        assert_eq!(set.include_dir, Some(PathBuf::from("/opt/cuda/include")));
        assert_eq!(
            (set.cudnn_search, set.gemm_search),
            (AlgoSearch::Heuristic, AlgoSearch::Heuristic)
        );
        let unset = CudaConfig::resolve(None, None, None, None);
        assert_eq!(
            unset.cache_dir,
            std::env::temp_dir().join("ditstream-kernels")
        );
        let default_include = PathBuf::from(INCLUDE_DEFAULT);
        assert_eq!(
            unset.include_dir,
            default_include
                .join("cuda_bf16.h")
                .is_file()
                .then_some(default_include)
        );
        assert_eq!(
            (unset.cudnn_search, unset.gemm_search),
            (AlgoSearch::Find, AlgoSearch::Find)
        );
    }
}
