//! The biased, masked softmax against an f64 formula and hand cases, its checks, and (feature `cuda`,
//! on a GPU) its CUDA twin against the CPU.
//!
//! CPU vs f64: the f32 path rounds v (one add each for bias + mask and logit), exp (< 1 ulp), a sum of
//! S_k positive terms (relative error ≤ (S_k − 1)·u, u = 2⁻²⁴) and a division: relative error
//! ≤ (S_k + 8)·u ≈ 4.3e-6 at S_k = 64 for weights; the rounding of v by |v|·u also moves exp by |v|·u
//! relative, |v| ≤ ~6 here. Hence rtol 1e-5 and atol 1e-7 for the weights near zero.

use super::*;
use crate::testing::assert_close_slices;
use crate::{DType, Device};

/// Seeded small test case: (logits [B, H, S_q, S_k], table [NB, H], buckets, valid_lens).
fn case(
    [b, h, sq, sk]: [usize; 4],
    nb: usize,
    lens: &[u32],
    dtype: DType,
    device: Device,
) -> Result<(Tensor, Tensor, Indices, Indices, Vec<u32>)> {
    let logits = Tensor::randn(&[b, h, sq, sk], dtype, 41, Device::Cpu)?.to_device(device)?;
    let table = Tensor::randn(&[nb, h], dtype, 42, Device::Cpu)?.to_device(device)?;
    let buckets: Vec<u32> = (0..sq + sk - 1)
        .map(|i| ((i * 2654435761) % nb) as u32)
        .collect();
    let bucket_idx = Indices::new(&buckets, nb, "bucket", device)?;
    let lens_idx = Indices::new(lens, sk + 1, "valid length", device)?;
    Ok((logits, table, bucket_idx, lens_idx, buckets))
}

#[test]
fn matches_an_f64_formula_and_masks_keys() -> Result<()> {
    let (b, h, sq, sk, nb) = (2, 3, 5, 64, 7);
    let lens = [64, 9];
    let (logits, table, bidx, lidx, buckets) =
        case([b, h, sq, sk], nb, &lens, DType::F32, Device::Cpu)?;
    let out = position_bias_softmax(&logits, &table, &bidx, &lidx)?;
    assert_eq!(out.shape(), [b, h, sq, sk]);
    let (x, t) = (logits.to_vec_f32()?, table.to_vec_f32()?);
    let mut expect = vec![0.0f32; x.len()];
    for (bi, &valid) in lens.iter().enumerate() {
        let valid = valid as usize;
        for hi in 0..h {
            for qi in 0..sq {
                let row = ((bi * h + hi) * sq + qi) * sk;
                let v: Vec<f64> = (0..valid)
                    .map(|k| {
                        let bucket = buckets[k + sq - 1 - qi] as usize;
                        f64::from(x[row + k]) + f64::from(t[bucket * h + hi])
                    })
                    .collect();
                let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = v.iter().map(|a| (a - max).exp()).sum();
                for (k, a) in v.iter().enumerate() {
                    expect[row + k] = ((a - max).exp() / sum) as f32;
                }
            }
        }
    }
    let got = out.to_vec_f32()?;
    assert_close_slices(&got, &expect, 1e-7, 1e-5);
    // Masked keys (batch 1, keys ≥ 9) are exactly zero, and each row sums to 1.
    let row = &got[(h * sq) * sk..][..sk];
    assert!(row[9..].iter().all(|&p| p == 0.0));
    assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    Ok(())
}

#[test]
fn hand_case_bias_by_relative_position() -> Result<()> {
    // One head, S_q = 2, S_k = 2, zero logits; buckets by r = k − q: r = −1 → 0, 0 → 1, 1 → 2; table
    // [0, ln 3, 0]: row q = 0 sees biases (ln 3, 0) → (3/4, 1/4); row q = 1 sees (0, ln 3) → (1/4, 3/4).
    let logits = Tensor::zeros(&[1, 1, 2, 2], DType::F32, Device::Cpu)?;
    let table = Tensor::from_vec(vec![0.0, 3f32.ln(), 0.0], &[3, 1])?;
    let buckets = Indices::new(&[0, 1, 2], 3, "bucket", Device::Cpu)?;
    let lens = Indices::new(&[2], 3, "valid length", Device::Cpu)?;
    let out = position_bias_softmax(&logits, &table, &buckets, &lens)?.to_vec_f32()?;
    assert_close_slices(&out, &[0.75, 0.25, 0.25, 0.75], 1e-7, 1e-6);
    // No valid key at all: every logit is f32::MIN after the mask, so the row is uniform (as in
    // transformers, whose mask value this is).
    let none = Indices::new(&[0], 3, "valid length", Device::Cpu)?;
    let out = position_bias_softmax(&logits, &table, &buckets, &none)?.to_vec_f32()?;
    assert_eq!(out, [0.5, 0.5, 0.5, 0.5]);
    Ok(())
}

#[test]
fn bad_shapes_and_indices_are_refused() -> Result<()> {
    let (logits, table, buckets, lens, _) =
        case([2, 3, 4, 6], 5, &[6, 2], DType::F32, Device::Cpu)?;
    assert!(position_bias_softmax(&logits, &table, &buckets, &lens).is_ok());
    // Table with the wrong head count.
    let t4 = Tensor::zeros(&[5, 4], DType::F32, Device::Cpu)?;
    assert!(position_bias_softmax(&logits, &t4, &buckets, &lens).is_err());
    // Buckets: wrong count, or checked against more buckets than the table has.
    let short = Indices::new(&[0; 8], 5, "bucket", Device::Cpu)?;
    let msg = position_bias_softmax(&logits, &table, &short, &lens)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("buckets") && msg.contains("S_q + S_k − 1 = 9"),
        "{msg}"
    );
    let wide = Indices::new(&[0; 9], 6, "bucket", Device::Cpu)?;
    assert!(position_bias_softmax(&logits, &table, &wide, &lens).is_err());
    // valid_lens: one per batch row, each ≤ S_k.
    let one = Indices::new(&[6], 7, "valid length", Device::Cpu)?;
    assert!(position_bias_softmax(&logits, &table, &buckets, &one).is_err());
    assert!(Indices::new(&[7, 1], 7, "valid length", Device::Cpu).is_err());
    // Logits that are not [B, H, S_q, S_k].
    let flat = logits.reshape(&[6, 4, 6])?;
    assert!(position_bias_softmax(&flat, &table, &buckets, &lens).is_err());
    Ok(())
}

/// The CUDA softmax against the CPU twin on the same stored inputs.
///
/// Tolerance: both read the same values and do the same f32 operations per element in the same order
/// (v = logit + (bias + mask), so v and the row max agree bit for bit; exp(v − max); division by the
/// sum). They differ in `expf` (GPU ≤ 2 ulp, CPU < 1 ulp: each exp within 6u of the other, u = 2⁻²⁴),
/// so the sums of S_k positive terms differ by ≤ 6u from that plus the summation order (each side
/// within (S_k − 1)·u of its exact sum), and each division rounds once: relative to the weight p,
/// |gpu − cpu| ≤ (6 + 6 + 2(S_k − 1) + 2)·u ≤ (2·S_k + 16)·u. atol 1e-12 only covers weights in the
/// subnormal range. bf16 outputs: two f32 values that close round to the same or neighbouring bf16,
/// at most one bf16 ulp = 2⁻⁷ of the value apart: rtol 1e-2.
#[cfg(feature = "cuda")]
#[test]
fn cuda_matches_cpu() -> Result<()> {
    let Some(dev) = crate::testing::test_gpu() else {
        return Ok(());
    };
    let u = 2f32.powi(-24);
    // Odd sizes (rows not a multiple of the block's 8 warps, S_k not of 32), Wan's 512 × 512, a row
    // with no valid key (uniform), T5's 32 buckets.
    let cases: [([usize; 4], &[u32]); 3] = [
        ([2, 3, 77, 77], &[77, 20]),
        ([2, 2, 512, 512], &[512, 126]),
        ([3, 1, 5, 40], &[0, 1, 40]),
    ];
    for (shape, lens) in cases {
        for (dtype, table_dtype) in [
            (DType::F32, DType::F32),
            (DType::BF16, DType::BF16),
            (DType::BF16, DType::F32),
        ] {
            let (logits, table, buckets, valid, _) = case(shape, 32, lens, dtype, Device::Cpu)?;
            let table = table.to_dtype(table_dtype)?;
            let cpu = position_bias_softmax(&logits, &table, &buckets, &valid)?;
            let (gl, gt) = (logits.to_device(dev)?, table.to_device(dev)?);
            let gb = Indices::new(&buckets.to_vec()?, buckets.bound(), "bucket", dev)?;
            let gv = Indices::new(&valid.to_vec()?, valid.bound(), "valid length", dev)?;
            let gpu = position_bias_softmax(&gl, &gt, &gb, &gv)?;
            assert_eq!((gpu.device(), gpu.dtype()), (dev, dtype));
            let rtol = match dtype {
                DType::F32 => (2 * shape[3] + 16) as f32 * u,
                DType::BF16 => 1e-2,
            };
            let (g, c) = (gpu.to_vec_f32()?, cpu.to_vec_f32()?);
            let diff = crate::testing::max_abs_diff(&gpu.to_device(Device::Cpu)?, &cpu)?;
            println!(
                "PARITY\tposition_bias_softmax\t{dtype:?}/{table_dtype:?}\t{shape:?}\t{diff:.3e}\tatol 1e-12 rtol {rtol:.1e}"
            );
            assert_close_slices(&g, &c, 1e-12, rtol);
        }
    }
    Ok(())
}
