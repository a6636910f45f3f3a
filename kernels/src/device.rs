//! `Device` (where a tensor lives) and `DType` (how its elements are stored).

use std::fmt;

/// Where a tensor's storage lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory; ops run the f32 reference backend.
    Cpu,
    /// CUDA device with this ordinal (feature `cuda`; without it ops answer `UnsupportedDevice`).
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(ordinal) => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// Element storage type. Maths always runs in f32; bf16 is a storage format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// bfloat16 (8 exponent bits, 7 mantissa bits), via the `half` crate.
    BF16,
}

impl DType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 => 2,
        }
    }
}
