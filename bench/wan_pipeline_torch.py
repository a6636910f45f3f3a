"""diffusers' `WanPipeline`, one whole request timed: the reference for a request through `serve`.

Wan2.1-1.3B dims by default with random weights (diffusers' own init), the transformer and the VAE
(`AutoencoderKLWan`, the Wan2.1 VAE's default config) in bf16 as `configs/h200x1.yaml` runs ours,
eager, default attention backend (torch SDPA); UniPC with flow sigmas (`flow_shift` 3.0 at 480p, as
our config), classifier-free guidance 5.0, seeded prompt embeddings of 512 tokens (the text encoder
is excluded: ours includes it), `output_type="np"` (decoded frames on the host; ours also encodes
H.264). One warm-up request (2 steps), then the timed request: wall from the call to its return
with the GPU synchronised, and where the loop ends (a step-end callback on the last step that
synchronises). Prints `RESULT` lines: `RESULT\tWanPipeline\t<what>\t<seconds>`.

diffusers is not installed on the GPU machine: the caller unpacks the wheel carried in `.whl/` and
puts it on PYTHONPATH (scripts/gpu-request.sh).
"""

import argparse
import time

import torch

from dit_step_torch import PRESETS, wan_transformer


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="wan2.1-t2v-1.3b", choices=sorted(PRESETS))
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--shift", type=float, default=3.0)
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--text-len", type=int, default=512)
    args = p.parse_args()

    import diffusers
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    text_dim = PRESETS[args.preset][4]
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    t0 = time.perf_counter()
    transformer = wan_transformer(args.preset, dev, dt)
    with torch.device(dev):
        vae = AutoencoderKLWan()
    vae = vae.to(dt).eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        flow_shift=args.shift)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler,
                       transformer=transformer)
    torch.cuda.synchronize()
    print(f"diffusers {diffusers.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}: "
          f"WanPipeline {args.preset} bf16 built in {time.perf_counter() - t0:.1f} s; "
          f"{args.width}x{args.height} {args.frames} frames, {args.steps} steps, CFG {args.guidance}")

    g = torch.Generator(dev).manual_seed(1)
    cond = torch.randn(1, args.text_len, text_dim, device=dev, dtype=dt, generator=g)
    uncond = torch.randn(1, args.text_len, text_dim, device=dev, dtype=dt, generator=g)

    def request(steps):
        loop_end = {}

        def on_step_end(pipe, i, t, kwargs):
            if i == steps - 1:
                torch.cuda.synchronize()
                loop_end["t"] = time.perf_counter()
            return kwargs

        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = pipe(prompt_embeds=cond, negative_prompt_embeds=uncond, height=args.height,
                       width=args.width, num_frames=args.frames, num_inference_steps=steps,
                       guidance_scale=args.guidance, generator=torch.Generator(dev).manual_seed(2),
                       output_type="np", callback_on_step_end=on_step_end).frames
        torch.cuda.synchronize()
        end = time.perf_counter()
        return out, end - start, loop_end["t"] - start

    request(2)  # warm-up: every kernel at these shapes, the VAE included
    frames, wall, loop = request(args.steps)
    print(f"WanPipeline: {wall:.2f} s for the request ({loop:.2f} s to the loop's end, "
          f"{wall - loop:.2f} s decode and post-processing); frames {list(frames.shape)}")
    print(f"RESULT\tWanPipeline\trequest\t{wall:.3f}")
    print(f"RESULT\tWanPipeline\tloop\t{loop:.3f}")
    print(f"RESULT\tWanPipeline\tafter loop\t{wall - loop:.3f}")


if __name__ == "__main__":
    main()
