#!/usr/bin/env python3
"""Builds the reference fixtures the Rust tests compare against, with diffusers on CPU in fp32.

Usage: python scripts/make_fixtures.py [schedulers ...]   (no argument: every fixture)

Needs torch, diffusers==0.42.1, safetensors (a venv outside the repo). The outputs are small and
committed; re-running reproduces them bit for bit on the same library versions.
"""
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent


def schedulers():
    """Diffusers' flow-matching UniPC and Euler: sigmas, timesteps, and the latent after each step
    for seeded model outputs, on a small latent."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    cases = [
        ("unipc_n1_s5", "unipc", 1, 5.0),
        ("unipc_n2_s3", "unipc", 2, 3.0),
        ("unipc_n3_s3", "unipc", 3, 3.0),
        ("unipc_n10_s3", "unipc", 10, 3.0),
        ("unipc_n50_s5", "unipc", 50, 5.0),
        ("unipc_n40_s12", "unipc", 40, 12.0),
        ("euler_n1_s7", "euler", 1, 7.0),
        ("euler_n10_s7", "euler", 10, 7.0),
        ("euler_n50_s5", "euler", 50, 5.0),
    ]
    out = {}
    for name, kind, steps, shift in cases:
        if kind == "unipc":
            s = UniPCMultistepScheduler(
                prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift
            )
        else:
            s = FlowMatchEulerDiscreteScheduler(shift=shift)
        s.set_timesteps(steps)
        g = torch.Generator("cpu").manual_seed(steps)
        x = torch.randn((2, 3, 4), generator=g, dtype=torch.float32)
        xs, vs = [x.clone()], []
        for t in s.timesteps:
            # A velocity shaped like the real one (noise minus clean sample), plus noise.
            v = torch.randn((2, 3, 4), generator=g) + 0.5 * x
            x = s.step(v, t, x, return_dict=False)[0]
            xs.append(x.clone())
            vs.append(v)
        out[f"{name}.sigmas"] = s.sigmas.to(torch.float32).contiguous()
        out[f"{name}.timesteps"] = s.timesteps.to(torch.float64).contiguous()
        out[f"{name}.x"] = torch.stack(xs).reshape(steps + 1, -1).contiguous()
        out[f"{name}.v"] = torch.stack(vs).reshape(steps, -1).contiguous()
    path = ROOT / "denoiser/tests/fixtures/schedulers.safetensors"
    save_file(out, str(path))
    print(f"wrote {path} ({path.stat().st_size} bytes)")


FIXTURES = {"schedulers": schedulers}

if __name__ == "__main__":
    for name in sys.argv[1:] or FIXTURES:
        FIXTURES[name]()
