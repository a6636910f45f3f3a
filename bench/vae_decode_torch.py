"""diffusers' `AutoencoderKLWan.decode`, timed the way `bench/src/bin/vae_decode.rs` times ours.

The Wan 2.1 VAE with diffusers' default config (base_dim 96, dim_mult [1, 2, 4, 4], 2 residual blocks,
z_dim 16), diffusers' own random init, on cuda in bf16 (or f32), eager, no tiling or slicing: the
decode diffusers' Wan pipeline runs (it feeds the latent one frame at a time through its feature cache
and returns the whole video at the end). Seeded normal latent [1, 16, (frames − 1)/4 + 1, h/8, w/8].

Warm-up: `--warmup` decodes of the first min(3, T) latent frames (they hit every shape: cache of 0, 1
and 2 frames); then the peak-memory counters are reset and `--iters` whole decodes are timed with CUDA
events (median). Peak memory: `torch.cuda.max_memory_allocated` (live tensors, weights included; the
encoder's weights too, ~0.1 GiB in bf16) and `max_memory_reserved` (the caching allocator's pool).
diffusers returns every frame at the end, so its first frame is available at the total time.

Prints a `RESULT` line in the format of the Rust driver; `scripts/gpu-vae-bench.sh` runs both.
diffusers is not installed on the GPU machine: the script unpacks the wheel carried in `.whl/` and puts
it on PYTHONPATH.
"""

import argparse
import statistics
import time

import torch

GIB = float(1 << 30)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=2)
    args = p.parse_args()
    assert args.frames % 4 == 1 and args.height % 8 == 0 and args.width % 8 == 0

    import diffusers
    from diffusers import AutoencoderKLWan

    dt = {"bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
    dev = "cuda"
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(dev):
        vae = AutoencoderKLWan()
    vae = vae.to(dtype=dt).eval()
    torch.cuda.synchronize()
    params = sum(p.numel() for p in vae.parameters())
    print(
        f"diffusers {diffusers.__version__}, torch {torch.__version__}: AutoencoderKLWan "
        f"({params / 1e6:.1f} M parameters, encoder included) {args.dtype} on {torch.cuda.get_device_name()} "
        f"in {time.perf_counter() - t0:.1f} s"
    )
    t = (args.frames - 1) // 4 + 1
    shape = (1, 16, t, args.height // 8, args.width // 8)
    gen = torch.Generator(device=dev).manual_seed(1)
    latent = torch.randn(shape, generator=gen, device=dev, dtype=torch.float32).to(dt)
    label = f"{args.height}x{args.width}x{args.frames}f {args.dtype}"
    print(f"video {label} → latent {list(shape)}")

    with torch.no_grad():
        for _ in range(args.warmup):
            t1 = time.perf_counter()
            vae.decode(latent[:, :, : min(3, t)]).sample
            torch.cuda.synchronize()
            print(f"warm-up: {min(3, t)} latent frames in {time.perf_counter() - t1:.1f} s")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        samples = []
        for i in range(max(args.iters, 1)):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            video = vae.decode(latent).sample
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
            samples.append(ms)
            print(f"iter {i}: {ms:.1f} ms, video {list(video.shape)} {video.dtype}")
            del video
        peak = torch.cuda.max_memory_allocated() / GIB
        reserved = torch.cuda.max_memory_reserved() / GIB
    total = statistics.median(samples)
    print(f"diffusers: total {total:.1f} ms, peak {peak:.2f} GiB allocated / {reserved:.2f} GiB reserved")
    print(f"RESULT\tdiffusers\t{label}\t1\t{total:.1f}\t{total:.1f}\t-\t{peak:.2f}\t{reserved:.2f}")


if __name__ == "__main__":
    main()
