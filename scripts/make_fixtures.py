#!/usr/bin/env python3
"""Builds the reference fixtures the Rust tests compare against, with diffusers on CPU in fp32.

Usage: python scripts/make_fixtures.py [schedulers ...]   (no argument: every fixture)

Needs torch, diffusers==0.42.1, safetensors (and for `text`: transformers, tokenizers) (a venv outside the repo). The outputs are small and
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


def dit():
    """WanTransformer3DModel built from config after seeding: diffusers' own test config, and a
    head-dim-128 mini model that exercises the 44/42/42 RoPE split on a (3, 6, 10) grid. Saves the
    checkpoint folder as users have it (config.json + safetensors), the inputs, the output, and
    intermediates (condition embeddings, per-block outputs)."""
    from diffusers import WanTransformer3DModel

    configs = {
        # tests/models/transformers/test_models_transformer_wan.py
        "dit_diffusers_test": (
            dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                 out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2,
                 cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
            (1, 4, 2, 16, 16), 12,
        ),
        # reference/wan.md §6 advice 2
        "dit_mini128": (
            dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=16,
                 out_channels=16, text_dim=64, freq_dim=256, ffn_dim=256, num_layers=2,
                 cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024),
            (1, 16, 3, 12, 20), 24,
        ),
    }
    for name, (config, shape, text_len) in configs.items():
        torch.manual_seed(0)
        model = WanTransformer3DModel(**config).eval()
        folder = ROOT / "denoiser/tests/fixtures" / name
        model.save_pretrained(str(folder / "transformer"), safe_serialization=True)
        g = torch.Generator("cpu").manual_seed(1)
        x = torch.randn(shape, generator=g)
        ctx = torch.randn((1, text_len, config["text_dim"]), generator=g)
        # The pipeline zero-pads the text states past the real tokens: keep the last rows zero.
        ctx[:, text_len - 4:] = 0
        io = {"hidden_states": x, "encoder_hidden_states": ctx}
        captured = {}
        hooks = [model.condition_embedder.register_forward_hook(
            lambda m, i, o: captured.update(temb=o[0], timestep_proj=o[1], context=o[2]))]
        for b, block in enumerate(model.blocks):
            hooks.append(block.register_forward_hook(
                lambda m, i, o, b=b: captured.__setitem__(f"block{b}", o)))
        hooks.append(model.rope.register_forward_hook(
            lambda m, i, o: captured.update(rope_cos=o[0], rope_sin=o[1])))
        cases = {"t500": torch.tensor([500], dtype=torch.int64), "t999": torch.tensor([999])}
        # Wan2.2 TI2V-style per-token timesteps: first latent frame clean (t = 0), the rest t = 700.
        tokens = shape[2] * (shape[3] // 2) * (shape[4] // 2)
        per_token = torch.full((1, tokens), 700, dtype=torch.int64)
        per_token[:, : tokens // shape[2]] = 0
        cases["per_token"] = per_token
        with torch.no_grad():
            for case, t in cases.items():
                captured.clear()
                out = model(x, t, ctx, return_dict=False)[0]
                io[f"{case}.timestep"] = t.to(torch.float32)  # exact: integers < 2^24
                io[f"{case}.output"] = out
                for k, v in captured.items():
                    # RoPE depends on the grid only: save it once.
                    io[k if k.startswith("rope") else f"{case}.{k}"] = v
        for h in hooks:
            h.remove()
        io = {k: v.contiguous() for k, v in io.items()}
        save_file(io, str(folder / "io.safetensors"))
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        print(f"wrote {folder} ({size} bytes)")


def vae():
    """AutoencoderKLWan (Wan 2.1) decode from config after seeding: diffusers' test config (1-channel
    layers) and the real topology at base_dim 16, on a non-square latent, latent T in {1, 2, 3, 5}
    (chunk 0, chunk 1, and later chunks of the causal cache). The latent is in the DiT's space; the
    video is what the pipeline decodes from it: vae.decode(latent * std + mean), clamped to [-1, 1]."""
    from diffusers import AutoencoderKLWan

    configs = {
        "vae_diffusers_test": (
            dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                 temperal_downsample=[False, True, True]),
            (2, 2),
        ),
        "vae_base16": (
            dict(base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                 temperal_downsample=[False, True, True]),
            (6, 10),
        ),
    }
    for name, (config, (h, w)) in configs.items():
        torch.manual_seed(0)
        model = AutoencoderKLWan(**config).eval()
        folder = ROOT / "decoder/tests/fixtures" / name
        # Only what decoding reads: the decoder and post_quant_conv (the encoder would double the
        # size). The names are the checkpoint's own.
        (folder / "vae").mkdir(parents=True, exist_ok=True)
        model.save_config(str(folder / "vae"))
        weights = {k: v.contiguous() for k, v in model.state_dict().items()
                   if k.startswith(("decoder.", "post_quant_conv."))}
        save_file(weights, str(folder / "vae/diffusion_pytorch_model.safetensors"))
        mean = torch.tensor(model.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(model.config.latents_std).view(1, -1, 1, 1, 1)
        io = {}
        g = torch.Generator("cpu").manual_seed(2)
        with torch.no_grad():
            for t in (1, 2, 3, 5):
                z = torch.randn((1, 16, t, h, w), generator=g)
                video = model.decode(z * std + mean, return_dict=False)[0]
                io[f"t{t}.latent"] = z
                io[f"t{t}.video"] = video.contiguous()
        save_file(io, str(folder / "io.safetensors"))
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        print(f"wrote {folder} ({size} bytes)")


def text():
    """The umT5 text encoder and its tokenizer: a tiny seeded `UMT5EncoderModel` (and a `T5EncoderModel`,
    whose relative-position bias lives in layer 0 only), a tiny T5-style SentencePiece-Unigram tokenizer
    trained on an in-script corpus with the `tokenizers` library, and for a batch of prompts the
    pipeline's token ids, attention masks, the encoder's raw last hidden states and the prompt embeddings
    exactly as diffusers' `WanPipeline._get_t5_prompt_embeds` makes them (cut, zero-padded)."""
    import json
    import math
    import types
    import unicodedata

    from diffusers.pipelines.wan.pipeline_wan import WanPipeline, prompt_clean
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import AutoTokenizer, T5Config, T5EncoderModel, T5Tokenizer, UMT5Config, UMT5EncoderModel

    folder = ROOT / "denoiser/tests/fixtures/text_umt5"
    corpus = [
        "A cat plays the piano in a cozy living room.",
        "A cinematic shot of a red fox running through a snowy forest at dawn.",
        "Golden light filters through the pine trees, slow motion, highly detailed.",
        "An astronaut rides a horse on the moon, photorealistic, 4k.",
        "Two dogs chase each other across a sunny beach, waves crashing.",
        "A timelapse of clouds rolling over snowy mountains at sunset.",
        "Close-up of raindrops falling on green leaves, macro photography.",
        "A busy city street at night with neon signs and reflections on wet asphalt.",
        "Un café crème sur une table, façade naïve, lumière douce du matin.",
        "Ein Fuchs läuft durch den Schnee, über die Brücke, schöne Grüße.",
        "Una niña baila en la plaza, el señor sonríe, canción alegre.",
        "猫がピアノを弾く。夕焼けの山。雪の森を走る赤い狐。",
        "一只猫在弹钢琴，夕阳下的山，雪中奔跑的红狐狸。",
        "Bright colors, overexposed, static, blurred details, subtitles, style, artwork.",
    ] * 4
    # T5/umT5 ship a SentencePiece Unigram model; `tokenizers` trains the same kind of model. The
    # normalizer stands in for SentencePiece's precompiled nmt_nfkc char map (NFKC) plus the converter's
    # run-of-spaces Replace (a regex: it exercises the Rust crate's regex backend).
    trainer_tok = Tokenizer(models.Unigram())
    trainer_tok.normalizer = normalizers.NFKC()
    trainer_tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True),
    ])
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=["<pad>", "</s>", "<unk>"],
                                      unk_token="<unk>", max_piece_length=8)
    trainer_tok.train_from_iterator(corpus, trainer)
    trained = [v[0] for v in json.loads(trainer_tok.to_str())["model"]["vocab"]]
    assert trained[:3] == ["<pad>", "</s>", "<unk>"], trained[:3]
    # The trainer picks the same pieces every run but its scores wobble (parallel EM): rescore each
    # piece deterministically by its log frequency in the pre-tokenized corpus, so that re-running
    # this script reproduces tokenizer.json byte for byte.
    words = ["\u2581" + w for line in corpus for w in unicodedata.normalize("NFKC", line).split()]
    counts = {p: max(sum(w.count(p) for w in words), 1) for p in trained[3:]}
    total = sum(counts.values())
    scored = sorted(((p, round(math.log(c / total), 6)) for p, c in counts.items()),
                    key=lambda ps: (-ps[1], ps[0]))
    vocab = [(p, 0.0) for p in trained[:3]] + scored
    # transformers' T5 tokenizer over that vocab: pad 0, eos 1, unk 2, `</s>` appended, 3 sentinels.
    tok = T5Tokenizer(vocab=vocab, extra_ids=3)
    tok.backend_tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.save_pretrained(str(folder / "tokenizer"))
    tok = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))  # as the pipeline loads it
    vocab_size = 320
    assert len(tok) <= vocab_size, len(tok)

    prompts = [
        "",
        "A cat plays the piano.",
        "Café crème, naïve façade \u2014 猫がピアノを弾く 🎹🐱",
        "A cinematic shot of a red fox running through a snowy forest at dawn, golden light "
        "filtering through the pine trees, slow motion, highly detailed",
        "  Tom &amp; Jerry\n\tchase   each  other  ",
    ]

    def perturb(model, g):
        # transformers initialises the norms to 1 and the position bias small: spread both so that a
        # swapped or missing weight shows.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "layer_norm" in name:
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
                if "relative_attention_bias" in name:
                    p.copy_(torch.randn(p.shape, generator=g))

    encoders = {
        "umt5": (UMT5Config, UMT5EncoderModel, "text_encoder",
                 dict(d_model=64, d_kv=12, num_heads=4, d_ff=96, num_layers=2)),
        "t5": (T5Config, T5EncoderModel, "text_encoder_t5",
               dict(d_model=32, d_kv=8, num_heads=2, d_ff=48, num_layers=3)),
    }
    io = {}
    for kind, (config_cls, model_cls, sub, dims) in encoders.items():
        torch.manual_seed(0)
        config = config_cls(vocab_size=vocab_size, num_decoder_layers=dims["num_layers"],
                            relative_attention_num_buckets=32, relative_attention_max_distance=128,
                            feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, dropout_rate=0.0,
                            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                            tie_word_embeddings=False, **dims)
        model = model_cls(config).eval()
        model.config._attn_implementation = "eager"
        perturb(model, torch.Generator("cpu").manual_seed(1))
        model.save_pretrained(str(folder / sub), safe_serialization=True)
        model = model_cls.from_pretrained(str(folder / sub), attn_implementation="eager").eval()
        # The pipeline's own function, on a stand-in `self` holding our tokenizer and encoder.
        pipe = types.SimpleNamespace(tokenizer=tok, text_encoder=model, _execution_device=torch.device("cpu"))
        for max_len in (16, 64):
            case = f"{kind}.max{max_len}"
            enc = tok([prompt_clean(p) for p in prompts], padding="max_length", max_length=max_len,
                      truncation=True, add_special_tokens=True, return_attention_mask=True,
                      return_tensors="pt")
            with torch.no_grad():
                raw = model(enc.input_ids, enc.attention_mask).last_hidden_state
                embeds = WanPipeline._get_t5_prompt_embeds(
                    pipe, prompt=prompts, max_sequence_length=max_len, dtype=torch.float32)
            io[f"{case}.input_ids"] = enc.input_ids
            io[f"{case}.attention_mask"] = enc.attention_mask
            io[f"{case}.raw"] = raw
            io[f"{case}.prompt_embeds"] = embeds
        # Wan's real maximum, 512, for a short prompt: its tokens, then zeros.
        with torch.no_grad():
            io[f"{kind}.max512.prompt_embeds"] = WanPipeline._get_t5_prompt_embeds(
                pipe, prompt=[prompts[1]], max_sequence_length=512, dtype=torch.float32)
    # Bucketing of relative positions (key − query) as transformers computes it: Wan's (32, 128) and
    # an odd small setting.
    rel = torch.arange(-700, 701)
    for buckets, distance in ((32, 128), (10, 20)):
        cfg = UMT5Config(relative_attention_num_buckets=buckets, relative_attention_max_distance=distance,
                         d_model=8, d_kv=4, num_heads=2, d_ff=8, num_layers=1)
        attn = UMT5EncoderModel(cfg).encoder.block[0].layer[0].SelfAttention
        io[f"buckets_{buckets}_{distance}"] = attn._relative_position_bucket(rel)
    io["relative_positions"] = rel
    (folder / "prompts.json").write_text(json.dumps(prompts, ensure_ascii=False, indent=1) + "\n")
    io = {k: v.contiguous() for k, v in io.items()}
    save_file(io, str(folder / "io.safetensors"))
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    print(f"wrote {folder} ({size} bytes)")


def loop():
    """The WanPipeline denoise loop with given latents and prompt embeddings (output_type="latent"):
    CFG with UniPC and with Euler, no CFG, and Wan2.2-A14B-style expert switching (two transformers,
    boundary 0.875, guidance_scale / guidance_scale_2). Small transformers like diffusers' pipeline
    tests (in/out 16, text_dim 32)."""
    from diffusers import (FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanPipeline,
                           WanTransformer3DModel)

    config = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                  out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2,
                  cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    folder = ROOT / "denoiser/tests/fixtures/loop"
    experts = []
    for seed, sub in [(0, "transformer"), (1, "transformer_2")]:
        torch.manual_seed(seed)
        model = WanTransformer3DModel(**config).eval()
        model.save_pretrained(str(folder / sub), safe_serialization=True)
        experts.append(model)
    g = torch.Generator("cpu").manual_seed(3)
    latents = torch.randn((1, 16, 3, 8, 8), generator=g)
    cond = torch.randn((1, 10, 32), generator=g)
    uncond = torch.randn((1, 10, 32), generator=g)
    io = {"latents": latents, "prompt_embeds": cond, "negative_prompt_embeds": uncond}

    def unipc(shift):
        return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                       flow_shift=shift)

    cases = {
        "unipc_cfg": (unipc(3.0), 4, 5.0, None, None),
        "euler_cfg": (FlowMatchEulerDiscreteScheduler(shift=7.0), 3, 6.0, None, None),
        "unipc_nocfg": (unipc(3.0), 3, 1.0, None, None),
        "experts": (unipc(12.0), 6, 4.0, 3.0, 0.875),
    }
    for name, (scheduler, steps, guidance, guidance_2, boundary) in cases.items():
        pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=scheduler,
                           transformer=experts[0], transformer_2=experts[1] if boundary else None,
                           boundary_ratio=boundary)
        kwargs = dict(guidance_scale_2=guidance_2) if boundary else {}
        with torch.no_grad():
            out = pipe(prompt_embeds=cond, negative_prompt_embeds=uncond if guidance > 1 else None,
                       height=64, width=64, num_frames=9, num_inference_steps=steps,
                       guidance_scale=guidance, latents=latents.clone(), output_type="latent",
                       **kwargs).frames
        io[f"{name}.output"] = out.contiguous()
    save_file(io, str(folder / "io.safetensors"))
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    print(f"wrote {folder} ({size} bytes)")


FIXTURES = {"schedulers": schedulers, "dit": dit, "vae": vae, "text": text, "loop": loop}

if __name__ == "__main__":
    for name in sys.argv[1:] or FIXTURES:
        FIXTURES[name]()
