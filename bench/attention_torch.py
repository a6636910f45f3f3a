"""PyTorch reference for bench/src/bin/attention.rs: torch.nn.functional.scaled_dot_product_attention,
bf16, non-causal, D = 128, at the same (B, H, S) shapes, timed the same way (untimed calls for
--settle-ms of GPU time, so that both are timed at the clock the GPU sustains at its power limit, then
the warm-up, then CUDA events around each timed call, median of them). Backends: the default dispatch
(cuDNN on the H200 with torch 2.11), cuDNN forced, and FlashAttention-2 (SDPBackend.FLASH_ATTENTION).
Inputs are [B, H, S, D] contiguous (torch's native layout; ours are [B, S, H, D], the layout the DiT
produces).

Usage: attention_torch.py [--iters N] [--warmup N] [--settle-ms MS] B,H,S[,D[,S_kv]] ...
A shape may name a key length of its own, as the Rust benchmark's (the DiT's cross-attention to 512
text tokens: 1,12,32760,128,512); FLOPs are then 4·B·H·S·S_kv·D.
Prints `RESULT\ttorch\t<backend>\t(B,H,S,D[,S_kv])\t<ms>\t<TFLOP/s>` lines."""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

D = 128


def gpu_seconds(f):
    """Seconds one call of f takes on the GPU, between CUDA events around it."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    f()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / 1e3


def timed(f, warmup, iters, settle_ms):
    spent = 0.0
    while spent * 1e3 < settle_ms:
        spent += gpu_seconds(f)
    for _ in range(warmup):
        f()
    times = [gpu_seconds(f) for _ in range(iters)]
    times.sort()
    n = len(times)
    return times[n // 2] if n % 2 else (times[n // 2 - 1] + times[n // 2]) / 2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("shapes", nargs="*", default=["1,12,32760", "1,40,75600", "1,24,27280", "2,12,8190"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--settle-ms", type=float, default=1000.0)
    args = p.parse_args()
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        dims = [int(x) for x in shape.split(",")]
        b, h, s = dims[:3]
        d = dims[3] if len(dims) > 3 else D
        s_kv = dims[4] if len(dims) > 4 else s
        label = f"({b},{h},{s},{d})" if s_kv == s else f"({b},{h},{s},{d},{s_kv})"
        q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(b, h, s_kv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        flops = 4 * b * h * s * s_kv * d
        for name, backend in [
            ("default", None),
            ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("flash2", SDPBackend.FLASH_ATTENTION),
        ]:
            def call():
                return F.scaled_dot_product_attention(q, k, v)

            try:
                if backend is None:
                    t = timed(call, args.warmup, args.iters, args.settle_ms)
                else:
                    with sdpa_kernel(backend):
                        t = timed(call, args.warmup, args.iters, args.settle_ms)
            except RuntimeError as err:
                print(f"SKIP\ttorch\t{name}\t{label}\t{str(err).splitlines()[0]}")
                continue
            print(f"RESULT\ttorch\t{name}\t{label}\t{t * 1e3:.3f}\t{flops / t / 1e12:.1f}", flush=True)
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
