"""PyTorch reference for bench/src/bin/conv.rs: the Wan 2.1 VAE decoder's convolutions through
torch.nn.functional.conv3d (cuDNN, torch.backends.cudnn.benchmark = True, TF32 off), on the case list
that `conv --list` prints (one steady-state decode chunk), timed the same way: CUDA events around
--reps back-to-back calls after --warmup untimed ones (the first lets cuDNN benchmark its algorithms),
median of --iters batches; FLOPs = 2·C_out·C_in·kt·kh·kw·T·H·W.

Paths, per case (x: the chunk's new frames, cache: the conv's cached frames, joined = cat(cache, x)):
- torch_ncdhw: F.conv3d(joined, w, b, padding=(0, kh//2, kw//2)): the convolution alone, as our
  `cudnn_prejoined` path;
- torch_ndhwc: the same with input and weight in torch.channels_last_3d;
- torch_diffusers: what diffusers' WanCausalConv3d runs: cat(cache, x), F.pad to the causal padding,
  then the convolution with no padding (two copies and the convolution), as our `causal_conv3d`.

Usage: conv_torch.py --cases FILE [--dtype bf16|f32] [--warmup N] [--reps N] [--iters N]
Prints `RESULT\t<path>\t<case>\t<ms>\t<TFLOP/s>` and `TOTAL\t<path>\t<ms per chunk>` lines."""

import argparse
import math

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


def read_cases(path):
    cases = []
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if parts[0] != "CASE":
                continue
            name, c_in, c_out, kernel, frames, cached, h, w, calls = parts[1:10]
            cases.append((name, int(c_in), int(c_out), tuple(int(k) for k in kernel.split(",")),
                          int(frames), int(cached), int(h), int(w), int(calls)))
    if not cases:
        raise SystemExit(f"no CASE lines in {path} (make it with `conv --list`)")
    return cases


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", required=True)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.backends.cudnn.benchmark = True
    # Ours runs f32 without TF32 (FMA maths): compare like with like.
    torch.backends.cudnn.allow_tf32 = False
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}, {args.dtype}")
    g = torch.Generator(device="cuda").manual_seed(0)
    totals = {}
    for name, c_in, c_out, (kt, kh, kw), frames, cached, h, w, calls in read_cases(args.cases):
        def randn(*shape):
            return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

        x = randn(1, c_in, frames, h, w)
        cache = randn(1, c_in, cached, h, w) if cached else None
        weight = randn(c_out, c_in, kt, kh, kw) / math.sqrt(c_in * kt * kh * kw)
        bias = randn(c_out)
        joined = torch.cat([cache, x], 2) if cached else x
        padding = (0, kh // 2, kw // 2)
        joined_cl = joined.contiguous(memory_format=torch.channels_last_3d)
        weight_cl = weight.contiguous(memory_format=torch.channels_last_3d)
        # diffusers WanCausalConv3d: padding (w, w, h, h, 2·p_t, 0), the cached frames replacing zeros.
        causal_pad = [kw // 2, kw // 2, kh // 2, kh // 2, kt - 1, 0]

        def diffusers_style():
            inp, pad = x, list(causal_pad)
            if cache is not None and pad[4] > 0:
                inp = torch.cat([cache, x], 2)
                pad[4] -= cache.shape[2]
            return F.conv3d(F.pad(inp, pad), weight, bias)

        flops = 2 * c_out * c_in * kt * kh * kw * frames * h * w
        for path, f in [
            ("torch_ncdhw", lambda: F.conv3d(joined, weight, bias, padding=padding)),
            ("torch_ndhwc", lambda: F.conv3d(joined_cl, weight_cl, bias, padding=padding)),
            ("torch_diffusers", diffusers_style),
        ]:
            t = timed(f, args.warmup, args.reps, args.iters)
            totals[path] = totals.get(path, 0.0) + t * calls
            print(f"RESULT\t{path}\t{name}\t{t * 1e3:.4f}\t{flops / t / 1e12:.1f}", flush=True)
        del x, cache, joined, joined_cl, weight, weight_cl
        torch.cuda.empty_cache()
    for path, total in totals.items():
        print(f"TOTAL\t{path}\t{total * 1e3:.3f}")


if __name__ == "__main__":
    main()
