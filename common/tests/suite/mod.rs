//! The collective test suite, generic over [`Communicator`], shared by the CPU run
//! (`collectives_cpu.rs`) and the NCCL run (`collectives_nccl.rs`). Every rank of a group calls
//! [`check_group`]; each rank's inputs are a pure function of (seed, operation, global rank), so
//! every rank can compute every other rank's inputs and checks its outputs against a direct
//! computation. Values are small integers, so sums are exact in every element type and any
//! reduction order gives the same bits.

#![allow(dead_code)]

use std::borrow::{Borrow, BorrowMut};

use ditstream_common::collectives::{
    Communicator, Element, Pending, ReduceOp, UlyssesExt, UlyssesShape,
};
use rand::{Rng, SeedableRng, rngs::StdRng};

/// Elements the suite builds from small integers.
pub trait TestElem: Element {
    fn from_i32(v: i32) -> Self;
}
impl TestElem for f32 {
    fn from_i32(v: i32) -> Self {
        v as f32
    }
}
impl TestElem for f64 {
    fn from_i32(v: i32) -> Self {
        v as f64
    }
}
impl TestElem for half::bf16 {
    fn from_i32(v: i32) -> Self {
        half::bf16::from_f32(v as f32)
    }
}
impl TestElem for half::f16 {
    fn from_i32(v: i32) -> Self {
        half::f16::from_f32(v as f32)
    }
}
impl TestElem for i32 {
    fn from_i32(v: i32) -> Self {
        v
    }
}
impl TestElem for i64 {
    fn from_i32(v: i32) -> Self {
        v as i64
    }
}
impl TestElem for u8 {
    fn from_i32(v: i32) -> Self {
        v as u8
    }
}

/// Rank `global`'s input for operation `op`: `len` integers in 0..20 (signed ones in −10..20).
pub fn input<T: TestElem>(seed: u64, op: u64, global: usize, len: usize) -> Vec<T> {
    let mut rng =
        StdRng::seed_from_u64(seed ^ (op << 32) ^ (global as u64).wrapping_mul(0x9E37_79B9));
    let signed = T::from_i32(-1) < T::from_i32(0);
    (0..len)
        .map(|_| {
            T::from_i32(if signed {
                rng.random_range(-10..20)
            } else {
                rng.random_range(0..20)
            })
        })
        .collect()
}

type Res = Result<(), String>;

fn expect_eq<T: Element>(what: &str, ranks: &[usize], rank: usize, got: &[T], want: &[T]) -> Res {
    if got == want {
        return Ok(());
    }
    let first = got.iter().zip(want).position(|(g, w)| g != w);
    Err(format!(
        "{what} on group {ranks:?}, group rank {rank}: got {} elements, want {}; first difference at {first:?}: got {:?} want {:?}",
        got.len(),
        want.len(),
        first.map(|i| got[i]),
        first.map(|i| want[i]),
    ))
}

fn err<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// Runs every operation on `comm` and checks the results. All ranks of the group call it.
pub fn check_group<C: Communicator>(comm: &C, seed: u64) -> Res {
    all_gather::<C, f32>(comm, seed, 5)?;
    all_gather::<C, half::bf16>(comm, seed, 7)?;
    all_gather::<C, u8>(comm, seed, 3)?;
    all_gather::<C, i32>(comm, seed, 0)?;
    all_gather_v::<C, f32>(comm, seed)?;
    all_gather_v::<C, i64>(comm, seed + 1)?;
    all_to_all::<C, f32>(comm, seed, 4)?;
    all_to_all::<C, half::f16>(comm, seed, 1)?;
    all_to_all_posted::<C, f32>(comm, seed, 3)?;
    all_to_all_posted::<C, half::bf16>(comm, seed, 0)?;
    all_gather_posted::<C, f32>(comm, seed, 5)?;
    all_gather_posted::<C, half::bf16>(comm, seed, 0)?;
    all_to_all_v::<C, f32>(comm, seed)?;
    all_to_all_v::<C, u8>(comm, seed + 1)?;
    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
        all_reduce::<C, f32>(comm, seed, op, 9)?;
        all_reduce::<C, i32>(comm, seed, op, 4)?;
        all_reduce::<C, half::bf16>(comm, seed, op, 6)?;
        reduce_scatter::<C, f32>(comm, seed, op, 3)?;
    }
    all_reduce::<C, f64>(comm, seed, ReduceOp::Sum, 2)?;
    reduce_scatter::<C, half::bf16>(comm, seed, ReduceOp::Sum, 2)?;
    for root in 0..comm.size() {
        broadcast::<C, f32>(comm, seed, root, 6)?;
    }
    broadcast::<C, u8>(comm, seed, comm.size() - 1, 3)?;
    comm.barrier().map_err(err("barrier"))?;
    ring::<C, f32>(comm, seed, 8)?;
    for shape in [
        UlyssesShape::bshd(1, 3, 2 * comm.size(), 4),
        UlyssesShape::bshd(2, 2, comm.size(), 3),
        UlyssesShape::qkv(1, 2, 2 * comm.size(), 2),
        UlyssesShape::qkv(3, 1, comm.size(), 5),
    ] {
        ulysses::<C>(comm, seed, shape)?;
    }
    copy_2d::<C>(comm)?;
    comm.barrier().map_err(err("final barrier"))?;
    Ok(())
}

fn all_gather<C: Communicator, T: TestElem>(comm: &C, seed: u64, n: usize) -> Res {
    let (p, r, ranks) = (comm.size(), comm.rank(), comm.ranks().to_vec());
    let send = comm
        .upload(&input::<T>(seed, 1, ranks[r], n))
        .map_err(err("upload"))?;
    let mut recv = comm.alloc::<T>(p * n).map_err(err("alloc"))?;
    comm.all_gather(send.borrow(), recv.borrow_mut())
        .map_err(err("all_gather"))?;
    let want: Vec<T> = ranks
        .iter()
        .flat_map(|&g| input::<T>(seed, 1, g, n))
        .collect();
    let got = comm.download(recv.borrow()).map_err(err("download"))?;
    expect_eq(
        &format!("all_gather<{:?}>", T::DTYPE),
        &ranks,
        r,
        &got,
        &want,
    )
}

/// Uneven shards: every rank holds `base`, the last holds fewer (a padded sequence's tail).
fn all_gather_v<C: Communicator, T: TestElem>(comm: &C, seed: u64) -> Res {
    let (p, r, ranks) = (comm.size(), comm.rank(), comm.ranks().to_vec());
    for (base, last) in [(5, 2), (3, 0), (1, 4)] {
        let counts: Vec<usize> = (0..p)
            .map(|i| if i + 1 == p { last } else { base })
            .collect();
        let send = comm
            .upload(&input::<T>(seed, 2, ranks[r], counts[r]))
            .map_err(err("upload"))?;
        let mut recv = comm.alloc::<T>(counts.iter().sum()).map_err(err("alloc"))?;
        comm.all_gather_v(send.borrow(), recv.borrow_mut(), &counts)
            .map_err(err("all_gather_v"))?;
        let want: Vec<T> = ranks
            .iter()
            .zip(&counts)
            .flat_map(|(&g, &c)| input::<T>(seed, 2, g, c))
            .collect();
        let got = comm.download(recv.borrow()).map_err(err("download"))?;
        expect_eq(
            &format!("all_gather_v<{:?}> counts {counts:?}", T::DTYPE),
            &ranks,
            r,
            &got,
            &want,
        )?;
    }
    Ok(())
}

fn all_to_all<C: Communicator, T: TestElem>(comm: &C, seed: u64, n: usize) -> Res {
    let (p, r, ranks) = (comm.size(), comm.rank(), comm.ranks().to_vec());
    let send = comm
        .upload(&input::<T>(seed, 3, ranks[r], p * n))
        .map_err(err("upload"))?;
    let mut recv = comm.alloc::<T>(p * n).map_err(err("alloc"))?;
    comm.all_to_all(send.borrow(), recv.borrow_mut())
        .map_err(err("all_to_all"))?;
    // Chunk i of recv = chunk r of rank i's send.
    let want: Vec<T> = ranks
        .iter()
        .flat_map(|&g| input::<T>(seed, 3, g, p * n)[r * n..(r + 1) * n].to_vec())
        .collect();
    let got = comm.download(recv.borrow()).map_err(err("download"))?;
    expect_eq(
        &format!("all_to_all<{:?}>", T::DTYPE),
        &ranks,
        r,
        &got,
        &want,
    )
}

/// Two posted all-to-alls in flight at once, waited in the order posted: each lands in its own
/// buffer, as the blocking one would.
fn all_to_all_posted<C: Communicator, T: TestElem>(comm: &C, seed: u64, n: usize) -> Res {
    let (p, r, ranks) = (comm.size(), comm.rank(), comm.ranks().to_vec());
    let sends = [4u64, 5].map(|op| comm.upload(&input::<T>(seed, op, ranks[r], p * n)));
    let [Ok(send_a), Ok(send_b)] = sends else {
        return Err(format!("upload failed on rank {r}"));
    };
    let mut recv_a = comm.alloc::<T>(p * n).map_err(err("alloc"))?;
    let mut recv_b = comm.alloc::<T>(p * n).map_err(err("alloc"))?;
    let a = comm
        .all_to_all_posted(send_a.borrow(), recv_a.borrow_mut())
        .map_err(err("all_to_all_posted"))?;
    let b = comm
        .all_to_all_posted(send_b.borrow(), recv_b.borrow_mut())
        .map_err(err("all_to_all_posted"))?;
    a.wait().map_err(err("wait"))?;
    b.wait().map_err(err("wait"))?;
    for (op, recv) in [(4u64, &recv_a), (5, &recv_b)] {
        let want: Vec<T> = ranks
            .iter()
            .flat_map(|&g| input::<T>(seed, op, g, p * n)[r * n..(r + 1) * n].to_vec())
            .collect();
        let got = comm.download((*recv).borrow()).map_err(err("download"))?;
        expect_eq(
            &format!("all_to_all_posted<{:?}> #{op}", T::DTYPE),
            &ranks,
            r,
            &got,
            &want,
        )?;
    }
    Ok(())
}

/// A posted all-gather with a posted all-to-all behind it, both in flight, waited in order.
fn all_gather_posted<C: Communicator, T: TestElem>(comm: &C, seed: u64, n: usize) -> Res {
    let (p, r, ranks) = (comm.size(), comm.rank(), comm.ranks().to_vec());
    let send = comm
        .upload(&input::<T>(seed, 6, ranks[r], n))
        .map_err(err("upload"))?;
    let send_b = comm
        .upload(&input::<T>(seed, 7, ranks[r], p * n))
        .map_err(err("upload"))?;
    let mut recv = comm.alloc::<T>(p * n).map_err(err("alloc"))?;
    let mut recv_b = comm.alloc::<T>(p * n).map_err(err("alloc"))?;
    let gather = comm
        .all_gather_posted(send.borrow(), recv.borrow_mut())
        .map_err(err("all_gather_posted"))?;
    let behind = comm
        .all_to_all_posted(send_b.borrow(), recv_b.borrow_mut())
        .map_err(err("all_to_all_posted"))?;
    gather.wait().map_err(err("wait"))?;
    behind.wait().map_err(err("wait"))?;
    let want: Vec<T> = ranks
        .iter()
        .flat_map(|&g| input::<T>(seed, 6, g, n))
        .collect();
    let got = comm.download(recv.borrow()).map_err(err("download"))?;
    expect_eq(
        &format!("all_gather_posted<{:?}>", T::DTYPE),
        &ranks,
        r,
        &got,
        &want,
    )?;
    let want_b: Vec<T> = ranks
        .iter()
        .flat_map(|&g| input::<T>(seed, 7, g, p * n)[r * n..(r + 1) * n].to_vec())
        .collect();
    let got_b = comm.download(recv_b.borrow()).map_err(err("download"))?;
    expect_eq(
        "all_to_all_posted behind a gather",
        &ranks,
        r,
        &got_b,
        &want_b,
    )
}

/// Elements group rank i sends to group rank j (zero for some pairs).
fn a2av_count(i: usize, j: usize) -> usize {
    (i + 2 * j) % 4
}

fn all_to_all_v<C: Communicator, T: TestElem>(comm: &C, seed: u64) -> Res {
    let (p, r, ranks) = (comm.size(), comm.rank(), comm.ranks().to_vec());
    let send_counts: Vec<usize> = (0..p).map(|j| a2av_count(r, j)).collect();
    let recv_counts: Vec<usize> = (0..p).map(|i| a2av_count(i, r)).collect();
    let total = |i: usize| (0..p).map(|j| a2av_count(i, j)).sum::<usize>();
    let send = comm
        .upload(&input::<T>(seed, 4, ranks[r], total(r)))
        .map_err(err("upload"))?;
    let mut recv = comm
        .alloc::<T>(recv_counts.iter().sum())
        .map_err(err("alloc"))?;
    comm.all_to_all_v(send.borrow(), &send_counts, recv.borrow_mut(), &recv_counts)
        .map_err(err("all_to_all_v"))?;
    let want: Vec<T> = (0..p)
        .flat_map(|i| {
            let theirs = input::<T>(seed, 4, ranks[i], total(i));
            let off: usize = (0..r).map(|j| a2av_count(i, j)).sum();
            theirs[off..off + a2av_count(i, r)].to_vec()
        })
        .collect();
    let got = comm.download(recv.borrow()).map_err(err("download"))?;
    expect_eq(
        &format!("all_to_all_v<{:?}>", T::DTYPE),
        &ranks,
        r,
        &got,
        &want,
    )
}

fn reduce_all<T: TestElem>(parts: &[Vec<T>], op: ReduceOp) -> Vec<T> {
    let mut acc = parts[0].clone();
    for part in &parts[1..] {
        for (a, &v) in acc.iter_mut().zip(part) {
            *a = T::combine(*a, v, op);
        }
    }
    acc
}

fn all_reduce<C: Communicator, T: TestElem>(comm: &C, seed: u64, op: ReduceOp, n: usize) -> Res {
    let (r, ranks) = (comm.rank(), comm.ranks().to_vec());
    let mine = input::<T>(seed, 5, ranks[r], n);
    let send = comm.upload(&mine).map_err(err("upload"))?;
    let mut recv = comm.alloc::<T>(n).map_err(err("alloc"))?;
    comm.all_reduce(send.borrow(), recv.borrow_mut(), op)
        .map_err(err("all_reduce"))?;
    let parts: Vec<Vec<T>> = ranks.iter().map(|&g| input::<T>(seed, 5, g, n)).collect();
    let want = reduce_all(&parts, op);
    let got = comm.download(recv.borrow()).map_err(err("download"))?;
    let what = format!("all_reduce<{:?}> {op:?}", T::DTYPE);
    expect_eq(&what, &ranks, r, &got, &want)?;
    let mut inplace = comm.upload(&mine).map_err(err("upload"))?;
    comm.all_reduce_in_place(inplace.borrow_mut(), op)
        .map_err(err("all_reduce_in_place"))?;
    let got = comm.download(inplace.borrow()).map_err(err("download"))?;
    expect_eq(&format!("{what} in place"), &ranks, r, &got, &want)
}

fn reduce_scatter<C: Communicator, T: TestElem>(
    comm: &C,
    seed: u64,
    op: ReduceOp,
    n: usize,
) -> Res {
    let (p, r, ranks) = (comm.size(), comm.rank(), comm.ranks().to_vec());
    let send = comm
        .upload(&input::<T>(seed, 6, ranks[r], p * n))
        .map_err(err("upload"))?;
    let mut recv = comm.alloc::<T>(n).map_err(err("alloc"))?;
    comm.reduce_scatter(send.borrow(), recv.borrow_mut(), op)
        .map_err(err("reduce_scatter"))?;
    let parts: Vec<Vec<T>> = ranks
        .iter()
        .map(|&g| input::<T>(seed, 6, g, p * n)[r * n..(r + 1) * n].to_vec())
        .collect();
    let got = comm.download(recv.borrow()).map_err(err("download"))?;
    expect_eq(
        &format!("reduce_scatter<{:?}> {op:?}", T::DTYPE),
        &ranks,
        r,
        &got,
        &reduce_all(&parts, op),
    )
}

fn broadcast<C: Communicator, T: TestElem>(comm: &C, seed: u64, root: usize, n: usize) -> Res {
    let (r, ranks) = (comm.rank(), comm.ranks().to_vec());
    let mut buf = comm
        .upload(&input::<T>(seed, 7 + root as u64, ranks[r], n))
        .map_err(err("upload"))?;
    comm.broadcast(buf.borrow_mut(), root)
        .map_err(err("broadcast"))?;
    let want = input::<T>(seed, 7 + root as u64, ranks[root], n);
    let got = comm.download(buf.borrow()).map_err(err("download"))?;
    expect_eq(
        &format!("broadcast<{:?}> root {root}", T::DTYPE),
        &ranks,
        r,
        &got,
        &want,
    )
}

/// Ring attention's pattern: P steps of "send to next, receive from previous", each
/// overlapping some local work, the received block forwarded in the next step.
fn ring<C: Communicator, T: TestElem>(comm: &C, seed: u64, n: usize) -> Res {
    let (p, r, ranks) = (comm.size(), comm.rank(), comm.ranks().to_vec());
    let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
    let mut current = comm
        .upload(&input::<T>(seed, 100, ranks[r], n))
        .map_err(err("upload"))?;
    let mut incoming = comm.alloc::<T>(n).map_err(err("alloc"))?;
    for step in 1..=p {
        let pending = comm
            .send_recv(current.borrow(), next, incoming.borrow_mut(), prev)
            .map_err(err("send_recv"))?;
        // "Attention on the current block" happens here, overlapping the transfer.
        let busy: u64 = (0..1000u64).sum();
        std::hint::black_box(busy);
        pending.wait().map_err(err("send_recv wait"))?;
        std::mem::swap(&mut current, &mut incoming);
        // After `step` rotations we hold the block that started `step` ranks behind us.
        let origin = (r + p * step - step) % p;
        let want = input::<T>(seed, 100, ranks[origin], n);
        let got = comm.download(current.borrow()).map_err(err("download"))?;
        expect_eq(&format!("ring step {step}"), &ranks, r, &got, &want)?;
    }
    Ok(())
}

/// The full tensor X[b, t, g, k, d] (t over all S positions, k over all H heads) as unique
/// integers (exact in f32).
fn global_value(
    shape: UlyssesShape,
    p: usize,
    b: usize,
    t: usize,
    g: usize,
    k: usize,
    d: usize,
) -> f32 {
    let s = shape.s_local * p;
    ((((b * s + t) * shape.stack + g) * shape.h + k) * shape.d + d) as f32
}

/// Sequence shard r of X: [B, S/P, G, H, D].
fn seq_shard(shape: UlyssesShape, p: usize, r: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(shape.numel());
    for b in 0..shape.b {
        for t in 0..shape.s_local {
            for g in 0..shape.stack {
                for k in 0..shape.h {
                    for d in 0..shape.d {
                        out.push(global_value(shape, p, b, r * shape.s_local + t, g, k, d));
                    }
                }
            }
        }
    }
    out
}

/// Head group r of X: [B, S, G, H/P, D].
fn head_shard(shape: UlyssesShape, p: usize, r: usize) -> Vec<f32> {
    let hl = shape.h / p;
    let mut out = Vec::with_capacity(shape.numel());
    for b in 0..shape.b {
        for t in 0..shape.s_local * p {
            for g in 0..shape.stack {
                for k in 0..hl {
                    for d in 0..shape.d {
                        out.push(global_value(shape, p, b, t, g, r * hl + k, d));
                    }
                }
            }
        }
    }
    out
}

fn ulysses<C: Communicator>(comm: &C, seed: u64, shape: UlyssesShape) -> Res {
    let _ = seed;
    let (p, r, ranks) = (comm.size(), comm.rank(), comm.ranks().to_vec());
    let what = format!("ulysses {shape:?}");
    let input = comm
        .upload(&seq_shard(shape, p, r))
        .map_err(err("upload"))?;
    let mut heads = comm.alloc::<f32>(shape.numel()).map_err(err("alloc"))?;
    let mut scratch = comm.alloc::<f32>(shape.numel()).map_err(err("alloc"))?;
    comm.seq_to_heads(
        input.borrow(),
        heads.borrow_mut(),
        scratch.borrow_mut(),
        shape,
    )
    .map_err(err("seq_to_heads"))?;
    let got = comm.download(heads.borrow()).map_err(err("download"))?;
    expect_eq(
        &format!("{what} seq_to_heads"),
        &ranks,
        r,
        &got,
        &head_shard(shape, p, r),
    )?;
    let mut back = comm.alloc::<f32>(shape.numel()).map_err(err("alloc"))?;
    comm.heads_to_seq(
        heads.borrow(),
        back.borrow_mut(),
        scratch.borrow_mut(),
        shape,
    )
    .map_err(err("heads_to_seq"))?;
    let got = comm.download(back.borrow()).map_err(err("download"))?;
    expect_eq(
        &format!("{what} heads_to_seq"),
        &ranks,
        r,
        &got,
        &seq_shard(shape, p, r),
    )
}

fn copy_2d<C: Communicator>(comm: &C) -> Res {
    let (r, ranks) = (comm.rank(), comm.ranks().to_vec());
    let src: Vec<i32> = (0..40).collect();
    let src_buf = comm.upload(&src).map_err(err("upload"))?;
    let mut dst = comm.upload(&[-1i32; 30]).map_err(err("upload"))?;
    // 3 rows of 4 from offset 2, pitch 10 → offset 1, pitch 7.
    comm.copy_2d(src_buf.borrow(), 2, 10, dst.borrow_mut(), 1, 7, 4, 3)
        .map_err(err("copy_2d"))?;
    let mut want = vec![-1i32; 30];
    for y in 0..3 {
        for x in 0..4 {
            want[1 + y * 7 + x] = src[2 + y * 10 + x];
        }
    }
    let got = comm.download(dst.borrow()).map_err(err("download"))?;
    expect_eq("copy_2d", &ranks, r, &got, &want)
}

/// The group layouts every backend is tested on, for a world of `n` ranks: the whole world,
/// its reverse (group rank ≠ global rank), singletons, consecutive blocks (Ulysses-like),
/// strided groups (CFG- / column-like) and a partial cover (some ranks in no group).
pub fn group_layouts(n: usize) -> Vec<(String, Vec<Vec<usize>>)> {
    let mut out = vec![
        ("whole".to_string(), vec![(0..n).collect()]),
        ("reversed".to_string(), vec![(0..n).rev().collect()]),
        ("singletons".to_string(), (0..n).map(|r| vec![r]).collect()),
    ];
    for k in 2..n {
        if n.checked_rem(k) == Some(0) {
            out.push((
                format!("consecutive{k}"),
                (0..n / k).map(|b| (b * k..(b + 1) * k).collect()).collect(),
            ));
            out.push((
                format!("strided{k}"),
                (0..k).map(|c| (c..n).step_by(k).collect()).collect(),
            ));
        }
    }
    if n >= 3 {
        out.push(("partial".to_string(), vec![vec![n - 1, 1]]));
    }
    out
}
