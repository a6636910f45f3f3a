"""PyTorch reference for bench/src/bin/gemm.rs: bf16 GEMMs at the DiT linear shapes that `gemm --list`
prints, timed the same way (CUDA events around --reps back-to-back calls after --warmup untimed ones,
median of --iters batches; FLOPs = 2·M·K·N). Variants, named as ours:
- linear: torch.matmul(x, w.t()) (x [M, K], w [N, K]; no bias);
- linear+bias: F.linear(x, w, b);
- matmul: torch.matmul(x, b) with b [K, N] contiguous.
torch's defaults are kept (allow_bf16_reduced_precision_reduction is printed): this is torch as used.

Usage: gemm_torch.py --cases FILE [--warmup N] [--reps N] [--iters N]
Prints `RESULT\ttorch\t<variant>\t<shape>\t<ms>\t<TFLOP/s>` lines."""

import argparse

import torch
import torch.nn.functional as F


def timed(f, warmup, reps, iters):
    for _ in range(warmup):
        f()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            f()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / reps)
    times.sort()
    n = len(times)
    return times[n // 2] if n % 2 else (times[n // 2 - 1] + times[n // 2]) / 2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", required=True)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cuBLAS bf16 reduced-precision "
          f"reduction allowed: {torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction}")
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    with open(args.cases) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if parts[0] == "CASE":
                cases.append((parts[1], int(parts[2]), int(parts[3]), int(parts[4])))
    if not cases:
        raise SystemExit(f"no CASE lines in {args.cases} (make it with `gemm --list`)")
    for label, m, k, n in cases:
        def randn(*shape):
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

        x, w, b, bmat = randn(m, k), randn(n, k), randn(n), randn(k, n)
        flops = 2 * m * k * n
        for variant, f in [
            ("linear", lambda: torch.matmul(x, w.t())),
            ("linear+bias", lambda: F.linear(x, w, b)),
            ("matmul", lambda: torch.matmul(x, bmat)),
        ]:
            t = timed(f, args.warmup, args.reps, args.iters)
            print(f"RESULT\ttorch\t{variant}\t{label}\t{t * 1e3:.3f}\t{flops / t / 1e12:.1f}", flush=True)
        del x, w, b, bmat
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
