//! Device storage of a tensor: one cudarc buffer (f32 or bf16) on one GPU, and the host copies.

use cudarc::driver::{CudaSlice, DevicePtr};
use half::bf16;

use super::CudaBackend;
use crate::tensor::CpuStorage;
use crate::{DType, Device, Result};

/// A device buffer in the tensor's dtype. It may hold more elements than the tensor (empty tensors get
/// one element; `reshape` shares the buffer), never fewer.
pub(crate) enum CudaBuf {
    F32(CudaSlice<f32>),
    BF16(CudaSlice<bf16>),
}

/// A tensor's storage on GPU `ordinal`; allocated on, and only used on, that GPU's backend stream.
pub(crate) struct CudaStorage {
    pub buf: CudaBuf,
    pub ordinal: usize,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaStorage({:?}, {} elements, cuda:{})",
            self.dtype(),
            self.capacity(),
            self.ordinal
        )
    }
}

impl CudaStorage {
    pub fn dtype(&self) -> DType {
        match self.buf {
            CudaBuf::F32(_) => DType::F32,
            CudaBuf::BF16(_) => DType::BF16,
        }
    }

    pub fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn capacity(&self) -> usize {
        match &self.buf {
            CudaBuf::F32(s) => s.len(),
            CudaBuf::BF16(s) => s.len(),
        }
    }

    /// The raw device address, passed to kernels as a `T*` argument. Valid while `self` lives; uses are
    /// ordered by the backend stream (event tracking is off, so the returned guard is a no-op).
    pub fn ptr(&self) -> u64 {
        match &self.buf {
            CudaBuf::F32(s) => s.device_ptr(s.stream()).0,
            CudaBuf::BF16(s) => s.device_ptr(s.stream()).0,
        }
    }

    /// Uploads host data to GPU `ordinal` (same dtype).
    pub fn upload(host: &CpuStorage, ordinal: usize) -> Result<Self> {
        let backend = CudaBackend::get(ordinal)?;
        let stream = &backend.stream;
        let buf = match host {
            CpuStorage::F32(data) if !data.is_empty() => stream.clone_htod(data).map(CudaBuf::F32),
            CpuStorage::BF16(data) if !data.is_empty() => {
                stream.clone_htod(data).map(CudaBuf::BF16)
            }
            _ => return backend.alloc(host_dtype(host), 0),
        }
        .map_err(|e| backend.err("to_device", "cuMemcpyHtoDAsync", e))?;
        Ok(CudaStorage { buf, ordinal })
    }

    /// Copies the first `numel` elements back to the host (synchronises the stream).
    pub fn download(&self, numel: usize) -> Result<CpuStorage> {
        let backend = CudaBackend::get(self.ordinal)?;
        let stream = &backend.stream;
        let err = |e| backend.err("to_host", "cuMemcpyDtoHAsync", e);
        let host = match &self.buf {
            CudaBuf::F32(_) if numel == 0 => CpuStorage::F32(Vec::new()),
            CudaBuf::BF16(_) if numel == 0 => CpuStorage::BF16(Vec::new()),
            CudaBuf::F32(s) => CpuStorage::F32(stream.clone_dtoh(&s.slice(..numel)).map_err(err)?),
            CudaBuf::BF16(s) => {
                CpuStorage::BF16(stream.clone_dtoh(&s.slice(..numel)).map_err(err)?)
            }
        };
        // A copy into pageable memory has finished when the call returns, but say so explicitly: the
        // host vector is read right after.
        stream
            .synchronize()
            .map_err(|e| backend.err("to_host", "cuStreamSynchronize", e))?;
        Ok(host)
    }
}

fn host_dtype(host: &CpuStorage) -> DType {
    match host {
        CpuStorage::F32(_) => DType::F32,
        CpuStorage::BF16(_) => DType::BF16,
    }
}
