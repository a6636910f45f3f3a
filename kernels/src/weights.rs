//! Where model weights come from: diffusers/transformers safetensors checkpoints (one file or
//! sharded with `*.index.json`, memory-mapped, converted to the run dtype on load), or seeded
//! random weights of any shape for benchmarks and the embedded default.
//!
//! Models ask for each tensor by its checkpoint name and expected shape, so a missing tensor, a
//! wrong shape or an unreadable file is an error naming the tensor and the file.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::tensor::{Dtype as StDtype, Metadata};

use crate::{DType, Tensor};

/// Why a weight could not be had.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    /// A file could not be opened or mapped.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A file is not a valid safetensors file, or an index is malformed.
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The checkpoint folder holds no weights file.
    #[error("{dir}: no `{stem}.safetensors` or `{stem}.safetensors.index.json`")]
    NoWeights {
        /// The folder searched.
        dir: PathBuf,
        /// The file stem looked for.
        stem: String,
    },
    /// A tensor the model needs is absent.
    #[error("{origin}: tensor `{name}` is missing")]
    Missing {
        /// The checkpoint.
        origin: String,
        /// The tensor's name.
        name: String,
    },
    /// A tensor has another shape than the model's config implies.
    #[error("{origin}: tensor `{name}` has shape {actual:?}, the config implies {expected:?}")]
    Shape {
        /// The checkpoint.
        origin: String,
        /// The tensor's name.
        name: String,
        /// Shape the model expects.
        expected: Vec<usize>,
        /// Shape in the file.
        actual: Vec<usize>,
    },
    /// A tensor's dtype cannot be converted to a float dtype.
    #[error("{origin}: tensor `{name}` has dtype {dtype}; only F32, F16 and BF16 load")]
    Dtype {
        /// The checkpoint.
        origin: String,
        /// The tensor's name.
        name: String,
        /// Its dtype.
        dtype: String,
    },
    /// Building the tensor failed (cannot happen for consistent shapes; kept for completeness).
    #[error(transparent)]
    Kernel(#[from] crate::KernelError),
}

/// A source of named weight tensors.
pub trait WeightSource: Send + Sync {
    /// The tensor `name` of shape `shape`, converted to `dtype`, on the CPU.
    fn tensor(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor, WeightsError>;

    /// Optional tensor: `None` when absent (e.g. a bias some checkpoints leave out).
    fn optional(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Option<Tensor>, WeightsError> {
        match self.tensor(name, shape, dtype) {
            Err(WeightsError::Missing { .. }) => Ok(None),
            other => other.map(Some),
        }
    }
}

/// One memory-mapped safetensors file with its parsed header.
struct MappedFile {
    path: PathBuf,
    map: memmap2::Mmap,
    /// Where tensor data starts: the 8-byte header length plus the JSON header.
    data_start: usize,
    metadata: Metadata,
}

impl MappedFile {
    fn open(path: &Path) -> Result<MappedFile, WeightsError> {
        let io = |source| WeightsError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and private to this process; checkpoints are not modified
        // while a server runs (a truncated file would fault, as it would for any mmap reader).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let (header_len, metadata) =
            safetensors::SafeTensors::read_metadata(&map).map_err(|e| WeightsError::Format {
                path: path.to_path_buf(),
                message: format!("not a safetensors file: {e}"),
            })?;
        Ok(MappedFile {
            path: path.to_path_buf(),
            map,
            data_start: 8 + header_len,
            metadata,
        })
    }
}

/// A safetensors checkpoint: one file, or the shards listed by an index.
pub struct Checkpoint {
    origin: String,
    files: Vec<MappedFile>,
    /// Tensor name → index into `files`.
    index: HashMap<String, usize>,
}

impl Checkpoint {
    /// Opens `dir/{stem}.safetensors`, or the shards of `dir/{stem}.safetensors.index.json`
    /// (diffusers uses the stem `diffusion_pytorch_model`, transformers `model`).
    pub fn open_dir(dir: &Path, stem: &str) -> Result<Checkpoint, WeightsError> {
        let single = dir.join(format!("{stem}.safetensors"));
        let index = dir.join(format!("{stem}.safetensors.index.json"));
        if index.is_file() {
            Self::open_index(&index)
        } else if single.is_file() {
            Self::open_files(std::slice::from_ref(&single), &single)
        } else {
            Err(WeightsError::NoWeights {
                dir: dir.to_path_buf(),
                stem: stem.to_string(),
            })
        }
    }

    /// Opens the shards named by a `*.safetensors.index.json` (its `weight_map`).
    pub fn open_index(index: &Path) -> Result<Checkpoint, WeightsError> {
        let format = |message: String| WeightsError::Format {
            path: index.to_path_buf(),
            message,
        };
        let text = std::fs::read_to_string(index).map_err(|source| WeightsError::Io {
            path: index.to_path_buf(),
            source,
        })?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format(e.to_string()))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| format("no `weight_map` object".to_string()))?;
        let mut shards: Vec<String> = Vec::new();
        for (name, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| format(format!("weight_map[{name:?}] is not a file name")))?;
            if !shards.iter().any(|s| s == file) {
                shards.push(file.to_string());
            }
        }
        shards.sort();
        let dir = index.parent().unwrap_or(Path::new("."));
        let paths: Vec<PathBuf> = shards.iter().map(|s| dir.join(s)).collect();
        Self::open_files(&paths, index)
    }

    /// `origin` names the checkpoint in errors: the single file, or the index.
    fn open_files(paths: &[PathBuf], origin: &Path) -> Result<Checkpoint, WeightsError> {
        let files = paths
            .iter()
            .map(|p| MappedFile::open(p))
            .collect::<Result<Vec<_>, _>>()?;
        let mut index = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            for name in f.metadata.tensors().keys() {
                index.insert(name.clone(), i);
            }
        }
        Ok(Checkpoint {
            origin: origin.display().to_string(),
            files,
            index,
        })
    }

    /// The stored shape of tensor `name`, if present.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let file = &self.files[*self.index.get(name)?];
        file.metadata.info(name).map(|info| info.shape.clone())
    }

    /// The tensor `name` in the shape it is stored in (fixtures and tools; models pass the shape
    /// their config implies through [`WeightSource::tensor`]).
    pub fn stored(&self, name: &str, dtype: DType) -> Result<Tensor, WeightsError> {
        let shape = self.shape(name).ok_or_else(|| WeightsError::Missing {
            origin: self.origin.clone(),
            name: name.to_string(),
        })?;
        self.tensor(name, &shape, dtype)
    }

    /// Every tensor name in the checkpoint.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }
}

impl WeightSource for Checkpoint {
    fn tensor(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor, WeightsError> {
        let missing = || WeightsError::Missing {
            origin: self.origin.clone(),
            name: name.to_string(),
        };
        let file = &self.files[*self.index.get(name).ok_or_else(missing)?];
        let info = file.metadata.info(name).ok_or_else(missing)?;
        if info.shape != shape {
            return Err(WeightsError::Shape {
                origin: file.path.display().to_string(),
                name: name.to_string(),
                expected: shape.to_vec(),
                actual: info.shape.clone(),
            });
        }
        let bytes =
            &file.map[file.data_start + info.data_offsets.0..file.data_start + info.data_offsets.1];
        // Safetensors data is little-endian and unaligned in general: decode element by element.
        let values: Vec<f32> = match info.dtype {
            StDtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            StDtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            StDtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(WeightsError::Dtype {
                    origin: file.path.display().to_string(),
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                });
            }
        };
        Ok(Tensor::from_vec(values, shape)?.to_dtype(dtype)?)
    }
}

/// Seeded random weights of whatever shape is asked for, scaled so activations stay O(1) through
/// deep stacks (and within bf16 range): matrices ~ N(0, 1/fan_in), norm weights 1, biases and
/// modulation tables small. Each tensor's seed derives from its name, so a tensor does not depend
/// on the order of requests.
#[derive(Debug, Clone, Copy)]
pub struct RandomWeights {
    seed: u64,
}

impl RandomWeights {
    /// Random weights from `seed`.
    pub fn new(seed: u64) -> RandomWeights {
        RandomWeights { seed }
    }
}

/// [`RandomWeights`] drawn ahead on every host core and kept on the host, so that building a big model
/// (once per GPU, or once per mesh in a benchmark) only uploads: the same values as drawing them one
/// by one, which for billions of weights on one core takes minutes.
#[derive(Debug, Clone)]
pub struct DrawnWeights(HashMap<String, Tensor>);

/// Records the weights a model asks for and hands out zeros: a dry build on the host.
#[derive(Default)]
struct Recorder(std::sync::Mutex<Vec<(String, Vec<usize>, DType)>>);

impl WeightSource for Recorder {
    fn tensor(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor, WeightsError> {
        let mut requests = self.0.lock().unwrap_or_else(|e| e.into_inner());
        requests.push((name.to_string(), shape.to_vec(), dtype));
        Ok(Tensor::zeros(shape, dtype, crate::Device::Cpu)?)
    }
}

impl DrawnWeights {
    /// Draws, with `RandomWeights::new(seed)`, every weight that `dry_build` asks for (it builds
    /// the model on the host from the source it is given; the zeros it gets are dropped).
    pub fn draw<E>(
        seed: u64,
        dry_build: impl FnOnce(&dyn WeightSource) -> Result<(), E>,
    ) -> Result<DrawnWeights, E>
    where
        E: From<WeightsError>,
    {
        use std::sync::Mutex;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let recorder = Recorder::default();
        dry_build(&recorder)?;
        let requests = recorder.0.into_inner().unwrap_or_else(|e| e.into_inner());
        let random = RandomWeights::new(seed);
        let next = AtomicUsize::new(0);
        let drawn = Mutex::new(HashMap::with_capacity(requests.len()));
        let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
        std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads.min(requests.len().max(1)))
                .map(|_| {
                    scope.spawn(|| -> Result<(), WeightsError> {
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            let Some((name, shape, dtype)) = requests.get(i) else {
                                return Ok(());
                            };
                            let t = random.tensor(name, shape, *dtype)?;
                            let mut map = drawn.lock().unwrap_or_else(|e| e.into_inner());
                            map.insert(name.clone(), t);
                        }
                    })
                })
                .collect();
            // A drawing thread only fails through `random.tensor` (its error is returned); one that
            // panicked re-raises here, as a panic in the caller's own loop would.
            workers.into_iter().try_for_each(|w| {
                w.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
        })?;
        Ok(DrawnWeights(
            drawn.into_inner().unwrap_or_else(|e| e.into_inner()),
        ))
    }
}

impl WeightSource for DrawnWeights {
    fn tensor(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor, WeightsError> {
        match self.0.get(name) {
            Some(t) if t.shape() == shape && t.dtype() == dtype => Ok(t.clone()),
            _ => Err(WeightsError::Missing {
                origin: "random weights drawn ahead".into(),
                name: name.to_string(),
            }),
        }
    }
}

/// FNV-1a of the name, mixed with the seed.
fn name_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl WeightSource for RandomWeights {
    fn tensor(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor, WeightsError> {
        let leaf = name.rsplit('.').next().unwrap_or(name);
        let is_norm = name
            .split('.')
            .any(|p| p.starts_with("norm") || p.ends_with("norm"));
        let numel: usize = shape.iter().product();
        let cpu = crate::Device::Cpu;
        let t = if is_norm && (leaf == "weight" || leaf == "gamma") {
            Tensor::full(shape, 1.0, dtype, cpu)?
        } else if is_norm && leaf == "bias" {
            Tensor::zeros(shape, dtype, cpu)?
        } else {
            let std = if leaf == "bias" || shape.len() <= 1 || name.contains("scale_shift_table") {
                0.02
            } else {
                // fan_in: every axis but the first (Linear [out, in], Conv [out, in, k…]).
                let fan_in = (numel / shape[0]).max(1);
                1.0 / (fan_in as f32).sqrt()
            };
            let t = Tensor::randn(shape, DType::F32, name_seed(self.seed, name), cpu)?;
            crate::ops::scale(&t, std)?.to_dtype(dtype)?
        };
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn write(path: &Path, tensors: &[(&str, Vec<f32>, Vec<usize>)]) {
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, v, _)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        let views: Vec<(&str, TensorView)> = tensors
            .iter()
            .zip(&bytes)
            .map(|((n, _, s), b)| (*n, TensorView::new(StDtype::F32, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("ditstream-weights-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn single_file_loads_and_checks_shapes() {
        let dir = temp_dir("single");
        write(
            &dir.join("model.safetensors"),
            &[("a.weight", vec![1.0, 2.0, 3.0, 4.0], vec![2, 2])],
        );
        let ck = Checkpoint::open_dir(&dir, "model").unwrap();
        let t = ck.tensor("a.weight", &[2, 2], DType::F32).unwrap();
        assert_eq!(t.to_vec_f32().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
        let bf = ck.tensor("a.weight", &[2, 2], DType::BF16).unwrap();
        assert_eq!(bf.dtype(), DType::BF16);
        let e = ck
            .tensor("a.weight", &[4], DType::F32)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tensor `a.weight` has shape [2, 2], the config implies [4]"),
            "{e}"
        );
        let e = ck
            .tensor("b.weight", &[4], DType::F32)
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("tensor `b.weight` is missing"), "{e}");
        assert!(ck.optional("b.bias", &[4], DType::F32).unwrap().is_none());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn sharded_index_loads_every_shard() {
        let dir = temp_dir("sharded");
        write(
            &dir.join("m-00001-of-00002.safetensors"),
            &[("x", vec![1.0], vec![1])],
        );
        write(
            &dir.join("m-00002-of-00002.safetensors"),
            &[("y", vec![2.0, 3.0], vec![2])],
        );
        std::fs::write(
            dir.join("m.safetensors.index.json"),
            r#"{"metadata": {}, "weight_map": {"x": "m-00001-of-00002.safetensors", "y": "m-00002-of-00002.safetensors"}}"#,
        )
        .unwrap();
        let ck = Checkpoint::open_dir(&dir, "m").unwrap();
        assert_eq!(
            ck.tensor("y", &[2], DType::F32)
                .unwrap()
                .to_vec_f32()
                .unwrap(),
            vec![2.0, 3.0]
        );
        assert_eq!(
            ck.tensor("x", &[1], DType::F32)
                .unwrap()
                .to_vec_f32()
                .unwrap(),
            vec![1.0]
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn bad_folders_name_the_file() {
        let dir = temp_dir("bad");
        let e = Checkpoint::open_dir(&dir, "model")
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("no `model.safetensors` or `model.safetensors.index.json`"),
            "{e}"
        );
        std::fs::write(dir.join("model.safetensors"), b"not a safetensors file").unwrap();
        let e = Checkpoint::open_dir(&dir, "model")
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("model.safetensors"), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn random_weights_are_deterministic_and_scaled() {
        let w = RandomWeights::new(7);
        let a = w
            .tensor("blocks.0.attn1.to_q.weight", &[64, 256], DType::F32)
            .unwrap();
        let b = w
            .tensor("blocks.0.attn1.to_q.weight", &[64, 256], DType::F32)
            .unwrap();
        assert_eq!(a.to_vec_f32().unwrap(), b.to_vec_f32().unwrap());
        let v = a.to_vec_f32().unwrap();
        let var = v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32;
        // N(0, 1/256): variance 1/256 within sampling error (16k samples: ±3%).
        assert!((var * 256.0 - 1.0).abs() < 0.1, "variance {var}");
        let n = w
            .tensor("blocks.0.attn1.norm_q.weight", &[8], DType::F32)
            .unwrap();
        assert_eq!(n.to_vec_f32().unwrap(), vec![1.0; 8]);
        let other = w
            .tensor("blocks.1.attn1.to_q.weight", &[64, 256], DType::F32)
            .unwrap();
        assert_ne!(other.to_vec_f32().unwrap(), v);
    }
}
