//! [`Indices`]: integer indices (token ids, relative-position buckets, per-row lengths) on a device,
//! for the ops that look values up by index. Tensors hold f32/bf16 only; an index is a u32, and it is
//! checked against the table it will address once, on the host, when made, so the kernels that read
//! it never go out of bounds.

use std::sync::Arc;

use crate::{Device, KernelError, Result};

/// Where the values live.
enum IndexStorage {
    Cpu(Vec<u32>),
    #[cfg(feature = "cuda")]
    Cuda {
        buf: cudarc::driver::CudaSlice<u32>,
        ordinal: usize,
    },
}

/// A flat list of u32 indices, each `< bound`, on one device. Cloning is cheap (shared storage).
#[derive(Clone)]
pub struct Indices {
    storage: Arc<IndexStorage>,
    len: usize,
    bound: usize,
}

impl std::fmt::Debug for Indices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Indices({} values < {} on {})",
            self.len,
            self.bound,
            self.device()
        )
    }
}

impl Indices {
    /// `values`, each checked to be `< bound`, copied to `device` (one host-to-device copy on a GPU).
    /// `what` names the values in the error (e.g. "token id").
    pub fn new(values: &[u32], bound: usize, what: &str, device: Device) -> Result<Self> {
        if let Some((i, &bad)) = values
            .iter()
            .enumerate()
            .find(|&(_, &v)| v as usize >= bound)
        {
            return Err(KernelError::arg(
                "Indices::new",
                "values",
                format!("{what} {bad} at position {i}"),
                format!("every {what} must be < {bound}"),
            ));
        }
        let storage = match device {
            Device::Cpu => IndexStorage::Cpu(values.to_vec()),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => {
                let backend = crate::cuda::CudaBackend::get(ordinal)?;
                // An empty list still gets a one-element buffer, as tensors do; kernels never read it.
                let host = if values.is_empty() {
                    &[0u32][..]
                } else {
                    values
                };
                let buf = backend
                    .stream
                    .clone_htod(host)
                    .map_err(|e| backend.err("Indices::new", "cuMemcpyHtoDAsync", e))?;
                IndexStorage::Cuda { buf, ordinal }
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => {
                return Err(KernelError::UnsupportedDevice {
                    op: "Indices::new",
                    device,
                });
            }
        };
        Ok(Indices {
            storage: Arc::new(storage),
            len: values.len(),
            bound,
        })
    }

    /// Number of indices.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every value is `< bound` (checked when made).
    pub fn bound(&self) -> usize {
        self.bound
    }

    /// Where the values live.
    pub fn device(&self) -> Device {
        match self.storage.as_ref() {
            IndexStorage::Cpu(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            IndexStorage::Cuda { ordinal, .. } => Device::Cuda(*ordinal),
        }
    }

    /// The host values, or `UnsupportedDevice` naming `op` for indices on a GPU.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))] // `op` names the GPU case only
    pub(crate) fn cpu(&self, op: &'static str) -> Result<&[u32]> {
        match self.storage.as_ref() {
            IndexStorage::Cpu(v) => Ok(v),
            #[cfg(feature = "cuda")]
            IndexStorage::Cuda { .. } => Err(KernelError::UnsupportedDevice {
                op,
                device: self.device(),
            }),
        }
    }

    /// The device address of the first value (a `const unsigned*` kernel argument), or
    /// `UnsupportedDevice` naming `op` for host indices. Valid while `self` lives; uses are ordered by
    /// the device's one stream (event tracking is off).
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_ptr(&self, op: &'static str) -> Result<u64> {
        use cudarc::driver::DevicePtr;
        match self.storage.as_ref() {
            IndexStorage::Cuda { buf, .. } => Ok(buf.device_ptr(buf.stream()).0),
            IndexStorage::Cpu(_) => Err(KernelError::UnsupportedDevice {
                op,
                device: Device::Cpu,
            }),
        }
    }

    /// The values back on the host (from a GPU this waits for the device's stream).
    pub fn to_vec(&self) -> Result<Vec<u32>> {
        match self.storage.as_ref() {
            IndexStorage::Cpu(v) => Ok(v.clone()),
            #[cfg(feature = "cuda")]
            IndexStorage::Cuda { buf, ordinal } => {
                if self.len == 0 {
                    return Ok(Vec::new());
                }
                let backend = crate::cuda::CudaBackend::get(*ordinal)?;
                let host = backend
                    .stream
                    .clone_dtoh(&buf.slice(..self.len))
                    .map_err(|e| backend.err("Indices::to_vec", "cuMemcpyDtoHAsync", e))?;
                backend
                    .stream
                    .synchronize()
                    .map_err(|e| backend.err("Indices::to_vec", "cuStreamSynchronize", e))?;
                Ok(host)
            }
        }
    }
}
