"""What a training run draws (tools/train/default.py eval): videos generated from its checkpoints by
the sampler and decoder the daemon runs, judged by the checker (synthetic.check) against prompts
no training clip was drawn from, and a contact sheet of sample frames. `reconstruct`
(tools/train/default.py recon) judges the VAE alone the same way: clips through encoder and decoder, the
decoder streaming block by block as the daemon's VAE workers do."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..models.wan.canvas import commit_canvas
from ..models.wan.dit import DiTConfig, WanDiT
from ..models.wan.sampler import SamplerConfig, denoise_block, warped_timesteps
from ..models.wan.vae import VAEConfig, to_uint8_frames
from ..synthetic import HELD_OUT, check, held_out_prompts
from .dit import text_encoder
from .vae import load_vae


def load_trained(out: Path, dit_cfg: DiTConfig, vae_cfg: VAEConfig, text_seed: int):
    data = torch.load(out / "latents.pt", weights_only=False)
    dit, text = WanDiT(dit_cfg), text_encoder(dit_cfg, text_seed)
    state = torch.load(out / "dit.pt", weights_only=True)
    dit.load_state_dict(state["dit"])
    text.load_state_dict(state["text"])
    _, vae, _ = load_vae(out, vae_cfg)
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
    if sampler.canvas:
        commit_canvas(dit, st, lh, lw, sampler.context_t)
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


@torch.no_grad()
def reconstruct(out: Path, vae_cfg: VAEConfig, n: int = 24, frames: int = 61, latents_per_block: int = 3, log=print):
    """The checker on `n` held-out clips of `frames` frames put through the VAE's encoder and
    decoder: a DiT cannot draw better than this. Writes recon_STEP.json and recon_STEP.png
    (input above output, first, middle and last frame, for the first four clips)."""
    from ..synthetic import clip

    enc, dec, step = load_vae(out, vae_cfg)
    rng, rows, sheet = random.Random(77), [], []
    for cap in held_out_prompts(n):
        c = clip(cap, frames=frames, rng=rng)
        z = enc(torch.from_numpy(c.frames).permute(3, 0, 1, 2)[None].float() / 127.5 - 1.0)[0]
        vs = dec.new_state()
        y = np.concatenate(
            [
                to_uint8_frames(dec.decode(z[:, :, i : i + latents_per_block], vs)).numpy()
                for i in range(0, z.shape[2], latents_per_block)
            ]
        )
        got = check(y)
        rows.append(
            {"prompt": cap.prompt, "colour": got.colour, "direction": got.direction, "background": got.background}
        )
        rows[-1].update({f"{k}_ok": rows[-1][k] == getattr(cap, k) for k in ("colour", "direction", "background")})
        rows[-1]["psnr_db"] = float(10 * np.log10(255.0**2 / max(1e-6, ((y.astype(float) - c.frames) ** 2).mean())))
        if len(sheet) < 4:
            idx = (0, frames // 2, frames - 1)
            sheet.append(np.concatenate([np.concatenate([c.frames[i], y[i]]) for i in idx], axis=1))
    summary = {"step": step, "clips": n, "frames": frames}
    summary.update({k: sum(r[f"{k}_ok"] for r in rows) / n for k in ("colour", "direction", "background")})
    summary["psnr_db"] = float(np.mean([r["psnr_db"] for r in rows]))
    (out / f"recon_{step}.json").write_text(json.dumps({**summary, "clips_checked": rows}, indent=1))
    from PIL import Image

    Image.fromarray(np.concatenate(sheet, axis=0)).save(out / f"recon_{step}.png")
    log(json.dumps(summary))
    return summary


def evaluate(
    out: Path, dit_cfg, vae_cfg, sampler: SamplerConfig, text_seed: int, n: int = 24, blocks: int = 4, log=print
):
    if not 1 <= n <= HELD_OUT:  # past them, prompts the DiT may have trained on
        raise ValueError(f"judge 1-{HELD_OUT} held-out prompts, not {n}")
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


def trained_sampler(base: SamplerConfig, canvas: bool = True) -> SamplerConfig:
    """The preset's 4 steps without the shift: the trained DiT is not distilled, so its last x0
    estimate is the mean of what the noise left open; at shift 5 the last step is at sigma 0.63
    (a blur of every place the object could be), unshifted at 0.25. With the position canvas
    (DiTRun.canvas), the window holds it as its one sink beside the preset's frames."""
    if not canvas:
        return replace(base, shift=1.0)
    return replace(base, shift=1.0, canvas=True, sink_frames=1, window_frames=base.window_frames + 1)
