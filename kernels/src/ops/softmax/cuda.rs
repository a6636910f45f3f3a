//! CUDA twin of the biased, masked softmax (`softmax.cu`): one warp per row of keys.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::cpu::Dims;
use crate::cuda::{CudaBackend, KernelSource, suffix};
use crate::{Indices, KernelError, Result, Tensor};

pub(crate) const SOURCE: KernelSource = KernelSource {
    name: "softmax",
    text: include_str!("softmax.cu"),
};

/// Warps (rows) per block.
const ROWS_PER_BLOCK: u32 = 8;

fn int(op: &'static str, name: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v)
        .map_err(|_| KernelError::arg(op, name, v, "the CUDA kernel takes it as an i32"))
}

/// logits [B, H, S_q, S_k] (+ table, buckets, valid_lens, all checked by the caller) → weights in the
/// logits' shape and dtype.
pub(super) fn position_bias_softmax(
    op: &'static str,
    logits: &Tensor,
    table: &Tensor,
    buckets: &Indices,
    valid_lens: &Indices,
    d: Dims,
) -> Result<Tensor> {
    let sl = logits.cuda_storage(op)?;
    let backend = CudaBackend::get(sl.ordinal)?;
    let out = backend.alloc(logits.dtype(), logits.numel())?;
    let rows = d.batch * d.heads * d.seq_q;
    if rows > 0 && d.seq_k > 0 {
        let name = format!(
            "position_bias_softmax_{}_{}",
            suffix(logits.dtype()),
            suffix(table.dtype())
        );
        let f = backend.function(&SOURCE, &name)?;
        let (lp, tp, bp, vp, outp) = (
            sl.ptr(),
            table.cuda_storage(op)?.ptr(),
            buckets.cuda_ptr(op)?,
            valid_lens.cuda_ptr(op)?,
            out.ptr(),
        );
        let (rows_i, heads_i, sq_i, sk_i) = (
            rows as i64,
            int(op, "heads", d.heads)?,
            int(op, "seq_q", d.seq_q)?,
            int(op, "seq_k", d.seq_k)?,
        );
        let blocks = rows.div_ceil(ROWS_PER_BLOCK as usize).clamp(1, 1 << 20) as u32;
        let config = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (32 * ROWS_PER_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = backend.stream.launch_builder(&f);
        launch.arg(&lp).arg(&tp).arg(&bp).arg(&vp).arg(&outp);
        launch.arg(&rows_i).arg(&heads_i).arg(&sq_i).arg(&sk_i);
        // SAFETY: logits/out hold rows·S_k elements; buckets hold S_q + S_k − 1 values < NB, the table
        // NB·H; valid_lens B values (all checked by the caller). Arguments match the kernel.
        unsafe { launch.launch(config) }.map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    }
    Ok(Tensor::from_cuda(out, logits.shape()))
}
