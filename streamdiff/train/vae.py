"""Training the embedded default's VAE on the synthetic grammar (tools/train/default.py vae).

The decoder is the shipped `WanVAEDecoder` at the tiny preset's widths, trained through the same
modules and kernels it decodes with (`decode_clip`); the encoder is the daemon's image encoder
(`WanVAEEncoder`, the same modules under autograd), thrown away after. Clips come from
`synthetic.clip`: 1 + 4k frames of a captioned object, cropped around the object. Long clips
train chunk by chunk (`chunk`): encoder and decoder carry their causal caches from one chunk to
the next, detached (truncated backpropagation through time), one optimiser step
per chunk (or, with `one_chunk`, one step per clip on a random chunk after the earlier ones ran
forward only), so the decoder learns the steady state a streamed video reaches after the first few
blocks, which clips shorter than its temporal receptive field (about 21 latent frames) never
show. The loss is L1 + squared error on pixels, the object's pixels (its drawn shape, not its
box) weighted up, since the object covers a few percent of a frame and is what the checker reads,
and a band of `edge_px` pixels either side of its outline weighted up again (`edge_mask`): the
first attempt's colour misses were a soft edge, whose in-between colours the checker averages
into the object's (issue 36). Plus a small penalty on the latents that keeps them bounded for the
DiT.

Issue 36's recipe trains long clips chunk by chunk from the first step (no short-clip phase that
learns a context of zero padding, which later phases had to unlearn), on crops around the object
to keep a step cheap. A run saves a resumable checkpoint every `save_every` steps or
`save_seconds` of wall time, whichever comes first, and keeps a copy every `keep_every` steps
(`vae_step{N}.pt`: the milestones a repository may hold). The learning rate is a function of the
step within a phase: a run that resumes its own recipe continues the schedule it was on; one
that resumes with another recipe starts a new phase (its own warmup and cosine) at that step.

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
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..models.wan.vae import VAEConfig, WanVAEDecoder, decode_clip
from ..models.wan.vae_encoder import WanVAEEncoder
from ..synthetic import COLOURS, Caption, clip
from . import resume, save


@dataclass
class VAERun:
    steps: int = 3000
    batch: int = 4
    frames: int = 9  # 1 + 4k: the shot's first frame and two 4-frame groups
    chunk: int = 0  # latent frames per chunk of a clip (0: the whole clip at once)
    # One optimiser step per clip, on a chunk drawn at random, the chunks before it run forward
    # only (no grad) to fill both caches: each step sees fresh clips, a shot's start (the first
    # chunk) or its steady state, instead of `frames / chunk` steps in a row on the same clips.
    one_chunk: bool = False
    crop: tuple[int, int] = (64, 48)  # (width, height) of the crop around the object, multiples of 16
    lr: float = 2e-3  # 1e-3 left the background colours unlearnt after 300 steps
    # The cosine schedule runs from the step a run starts (or resumes) at to `steps`: a run that
    # continues a checkpoint with other clips is a new phase with its own warmup.
    kl: float = 1e-4  # on the means only: a deterministic autoencoder whose latents stay bounded
    object_weight: float = 8.0
    edge_weight: float = 8.0  # added on the band around the object's outline
    edge_px: int = 1  # the band: pixels either side of the outline
    seed: int = 0
    log_every: int = 25
    save_every: int = 200
    save_seconds: float = 600.0  # a killed run loses at most this much wall time
    keep_every: int = 0  # copy the checkpoint to vae_step{N}.pt every N steps (0: never)
    # Train the decoder alone on the encoder's latents as they are: once the DiT's data set is
    # encoded, the decoder goes on learning without moving the latents the DiT learns.
    freeze_encoder: bool = False

    def recipe(self) -> dict:
        """What makes two runs the same phase of the learning-rate schedule."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if k in _RECIPE}


_RECIPE = (
    "steps",
    "batch",
    "frames",
    "chunk",
    "one_chunk",
    "crop",
    "lr",
    "kl",
    "object_weight",
    "edge_weight",
    "edge_px",
    "freeze_encoder",
)


def batch_of(run: VAERun, rng: random.Random, width: int = 256, height: int = 144) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 3, T, h, w) in [-1, 1] and the object's mask (B, 1, T, h, w): its drawn pixels (clips
    are flat colours and the object never has the background's), cropped from full frames around
    the object's path so it is in the crop in most frames."""
    cw, ch = run.crop
    xs, ms = [], []
    for _ in range(run.batch):
        c = clip(Caption.random(rng), frames=run.frames, width=width, height=height, rng=rng)
        boxes = c.boxes
        cx = int(np.clip((boxes[:, 0].mean() + boxes[:, 2].mean()) / 2 - cw / 2 + rng.uniform(-24, 24), 0, width - cw))
        cy = int(np.clip((boxes[:, 1].mean() + boxes[:, 3].mean()) / 2 - ch / 2 + rng.uniform(-24, 24), 0, height - ch))
        f = c.frames[:, cy : cy + ch, cx : cx + cw]
        mask = (f == np.array(COLOURS[c.caption.colour], dtype=np.uint8)).all(-1).astype(np.float32)
        xs.append(torch.from_numpy(f).permute(3, 0, 1, 2).float() / 127.5 - 1.0)
        ms.append(torch.from_numpy(mask)[None])
    return torch.stack(xs), torch.stack(ms)


def frame_range(i: int, n: int) -> slice:
    """The frames of latent frames [i, i + n): the shot's first latent frame is one frame, later ones 4."""
    return slice(0 if i == 0 else 1 + 4 * (i - 1), 1 + 4 * (i + n - 1))


def edge_mask(mask: torch.Tensor, px: int = 1) -> torch.Tensor:
    """The band of `px` pixels either side of the outline of each frame's mask (B, 1, T, h, w):
    the mask dilated minus the mask eroded."""
    k = (1, 2 * px + 1, 2 * px + 1)
    dilated = torch.nn.functional.max_pool3d(mask, k, stride=1, padding=(0, px, px))
    eroded = 1.0 - torch.nn.functional.max_pool3d(1.0 - mask, k, stride=1, padding=(0, px, px))
    return dilated - eroded


# The keys a run's checkpoint gave its encoder before it was the daemon's (train/encoder.py,
# until 2026-12-07): the same modules in the same order, under other names: `quant` is the
# release's `conv1`, the rest sits under `encoder.`.
_RUN_KEYS = (
    (re.compile(r"\.residual\.5\."), ".residual.6."),  # the release's Dropout at 5
    (re.compile(r"^(encoder\.downsamples\.\d+)\.resample\."), r"\1.resample.1."),  # after its ZeroPad2d
)


def _run_keys(module, state_dict, prefix, *_):
    """load_state_dict's pre-hook: an older run's encoder keys renamed (resume and load_vae)."""
    if not any(k.startswith(prefix + "quant.") for k in state_dict):
        return
    for k in [k for k in state_dict if k.startswith(prefix)]:
        new = k[len(prefix) :]
        new = "conv1." + new[len("quant.") :] if new.startswith("quant.") else "encoder." + new
        for pattern, repl in _RUN_KEYS:
            new = pattern.sub(repl, new)
        state_dict[prefix + new] = state_dict.pop(k)


def encoder(cfg: VAEConfig) -> WanVAEEncoder:
    """The encoder a run trains beside the decoder; it loads older runs' checkpoints too."""
    enc = WanVAEEncoder(cfg)
    enc.register_load_state_dict_pre_hook(_run_keys)
    return enc


def load_vae(out: Path, cfg: VAEConfig) -> tuple[WanVAEEncoder, WanVAEDecoder, int]:
    """A run's trained encoder and decoder (eval mode, no grad) and the step they reached. The
    decoder de-normalises with mean 0 and std 1 (raw latents) until the DiT's data sets them."""
    state = torch.load(out / "vae.pt", weights_only=True)
    enc, dec = encoder(cfg), WanVAEDecoder(cfg)
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
    enc, dec = encoder(cfg), WanVAEDecoder(cfg)
    # The decoder de-normalises with these; training runs in raw latents (set after, from data).
    dec.mean.zero_()
    dec.std.fill_(1.0)
    params = [*enc.parameters(), *dec.parameters()]
    opt = torch.optim.AdamW(params, lr=run.lr, weight_decay=0.0)
    ckpt, modules = out / "vae.pt", {"encoder": enc, "decoder": dec}
    meta: dict = {}
    step = resume(ckpt, modules, opt, log, meta)
    # The same recipe continues its schedule (a killed or paused run); another starts a phase here.
    start = meta["phase_start"] if meta.get("recipe") == run.recipe() else step
    meta = {"phase_start": start, "recipe": run.recipe()}
    last_save = time.time()
    rng = random.Random(run.seed * 7919 + step)
    curve = (out / "vae_curve.jsonl").open("a")
    t0, acc = time.time(), []
    latents = (run.frames - 1) // 4 + 1
    chunk = run.chunk or latents
    if latents % chunk:
        raise ValueError(f"{latents} latent frames do not split into chunks of {chunk}")
    # Its optimiser state stays in the checkpoint; AdamW skips parameters without a gradient.
    enc.requires_grad_(not run.freeze_encoder)
    x = mask = state = enc_state = None
    i = latents
    while step < run.steps:
        phase = (step - start) / max(1, run.steps - start)
        lr = run.lr * min(1.0, (step - start + 1) / 100) * 0.5 * (1 + math.cos(math.pi * phase))
        for g in opt.param_groups:
            g["lr"] = lr
        if i >= latents:  # a new clip: both caches start at a shot's start
            x, mask = batch_of(run, rng)
            i, state, enc_state = 0, dec.new_state(), enc.new_state()
            if run.one_chunk:  # the chunks before a random one only fill the caches
                with torch.no_grad():
                    for _ in range(rng.randrange(latents // chunk)):
                        decode_clip(dec, enc(x[:, :, frame_range(i, chunk)], enc_state)[0], state)
                        i += chunk
        xc, mc = x[:, :, frame_range(i, chunk)], mask[:, :, frame_range(i, chunk)]
        i = latents if run.one_chunk else i + chunk
        mu, _ = enc(xc, enc_state)
        y = decode_clip(dec, mu, state)
        edge = edge_mask(mc, run.edge_px)
        weight = 1.0 + (run.object_weight - 1.0) * mc + run.edge_weight * edge
        err = y - xc
        rec = ((err.abs() + err.square()) * weight).mean() / weight.mean()
        kl = 0.5 * mu.square().mean()
        loss = rec + run.kl * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        for st in (state, enc_state):  # truncated backpropagation through time
            st.cache = [None if c is None else c.detach() for c in st.cache]
        step += 1
        with torch.no_grad():
            mse = (y.clamp(-1, 1) - xc).square().mean().item()
            ad = (y.clamp(-1, 1) - xc).abs()
            obj = (ad * mc).sum().item() / max(1.0, 3 * mc.sum().item())
            edg = (ad * edge).sum().item() / max(1.0, 3 * edge.sum().item())
        acc.append((rec.item(), kl.item(), mse, obj, edg))
        if step % run.log_every == 0 or step == run.steps:
            r, k, e, o, ed = (float(np.mean(v)) for v in zip(*acc, strict=True))
            rec_row = {
                "step": step,
                "rec_l1": r,
                "kl": k,
                "psnr_db": 10 * math.log10(4.0 / max(e, 1e-10)),
                "object_l1": o,
                "edge_l1": ed,
                "lr": lr,
                "elapsed_s": time.time() - t0,
            }
            curve.write(json.dumps(rec_row) + "\n")
            curve.flush()
            log(
                f"vae step {step}: L1 {r:.4f} (object {o:.3f}, edge {ed:.3f}), PSNR {rec_row['psnr_db']:.1f} dB, "
                f"KL {k:.2f}, {(time.time() - t0) / len(acc):.2f} s/step"
            )
            acc, t0 = [], time.time()
        if step % run.save_every == 0 or step == run.steps or time.time() - last_save >= run.save_seconds:
            save(ckpt, modules, opt, step, meta)
            last_save = time.time()
            (out / "vae_run.json").write_text(json.dumps({**asdict(run), "config": asdict(cfg)}, indent=1))
            if run.keep_every and step % run.keep_every == 0:
                shutil.copyfile(ckpt, out / f"vae_step{step}.pt")
    curve.close()


def export_vae(out: Path, cfg: VAEConfig, dest: Path) -> Path:
    """The run's decoder as the embedded default's shipped weights (presets.load_embedded_vae):
    its parameters, and the latent statistics of the DiT's data set (`latents.pt`) where the DiT
    stage has encoded one, else mean 0 and std 1 (the raw latents it was trained on)."""
    from safetensors.torch import save_file

    _, dec, _ = load_vae(out, cfg)
    data = out / "latents.pt"
    if data.exists():
        d = torch.load(data, weights_only=False)
        dec.mean.copy_(d["mean"].view_as(dec.mean))
        dec.std.copy_(d["std"].view_as(dec.std))
    sd = {k: v.contiguous() for k, v in dec.state_dict().items()}
    sd.update(mean=dec.mean.contiguous(), std=dec.std.contiguous())
    dest.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(dest))
    return dest
