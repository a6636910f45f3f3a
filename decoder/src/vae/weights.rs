//! Checkpoint names for the VAE: a prefix over the kernels crate's [`WeightSource`] (a diffusers
//! safetensors checkpoint, or seeded random weights), so the building code reads like the checkpoint
//! (`w.pp("decoder").pp("up_blocks").pp(0)`), as candle's `VarBuilder::pp`. Each tensor is converted
//! to the decoder's dtype and moved to its device once, here, when the decoder is built.

use ditstream_kernels::weights::WeightSource;
use ditstream_kernels::{DType, Device, Tensor};

use super::error::Result;

/// A name prefix over a [`WeightSource`]; every tensor is fetched with the shape the config implies,
/// in `dtype`, on `device`.
#[derive(Clone)]
pub(crate) struct Prefixed<'a> {
    source: &'a dyn WeightSource,
    prefix: String,
    dtype: DType,
    device: Device,
}

impl<'a> Prefixed<'a> {
    /// The whole checkpoint (empty prefix), tensors converted to `dtype` and placed on `device`.
    pub(crate) fn root(source: &'a dyn WeightSource, dtype: DType, device: Device) -> Self {
        Prefixed {
            source,
            prefix: String::new(),
            dtype,
            device,
        }
    }

    /// `prefix.name`.
    pub(crate) fn pp(&self, name: impl std::fmt::Display) -> Prefixed<'a> {
        Prefixed {
            source: self.source,
            prefix: self.join(name),
            dtype: self.dtype,
            device: self.device,
        }
    }

    /// The tensor `prefix.name`, which must have exactly `shape`, on the device.
    pub(crate) fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let host = self.source.tensor(&self.join(name), shape, self.dtype)?;
        Ok(host.to_device(self.device)?)
    }

    fn join(&self, name: impl std::fmt::Display) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }
}
