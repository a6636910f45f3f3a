//! The ops the Wan DiT and VAE call, one folder per family.
//!
//! Each folder's `mod.rs` owns the public signatures, their shape contracts and checks, and the device
//! dispatch; `cpu.rs` is the f32 reference (plain loops over flat row-major slices); `tests.rs` checks
//! the reference against direct formulas. With feature `cuda`, `cuda.rs` (and `<op>.cu`, compiled by
//! NVRTC at run time) fills the `Device::Cuda` arm of each dispatch; `kernels/tests/cuda_parity.rs`
//! checks every one against the CPU.
//!
//! This file holds the checks every op shares: same device, rank, broadcasting.

pub(crate) mod attention;
mod conv;
mod elementwise;
mod embedding; // umT5 text encoder: token lookup, `Indices`
mod matmul;
mod norm;
mod quant; // FP8 (e4m3) linears: per-row quantisation, the e4m3 GEMM
mod random; // random-weight models drawn on the device
mod rope;
mod softmax; // T5 attention: relative-position bias + mask + softmax

pub use attention::{AttentionOptions, attention, lse_combine, lse_merge_pair};
pub use conv::{
    Halo, causal_conv3d, causal_conv3d_residual, causal_conv3d_upsampled, channels_to_frames,
    conv2d, conv3d, conv3d_cached, conv3d_cached_upsampled, conv3d_channels_last, halo_edges,
    upsample_nearest2x,
};
pub use elementwise::{
    add, affine, clamp, gated_residual, gelu_tanh, modulate, mul, scale, silu, sub,
};
pub use embedding::{Indices, embedding};
pub use matmul::{linear, linear_gelu_tanh, linear_residual, matmul};
pub use norm::{
    layer_norm, layer_norm_e4m3, layer_norm_modulate, layer_norm_modulate_e4m3, rms_norm,
    rms_norm_channels, rms_norm_channels_silu, rms_norm_rope,
};
pub use quant::{
    E4M3_MAX, FP8_ATTENTION_BLOCK, FP8_ATTENTION_QUANTIZE_MARKS, Fp8KeySplit, Fp8Tensor,
    attention_fp8, attention_fp8_reference, e4m3, e4m3_value, linear_fp8, linear_fp8_gelu_tanh,
    linear_fp8_residual,
};
pub use random::random_normal;
pub use rope::{apply_rope, rope_band_dims, rope_tables_3d};
pub use softmax::position_bias_softmax;

use crate::{Device, KernelError, Result, Tensor};

/// The `.cu` sources of the ops (the kernel compile test walks them).
#[cfg(all(test, feature = "cuda"))]
pub(crate) fn kernel_sources() -> [&'static crate::cuda::KernelSource; 10] {
    [
        &embedding::cuda::SOURCE,
        &random::cuda::SOURCE,
        &softmax::cuda::SOURCE,
        &conv::cuda::SOURCE,
        &elementwise::cuda::SOURCE,
        &norm::cuda::SOURCE,
        &rope::cuda::SOURCE,
        &attention::cuda::SOURCE,
        &attention::hopper::SOURCE,
        &quant::cuda::SOURCE,
    ]
}

/// The device all operands share, or `DeviceMismatch`.
pub(crate) fn same_device(op: &'static str, tensors: &[&Tensor]) -> Result<Device> {
    let first = tensors.first().map_or(Device::Cpu, |t| t.device());
    for t in tensors {
        if t.device() != first {
            return Err(KernelError::DeviceMismatch {
                op,
                first,
                other: t.device(),
            });
        }
    }
    Ok(first)
}

/// `UnsupportedDevice` for the CUDA arm of an op in a build without feature `cuda` (every op has
/// its CUDA twin).
#[cfg(not(feature = "cuda"))]
pub(crate) fn unsupported<T>(op: &'static str, device: Device) -> Result<T> {
    Err(KernelError::UnsupportedDevice { op, device })
}

/// Checks that `t` has `rank` dims; `contract` is the shape contract quoted in the error.
pub(crate) fn expect_rank(op: &'static str, contract: &str, t: &Tensor, rank: usize) -> Result<()> {
    if t.rank() != rank {
        return Err(KernelError::shape(
            op,
            format!("expected rank {rank}: {contract}"),
            &[t.shape()],
        ));
    }
    Ok(())
}

/// The dims of `t` as an array, checking that it has rank N; `contract` is quoted in the error.
pub(crate) fn dims<const N: usize>(
    op: &'static str,
    contract: &str,
    t: &Tensor,
) -> Result<[usize; N]> {
    t.shape()
        .try_into()
        .map_err(|_| KernelError::shape(op, format!("expected rank {N}: {contract}"), &[t.shape()]))
}

/// NumPy broadcasting of two shapes (aligned on the right; a dim of 1 stretches).
pub(crate) fn broadcast_shape(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let rank = a.len().max(b.len());
    let dim_at = |s: &[usize], axis: usize| {
        // Axis `axis` of the broadcast shape; missing leading dims count as 1.
        (axis + s.len()).checked_sub(rank).map_or(1, |i| s[i])
    };
    (0..rank)
        .map(|axis| match (dim_at(a, axis), dim_at(b, axis)) {
            (x, y) if x == y => Ok(x),
            (1, y) => Ok(y),
            (x, 1) => Ok(x),
            _ => Err(KernelError::shape(
                op,
                "shapes must broadcast (NumPy rules)",
                &[a, b],
            )),
        })
        .collect()
}

/// Element strides that read a tensor of shape `from` as if it had the broadcast shape `to`
/// (0 on stretched or missing axes). `from` must broadcast to `to`.
pub(crate) fn broadcast_strides(from: &[usize], to: &[usize]) -> Vec<usize> {
    let own = crate::tensor::contiguous_strides(from);
    let missing = to.len() - from.len();
    (0..to.len())
        .map(|axis| match axis.checked_sub(missing) {
            Some(i) if from[i] == to[axis] => own[i],
            _ => 0,
        })
        .collect()
}

/// Checks that `param` broadcasts to exactly `target` (the output keeps `target`'s shape).
pub(crate) fn expect_broadcasts_to(
    op: &'static str,
    name: &str,
    param: &Tensor,
    target: &[usize],
) -> Result<()> {
    let fits = param.rank() <= target.len()
        && param
            .shape()
            .iter()
            .rev()
            .zip(target.iter().rev())
            .all(|(&p, &t)| p == t || p == 1);
    if !fits {
        return Err(KernelError::shape(
            op,
            format!("{name} must broadcast to the primary input's shape"),
            &[target, param.shape()],
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_shapes_follow_numpy() {
        assert_eq!(
            broadcast_shape("t", &[2, 1, 4], &[3, 1]).ok(),
            Some(vec![2, 3, 4])
        );
        assert!(broadcast_shape("t", &[2, 3], &[4]).is_err());
        assert_eq!(broadcast_strides(&[3, 1], &[2, 3, 4]), vec![0, 1, 0]);
        assert_eq!(broadcast_strides(&[2, 1, 4], &[2, 3, 4]), vec![4, 0, 1]);
    }
}
