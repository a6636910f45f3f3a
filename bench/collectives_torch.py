#!/usr/bin/env python3
"""Reference for bench/src/bin/collectives.rs: the same collectives with torch.distributed (NCCL),
same sizes, same timing method, one process per GPU spawned with torch.multiprocessing (no torchrun).

Per iteration: barrier + synchronize, then host wall-clock around the call and a synchronize; the
slowest rank counts; the median over --iters after --warmup. Bandwidths follow NCCL-tests
(busbw = algbw*(P-1)/P for all-gather / all-to-all / Ulysses, *2(P-1)/P for all-reduce).
Prints a table and `RESULT<TAB>torch<TAB>op<TAB>P<TAB>bytes<TAB>median_ms<TAB>algbw<TAB>busbw` lines.

    /opt/torch/.venv/bin/python bench/collectives_torch.py [--size-mib 256] [--iters 20] [--gpus N]
"""

import argparse
import os
import socket
import statistics
import time

# NVLink multicast can take the host's GPUs out of service (GPU.md): keep it off in every process.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def ulysses_heads(p):
    return 40 if 40 % p == 0 else 8 * p


def time_op(args, rank, op):
    for _ in range(args.warmup):
        dist.barrier(device_ids=[rank])
        op()
    torch.cuda.synchronize()
    samples = []
    for _ in range(args.iters):
        dist.barrier(device_ids=[rank])
        torch.cuda.synchronize()
        t = time.perf_counter()
        op()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t)
    # Slowest rank per iteration.
    s = torch.tensor(samples, dtype=torch.float64, device=f"cuda:{rank}")
    dist.all_reduce(s, op=dist.ReduceOp.MAX)
    return s.cpu().tolist()


def worker(rank, p, port, args, queue):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=p, device_id=dev)
    el = 2
    elems = (args.size_mib << 20) // el // p * p
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)
    rand = lambda *shape: (torch.rand(*shape, generator=gen, device=dev, dtype=torch.float32) * 2 - 1).to(torch.bfloat16)
    results = []

    per = elems // p
    send, recv = rand(per), torch.empty(per * p, device=dev, dtype=torch.bfloat16)
    results.append(("all_gather", "ag", per * p * el, time_op(args, rank, lambda: dist.all_gather_into_tensor(recv, send))))
    del send, recv

    send, recv = rand(elems), torch.empty(elems, device=dev, dtype=torch.bfloat16)
    results.append(("all_to_all", "a2a", elems * el, time_op(args, rank, lambda: dist.all_to_all_single(recv, send))))
    del send, recv

    h, d = ulysses_heads(p), 128
    hl = h // p
    s = elems // (3 * h * d)
    x = rand(1, s, 3, h, d)
    out = torch.empty(p, 1, s, 3, hl, d, device=dev, dtype=torch.bfloat16)

    def qkv():
        # [1, s, 3, H, D] -> pack [P, 1, s, 3, H/P, D] -> all-to-all -> [P*s, 3, H/P, D] (B = 1: no unpack)
        packed = x.view(1, s, 3, p, hl, d).permute(3, 0, 1, 2, 4, 5).contiguous()
        dist.all_to_all_single(out, packed)
        return out.view(1, p * s, 3, hl, d)

    results.append(("ulysses_qkv_seq_to_heads", "a2a", x.numel() * el, time_op(args, rank, qkv)))
    del x, out

    s = elems // (h * d)
    y = rand(1, p * s, hl, d)  # [1, S, H/P, D] is already P packed chunks of [s, H/P, D]
    recv = torch.empty(p, s, hl, d, device=dev, dtype=torch.bfloat16)

    def bshd():
        dist.all_to_all_single(recv, y)
        return recv.permute(1, 0, 2, 3).contiguous().view(1, s, h, d)  # unpack

    results.append(("ulysses_bshd_heads_to_seq", "a2a", y.numel() * el, time_op(args, rank, bshd)))
    del y, recv

    buf = rand(elems)
    results.append(("all_reduce", "ar", elems * el, time_op(args, rank, lambda: dist.all_reduce(buf))))
    del buf

    if rank == 0:
        queue.put((torch.cuda.get_device_name(rank), torch.cuda.nccl.version(), results))
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--gpus", type=int, default=None)
    args = ap.parse_args()
    p = args.gpus or torch.cuda.device_count()
    assert p >= 1, "no GPUs visible"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(worker, args=(p, port, args, queue), nprocs=p, join=True, start_method="spawn")
    device, version, results = queue.get()
    factor = {"ag": (p - 1) / p, "a2a": (p - 1) / p, "ar": 2 * (p - 1) / p}
    ver = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    print(f"torch.distributed {torch.__version__} (NCCL {ver}), {p} x {device}, bf16, "
          f"median of {args.iters} after {args.warmup} warm-up")
    print(f"{'op':<28} {'MiB/rank':>10} {'median ms':>10} {'algbw GB/s':>12} {'busbw GB/s':>12}")
    for name, kind, nbytes, samples in results:
        med = statistics.median(samples)
        alg = nbytes / med / 1e9
        bus = alg * factor[kind]
        print(f"{name:<28} {nbytes / 2**20:>10.1f} {med * 1e3:>10.3f} {alg:>12.1f} {bus:>12.1f}")
        print(f"RESULT\ttorch\t{name}\t{p}\t{nbytes}\t{med * 1e3:.6f}\t{alg:.2f}\t{bus:.2f}")


if __name__ == "__main__":
    main()
