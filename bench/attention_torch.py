"""PyTorch reference for bench/src/bin/attention.rs: torch.nn.functional.scaled_dot_product_attention,
bf16, non-causal, D = 128, at the same (B, H, S) shapes, timed the same way (untimed calls for
--settle-ms of GPU time, so that both are timed at the clock the GPU sustains at its power limit, then
the warm-up, then CUDA events around each timed call, median of them). Backends: the default dispatch
(cuDNN on the H200 with torch 2.11), cuDNN forced, and FlashAttention-2 (SDPBackend.FLASH_ATTENTION).
Inputs are [B, H, S, D] contiguous (torch's native layout; ours are [B, S, H, D], the layout the DiT
produces).

`--cudnn-fp8` adds cuDNN's own FP8 attention (the cuDNN frontend's `sdpa_fp8` graph, on the torch
venv's cuDNN): the vendor's FP8 kernel beside ours (issue 24). Its recipe is cuDNN's, not ours: one
scale per tensor for Q, K, V (powers of two from their amax), P quantised at a fixed scale (256, so
p ≤ 1 → ≤ 256), O written in e4m3 (Hopper's only FP8 output), the softmax's LSE written as ours is.
Its inputs are quantised before timing, so its time is the kernel's alone (our `SPLIT` kernel part is
the like-for-like figure; our `RESULT`/`BATCH` include our quantisation). The frontend is not in the
torch venv: put a wheel's contents on PYTHONPATH (scripts/gpu-attention-cudnn-fp8.sh does). A `CHECK`
line gives its output's relative RMS distance to torch's bf16 result.

`--batch` also times each kernel back to back, as the Rust bench's `BATCH`: the median of 3 batches of
`--iters` calls, one event pair around each batch, divided by `--iters`.

Usage: attention_torch.py [--iters N] [--warmup N] [--settle-ms MS] [--batch] [--cudnn-fp8] B,H,S[,D[,S_kv]] ...
A shape may name a key length of its own, as the Rust benchmark's (the DiT's cross-attention to 512
text tokens: 1,12,32760,128,512); FLOPs are then 4·B·H·S·S_kv·D.
Prints `RESULT|BATCH\ttorch\t<backend>\t(B,H,S,D[,S_kv])\t<ms>\t<TFLOP/s>` lines."""

import argparse
import traceback

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


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def timed(f, warmup, iters, settle_ms, batch):
    """(RESULT seconds, BATCH seconds or None): each call alone, the median of `iters`; then, with
    `batch`, the median of 3 batches of `iters` back-to-back calls, per call."""
    spent = 0.0
    while spent * 1e3 < settle_ms:
        spent += gpu_seconds(f)
    for _ in range(warmup):
        f()
    one = median([gpu_seconds(f) for _ in range(iters)])
    if not batch:
        return one, None

    def run_batch():
        for _ in range(iters):
            f()

    return one, median([gpu_seconds(run_batch) / iters for _ in range(3)])


def report(name, label, flops, times):
    for kind, t in zip(("RESULT", "BATCH"), times):
        if t is not None:
            print(f"{kind}\ttorch\t{name}\t{label}\t{t * 1e3:.3f}\t{flops / t / 1e12:.1f}", flush=True)


def pow2_scale(x, bound):
    """The power of two that takes x's largest magnitude closest to `bound` without passing it."""
    amax = x.abs().amax().float().clamp_min(1e-12)
    return torch.exp2(torch.floor(torch.log2(bound / amax)))


def cudnn_fp8(q, k, v):
    """cuDNN's FP8 attention on q, k, v bf16 [B, H, S, D] (see the module docs): returns (a call
    running the graph alone on inputs quantised here, its output dequantised to bf16)."""
    import cudnn

    b, h, s, d = q.shape
    e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

    def operand(name, x):
        return graph.tensor(name=name, dim=list(x.shape), stride=list(x.stride()), data_type=e4m3)

    def scalar(name):
        return graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)

    tq, tk, tv = operand("q", q), operand("k", k), operand("v", v)
    names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
    scalars = {n: scalar(n) for n in names}
    o, stats, amax_s, amax_o = graph.sdpa_fp8(
        q=tq, k=tk, v=tv, **scalars, generate_stats=True, attn_scale=1.0 / d**0.5, name="sdpa_fp8"
    )
    o.set_output(True).set_dim([b, h, s, d]).set_stride([h * s * d, s * d, d, 1]).set_data_type(e4m3)
    stats.set_output(True).set_dim([b, h, s, 1]).set_stride([h * s, s, 1, 1]).set_data_type(f32)
    for t in (amax_s, amax_o):
        t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device="cuda")

    codes, values = {}, {}
    for name, t, x in (("q", tq, q), ("k", tk, k), ("v", tv, v)):
        sc = pow2_scale(x, 448.0)
        codes[t] = (x.float() * sc).to(torch.float8_e4m3fn).contiguous()
        values["descale_" + name] = sc.reciprocal()
    p_scale = torch.tensor(256.0, device="cuda")
    # O's magnitude is at most V's (a convex combination of its rows), so V's scale fits O too.
    o_scale = pow2_scale(v, 448.0)
    values |= {"descale_s": p_scale.reciprocal(), "scale_s": p_scale, "scale_o": o_scale}
    out = torch.empty(b, h, s, d, dtype=torch.float8_e4m3fn, device="cuda")
    pack = dict(codes)
    pack |= {scalars[n]: values[n].reshape(1, 1, 1, 1).float().contiguous() for n in names}
    pack |= {
        o: out,
        stats: torch.empty(b, h, s, 1, dtype=torch.float32, device="cuda"),
        amax_s: torch.empty(1, 1, 1, 1, dtype=torch.float32, device="cuda"),
        amax_o: torch.empty(1, 1, 1, 1, dtype=torch.float32, device="cuda"),
    }

    def call():
        graph.execute(pack, workspace, handle=handle)

    call()
    torch.cuda.synchronize()
    return call, (out.float() / o_scale).to(torch.bfloat16)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("shapes", nargs="*", default=["1,12,32760", "1,40,75600", "1,24,27280", "2,12,8190"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--settle-ms", type=float, default=1000.0)
    p.add_argument("--batch", action="store_true")
    p.add_argument("--cudnn-fp8", action="store_true")
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
                    t = timed(call, args.warmup, args.iters, args.settle_ms, args.batch)
                else:
                    with sdpa_kernel(backend):
                        t = timed(call, args.warmup, args.iters, args.settle_ms, args.batch)
            except RuntimeError as err:
                print(f"SKIP\ttorch\t{name}\t{label}\t{str(err).splitlines()[0]}")
                continue
            report(name, label, flops, t)
        if args.cudnn_fp8:
            try:
                call, out8 = cudnn_fp8(q, k, v)
            except Exception as err:  # the frontend missing, or cuDNN refusing the graph
                traceback.print_exc()
                why = (str(err).splitlines() or [""])[0]
                print(f"SKIP\ttorch\tcudnn_fp8\t{label}\t{type(err).__name__}: {why}", flush=True)
            else:
                ref = F.scaled_dot_product_attention(q, k, v).float()
                rms = ((out8.float() - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
                print(f"CHECK\ttorch\tcudnn_fp8\t{label}\tout rel rms vs bf16 {rms:.3e}", flush=True)
                report("cudnn_fp8", label, flops, timed(call, args.warmup, args.iters, args.settle_ms, args.batch))
                del call, out8
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
