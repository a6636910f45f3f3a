//! CUDA twin of the row gather (`embedding.cu`).

use cudarc::driver::PushKernelArg;

use super::Indices;
use crate::cuda::{CudaBackend, KernelSource, grid_1d, suffix};
use crate::{Result, Tensor};

pub(crate) const SOURCE: KernelSource = KernelSource {
    name: "embedding",
    text: include_str!("embedding.cu"),
};

/// table [V, D], ids [N] → `out_shape` = [N, D] in the table's dtype.
pub(super) fn embedding(
    op: &'static str,
    table: &Tensor,
    ids: &Indices,
    out_shape: &[usize; 2],
) -> Result<Tensor> {
    let st = table.cuda_storage(op)?;
    let backend = CudaBackend::get(st.ordinal)?;
    let [n, d] = *out_shape;
    let out = backend.alloc(table.dtype(), n * d)?;
    if n * d > 0 {
        let f = backend.function(&SOURCE, &format!("embedding_{}", suffix(table.dtype())))?;
        let (tp, ip, outp) = (st.ptr(), ids.cuda_ptr(op)?, out.ptr());
        let (n_i, d_i) = (n as i64, d as i64);
        let mut launch = backend.stream.launch_builder(&f);
        launch.arg(&tp).arg(&ip).arg(&outp).arg(&n_i).arg(&d_i);
        // SAFETY: table holds V·d elements and every id is < V (Indices' bound, checked ≤ V by the
        // caller); ids holds n values; out holds n·d. Arguments match the kernel's signature.
        unsafe { launch.launch(grid_1d(n * d)) }
            .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    }
    Ok(Tensor::from_cuda(out, out_shape))
}
