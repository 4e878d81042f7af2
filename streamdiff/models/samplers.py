"""The samplers a DiT engine runs, behind one interface (as diffusers' schedulers share `step`):
how a block is denoised, what holds its window, and how a continuing scene re-caches it.

- `BlockSampler`: the step list (warped through the shifted schedule, or not), a re-noising draw
  after every step but the last, the clean pass at t = context_t committing the block (Self-Forcing,
  Causal Forcing, CausVid, LongLive).
- `UniPCSampler`: LongLive 2.0's multistep solver: its own timesteps, no noise after the first.
- `RecomputeSampler`: Krea's: no clean pass; the block's context is recomputed under the prompt
  after each block, which also commits it (`WanDiT.commit_and_recompute`).
- `RollingSampler`: Rolling Forcing's window of blocks at staggered noise levels (wan/rolling.py):
  one window step per finished block, its sessions one after another.

One is chosen when the engine is built (`sampler_for`, from the preset's `SamplerConfig`); the
engine asks it, and does not branch on the kind.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .wan import rolling
from .wan.dit import WanDiT
from .wan.kv_cache import DiTState
from .wan.sampler import SamplerConfig, denoise_block, denoise_sessions, step_timesteps, unipc_timesteps


class BlockSampler:
    kind = "block"

    def __init__(self, cfg: SamplerConfig) -> None:
        self.cfg = cfg
        self.timesteps = self.schedule(cfg.steps)
        self.first_timesteps = self.schedule(cfg.first_block_steps or cfg.steps)

    def schedule(self, steps) -> list[float]:
        """A step list's timesteps."""
        return step_timesteps(steps, self.cfg.shift, self.cfg.warp)

    def renoises(self, steps: list[float]) -> int:
        """The noise draws a block of `steps` takes after its initial noise."""
        return len(steps) - 1

    @property
    def least_cache_frames(self) -> int:
        """The fewest frames a session's cache may hold: the sinks and one block (the canvas,
        which is no planned block, needs the whole window)."""
        s = self.cfg
        return s.window_frames if s.canvas else s.sink_frames + s.frames_per_block

    def new_state(self, model: WanDiT, h: int, w: int, window: int) -> tuple[DiTState, rolling.RollingState | None]:
        """A session's caches for `window` frames (and a rolling window, for that sampler)."""
        return model.new_state(h, w, window, self.cfg.sink_frames), None

    def recache(self, model: WanDiT, state: DiTState, window, context: torch.Tensor) -> None:
        """A continuing scene's re-cache: the held window's keys/values again under `context`."""
        model.recache(state, context, self.cfg.context_t, self.cfg.global_sink)

    def denoise(
        self,
        model: WanDiT,
        states: list[DiTState],
        noise: list[torch.Tensor],
        steps: list[list[float]],
        renoise: list[list[torch.Tensor]],
        sigmas: list[list[float]],
        hold: torch.Tensor | None,
        frames: int,
    ) -> torch.Tensor:
        """The block of each session (one batched forward per step where there are several),
        committed to its cache: (B, C, frames, h, w)."""
        ctx_t, unipc = self.cfg.context_t, self.kind == "unipc"
        if len(states) == 1:
            x0 = denoise_block(
                model, states[0], noise[0], steps[0], [r[0] for r in renoise], ctx_t, sigmas[0],
                commit=self.commits, unipc=unipc, hold=hold,
            )  # fmt: skip
        else:
            noise_b, renoise_b = torch.cat(noise), [torch.cat(r) for r in renoise]
            x0 = denoise_sessions(
                model, states, noise_b, steps, renoise_b, ctx_t, sigmas, commit=self.commits, unipc=unipc
            )
        self.after(model, states, x0, frames)
        return x0

    commits = True  # the clean pass commits the block to the cache

    def after(self, model: WanDiT, states: list[DiTState], x0: torch.Tensor, frames: int) -> None:
        """What follows a block's denoise (nothing: the clean pass committed it)."""


class UniPCSampler(BlockSampler):
    kind = "unipc"

    def schedule(self, steps) -> list[float]:
        return unipc_timesteps(steps, self.cfg.shift)

    def renoises(self, steps: list[float]) -> int:
        return 0  # a multistep solver draws no noise after the first


class RecomputeSampler(BlockSampler):
    kind = "recompute"
    commits = False  # the recompute takes the clean pass's place

    def recache(self, model: WanDiT, state: DiTState, window, context: torch.Tensor) -> None:
        model.set_prompt(state, context)  # the held context again, Krea's way, under the new prompt
        model.recompute(state, self.cfg.frames_per_block, self.cfg.context_t)

    def after(self, model: WanDiT, states: list[DiTState], x0: torch.Tensor, frames: int) -> None:
        for i, st in enumerate(states):
            model.commit_and_recompute(st, x0[i : i + 1], frames, self.cfg.context_t)


class RollingSampler(BlockSampler):
    kind = "rolling"

    def __init__(self, cfg: SamplerConfig) -> None:
        super().__init__(cfg)
        self.window = rolling.Schedule.of(cfg)

    @property
    def least_cache_frames(self) -> int:
        return self.cfg.window_frames  # its blocks in flight are not a video's length

    def new_state(self, model: WanDiT, h: int, w: int, window: int) -> tuple[DiTState, rolling.RollingState | None]:
        r = rolling.RollingState(model, h, w, self.cfg)
        return r.store, r  # the finished history is the session's state

    def recache(self, model: WanDiT, state: DiTState, window, context: torch.Tensor) -> None:
        rolling.recache(model, window, context, self.cfg.context_t)

    def next_block(
        self,
        model: WanDiT,
        window: rolling.RollingState,
        shot_left: int,
        noise_of: Callable[[int], torch.Tensor],
        draw: Callable[[tuple[int, ...]], torch.Tensor],
    ) -> torch.Tensor:
        """The next finished block: the shot's first call fills the window (one forward per
        level), later calls take one window step each (rolling.next_block)."""
        last = window.finished + shot_left - 1 if shot_left > 0 else None
        return rolling.next_block(model, window, self.window, last, noise_of, draw)


def sampler_for(cfg: SamplerConfig) -> BlockSampler:
    """The sampler a preset's settings name (`kind`, and Krea's `kv_recompute`)."""
    if cfg.kind == "rolling":
        return RollingSampler(cfg)
    if cfg.kind == "unipc":
        return UniPCSampler(cfg)
    return RecomputeSampler(cfg) if cfg.kv_recompute else BlockSampler(cfg)
