"""diffusers' `WanTransformer3DModel` forward, timed the way `bench/src/bin/dit_step.rs` times ours.

Same dimensions (Wan2.1-1.3B by default), same latent and text lengths, bf16, eager, default attention
backend (torch SDPA), random weights (diffusers' own init), seeded normal inputs, timestep 500. CUDA
events around each forward after `--warmup` untimed ones, the median of `--iters`. With `--split` the
same per-op timings as ours: SDPA at the self- and cross-attention shapes and one block's linears, times
the block count. Prints `RESULT` lines in the format of the Rust driver; `scripts/gpu-dit.sh` runs both.

diffusers is not installed on the GPU machine: scripts/gpu-dit.sh unpacks the wheel carried in `.whl/`
and puts it on PYTHONPATH.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

PRESETS = {
    # name: (heads, layers, ffn, channels, text_dim)
    "tiny": (2, 2, 256, 16, 64),
    "wan2.1-t2v-1.3b": (12, 30, 8960, 16, 4096),
    "wan2.1-t2v-14b": (40, 40, 13824, 16, 4096),
}


HEAD_DIM = 128


def wan_transformer(preset, dev, dt):
    """diffusers' `WanTransformer3DModel` at `preset`'s dims, built on `dev` with diffusers' own
    random init (seed it first), in `dt`, in eval mode: the reference model of every torch script
    here (this one and `wan_pipeline_torch.py`)."""
    from diffusers import WanTransformer3DModel

    heads, layers, ffn, channels, text_dim = PRESETS[preset]
    with torch.device(dev):
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=heads,
            attention_head_dim=HEAD_DIM,
            in_channels=channels,
            out_channels=channels,
            text_dim=text_dim,
            freq_dim=256,
            ffn_dim=ffn,
            num_layers=layers,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
        )
    return model.to(dt).eval()


def timed(warmup, iters, f):
    """Median seconds of `iters` calls of f after `warmup` untimed ones (CUDA events)."""
    for _ in range(warmup):
        f()
    samples = []
    for _ in range(max(iters, 1)):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        f()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="wan2.1-t2v-1.3b", choices=sorted(PRESETS))
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--frames", type=int, default=5)
    p.add_argument("--text-len", type=int, default=512)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--split", action="store_true", help="also time SDPA and the linears alone")
    args = p.parse_args()
    assert args.frames % 4 == 1 and args.height % 16 == 0 and args.width % 16 == 0

    import diffusers

    heads, layers, ffn, channels, text_dim = PRESETS[args.preset]
    hd = HEAD_DIM
    d = heads * hd
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = wan_transformer(args.preset, dev, dt)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    latent = (1, channels, (args.frames - 1) // 4 + 1, args.height // 8, args.width // 8)
    tokens = latent[2] * (latent[3] // 2) * (latent[4] // 2)
    s = args.text_len
    print(
        f"diffusers {diffusers.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}: "
        f"{args.preset} ({layers} blocks, D {d}, FFN {ffn}) bf16 built in {build_s:.1f} s; "
        f"latent {list(latent)} -> {tokens} tokens; text {s} tokens"
    )

    x = torch.randn(latent, device=dev, dtype=dt)
    t = torch.tensor([500.0], device=dev)
    ctx = torch.randn(1, s, text_dim, device=dev, dtype=dt)
    with torch.inference_mode():
        forward = timed(args.warmup, args.iters, lambda: model(x, t, ctx, return_dict=False))
        lf, sf, df, ff = float(tokens), float(s), float(d), float(ffn)
        flops = layers * (
            2 * lf * df * df * 6 + 2 * sf * df * df * 2 + 4 * lf * df * ff + 4 * lf * lf * df + 4 * lf * sf * df
        )
        print(f"RESULT\tdiffusers\tforward\t{forward * 1e3:.3f}\tms\t{flops / forward / 1e12:.1f}\tTFLOP/s")
        if args.split:
            reps = max(args.iters, 3)
            q = torch.randn(1, heads, tokens, hd, device=dev, dtype=dt)
            kv = torch.randn(1, heads, s, hd, device=dev, dtype=dt)
            self_attn = timed(1, reps, lambda: F.scaled_dot_product_attention(q, q, q))
            cross_attn = timed(1, reps, lambda: F.scaled_dot_product_attention(q, kv, kv))
            h = torch.randn(1, tokens, d, device=dev, dtype=dt)
            h_ffn = torch.randn(1, tokens, ffn, device=dev, dtype=dt)
            txt = torch.randn(1, s, d, device=dev, dtype=dt)
            w_dd, b_d = torch.randn(d, d, device=dev, dtype=dt), torch.randn(d, device=dev, dtype=dt)
            w_up, b_f = torch.randn(ffn, d, device=dev, dtype=dt), torch.randn(ffn, device=dev, dtype=dt)
            w_down = torch.randn(d, ffn, device=dev, dtype=dt)

            def block_linears():
                for _ in range(6):
                    F.linear(h, w_dd, b_d)
                for _ in range(2):
                    F.linear(txt, w_dd, b_d)
                F.linear(h, w_up, b_f)
                return F.linear(h_ffn, w_down, b_d)

            linears = timed(1, reps, block_linears)
            rest = forward - layers * (self_attn + cross_attn + linears)
            for what, secs in [
                ("self-attention", layers * self_attn),
                ("cross-attention", layers * cross_attn),
                ("linears", layers * linears),
                ("rest", rest),
            ]:
                print(f"RESULT\tdiffusers\t{what}\t{secs * 1e3:.3f}\tms\t{100 * secs / forward:.1f}\t% of forward")
            print(f"SDPA alone: {self_attn * 1e3:.3f} ms per block, {4 * lf * lf * df / self_attn / 1e12:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
