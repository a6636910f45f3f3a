//! The reference row gather.

/// `out[n·d..(n+1)·d] = table[ids[n]·d..(ids[n]+1)·d]`; ids are in bounds (checked by the caller).
pub(crate) fn embedding(table: &[f32], d: usize, ids: &[u32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(ids.len() * d);
    for &id in ids {
        let start = id as usize * d;
        out.extend_from_slice(&table[start..start + d]);
    }
    out
}
