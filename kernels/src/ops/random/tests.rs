//! The seeded normal draw: on the CPU it is exactly `affine(randn)` (the definition), and (feature
//! `cuda`, on a GPU) the kernel reproduces it.

use super::*;

#[test]
fn cpu_draw_is_affine_of_randn_bit_for_bit() -> Result<()> {
    let shape = [3, 257];
    for dtype in [DType::F32, DType::BF16] {
        let drawn = random_normal(&shape, 1.0, 0.1, dtype, 77, Device::Cpu)?;
        let reference = crate::affine(
            &Tensor::randn(&shape, DType::F32, 77, Device::Cpu)?,
            0.1,
            1.0,
        )?
        .to_dtype(dtype)?;
        assert_eq!(drawn.dtype(), dtype);
        assert_eq!(drawn.to_vec_f32()?, reference.to_vec_f32()?);
    }
    Ok(())
}

/// The kernel against the CPU draw.
///
/// Tolerance: both compute the same f64 Box–Muller from the same 64 bits and the same f32 affine map
/// (the kernel forbids the FMA contraction). They differ only in the f64 `log` and `cos` (CUDA ≤ 1 and
/// ≤ 2 ulp, glibc < 1 ulp): a relative difference ~1e-15 in the f64 sample, which changes its f32
/// rounding only when it lies that close to a rounding midpoint, and then by one f32 ulp (2⁻²³
/// relative); the affine map then moves by at most that ulp times |std| plus one ulp of the result.
/// Hence |gpu − cpu| ≤ 2⁻²⁰·|std| + 2⁻²²·|cpu| (samples |n| < 8), and in bf16 one bf16 ulp (2⁻⁷
/// relative: rtol 1e-2). Almost every element must be bit-identical: at most 1 in 10⁴ may differ.
#[cfg(feature = "cuda")]
#[test]
fn cuda_draw_matches_cpu() -> Result<()> {
    let Some(dev) = crate::testing::test_gpu() else {
        return Ok(());
    };
    let shape = [1000, 1000];
    for (dtype, rtol) in [(DType::F32, 2f32.powi(-22)), (DType::BF16, 1e-2)] {
        for (mean, std) in [(0.0f32, 1.0f32), (1.0, 0.1), (0.0, 0.02)] {
            let cpu = random_normal(&shape, mean, std, dtype, 123, Device::Cpu)?;
            let gpu = random_normal(&shape, mean, std, dtype, 123, dev)?;
            assert_eq!((gpu.device(), gpu.dtype()), (dev, dtype));
            let (g, c) = (gpu.to_vec_f32()?, cpu.to_vec_f32()?);
            let differing = g.iter().zip(&c).filter(|(a, b)| a != b).count();
            let diff = crate::testing::max_abs_diff(&gpu.to_device(Device::Cpu)?, &cpu)?;
            println!(
                "PARITY\trandom_normal\t{dtype:?}\t{shape:?} mean {mean} std {std}\t{diff:.3e}\t{differing} of {} differ",
                c.len()
            );
            crate::testing::assert_close_slices(&g, &c, 2f32.powi(-20) * std, rtol);
            assert!(differing * 10_000 <= c.len(), "{differing} elements differ");
        }
    }
    Ok(())
}
