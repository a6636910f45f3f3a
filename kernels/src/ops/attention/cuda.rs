//! CUDA twins of `attention`, `lse_combine` and `lse_merge_pair` (`attention.cu`).
//!
//! Three attention kernels, picked automatically in this order where they apply: the Hopper wgmma
//! kernel of `hopper.cu` (bf16, head dim 128, sm_90a; see `hopper.rs`), the tensor-core one of
//! `flash.cu` (mma.sync; bf16, head dim 64/128/256/384/512, sm_80+; see `flash.rs`), and the portable
//! one (f32 CUDA-core maths with online softmax over 32-key tiles staged in shared memory; any dtype,
//! head dim ≤ 512, not fast), the fallback. `crate::cuda::with_attention_kernel` forces one (tests,
//! benchmarks).
//!
//! The portable kernel has two builds: accumulators for head dims ≤ 256 (`attention_fwd_*`), and for
//! ≤ 512 (`attention_fwd_wide_*`: the Wan VAE's single head of 384 in f32). Its shared memory,
//! 4·(32·(2D + 1) + 16·D) bytes (K, V tiles and the block's Q rows in f32), is 160 KiB at D = 512:
//! above the 48 KiB default, so the launch opts in through the function attribute (H100/H200 allow
//! 227 KiB per block).

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaFunction, DeviceRepr, LaunchConfig, PushKernelArg};

use super::hopper::WsArgs;
use crate::cuda::attention_kernel::attention_kernel;
use crate::cuda::{AttentionKernel, CudaBackend, KernelSource, grid_1d, suffix};
use crate::{DType, KernelError, Result, Tensor};

pub(crate) const SOURCE: KernelSource = KernelSource {
    name: "attention",
    text: concat!(include_str!("attention.cu"), include_str!("flash.cu")),
};

/// `ATT_*` of attention.cu: query rows per block, keys per tile, threads per block; the head-dim
/// bounds of its two builds (`MAXD`).
const ROWS_PER_BLOCK: usize = 16;
const KEYS_PER_TILE: usize = 32;
const THREADS: u32 = 128;
const NARROW_HEAD_DIM: usize = 256;
const MAX_HEAD_DIM: usize = 512;
/// `MAX_PARTS` of attention.cu: partials one `lse_combine` launch merges.
const MAX_PARTS: usize = 16;

pub(crate) fn int(op: &'static str, name: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v)
        .map_err(|_| KernelError::arg(op, name, v, "the CUDA kernels take it as an i32"))
}

/// One forward launch of an attention kernel, shared by the three (portable, `flash.cu`, `hopper.cu`):
/// allocates out (q's dtype) and lse [B, H, S_q] f32, opts `f` into its dynamic shared memory when
/// that is above the 48 KiB default, and launches `grid` × `block` threads with the argument list
/// they all take: (q, k, v, out, lse, seq_q, seq_k, heads, [head_dim,] kv_len, scale), where q, k, v
/// are the buffers' addresses, or, given `ws` (the warp-specialised Hopper kernel), the tensor maps of
/// them (its TMA copies), with its work schedule appended. Nothing is launched for an empty output.
///
/// # Safety
/// `f` takes exactly that argument list (`head_dim_arg`: whether `head_dim` is in it; with `ws`, the
/// tensor maps by value in place of the addresses, encoded over these q, k, v, and the schedule's
/// arguments after scale, its buffers live until the launch is queued), q/k/v are
/// contiguous [B, S, H, D] buffers of the checked `dims` in the dtype `f` reads, kv_len ≤ S_k, and
/// `grid`, `block` and `smem` are what `f` expects for these shapes (its shared-memory carve-up).
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn launch(
    op: &'static str,
    backend: &CudaBackend,
    f: &CudaFunction,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    [batch, seq_q, seq_k, heads, head_dim]: [usize; 5],
    (scale, kv_len, head_dim_arg): (f32, usize, bool),
    (grid, block, smem): ((u32, u32, u32), u32, usize),
    ws: Option<&WsArgs>,
) -> Result<(Tensor, Tensor)> {
    let out = backend.alloc(q.dtype(), q.numel())?;
    let lse = backend.alloc(DType::F32, batch * heads * seq_q)?;
    if batch * heads * seq_q > 0 {
        if smem > 48 * 1024 {
            f.set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(|e| backend.err(op, "cuFuncSetAttribute", e))?;
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (block, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (qp, kp, vp, op_ptr, lp) = (
            q.cuda_storage(op)?.ptr(),
            k.cuda_storage(op)?.ptr(),
            v.cuda_storage(op)?.ptr(),
            out.ptr(),
            lse.ptr(),
        );
        let mut ints = vec![
            int(op, "seq_q", seq_q)?,
            int(op, "seq_k", seq_k)?,
            int(op, "heads", heads)?,
        ];
        if head_dim_arg {
            ints.push(int(op, "head_dim", head_dim)?);
        }
        ints.push(int(op, "kv_len", kv_len)?);
        let mut launch = backend.stream.launch_builder(f);
        match ws {
            Some(WsArgs {
                maps: [mq, mk, mv], ..
            }) => launch.arg(mq).arg(mk).arg(mv),
            None => launch.arg(&qp).arg(&kp).arg(&vp),
        };
        launch.arg(&op_ptr).arg(&lp);
        for i in &ints {
            launch.arg(i);
        }
        launch.arg(&scale);
        let buffers = ws.map(|ws| ws.split.buffers(&backend.stream));
        if let (Some(ws), Some([part, tickets])) = (ws, &buffers) {
            launch.arg(part).arg(tickets);
            for i in &ws.split.schedule {
                launch.arg(i);
            }
        }
        // SAFETY: the caller's contract (above); out and lse were allocated here with the sizes the
        // kernels write (q's shape, B·H·S_q).
        unsafe { launch.launch(cfg) }.map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    }
    Ok((
        Tensor::from_cuda(out, q.shape()),
        Tensor::from_cuda(lse, &[batch, heads, seq_q]),
    ))
}

/// q [B, S_q, H, D], k/v [B, S_k, H, D] (one dtype) → (out in q's dtype, lse [B, H, S_q] f32).
pub(super) fn attention(
    op: &'static str,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    [batch, seq_q, seq_k, heads, head_dim]: [usize; 5],
    scale: f32,
    kv_len: usize,
) -> Result<(Tensor, Tensor)> {
    let dims = [batch, seq_q, seq_k, heads, head_dim];
    let backend = CudaBackend::get(q.cuda_storage(op)?.ordinal)?;
    let flash = match attention_kernel() {
        AttentionKernel::Portable => None,
        AttentionKernel::Hopper(i) => {
            let variant = super::hopper::check(op, &backend, q.dtype(), dims, scale, i)?;
            return super::hopper::attention(op, &backend, (q, k, v), dims, scale, kv_len, variant);
        }
        AttentionKernel::Flash(i) => Some(super::flash::check(
            op,
            &backend,
            q.dtype(),
            dims,
            scale,
            i,
        )?),
        AttentionKernel::Auto | AttentionKernel::HopperFp8(_) => {
            if let Some(variant) = super::hopper::auto(&backend, q.dtype(), dims, scale, kv_len) {
                return super::hopper::attention(
                    op,
                    &backend,
                    (q, k, v),
                    dims,
                    scale,
                    kv_len,
                    variant,
                );
            }
            super::flash::auto(&backend, q.dtype(), dims, scale)
        }
    };
    if let Some(variant) = flash {
        return super::flash::attention(op, &backend, (q, k, v), dims, scale, kv_len, variant);
    }
    if head_dim > MAX_HEAD_DIM {
        return Err(KernelError::arg(
            op,
            "head_dim",
            head_dim,
            format!("the portable CUDA attention takes head dims up to {MAX_HEAD_DIM}"),
        ));
    }
    let build = if head_dim <= NARROW_HEAD_DIM {
        "attention_fwd"
    } else {
        "attention_fwd_wide"
    };
    let f = backend.function(&SOURCE, &format!("{build}_{}", suffix(q.dtype())))?;
    let smem = 4 * (KEYS_PER_TILE * (2 * head_dim + 1) + ROWS_PER_BLOCK * head_dim);
    let grid = (
        seq_q.div_ceil(ROWS_PER_BLOCK) as u32,
        int(op, "heads", heads)? as u32,
        int(op, "batch", batch)? as u32,
    );
    // SAFETY: `attention_fwd*` takes the shared argument list with head_dim; q/k/v hold the shapes
    // the caller checked, in the dtype of the build picked; kv_len ≤ S_k (checked by the caller); smem
    // is its carve-up (K, V tiles and the block's Q rows in f32) for this head dim, ≤ 160 KiB.
    unsafe {
        launch(
            op,
            &backend,
            &f,
            (q, k, v),
            dims,
            (scale, kv_len, true),
            (grid, THREADS, smem),
            None,
        )
    }
}

/// `Parts` of attention.cu: up to MAX_PARTS partial (out, lse) addresses.
#[repr(C)]
#[derive(Clone, Copy)]
struct Parts {
    out: [u64; MAX_PARTS],
    lse: [u64; MAX_PARTS],
    k: i32,
    pad: i32,
}

// SAFETY: plain-old-data `#[repr(C)]` struct matching the kernel's `Parts` by value.
unsafe impl DeviceRepr for Parts {}

/// One `lse_combine` launch over ≤ MAX_PARTS partials whose outs share one dtype → out in `out_dtype`.
fn combine_launch(
    op: &'static str,
    parts: &[(Tensor, Tensor)],
    out_dtype: DType,
    [batch, seq, heads, head_dim]: [usize; 4],
) -> Result<(Tensor, Tensor)> {
    let (first_out, first_lse) = &parts[0];
    let backend = CudaBackend::get(first_out.cuda_storage(op)?.ordinal)?;
    let out = backend.alloc(out_dtype, first_out.numel())?;
    let lse = backend.alloc(DType::F32, first_lse.numel())?;
    let rows = batch * seq * heads;
    if rows > 0 {
        let mut p = Parts {
            out: [0; MAX_PARTS],
            lse: [0; MAX_PARTS],
            k: parts.len() as i32,
            pad: 0,
        };
        for (i, (o, l)) in parts.iter().enumerate() {
            p.out[i] = o.cuda_storage(op)?.ptr();
            p.lse[i] = l.cuda_storage(op)?.ptr();
        }
        let name = format!(
            "lse_combine_{}_{}",
            suffix(out_dtype),
            suffix(first_out.dtype())
        );
        let f = backend.function(&SOURCE, &name)?;
        let (outp, lp) = (out.ptr(), lse.ptr());
        let dims = [rows as i64, seq as i64, heads as i64];
        let d = int(op, "head_dim", head_dim)?;
        let mut launch = backend.stream.launch_builder(&f);
        launch.arg(&p).arg(&outp).arg(&lp);
        launch.arg(&dims[0]).arg(&dims[1]).arg(&dims[2]).arg(&d);
        // SAFETY: every partial has the checked shapes; p.k ≤ MAX_PARTS entries are filled.
        unsafe { launch.launch(grid_1d(rows)) }
            .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    }
    Ok((
        Tensor::from_cuda(out, first_out.shape()),
        Tensor::from_cuda(lse, first_lse.shape()),
    ))
}

/// k-way LSE combine → (out in the first out's dtype, lse f32). More than 16 partials are combined in
/// groups, the running result (kept in f32) entering the next group as its first partial.
pub(super) fn lse_combine(
    op: &'static str,
    parts: &[(&Tensor, &Tensor)],
    dims: [usize; 4],
) -> Result<(Tensor, Tensor)> {
    let out_dtype = parts[0].0.dtype();
    let same = parts.iter().all(|(o, _)| o.dtype() == out_dtype);
    let in_dtype = if same && parts.len() <= MAX_PARTS {
        out_dtype
    } else {
        DType::F32
    };
    let mut pending = parts
        .iter()
        .map(|(o, l)| Ok((o.to_dtype(in_dtype)?, (*l).clone())))
        .collect::<Result<Vec<_>>>()?;
    if pending.len() <= MAX_PARTS {
        return combine_launch(op, &pending, out_dtype, dims);
    }
    let rest = pending.split_off(MAX_PARTS);
    let mut acc = combine_launch(op, &pending, DType::F32, dims)?;
    for group in rest.chunks(MAX_PARTS - 1) {
        let mut step = vec![acc];
        step.extend(group.iter().cloned());
        acc = combine_launch(op, &step, DType::F32, dims)?;
    }
    Ok((acc.0.to_dtype(out_dtype)?, acc.1))
}

/// Ring's merge of (out, lse) with (out_blk, lse_blk) → (out in out's dtype, lse f32).
pub(super) fn lse_merge_pair(
    op: &'static str,
    (out, lse): (&Tensor, &Tensor),
    (out_blk, lse_blk): (&Tensor, &Tensor),
    [batch, seq, heads, head_dim]: [usize; 4],
) -> Result<(Tensor, Tensor)> {
    let so = out.cuda_storage(op)?;
    let backend = CudaBackend::get(so.ordinal)?;
    let merged = backend.alloc(out.dtype(), out.numel())?;
    let merged_lse = backend.alloc(DType::F32, lse.numel())?;
    let rows = batch * seq * heads;
    if rows > 0 {
        let name = format!(
            "lse_merge_pair_{}_{}",
            suffix(out.dtype()),
            suffix(out_blk.dtype())
        );
        let f = backend.function(&SOURCE, &name)?;
        let ptrs = [
            so.ptr(),
            lse.cuda_storage(op)?.ptr(),
            out_blk.cuda_storage(op)?.ptr(),
            lse_blk.cuda_storage(op)?.ptr(),
            merged.ptr(),
            merged_lse.ptr(),
        ];
        let dims = [rows as i64, seq as i64, heads as i64];
        let d = int(op, "head_dim", head_dim)?;
        let mut launch = backend.stream.launch_builder(&f);
        for p in &ptrs {
            launch.arg(p);
        }
        launch.arg(&dims[0]).arg(&dims[1]).arg(&dims[2]).arg(&d);
        // SAFETY: all four inputs have the checked shapes; outputs are allocated to match.
        unsafe { launch.launch(grid_1d(rows)) }
            .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    }
    Ok((
        Tensor::from_cuda(merged, out.shape()),
        Tensor::from_cuda(merged_lse, lse.shape()),
    ))
}
