"""The two stages as the pipeline uses them: one call = one block of one session.

`DiTEngine` (DiT worker): text encoding with a small prompt cache, per-session KV/cross caches,
seeded noise, the step lists. `VAEEngine` (VAE worker): per-session temporal caches, uint8
frames. Sessions are plain objects owned by the caller; engines hold only weights.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .presets import ModelSpec, build_dit, build_text_encoder, build_vae
from .wan import rolling
from .wan.dit import DiTState
from .wan.kernels import CPU_DECODE_WORKING_SET_BYTES, DecodePlan, plan_block
from .wan.sampler import denoise_block, denoise_sessions, sigma_of, step_timesteps
from .wan.vae import Halo, VAEState, to_uint8_frames


@dataclass
class DiTSession:
    state: DiTState
    latent_hw: tuple[int, int]
    generator: torch.Generator
    shot_blocks: int = 0  # blocks generated since the last cut (the first uses its own steps)
    prompt: str | None = None
    rolling: rolling.RollingState | None = None  # the rolling sampler's window (sampler kind "rolling")


class DiTEngine:
    def __init__(self, spec: ModelSpec, device: str = "cpu", prompt_cache: int = 16) -> None:
        self.device = device
        self.model, self.preset = build_dit(spec, device)
        self.text = build_text_encoder(spec, device)
        s = self.preset.sampler
        self.timesteps = step_timesteps(s.steps, s.shift, s.warp)
        self.first_timesteps = step_timesteps(s.first_block_steps or s.steps, s.shift, s.warp)
        self.rolling_schedule = rolling.Schedule.of(s) if s.kind == "rolling" else None
        self._prompts: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._prompt_cache = prompt_cache

    @property
    def frames_per_block(self) -> int:
        return self.preset.sampler.frames_per_block

    def latent_size(self, width: int, height: int) -> tuple[int, int]:
        f = self.preset.vae.spatial_factor * 2  # VAE factor x DiT patch
        if width % f or height % f:
            raise ValueError(f"size {width}x{height} must be a multiple of {f} in both dimensions")
        return height // self.preset.vae.spatial_factor, width // self.preset.vae.spatial_factor

    def open_session(self, width: int, height: int, seed: int) -> DiTSession:
        h, w = self.latent_size(width, height)
        state, window = self._new_shot(h, w)
        return DiTSession(state, (h, w), torch.Generator().manual_seed(seed), rolling=window)

    def _new_shot(self, h: int, w: int) -> tuple[DiTState, rolling.RollingState | None]:
        """A shot's fresh caches; with the rolling sampler, its window (whose finished history
        is the session's `state`)."""
        s = self.preset.sampler
        if self.rolling_schedule is not None:
            r = rolling.RollingState(self.model, h, w, s)
            return r.store, r
        return self.model.new_state(h, w, s.window_frames, s.sink_frames), None

    def encode_prompt(self, prompt: str) -> torch.Tensor:
        emb = self._prompts.get(prompt)
        if emb is None:
            emb = self.text.encode([prompt])
            self._prompts[prompt] = emb
            if len(self._prompts) > self._prompt_cache:
                self._prompts.popitem(last=False)
        self._prompts.move_to_end(prompt)
        return emb

    def set_scene(
        self, sess: DiTSession, prompt: str, cut: bool, seed: int | None = None, recache: bool = False
    ) -> None:
        """Start a scene. `cut`: a new shot (fresh KV cache, positions from 0, first-block steps).
        Otherwise `continue`: keep the visual history, swap the prompt (cross-attention cache);
        with `recache`, also recompute the held frames' keys/values under the new prompt.

        Rolling sampler: the authors' loop has one prompt per video. A new scene's first block
        is the oldest in flight (every earlier block is finished), so all blocks in flight belong
        to the new scene: they keep their noise levels and continue under its prompt from the
        next window step on (a restart would stall the stream for a full window). A cut discards
        them with the caches; the new shot fills its window afresh."""
        if cut:  # rolling: the blocks in flight are discarded with the old shot's caches
            sess.state, sess.rolling = self._new_shot(*sess.latent_hw)
            sess.shot_blocks = 0
        if seed is not None:
            sess.generator.manual_seed(seed)
        if recache and not cut and sess.rolling is not None:
            rolling.recache(self.model, sess.rolling, self.encode_prompt(prompt), self.preset.sampler.context_t)
            sess.prompt = prompt
        elif recache and not cut:
            self.model.recache(sess.state, self.encode_prompt(prompt), self.preset.sampler.context_t)
            sess.prompt = prompt
        elif cut or prompt != sess.prompt:
            self.model.set_prompt(sess.state, self.encode_prompt(prompt))
            sess.prompt = prompt

    def steps_of(self, sess: DiTSession) -> list[float]:
        """The step list of the session's next block (a shot's first block has its own)."""
        return self.first_timesteps if sess.shot_blocks == 0 else self.timesteps

    def generate_block(self, sess: DiTSession, frames: int, shot_left: int = 0) -> torch.Tensor:
        """Denoise the next `frames` latent frames -> (1, C, frames, h, w) float32 on the CPU.
        `shot_left`: the rolling sampler's blocks of this shot from this one on (0: open-ended)."""
        return self.generate_blocks([sess], frames, [shot_left])[0]

    def generate_blocks(
        self, sessions: list[DiTSession], frames: int, shots_left: list[int] | None = None
    ) -> list[torch.Tensor]:
        """The next block of several sessions in one batched forward per step (same latent size
        and step count; any prompts and cache positions). Each session draws its noise from its
        own generator exactly as alone, so each result equals its session run alone.
        The rolling sampler runs its sessions one after another (`shots_left`: see generate_block)."""
        if self.rolling_schedule is not None:
            left = shots_left or [0] * len(sessions)
            return [self._rolling_block(s, frames, n) for s, n in zip(sessions, left, strict=True)]
        steps = [self.steps_of(s) for s in sessions]
        noise, renoise = [], [[] for _ in steps[0][1:]]
        for sess, ts in zip(sessions, steps, strict=True):
            shape = (1, self.model.cfg.in_channels, frames, *sess.latent_hw)
            noise.append(torch.randn(shape, generator=sess.generator))
            for i in range(len(ts) - 1):
                renoise[i].append(torch.randn(shape, generator=sess.generator))
        ctx_t, shift = self.preset.sampler.context_t, self.preset.sampler.shift
        sigmas = [sigma_of(ts, shift) for ts in steps]
        if len(sessions) == 1:
            x0 = denoise_block(
                self.model, sessions[0].state, noise[0], steps[0], [r[0] for r in renoise], ctx_t, sigmas[0]
            )
        else:
            states = [s.state for s in sessions]
            noise_b, renoise_b = torch.cat(noise), [torch.cat(r) for r in renoise]
            x0 = denoise_sessions(self.model, states, noise_b, steps, renoise_b, ctx_t, sigmas)
        for sess in sessions:
            sess.shot_blocks += 1
        return [x.float().cpu() for x in x0.split(1)]

    def _rolling_block(self, sess: DiTSession, frames: int, shot_left: int) -> torch.Tensor:
        """The next finished block of a rolling session: the shot's first call fills the window
        (one forward per level), later calls take one window step each (rolling.next_block)."""
        fpb, r, g = self.frames_per_block, sess.rolling, sess.generator
        if frames != fpb:
            raise ValueError(f"the rolling sampler makes whole blocks of {fpb} latent frames, not {frames}")
        shape = (1, self.model.cfg.in_channels, fpb, *sess.latent_hw)
        if r.entered == 0 and shot_left > 0:
            # The authors draw the whole video's noise before the loop, frame-major (1, F, C, h, w);
            # so does a shot of known length here. Blocks past it (a live video, a shot lengthened
            # by a steer) draw theirs as they enter.
            r.noise = torch.randn((1, shot_left * fpb, shape[1], *shape[3:]), generator=g)

        def noise_of(i: int) -> torch.Tensor:
            if r.noise is not None and (i + 1) * fpb <= r.noise.shape[1]:
                return r.noise[:, i * fpb : (i + 1) * fpb].transpose(1, 2)
            return torch.randn((1, fpb, shape[1], *shape[3:]), generator=g).transpose(1, 2)

        last = r.finished + shot_left - 1 if shot_left > 0 else None
        sched = self.rolling_schedule
        x0 = rolling.next_block(self.model, r, sched, last, noise_of, lambda s: torch.randn(s, generator=g))
        sess.shot_blocks += 1
        return x0.float().cpu()


class VAEEngine:
    def __init__(self, spec: ModelSpec, device: str = "cpu", working_set_bytes: int = CPU_DECODE_WORKING_SET_BYTES):
        self.device = device
        self.model, self.preset = build_vae(spec, device)
        self.working_set_bytes = working_set_bytes

    def open_session(self) -> VAEState:
        return self.model.new_state()

    def frames_out(self, latent_frames: int, state: VAEState) -> int:
        return self.preset.vae.frames_out(latent_frames, first_block=state.latent_frames == 0)

    def plan(
        self, latent_shape: tuple[int, ...], world: int = 1, batch: int = 1, weights: tuple[float, ...] | None = None
    ) -> DecodePlan:
        """The decode plan of `batch` blocks of this global shape over `world` shards, bands in
        proportion to `weights` (the same on every rank)."""
        cfg = self.preset.vae
        return plan_block(
            latent_shape,
            world,
            torch.device(self.device).type,
            cfg.base_dim,
            cfg.spatial_factor,
            cfg.temporal_factor,
            self.model.conv2.weight.element_size(),
            self.working_set_bytes,
            batch,
            weights,
        )

    def decode_block(
        self,
        state: VAEState,
        latent: torch.Tensor,
        plan: DecodePlan | None = None,
        rank: int = 0,
        halo: Halo | None = None,
        shard_front: bool = False,
    ) -> torch.Tensor:
        """(1, C, f, h, w) -> (frames, 8h, 8w, 3) uint8 on the CPU; with a plan of several
        shards, only rank `rank`'s band of rows (exchanging through `halo`)."""
        return self.decode_blocks([state], latent, plan, rank, halo, shard_front)[0]

    def decode_blocks(
        self,
        states: list[VAEState],
        latents: torch.Tensor,
        plan: DecodePlan | None = None,
        rank: int = 0,
        halo: Halo | None = None,
        shard_front: bool = False,
    ) -> list[torch.Tensor]:
        """Blocks of several sessions (rows of `latents`, same size and phase) in one decode call,
        each with its own temporal cache -> one (frames, rows, W, 3) uint8 array per session."""
        plan = plan or self.plan(tuple(latents.shape[1:]), 1, latents.shape[0])
        z = latents.to(self.device)
        if len(states) == 1:
            x = self.model.decode_rows(z, states[0], plan, rank, halo, shard_front)
        else:
            x = self.model.decode_sessions(z, states, plan, rank, halo, shard_front)
        return [to_uint8_frames(x[i : i + 1]) for i in range(x.shape[0])]
