//! Row gather by index: the token-embedding lookup (`nn.Embedding`), and [`Indices`], the integer
//! index lists the gathering ops take.

pub(crate) mod cpu;
#[cfg(feature = "cuda")]
pub(super) mod cuda;
mod indices;
#[cfg(test)]
mod tests;

pub use indices::Indices;

use super::expect_rank;
#[cfg(not(feature = "cuda"))]
use super::unsupported;
use crate::{Device, KernelError, Result, Tensor};

/// Rows of `table` picked by `ids`: table [V, D], ids `[N]` (each < V, on the table's device) →
/// [N, D] in the table's dtype, `out[n] = table[ids[n]]`. A copy: exact in either dtype.
pub fn embedding(table: &Tensor, ids: &Indices) -> Result<Tensor> {
    const OP: &str = "embedding";
    expect_rank(OP, "table [V, D], ids [N]", table, 2)?;
    let (rows, d) = (table.shape()[0], table.shape()[1]);
    if ids.bound() > rows {
        return Err(KernelError::arg(
            OP,
            "ids",
            format!("indices checked against {}", ids.bound()),
            format!("they must be checked against the table's {rows} rows (or fewer)"),
        ));
    }
    if ids.device() != table.device() {
        return Err(KernelError::DeviceMismatch {
            op: OP,
            first: table.device(),
            other: ids.device(),
        });
    }
    let out_shape = [ids.len(), d];
    match table.device() {
        Device::Cpu => {
            let out = cpu::embedding(&table.cpu_f32(OP)?, d, ids.cpu(OP)?);
            Tensor::from_f32_cpu(out, &out_shape, table.dtype())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::embedding(OP, table, ids, &out_shape),
        #[cfg(not(feature = "cuda"))]
        device @ Device::Cuda(_) => unsupported(OP, device),
    }
}
