//! FP8 attention: the CPU reference of the recipe, and the op that runs it where its tensors
//! live. On a GPU (bf16, head dim 128, sm_90a) the operands are quantised by `quant.cu`'s
//! attention kernels and attended by the FP8 Hopper kernel (`ops/attention/hopper.cu`, namespace
//! `fp8`), which takes the same steps in the same order: `fp8_attention_matches_cpu` in
//! `kernels/tests/cuda_parity.rs` holds it to this reference.
//!
//! The recipe (FlashAttention-3's FP8 forward, with block scales for Q and K as SageAttention
//! keeps them):
//! - Q and K in e4m3 with one scale per (sample, head, block of [`BLOCK`] tokens): s = max|block|
//!   / 448, as the linears' rows (`super`), so each block spans the format's range;
//! - V in e4m3 with one scale per (sample, head, channel) over the valid keys, which folds into
//!   the output (out[:, d] = (Σⱼ P·q_v[j, d])·s_v[d]);
//! - S = (q_Q·q_Kᵀ)·s_q·s_k·scale summed in f32; the softmax online over key blocks of [`STEP`]
//!   (the GPU kernel's K/V block), in f32, as a flash kernel runs it, with p = exp(S − m) at an
//!   exponent offset m that moves only when a block's row max passes it, and then to that max +
//!   [`HEADROOM`]·ln 2 (the accumulator and the row sum l rescaled by exp(m_old − m)). So p ≤ 1
//!   always, and the GPU kernel may take a block's exponentials before its row max (hopper.cu's
//!   `spec_softmax`), a bet that the max has not passed the offset which the headroom makes good;
//! - P·V on e4m3 operands: p scaled by 448 (so p ∈ [0, 1] uses the format's whole range) and
//!   rounded, the products summed in f32 (the GPU kernel's tensor cores sum at most three blocks,
//!   384 keys, before it adds them into an f32 accumulator); l sums the same rounded weights (the
//!   GPU kernel adds them in its P·V GEMM, against a column of ones), so out = acc·s_v / (448·l),
//!   rounded once to q's dtype, is a weighted mean of V with weights that sum to one;
//! - lse = m + ln l over the valid keys (natural log, with the scale), as the bf16 kernel
//!   returns it, so Ring and Attention2D merge FP8 partials the same way;
//! - on a GPU, the tiles of a sparse last wave may take their keys in a few runs, each the above
//!   from scratch, merged by their LSEs in f32 ([`KeySplit`]; the reference takes the same runs).

use super::cpu::{e4m3, rcp};
use super::{E4M3_MAX, same_device};
use crate::{AttentionOptions, DType, Device, KernelError, Result, Tensor};

/// Tokens per Q and K scale block: the Hopper kernel's query tile.
pub const BLOCK: usize = 128;

/// How far above a row's new max the softmax's exponent offset moves, in log2 units (a factor 16):
/// the GPU kernel's `HEADROOM` (`ops/attention/hopper.cu`). The largest weight of a block is then
/// ≥ 448/16 = 28 in e4m3, well inside the format's normal range.
pub const HEADROOM: f32 = 4.0;

/// Keys per online-softmax step: the K/V block of the GPU's FP8 kernels
/// (`crate::cuda::HOPPER_FP8_KEYS`). The running max moves once per step and sets the scale at
/// which each p rounds to e4m3, so the reference takes the kernel's steps: then only the summation
/// order separates the two.
pub const STEP: usize = 128;

/// How a call's query tiles take their keys: the tiles of [`BLOCK`] query rows, numbered q-tile +
/// ⌈S_q / BLOCK⌉·(head + H·sample), from `first` on take the n = ⌈kv_len / BLOCK⌉ blocks of
/// [`BLOCK`] keys in `ways` runs, run c the blocks [c·n / ways, (c + 1)·n / ways), each its own
/// online softmax from scratch; the runs' rows merge by their LSEs, out = Σ_c w_c·out_c with w_c =
/// e^(lse_c − max) / Σ e^(lse − max), lse = max + ln Σ e^(lse − max), in f32. The GPU kernel splits
/// a sparse last wave so, as the bf16 one does, to fill the SMs (`crate::cuda::fp8_attention_split`
/// says how for a call); [`KeySplit::NONE`] takes every tile's keys in one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeySplit {
    /// The first tile split.
    pub first: usize,
    /// Runs per split tile (1: none split).
    pub ways: usize,
}

impl KeySplit {
    /// Every tile's keys in one run.
    pub const NONE: KeySplit = KeySplit {
        first: usize::MAX,
        ways: 1,
    };
}

/// FP8 scaled-dot-product attention by the recipe of the module docs: q [B, S_q, H, D], k and v
/// [B, S_k, H, D] (f32 or bf16, one dtype) → out [B, S_q, H, D] in q's dtype and lse [B, H, S_q]
/// (f32), as [`crate::attention`] returns them. On a GPU it takes bf16 at head dim 128 with a
/// scale > 0 on sm_90a, and refuses anything else with an error naming the rule.
pub fn attention_fp8(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    options: AttentionOptions,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "attention_fp8";
    let (dims, args) = check(OP, (q, k, v), options)?;
    match same_device(OP, &[q, k, v])? {
        Device::Cpu => reference(OP, (q, k, v), dims, args, (STEP, KeySplit::NONE)),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => super::cuda::attention(OP, (q, k, v), dims, args.0, args.1),
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => Err(KernelError::UnsupportedDevice { op: OP, device }),
    }
}

/// The CPU recipe of [`attention_fp8`] with online-softmax steps of `step` keys (≥ 1) and the
/// tiles' keys taken in the runs of `split`: the reference the GPU kernel is held to at its K/V
/// block of 128 keys and its launch's split (any other step works too, and K's scale blocks stay
/// 128 tokens, which a step may straddle; a step restarts at each run; `split.ways` is at least
/// 1 and at most the key blocks). Takes [`attention_fp8`]'s arguments (tensors anywhere, read on
/// the host) and checks them the same.
pub fn attention_fp8_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    options: AttentionOptions,
    step: usize,
    split: KeySplit,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "attention_fp8_reference";
    if step == 0 {
        return Err(KernelError::arg(OP, "step", step, "it must be at least 1"));
    }
    if split.ways == 0 {
        return Err(KernelError::arg(
            OP,
            "split.ways",
            split.ways,
            "it must be at least 1",
        ));
    }
    let (dims, args) = check(OP, (q, k, v), options)?;
    // A run without keys has no softmax to merge: every run holds at least one block.
    let blocks = args.1.div_ceil(BLOCK);
    if split.ways > 1 && blocks > 0 && split.ways > blocks {
        return Err(KernelError::arg(
            OP,
            "split.ways",
            split.ways,
            format!(
                "it must be at most the {blocks} blocks of {BLOCK} keys that kv_len = {} makes",
                args.1
            ),
        ));
    }
    reference(OP, (q, k, v), dims, args, (step, split))
}

/// The shapes' rule → ([B, S_q, S_k, H, D], (scale, kv_len)).
fn check(
    op: &'static str,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    options: AttentionOptions,
) -> Result<([usize; 5], (f32, usize))> {
    let (qs, ks) = (q.shape(), k.shape());
    let ok = qs.len() == 4 && ks.len() == 4 && ks[0] == qs[0] && ks[2..] == qs[2..];
    if !ok || v.shape() != ks {
        return Err(KernelError::shape(
            op,
            "q [B, S_q, H, D], k and v [B, S_k, H, D]",
            &[qs, ks, v.shape()],
        ));
    }
    let [b, sq, h, d] = [qs[0], qs[1], qs[2], qs[3]];
    let sk = ks[1];
    let kv_len = options.kv_len.unwrap_or(sk);
    if kv_len > sk {
        return Err(KernelError::arg(
            op,
            "kv_len",
            kv_len,
            format!("it must be at most S_k = {sk}"),
        ));
    }
    let scale = options.scale.unwrap_or(1.0 / (d as f32).sqrt());
    Ok(([b, sq, sk, h, d], (scale, kv_len)))
}

/// The recipe on the host, over checked arguments.
fn reference(
    op: &'static str,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    [b, sq, sk, h, d]: [usize; 5],
    (scale, kv_len): (f32, usize),
    (step, split): (usize, KeySplit),
) -> Result<(Tensor, Tensor)> {
    let qs = q.shape();
    let (tiles_x, blocks) = (sq.div_ceil(BLOCK), kv_len.div_ceil(BLOCK));
    let (qv, kv, vv) = (q.cpu_f32(op)?, k.cpu_f32(op)?, v.cpu_f32(op)?);
    let at = |s: usize, bi: usize, t: usize, hi: usize| ((bi * s + t) * h + hi) * d;
    let mut out = vec![0f32; b * sq * h * d];
    let mut lse = vec![f32::NEG_INFINITY; b * h * sq];
    for bi in 0..b {
        for hi in 0..h {
            // Quantised Q and K (values, unscaled) and their block scales; V per channel.
            let rows = |x: &[f32], s: usize, n: usize| -> (Vec<Vec<f32>>, Vec<f32>) {
                let mut codes = Vec::with_capacity(n);
                let mut scales = Vec::new();
                for start in (0..n).step_by(BLOCK) {
                    let block = start..(start + BLOCK).min(n);
                    let amax = block.clone().fold(0f32, |m, t| {
                        x[at(s, bi, t, hi)..][..d]
                            .iter()
                            .fold(m, |m, v| m.max(v.abs()))
                    });
                    let sc = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
                    scales.push(sc);
                    let r = rcp(sc);
                    for t in block {
                        codes.push(
                            x[at(s, bi, t, hi)..][..d]
                                .iter()
                                .map(|v| e4m3(v * r))
                                .collect(),
                        );
                    }
                }
                (codes, scales)
            };
            let (q8, q_scales) = rows(&qv, sq, sq);
            let (k8, k_scales) = rows(&kv, sk, kv_len);
            let v_scales: Vec<f32> = (0..d)
                .map(|c| {
                    let amax =
                        (0..kv_len).fold(0f32, |m, t| m.max(vv[at(sk, bi, t, hi) + c].abs()));
                    if amax > 0.0 { amax / E4M3_MAX } else { 1.0 }
                })
                .collect();
            let v_rcp: Vec<f32> = v_scales.iter().map(|&s| rcp(s)).collect();
            let v8: Vec<Vec<f32>> = (0..kv_len)
                .map(|t| {
                    (0..d)
                        .map(|c| e4m3(vv[at(sk, bi, t, hi) + c] * v_rcp[c]))
                        .collect()
                })
                .collect();
            for i in 0..sq {
                let sqk = q_scales[i / BLOCK];
                // The online softmax over `keys` → (acc, m, l).
                let run = |keys: std::ops::Range<usize>| {
                    let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
                    let mut acc = vec![0f32; d];
                    for start in keys.clone().step_by(step) {
                        let keys = start..(start + step).min(keys.end);
                        let s_ij: Vec<f32> = keys
                            .clone()
                            .map(|j| {
                                let dot: f32 = q8[i].iter().zip(&k8[j]).map(|(a, c)| a * c).sum();
                                dot * (sqk * k_scales[j / BLOCK]) * scale
                            })
                            .collect();
                        let block_max = s_ij.iter().fold(f32::NEG_INFINITY, |a, &s| a.max(s));
                        let m_new = if block_max > m {
                            block_max + HEADROOM * std::f32::consts::LN_2
                        } else {
                            m
                        };
                        let alpha = (m - m_new).exp(); // 0 on the first block (m = −∞), 1 if m stays
                        l *= alpha;
                        acc.iter_mut().for_each(|a| *a *= alpha);
                        for (j, &s) in keys.zip(&s_ij) {
                            let p8 = e4m3((s - m_new).exp() * E4M3_MAX);
                            l += p8 / E4M3_MAX;
                            for (a, vq) in acc.iter_mut().zip(&v8[j]) {
                                *a += p8 * vq;
                            }
                        }
                        m = m_new;
                    }
                    (acc, m, l)
                };
                if kv_len == 0 {
                    continue;
                }
                let tile = i / BLOCK + tiles_x * (hi + h * bi);
                let ways = if tile >= split.first { split.ways } else { 1 };
                // Each run's normalised rows and LSE, then their merge (one run: as it is).
                let runs: Vec<(Vec<f32>, f32)> = (0..ways)
                    .map(|c| {
                        let (first, end) = (c * blocks / ways, (c + 1) * blocks / ways);
                        let (acc, m, l) = run(first * BLOCK..(end * BLOCK).min(kv_len));
                        let o = acc
                            .iter()
                            .zip(&v_scales)
                            .map(|(a, sv)| a * sv / (E4M3_MAX * l))
                            .collect();
                        (o, m + l.ln())
                    })
                    .collect();
                let o = &mut out[at(sq, bi, i, hi)..][..d];
                let row_lse = &mut lse[(bi * h + hi) * sq + i];
                if let [(run, run_lse)] = &runs[..] {
                    o.copy_from_slice(run);
                    *row_lse = *run_lse;
                } else {
                    let mx = runs.iter().fold(f32::NEG_INFINITY, |a, r| a.max(r.1));
                    let wsum: f32 = runs.iter().map(|r| (r.1 - mx).exp()).sum();
                    o.fill(0.0);
                    for (run, run_lse) in &runs {
                        let w = (run_lse - mx).exp() / wsum;
                        for (o, x) in o.iter_mut().zip(run) {
                            *o += w * x;
                        }
                    }
                    *row_lse = mx + wsum.ln();
                }
            }
        }
    }
    Ok((
        Tensor::from_f32_cpu(out, qs, q.dtype())?,
        Tensor::from_f32_cpu(lse, &[b, h, sq], DType::F32)?,
    ))
}
