//! Reading a transformers-format encoder folder: `config.json` and the weights, either one
//! `model.safetensors` or shards listed in `model.safetensors.index.json`. Every tensor is looked up by
//! its checkpoint name and checked for presence and shape; errors name the file.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use ditstream_kernels::Tensor;
use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use super::TextError;

/// Single-file weights of a transformers checkpoint folder.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// Index of sharded weights (`weight_map`: tensor name → shard file).
pub const WEIGHTS_INDEX_FILE: &str = "model.safetensors.index.json";

/// Tensors read from a checkpoint folder, by checkpoint name, with the file each came from.
pub(crate) struct Checkpoint {
    tensors: HashMap<String, (Tensor, PathBuf)>,
    /// What was read, for "missing tensor" errors: the single file, or the index.
    source: PathBuf,
}

impl Checkpoint {
    /// Reads every tensor of `dir`'s weights: `model.safetensors` if present, else the shards of
    /// `model.safetensors.index.json`. f32 and bf16 stay as stored; f16 widens to f32.
    pub(crate) fn read_dir(dir: &Path) -> Result<Self, TextError> {
        let single = dir.join(WEIGHTS_FILE);
        let index = dir.join(WEIGHTS_INDEX_FILE);
        let mut tensors = HashMap::new();
        if single.is_file() {
            read_file(&single, None, &mut tensors)?;
            return Ok(Checkpoint {
                tensors,
                source: single,
            });
        }
        if !index.is_file() {
            return Err(TextError::Io {
                path: single,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE} is in the folder"),
                ),
            });
        }
        // Shard file → the names the index assigns to it (only those are taken from it).
        let mut shards: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (name, file) in read_index(&index)? {
            shards.entry(file).or_default().push(name);
        }
        for (file, names) in shards {
            read_file(&dir.join(&file), Some(&names), &mut tensors)?;
        }
        Ok(Checkpoint {
            tensors,
            source: index,
        })
    }

    /// Whether the checkpoint holds `name`.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The tensor `name`, which must have exactly `shape`.
    pub(crate) fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor, TextError> {
        let (tensor, file) = self
            .tensors
            .get(name)
            .ok_or_else(|| TextError::MissingTensor {
                name: name.to_string(),
                path: self.source.clone(),
            })?;
        if tensor.shape() != shape {
            return Err(TextError::TensorShape {
                name: name.to_string(),
                path: file.clone(),
                expected: shape.to_vec(),
                got: tensor.shape().to_vec(),
            });
        }
        Ok(tensor.clone())
    }
}

/// `weight_map` of a sharded checkpoint's index: (tensor name, shard file name).
fn read_index(path: &Path) -> Result<Vec<(String, String)>, TextError> {
    let bad = |message: String| TextError::Checkpoint {
        path: path.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|source| TextError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let json: Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("has no `weight_map` object".into()))?;
    map.iter()
        .map(|(name, file)| match file.as_str() {
            // A shard name is a file in the same folder, never a path elsewhere.
            Some(f) if !f.contains('/') && !f.contains('\\') && f != ".." => {
                Ok((name.clone(), f.to_string()))
            }
            _ => Err(bad(format!(
                "weight_map[{name:?}] = {file}: must be a file name in the same folder"
            ))),
        })
        .collect()
}

/// Reads the tensors of one safetensors file (all of them, or only `names`) into `out`.
fn read_file(
    path: &Path,
    names: Option<&[String]>,
    out: &mut HashMap<String, (Tensor, PathBuf)>,
) -> Result<(), TextError> {
    let bytes = std::fs::read(path).map_err(|source| TextError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let bad = |message: String| TextError::Checkpoint {
        path: path.to_path_buf(),
        message,
    };
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
    let wanted: Vec<String> = match names {
        Some(names) => names.to_vec(),
        None => file.names().into_iter().map(String::from).collect(),
    };
    for name in wanted {
        let view = file.tensor(&name).map_err(|e| {
            bad(format!(
                "tensor {name:?} (listed in the index) cannot be read: {e}"
            ))
        })?;
        let data = view.data();
        let tensor = match view.dtype() {
            Dtype::F32 => Tensor::from_vec(
                data.chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
                view.shape(),
            ),
            Dtype::BF16 => Tensor::from_bf16_vec(
                data.chunks_exact(2)
                    .map(|b| bf16::from_le_bytes([b[0], b[1]]))
                    .collect(),
                view.shape(),
            ),
            Dtype::F16 => Tensor::from_vec(
                data.chunks_exact(2)
                    .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
                view.shape(),
            ),
            other => {
                return Err(bad(format!(
                    "tensor {name:?} has dtype {other:?}; only F32, BF16 and F16 are read"
                )));
            }
        }?;
        out.insert(name, (tensor, path.to_path_buf()));
    }
    Ok(())
}
