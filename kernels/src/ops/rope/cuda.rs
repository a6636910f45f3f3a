//! CUDA twin of `apply_rope` (`rope.cu`). The cos/sin tables are read in their dtype (cast to f32 first
//! when the two differ).

use cudarc::driver::PushKernelArg;

use crate::cuda::{CudaBackend, KernelSource, grid_1d, suffix};
use crate::{DType, Result, Tensor};

pub(crate) const SOURCE: KernelSource = KernelSource {
    name: "rope",
    text: include_str!("rope.cu"),
};

/// x [B, S, H, D], cos/sin [S, D/2] → x's shape and dtype.
pub(super) fn apply_rope(
    op: &'static str,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    [batch, seq, heads, head_dim]: [usize; 4],
) -> Result<Tensor> {
    let sx = x.cuda_storage(op)?;
    let backend = CudaBackend::get(sx.ordinal)?;
    let out = backend.alloc(x.dtype(), x.numel())?;
    let pairs = head_dim / 2;
    let threads = batch * seq * heads * pairs;
    if threads > 0 {
        let table_dtype = if cos.dtype() == sin.dtype() {
            cos.dtype()
        } else {
            DType::F32
        };
        let (cos, sin) = (cos.to_dtype(table_dtype)?, sin.to_dtype(table_dtype)?);
        let name = format!("apply_rope_{}_{}", suffix(x.dtype()), suffix(table_dtype));
        let f = backend.function(&SOURCE, &name)?;
        let (xp, cp, sp, outp) = (
            sx.ptr(),
            cos.cuda_storage(op)?.ptr(),
            sin.cuda_storage(op)?.ptr(),
            out.ptr(),
        );
        let dims = [batch as i64, seq as i64, heads as i64, pairs as i64];
        let mut launch = backend.stream.launch_builder(&f);
        launch.arg(&xp).arg(&cp).arg(&sp).arg(&outp);
        launch
            .arg(&dims[0])
            .arg(&dims[1])
            .arg(&dims[2])
            .arg(&dims[3]);
        // SAFETY: x/out hold B·S·H·D elements, the tables S·D/2 (checked by the caller).
        unsafe { launch.launch(grid_1d(threads)) }
            .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    }
    Ok(Tensor::from_cuda(out, x.shape()))
}
