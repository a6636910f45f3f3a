//! CUDA twins of the elementwise ops (`elementwise.cu`): one unary kernel with an op code and two scalar
//! parameters, one broadcasting binary kernel, one ternary kernel (modulate, gated residual). Kernels are
//! instantiated per operand dtype, so mixed f32/bf16 operands need no cast pass.

use cudarc::driver::PushKernelArg;

use crate::cuda::{CudaBackend, KernelSource, Layout, grid_1d, suffix};
use crate::ops::broadcast_strides;
use crate::tensor::contiguous_strides;
use crate::{Result, Tensor};

pub(crate) const SOURCE: KernelSource = KernelSource {
    name: "elementwise",
    text: include_str!("elementwise.cu"),
};

/// f(x; p0, p1) per element → x's shape and dtype.
pub(super) fn unary(op: &'static str, x: &Tensor, code: i32, p0: f32, p1: f32) -> Result<Tensor> {
    let src = x.cuda_storage(op)?;
    let backend = CudaBackend::get(src.ordinal)?;
    let out = backend.alloc(x.dtype(), x.numel())?;
    let n = x.numel() as i64;
    if n > 0 {
        let f = backend.function(&SOURCE, &format!("unary_{}", suffix(x.dtype())))?;
        let (xp, op_ptr) = (src.ptr(), out.ptr());
        let mut launch = backend.stream.launch_builder(&f);
        launch
            .arg(&xp)
            .arg(&op_ptr)
            .arg(&n)
            .arg(&code)
            .arg(&p0)
            .arg(&p1);
        // SAFETY: x and out hold n elements of the kernel's T; arguments match its signature.
        unsafe { launch.launch(grid_1d(n as usize)) }
            .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    }
    Ok(Tensor::from_cuda(out, x.shape()))
}

/// a ∘ b with NumPy broadcasting to `out_shape` → a's dtype.
pub(super) fn binary(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
    out_shape: &[usize],
    code: i32,
) -> Result<Tensor> {
    let (sa, sb) = (a.cuda_storage(op)?, b.cuda_storage(op)?);
    let backend = CudaBackend::get(sa.ordinal)?;
    let numel: usize = out_shape.iter().product();
    let out = backend.alloc(a.dtype(), numel)?;
    if numel > 0 {
        let layout = Layout::new(
            op,
            out_shape,
            &[
                &broadcast_strides(a.shape(), out_shape),
                &broadcast_strides(b.shape(), out_shape),
            ],
        )?;
        let (ap, bp, outp, n) = (sa.ptr(), sb.ptr(), out.ptr(), numel as i64);
        // In 16-byte words of a where the layout and the addresses allow (binary_words' conditions).
        let per_word = 16 / a.dtype().size_in_bytes();
        let aligned = |p: u64| p.is_multiple_of(16);
        let words = layout
            .words(per_word)
            .filter(|&b_inner| aligned(ap) && aligned(outp) && (!b_inner || aligned(bp)));
        let types = format!("{}_{}", suffix(a.dtype()), suffix(b.dtype()));
        let name = match words {
            Some(_) => format!("binary_words_{types}"),
            None => format!("binary_{types}"),
        };
        let f = backend.function(&SOURCE, &name)?;
        let mut launch = backend.stream.launch_builder(&f);
        launch
            .arg(&ap)
            .arg(&bp)
            .arg(&outp)
            .arg(&n)
            .arg(&layout)
            .arg(&code);
        let b_inner = i32::from(words == Some(true));
        if words.is_some() {
            launch.arg(&b_inner);
        }
        let threads = match words {
            Some(_) => numel / per_word,
            None => numel,
        };
        // SAFETY: the layout's strides address a and b inside their shapes; out holds numel elements;
        // the word kernel's conditions were checked above (Layout::words and the alignment).
        unsafe { launch.launch(grid_1d(threads)) }
            .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    }
    Ok(Tensor::from_cuda(out, out_shape))
}

/// f(x, p, q) with p, q broadcast to x → x's shape and dtype.
pub(super) fn ternary(
    op: &'static str,
    x: &Tensor,
    p: &Tensor,
    q: &Tensor,
    code: i32,
) -> Result<Tensor> {
    let (sx, sp, sq) = (
        x.cuda_storage(op)?,
        p.cuda_storage(op)?,
        q.cuda_storage(op)?,
    );
    let backend = CudaBackend::get(sx.ordinal)?;
    let numel = x.numel();
    let out = backend.alloc(x.dtype(), numel)?;
    if numel > 0 {
        let layout = Layout::new(
            op,
            x.shape(),
            &[
                &contiguous_strides(x.shape()),
                &broadcast_strides(p.shape(), x.shape()),
                &broadcast_strides(q.shape(), x.shape()),
            ],
        )?;
        let name = format!(
            "ternary_{}_{}_{}",
            suffix(x.dtype()),
            suffix(p.dtype()),
            suffix(q.dtype())
        );
        let f = backend.function(&SOURCE, &name)?;
        let (xp, pp, qp, outp, n) = (sx.ptr(), sp.ptr(), sq.ptr(), out.ptr(), numel as i64);
        let mut launch = backend.stream.launch_builder(&f);
        launch
            .arg(&xp)
            .arg(&pp)
            .arg(&qp)
            .arg(&outp)
            .arg(&n)
            .arg(&layout)
            .arg(&code);
        // SAFETY: the layout's strides address x, p and q inside their shapes; out holds numel elements.
        unsafe { launch.launch(grid_1d(numel)) }
            .map_err(|e| backend.err(op, "cuLaunchKernel", e))?;
    }
    Ok(Tensor::from_cuda(out, x.shape()))
}
