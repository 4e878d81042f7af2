"""Training the embedded default's VAE on the synthetic grammar (tools/train_default vae).

The decoder is the shipped `WanVAEDecoder` at the tiny preset's widths, trained through the same
modules and kernels it decodes with (`decode_clip`); the encoder (`encoder.py`) is thrown away
after. Clips come from `synthetic.clip`: 1 + 4k frames of a captioned object, cropped around the
object. Long clips train chunk by chunk (`chunk`): encoder and decoder carry their causal caches
from one chunk to the next, detached (truncated backpropagation through time), one optimiser step
per chunk, so the decoder learns the steady state a streamed video reaches after the first few
blocks, which clips shorter than its temporal receptive field (about 21 latent frames) never
show. The loss is L1 + squared error on pixels, the object's pixels (the ground truth's box)
weighted up, since the object covers a few percent of a frame and is what the checker reads,
plus a small penalty on the latents that keeps them bounded for the DiT.

It trains as a deterministic autoencoder (the DiT learns the means): with sampled latents (a
posterior std near 0.9 at the start) the decoder still could not tell colours apart after 400
steps. On one batch, L1 alone at lr 1e-3 left the object at 0.2 mean error after 60 steps; L1 +
squared error at 3e-3 reached 0.09. A run resumes from its last checkpoint; every logged step
goes to `vae_curve.jsonl`.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..models.wan.vae import VAEConfig, WanVAEDecoder, decode_clip
from ..synthetic import Caption, clip
from . import resume, save
from .encoder import WanVAEEncoder


@dataclass
class VAERun:
    steps: int = 3000
    batch: int = 4
    frames: int = 9  # 1 + 4k: the shot's first frame and two 4-frame groups
    chunk: int = 0  # latent frames per chunk of a clip (0: the whole clip at once)
    crop: tuple[int, int] = (64, 48)  # (width, height) of the crop around the object, multiples of 16
    lr: float = 2e-3  # 1e-3 left the background colours unlearnt after 300 steps
    # The cosine schedule runs from the step a run starts (or resumes) at to `steps`: a run that
    # continues a checkpoint with other clips is a new phase with its own warmup.
    kl: float = 1e-4  # on the means only: a deterministic autoencoder whose latents stay bounded
    object_weight: float = 8.0
    seed: int = 0
    log_every: int = 25
    save_every: int = 200


def batch_of(run: VAERun, rng: random.Random, width: int = 256, height: int = 144) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 3, T, h, w) in [-1, 1] and the object mask (B, 1, T, h, w), cropped from full frames
    around the object's path so it is in the crop in most frames."""
    cw, ch = run.crop
    xs, ms = [], []
    for _ in range(run.batch):
        c = clip(Caption.random(rng), frames=run.frames, width=width, height=height, rng=rng)
        boxes = c.boxes
        cx = int(np.clip((boxes[:, 0].mean() + boxes[:, 2].mean()) / 2 - cw / 2 + rng.uniform(-24, 24), 0, width - cw))
        cy = int(np.clip((boxes[:, 1].mean() + boxes[:, 3].mean()) / 2 - ch / 2 + rng.uniform(-24, 24), 0, height - ch))
        f = c.frames[:, cy : cy + ch, cx : cx + cw]
        mask = np.zeros(f.shape[:3], dtype=np.float32)
        for i, (x0, y0, x1, y1) in enumerate(boxes):
            mask[i, max(0, y0 - cy) : max(0, y1 - cy), max(0, x0 - cx) : max(0, x1 - cx)] = 1.0
        xs.append(torch.from_numpy(f).permute(3, 0, 1, 2).float() / 127.5 - 1.0)
        ms.append(torch.from_numpy(mask)[None])
    return torch.stack(xs), torch.stack(ms)


def load_vae(out: Path, cfg: VAEConfig) -> tuple[WanVAEEncoder, WanVAEDecoder, int]:
    """A run's trained encoder and decoder (eval mode, no grad) and the step they reached. The
    decoder de-normalises with mean 0 and std 1 (raw latents) until the DiT's data sets them."""
    state = torch.load(out / "vae.pt", weights_only=True)
    enc, dec = WanVAEEncoder(cfg), WanVAEDecoder(cfg)
    enc.load_state_dict(state["encoder"])
    dec.load_state_dict(state["decoder"])
    dec.mean.zero_()
    dec.std.fill_(1.0)
    for m in (enc, dec):
        m.eval().requires_grad_(False)
    return enc, dec, state["step"]


def train_vae(out: Path, cfg: VAEConfig, run: VAERun, log=print) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(run.seed)
    enc, dec = WanVAEEncoder(cfg), WanVAEDecoder(cfg)
    # The decoder de-normalises with these; training runs in raw latents (set after, from data).
    dec.mean.zero_()
    dec.std.fill_(1.0)
    params = [*enc.parameters(), *dec.parameters()]
    opt = torch.optim.AdamW(params, lr=run.lr, weight_decay=0.0)
    ckpt, modules = out / "vae.pt", {"encoder": enc, "decoder": dec}
    step = start = resume(ckpt, modules, opt, log)
    rng = random.Random(run.seed * 7919 + step)
    curve = (out / "vae_curve.jsonl").open("a")
    t0, acc = time.time(), []
    latents = (run.frames - 1) // 4 + 1
    chunk = run.chunk or latents
    if latents % chunk:
        raise ValueError(f"{latents} latent frames do not split into chunks of {chunk}")
    x = mask = state = None
    i = latents
    while step < run.steps:
        phase = (step - start) / max(1, run.steps - start)
        lr = run.lr * min(1.0, (step - start + 1) / 100) * 0.5 * (1 + math.cos(math.pi * phase))
        for g in opt.param_groups:
            g["lr"] = lr
        if i >= latents:  # a new clip: both caches start at a shot's start
            x, mask = batch_of(run, rng)
            i, state = 0, dec.new_state()
            enc.stream(chunk < latents)
        # Frames of latent frames [i, i + chunk): the first latent frame is one frame, later ones 4.
        f0, f1 = (0 if i == 0 else 1 + 4 * (i - 1)), 1 + 4 * (i + chunk - 1)
        xc, mc = x[:, :, f0:f1], mask[:, :, f0:f1]
        i += chunk
        mu, _ = enc(xc)
        y = decode_clip(dec, mu, state)
        weight = 1.0 + (run.object_weight - 1.0) * mc
        err = y - xc
        rec = ((err.abs() + err.square()) * weight).mean() / weight.mean()
        kl = 0.5 * mu.square().mean()
        loss = rec + run.kl * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        enc.detach_stream()
        state.cache = [None if c is None else c.detach() for c in state.cache]
        step += 1
        with torch.no_grad():
            mse = (y.clamp(-1, 1) - xc).square().mean().item()
            obj = ((y.clamp(-1, 1) - xc).abs() * mc).sum().item() / max(1.0, 3 * mc.sum().item())
        acc.append((rec.item(), kl.item(), mse, obj))
        if step % run.log_every == 0 or step == run.steps:
            r, k, e, o = (float(np.mean(v)) for v in zip(*acc, strict=True))
            rec_row = {
                "step": step,
                "rec_l1": r,
                "kl": k,
                "psnr_db": 10 * math.log10(4.0 / max(e, 1e-10)),
                "object_l1": o,
                "lr": lr,
                "elapsed_s": time.time() - t0,
            }
            curve.write(json.dumps(rec_row) + "\n")
            curve.flush()
            log(
                f"vae step {step}: L1 {r:.4f} (object {o:.3f}), PSNR {rec_row['psnr_db']:.1f} dB, KL {k:.2f}, "
                f"{(time.time() - t0) / len(acc):.2f} s/step"
            )
            acc, t0 = [], time.time()
        if step % run.save_every == 0 or step == run.steps:
            save(ckpt, modules, opt, step)
            (out / "vae_run.json").write_text(json.dumps({**asdict(run), "config": asdict(cfg)}, indent=1))
    curve.close()
