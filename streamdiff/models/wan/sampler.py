"""Few-step flow-matching sampler for block-causal generation (runs in the DiT worker process).

One call denoises one block of one session (Self-Forcing / Causal Forcing inference): for each
timestep of the step list, predict the flow v, take x0 = x_t - sigma_t * v, and re-noise x0 to
the next sigma with fresh noise; then run the model once more on the clean x0 at t = 0 with
`commit=True`, so the KV cache holds clean keys/values for the blocks that follow.

Sampler kind `unipc` (LongLive 2.0): a fresh UniPC multistep solver per block (unipc.py) on the
authors' flow schedule of len(steps) steps, no fresh noise after the first, then the same clean
pass. Its `steps` are the solver's timesteps, rounded (checked: `unipc_timesteps`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .dit import WanDiT
from .kv_cache import DiTState
from .unipc import FlowUniPC, flow_sigmas

# The words LongLive 2.0's training data start a new shot's prompt with (its utils/dataset.py):
# a multi-shot transition's prompt carries them (DiTEngine.set_scene)
SHOT_PREFIX = "The scene transitions. "


@dataclass(frozen=True)
class SamplerConfig:
    frames_per_block: int = 3  # latent frames per block: 3 chunk-wise, 1 frame-wise
    steps: tuple[int, ...] = (1000, 750, 500, 250)  # raw step list, warped by `shift`
    first_block_steps: tuple[int, ...] | None = None  # e.g. 4 steps for 1-step models' first block
    shift: float = 5.0  # flow-matching timestep shift
    window_frames: int = 21  # local attention window incl. the current block (KV cache size)
    sink_frames: int = 0  # frames at the start of a shot never evicted from the window
    context_t: float = 0.0  # timestep of the clean cache-refresh pass
    warp: bool = True  # map `steps` through the shifted schedule (Self-Forcing's warp_denoising_step)
    global_sink: bool = False  # a re-cache keeps the sinks' keys/values as written (LongLive)
    recache: str = "on_request"  # never | on_request | every_switch: prompt switches that recompute the cache
    # block | rolling (Rolling Forcing: blocks in flight at staggered noise levels) | unipc
    kind: str = "block"
    kv_recompute: bool = False  # Krea: each block first recomputes its context's keys/values
    # A shot starts with the position canvas (canvas.py) committed at t = 0 as its sink frame: the
    # trained tiny default's absolute position (a Wan DiT has none). Never decoded.
    canvas: bool = False
    # LongLive 2.0's multi-shot: a cut keeps the visual history, and the next shot's RoPE positions
    # move on by this many frames a shot, its prompt marked (SHOT_PREFIX), and the first sink
    # frames of its first block pinned as the shot sink (KVCache.pin). 0: a cut starts afresh.
    shot_offset: int = 0

    def validate(self) -> None:
        if self.recache not in ("never", "on_request", "every_switch"):
            raise ValueError(f"recache must be never, on_request or every_switch, got {self.recache!r}")
        if self.kind not in ("block", "rolling", "unipc"):
            raise ValueError(f"sampler kind must be block, rolling or unipc, got {self.kind!r}")
        if self.kind == "unipc":
            unipc_timesteps(self.steps, self.shift)
            unipc_timesteps(self.first_block_steps or self.steps, self.shift)
        if self.frames_per_block < 1:
            raise ValueError(f"frames_per_block must be >= 1, got {self.frames_per_block}")
        for name, steps in (("steps", self.steps), ("first_block_steps", self.first_block_steps or (1,))):
            # 0 may only end a list (Krea's last pass at t = 0, after re-noising to the smallest sigma)
            if not steps or any(not 0 < s <= 1000 for s in steps[:-1]) or not 0 <= steps[-1] <= 1000 or steps[0] == 0:
                raise ValueError(
                    f"{name} must be a non-empty list of integers in 1..1000 (a last 0 allowed), got {steps}"
                )
        if self.kv_recompute and self.kind != "block":  # Krea's recompute replaces the block sampler's clean pass
            raise ValueError(f"kv_recompute needs the block sampler, not {self.kind!r}")
        if self.canvas and (self.kind != "block" or self.sink_frames < 1 or self.kv_recompute):
            raise ValueError("canvas needs the block sampler, a sink frame to hold it and no kv_recompute")
        if self.shot_offset < 0:
            raise ValueError(f"shot_offset must be >= 0, got {self.shot_offset}")
        if self.shot_offset and (self.kind == "rolling" or self.sink_frames < 1 or self.recache != "never"):
            # a re-cache would lay every held frame at the current shot's positions
            raise ValueError(
                "shot_offset needs the block or unipc sampler, sink frames for the shot sink and recache 'never'"
            )
        if self.window_frames - self.sink_frames < self.frames_per_block:
            raise ValueError(
                f"window_frames ({self.window_frames}) - sink_frames ({self.sink_frames}) "
                f"must hold a block of {self.frames_per_block} frames"
            )


def unipc_timesteps(steps: Sequence[int], shift: float) -> list[float]:
    """The UniPC solver's timesteps for a step list of its length (`flow_sigmas`), which the
    list must give rounded: the preset says what runs (LongLive 2.0's 4 steps at shift 5 are
    1000, 937, 833, 625), and a list that is not the solver's is refused, naming both."""
    ts = [1000.0 * s for s in flow_sigmas(len(steps), shift)[:-1]]
    if [round(t) for t in ts] != list(steps):
        raise ValueError(
            f"a unipc sampler's steps are its solver's timesteps at shift {shift:g}: "
            f"{[round(t) for t in ts]} for {len(steps)} steps, got {list(steps)}"
        )
    return ts


def _schedule(shift: float) -> torch.Tensor:
    """The shifted flow-matching schedule of the authors' scheduler (FlowMatchScheduler with 1000
    steps and `extra_one_step`): sigma = linspace(1, 0, 1001)[:-1], sigma' = s*sigma/(1+(s-1)*sigma),
    as timesteps t = 1000*sigma' (float64)."""
    sigma = torch.linspace(1.0, 0.0, 1001, dtype=torch.float64)[:-1]
    return 1000.0 * shift * sigma / (1 + (shift - 1) * sigma)


def warped_timesteps(steps: Sequence[float], shift: float) -> list[float]:
    """Map raw steps (1000 = pure noise) to shifted timesteps, as Self-Forcing's
    `warp_denoising_step`: step k selects t[1000 - k] of the shifted schedule, which is the
    shift applied to sigma = k / 1000; written as the formula so that Krea's last step, 0, maps
    to 0 (its schedule is linspace(1000, 0, n) warped the same way)."""
    out = []
    for k in steps:
        sigma = torch.tensor(float(k) / 1000.0, dtype=torch.float64)
        out.append(float(1000.0 * shift * sigma / (1 + (shift - 1) * sigma)))
    return out


def step_timesteps(steps: Sequence[int], shift: float, warp: bool) -> list[float]:
    """The timesteps a step list runs at: warped (above), or as written (CausVid, Krea)."""
    return warped_timesteps(steps, shift) if warp else [float(k) for k in steps]


def sigma_of(timesteps: Sequence[float], shift: float) -> list[float]:
    """Each timestep's sigma as the authors' scheduler converts it: the sigma of the nearest
    timestep of the shifted schedule. A warped step is on the schedule (sigma = t / 1000); a step
    as written (CausVid's 757 under shift 8) takes its nearest neighbour there."""
    t = _schedule(shift)
    return [float(t[int(torch.argmin((t - float(x)).abs()))]) / 1000.0 for x in timesteps]


@torch.no_grad()
def denoise_block(
    model: WanDiT,
    state: DiTState,
    noise: torch.Tensor,
    timesteps: Sequence[float],
    renoise: Sequence[torch.Tensor],
    context_t: float = 0.0,
    sigmas: Sequence[float] | None = None,
    commit: bool = True,
    unipc: bool = False,
    hold: torch.Tensor | None = None,
) -> torch.Tensor:
    """Denoise one block and commit it to the session's KV cache (`commit=False`: leave the
    commit to the caller, as Krea's per-block recompute does, `WanDiT.commit_and_recompute`).
    `hold`: clean latent frames (B, C, n, H, W) that are the block's first n, held through every
    step at t = 0 (LongLive 2.0's image-to-video first block; the UniPC solver only).

    noise: (B, C, f, H, W) initial noise; renoise: one noise tensor per step after the first;
    sigmas: each step's noise level (`sigma_of`; default timestep / 1000, exact for warped steps).
    unipc: the UniPC solver steps between the timesteps instead (no renoise).
    Returns the clean latent x0 (float32, on the model's device).
    """
    b, dev = noise.shape[0], model.patch_embedding.weight.device
    steps = _on_device([[t] * b for t in timesteps], dev)
    sig = _on_device([[s] * b for s in sigmas], dev) if sigmas is not None else steps / 1000.0
    forward = lambda x, t, c: model.forward_block(x, t, state, c)  # noqa: E731
    if unipc:
        return _denoise_unipc(forward, model, noise, timesteps, context_t, commit, hold)
    if hold is not None:
        raise ValueError("holding a block's first frames clean is the UniPC sampler's (LongLive 2.0)")
    return _denoise(forward, model, noise, steps, sig, renoise, context_t, commit)


@torch.no_grad()
def denoise_sessions(
    model: WanDiT,
    states: list[DiTState],
    noise: torch.Tensor,
    timesteps: Sequence[Sequence[float]],
    renoise: Sequence[torch.Tensor],
    context_t: float = 0.0,
    sigmas: Sequence[Sequence[float]] | None = None,
    commit: bool = True,
    unipc: bool = False,
) -> torch.Tensor:
    """`denoise_block` for several sessions at once: row i of noise/renoise is session i's, and
    `timesteps[i]` (`sigmas[i]`) its step list (all of one length: the sessions take their steps together)."""
    if len({len(ts) for ts in timesteps}) != 1:
        raise ValueError("sessions denoised together must have step lists of one length")
    dev = model.patch_embedding.weight.device
    steps = _on_device([list(col) for col in zip(*timesteps, strict=True)], dev)  # (steps, S)
    sig = _on_device([list(col) for col in zip(*sigmas, strict=True)], dev) if sigmas is not None else steps / 1000.0
    forward = lambda x, t, c: model.forward_sessions(x, t, states, c)  # noqa: E731
    if unipc:  # one step list for all (the solver's coefficients are the same numbers)
        if len({tuple(ts) for ts in timesteps}) != 1:
            raise ValueError("sessions solved together by UniPC must share their step list")
        return _denoise_unipc(forward, model, noise, timesteps[0], context_t, commit)
    return _denoise(forward, model, noise, steps, sig, renoise, context_t, commit)


def _on_device(rows: list[list[float]], dev: torch.device) -> torch.Tensor:
    """A (rows, cols) float32 table of Python numbers made on the device by fills: a tensor made
    from a list is an upload, which from pageable memory waits for the device's queue to drain."""
    return torch.stack([torch.cat([torch.full((1,), float(x), device=dev) for x in row]) for row in rows])


def _denoise(
    forward, model: WanDiT, noise, steps: torch.Tensor, sigmas: torch.Tensor, renoise, context_t: float, commit: bool
) -> torch.Tensor:
    """The few-step flow sampler; steps, sigmas: (n_steps, B), one column per row of the batch.
    For each step: x0 = x - sigma * v; then re-noise to the next step's sigma; finally one pass at
    t = context_t commits the clean block's keys/values to the cache."""
    b, _, f = noise.shape[:3]
    dev = model.patch_embedding.weight.device
    x = noise.to(dev, torch.float32)
    x0 = x
    for i in range(steps.shape[0]):
        t = steps[i]  # (B,)
        v = forward(x, t[:, None].expand(b, f), False)
        sigma = sigmas[i].view(b, 1, 1, 1, 1)
        x0 = x - sigma * v
        if i + 1 < steps.shape[0]:
            s_next = sigmas[i + 1].view(b, 1, 1, 1, 1)
            x = (1.0 - s_next) * x0 + s_next * renoise[i].to(dev, torch.float32)
    if commit:
        forward(x0, torch.full((b, f), context_t, device=dev), True)
    return x0


def _denoise_unipc(
    forward, model: WanDiT, noise, timesteps: Sequence[float], context_t: float, commit: bool, hold=None
):
    """A fresh UniPC solver over the block (LongLive 2.0's `FlowUniPCMultistepScheduler` per
    chunk): the flow at each timestep, one solver step, the last landing on x0; then the clean
    pass. The solver's coefficients are Python floats: no host synchronisation. `hold` (its
    image-to-video): the block's first frames overwritten with it before and after every step,
    their timesteps 0 (`utils/i2v_conditioning.py`)."""
    b, _, f = noise.shape[:3]
    dev = model.patch_embedding.weight.device
    solver = FlowUniPC([t / 1000.0 for t in timesteps] + [0.0])
    x = noise.to(dev, torch.float32)
    n = 0 if hold is None else hold.shape[2]

    def held(x: torch.Tensor) -> torch.Tensor:
        return x if not n else torch.cat([hold.to(x.dtype).expand(b, -1, -1, -1, -1), x[:, :, n:]], dim=2)

    for t in timesteps:
        x = held(x)
        ts = torch.full((b, f), t, device=dev)
        ts[:, :n] = 0.0
        x = held(solver.step(forward(x, ts, False), x))
    if commit:
        forward(x, torch.full((b, f), context_t, device=dev), True)
    return x
