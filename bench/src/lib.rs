//! Shared helpers for the benchmark binaries in `bench/src/bin/`: timing statistics and the
//! NCCL-tests bandwidth conventions, so every driver reports numbers the same way.

/// Median of `samples` (mean of the middle two for an even count); `None` when empty.
pub fn median(samples: &[f64]) -> Option<f64> {
    if samples.is_empty() {
        return None;
    }
    let mut v = samples.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    })
}

/// Collective kinds, for the bus-bandwidth factor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    /// all-gather: size = the gathered (output) bytes per rank.
    AllGather,
    /// all-to-all: size = the bytes each rank sends (= receives).
    AllToAll,
    /// all-reduce: size = the buffer bytes per rank.
    AllReduce,
}

/// NCCL-tests convention: bus bandwidth = algorithm bandwidth × factor, with factor
/// (P−1)/P for all-gather and all-to-all and 2(P−1)/P for all-reduce (`P` ranks).
pub fn bus_factor(kind: Collective, p: usize) -> f64 {
    let p = p as f64;
    match kind {
        Collective::AllGather | Collective::AllToAll => (p - 1.0) / p,
        Collective::AllReduce => 2.0 * (p - 1.0) / p,
    }
}

/// Algorithm bandwidth in GB/s (10⁹ bytes per second) of `bytes` moved in `seconds`.
pub fn algbw_gbs(bytes: usize, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn bus_factors_follow_nccl_tests() {
        assert_eq!(bus_factor(Collective::AllGather, 2), 0.5);
        assert_eq!(bus_factor(Collective::AllToAll, 4), 0.75);
        assert_eq!(bus_factor(Collective::AllReduce, 2), 1.0);
        assert_eq!(bus_factor(Collective::AllGather, 1), 0.0);
    }
}
