//! CUDA twins of the norms (`norm.cu`). Per-channel parameters (weight, bias, gamma) are read in their
//! own dtype; when a weight and its bias differ in dtype both are read as f32 (a cast of a few KiB).

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::cuda::{CudaBackend, KernelSource, suffix};
use crate::ops::quant::cuda::Codes;
use crate::{DType, Fp8Tensor, KernelError, Result, Tensor};

pub(crate) const SOURCE: KernelSource = KernelSource {
    name: "norm",
    text: include_str!("norm.cu"),
};

/// Threads per row of the row-wise norms.
const ROW_BLOCK: u32 = 256;

/// The parameters' common dtype (f32 when they differ) and the parameters stored in it.
fn params_in_common_dtype(params: &[Option<&Tensor>]) -> Result<(DType, Vec<Option<Tensor>>)> {
    let dtypes: Vec<DType> = params.iter().flatten().map(|p| p.dtype()).collect();
    let dtype = match dtypes.first() {
        Some(&first) if dtypes.iter().all(|&d| d == first) => first,
        _ => DType::F32,
    };
    let cast = params
        .iter()
        .map(|p| p.map(|p| p.to_dtype(dtype)).transpose())
        .collect::<Result<_>>()?;
    Ok((dtype, cast))
}

fn int(op: &'static str, name: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v)
        .map_err(|_| KernelError::arg(op, name, v, "the CUDA kernels take it as an i32"))
}

/// A device address, or 0 for an absent optional parameter (the kernel's `has_*` flag is then 0).
fn ptr_or_null(op: &'static str, t: Option<&Tensor>) -> Result<u64> {
    Ok(match t {
        Some(t) => t.cuda_storage(op)?.ptr(),
        None => 0,
    })
}

/// A block per row (grid-stride beyond 2²⁰ rows) of `threads`.
fn row_grid(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.clamp(1, 1 << 20) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The row-wise kernel `base` for rows of `d` elements of `dtype` in the buffers at `ptrs` (the rows
/// and the per-element parameters; a null pointer, an absent one, passes), and its threads per
/// block: norm.cu's register-held `<base>_rows` where it applies (d whole 16-byte words, every
/// buffer 16-byte aligned, at most ROW_WORDS words per thread of a 1,024-thread block), else
/// the element-wise `<base>` with ROW_BLOCK threads.
fn row_kernel(base: &str, dtype: DType, d: usize, ptrs: &[u64]) -> (String, u32) {
    const ROW_WORDS: usize = 4; // norm.cu
    let per_word = 16 / dtype.size_in_bytes();
    let threads = (d / per_word).div_ceil(ROW_WORDS).next_multiple_of(32);
    if d > 0 && d.is_multiple_of(per_word) && threads <= 1024 && ptrs.iter().all(|p| p % 16 == 0) {
        (format!("{base}_rows"), threads as u32)
    } else {
        (base.to_string(), ROW_BLOCK)
    }
}

/// LayerNorm over the last dim `d` (weight/bias optional) → x's shape and dtype.
pub(super) fn layer_norm(
    op: &'static str,
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    d: usize,
    eps: f32,
) -> Result<Tensor> {
    let sx = x.cuda_storage(op)?;
    let backend = CudaBackend::get(sx.ordinal)?;
    let out = backend.alloc(x.dtype(), x.numel())?;
    let rows = x.numel().checked_div(d).unwrap_or(0);
    if rows > 0 {
        let (wdtype, params) = params_in_common_dtype(&[weight, bias])?;
        let (xp, wp, bp, outp) = (
            sx.ptr(),
            ptr_or_null(op, params[0].as_ref())?,
            ptr_or_null(op, params[1].as_ref())?,
            out.ptr(),
        );
        let (kernel, threads) = row_kernel("layer_norm", x.dtype(), d, &[xp, outp, wp, bp]);
        let name = format!("{kernel}_{}_{}", suffix(x.dtype()), suffix(wdtype));
        let f = backend.function(&SOURCE, &name)?;
        let (rows_i, d_i) = (rows as i64, int(op, "d", d)?);
        let (has_w, has_b) = (i32::from(weight.is_some()), i32::from(bias.is_some()));
        let mut launch = backend.stream.launch_builder(&f);
        launch.arg(&xp).arg(&wp).arg(&bp).arg(&outp);
        launch
            .arg(&rows_i)
            .arg(&d_i)
            .arg(&eps)
            .arg(&has_w)
            .arg(&has_b);
        // SAFETY: x/out hold rows·d elements; weight/bias hold d (checked by the caller) or are unused;
        // the _rows variant's conditions were checked by row_kernel.
        unsafe { launch.launch(row_grid(rows, threads)) }
            .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    }
    Ok(Tensor::from_cuda(out, x.shape()))
}

/// LayerNorm (no affine) then modulation over the last dim `d`, stored in `out_dtype`; shift/scale
/// are f32 with row r of x using their row r / `rows_per_mod` (checked by the caller).
#[allow(clippy::too_many_arguments)]
pub(super) fn layer_norm_modulate(
    op: &'static str,
    x: &Tensor,
    shift: &Tensor,
    scale: &Tensor,
    d: usize,
    rows_per_mod: usize,
    eps: f32,
    out_dtype: DType,
) -> Result<Tensor> {
    let sx = x.cuda_storage(op)?;
    let backend = CudaBackend::get(sx.ordinal)?;
    let out = backend.alloc(out_dtype, x.numel())?;
    let rows = x.numel().checked_div(d).unwrap_or(0);
    if rows > 0 {
        let (xp, shp, scp, outp) = (
            sx.ptr(),
            shift.cuda_storage(op)?.ptr(),
            scale.cuda_storage(op)?.ptr(),
            out.ptr(),
        );
        // The rows kernel stores a word of x's elements in out's dtype: 16 or 8 bytes, or element by
        // element for f32 out of bf16 x; out is aligned as x is (a fresh allocation).
        let (kernel, threads) =
            row_kernel("layer_norm_modulate", x.dtype(), d, &[xp, outp, shp, scp]);
        let name = format!("{kernel}_{}_{}", suffix(x.dtype()), suffix(out_dtype));
        let f = backend.function(&SOURCE, &name)?;
        let (rows_i, d_i, per_i) = (rows as i64, int(op, "d", d)?, rows_per_mod as i64);
        let mut launch = backend.stream.launch_builder(&f);
        launch.arg(&xp).arg(&shp).arg(&scp).arg(&outp);
        launch.arg(&rows_i).arg(&d_i).arg(&per_i).arg(&eps);
        // SAFETY: x/out hold rows·d elements; shift/scale hold (rows / rows_per_mod)·d f32 (the caller
        // checked their shape against x's); the _rows variant's conditions were checked by row_kernel.
        unsafe { launch.launch(row_grid(rows, threads)) }
            .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    }
    Ok(Tensor::from_cuda(out, x.shape()))
}

/// Which fused e4m3 map, with its own kernel arguments.
enum E4m3Norm {
    /// `quantize_rows_e4m3_rows_bf16`: none (and no per-element params).
    Identity,
    /// `layer_norm_rows_e4m3_bf16_<W>`: (eps, has_w, has_b).
    LayerNorm(f32, i32, i32),
    /// `layer_norm_modulate_rows_e4m3_bf16`: (rows_per_mod, eps).
    Modulate(i64, f32),
}

/// Runs norm.cu's fused e4m3 kernel `name` on x's rows of `d` where it applies, or returns None:
/// bf16 rows on a GPU with FP8 that `row_kernel` holds in registers (with its threads, hence the
/// unfused kernel's reduction order). The kernel's arguments are x, the per-element `params`
/// (device pointers, 0 for an absent one; none for the identity), the codes, the scales, rows and
/// d, then `norm`'s.
fn norm_e4m3(
    op: &'static str,
    x: &Tensor,
    d: usize,
    params: &[u64],
    name: &str,
    norm: E4m3Norm,
) -> Result<Option<Fp8Tensor>> {
    let rows = x.numel().checked_div(d).unwrap_or(0);
    let Ok(sx) = x.cuda_storage(op) else {
        return Ok(None);
    };
    let backend = CudaBackend::get(sx.ordinal)?;
    let xp = sx.ptr();
    let mut ptrs = vec![xp];
    ptrs.extend(params);
    let (kernel, threads) = row_kernel("", x.dtype(), d, &ptrs);
    if rows == 0 || x.dtype() != DType::BF16 || kernel != "_rows" || backend.capability < (8, 9) {
        return Ok(None);
    }
    let codes = Codes::alloc(&backend, op, rows * d)?;
    let scales = backend.alloc(DType::F32, rows)?;
    let (qp, sp) = (codes.ptr(), scales.ptr());
    let (rows_i, d_i) = (rows as i64, int(op, "d", d)?);
    let f = backend.function(&SOURCE, name)?;
    let mut launch = backend.stream.launch_builder(&f);
    launch.arg(&xp);
    for p in params {
        launch.arg(p);
    }
    launch.arg(&qp).arg(&sp).arg(&rows_i).arg(&d_i);
    match &norm {
        E4m3Norm::Identity => &mut launch,
        E4m3Norm::LayerNorm(eps, has_w, has_b) => launch.arg(eps).arg(has_w).arg(has_b),
        E4m3Norm::Modulate(rows_per_mod, eps) => launch.arg(rows_per_mod).arg(eps),
    };
    // SAFETY: x holds rows·d bf16, codes rows·d bytes (8-byte words: d is a multiple of 8), scales
    // rows f32; the params hold what the caller's kernel reads (checked by the caller); the rows
    // kernel's conditions and the GPU's FP8 support were checked above.
    unsafe { launch.launch(row_grid(rows, threads)) }
        .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    Ok(Some(Fp8Tensor::from_cuda(
        x.shape(),
        codes,
        scales,
        DType::BF16,
    )))
}

/// `layer_norm` with its output quantised per row (norm.cu's `layer_norm_rows_e4m3`), or None
/// where the fused kernel does not apply (see `norm_e4m3`).
pub(super) fn layer_norm_e4m3(
    op: &'static str,
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    d: usize,
    eps: f32,
) -> Result<Option<Fp8Tensor>> {
    let (wdtype, params) = params_in_common_dtype(&[weight, bias])?;
    let ptrs = [
        ptr_or_null(op, params[0].as_ref())?,
        ptr_or_null(op, params[1].as_ref())?,
    ];
    let (has_w, has_b) = (i32::from(weight.is_some()), i32::from(bias.is_some()));
    let name = format!("layer_norm_rows_e4m3_bf16_{}", suffix(wdtype));
    norm_e4m3(
        op,
        x,
        d,
        &ptrs,
        &name,
        E4m3Norm::LayerNorm(eps, has_w, has_b),
    )
}

/// `Fp8Tensor::quantize` of bf16 rows of `d` in one read of each row (norm.cu's
/// `quantize_rows_e4m3_rows_bf16`), or None where the register-held walk does not apply.
pub(crate) fn quantize_e4m3(op: &'static str, x: &Tensor, d: usize) -> Result<Option<Fp8Tensor>> {
    norm_e4m3(
        op,
        x,
        d,
        &[],
        "quantize_rows_e4m3_rows_bf16",
        E4m3Norm::Identity,
    )
}

/// `layer_norm_modulate` to bf16 with its output quantised per row (norm.cu's
/// `layer_norm_modulate_rows_e4m3_bf16`), or None where the fused kernel does not apply.
pub(super) fn layer_norm_modulate_e4m3(
    op: &'static str,
    x: &Tensor,
    shift: &Tensor,
    scale: &Tensor,
    d: usize,
    rows_per_mod: usize,
    eps: f32,
) -> Result<Option<Fp8Tensor>> {
    let ptrs = [shift.cuda_storage(op)?.ptr(), scale.cuda_storage(op)?.ptr()];
    let norm = E4m3Norm::Modulate(rows_per_mod as i64, eps);
    norm_e4m3(op, x, d, &ptrs, "layer_norm_modulate_rows_e4m3_bf16", norm)
}

/// RMSNorm over the last dim `d` → x's shape and dtype.
pub(super) fn rms_norm(
    op: &'static str,
    x: &Tensor,
    weight: &Tensor,
    d: usize,
    eps: f32,
) -> Result<Tensor> {
    let sx = x.cuda_storage(op)?;
    let backend = CudaBackend::get(sx.ordinal)?;
    let out = backend.alloc(x.dtype(), x.numel())?;
    let rows = x.numel().checked_div(d).unwrap_or(0);
    if rows > 0 {
        let (xp, wp, outp) = (sx.ptr(), weight.cuda_storage(op)?.ptr(), out.ptr());
        let (kernel, threads) = row_kernel("rms_norm", x.dtype(), d, &[xp, outp, wp]);
        let name = format!("{kernel}_{}_{}", suffix(x.dtype()), suffix(weight.dtype()));
        let f = backend.function(&SOURCE, &name)?;
        let (rows_i, d_i) = (rows as i64, int(op, "d", d)?);
        let mut launch = backend.stream.launch_builder(&f);
        launch
            .arg(&xp)
            .arg(&wp)
            .arg(&outp)
            .arg(&rows_i)
            .arg(&d_i)
            .arg(&eps);
        // SAFETY: x/out hold rows·d elements, weight d (checked by the caller); the _rows variant's
        // conditions were checked by row_kernel.
        unsafe { launch.launch(row_grid(rows, threads)) }
            .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    }
    Ok(Tensor::from_cuda(out, x.shape()))
}

/// RMSNorm over the last dim `d` = heads · `head_dim`, rounded to x's dtype, then RoPE with the f32
/// tables [seq, head_dim / 2] (row r at position r % seq), in one pass (`rms_norm_rope_rows`), or
/// as the two kernels where the row kernel does not apply; → x's dtype, `out_shape`.
#[allow(clippy::too_many_arguments)]
pub(super) fn rms_norm_rope(
    op: &'static str,
    x: &Tensor,
    weight: &Tensor,
    eps: f32,
    cos: &Tensor,
    sin: &Tensor,
    (rows, seq, d, head_dim): (usize, usize, usize, usize),
    out_shape: &[usize],
) -> Result<Tensor> {
    let sx = x.cuda_storage(op)?;
    let backend = CudaBackend::get(sx.ordinal)?;
    let out = backend.alloc(x.dtype(), x.numel())?;
    let (cos, sin) = (cos.to_dtype(DType::F32)?, sin.to_dtype(DType::F32)?);
    let (xp, wp, cp, sp, outp) = (
        sx.ptr(),
        weight.cuda_storage(op)?.ptr(),
        cos.cuda_storage(op)?.ptr(),
        sin.cuda_storage(op)?.ptr(),
        out.ptr(),
    );
    let (kernel, threads) = row_kernel("rms_norm_rope", x.dtype(), d, &[xp, outp, wp, cp, sp]);
    if kernel == "rms_norm_rope" {
        let normed = rms_norm(op, x, weight, d, eps)?.reshape(out_shape)?;
        return crate::apply_rope(&normed, &cos, &sin);
    }
    if rows > 0 {
        let name = format!("{kernel}_{}_{}", suffix(x.dtype()), suffix(weight.dtype()));
        let f = backend.function(&SOURCE, &name)?;
        let (rows_i, seq_i, d_i, hd_i) = (
            rows as i64,
            seq as i64,
            int(op, "d", d)?,
            int(op, "head_dim", head_dim)?,
        );
        let mut launch = backend.stream.launch_builder(&f);
        launch.arg(&xp).arg(&wp).arg(&cp).arg(&sp).arg(&outp);
        launch
            .arg(&rows_i)
            .arg(&seq_i)
            .arg(&d_i)
            .arg(&hd_i)
            .arg(&eps);
        // SAFETY: x/out hold rows·d elements, weight d, the tables seq·head_dim/2 f32 (checked by the
        // caller, with head_dim even and dividing d); row_kernel checked the _rows conditions.
        unsafe { launch.launch(row_grid(rows, threads)) }
            .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    }
    Ok(Tensor::from_cuda(out, out_shape))
}

/// The VAE's channel-first L2 norm on x [batch, channels, positions] → x's shape and dtype; with
/// `silu`, followed by SiLU in the same kernel (the norm rounded to x's dtype in between).
pub(super) fn rms_norm_channels(
    op: &'static str,
    x: &Tensor,
    gamma: &Tensor,
    bias: Option<&Tensor>,
    (batch, channels, positions): (usize, usize, usize),
    silu: bool,
) -> Result<Tensor> {
    let sx = x.cuda_storage(op)?;
    let backend = CudaBackend::get(sx.ordinal)?;
    let out = backend.alloc(x.dtype(), x.numel())?;
    if batch * positions > 0 && channels > 0 {
        let (wdtype, params) = params_in_common_dtype(&[Some(gamma), bias])?;
        let (xp, gp, bp, outp) = (
            sx.ptr(),
            ptr_or_null(op, params[0].as_ref())?,
            ptr_or_null(op, params[1].as_ref())?,
            out.ptr(),
        );
        // norm.cu's tiling: 8 words of 16 bytes of positions per channel, then a float per position.
        let es = x.dtype().size_in_bytes();
        let tile_positions = 128 / es;
        let smem = channels * 128 + tile_positions * 4;
        if smem > backend.smem_optin {
            return Err(KernelError::arg(
                op,
                "channels",
                channels,
                format!(
                    "at most {} on this GPU (a tile of every channel must fit in its {} bytes of shared memory per block)",
                    (backend.smem_optin - tile_positions * 4) / 128,
                    backend.smem_optin
                ),
            ));
        }
        let words = positions.is_multiple_of(16 / es) && xp % 16 == 0 && outp % 16 == 0;
        let name = format!(
            "rms_norm_channels{}_{}_{}_{}",
            if silu { "_silu" } else { "" },
            suffix(x.dtype()),
            suffix(wdtype),
            if words { "v" } else { "e" }
        );
        let f = backend.function(&SOURCE, &name)?;
        if smem > 48 * 1024 {
            f.set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(|e| backend.err(op, "cuFuncSetAttribute", e))?;
        }
        let (batch_i, channels_i, positions_i) = (
            batch as i64,
            int(op, "channels", channels)?,
            positions as i64,
        );
        let has_bias = i32::from(bias.is_some());
        let mut launch = backend.stream.launch_builder(&f);
        launch.arg(&xp).arg(&gp).arg(&bp).arg(&outp);
        launch
            .arg(&batch_i)
            .arg(&channels_i)
            .arg(&positions_i)
            .arg(&has_bias);
        let tiles = batch * positions.div_ceil(tile_positions);
        let cfg = LaunchConfig {
            grid_dim: (tiles.clamp(1, 1 << 20) as u32, 1, 1),
            block_dim: (256, 1, 1), // RMS_THREADS of norm.cu
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: x/out hold batch·channels·positions elements, gamma/bias channels (checked by caller);
        // with words, positions is a multiple of 16 bytes of elements and x/out are 16-byte aligned;
        // `smem` is the kernel's carve-up and within the device's opt-in limit.
        unsafe { launch.launch(cfg) }.map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    }
    Ok(Tensor::from_cuda(out, x.shape()))
}
