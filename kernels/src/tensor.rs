//! `Tensor`: shape + dtype + device over contiguous row-major storage, with the layout ops
//! (reshape, permute, narrow, concat, split), casts, host copies and seeded random fills.
//!
//! Every tensor is contiguous. Layout changes other than `reshape` copy; this keeps every op's
//! reference implementation a plain loop over a flat slice, and a CUDA kernel a plain index map.

use std::borrow::Cow;
use std::sync::Arc;

use half::bf16;

use crate::{DType, Device, KernelError, Result, rng};

/// Host storage: one flat row-major buffer in the tensor's dtype.
#[derive(Debug, Clone)]
pub(crate) enum CpuStorage {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
}

/// Storage of a tensor, one variant per backend; every `match` on this enum is a dispatch point.
#[derive(Debug)]
pub(crate) enum Storage {
    Cpu(CpuStorage),
    /// A device buffer (f32 or bf16) on one GPU (feature `cuda`).
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaStorage),
}

/// An n-dimensional array: contiguous, row-major, f32 or bf16, on one device.
///
/// Cloning is cheap (the storage is shared); ops never mutate their inputs.
#[derive(Debug, Clone)]
pub struct Tensor {
    storage: Arc<Storage>,
    shape: Vec<usize>,
}

/// Row-major strides (in elements) of a contiguous tensor of this shape.
pub(crate) fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for axis in (0..shape.len().saturating_sub(1)).rev() {
        strides[axis] = strides[axis + 1] * shape[axis + 1];
    }
    strides
}

/// Walks every index of `shape` in row-major order and yields the matching offset into a buffer
/// addressed with `strides` (which may be 0 for broadcast axes, or permuted strides).
pub(crate) struct StridedOffsets {
    shape: Vec<usize>,
    strides: Vec<usize>,
    index: Vec<usize>,
    offset: usize,
    remaining: usize,
}

impl StridedOffsets {
    pub(crate) fn new(shape: &[usize], strides: &[usize]) -> Self {
        debug_assert_eq!(shape.len(), strides.len());
        StridedOffsets {
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            index: vec![0; shape.len()],
            offset: 0,
            remaining: shape.iter().product(),
        }
    }
}

impl Iterator for StridedOffsets {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.remaining == 0 {
            return None;
        }
        let current = self.offset;
        self.remaining -= 1;
        // Odometer step: bump the last axis, carrying into earlier axes.
        for axis in (0..self.shape.len()).rev() {
            self.index[axis] += 1;
            self.offset += self.strides[axis];
            if self.index[axis] < self.shape[axis] {
                break;
            }
            self.offset -= self.strides[axis] * self.shape[axis];
            self.index[axis] = 0;
        }
        Some(current)
    }
}

/// Applies a dtype-generic copy to either storage variant, keeping the dtype.
macro_rules! map_cpu {
    ($storage:expr, |$data:ident| $body:expr) => {
        match $storage {
            CpuStorage::F32($data) => CpuStorage::F32($body),
            CpuStorage::BF16($data) => CpuStorage::BF16($body),
        }
    };
}

impl CpuStorage {
    fn len(&self) -> usize {
        match self {
            CpuStorage::F32(data) => data.len(),
            CpuStorage::BF16(data) => data.len(),
        }
    }

    fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::BF16(_) => DType::BF16,
        }
    }

    /// Stores f32 values in `dtype` (round-to-nearest-even for bf16).
    fn from_f32(data: Vec<f32>, dtype: DType) -> Self {
        match dtype {
            DType::F32 => CpuStorage::F32(data),
            DType::BF16 => CpuStorage::BF16(data.into_iter().map(bf16::from_f32).collect()),
        }
    }
}

impl Tensor {
    fn from_cpu(storage: CpuStorage, shape: &[usize], op: &'static str) -> Result<Self> {
        let numel: usize = shape.iter().product();
        if storage.len() != numel {
            return Err(KernelError::DataLength {
                op,
                shape: shape.to_vec(),
                numel,
                len: storage.len(),
            });
        }
        Ok(Tensor {
            storage: Arc::new(Storage::Cpu(storage)),
            shape: shape.to_vec(),
        })
    }

    /// Wraps host f32 values (row-major) as a CPU f32 tensor. `data.len()` must equal the shape's product.
    pub fn from_vec(data: Vec<f32>, shape: &[usize]) -> Result<Self> {
        Self::from_cpu(CpuStorage::F32(data), shape, "from_vec")
    }

    /// Wraps host bf16 values (row-major) as a CPU bf16 tensor.
    pub fn from_bf16_vec(data: Vec<bf16>, shape: &[usize]) -> Result<Self> {
        Self::from_cpu(CpuStorage::BF16(data), shape, "from_bf16_vec")
    }

    /// Op outputs: f32 results stored in `dtype` on the CPU. Callers guarantee the length.
    pub(crate) fn from_f32_cpu(data: Vec<f32>, shape: &[usize], dtype: DType) -> Result<Self> {
        Self::from_cpu(CpuStorage::from_f32(data, dtype), shape, "op output")
    }

    /// Wraps a device buffer (op outputs on a GPU); the buffer holds at least the shape's elements.
    #[cfg(feature = "cuda")]
    pub(crate) fn from_cuda(storage: crate::cuda::CudaStorage, shape: &[usize]) -> Self {
        Tensor {
            storage: Arc::new(Storage::Cuda(storage)),
            shape: shape.to_vec(),
        }
    }

    /// A tensor of `value` everywhere.
    pub fn full(shape: &[usize], value: f32, dtype: DType, device: Device) -> Result<Self> {
        // Built on the host and uploaded: fills are rare (caches, accumulators), not per step.
        let numel = shape.iter().product();
        Self::from_f32_cpu(vec![value; numel], shape, dtype)?.to_device(device)
    }

    /// A tensor of zeros.
    pub fn zeros(shape: &[usize], dtype: DType, device: Device) -> Result<Self> {
        Self::full(shape, 0.0, dtype, device)
    }

    /// Standard normal samples; element `i` depends only on `(seed, i)` (see the `rng` module), so the
    /// same seed gives the same tensor on every machine and thread count. bf16 stores the rounded samples.
    /// On a GPU the samples are drawn on the host and uploaded, so they equal the CPU's bit for bit.
    pub fn randn(shape: &[usize], dtype: DType, seed: u64, device: Device) -> Result<Self> {
        let numel: usize = shape.iter().product();
        let data = (0..numel as u64).map(|i| rng::normal_at(seed, i)).collect();
        Self::from_f32_cpu(data, shape, dtype)?.to_device(device)
    }

    /// Dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Length of `axis`.
    pub fn dim(&self, axis: usize) -> Result<usize> {
        self.shape
            .get(axis)
            .copied()
            .ok_or(KernelError::AxisOutOfRange {
                op: "dim",
                axis,
                rank: self.rank(),
            })
    }

    /// Element storage type.
    pub fn dtype(&self) -> DType {
        match self.storage.as_ref() {
            Storage::Cpu(cpu) => cpu.dtype(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(gpu) => gpu.dtype(),
        }
    }

    /// Where the storage lives.
    pub fn device(&self) -> Device {
        match self.storage.as_ref() {
            Storage::Cpu(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Storage::Cuda(gpu) => gpu.device(),
        }
    }

    /// Host storage, or `UnsupportedDevice` naming `op` for a tensor on another device.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))] // `op` names the GPU case only
    pub(crate) fn cpu_storage(&self, op: &'static str) -> Result<&CpuStorage> {
        match self.storage.as_ref() {
            Storage::Cpu(cpu) => Ok(cpu),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => Err(KernelError::UnsupportedDevice {
                op,
                device: self.device(),
            }),
        }
    }

    /// A weak handle on the storage, which this tensor shares with its clones and reshapes: while the
    /// handle lives no other storage can take its address, and it upgrades only while the storage does.
    /// For caches of values derived from a tensor (the channels-last filters of `ops/conv/cuda.rs`).
    #[cfg(feature = "cuda")]
    pub(crate) fn storage_weak(&self) -> std::sync::Weak<Storage> {
        Arc::downgrade(&self.storage)
    }

    /// Device storage, or `UnsupportedDevice` naming `op` for a tensor on the host.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_storage(&self, op: &'static str) -> Result<&crate::cuda::CudaStorage> {
        match self.storage.as_ref() {
            Storage::Cuda(gpu) => Ok(gpu),
            Storage::Cpu(_) => Err(KernelError::UnsupportedDevice {
                op,
                device: Device::Cpu,
            }),
        }
    }

    /// The values in host memory: borrowed on the CPU, copied back from a GPU (which waits for the ops
    /// queued on its stream).
    fn host_storage(&self) -> Result<Cow<'_, CpuStorage>> {
        match self.storage.as_ref() {
            Storage::Cpu(cpu) => Ok(Cow::Borrowed(cpu)),
            #[cfg(feature = "cuda")]
            Storage::Cuda(gpu) => Ok(Cow::Owned(gpu.download(self.numel())?)),
        }
    }

    /// Host values as f32: borrowed when stored as f32, converted when bf16. The CPU reference ops read
    /// their inputs through this.
    pub(crate) fn cpu_f32(&self, op: &'static str) -> Result<Cow<'_, [f32]>> {
        Ok(match self.cpu_storage(op)? {
            CpuStorage::F32(data) => Cow::Borrowed(data.as_slice()),
            CpuStorage::BF16(data) => Cow::Owned(data.iter().map(|v| v.to_f32()).collect()),
        })
    }

    /// A copy of the values as f32 in host memory (bf16 widens exactly); from any device.
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        Ok(match self.host_storage()?.into_owned() {
            CpuStorage::F32(data) => data,
            CpuStorage::BF16(data) => data.iter().map(|v| v.to_f32()).collect(),
        })
    }

    /// A copy of the values as bf16 in host memory (f32 rounds to nearest even); from any device.
    pub fn to_vec_bf16(&self) -> Result<Vec<bf16>> {
        Ok(match self.host_storage()?.into_owned() {
            CpuStorage::F32(data) => data.iter().map(|&v| bf16::from_f32(v)).collect(),
            CpuStorage::BF16(data) => data,
        })
    }

    /// The same values stored as `dtype` (a cheap clone when already `dtype`). f32 → bf16 rounds to
    /// nearest even; bf16 → f32 is exact.
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        #[cfg(feature = "cuda")]
        if let Storage::Cuda(src) = self.storage.as_ref() {
            let out = crate::cuda::CudaBackend::get(src.ordinal)?.alloc(dtype, self.numel())?;
            let strides = contiguous_strides(&self.shape);
            crate::cuda::copy_strided(
                "to_dtype",
                src,
                0,
                &strides,
                &out,
                0,
                &strides,
                &self.shape,
            )?;
            return Ok(Self::from_cuda(out, &self.shape));
        }
        let values = self.cpu_f32("to_dtype")?.into_owned();
        Self::from_f32_cpu(values, &self.shape, dtype)
    }

    /// A copy on `device` (a cheap clone when already there). Between two GPUs the copy goes through
    /// the host (peer copies are the collectives' business).
    pub fn to_device(&self, device: Device) -> Result<Self> {
        if device == self.device() {
            return Ok(self.clone());
        }
        match device {
            Device::Cpu => {
                let host = self.host_storage()?.into_owned();
                Self::from_cpu(host, &self.shape, "to_device")
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => {
                let host = self.host_storage()?;
                let gpu = crate::cuda::CudaStorage::upload(&host, ordinal)?;
                Ok(Self::from_cuda(gpu, &self.shape))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(KernelError::UnsupportedDevice {
                op: "to_device",
                device,
            }),
        }
    }

    /// Whether `other` is this very tensor (a clone of it, or of the same reshape): the same
    /// storage and shape. Ops never mutate their inputs, so such a tensor holds the same values,
    /// which lets a cache keyed on it skip comparing them.
    pub fn is_same(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage) && self.shape == other.shape
    }

    /// The same data under a new shape with the same element count. Free: the storage is shared.
    pub fn reshape(&self, shape: &[usize]) -> Result<Self> {
        let numel: usize = shape.iter().product();
        if numel != self.numel() {
            return Err(KernelError::shape(
                "reshape",
                format!("element counts differ ({} vs {numel})", self.numel()),
                &[&self.shape, shape],
            ));
        }
        Ok(Tensor {
            storage: Arc::clone(&self.storage),
            shape: shape.to_vec(),
        })
    }

    /// A contiguous copy with axes reordered: output axis `i` is input axis `perm[i]`
    /// (PyTorch's `x.permute(perm).contiguous()`).
    pub fn permute(&self, perm: &[usize]) -> Result<Self> {
        let mut seen = vec![false; self.rank()];
        let valid = perm.len() == self.rank()
            && perm
                .iter()
                .all(|&p| p < seen.len() && !std::mem::replace(&mut seen[p], true));
        if !valid {
            return Err(KernelError::InvalidPermutation {
                perm: perm.to_vec(),
                shape: self.shape.clone(),
            });
        }
        let in_strides = contiguous_strides(&self.shape);
        let out_shape: Vec<usize> = perm.iter().map(|&p| self.shape[p]).collect();
        let strides_by_out_axis: Vec<usize> = perm.iter().map(|&p| in_strides[p]).collect();
        #[cfg(feature = "cuda")]
        if let Storage::Cuda(src) = self.storage.as_ref() {
            let out =
                crate::cuda::CudaBackend::get(src.ordinal)?.alloc(self.dtype(), self.numel())?;
            let out_strides = contiguous_strides(&out_shape);
            crate::cuda::copy_strided(
                "permute",
                src,
                0,
                &strides_by_out_axis,
                &out,
                0,
                &out_strides,
                &out_shape,
            )?;
            return Ok(Self::from_cuda(out, &out_shape));
        }
        let storage = map_cpu!(self.cpu_storage("permute")?, |data| {
            StridedOffsets::new(&out_shape, &strides_by_out_axis)
                .map(|offset| data[offset])
                .collect()
        });
        Self::from_cpu(storage, &out_shape, "permute")
    }

    /// `(outer, dim, inner)`: the tensor viewed as a 3-D block around `axis`.
    fn split_at_axis(&self, op: &'static str, axis: usize) -> Result<(usize, usize, usize)> {
        if axis >= self.rank() {
            return Err(KernelError::AxisOutOfRange {
                op,
                axis,
                rank: self.rank(),
            });
        }
        let outer = self.shape[..axis].iter().product();
        let inner = self.shape[axis + 1..].iter().product();
        Ok((outer, self.shape[axis], inner))
    }

    /// A contiguous copy of indices `start..start + len` along `axis`.
    pub fn narrow(&self, axis: usize, start: usize, len: usize) -> Result<Self> {
        let (outer, dim, inner) = self.split_at_axis("narrow", axis)?;
        if start + len > dim {
            return Err(KernelError::RangeOutOfBounds {
                op: "narrow",
                axis,
                start,
                end: start + len,
                dim,
                shape: self.shape.clone(),
            });
        }
        let mut out_shape = self.shape.clone();
        out_shape[axis] = len;
        #[cfg(feature = "cuda")]
        if let Storage::Cuda(src) = self.storage.as_ref() {
            let numel = outer * len * inner;
            let out = crate::cuda::CudaBackend::get(src.ordinal)?.alloc(self.dtype(), numel)?;
            crate::cuda::copy_strided(
                "narrow",
                src,
                start * inner,
                &contiguous_strides(&self.shape),
                &out,
                0,
                &contiguous_strides(&out_shape),
                &out_shape,
            )?;
            return Ok(Self::from_cuda(out, &out_shape));
        }
        let storage = map_cpu!(self.cpu_storage("narrow")?, |data| {
            let mut out = Vec::with_capacity(outer * len * inner);
            for o in 0..outer {
                let begin = (o * dim + start) * inner;
                out.extend_from_slice(&data[begin..begin + len * inner]);
            }
            out
        });
        Self::from_cpu(storage, &out_shape, "narrow")
    }

    /// Joins tensors along `axis`; all other dims, the dtype and the device must agree.
    pub fn concat(tensors: &[&Tensor], axis: usize) -> Result<Self> {
        let Some(first) = tensors.first() else {
            return Err(KernelError::arg(
                "concat",
                "tensors",
                "[]",
                "at least one tensor is needed",
            ));
        };
        first.split_at_axis("concat", axis)?;
        for t in tensors {
            let same_other_dims = t.rank() == first.rank()
                && (0..t.rank()).all(|a| a == axis || t.shape[a] == first.shape[a]);
            if !same_other_dims {
                let shapes: Vec<&[usize]> = tensors.iter().map(|t| t.shape()).collect();
                return Err(KernelError::shape(
                    "concat",
                    format!("all dims except axis {axis} must agree"),
                    &shapes,
                ));
            }
            if t.dtype() != first.dtype() {
                return Err(KernelError::DTypeMismatch {
                    op: "concat",
                    name: "tensors",
                    expected: first.dtype(),
                    got: t.dtype(),
                });
            }
            crate::ops::same_device("concat", &[first, t])?;
        }
        let outer: usize = first.shape[..axis].iter().product();
        let inner: usize = first.shape[axis + 1..].iter().product();
        let mut out_shape = first.shape.clone();
        out_shape[axis] = tensors.iter().map(|t| t.shape[axis]).sum();
        #[cfg(feature = "cuda")]
        if let Storage::Cuda(first_gpu) = first.storage.as_ref() {
            // Each part lands at its offset along `axis` of the output, read contiguously.
            let numel = out_shape.iter().product();
            let out =
                crate::cuda::CudaBackend::get(first_gpu.ordinal)?.alloc(first.dtype(), numel)?;
            let out_strides = contiguous_strides(&out_shape);
            let mut at = 0;
            for t in tensors {
                crate::cuda::copy_strided(
                    "concat",
                    t.cuda_storage("concat")?,
                    0,
                    &contiguous_strides(&t.shape),
                    &out,
                    at * out_strides[axis],
                    &out_strides,
                    &t.shape,
                )?;
                at += t.shape[axis];
            }
            return Ok(Self::from_cuda(out, &out_shape));
        }

        // Row `o` of the output is row `o` of each input in turn. Going through f32 is exact for bf16
        // (widening, then rounding a value that is already a bf16).
        let parts = tensors
            .iter()
            .map(|t| t.cpu_f32("concat"))
            .collect::<Result<Vec<_>>>()?;
        let row_lens: Vec<usize> = tensors.iter().map(|t| t.shape[axis] * inner).collect();
        let mut out = Vec::with_capacity(out_shape.iter().product());
        for o in 0..outer {
            for (part, &row) in parts.iter().zip(&row_lens) {
                out.extend_from_slice(&part[o * row..(o + 1) * row]);
            }
        }
        Self::from_f32_cpu(out, &out_shape, first.dtype())
    }

    /// Cuts `axis` into consecutive pieces of the given sizes, which must add up to the axis length.
    pub fn split(&self, axis: usize, sizes: &[usize]) -> Result<Vec<Self>> {
        let (_, dim, _) = self.split_at_axis("split", axis)?;
        if sizes.iter().sum::<usize>() != dim {
            return Err(KernelError::arg(
                "split",
                "sizes",
                format!("{sizes:?}"),
                format!("they must add up to axis {axis}'s length {dim}"),
            ));
        }
        let mut start = 0;
        let mut pieces = Vec::with_capacity(sizes.len());
        for &size in sizes {
            pieces.push(self.narrow(axis, start, size)?);
            start += size;
        }
        Ok(pieces)
    }

    /// Cuts `axis` into `n` equal pieces; the axis length must divide by `n`.
    pub fn chunk(&self, axis: usize, n: usize) -> Result<Vec<Self>> {
        let (_, dim, _) = self.split_at_axis("chunk", axis)?;
        if n == 0 || dim % n != 0 {
            return Err(KernelError::arg(
                "chunk",
                "n",
                n,
                format!("it must divide axis {axis}'s length {dim}"),
            ));
        }
        self.split(axis, &vec![dim / n; n])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arange(shape: &[usize]) -> Tensor {
        let numel: usize = shape.iter().product();
        Tensor::from_vec((0..numel).map(|i| i as f32).collect(), shape).expect("arange")
    }

    #[test]
    fn construction_checks_lengths_and_devices() {
        assert!(matches!(
            Tensor::from_vec(vec![1.0; 5], &[2, 3]),
            Err(KernelError::DataLength {
                numel: 6,
                len: 5,
                ..
            })
        ));
        let z = Tensor::zeros(&[2, 3], DType::BF16, Device::Cpu).expect("zeros");
        assert_eq!(
            (z.shape(), z.dtype(), z.device()),
            (&[2, 3][..], DType::BF16, Device::Cpu)
        );
        assert_eq!(z.numel(), 6);
        assert_eq!(z.dim(1).ok(), Some(3));
        assert!(z.dim(2).is_err());
        #[cfg(not(feature = "cuda"))]
        {
            assert!(matches!(
                Tensor::zeros(&[2], DType::F32, Device::Cuda(0)),
                Err(KernelError::UnsupportedDevice { .. })
            ));
            assert!(z.to_device(Device::Cuda(1)).is_err());
        }
    }

    #[test]
    fn randn_is_deterministic_per_seed() -> Result<()> {
        let a = Tensor::randn(&[4, 5], DType::F32, 3, Device::Cpu)?.to_vec_f32()?;
        let b = Tensor::randn(&[4, 5], DType::F32, 3, Device::Cpu)?.to_vec_f32()?;
        let c = Tensor::randn(&[4, 5], DType::F32, 4, Device::Cpu)?.to_vec_f32()?;
        assert_eq!(a, b);
        assert_ne!(a, c);
        // Element i depends only on (seed, i): a longer draw extends a shorter one.
        let longer = Tensor::randn(&[30], DType::F32, 3, Device::Cpu)?.to_vec_f32()?;
        assert_eq!(&longer[..20], a.as_slice());
        Ok(())
    }

    #[test]
    fn bf16_casts_round_trip() -> Result<()> {
        // Near 1 the bf16 spacing is 2⁻⁷. 1 + 2⁻⁸ is a tie and rounds to even (1.0); 1 + 3·2⁻⁸ is a tie
        // between 1 + 2⁻⁷ (odd) and 1 + 2⁻⁶ (even) and rounds to the latter; 1 + 2⁻⁷ is exact.
        let x = Tensor::from_vec(
            vec![
                1.0 + 2f32.powi(-8),
                1.0 + 3.0 * 2f32.powi(-8),
                1.0 + 2f32.powi(-7),
                -0.0,
            ],
            &[4],
        )?;
        let x16 = x.to_dtype(DType::BF16)?;
        assert_eq!(x16.dtype(), DType::BF16);
        assert_eq!(
            x16.to_vec_f32()?,
            [1.0, 1.0 + 2f32.powi(-6), 1.0 + 2f32.powi(-7), -0.0]
        );
        // bf16 → f32 is exact, so bf16 → f32 → bf16 is the identity.
        let r = Tensor::randn(&[1000], DType::BF16, 5, Device::Cpu)?;
        assert_eq!(
            r.to_dtype(DType::F32)?
                .to_dtype(DType::BF16)?
                .to_vec_bf16()?,
            r.to_vec_bf16()?
        );
        // f32 → bf16 has relative error ≤ 2⁻⁸ (8 significant bits, round to nearest).
        let f = Tensor::randn(&[1000], DType::F32, 6, Device::Cpu)?;
        let back = f.to_dtype(DType::BF16)?.to_vec_f32()?;
        for (a, b) in f.to_vec_f32()?.iter().zip(&back) {
            assert!((a - b).abs() <= a.abs() * 2f32.powi(-8), "{a} → {b}");
        }
        Ok(())
    }

    #[test]
    fn reshape_shares_and_checks() -> Result<()> {
        let x = arange(&[2, 3, 4]);
        let y = x.reshape(&[6, 4])?;
        assert_eq!(y.to_vec_f32()?, x.to_vec_f32()?);
        assert!(x.reshape(&[5, 5]).is_err());
        Ok(())
    }

    #[test]
    fn permute_matches_index_formula() -> Result<()> {
        let (a, b, c, d) = (2, 3, 4, 5);
        let x = arange(&[a, b, c, d]);
        let y = x.permute(&[2, 0, 3, 1])?; // [c, a, d, b]
        assert_eq!(y.shape(), [c, a, d, b]);
        let yv = y.to_vec_f32()?;
        for i in 0..a {
            for j in 0..b {
                for k in 0..c {
                    for l in 0..d {
                        let src = ((i * b + j) * c + k) * d + l;
                        let dst = ((k * a + i) * d + l) * b + j;
                        assert_eq!(yv[dst], src as f32);
                    }
                }
            }
        }
        // bf16 stays bf16; invalid permutations are errors.
        assert_eq!(
            x.to_dtype(DType::BF16)?.permute(&[3, 2, 1, 0])?.dtype(),
            DType::BF16
        );
        assert!(x.permute(&[0, 1, 1, 2]).is_err());
        assert!(x.permute(&[0, 1, 2]).is_err());
        Ok(())
    }

    #[test]
    fn narrow_concat_split_chunk() -> Result<()> {
        let x = arange(&[2, 5, 3]);
        let mid = x.narrow(1, 1, 2)?;
        assert_eq!(mid.shape(), [2, 2, 3]);
        assert_eq!(
            mid.to_vec_f32()?,
            [3., 4., 5., 6., 7., 8., 18., 19., 20., 21., 22., 23.]
        );
        assert!(x.narrow(1, 4, 2).is_err());
        assert!(x.narrow(3, 0, 1).is_err());

        let parts = x.split(1, &[1, 3, 1])?;
        assert_eq!(parts[1].shape(), [2, 3, 3]);
        let joined = Tensor::concat(&parts.iter().collect::<Vec<_>>(), 1)?;
        assert_eq!(joined.to_vec_f32()?, x.to_vec_f32()?);
        assert!(x.split(1, &[2, 2]).is_err());

        let halves = x.chunk(0, 2)?;
        assert_eq!(
            halves[1].to_vec_f32()?,
            (15..30).map(|i| i as f32).collect::<Vec<_>>()
        );
        assert!(x.chunk(1, 2).is_err());

        // Concat checks the other dims and the dtype.
        let y = arange(&[2, 5, 4]);
        assert!(Tensor::concat(&[&x, &y], 1).is_err());
        assert_eq!(Tensor::concat(&[&x, &y], 2)?.shape(), [2, 5, 7]);
        assert!(Tensor::concat(&[&x, &x.to_dtype(DType::BF16)?], 0).is_err());
        assert!(Tensor::concat(&[], 0).is_err());
        // bf16 concat is exact.
        let x16 = x.to_dtype(DType::BF16)?;
        let joined = Tensor::concat(&[&x16, &x16], 0)?;
        assert_eq!(joined.dtype(), DType::BF16);
        assert_eq!(joined.narrow(0, 2, 2)?.to_vec_bf16()?, x16.to_vec_bf16()?);
        Ok(())
    }
}
