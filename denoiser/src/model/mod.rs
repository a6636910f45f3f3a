//! The denoiser's model: the Wan 2.x transformer, its config, and how it is loaded.

mod config;
mod wan;

use std::path::{Path, PathBuf};

use ditstream_kernels::weights::{Checkpoint, WeightsError};
use ditstream_kernels::{DType, Device};

pub use config::WanConfig;
pub use wan::{
    Conditioning, LocalAttention, Operand, SelfAttention, WanTransformer, timestep_sinusoid,
};

/// Why the model could not be built or run.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The checkpoint's `config.json` is unreadable or asks for something unsupported.
    #[error("{path}: {message}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// What is wrong, naming the key.
        message: String,
    },
    /// A weight is missing, misshapen or unreadable.
    #[error(transparent)]
    Weights(#[from] WeightsError),
    /// An input breaks the model's shape contract.
    #[error("{what} shape {value}: {rule}")]
    Input {
        /// Which input.
        what: &'static str,
        /// Its shape.
        value: String,
        /// The rule.
        rule: String,
    },
    /// An op failed (a bug if inputs were checked; carries the op's own message).
    #[error(transparent)]
    Kernel(#[from] ditstream_kernels::KernelError),
    /// The caller's interrupt asked the forward to stop, before block `block`.
    #[error("interrupted before transformer block {block}")]
    Interrupted {
        /// The first block not run.
        block: usize,
    },
}

impl WanTransformer {
    /// Loads a diffusers `transformer/` folder (`config.json` and
    /// `diffusion_pytorch_model.safetensors`, sharded or not) in `dtype`, weights on `device`.
    pub fn from_dir(
        dir: &Path,
        dtype: DType,
        device: Device,
    ) -> Result<WanTransformer, ModelError> {
        let cfg = WanConfig::from_dir(dir)?;
        let weights = Checkpoint::open_dir(dir, "diffusion_pytorch_model")?;
        WanTransformer::new(cfg, &weights, dtype, device)
    }
}
