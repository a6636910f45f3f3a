//! Approximate-equality helpers for tests: max abs / max rel differences and an `allclose`-style assert.
//!
//! Tests here and in the model crates compare tensors through these so that every tolerance is stated
//! the same way: `|actual − expected| ≤ atol + rtol·|expected|` per element (NumPy's `allclose`).
//! Infinities compare equal when both sides hold the same infinity (masked LSE is −∞); NaN never does.

use crate::{KernelError, Result, Tensor};

fn values_of(a: &Tensor, b: &Tensor) -> Result<(Vec<f32>, Vec<f32>)> {
    if a.shape() != b.shape() {
        return Err(KernelError::shape(
            "compare",
            "tensors must have the same shape",
            &[a.shape(), b.shape()],
        ));
    }
    Ok((a.to_vec_f32()?, b.to_vec_f32()?))
}

fn abs_diff(a: f32, b: f32) -> f32 {
    if a == b {
        0.0 // also covers equal infinities, whose difference would be NaN
    } else {
        (a - b).abs()
    }
}

/// max_i |a_i − b_i| (NaN if either side holds NaN). Shapes must match.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let (a, b) = values_of(a, b)?;
    Ok(a.iter().zip(&b).fold(0.0, |worst, (&x, &y)| {
        let d = abs_diff(x, y);
        if d.is_nan() || worst.is_nan() {
            f32::NAN
        } else {
            worst.max(d)
        }
    }))
}

/// max_i |actual_i − expected_i| / |expected_i| over the elements where expected_i ≠ 0 and the values
/// differ. Shapes must match.
pub fn max_rel_diff(actual: &Tensor, expected: &Tensor) -> Result<f32> {
    let (a, e) = values_of(actual, expected)?;
    Ok(a.iter()
        .zip(&e)
        .filter(|&(&x, &y)| y != 0.0 && x != y)
        .map(|(&x, &y)| (x - y).abs() / y.abs())
        .fold(
            0.0,
            |worst, r| if r.is_nan() { f32::NAN } else { worst.max(r) },
        ))
}

/// Panics unless every element satisfies `|actual − expected| ≤ atol + rtol·|expected|`, naming the
/// worst element (index, both values) and the max abs difference. For tests only.
pub fn assert_close(actual: &Tensor, expected: &Tensor, atol: f32, rtol: f32) {
    let (a, e) = match values_of(actual, expected) {
        Ok(values) => values,
        Err(err) => panic!("assert_close: {err}"),
    };
    assert_close_slices(&a, &e, atol, rtol);
}

/// [`assert_close`] on flat slices of equal length.
pub fn assert_close_slices(actual: &[f32], expected: &[f32], atol: f32, rtol: f32) {
    assert_eq!(actual.len(), expected.len(), "assert_close: lengths differ");
    let mut worst: Option<(usize, f32)> = None; // (index, excess over the allowed error)
    for (i, (&x, &y)) in actual.iter().zip(expected).enumerate() {
        let diff = abs_diff(x, y);
        let excess = if diff.is_nan() {
            f32::INFINITY
        } else {
            diff - (atol + rtol * y.abs())
        };
        if excess > 0.0 && worst.is_none_or(|(_, w)| excess > w) {
            worst = Some((i, excess));
        }
    }
    if let Some((i, _)) = worst {
        let max_abs = actual
            .iter()
            .zip(expected)
            .map(|(&x, &y)| abs_diff(x, y))
            .fold(0.0f32, f32::max);
        panic!(
            "assert_close failed (atol {atol}, rtol {rtol}): element {i} is {} vs expected {}; \
             max abs diff {max_abs}",
            actual[i], expected[i]
        );
    }
}

/// The variables by which a GPU script sets a test or benchmark run's CUDA settings: the gate's
/// knobs, as `DITSTREAM_REQUIRE_GPUS` (a deployment sets the same in its config's `cuda:` section;
/// the library reads no environment variable).
#[cfg(feature = "cuda")]
pub const CUDA_SETTINGS_VARS: [&str; 4] = [
    "DITSTREAM_KERNEL_CACHE",
    "DITSTREAM_CUDA_INCLUDE",
    "DITSTREAM_CUDNN_SEARCH",
    "DITSTREAM_GEMM_SEARCH",
];

/// A test or benchmark run's CUDA settings from the variables `env` gives (`None` or empty:
/// unset): the kernel cache folder, the folder holding `cuda_bf16.h`, and the cuDNN and cuBLASLt
/// searches (`find` or `heuristic`; another value is an error naming the variable and the value),
/// each unset one taking [`CudaConfig::resolve`]'s default.
///
/// [`CudaConfig::resolve`]: crate::cuda::CudaConfig::resolve
#[cfg(feature = "cuda")]
pub fn cuda_settings_in(
    env: &dyn Fn(&str) -> Option<std::ffi::OsString>,
) -> Result<crate::cuda::CudaConfig> {
    use crate::cuda::{AlgoSearch, CudaConfig};
    let [cache, include, cudnn, gemm] = CUDA_SETTINGS_VARS;
    let get = |var| env(var).filter(|v| !v.is_empty());
    let search = |var| match get(var) {
        None => Ok(None),
        Some(v) => match v.to_str() {
            Some("find") => Ok(Some(AlgoSearch::Find)),
            Some("heuristic") => Ok(Some(AlgoSearch::Heuristic)),
            _ => Err(KernelError::arg(
                "cuda settings",
                var,
                v.to_string_lossy(),
                "expected `find` (measure each algorithm) or `heuristic` (rank without running)",
            )),
        },
    };
    Ok(CudaConfig::resolve(
        get(cache).map(Into::into),
        get(include).map(Into::into),
        search(cudnn)?,
        search(gemm)?,
    ))
}

/// [`cuda_settings_in`] this process's environment.
#[cfg(feature = "cuda")]
pub fn cuda_settings_from_env() -> Result<crate::cuda::CudaConfig> {
    cuda_settings_in(&|var| std::env::var_os(var))
}

/// Fixes this process's CUDA settings from its environment ([`cuda_settings_from_env`]) unless
/// the same are fixed already: what a GPU test's gate and each benchmark do first.
#[cfg(feature = "cuda")]
pub fn configure_cuda() -> Result<()> {
    crate::cuda::ensure_cuda_config(cuda_settings_from_env()?)
}

/// The GPU a GPU test runs on (`cuda:0`), or `None` when there is none: the test then prints why and
/// returns, unless `DITSTREAM_REQUIRE_GPUS` (set by the `scripts/gpu-*.sh` runs) asks for GPUs, in
/// which case their absence fails the test, so a skip never hides a failure on a GPU machine.
#[cfg(feature = "cuda")]
pub fn test_gpu() -> Option<crate::Device> {
    test_gpus(1).then_some(crate::Device::Cuda(0))
}

/// Whether a test that needs `n` GPUs (`cuda:0..n`) runs: false after printing why when fewer are
/// usable, unless `DITSTREAM_REQUIRE_GPUS` asks for at least `n`, in which case that fails the test.
/// With more required than `n`, the machine must have them all (the script said so). When the test
/// runs, the process's CUDA settings are fixed from the script's variables ([`configure_cuda`]).
#[cfg(feature = "cuda")]
pub fn test_gpus(n: usize) -> bool {
    let required = std::env::var("DITSTREAM_REQUIRE_GPUS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0);
    let n = n.max(1);
    match crate::cuda::cuda_device_count() {
        Ok(found) if found >= n.max(required) => {
            if let Err(e) = configure_cuda() {
                panic!("the GPU run's CUDA settings: {e}");
            }
            true
        }
        outcome => {
            let why = match outcome {
                Ok(found) => format!("{found} CUDA device(s), {n} needed"),
                Err(e) => e.to_string(),
            };
            assert!(
                required < n,
                "DITSTREAM_REQUIRE_GPUS={required} but the GPUs are not usable: {why}"
            );
            eprintln!("skipped: {why}");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The script's variables set what they name; an empty one is unset; a search that is neither
    /// `find` nor `heuristic` is refused with its variable and value.
    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_settings_come_from_the_scripts_variables() {
        use crate::cuda::{AlgoSearch, CudaConfig};
        use std::path::PathBuf;
        let settings = |vars: &[(&str, &str)]| {
            let vars: Vec<(String, std::ffi::OsString)> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.into()))
                .collect();
            cuda_settings_in(&move |name: &str| {
                vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
            })
        };
        let c = settings(&[
            ("DITSTREAM_KERNEL_CACHE", "/tmp/k"),
            ("DITSTREAM_CUDA_INCLUDE", "/pip/include"),
            ("DITSTREAM_CUDNN_SEARCH", "heuristic"),
            ("DITSTREAM_GEMM_SEARCH", "find"),
        ])
        .unwrap();
        assert_eq!(c.cache_dir, PathBuf::from("/tmp/k"));
        assert_eq!(c.include_dir, Some(PathBuf::from("/pip/include")));
        assert_eq!(
            (c.cudnn_search, c.gemm_search),
            (AlgoSearch::Heuristic, AlgoSearch::Find)
        );
        let unset = settings(&[("DITSTREAM_KERNEL_CACHE", "")]).unwrap();
        assert_eq!(unset, CudaConfig::resolve(None, None, None, None));
        let err = settings(&[("DITSTREAM_GEMM_SEARCH", "fastest")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("DITSTREAM_GEMM_SEARCH") && err.contains("fastest"),
            "{err}"
        );
    }

    #[test]
    fn diffs_and_assert() -> Result<()> {
        let a = Tensor::from_vec(vec![1.0, 2.0, f32::NEG_INFINITY], &[3])?;
        let b = Tensor::from_vec(vec![1.0, 2.5, f32::NEG_INFINITY], &[3])?;
        assert_eq!(max_abs_diff(&a, &b)?, 0.5);
        assert_eq!(max_rel_diff(&a, &b)?, 0.2);
        assert_close(&a, &b, 0.5, 0.0);
        assert!(std::panic::catch_unwind(|| assert_close(&a, &b, 0.1, 0.0)).is_err());
        Ok(())
    }
}
