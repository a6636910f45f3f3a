//! The CUDA backend's device layer (feature `cuda`): one `CudaBackend` per GPU ordinal, holding the
//! context, the one stream every op of that device runs on, the NVRTC-compiled kernels, the cuBLASLt
//! plans and the cuDNN convolution plans; plus device storage for [`Tensor`] and the strided-copy
//! kernel behind the layout ops and casts.
//!
//! - Libraries load at run time (cudarc `dynamic-loading`). cudarc panics when a library is missing, so
//!   `CudaBackend::get` probes `libcuda` and `libnvrtc` first, `gemm` probes `libcublasLt` and
//!   [`cudnn`] `libcudnn` before their first use: a missing library is [`KernelError::CudaUnavailable`]
//!   naming the library (for cuDNN, convolutions fall back to im2col; see [`ConvAlgo`]).
//! - One stream per device: every op on `Device::Cuda(n)` is queued on backend `n`'s stream, so ops are
//!   ordered without events (cudarc's per-buffer event tracking is switched off). Reading a tensor back to
//!   the host synchronises that stream. [`cuda_stream`] hands the stream out, e.g. to NCCL.
//! - Kernels: `ops/<op>/<op>.cu` sources, compiled on first use for the device's architecture and cached
//!   as CUBIN on disk (see [`nvrtc`]); modules and functions are cached per backend.

pub mod attention_kernel;
pub mod conv_algo;
mod copy;
pub mod cudnn;
mod cudnn_graph;
pub(crate) mod gemm;
pub mod nvrtc;
mod plan_cache;
mod storage;

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DriverError, LaunchConfig, sys as cu,
};

pub use attention_kernel::{
    AttentionKernel, FLASH_VARIANTS, FlashVariant, HOPPER_FP8_KEYS, HOPPER_FP8_VARIANTS,
    HOPPER_VARIANTS, HopperFp8Variant, HopperVariant, with_attention_kernel,
};
pub use conv_algo::{
    AUTO_CONV_ALGO, AUTO_POINTWISE_CONV_ALGO, ConvAlgo, auto_conv_algo, conv_algo, with_conv_algo,
};
pub(crate) use copy::{EdgeRuns, Layout, copy_strided, halo_edges};
pub use cudnn::{cudnn_conv_plans, cudnn_version};
pub use nvrtc::{AlgoSearch, CudaConfig, cuda_config, ensure_cuda_config, set_cuda_config};
pub(crate) use storage::{CudaBuf, CudaStorage};

use crate::{DType, Device, KernelError, Result, Tensor};

/// A `.cu` source: its name (the op folder; names the cache file and errors) and its text.
pub(crate) struct KernelSource {
    pub name: &'static str,
    pub text: &'static str,
}

/// Threads per block of the one-thread-per-element kernels.
pub(crate) const BLOCK: u32 = 256;

/// A 1-D launch of `n` threads in blocks of [`BLOCK`] (kernels use a grid-stride loop, so the grid is
/// capped; `n` must be > 0).
pub(crate) fn grid_1d(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, 1 << 20) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The kernel-name suffix of a dtype: kernels are instantiated per operand dtype as `<kernel>_<f32|bf16>…`.
pub(crate) fn suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
    }
}

/// Runs `f`, turning a panic inside cudarc (a library or symbol that failed to load) into an error.
pub(crate) fn catch<T>(library: &'static str, f: impl FnOnce() -> T) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|panic| {
        let detail = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panicked while loading".into());
        KernelError::CudaUnavailable { library, detail }
    })
}

/// Number of CUDA devices; an error when libcuda is missing or the driver cannot start.
pub fn cuda_device_count() -> Result<usize> {
    probe_driver()?;
    let count =
        catch("libcuda", CudaContext::device_count)?.map_err(|e| KernelError::CudaUnavailable {
            library: "libcuda",
            detail: format!("cuDeviceGetCount: {e:?}"),
        })?;
    Ok(count.max(0) as usize)
}

fn probe_driver() -> Result<()> {
    // SAFETY: is_culib_present only dlopens the candidate names and drops the handles.
    if !unsafe { cu::is_culib_present() } {
        return Err(KernelError::CudaUnavailable {
            library: "libcuda",
            detail: format!("tried {:?}", cudarc::get_lib_name_candidates("cuda")),
        });
    }
    Ok(())
}

/// The stream all ops on `Device::Cuda(ordinal)` run on (for NCCL or timing events beside our ops).
pub fn cuda_stream(ordinal: usize) -> Result<Arc<CudaStream>> {
    Ok(CudaBackend::get(ordinal)?.stream.clone())
}

/// Waits until every op queued on `Device::Cuda(ordinal)` has finished.
pub fn synchronize(ordinal: usize) -> Result<()> {
    let backend = CudaBackend::get(ordinal)?;
    backend
        .stream
        .synchronize()
        .map_err(|e| backend.err("synchronize", "cuStreamSynchronize", e))
}

/// The device address of a CUDA tensor's first element, for code that works on device memory directly
/// (the denoiser's collectives hand it to NCCL). Valid while the tensor (or a clone) lives. The ops that
/// wrote it were queued on [`cuda_stream`]; a reader on another stream orders itself after them (an event
/// recorded there). Tensors are immutable: never write through this address, except into a tensor from
/// [`uninit_tensor`] before anything reads it.
pub fn tensor_device_ptr(t: &Tensor) -> Result<u64> {
    Ok(t.cuda_storage("tensor_device_ptr")?.ptr())
}

/// Whether GPU `ordinal` has FP8 (e4m3) tensor cores: compute capability 8.9 (Ada) or later.
pub fn supports_fp8(ordinal: usize) -> Result<bool> {
    Ok(CudaBackend::get(ordinal)?.capability >= (8, 9))
}

/// Whether the FP8 attention kernel ([`crate::attention_fp8`] on a GPU) runs on GPU `ordinal` at
/// `head_dim`: Hopper (sm_90a, its e4m3 wgmma) and head dim 128.
pub fn supports_fp8_attention(ordinal: usize, head_dim: usize) -> Result<bool> {
    let backend = CudaBackend::get(ordinal)?;
    let dims = [1, 1, 1, 1, head_dim];
    Ok(crate::ops::attention::hopper::fp8_unsupported(&backend, dims, 1.0).is_none())
}

/// How the FP8 attention kernel's launch of `HOPPER_FP8_VARIANTS[variant]` on GPU `ordinal` takes
/// the keys of a call of `[batch, seq_q, heads]` and kv_len (the runs a sparse last wave is split
/// in): the split that [`crate::attention_fp8_reference`] takes to follow it.
pub fn fp8_attention_split(
    ordinal: usize,
    variant: usize,
    dims: [usize; 3],
    kv_len: usize,
) -> Result<crate::Fp8KeySplit> {
    const OP: &str = "fp8_attention_split";
    let backend = CudaBackend::get(ordinal)?;
    let v = HOPPER_FP8_VARIANTS.get(variant).ok_or_else(|| {
        crate::KernelError::arg(
            OP,
            "variant",
            variant,
            format!("there are {} variants", HOPPER_FP8_VARIANTS.len()),
        )
    })?;
    Ok(crate::ops::attention::hopper::fp8_key_split(
        &backend, v, dims, kv_len,
    ))
}

/// A contiguous tensor on GPU `ordinal` whose storage is allocated (stream-ordered, on [`cuda_stream`])
/// but not written: its values are unspecified until the caller fills every element through
/// [`tensor_device_ptr`] (on another stream: after an event recorded on [`cuda_stream`] following this
/// call). For buffers that a foreign library fills (NCCL receives), which would otherwise pay a fill.
pub fn uninit_tensor(shape: &[usize], dtype: DType, ordinal: usize) -> Result<Tensor> {
    let numel = shape.iter().product();
    let storage = CudaBackend::get(ordinal)?.alloc(dtype, numel)?;
    Ok(Tensor::from_cuda(storage, shape))
}

/// Everything one GPU needs: context, stream, compiled kernels, cuBLASLt and cuDNN plans.
pub(crate) struct CudaBackend {
    pub ordinal: usize,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// NVRTC target, e.g. `sm_90a` on H200.
    pub arch: String,
    /// Compute capability (major, minor): (9, 0) on H200.
    pub capability: (i32, i32),
    /// Streaming multiprocessors (132 on the H200): how many CTAs of a one-CTA-per-SM kernel run at once.
    pub sm_count: usize,
    /// Most dynamic shared memory one block may opt in to, bytes (227 KiB on the H200).
    pub smem_optin: usize,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<(&'static str, String), CudaFunction>>,
    /// Created on the first GEMM (probing libcublasLt then).
    pub blas: Mutex<Option<gemm::Blas>>,
    /// Created on the first cuDNN convolution (probing libcudnn then).
    pub dnn: Mutex<cudnn::DnnSlot>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaBackend(cuda:{}, {})", self.ordinal, self.arch)
    }
}

/// Makes the device's default memory pool (where every `cuMemAllocAsync` of cudarc comes from) keep
/// freed memory instead of returning it to the driver at each synchronisation, which is what its
/// default release threshold of 0 does. Tensors are freed and re-allocated on every forward and
/// every VAE chunk; with the default, each synchronising call (a read-back, a timed event) gives the
/// memory back and the next forward maps it again, gigabytes at a time. The pool then behaves like
/// PyTorch's caching allocator: it holds what the peak needed. Memory pressure from other pools or
/// processes is not a concern on a GPU that serves one role.
fn keep_pool_memory(ctx: &CudaContext) -> std::result::Result<(), cu::CUresult> {
    if !ctx.has_async_alloc() {
        return Ok(()); // no stream-ordered allocator: cudarc uses cuMemAlloc, nothing is pooled
    }
    let mut pool: cu::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a valid out-pointer and the context's device handle.
    let code = unsafe { cu::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) };
    if code != cu::CUresult::CUDA_SUCCESS {
        return Err(code);
    }
    let mut threshold: u64 = u64::MAX;
    // SAFETY: `pool` is the device's default pool; the attribute takes a pointer to a u64 (cuuint64_t).
    let code = unsafe {
        cu::cuMemPoolSetAttribute(
            pool,
            cu::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    };
    match code {
        cu::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(e),
    }
}

impl CudaBackend {
    /// The backend of GPU `ordinal`, created on first use.
    ///
    /// Every op calls this (often more than once), from every thread that drives a GPU: the ranks of
    /// a parallel decode are threads of one process. The lookup of a created backend therefore takes
    /// no lock (a `OnceLock` per ordinal, read with an atomic load), so those threads never queue
    /// behind one another here; the mutex only serialises creation (a context and a stream, once per
    /// GPU). Ordinals beyond the table, which no machine of ours has, take the locked map.
    pub fn get(ordinal: usize) -> Result<Arc<CudaBackend>> {
        const SLOTS: usize = 64;
        static READY: [OnceLock<Arc<CudaBackend>>; SLOTS] = [const { OnceLock::new() }; SLOTS];
        static CREATING: Mutex<Option<HashMap<usize, Arc<CudaBackend>>>> = Mutex::new(None);
        if let Some(backend) = READY.get(ordinal).and_then(OnceLock::get) {
            return Ok(backend.clone());
        }
        // A poisoned lock only means another thread panicked while inserting; the map is still valid.
        let mut creating = CREATING.lock().unwrap_or_else(|e| e.into_inner());
        let map = creating.get_or_insert_with(HashMap::new);
        if let Some(backend) = map.get(&ordinal) {
            return Ok(backend.clone());
        }
        let backend = Arc::new(Self::new(ordinal)?);
        map.insert(ordinal, backend.clone());
        if let Some(slot) = READY.get(ordinal) {
            // Only this thread (holding `CREATING`) sets a slot, once: it is empty here.
            let _ = slot.set(backend.clone());
        }
        Ok(backend)
    }

    fn new(ordinal: usize) -> Result<Self> {
        let count = cuda_device_count()?;
        let device = Device::Cuda(ordinal);
        if ordinal >= count {
            return Err(KernelError::CudaUnavailable {
                library: "device",
                detail: format!("{device} asked for but {count} CUDA device(s) found"),
            });
        }
        let err = |call, e: DriverError| KernelError::Cuda {
            op: "init",
            call,
            device,
            detail: format!("{e:?}"),
        };
        let ctx = catch("libcuda", || CudaContext::new(ordinal))?
            .map_err(|e| err("cuDevicePrimaryCtxRetain", e))?;
        // SAFETY: every buffer of this device is used on the one stream below only, so cudarc's
        // cross-stream events are not needed (stream order already orders uses and frees).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| err("cuStreamCreate", e))?;
        keep_pool_memory(&ctx).map_err(|code| KernelError::Cuda {
            op: "init",
            call: "cuMemPoolSetAttribute",
            device,
            detail: format!("{code:?}"),
        })?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| err("cuDeviceGetAttribute", e))?;
        // The `a` variants (sm_90a, sm_100a, ...) unlock the architecture-specific instructions (wgmma);
        // they exist from Hopper on and run only on that exact architecture, which is the one we compile for.
        let arch = if major >= 9 {
            format!("sm_{major}{minor}a")
        } else {
            format!("sm_{major}{minor}")
        };
        let sm_count = ctx
            .attribute(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| err("cuDeviceGetAttribute", e))? as usize;
        let smem_optin = ctx
            .attribute(
                cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(|e| err("cuDeviceGetAttribute", e))? as usize;
        tracing::debug!(ordinal, %arch, sm_count, smem_optin, "CUDA backend ready");
        Ok(CudaBackend {
            ordinal,
            ctx,
            stream,
            arch,
            capability: (major, minor),
            sm_count,
            smem_optin,
            modules: Mutex::default(),
            functions: Mutex::default(),
            blas: Mutex::new(None),
            dnn: Mutex::default(),
        })
    }

    pub fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    /// The GPU model as the plan caches key their choices: name, NVRTC architecture and SM count,
    /// e.g. `NVIDIA H200 sm_90a 132`.
    pub fn model(&self) -> String {
        format!(
            "{} {} {}",
            self.ctx.name().unwrap_or_else(|_| "unknown GPU".into()),
            self.arch,
            self.sm_count
        )
    }

    /// A [`KernelError::Cuda`] for a failed driver call.
    pub fn err(
        &self,
        op: &'static str,
        call: &'static str,
        e: impl std::fmt::Debug,
    ) -> KernelError {
        KernelError::Cuda {
            op,
            call,
            device: self.device(),
            detail: format!("{e:?}"),
        }
    }

    /// Kernel `name` of `source`, compiling (or loading the cached CUBIN of) the source on first use.
    pub fn function(&self, source: &KernelSource, name: &str) -> Result<CudaFunction> {
        let key = (source.name, name.to_string());
        if let Some(f) = self.lock_functions().get(&key) {
            return Ok(f.clone());
        }
        let module = self.module(source)?;
        let f = module
            .load_function(name)
            .map_err(|e| self.err(source.name, "cuModuleGetFunction", (name, e)))?;
        self.lock_functions().insert(key, f.clone());
        Ok(f)
    }

    fn lock_functions(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<(&'static str, String), CudaFunction>> {
        // Poisoning leaves a map of valid entries.
        self.functions.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn module(&self, source: &KernelSource) -> Result<Arc<CudaModule>> {
        let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = modules.get(source.name) {
            return Ok(m.clone());
        }
        let cubin = nvrtc::cubin(source, &self.arch)?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(|e| self.err(source.name, "cuModuleLoadData", e))?;
        modules.insert(source.name, module.clone());
        Ok(module)
    }

    /// Uninitialised device memory for `len` elements of `dtype` (at least one element is allocated so
    /// that empty tensors have a buffer; kernels never run on them).
    pub fn alloc(&self, dtype: DType, len: usize) -> Result<CudaStorage> {
        let len = len.max(1);
        // SAFETY: every caller writes the elements it later reads (op outputs are fully written by their
        // kernel, uploads by the copy).
        let buf = unsafe {
            match dtype {
                DType::F32 => self.stream.alloc::<f32>(len).map(CudaBuf::F32),
                DType::BF16 => self.stream.alloc::<half::bf16>(len).map(CudaBuf::BF16),
            }
        }
        .map_err(|e| self.err("alloc", "cuMemAllocAsync", (len, e)))?;
        Ok(CudaStorage {
            buf,
            ordinal: self.ordinal,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel source compiles for Hopper. Needs only libnvrtc (and cuda_bf16.h), not a GPU: skips
    /// with a message where libnvrtc is absent.
    #[test]
    fn every_kernel_source_compiles_for_sm_90a() -> Result<()> {
        // SAFETY: only dlopens the candidate names.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("skipped: libnvrtc not found (set LD_LIBRARY_PATH to a CUDA 13 lib dir)");
            return Ok(());
        }
        // The GPU script's CUDA headers (DITSTREAM_CUDA_INCLUDE), as every GPU test's gate.
        crate::testing::configure_cuda()?;
        let sources = std::iter::once(&copy::SOURCE).chain(crate::ops::kernel_sources());
        for source in sources {
            let cubin = nvrtc::cubin(source, "sm_90a")?;
            assert!(
                cubin.starts_with(b"\x7fELF"),
                "{} did not give an ELF CUBIN",
                source.name
            );
        }
        Ok(())
    }

    /// A source NVRTC rejects is a `Compile` error carrying the compiler's log.
    #[test]
    fn compile_errors_carry_the_log() {
        // SAFETY: only dlopens the candidate names.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("skipped: libnvrtc not found");
            return;
        }
        // The GPU script's CUDA headers (DITSTREAM_CUDA_INCLUDE), as every GPU test's gate.
        crate::testing::configure_cuda().unwrap();
        let bad = KernelSource {
            name: "broken_test_kernel",
            text: "extern \"C\" __global__ void k() { undeclared_thing = 1; }",
        };
        match nvrtc::cubin(&bad, "sm_90a") {
            Err(KernelError::Compile { log, .. }) => {
                assert!(log.contains("undeclared_thing"), "log: {log}")
            }
            other => panic!("expected a compile error, got {other:?}"),
        }
    }
}
