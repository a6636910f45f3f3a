//! Algorithm choices on disk, so that a restart does not search again: the first decode of a
//! fresh process pays cuDNN's algorithm search per convolution shape (~20 s at 480p on an H200,
//! see `cudnn.rs`), the first forward cuBLASLt's per GEMM shape (`gemm.rs`); a process that finds
//! the shape's choice here builds that plan directly.
//!
//! One file per library (`<kernel cache dir>/cudnn-plans.tsv`, `cublaslt-algos.tsv`), one line
//! per choice, tab-separated: `v1  <device>  <library version>  <shape>  <choice's fields…>`
//! ([`Entry`] says what the choice's fields are). A choice is valid only for the GPU model and the
//! library version it was measured with, so both are part of its key (`device` is the GPU's name,
//! NVRTC architecture and SM count, e.g. `NVIDIA H200 sm_90a 132`); lines of other devices and
//! versions are kept untouched, so one cache directory serves a mixed fleet. Unknown versions of the
//! line format and lines that do not parse are skipped (and dropped at the next write). Writes go to
//! a temporary file that is renamed over the old one, after merging what another process may have
//! added meanwhile; two processes adding at the same instant can lose one line, which costs one
//! search later, never a wrong plan.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::cudnn::{DnnConvKey, DnnLayout};
use crate::DType;

/// First field of every line this version writes.
const FORMAT: &str = "v1";

/// What a cache file records per shape: its fields after the shape, and back.
pub(crate) trait Entry: Clone + PartialEq + Sized {
    /// The fields, in file order (none may contain a tab or a newline).
    fn fields(&self) -> Vec<String>;
    /// The entry of `fields`, or `None` if they do not parse.
    fn parse(fields: &[&str]) -> Option<Self>;
}

/// What cuDNN's search chose for one convolution shape.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Choice {
    /// `cudnnConvolutionFwdAlgo_t` of the legacy algorithm, as its number.
    pub algo: i32,
    /// `cudnnMathType_t` it runs with, as its number.
    pub math: i32,
    /// The graph-API configuration that runs instead (its label, see `Candidate::label`), if one
    /// measured faster.
    pub graph: Option<String>,
    /// The chosen plan's measured time, for the plan line.
    pub ms: f32,
}

impl Entry for Choice {
    fn fields(&self) -> Vec<String> {
        let graph = self.graph.as_deref().unwrap_or("-");
        vec![
            self.algo.to_string(),
            self.math.to_string(),
            graph.to_string(),
            self.ms.to_string(),
        ]
    }

    fn parse(fields: &[&str]) -> Option<Self> {
        let [algo, math, graph, ms] = fields[..] else {
            return None;
        };
        Some(Choice {
            algo: algo.parse().ok()?,
            math: math.parse().ok()?,
            graph: (graph != "-").then(|| graph.to_string()),
            ms: ms.parse().ok()?,
        })
    }
}

/// A cache file's choices, by (device, library version, shape).
#[derive(Debug, PartialEq)]
pub(crate) struct PlanCache<C> {
    choices: BTreeMap<(String, usize, String), C>,
}

impl<C> Default for PlanCache<C> {
    fn default() -> Self {
        PlanCache {
            choices: BTreeMap::new(),
        }
    }
}

/// The text form of a convolution shape: every field of the key, e.g.
/// `bf16 ndhwc b1 c96>96 in6x48x80 k3x3x3 s1x1x1 p0x1x1`.
pub(crate) fn shape_text(key: &DnnConvKey) -> String {
    let dims = |d: [usize; 3]| format!("{}x{}x{}", d[0], d[1], d[2]);
    let dtype = match key.dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
    };
    let layout = match key.layout {
        DnnLayout::Ncdhw => "ncdhw",
        DnnLayout::Ndhwc => "ndhwc",
    };
    format!(
        "{dtype} {layout} b{} c{}>{} in{} k{} s{} p{}",
        key.batch,
        key.c_in,
        key.c_out,
        dims(key.input),
        dims(key.kernel),
        dims(key.stride),
        dims(key.pad)
    )
}

impl<C: Entry> PlanCache<C> {
    /// The choices in `text` (the file's contents); lines that do not parse are skipped.
    pub fn parse(text: &str) -> Self {
        let mut cache = PlanCache::default();
        for line in text.lines() {
            let f: Vec<&str> = line.split('\t').collect();
            let [format, device, version, shape, ref rest @ ..] = f[..] else {
                continue;
            };
            if format != FORMAT {
                continue;
            }
            let (Ok(version), Some(choice)) = (version.parse::<usize>(), C::parse(rest)) else {
                continue;
            };
            cache
                .choices
                .insert((device.to_string(), version, shape.to_string()), choice);
        }
        cache
    }

    /// The file's text: one line per choice, sorted (so equal caches write equal files).
    pub fn render(&self) -> String {
        let mut out = String::new();
        for ((device, version, shape), c) in &self.choices {
            out.push_str(&format!("{FORMAT}\t{device}\t{version}\t{shape}"));
            for field in c.fields() {
                out.push('\t');
                out.push_str(&field);
            }
            out.push('\n');
        }
        out
    }

    /// The choice for `shape` on `device` with library version `version`.
    pub fn get(&self, device: &str, version: usize, shape: &str) -> Option<&C> {
        self.choices
            .get(&(device.to_string(), version, shape.to_string()))
    }

    /// Records a choice.
    pub fn insert(&mut self, device: &str, version: usize, shape: &str, choice: C) {
        self.choices
            .insert((device.to_string(), version, shape.to_string()), choice);
    }

    /// Reads the file at `path` (absent or unreadable: empty).
    pub fn load(path: &Path) -> Self {
        std::fs::read_to_string(path)
            .map(|t| PlanCache::parse(&t))
            .unwrap_or_default()
    }

    /// Adds `choice` to the file at `path`: reads what is there now (another process may have
    /// added lines), adds it, writes a temporary file and renames it over the old one.
    pub fn store(
        path: &Path,
        device: &str,
        version: usize,
        shape: &str,
        choice: C,
    ) -> std::io::Result<()> {
        let mut cache = PlanCache::load(path);
        cache.insert(device, version, shape, choice);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = temp_name(path);
        std::fs::write(&tmp, cache.render())?;
        std::fs::rename(&tmp, path)
    }
}

/// A name beside `path` that no other process or thread writes at the same time.
fn temp_name(path: &Path) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{}.{n}.tmp", std::process::id()));
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(c_in: usize, input: [usize; 3]) -> DnnConvKey {
        DnnConvKey {
            dtype: DType::BF16,
            layout: DnnLayout::Ndhwc,
            batch: 1,
            c_in,
            c_out: 96,
            input,
            kernel: [3, 3, 3],
            stride: [1, 1, 1],
            pad: [0, 1, 1],
        }
    }

    fn choice(algo: i32, graph: Option<&str>) -> Choice {
        Choice {
            algo,
            math: 1,
            graph: graph.map(str::to_string),
            ms: 1.25,
        }
    }

    #[test]
    fn every_field_of_the_shape_is_in_its_text() {
        let base = key(96, [6, 48, 80]);
        assert_eq!(
            shape_text(&base),
            "bf16 ndhwc b1 c96>96 in6x48x80 k3x3x3 s1x1x1 p0x1x1"
        );
        let variants = [
            DnnConvKey {
                dtype: DType::F32,
                ..base
            },
            DnnConvKey {
                layout: DnnLayout::Ncdhw,
                ..base
            },
            DnnConvKey { batch: 2, ..base },
            DnnConvKey { c_in: 48, ..base },
            DnnConvKey { c_out: 48, ..base },
            DnnConvKey {
                input: [6, 48, 81],
                ..base
            },
            DnnConvKey {
                kernel: [1, 3, 3],
                ..base
            },
            DnnConvKey {
                stride: [1, 2, 2],
                ..base
            },
            DnnConvKey {
                pad: [0, 0, 0],
                ..base
            },
        ];
        let mut seen = std::collections::HashSet::from([shape_text(&base)]);
        for v in &variants {
            assert!(seen.insert(shape_text(v)), "{v:?} collides");
        }
    }

    #[test]
    fn choices_are_keyed_by_device_cudnn_and_shape() {
        let shape = shape_text(&key(96, [6, 48, 80]));
        let mut cache = PlanCache::<Choice>::default();
        cache.insert("NVIDIA H200 sm_90a 132", 91900, &shape, choice(1, None));
        cache.insert(
            "NVIDIA H200 sm_90a 132",
            92100,
            &shape,
            choice(6, Some("eng12_k2=3_k13=0")),
        );
        cache.insert("NVIDIA H100 sm_90a 132", 91900, &shape, choice(7, None));
        let h200 = "NVIDIA H200 sm_90a 132";
        assert_eq!(cache.get(h200, 91900, &shape).unwrap().algo, 1);
        assert_eq!(
            cache.get(h200, 92100, &shape).unwrap().graph.as_deref(),
            Some("eng12_k2=3_k13=0")
        );
        assert_eq!(
            cache
                .get("NVIDIA H100 sm_90a 132", 91900, &shape)
                .unwrap()
                .algo,
            7
        );
        assert!(cache.get(h200, 91800, &shape).is_none());
        assert!(
            cache
                .get(h200, 91900, &shape_text(&key(48, [6, 48, 80])))
                .is_none()
        );
    }

    #[test]
    fn the_file_round_trips_and_bad_lines_are_skipped() {
        let shape = shape_text(&key(96, [6, 48, 80]));
        let mut cache = PlanCache::<Choice>::default();
        cache.insert("gpu a", 91900, &shape, choice(1, Some("eng0")));
        cache.insert("gpu b", 91900, &shape, choice(2, None));
        let text = cache.render();
        assert_eq!(PlanCache::parse(&text), cache);
        let noisy = format!(
            "v0\tgpu a\t91900\t{shape}\t5\t1\t-\t1\nnot a line\n{text}v1\tgpu a\tx\t{shape}\t1\t1\t-\t1\n"
        );
        assert_eq!(PlanCache::parse(&noisy), cache);
    }

    #[test]
    fn a_store_merges_with_what_is_on_disk() {
        let dir = std::env::temp_dir().join(format!("ditstream-plans-{}", std::process::id()));
        let path = dir.join("cudnn-plans.tsv");
        let _ = std::fs::remove_file(&path);
        let (a, b) = (
            shape_text(&key(96, [6, 48, 80])),
            shape_text(&key(48, [6, 48, 80])),
        );
        PlanCache::store(&path, "gpu", 91900, &a, choice(1, None)).unwrap();
        // Another process's line appears meanwhile; the next store keeps it.
        let mut other = PlanCache::<Choice>::load(&path);
        other.insert("other gpu", 90100, &a, choice(3, None));
        std::fs::write(&path, other.render()).unwrap();
        PlanCache::store(&path, "gpu", 91900, &b, choice(2, Some("eng5"))).unwrap();
        let read = PlanCache::<Choice>::load(&path);
        assert_eq!(read.get("gpu", 91900, &a).unwrap().algo, 1);
        assert_eq!(read.get("gpu", 91900, &b).unwrap().algo, 2);
        assert_eq!(read.get("other gpu", 90100, &a).unwrap().algo, 3);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
