//! The row gather against hand cases, its bound checks, and (feature `cuda`, on a GPU) its CUDA twin
//! against the CPU. A gather copies stored values, so every comparison is exact (tolerance 0).

use super::*;
use crate::{DType, Device};

#[test]
fn gathers_rows_in_order_with_repeats() -> Result<()> {
    // table [4, 3]: row r holds r·10 + c.
    let table = Tensor::from_vec(
        (0..12).map(|i| (i / 3 * 10 + i % 3) as f32).collect(),
        &[4, 3],
    )?;
    let ids = Indices::new(&[3, 0, 3, 1], 4, "token id", Device::Cpu)?;
    let out = embedding(&table, &ids)?;
    assert_eq!(out.shape(), [4, 3]);
    assert_eq!(
        out.to_vec_f32()?,
        [30., 31., 32., 0., 1., 2., 30., 31., 32., 10., 11., 12.]
    );
    // bf16 stays bf16, bit for bit.
    let t16 = table.to_dtype(DType::BF16)?;
    let out16 = embedding(&t16, &ids)?;
    assert_eq!(out16.dtype(), DType::BF16);
    assert_eq!(out16.to_vec_f32()?, out.to_vec_f32()?);
    // No ids: an empty [0, D].
    let none = Indices::new(&[], 4, "token id", Device::Cpu)?;
    assert_eq!(embedding(&table, &none)?.shape(), [0, 3]);
    Ok(())
}

#[test]
fn out_of_range_ids_are_refused_with_the_value() -> Result<()> {
    let e = Indices::new(&[1, 7], 4, "token id", Device::Cpu).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("token id 7 at position 1") && msg.contains("< 4"),
        "{msg}"
    );
    // Indices checked against a larger table than the one they address.
    let table = Tensor::zeros(&[4, 3], DType::F32, Device::Cpu)?;
    let ids = Indices::new(&[5], 6, "token id", Device::Cpu)?;
    assert!(embedding(&table, &ids).is_err());
    // A table that is not [V, D].
    let flat = Tensor::zeros(&[12], DType::F32, Device::Cpu)?;
    let ok = Indices::new(&[1], 4, "token id", Device::Cpu)?;
    assert!(embedding(&flat, &ok).is_err());
    Ok(())
}

/// The CUDA gather equals the CPU one exactly, in f32 and bf16, and device indices come back intact.
#[cfg(feature = "cuda")]
#[test]
fn cuda_gather_matches_cpu_exactly() -> Result<()> {
    let Some(dev) = crate::testing::test_gpu() else {
        return Ok(());
    };
    let (rows, d) = (1000, 96);
    let values: Vec<u32> = (0..257u32).map(|i| (i * 7919 + 13) % rows as u32).collect();
    let host_ids = Indices::new(&values, rows, "token id", Device::Cpu)?;
    let dev_ids = Indices::new(&values, rows, "token id", dev)?;
    assert_eq!(dev_ids.device(), dev);
    assert_eq!(dev_ids.to_vec()?, values);
    for dtype in [DType::F32, DType::BF16] {
        let table = Tensor::randn(&[rows, d], dtype, 5, Device::Cpu)?;
        let cpu = embedding(&table, &host_ids)?;
        let gpu = embedding(&table.to_device(dev)?, &dev_ids)?;
        assert_eq!((gpu.device(), gpu.dtype()), (dev, dtype));
        let diff = crate::testing::max_abs_diff(&gpu.to_device(Device::Cpu)?, &cpu)?;
        println!(
            "PARITY\tembedding\t{dtype:?}\t{:?}\t{diff:.3e}\texact",
            cpu.shape()
        );
        assert_eq!(gpu.to_vec_f32()?, cpu.to_vec_f32()?);
    }
    // Host indices against a device table: a device mismatch, not a silent copy.
    let table = Tensor::zeros(&[rows, d], DType::F32, dev)?;
    assert!(embedding(&table, &host_ids).is_err());
    Ok(())
}
