//! CUDA twins of the FP8 ops: the per-row quantisation kernel (`quant.cu`) and the FP8 linear on
//! cuBLASLt's e4m3 GEMM (`crate::cuda::gemm`), laid out as `ops/matmul/cuda.rs` lays out the bf16
//! linear: m = out (the weight, transposed, as A, with its per-channel scales), n = rows (the
//! quantised activations as B, with their per-token scales), k = in.

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

use super::Fp8Tensor;
use super::attention::BLOCK;
use crate::cuda::gemm::{Epilogue, GemmKey, gemm_e4m3};
use crate::cuda::{CudaBackend, CudaStorage, KernelSource, suffix};
use crate::{DType, KernelError, Result, Tensor};

pub(crate) const SOURCE: KernelSource = KernelSource {
    name: "quant",
    text: include_str!("quant.cu"),
};

/// Threads per row of the quantisation kernel.
const THREADS: u32 = 256;

/// e4m3 codes on one GPU.
pub(crate) struct Codes {
    buf: CudaSlice<u8>,
    ordinal: usize,
}

impl Codes {
    /// `len` codes on the backend's GPU, not initialised: the kernel given them writes every one.
    pub(crate) fn alloc(backend: &CudaBackend, op: &'static str, len: usize) -> Result<Codes> {
        // SAFETY: the caller's kernel writes every code before anything reads it (see above).
        let buf = unsafe { backend.stream.alloc::<u8>(len.max(1)) }
            .map_err(|e| backend.err(op, "cuMemAllocAsync", e))?;
        Ok(Codes {
            buf,
            ordinal: backend.ordinal,
        })
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.buf.device_ptr(self.buf.stream()).0
    }

    pub(super) fn download(&self) -> Result<Vec<u8>> {
        let backend = CudaBackend::get(self.ordinal)?;
        let host = backend
            .stream
            .clone_dtoh(&self.buf)
            .map_err(|e| backend.err("to_host", "cuMemcpyDtoHAsync", e))?;
        backend
            .stream
            .synchronize()
            .map_err(|e| backend.err("to_host", "cuStreamSynchronize", e))?;
        Ok(host)
    }
}

/// The backend of x's GPU, refusing GPUs without FP8 tensor cores.
pub(crate) fn fp8_backend(op: &'static str, x: &Tensor) -> Result<std::sync::Arc<CudaBackend>> {
    let backend = CudaBackend::get(x.cuda_storage(op)?.ordinal)?;
    let (major, minor) = backend.capability;
    if backend.capability < (8, 9) {
        return Err(KernelError::arg(
            op,
            "device",
            format!("{} (compute capability {major}.{minor})", backend.device()),
            "FP8 (e4m3) needs compute capability 8.9 or later (Ada, Hopper, Blackwell)",
        ));
    }
    Ok(backend)
}

/// x [.., k] (f32 or bf16) → its codes and per-row f32 scales, on x's GPU.
pub(super) fn quantize(
    op: &'static str,
    x: &Tensor,
    k: usize,
) -> Result<(std::sync::Arc<Codes>, CudaStorage)> {
    let backend = fp8_backend(op, x)?;
    let rows = x.numel() / k;
    let k_i = i32::try_from(k)
        .map_err(|_| KernelError::arg(op, "k", k, "the CUDA kernel takes it as an i32"))?;
    let codes = Codes::alloc(&backend, op, rows * k)?;
    let scales = backend.alloc(DType::F32, rows)?;
    if rows > 0 {
        let xp = x.cuda_storage(op)?.ptr();
        let (qp, sp) = (codes.ptr(), scales.ptr());
        let vectorised = k.is_multiple_of(8) && xp % 16 == 0 && qp % 8 == 0;
        let name = format!(
            "quantize_rows_e4m3{}_{}",
            if vectorised { "_v8" } else { "" },
            suffix(x.dtype())
        );
        let f = backend.function(&SOURCE, &name)?;
        let rows_i = rows as i64;
        let mut launch = backend.stream.launch_builder(&f);
        launch.arg(&xp).arg(&qp).arg(&sp).arg(&rows_i).arg(&k_i);
        let grid = LaunchConfig {
            grid_dim: (rows.clamp(1, 1 << 20) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: x holds rows·k elements of the kernel's T, codes rows·k bytes, scales rows f32s;
        // the _v8 kernel's alignment and k % 8 were checked above.
        unsafe { launch.launch(grid) }.map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    }
    Ok((std::sync::Arc::new(codes), scales))
}

/// The FP8 linear on the GPU: x [.., in] (quantised from bf16, per token) times w (codes
/// [out, in] and `w`'s scales, or the gate-folded `scales` [groups, out] of `residual`), + bias
/// (+ GELU), → `out_shape` in bf16. With `residual` = (residual, scales, groups), group g of the
/// rows adds its rows of the residual in the accumulator (C, beta 1) and uses scales and bias row g.
pub(super) fn linear(
    op: &'static str,
    x: &Fp8Tensor,
    w: &Fp8Tensor,
    bias: Option<&Tensor>,
    gelu: bool,
    residual: Option<(&Tensor, &Tensor, usize)>,
    out_shape: &[usize],
) -> Result<Tensor> {
    let backend = fp8_backend(op, x.scales())?;
    let (out_f, in_f) = (w.shape()[0], w.shape()[1]);
    let rows = x.scales().numel();
    let bf16_only = |what: &'static str, dtype: DType| {
        if dtype == DType::BF16 {
            Ok(())
        } else {
            Err(KernelError::arg(
                op,
                what,
                format!("{dtype:?}"),
                "the GPU's FP8 GEMM writes bf16 activations (x quantised from bf16)",
            ))
        }
    };
    bf16_only("x", x.dtype())?;
    if let Some((r, _, _)) = residual {
        bf16_only("residual", r.dtype())?;
    }
    for (name, v) in [("in", in_f), ("out", out_f)] {
        if !v.is_multiple_of(16) {
            return Err(KernelError::arg(
                op,
                name,
                v,
                "cuBLASLt's FP8 GEMM needs in and out features that are multiples of 16",
            ));
        }
    }
    if rows == 0 || out_f == 0 {
        return match residual {
            Some((r, _, _)) => Ok(r.clone()),
            None => Tensor::zeros(out_shape, DType::BF16, x.device()),
        };
    }
    let mismatch = |other: &Fp8Tensor| KernelError::DeviceMismatch {
        op,
        first: x.device(),
        other: other.device(),
    };
    let (groups, scales) = match residual {
        Some((_, s, g)) => (g.max(1), s),
        None => (1, w.scales()),
    };
    let super::Codes::Cuda(x_codes) = &x.codes else {
        return Err(mismatch(x));
    };
    let super::Codes::Cuda(w_codes) = &w.codes else {
        return Err(mismatch(w));
    };
    let bias = bias.map(|b| b.to_dtype(DType::BF16)).transpose()?;
    let out = backend.alloc(DType::BF16, rows * out_f)?;
    let rows_per_group = rows / groups;
    let epilogue = match (bias.is_some(), gelu) {
        (false, _) => Epilogue::None,
        (true, false) => Epilogue::Bias,
        (true, true) => Epilogue::GeluBias,
    };
    let key = GemmKey {
        dtype: DType::BF16,
        e4m3: true,
        m: out_f as u64,
        n: rows_per_group as u64,
        k: in_f as u64,
        transa: true,
        batch: 1,
        stride_a: 0,
        stride_b: 0,
        stride_d: 0,
        epilogue,
    };
    let (wp, xp, sxp) = (
        w_codes.ptr(),
        x_codes.ptr(),
        x.scales().cuda_storage(op)?.ptr(),
    );
    let swp = scales.cuda_storage(op)?.ptr();
    let bp = bias
        .as_ref()
        .map(|b| b.cuda_storage(op).map(|s| s.ptr()))
        .transpose()?;
    let rp = residual
        .map(|(r, _, _)| r.cuda_storage(op).map(|s| s.ptr()))
        .transpose()?;
    // Per-group scales and biases are stacked [groups, out]; shared ones are [out].
    let param_step = |elem: u64| {
        if scales.numel() > out_f {
            out_f as u64 * elem
        } else {
            0
        }
    };
    for g in 0..groups as u64 {
        let rows_before = g * rows_per_group as u64;
        gemm_e4m3(
            &backend,
            op,
            key,
            wp,
            xp + rows_before * in_f as u64,
            out.ptr() + rows_before * out_f as u64 * 2,
            bp.map(|b| b + g * param_step(2)),
            rp.map(|r| r + rows_before * out_f as u64 * 2),
            (swp + g * param_step(4), sxp + rows_before * 4),
        )?;
    }
    Ok(Tensor::from_cuda(out, out_shape))
}

/// FP8 attention on the GPU (`super::attention_fp8`'s recipe): q, k, v bf16 [B, S, H, 128] are
/// quantised by quant.cu's attention kernels (Q and K per 128-token block, V per channel into Vᵀ
/// with its keys in the P fragments' order), then hopper.cu's FP8 forward runs on the codes.
pub(super) fn attention(
    op: &'static str,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    [batch, seq_q, seq_k, heads, head_dim]: [usize; 5],
    scale: f32,
    kv_len: usize,
) -> Result<(Tensor, Tensor)> {
    use crate::cuda::attention_kernel::attention_kernel;
    use crate::cuda::{AttentionKernel, HOPPER_FP8_VARIANTS};
    use crate::ops::attention::hopper;

    let backend = fp8_backend(op, q)?;
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.dtype() != DType::BF16 {
            return Err(KernelError::arg(
                op,
                name,
                format!("{:?}", t.dtype()),
                "the GPU's FP8 attention quantises bf16 operands",
            ));
        }
    }
    let dims = [batch, seq_q, seq_k, heads, head_dim];
    if let Some(why) = hopper::fp8_unsupported(&backend, dims, scale) {
        return Err(KernelError::arg(
            op,
            "q",
            format!("{:?}", q.shape()),
            format!("the FP8 Hopper attention does not apply: {why}"),
        ));
    }
    let variant = match attention_kernel() {
        AttentionKernel::HopperFp8(i) => HOPPER_FP8_VARIANTS.get(i).ok_or_else(|| {
            KernelError::arg(
                op,
                "AttentionKernel::HopperFp8",
                i,
                format!("there are {} variants", HOPPER_FP8_VARIANTS.len()),
            )
        })?,
        _ => &HOPPER_FP8_VARIANTS[DEFAULT_FP8_ATTENTION],
    };
    if batch * heads * seq_q == 0 || kv_len == 0 {
        // Nothing to read: out = 0, lse = −∞ (as the reference), without a launch.
        let out = Tensor::zeros(q.shape(), DType::BF16, q.device())?;
        let lse = Tensor::full(
            &[batch, heads, seq_q],
            f32::NEG_INFINITY,
            DType::F32,
            q.device(),
        )?;
        return Ok((out, lse));
    }
    let operands = quantize_attention(op, &backend, (q, k, v), dims, kv_len)?;
    let ptrs = hopper::Fp8Operands {
        q: operands.q.ptr(),
        k: operands.k.ptr(),
        vt: operands.vt.ptr(),
        s_pad: operands.s_pad,
        scales: [
            operands.scales[0].cuda_storage(op)?.ptr(),
            operands.scales[1].cuda_storage(op)?.ptr(),
            operands.scales[2].cuda_storage(op)?.ptr(),
        ],
    };
    // SAFETY: `quantize_attention` wrote the operands with the shapes `Fp8Operands` documents (vᵀ
    // zero past kv_len), 1 ≤ kv_len ≤ S_k (checked by the caller); the buffers are freed in stream
    // order, after the attention that reads them.
    unsafe {
        hopper::attention_fp8(
            op,
            &backend,
            &ptrs,
            [batch, seq_q, seq_k, heads],
            (scale, kv_len),
            variant,
        )
    }
}

/// The FP8 attention's operands on the GPU, as `hopper::Fp8Operands` describes them: Q's and K's
/// codes in their layout, Vᵀ's [B, H, 128, s_pad] (keys in the P fragments' order, 0 from kv_len
/// on), and their f32 scales (`scales`: q [B, H, ⌈S_q/128⌉], k [B, H, ⌈kv_len/128⌉], v [B, H, 128]).
pub(super) struct AttentionOperands {
    pub(super) q: Codes,
    pub(super) k: Codes,
    pub(super) vt: Codes,
    pub(super) scales: [Tensor; 3],
    pub(super) s_pad: usize,
}

/// q, k, v bf16 [B, S, H, 128] on `backend`'s GPU → the FP8 attention's operands, by quant.cu's two
/// attention kernels (`super::attention_fp8`'s recipe, code for code). kv_len ≥ 1, ≤ S_k.
pub(super) fn quantize_attention(
    op: &'static str,
    backend: &CudaBackend,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    [batch, seq_q, seq_k, heads, head_dim]: [usize; 5],
    kv_len: usize,
) -> Result<AttentionOperands> {
    let int = |name, v| crate::ops::attention::cuda::int(op, name, v);
    let (h, b) = (int("heads", heads)? as u32, int("batch", batch)? as u32);
    let (seq_qi, seq_ki, heads_i) = (int("seq_q", seq_q)?, int("seq_k", seq_k)?, heads as i32);
    let kv_i = int("kv_len", kv_len)?;
    let (q_blocks, k_blocks) = (seq_q.div_ceil(BLOCK), kv_len.div_ceil(BLOCK));
    let s_pad = k_blocks * BLOCK;
    let s_pad_i = int("kv_len rounded up to 128", s_pad)?;
    let alloc_err = |e| backend.err(op, "cuMemAllocAsync", e);
    // The kernels below write every code that the attention reads (k's codes past kv_len are
    // never read: its map ends there; vᵀ is written up to s_pad).
    let q8 = Codes::alloc(backend, op, q.numel())?;
    let k8 = Codes::alloc(backend, op, k.numel())?;
    let vt8 = Codes::alloc(backend, op, batch * heads * head_dim * s_pad)?;
    let amax = backend
        .stream
        .alloc_zeros::<u32>(batch * heads * head_dim)
        .map_err(alloc_err)?;
    let q_scales = backend.alloc(DType::F32, batch * heads * q_blocks)?;
    let k_scales = backend.alloc(DType::F32, batch * heads * k_blocks)?;
    let v_scales = backend.alloc(DType::F32, batch * heads * head_dim)?;
    let stream = &backend.stream;
    let (q8p, k8p, vt8p) = (q8.ptr(), k8.ptr(), vt8.ptr());
    let amax_p = amax.device_ptr(stream).0;
    let (qp, kp, vp) = (
        q.cuda_storage(op)?.ptr(),
        k.cuda_storage(op)?.ptr(),
        v.cuda_storage(op)?.ptr(),
    );
    let (qsp, ksp, vsp) = (q_scales.ptr(), k_scales.ptr(), v_scales.ptr());
    let cfg = |blocks: usize, threads: u32| LaunchConfig {
        grid_dim: (blocks as u32, h, b),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let f = backend.function(&SOURCE, "quantize_attention_qkv_bf16")?;
    let (q_blocks_i, k_blocks_i) = (
        int("seq_q blocks", q_blocks)?,
        int("kv_len blocks", k_blocks)?,
    );
    int("the quantisation's grid", q_blocks + 2 * k_blocks)?;
    let mut launch = stream.launch_builder(&f);
    launch
        .arg(&qp)
        .arg(&kp)
        .arg(&vp)
        .arg(&q8p)
        .arg(&k8p)
        .arg(&qsp)
        .arg(&ksp)
        .arg(&amax_p)
        .arg(&seq_qi)
        .arg(&seq_ki)
        .arg(&heads_i)
        .arg(&kv_i)
        .arg(&q_blocks_i)
        .arg(&k_blocks_i);
    // SAFETY: q bf16 [B, S_q, H, 128] and k, v [B, S_k, H, 128] (16-byte aligned rows), their
    // codes as many bytes as q and k, scales B·H·q_blocks and B·H·k_blocks f32 with q_blocks =
    // ⌈S_q/128⌉ and k_blocks = ⌈kv_len/128⌉ (kv_len ≤ S_k), amax B·H·128 zeroed u32; the grid's x
    // is q_blocks + 2·k_blocks, as the kernel splits it.
    unsafe { launch.launch(cfg(q_blocks + 2 * k_blocks, THREADS)) }
        .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    // Each kernel's share of the attention on a recorded timeline (`crate::timeline`).
    crate::timeline::mark(super::FP8_ATTENTION_QUANTIZE_MARKS[0]);
    let f = backend.function(&SOURCE, "quantize_attention_v_e4m3_bf16")?;
    let mut launch = stream.launch_builder(&f);
    launch
        .arg(&vp)
        .arg(&amax_p)
        .arg(&vt8p)
        .arg(&vsp)
        .arg(&seq_ki)
        .arg(&heads_i)
        .arg(&kv_i)
        .arg(&s_pad_i);
    // SAFETY: v as above, vt B·H·128·s_pad bytes (s_pad = the grid's x · 128), v_scales B·H·128
    // f32; the kernel's 34 KiB of static shared memory is under the default limit.
    unsafe { launch.launch(cfg(k_blocks, THREADS)) }
        .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    crate::timeline::mark(super::FP8_ATTENTION_QUANTIZE_MARKS[1]);
    Ok(AttentionOperands {
        q: q8,
        k: k8,
        vt: vt8,
        scales: [
            Tensor::from_cuda(q_scales, &[batch, heads, q_blocks]),
            Tensor::from_cuda(k_scales, &[batch, heads, k_blocks]),
            Tensor::from_cuda(v_scales, &[batch, heads, head_dim]),
        ],
        s_pad,
    })
}

/// `HOPPER_FP8_VARIANTS[DEFAULT_FP8_ATTENTION]` runs unless a test or benchmark forces another:
/// windows of 3 blocks with speculative exponentials (`hopper_fp8_fwd_d128_br128_bc128_s3_win3_spec`).
/// Speculative exponentials (bench/RESULTS.md, 2026-12-06, seventh session) were 8–14 % faster on an
/// H100 than the same windows with the row max first, whose figures they matched in every parity
/// case but one, where scores pass the offset by ~100 nats and they came closer to the recipe.
/// Windows of 3 (ninth and tenth sessions) were 0.8–2.2 % faster than windows of 2 (third in the
/// list) at the 14B shape in all 9 runs of 5 H100 calls, ahead at the 1.3B one in 10 of 13, and
/// made both FP8 forwards ~1.1 % faster; over 32,768 flat keys they come within 1.7e-3 of the
/// recipe (windows of 2: 1.2e-3; of 1: 7.3e-4; bound 1e-2). Windows of 4 were no faster than 2.
/// Its launch splits a sparse last wave along the keys (`split`; second in the list, the same
/// kernel with every tile whole): on an H200 at the 1.3B shape, whose 3,072 tiles leave 36 for a
/// 24th wave, 0.7–3.3 % faster in 5 of 5 runs; level at the 14B one (eleventh session). P passed
/// through shared memory instead of registers was 2.5–5 % slower at both shapes (thirteenth
/// session; hopper.cu's fp8 namespace comment lists it with the other variants removed).
const DEFAULT_FP8_ATTENTION: usize = 0;

#[cfg(test)]
mod tests {
    use super::DEFAULT_FP8_ATTENTION;
    use crate::cuda::{HOPPER_FP8_KEYS, HOPPER_FP8_VARIANTS};

    /// The CPU's `attention_fp8` takes the kernels' softmax steps: a model run in FP8 on the CPU
    /// and on the GPU rounds P at the same running maxima.
    #[test]
    fn the_reference_steps_as_the_kernels() {
        assert_eq!(HOPPER_FP8_KEYS, super::super::attention::STEP);
        assert!(DEFAULT_FP8_ATTENTION < HOPPER_FP8_VARIANTS.len());
    }
}
