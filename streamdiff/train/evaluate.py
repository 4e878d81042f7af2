"""What a training run draws (tools/train_default eval): videos generated from its checkpoints by
the sampler and decoder the daemon runs, judged by the checker (synthetic.check) against prompts
no training clip was drawn from, and a contact sheet of sample frames."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..models.wan.dit import DiTConfig, WanDiT
from ..models.wan.sampler import SamplerConfig, denoise_block, warped_timesteps
from ..models.wan.text import TinyTextEncoder
from ..models.wan.vae import VAEConfig, WanVAEDecoder, to_uint8_frames
from ..synthetic import Caption, check


def load_trained(out: Path, dit_cfg: DiTConfig, vae_cfg: VAEConfig, text_seed: int):
    data = torch.load(out / "latents.pt", weights_only=False)
    dit, text = WanDiT(dit_cfg), TinyTextEncoder(dit_cfg.text_dim, dit_cfg.text_len, seed=text_seed)
    state = torch.load(out / "dit.pt", weights_only=True)
    dit.load_state_dict(state["dit"])
    text.load_state_dict(state["text"])
    vae = WanVAEDecoder(vae_cfg)
    vae.load_state_dict(torch.load(out / "vae.pt", weights_only=True)["decoder"])
    vae.mean.copy_(data["mean"].view(1, -1, 1, 1, 1))
    vae.std.copy_(data["std"].view(1, -1, 1, 1, 1))
    for m in (dit, text, vae):
        m.eval().requires_grad_(False)
    return dit, text, vae, state["step"]


@torch.no_grad()
def generate(dit, text, vae, sampler: SamplerConfig, prompt: str, seed: int, blocks: int, size=(256, 144)):
    """(frames, H, W, 3) uint8: `blocks` blocks of one shot, as the daemon's engines make them."""
    w, h = size
    lh, lw = h // 8, w // 8
    st = dit.new_state(lh, lw, sampler.window_frames, sampler.sink_frames)
    dit.set_prompt(st, text.encode([prompt]))
    steps = warped_timesteps(sampler.steps, sampler.shift)
    g = torch.Generator().manual_seed(seed)
    vs = vae.new_state()
    out = []
    for _ in range(blocks):
        shape = (1, dit.cfg.in_channels, sampler.frames_per_block, lh, lw)
        noise = torch.randn(shape, generator=g)
        renoise = [torch.randn(shape, generator=g) for _ in steps[1:]]
        x0 = denoise_block(dit, st, noise, steps, renoise, sampler.context_t)
        out.append(to_uint8_frames(vae.decode(x0, vs)).numpy())
    return np.concatenate(out)


def held_out_prompts(n: int, seed: int = 4242) -> list[Caption]:
    """Captions drawn apart from the training clips' stream (another seed), distinct."""
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n:
        c = Caption.random(rng)
        if c.prompt not in seen:
            seen.add(c.prompt)
            out.append(c)
    return out


def evaluate(
    out: Path, dit_cfg, vae_cfg, sampler: SamplerConfig, text_seed: int, n: int = 50, blocks: int = 4, log=print
):
    dit, text, vae, step = load_trained(out, dit_cfg, vae_cfg, text_seed)
    rows, sheet = [], []
    for i, cap in enumerate(held_out_prompts(n)):
        frames = generate(dit, text, vae, sampler, cap.prompt, seed=1000 + i, blocks=blocks)
        got = check(frames)
        rows.append(
            {
                "prompt": cap.prompt,
                "colour": got.colour,
                "direction": got.direction,
                "background": got.background,
                "colour_ok": got.colour == cap.colour,
                "direction_ok": got.direction == cap.direction,
                "background_ok": got.background == cap.background,
            }
        )
        if i < 8:
            sheet.append(np.concatenate([frames[j] for j in np.linspace(0, len(frames) - 1, 6).astype(int)], axis=1))
    summary = {
        "step": step,
        "prompts": n,
        "colour": sum(r["colour_ok"] for r in rows) / n,
        "direction": sum(r["direction_ok"] for r in rows) / n,
        "background": sum(r["background_ok"] for r in rows) / n,
    }
    (out / f"eval_{step}.json").write_text(json.dumps({**summary, "videos": rows}, indent=1))
    from PIL import Image

    Image.fromarray(np.concatenate(sheet, axis=0)).save(out / f"sheet_{step}.png")
    log(json.dumps(summary))
    return summary


def trained_dit_config(base: DiTConfig) -> DiTConfig:
    return replace(base, text_len=64)  # the grammar's prompts run to 55 bytes
