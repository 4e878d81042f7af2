"""Rolling Forcing's sampler: a window of blocks at staggered noise levels (DiT worker process).

Rolling Forcing (TencentARC/RollingForcing, `pipeline/rolling_forcing_inference.py`) denoises
as many blocks together as there are denoising steps, each one level apart: the oldest block of
the window is one step from clean, the youngest is pure noise. One window step is one DiT
forward over the whole window (bidirectional inside it, per-frame timesteps); afterwards every
block is re-noised to its next level, the oldest leaves the window finished, and a new block of
noise enters. In a stream this hides the step count: after the window fills, each forward
finishes one block. The difficulty is the cache: the authors' KV cache keeps only finished
blocks, written by a clean pass (t = context_noise) over the finished block alone, and their
attention reads it two ways (`wan/modules/causal_model.py`, `CausalWanSelfAttention`):

- the window's forward attends to the first block of the shot (the "anchor", re-positioned
  with RoPE to sit just before the frames that follow it here), then the most recent finished
  frames, then the window itself: 21 latent frames at most (`max_attention_size`);
- the clean pass attends to the most recent 21 frames of finished history including itself,
  at their own positions, the first block only while it is among them (no sink there).

Here the finished history is a plain sliding `KVCache` of `window_frames` frames (`store`,
written by the clean pass through `WanDiT.forward_block(commit=True)`), the anchor is a copy of
the first block's keys/values, and each window step assembles anchor + recent frames into a
second cache (`scratch`) that the window's forward reads through the same `forward_block` (the
store is a ring, `KVCache.read` gives its recent frames in order). That
costs a second window of keys/values per session (the authors hold one cache of 24 frames and
concatenate per layer); dit.py is unchanged.

Per-session state is a `RollingState`, passed in. The authors' clean pass also runs after
window steps whose oldest block is not finished yet (the first steps of a shot); those keys are
overwritten before anything reads them, so here the clean pass runs once per finished block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .dit import WanDiT, apply_rope
from .kv_cache import DiTState
from .sampler import SamplerConfig, sigma_of, step_timesteps


@dataclass
class InFlight:
    index: int  # block number within the shot
    x: torch.Tensor  # (1, C, f, h, w) float32: the noisy latent its next forward sees
    level: int  # index into the step list of the timestep it is denoised at next


class RollingState:
    """One session's rolling window: the blocks in flight, oldest (cleanest) first, and the
    caches their forwards read."""

    def __init__(self, model: WanDiT, latent_h: int, latent_w: int, cfg: SamplerConfig) -> None:
        if cfg.sink_frames > cfg.frames_per_block:
            raise ValueError(
                f"the rolling sampler's sink is the shot's first block: sink_frames ({cfg.sink_frames}) "
                f"must be <= frames_per_block ({cfg.frames_per_block})"
            )
        self.frames_per_block = cfg.frames_per_block
        self.window = cfg.window_frames  # attention cap in latent frames, the window's own included
        self.sink = cfg.sink_frames
        # Finished history at its own positions: what the clean pass attends over and writes.
        self.store: DiTState = model.new_state(latent_h, latent_w, cfg.window_frames, 0)
        # Anchor + recent history + the window, rebuilt for each window step (no eviction: sized
        # for the whole window after the anchor even where that exceeds the attention cap).
        in_flight = len(cfg.steps) * cfg.frames_per_block
        self.scratch: DiTState = model.new_state(latent_h, latent_w, max(cfg.window_frames, self.sink + in_flight), 0)
        self.anchor: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer (k, v) of the first `sink` frames
        self.anchor_latent: torch.Tensor | None = None  # the first block's clean latent (for a re-cache)
        self.flight: list[InFlight] = []
        self.entered = 0  # blocks of this shot that have entered the window
        self.finished = 0  # blocks of this shot finished (and written to `store`)

    def new_shot(self) -> None:
        """The next shot in the same buffers: a cut discards the blocks in flight and the history."""
        self.store.new_shot()
        self.scratch.new_shot()
        self.anchor, self.anchor_latent, self.flight, self.entered, self.finished = [], None, [], 0, 0


@dataclass(frozen=True)
class Schedule:
    timesteps: tuple[float, ...]  # the levels, noisiest first
    sigmas: tuple[float, ...]
    context_t: float

    @classmethod
    def of(cls, cfg: SamplerConfig) -> Schedule:
        ts = step_timesteps(cfg.steps, cfg.shift, cfg.warp)
        return cls(tuple(ts), tuple(sigma_of(ts, cfg.shift)), cfg.context_t)


@torch.no_grad()
def next_block(
    model: WanDiT,
    st: RollingState,
    sched: Schedule,
    last: int | None,
    noise_of: Callable[[int], torch.Tensor],
    draw: Callable[[tuple[int, ...]], torch.Tensor],
) -> torch.Tensor:
    """Run window steps until the oldest block in flight is finished; return its clean latent
    (1, C, f, h, w) float32. A new block enters at every step while its index is <= `last` (the
    shot's last block as planned now; None: open-ended, as a live video): so a shot's first call
    runs as many steps as there are levels, later ones one step, and the window drains at the end.
    `noise_of(i)`: block i's initial noise (1, C, f, h, w); `draw(shape)`: re-noising noise."""
    if last is not None:
        # A replan shortened the shot (a stop or a steer): blocks past its end leave unfinished.
        st.flight = [b for b in st.flight if b.index <= last]
        st.entered = min(st.entered, last + 1)
    while True:
        if last is None or st.entered <= last:
            st.flight.append(InFlight(st.entered, noise_of(st.entered).float(), 0))
            st.entered += 1
        if not st.flight:
            raise RuntimeError(f"block {st.finished} is past the shot's last block ({last})")
        done = window_step(model, st, sched, draw)
        if done is not None:
            return done


@torch.no_grad()
def window_step(
    model: WanDiT, st: RollingState, sched: Schedule, draw: Callable[[tuple[int, ...]], torch.Tensor]
) -> torch.Tensor | None:
    """One forward over the window; every block moves one level down. Returns the oldest
    block's clean latent if it was at the last level (it leaves the window and is committed to
    the history), else None."""
    f, blocks = st.frames_per_block, st.flight
    dev = model.patch_embedding.weight.device
    x = torch.cat([b.x.to(dev) for b in blocks], dim=2)  # (1, C, n, h, w)
    _, c, n, h, w = x.shape
    # Per-frame levels filled on the device (a tensor from a Python list would be an upload).
    t = torch.cat([torch.full((f,), sched.timesteps[b.level], device=dev) for b in blocks])[None]
    sig = torch.cat([torch.full((f,), sched.sigmas[b.level], device=dev) for b in blocks]).view(1, 1, n, 1, 1)
    _load_context(model, st, blocks[0].index * f, n)
    x0 = x - sig * model.forward_block(x, t, st.scratch, commit=False)
    finished, last_level = None, len(sched.timesteps) - 1
    for i, b in enumerate(blocks):
        x0_b = x0[:, :, i * f : (i + 1) * f]
        if b.level == last_level:
            if i != 0:
                raise AssertionError(f"block {b.index} finished behind block {blocks[0].index}")
            finished = x0_b
            continue
        # The authors draw a whole window's noise for each block they re-noise and keep the
        # block's frames of it (frame-major: (1, n, C, h, w)); drawn the same way, in block order.
        eps = draw((1, n, c, h, w))[:, i * f : (i + 1) * f].transpose(1, 2).to(dev, torch.float32)
        s1 = sched.sigmas[b.level + 1]
        b.x, b.level = (1.0 - s1) * x0_b + s1 * eps, b.level + 1
    if finished is not None:
        blocks.pop(0)
        _commit(model, st, finished, sched.context_t)
    return finished


def _commit(model: WanDiT, st: RollingState, x0: torch.Tensor, context_t: float) -> None:
    """The clean pass: the finished block at t = context_t writes its keys/values to the history,
    attending to the last `window` frames of it (the store slides, no sink)."""
    f = x0.shape[2]
    model.forward_block(x0, torch.full((1, f), context_t, device=x0.device), st.store, commit=True)
    if st.finished == 0:
        kv, n = st.store.kv, st.sink * st.store.kv.tpf
        st.anchor = [(k[:, :, :n].clone(), v[:, :, :n].clone()) for k, v in zip(kv.k, kv.v, strict=True)]
        st.anchor_latent = x0.float().clone()
    st.finished += 1


def _load_context(model: WanDiT, st: RollingState, start: int, n: int) -> None:
    """Fill `scratch` with what a window of `n` frames at position `start` attends to besides
    itself: the anchor, moved to sit just before the recent frames, and the most recent finished
    frames after the anchor's, so that the total is at most `window` frames. The shot's first
    block still in flight: nothing (the window attends to itself only, as the authors')."""
    sc, kv = st.scratch, st.store.kv
    sc.cross, sc.next_frame = st.store.cross, start
    sc.kv.reset(0)
    if start == 0:
        return
    tpf, s = kv.tpf, st.sink
    recent = max(0, min(st.window - n - s, start - s))
    held = kv.frames
    cos, sin = _frame_rotation(model, start - recent - s)
    for layer in range(len(kv.k)):
        if s:
            ak, av = st.anchor[layer]
            sc.kv.k[layer][:, :, : s * tpf] = apply_rope(ak, cos, sin)
            sc.kv.v[layer][:, :, : s * tpf] = av
        at = s * tpf  # the store is a ring: its recent frames in order, piece by piece
        for k, v in kv.read(layer, held - recent, held):
            sc.kv.k[layer][:, :, at : at + k.shape[2]] = k
            sc.kv.v[layer][:, :, at : at + k.shape[2]] = v
            at += k.shape[2]
    sc.kv.frames = s + recent


def _frame_rotation(model: WanDiT, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (1, 1, pairs) rotating keys stored at frame positions p to p + delta: the frame
    axis' pairs turn by delta, the height and width pairs stay (RoPE rotations compose)."""
    rope, (_, ph, pw) = model.rope(), model.cfg.rope_split()
    fc, fs = rope.frames(delta + 1)  # the frame table's row `delta` is the rotation by delta, on the device
    cos = torch.cat([fc[delta], torch.ones(ph + pw, device=fc.device)])
    sin = torch.cat([fs[delta], torch.zeros(ph + pw, device=fs.device)])
    return cos.view(1, 1, -1), sin.view(1, 1, -1)


@torch.no_grad()
def recache(model: WanDiT, st: RollingState, context: torch.Tensor, context_t: float = 0.0) -> None:
    """Switch the prompt and recompute the finished history's keys/values under it, the anchor
    included: each held block's clean pass again, in order (each attending to the blocks held
    before it, as it was written), then the first block's alone. Not LongLive's one bidirectional
    forward (`WanDiT.recache`): this history was written block by block, so under an unchanged
    prompt the recompute changes nothing."""
    model.set_prompt(st.store, context)
    kv, t = st.store.kv, st.store.next_frame
    held, fpb = kv.frames, st.frames_per_block
    latents = kv.latents_at(range(t - held, t))
    kv.reset(0)
    st.store.next_frame = t - held
    for i in range(0, held, fpb):  # eviction keeps whole blocks: the window holds whole blocks
        x = latents[:, :, i : i + fpb]
        model.forward_block(x, torch.full((x.shape[0], x.shape[2]), context_t, device=x.device), st.store, commit=True)
    if st.anchor_latent is None:
        return
    f = st.anchor_latent.shape[2]
    tmp = model.new_state(*st.anchor_latent.shape[3:], f + 1, 0)
    tmp.cross = st.store.cross
    x = st.anchor_latent.to(model.patch_embedding.weight.device)
    model.forward_block(x, torch.full((1, f), context_t, device=x.device), tmp, commit=True)
    n = st.sink * tmp.kv.tpf
    st.anchor = [(k[:, :, :n].clone(), v[:, :, :n].clone()) for k, v in zip(tmp.kv.k, tmp.kv.v, strict=True)]
