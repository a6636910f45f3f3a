//! `KernelError`: every way a kernels call can fail, carrying the offending shapes and values.

use crate::{DType, Device};

/// Result alias for the kernels crate.
pub type Result<T> = std::result::Result<T, KernelError>;

/// Errors from tensor construction, layout changes and ops. Each names the op and the values at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    /// A buffer's length does not match the element count of the requested shape.
    #[error("{op}: shape {shape:?} holds {numel} elements but {len} were given")]
    DataLength {
        /// The op or constructor.
        op: &'static str,
        /// Requested shape.
        shape: Vec<usize>,
        /// Elements the shape holds.
        numel: usize,
        /// Elements given.
        len: usize,
    },
    /// Operand shapes break the op's shape contract; `rule` says which one.
    #[error("{op}: {rule}; got shapes {shapes:?}")]
    ShapeMismatch {
        /// The op.
        op: &'static str,
        /// The contract that failed, in words (e.g. "x [.., in] and w [out, in] must share `in`").
        rule: String,
        /// The operand shapes, in argument order.
        shapes: Vec<Vec<usize>>,
    },
    /// An axis index is not below the tensor's rank.
    #[error("{op}: axis {axis} is out of range for rank {rank}")]
    AxisOutOfRange {
        /// The op.
        op: &'static str,
        /// Axis asked for.
        axis: usize,
        /// Rank of the tensor.
        rank: usize,
    },
    /// A permutation is not a reordering of `0..rank`.
    #[error("permute: {perm:?} is not a permutation of the axes of shape {shape:?}")]
    InvalidPermutation {
        /// The permutation given.
        perm: Vec<usize>,
        /// Shape of the tensor.
        shape: Vec<usize>,
    },
    /// A range `start..start+len` along an axis exceeds that axis.
    #[error("{op}: range {start}..{end} exceeds axis {axis} of length {dim} (shape {shape:?})")]
    RangeOutOfBounds {
        /// The op.
        op: &'static str,
        /// Axis.
        axis: usize,
        /// Range start.
        start: usize,
        /// Range end (exclusive).
        end: usize,
        /// Length of the axis.
        dim: usize,
        /// Shape of the tensor.
        shape: Vec<usize>,
    },
    /// A scalar argument is out of its allowed range (a split count, `kv_len`, a cache length, ...).
    #[error("{op}: {name} = {value} but {rule}")]
    InvalidArgument {
        /// The op.
        op: &'static str,
        /// The argument's name.
        name: &'static str,
        /// Its value, formatted.
        value: String,
        /// The rule it breaks.
        rule: String,
    },
    /// An operand has a dtype the op does not accept.
    #[error("{op}: {name} must be {expected:?}, got {got:?}")]
    DTypeMismatch {
        /// The op.
        op: &'static str,
        /// The operand.
        name: &'static str,
        /// The dtype required.
        expected: DType,
        /// The dtype given.
        got: DType,
    },
    /// Operands live on different devices.
    #[error("{op}: operands on different devices ({first} and {other})")]
    DeviceMismatch {
        /// The op.
        op: &'static str,
        /// Device of the first operand.
        first: Device,
        /// Device of an operand that differs.
        other: Device,
    },
    /// A CUDA library could not be loaded, or no usable GPU was found.
    #[error("CUDA unavailable: {library}: {detail}")]
    CudaUnavailable {
        /// The library (`libcuda`, `libnvrtc`, `libcublasLt`) or `device`.
        library: &'static str,
        /// What was tried and what happened.
        detail: String,
    },
    /// A CUDA driver, cuBLASLt or NVRTC call failed.
    #[error("{op}: CUDA call {call} failed on {device}: {detail}")]
    Cuda {
        /// The op or backend step.
        op: &'static str,
        /// The failing call.
        call: &'static str,
        /// The device.
        device: Device,
        /// The error the library returned.
        detail: String,
    },
    /// NVRTC rejected a kernel source; `log` is the compiler's log.
    #[error("NVRTC could not compile {source_name} for {arch} (options {options:?}):\n{log}")]
    Compile {
        /// The `.cu` source (op folder name).
        source_name: &'static str,
        /// The target architecture (e.g. `sm_90a`).
        arch: String,
        /// The options passed to NVRTC.
        options: Vec<String>,
        /// NVRTC's program log.
        log: String,
    },
    /// The op has no implementation for this device (yet).
    #[error("{op}: not implemented on {device}")]
    UnsupportedDevice {
        /// The op.
        op: &'static str,
        /// The device asked for.
        device: Device,
    },
}

impl KernelError {
    /// Shorthand for [`KernelError::ShapeMismatch`].
    pub(crate) fn shape(op: &'static str, rule: impl Into<String>, shapes: &[&[usize]]) -> Self {
        KernelError::ShapeMismatch {
            op,
            rule: rule.into(),
            shapes: shapes.iter().map(|s| s.to_vec()).collect(),
        }
    }

    /// Shorthand for [`KernelError::InvalidArgument`].
    pub(crate) fn arg(
        op: &'static str,
        name: &'static str,
        value: impl std::fmt::Display,
        rule: impl Into<String>,
    ) -> Self {
        KernelError::InvalidArgument {
            op,
            name,
            value: value.to_string(),
            rule: rule.into(),
        }
    }
}
