"""transformers' `UMT5EncoderModel` forward, timed the way `bench/src/bin/text_encode.rs` times ours.

Same dimensions (umT5-XXL, Wan's text encoder, by default), random weights (transformers' own init,
drawn on the GPU), bf16, the model's default attention implementation (printed; `--also-eager` times
eager attention too). Same inputs: batch 1 of 512 tokens all real, and batch 2 (prompt + negative
prompt) of 512 tokens each with the negative prompt's 126 real tokens then padding masked by the
attention mask, as the Wan pipeline pads them. CUDA events around each forward after `--warmup`
untimed ones, the median of `--iters`. Prints `RESULT` lines in the format of the Rust driver;
`scripts/gpu-text.sh` runs both.
"""

import argparse
import statistics
import time

import torch

PRESETS = {
    # name: (vocab, d_model, d_kv, heads, d_ff, layers)
    "umt5-xxl": (256384, 4096, 64, 64, 10240, 24),
    "tiny": (320, 64, 12, 4, 96, 2),
}


def timed(device, warmup, iters, f):
    """Median seconds and all samples of `iters` calls of f after `warmup` untimed ones."""
    for _ in range(warmup):
        f()
    samples = []
    for _ in range(max(iters, 1)):
        if device == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            f()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            f()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples), samples


def forward_flops(vocab, d, d_kv, heads, ff, layers, batch, seq):
    """Matrix FLOPs of one forward (the Rust driver's count)."""
    t, inner = batch * seq, heads * d_kv
    return layers * (2 * t * d * inner * 4 + 2 * t * d * ff * 3 + 4 * batch * seq * seq * inner)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="umt5-xxl", choices=sorted(PRESETS))
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--negative-len", type=int, default=126)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--also-eager", action="store_true",
                   help="also time eager attention when the default is another implementation")
    args = p.parse_args()
    assert 0 < args.negative_len <= args.seq

    import transformers
    from transformers import UMT5Config, UMT5EncoderModel

    vocab, d, d_kv, heads, ff, layers = PRESETS[args.preset]
    config = UMT5Config(
        vocab_size=vocab,
        d_model=d,
        d_kv=d_kv,
        d_ff=ff,
        num_layers=layers,
        num_heads=heads,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        dropout_rate=0.0,
        layer_norm_epsilon=1e-6,
        feed_forward_proj="gated-gelu",
        use_cache=False,
    )
    dev, dt = args.device, torch.bfloat16
    torch.manual_seed(0)
    t0 = time.perf_counter()
    # Parameters are created (and initialised) directly on the device in bf16.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        with torch.device(dev):
            model = UMT5EncoderModel(config)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(device=dev, dtype=dt).eval()
    if dev == "cuda":
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    params = sum(x.numel() for x in model.parameters())
    dtypes = sorted({str(x.dtype) for x in model.parameters()})
    attn = getattr(model.config, "_attn_implementation", None) or "eager"
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: UMT5EncoderModel "
          f"{args.preset}, {params / 1e6:.1f} M parameters {dtypes} on {dev}, random init in "
          f"{build_s:.2f} s; attention implementation: {attn}")

    s = args.seq
    gen = torch.Generator(device="cpu").manual_seed(7)
    impls = [attn]
    if args.also_eager and attn != "eager" and hasattr(model, "set_attn_implementation"):
        impls.append("eager")
    for impl in impls:
        if impl != attn:
            model.set_attn_implementation(impl)
        for label, lens in [("b1", [s]), ("b2", [s, args.negative_len])]:
            batch = len(lens)
            ids = torch.randint(1, vocab, (batch, s), generator=gen).to(dev)
            mask = torch.zeros(batch, s, dtype=torch.long)
            for b, n in enumerate(lens):
                mask[b, :n] = 1
            mask = mask.to(dev)

            def forward():
                with torch.inference_mode():
                    return model(input_ids=ids, attention_mask=mask).last_hidden_state

            out = forward()
            assert out.shape == (batch, s, d) and out.dtype == dt, (out.shape, out.dtype)
            assert torch.isfinite(out.float()).all(), "non-finite states"
            rms = out.float().pow(2).mean().sqrt().item()
            secs, samples = timed(dev, args.warmup, args.iters, forward)
            tag = label if impl == attn else f"{label}_{impl}"
            print(f"{tag}: ids [{batch}, {s}], valid lengths {lens}; states rms {rms:.3f}; "
                  f"{len(samples)} timed forwards: min {min(samples) * 1e3:.3f} ms, "
                  f"max {max(samples) * 1e3:.3f} ms")
            flops = forward_flops(vocab, d, d_kv, heads, ff, layers, batch, s)
            print(f"RESULT\ttransformers\t{tag}\t{secs * 1e3:.3f}\tms\t{flops / secs / 1e12:.1f}\tTFLOP/s")
    if dev == "cuda":
        print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
