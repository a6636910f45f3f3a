//! CUDA twin of the seeded normal draw (`random.cu`).

use cudarc::driver::PushKernelArg;

use crate::cuda::{CudaBackend, KernelSource, grid_1d, suffix};
use crate::{DType, Result, Tensor};

pub(crate) const SOURCE: KernelSource = KernelSource {
    name: "random",
    text: include_str!("random.cu"),
};

/// A fresh tensor of `shape` on GPU `ordinal` filled with `mean + std · n_i` in `dtype`.
pub(super) fn random_normal(
    shape: &[usize],
    mean: f32,
    std: f32,
    dtype: DType,
    seed: u64,
    ordinal: usize,
) -> Result<Tensor> {
    let backend = CudaBackend::get(ordinal)?;
    let numel: usize = shape.iter().product();
    let out = backend.alloc(dtype, numel)?;
    if numel > 0 {
        let f = backend.function(&SOURCE, &format!("random_normal_{}", suffix(dtype)))?;
        let (outp, n) = (out.ptr(), numel as i64);
        let mut launch = backend.stream.launch_builder(&f);
        launch.arg(&outp).arg(&n).arg(&seed).arg(&mean).arg(&std);
        // SAFETY: out holds numel elements of the kernel's T; arguments match its signature.
        unsafe { launch.launch(grid_1d(numel)) }
            .map_err(|e| backend.err("random_normal", "cuLaunchKernel", e))?;
    }
    Ok(Tensor::from_cuda(out, shape))
}
