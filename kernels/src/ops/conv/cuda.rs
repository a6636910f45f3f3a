//! CUDA twins of the convolutions and of nearest ×2 upsampling (`conv.cu`).
//!
//! A convolution is im2col + one cuBLASLt GEMM per block of output pixels, f32 accumulation:
//! for batch item b and output pixels [p0, p0 + np) (flattened t, h, w),
//! col [K = C_in·kt·kh·kw, np] ← im2col; block [C_out, np] = w [C_out, K] · col; then
//! out[b, :, p0..p0 + np] = block + bias (`conv_bias_scatter`). Blocks are sized so that col holds at
//! most [`COL_BUDGET`] elements: memory stays bounded whatever the frame size (at 480p the 96-wide
//! 3×3×3 convs take ~26k pixels per block). A causal conv's cached frames are read in place by im2col
//! (no concatenated copy of the input). A 1×1×1 conv without padding, stride or cache whose one block
//! covers the item skips im2col: the input already is col.
//!
//! GEMM mapping onto column-major cuBLASLt (`crate::cuda::gemm`): row-major block [C_out × np] is
//! column-major [np × C_out] = col' [np × K] · w' [K × C_out], where col's row-major [K × np] buffer is
//! col' with ld np and w's row-major [C_out × K] buffer is w' with ld K: m = np, n = C_out, k = K, no
//! transposes.
//!
//! Operands of different dtypes are promoted to f32 (exact for bf16) and the result cast back to x's
//! dtype, as `linear` does. In bf16 the GEMM's block is rounded to bf16 before the bias is added (two
//! roundings where the CPU has one): see the parity tolerances in `kernels/tests/cuda_parity.rs`.

use cudarc::driver::{DeviceRepr, PushKernelArg};

use super::cpu::ConvGeometry;
use crate::cuda::{CudaBackend, KernelSource, gemm::GemmKey, gemm::gemm, grid_1d, suffix};
use crate::{DType, Result, Tensor};

pub(crate) const SOURCE: KernelSource = KernelSource {
    name: "conv",
    text: include_str!("conv.cu"),
};

/// Most elements of one im2col block (128 Mi: 256 MiB in bf16, 512 MiB in f32).
const COL_BUDGET: usize = 1 << 27;

/// `ConvGeom` of conv.cu, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ConvGeom {
    c_in: i64,
    cached: i64,
    input: [i64; 3],
    output: [i64; 3],
    kernel: [i64; 3],
    stride: [i64; 3],
    pad: [i64; 3],
}

// SAFETY: plain-old-data `#[repr(C)]` struct of i64s matching the kernel's `ConvGeom` by value.
unsafe impl DeviceRepr for ConvGeom {}

fn i64s(v: [usize; 3]) -> [i64; 3] {
    v.map(|x| x as i64)
}

/// The operands in one dtype: theirs when they agree, else f32.
fn common_dtype(x: &Tensor, w: &Tensor) -> DType {
    if x.dtype() == w.dtype() {
        x.dtype()
    } else {
        DType::F32
    }
}

/// Conv3d on the GPU: `cache` [B, C_in, T_c, H, W] (optional) followed by x [B, C_in, T, H, W] along T
/// is the input `g` describes (g.input[0] = T_c + T); w [C_out, C_in, kt, kh, kw], bias [C_out] →
/// [B, C_out, T_out, H_out, W_out] in x's dtype.
pub(super) fn conv3d(
    op: &'static str,
    cache: Option<&Tensor>,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    g: &ConvGeometry,
) -> Result<Tensor> {
    let dtype = common_dtype(x, w);
    let out_shape = g.output_shape();
    let [t_out, h_out, w_out] = g.output();
    let pixels = t_out * h_out * w_out;
    let [kt, kh, kw] = g.kernel;
    let taps = g.in_channels * kt * kh * kw;
    if g.batch * g.out_channels * pixels == 0 || taps == 0 {
        // Nothing to compute (an empty output), or an empty sum: the bias (or zeros) everywhere.
        let zeros = Tensor::zeros(&out_shape, x.dtype(), x.device())?;
        return match bias {
            Some(b) => crate::add(&zeros, &b.reshape(&[g.out_channels, 1, 1, 1])?),
            None => Ok(zeros),
        };
    }
    let (xc, wc) = (x.to_dtype(dtype)?, w.to_dtype(dtype)?);
    let cache = cache.map(|c| c.to_dtype(dtype)).transpose()?;
    let backend = CudaBackend::get(xc.cuda_storage(op)?.ordinal)?;
    let out = backend.alloc(dtype, g.batch * g.out_channels * pixels)?;

    let cached = cache.as_ref().map_or(0, |c| c.shape()[2]);
    let geom = ConvGeom {
        c_in: g.in_channels as i64,
        cached: cached as i64,
        input: i64s(g.input),
        output: i64s(g.output()),
        kernel: i64s(g.kernel),
        stride: i64s(g.stride),
        pad: i64s(g.pad_front),
    };
    let size = dtype.size_in_bytes() as u64;
    let [x_frames, h_in, w_in] = [g.input[0] - cached, g.input[1], g.input[2]];
    let x_item = (g.in_channels * x_frames * h_in * w_in) as u64 * size;
    let block = (COL_BUDGET / taps).clamp(1, pixels);
    // A pointwise conv reads x as col directly when one block covers the item, and every item starts
    // 256-byte aligned (cuBLASLt's heuristic assumes aligned operands; buffers start aligned).
    let pointwise = g.kernel == [1, 1, 1]
        && g.stride == [1, 1, 1]
        && g.pad_front == [0, 0, 0]
        && g.pad_back == [0, 0, 0]
        && cached == 0
        && block == pixels
        && (g.batch == 1 || x_item.is_multiple_of(256));
    let col = if pointwise {
        None
    } else {
        Some(backend.alloc(dtype, taps * block)?)
    };
    let partial = backend.alloc(dtype, g.out_channels * block)?;

    let im2col = backend.function(&SOURCE, &format!("im2col_{}", suffix(dtype)))?;
    let bias_dtype = bias.map_or(dtype, |b| b.dtype());
    let scatter = backend.function(
        &SOURCE,
        &format!("conv_bias_scatter_{}_{}", suffix(dtype), suffix(bias_dtype)),
    )?;
    let cache_item = (g.in_channels * cached * h_in * w_in) as u64 * size;
    let out_item = (g.out_channels * pixels) as u64 * size;
    let (x_ptr, w_ptr, out_ptr, partial_ptr) = (
        xc.cuda_storage(op)?.ptr(),
        wc.cuda_storage(op)?.ptr(),
        out.ptr(),
        partial.ptr(),
    );
    let cache_ptr = match &cache {
        Some(c) => c.cuda_storage(op)?.ptr(),
        None => 0,
    };
    let bias_ptr = match bias {
        Some(b) => b.cuda_storage(op)?.ptr(),
        None => 0,
    };
    let has_bias = i32::from(bias.is_some());
    let (c_out, p_total) = (g.out_channels as i64, pixels as i64);
    for b in 0..g.batch as u64 {
        let x_b = x_ptr + b * x_item;
        for p0 in (0..pixels).step_by(block) {
            let np = block.min(pixels - p0);
            let (p0_i, np_i) = (p0 as i64, np as i64);
            let col_ptr = match &col {
                None => x_b,
                Some(col) => {
                    let col_ptr = col.ptr();
                    let cache_b = cache_ptr + b * cache_item;
                    let mut launch = backend.stream.launch_builder(&im2col);
                    launch
                        .arg(&x_b)
                        .arg(&cache_b)
                        .arg(&col_ptr)
                        .arg(&p0_i)
                        .arg(&np_i)
                        .arg(&geom);
                    // SAFETY: x_b/cache_b address item b's C_in·(T or T_c)·H·W elements; col holds
                    // taps·block ≥ taps·np elements; the kernel reads only in-range input indices.
                    unsafe { launch.launch(grid_1d(taps * np)) }
                        .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
                    col_ptr
                }
            };
            let key = GemmKey {
                dtype,
                m: np as u64,
                n: g.out_channels as u64,
                k: taps as u64,
                transa: false,
                batch: 1,
                stride_a: 0,
                stride_b: 0,
                stride_d: 0,
                bias: false,
            };
            gemm(&backend, op, key, col_ptr, w_ptr, partial_ptr, None)?;
            let out_b = out_ptr + b * out_item;
            let mut launch = backend.stream.launch_builder(&scatter);
            launch
                .arg(&partial_ptr)
                .arg(&bias_ptr)
                .arg(&out_b)
                .arg(&c_out)
                .arg(&np_i)
                .arg(&p0_i)
                .arg(&p_total)
                .arg(&has_bias);
            // SAFETY: partial holds C_out·np elements, bias C_out (or is unused), item b of out
            // C_out·p_total with p0 + np ≤ p_total.
            unsafe { launch.launch(grid_1d(g.out_channels * np)) }
                .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
        }
    }
    Tensor::from_cuda(out, &out_shape).to_dtype(x.dtype())
}

/// x [.., H, W] → [.., 2H, 2W] (`n` images of h × w), x's dtype.
pub(super) fn upsample_nearest2x(
    op: &'static str,
    x: &Tensor,
    (n, h, w): (usize, usize, usize),
    out_shape: &[usize],
) -> Result<Tensor> {
    let src = x.cuda_storage(op)?;
    let backend = CudaBackend::get(src.ordinal)?;
    let out = backend.alloc(x.dtype(), 4 * n * h * w)?;
    if n * h * w > 0 {
        let f = backend.function(
            &SOURCE,
            &format!("upsample_nearest2x_{}", suffix(x.dtype())),
        )?;
        let (xp, op_ptr) = (src.ptr(), out.ptr());
        let (n_i, h_i, w_i) = (n as i64, h as i64, w as i64);
        let mut launch = backend.stream.launch_builder(&f);
        launch.arg(&xp).arg(&op_ptr).arg(&n_i).arg(&h_i).arg(&w_i);
        // SAFETY: x holds n·h·w elements and out 4·n·h·w, as the kernel indexes.
        unsafe { launch.launch(grid_1d(4 * n * h * w)) }
            .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    }
    Ok(Tensor::from_cuda(out, out_shape))
}
