"""Training the embedded default's DiT and text encoder on the synthetic grammar
(tools/train/default.py dit).

Clips are encoded once by the trained VAE's encoder (`encode_dataset`): the encoder's means,
normalised per channel (those statistics become the preset's `latents_mean`/`latents_std`, which
the decoder de-normalises with). Training is flow matching with block-causal attention and clean
context, as in Causal Forcing's autoregressive stage, through the model's own streaming path:
for each block of a clip in order, the block noised to a random shifted sigma is denoised
against the clean blocks before it (loss: the flow eps - x0), then the clean block is committed
to the KV cache at t = 0, as the sampler's cache refresh does at inference. The text encoder
learns with it. Under autograd the cache replaces its buffers instead of writing into them
(models/wan/dit.py), so the graph holds every block's keys.

Two choices make it learn what the checker reads within a CPU budget (issue 36): the noise
levels are the sampler's own few steps (the daemon never asks the model about any other), and
the loss weights the latent pixels the object covers (`object_weight`; a few percent of a frame,
and all of what its colour and direction are read from). The prompts of `synthetic.HELD_OUT`
are never drawn, so what the model draws from them is judged on prompts it has not seen.

The first block is the hard one (sessions 4-6 found the DiT continues its context well and draws
no first block): it alone is drawn from pure noise with nothing before it, and a Wan DiT is blind
to absolute position. Every clip starts with the position canvas (`canvas`, models/wan/canvas.py)
committed before its first block, as the daemon commits it at every cut; half of the first
blocks are drawn at sigma 1 (`from_noise`), and the shot's first latent frame, which the decoder
turns into a picture on its own, weighs more (`first_frame_weight`).

A share of the clips (`switch`) is steered: at a block boundary the object takes another colour
and the prompt says so from that block on, the blocks before staying in the KV cache as they
were committed, as a live steer's `continue` (without re-cache) runs in the daemon.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..models.wan.canvas import position_canvas
from ..models.wan.dit import DiTConfig, WanDiT
from ..models.wan.sampler import SamplerConfig, warped_timesteps
from ..models.wan.text import TinyTextEncoder
from ..models.wan.vae import VAEConfig
from ..synthetic import COLOURS, Caption, clip, held_out_prompts
from . import resume, save
from .vae import frame_range, load_vae

TEXT_LAYERS = 3  # the trained default's text encoder (TinyTextEncoder; the seeded one has 1)


def text_encoder(dit_cfg: DiTConfig, seed: int, layers: int = TEXT_LAYERS) -> TinyTextEncoder:
    return TinyTextEncoder(dit_cfg.text_dim, dit_cfg.text_len, seed=seed, layers=layers)


@dataclass
class DiTRun:
    steps: int = 4000
    batch: int = 4
    blocks: int = 3  # blocks per training clip
    clips: int = 768  # clips encoded once
    lr: float = 5e-4
    object_weight: float = 8.0  # loss weight of the latent pixels the object covers
    switch: float = 0.25  # share of clips whose object changes colour at a block boundary (a steer)
    # How far the clips stray from their prompt's own size, speed and start (synthetic.clip): near
    # 0 a clip is a function of its prompt. At 1 (every start equally likely) a DiT this size had
    # drawn no first block after 1400 steps (issue 36, session 4): from noise, its x0 estimates
    # are the average of every place the object could be, and four steps do not make one of them.
    spread: float = 0.1
    # The first block at sigma 1 is drawn from pure noise, and a Wan DiT has no absolute position
    # (RoPE is relative, the patch embedding a strided convolution): from noise alone it cannot
    # know where "the middle of the left edge" is: neither coupling the noise to the clip nor a
    # flow-ODE first block made it commit to an object (docs/models.md#model-core-models). With
    # the position canvas before the first block (SamplerConfig.canvas) the place is readable, and
    # a probe learnt it within 1500 first blocks, but only with the object weighted at sigma 1 too:
    # unweighted it is 2% of the loss there. Without the canvas the object stays unweighted at
    # sigma 1, where weighting an undecided place paints it everywhere.
    canvas: bool = True
    # The share of first blocks drawn from pure noise (the rest at the sampler's other levels):
    # only there does the prompt alone say what to draw (later blocks have their context, lower
    # levels their input), so at a fair 1 in 4 the text path learnt slowly (issue 36, session 5).
    from_noise: float = 0.5
    # The share of steps that train the first block alone, at twice the batch: the block that
    # has to be drawn from noise, at a third of a four-block step's cost per clip.
    first_only: float = 0.5
    first_frame_weight: float = 4.0  # the shot's first latent frame is quiet (std ~0.5), its decode fragile
    seed: int = 0
    log_every: int = 25
    save_every: int = 200
    save_seconds: float = 300.0  # a killed run loses at most this much wall time


def clip_frames(blocks: int, frames_per_block: int, temporal: int = 4) -> int:
    """Video frames of a shot of `blocks` blocks: the first latent frame is one frame."""
    return 1 + temporal * (blocks * frames_per_block - 1)


def latent_mask(frames: np.ndarray, colour: tuple[int, int, int], spatial: int = 8) -> torch.Tensor:
    """(F, h, w) of 0/1: the latent pixels whose frames and `spatial` x `spatial` pixels hold any
    of the object (its colour, which the background never has), grown by one latent pixel."""
    m = torch.from_numpy((frames == np.array(colour, dtype=np.uint8)).all(-1)).float()  # (n, H, W)
    f = (m.shape[0] - 1) // 4 + 1
    per = torch.stack([m[frame_range(j, 1)].amax(0) for j in range(f)])  # (F, H, W)
    lat = torch.nn.functional.max_pool2d(per[:, None], spatial)  # (F, 1, h, w)
    return torch.nn.functional.max_pool2d(lat, 3, stride=1, padding=1)[:, 0]


def recolour(frames: np.ndarray, start: int, colour: str, to: str) -> np.ndarray:
    """The clip with its object drawn in `to` from frame `start` on (the background never has the
    object's colour, so its pixels are exactly those of `colour`)."""
    out = frames.copy()
    tail = out[start:]
    tail[(tail == np.array(COLOURS[colour], dtype=np.uint8)).all(-1)] = COLOURS[to]
    return out


@torch.no_grad()
def encode_dataset(out: Path, vae_cfg: VAEConfig, sampler: SamplerConfig, run: DiTRun, log=print) -> Path:
    path = out / "latents.pt"
    if path.exists():
        return path
    enc, _, _ = load_vae(out, vae_cfg)
    rng = random.Random(run.seed + 101)
    held_out = {c.prompt for c in held_out_prompts()}  # never trained on
    n = clip_frames(run.blocks, sampler.frames_per_block)
    lat, masks, prompts, t0 = [], [], [], time.time()
    while len(lat) < run.clips:
        cap = Caption.random(rng)
        c = clip(cap, frames=n, rng=rng, spread=run.spread)
        frames, caps = c.frames, [cap] * run.blocks
        if run.blocks > 1 and rng.random() < run.switch:
            k = rng.randrange(1, run.blocks)
            steered = replace(cap, colour=rng.choice([x for x in COLOURS if x not in (cap.colour, cap.background)]))
            frames = recolour(frames, frame_range(k * sampler.frames_per_block, 1).start, cap.colour, steered.colour)
            caps = [cap] * k + [steered] * (run.blocks - k)
        if any(x.prompt in held_out for x in caps):
            continue
        mask = torch.stack([latent_mask(frames, COLOURS[x]) for x in {x.colour for x in caps}]).amax(0)
        video = torch.from_numpy(frames).permute(3, 0, 1, 2)[None].float() / 127.5 - 1.0
        lat.append(enc(video)[0][0])
        masks.append(mask.to(torch.uint8))
        prompts.append([x.prompt for x in caps])
        if len(lat) % 64 == 0:
            log(f"encoded {len(lat)} of {run.clips} clips ({time.time() - t0:.0f}s)")
    z = torch.stack(lat)  # (N, C, F, h, w)
    mean = z.mean(dim=(0, 2, 3, 4))
    std = z.std(dim=(0, 2, 3, 4)).clamp_min(1e-3)
    torch.save({"latents": z, "masks": torch.stack(masks), "prompts": prompts, "mean": mean, "std": std}, path)
    return path


def train_dit(out: Path, dit_cfg: DiTConfig, sampler: SamplerConfig, run: DiTRun, text_seed: int, log=print) -> None:
    data = torch.load(out / "latents.pt", weights_only=False)
    mean, std = data["mean"].view(1, -1, 1, 1, 1), data["std"].view(1, -1, 1, 1, 1)
    z_all = (data["latents"] - mean) / std
    prompts = data["prompts"]
    masks = data["masks"].float()  # (N, F, h, w)
    sigmas = torch.tensor(warped_timesteps(sampler.steps, sampler.shift)) / 1000.0
    torch.manual_seed(run.seed)
    model, text = WanDiT(dit_cfg), text_encoder(dit_cfg, text_seed)
    params = [*model.parameters(), *text.parameters()]
    opt = torch.optim.AdamW(params, lr=run.lr, weight_decay=0.01)
    ckpt, modules = out / "dit.pt", {"dit": model, "text": text}
    step = resume(ckpt, modules, opt, log)
    rng = np.random.default_rng(run.seed * 7919 + step)
    fpb, h, w = sampler.frames_per_block, z_all.shape[-2], z_all.shape[-1]
    canvas = position_canvas(z_all.shape[1], h, w)
    curve = (out / "dit_curve.jsonl").open("a")
    t0, acc, acc1, last_save = time.time(), [], [], time.time()
    model.train()
    while step < run.steps:
        lr = run.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / run.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        alone = rng.random() < run.first_only  # the first block alone, at twice the batch
        nblocks, batch = (1, 2 * run.batch) if alone else (run.blocks, run.batch)
        idx = rng.choice(len(prompts), size=batch, replace=False)
        x0, mask = z_all[idx], masks[idx]
        b = x0.shape[0]
        pick = torch.where(torch.rand(b) < run.from_noise, 0, torch.randint(1, len(sigmas), (b,)))
        sigma0 = sigmas[pick].view(b, 1, 1, 1, 1)  # the first block's (sigmas[0] is 1)
        eps0 = torch.randn_like(x0[:, :, :fpb])
        wt = 1.0 + (run.object_weight - 1.0) * mask[:, None]  # (b, 1, F, h, w)
        if not run.canvas:  # its place not decided by anything it sees: unweighted (DiTRun.canvas)
            wt[sigma0.view(b) == 1.0, :, :fpb] = 1.0
        wt[:, :, 0] *= run.first_frame_weight
        state = model.new_state(h, w, sampler.window_frames, sampler.sink_frames, batch=b)
        start = canvas.expand(b, -1, -1, -1, -1)
        losses, said = [], None
        for k in range(nblocks):
            now = [prompts[i][k] for i in idx]
            if now != said:  # the first block, or a steer: the prompt the block is generated under
                ctx = model.text_embedding(text(now))
                state.cross, said = [blk.cross_attn.project_context(ctx) for blk in model.blocks], now
                if k == 0 and run.canvas:  # committed under the prompt, as the daemon does at a cut
                    model._forward(start, torch.full((b, 1), sampler.context_t), [state], commit=True)
            xb = x0[:, :, k * fpb : (k + 1) * fpb]
            sigma = sigma0 if k == 0 else sigmas[torch.randint(len(sigmas), (b,))].view(b, 1, 1, 1, 1)
            eps = eps0 if k == 0 else torch.randn_like(xb)
            xt = (1 - sigma) * xb + sigma * eps
            t = (1000 * sigma).view(b, 1).expand(b, fpb)
            v = model._forward(xt, t, [state], commit=False)
            wk = wt[:, :, k * fpb : (k + 1) * fpb]
            losses.append(((v - (eps - xb)).square() * wk).mean() / wk.mean())
            if k + 1 < nblocks:  # the last block's keys feed nothing
                model._forward(xb, torch.full((b, fpb), sampler.context_t), [state], commit=True)
        loss = torch.stack(losses).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        (acc1 if alone else acc).append([x.item() for x in losses])
        if (step % run.log_every == 0 or step == run.steps) and (acc or acc1):
            row, parts = {"step": step, "lr": lr}, []
            if acc:  # the four-block steps' loss, per block
                row["per_block"] = np.mean(acc, axis=0).tolist()
                row["loss"] = float(np.mean(row["per_block"]))
                parts.append(f"loss {row['loss']:.4f} (blocks {', '.join(f'{x:.3f}' for x in row['per_block'])})")
            if acc1:  # the first-block-alone steps' loss
                row["first_alone"] = float(np.mean(acc1))
                parts.append(f"first block alone {row['first_alone']:.4f}")
            row["elapsed_s"] = time.time() - t0
            curve.write(json.dumps(row) + "\n")
            curve.flush()
            log(f"dit step {step}: {', '.join(parts)}, {row['elapsed_s'] / (len(acc) + len(acc1)):.2f} s/step")
            acc, acc1, t0 = [], [], time.time()
        if step % run.save_every == 0 or step == run.steps or time.time() - last_save >= run.save_seconds:
            save(ckpt, modules, opt, step)
            last_save = time.time()
            (out / "dit_run.json").write_text(json.dumps({**asdict(run), "config": asdict(dit_cfg)}, indent=1))
    curve.close()


def export_dit(out: Path, dit_cfg: DiTConfig, sampler: dict, text_seed: int, dest: Path) -> Path:
    """The run's DiT and text encoder as the embedded default's shipped weights
    (presets.trained_dit): `dit.*` and `text.*` tensors, and in the metadata the configuration
    they were trained at and the sampler settings (`sampler`, those that differ from the preset's)
    they were trained to sample with, and the text encoder's depth."""
    from safetensors.torch import save_file

    state = torch.load(out / "dit.pt", weights_only=True)
    model, text = WanDiT(dit_cfg), text_encoder(dit_cfg, text_seed)
    model.load_state_dict(state["dit"])  # the checkpoint fits the configuration it is exported with
    text.load_state_dict(state["text"])
    sd = {f"dit.{k}": v.contiguous() for k, v in model.state_dict().items()}
    sd.update({f"text.{k}": v.contiguous() for k, v in text.state_dict().items()})
    meta = {"dit": json.dumps(asdict(dit_cfg)), "sampler": json.dumps(sampler), "step": str(state["step"])}
    meta["text"] = json.dumps({"layers": len(text.layers) + 1})
    dest.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(dest), metadata=meta)
    return dest
