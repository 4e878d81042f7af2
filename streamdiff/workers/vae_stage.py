"""The VAE stage of a worker: one shard of a VAE group decoding row strips of frames, or the
whole height (workers/stage_common.py says what the stages share)."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..ipc import messages as m
from ..ipc.shm import Ring
from ..models.wan.rows import split_rows
from ..parallel.vae_group import ExchangeHalo, group_max, move_bands
from ..platform import select
from .calibration import calibrated
from .errors import RequestError
from .faults import Faults
from .spec import WorkerSpec
from .stage_common import (
    REFUSE,
    RUN,
    SKIP,
    StageSession,
    check_cut,
    check_cut_change,
    cut_of,
    in_order,
    leave_group,
    phase,
    take_activations,
    timed_ms,
    transient_each,
)

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class VAEStageSession(StageSession):
    """What a VAE stage (one shard) holds of one session."""

    state: object  # the decoder's causal cache: VAEState (the Wan VAE's) or TAEHVState, this shard's rows
    weights: tuple[float, ...] | None = None  # the band weights its cache holds


class VAEStage:
    def __init__(self, spec: WorkerSpec, faults: Faults) -> None:
        from ..models.engines import VAEEngine

        torch.set_num_threads(spec.threads)
        self.platform = select(spec.device)
        self.device = spec.device
        self.clock = self.platform.stopwatch(spec.threads)
        self.engine = VAEEngine(spec.model, spec.device, spec.vae_working_set_bytes)
        self.latents = Ring(spec.latent_ring)
        self.frames = Ring(spec.frame_ring)
        self.faults = faults
        g = spec.group
        self.rank, self.world = (g.rank, g.world) if g else (0, 1)
        self.shard_front = bool(g and g.shard_front)
        if self.world > 1:
            from ..parallel.vae_group import agreed_working_set, init_group

            init_group(g.init_addr, g.rank, g.world, spec.device, g.timeout_s)
            self.engine.working_set_bytes = agreed_working_set(self.engine.working_set_bytes, spec.device)
        self.sessions: dict[str, VAEStageSession] = {}
        self.slots = self.engine.model.band_slots(self.shard_front)
        # topology.vae_cut: the DiT ran the decoder's first stages; this worker runs the rest.
        self.vae_cut = spec.vae_cut  # the worker's cut; each session's is its own (DecodeBlock.vae_cut)
        self.stages = check_cut(self.engine.model, self.vae_cut) if self.vae_cut else 0
        self.cpu_budget = spec.cpu_memory_budget_bytes
        self.max_batch = spec.max_batch
        self.calibration = calibrated(spec, "vae", self.calibrate, self._agree)
        compiler = self.engine.compiler
        if compiler.on:  # compiled at the calibration blocks (a first, a steady and a batched decode)
            self.calibration["compile"] = report = compiler.report()
            if compiler.active:
                log.info("VAE norms compiled: %(graphs)d graphs in %(compile_s).1f s", report)
            else:
                log.warning("VAE norms run eager: torch.compile failed (%s)", compiler.fallback)

    def models(self) -> list[torch.nn.Module]:
        return [self.engine.model]

    def info(self) -> m.VAEReady:
        p = self.engine.preset
        return m.VAEReady(
            **self.calibration,
            rank=self.rank,
            world=self.world,
            spatial_factor=p.vae.spatial_factor,
            temporal_factor=p.vae.temporal_factor,
        )

    def calibrate(self, given: m.GivenTimes | None = None) -> dict:
        """One steady-state block at the preset's default size, decoded by the whole group
        (every shard runs it: the same collectives), timed, alone and in batches of the sizes
        the supervisor may choose; and the temporal cache it leaves, per latent pixel of this
        shard's share, for the memory side of admission. `given`: timings given instead
        (workers/calibration.py): a shot's first block and one steady block run, untimed, for
        the cache they leave and their transients."""
        p = self.engine.preset
        w, h = p.default_size
        sf, fpb = p.vae.spatial_factor, p.sampler.frames_per_block
        g = torch.Generator().manual_seed(0)
        # The latent rows and columns the start-up blocks decode: the preset's size, but where
        # they run only for the cache they leave (timings given, a platform that counts no
        # transients: the CPU) a quarter of its rows and columns. A whole decoder caches whole
        # rows of every level, the same bytes per latent pixel at any size; a shard's halo rows
        # do not scale, and a cut decoder's stages are timed at the preset's size on this cache.
        lh, lw = h // sf, w // sf
        if given is not None and self.world == 1 and not self.vae_cut and not self.platform.counts_transients:
            lh, lw = max(2, lh // 4 // 2 * 2), max(2, lw // 4 // 2 * 2)

        def decode(states, frames: int) -> float:
            z = torch.randn(len(states), p.dit.out_channels, frames, lh, lw, generator=g)
            plan = self.engine.plan(tuple(z.shape[1:]), self.world, len(states))
            halo = ExchangeHalo(self.rank, list(plan.bands), self.platform.wait_clock()) if self.world > 1 else None
            front = self.shard_front
            return timed_ms(self.platform, lambda: self.engine.decode_blocks(states, z, plan, self.rank, halo, front))

        state = self.engine.open_session()
        decode([state], 1)  # a shot's first block, then steady ones: the first of a shape is cold
        if given is None:
            decode([state], fpb)
            ms, alone_t = self.platform.peak_during(lambda: decode([state], fpb))
        else:
            ms, alone_t = given.block_ms, self.platform.peak_during(lambda: decode([state], fpb))[1]
        cache = state.nbytes
        # A pair decoded in one call, if half the memory free now holds its caches and the
        # second block's transient (the budget is less the first's already) on every rank (their
        # free memory differs; all must run the same calibration collectives or none). The
        # worker's budget is taken once all its stages have loaded and calibrated (Worker.start).
        batch_ms, pair_t = ({}, None) if given is None else (dict(given.batch_ms), None)
        budget = self.platform.memory_budget(self.cpu_budget, alone_t)
        fits = int(self.max_batch > 1 and budget // 2 >= 2 * cache + alone_t)
        if given is None and -self._agree([-fits])[0]:
            other = copy.deepcopy(state)  # the same cache phase, without decoding its blocks again
            decode([state, other], fpb)  # cold: a new shape
            ms2, pair_t = self.platform.peak_during(lambda: decode([state, other], fpb))
            batch_ms["2"] = ms2 / 2
        out = {
            "cost": m.StageCost(ms, [w, h]),
            "batch_ms": batch_ms,
            "memory": m.VAEMemory(cache / (lh * lw), 0.0, alone_t, transient_each(alone_t, pair_t)),
        }
        if self.vae_cut:  # each decoder stage's time: what the supervisor moves a cut by (supervisor/cut.py)
            from ..models.wan.stage_times import stage_times

            z = (1, p.dit.out_channels, fpb, h // sf, w // sf)
            stages = stage_times(self.engine.model, state, lambda: torch.randn(z, generator=g), self.device, runs=2)
            out["stages_ms"] = m.StageTimes(stages, [w, h])
        return out

    def open(self, msg: m.OpenSession) -> None:
        self.faults.hit("open", msg.session)
        self.sessions[msg.session] = VAEStageSession(state=self.engine.open_session())

    def close(self, session: str) -> None:
        self.sessions.pop(session, None)

    def _rebalance(self, msg: m.DecodeBlock, held: VAEStageSession, weights: tuple[float, ...] | None) -> None:
        """Decode this block under the batch's band weights: in the middle of a shot whose
        bands differ, first move the cache's rows to the new bands (every shard does, in the
        batch's order: the same collectives)."""
        h = msg.shape[2]
        before, held.weights = held.weights, weights
        if msg.reset or held.state.latent_frames == 0 or self.world == 1:
            return
        old, new = split_rows(h, self.world, before), split_rows(h, self.world, weights)
        if old != new:
            move_bands(held.state, self.slots, old, new, self.rank)

    def check(self, msg: m.DecodeBlock, held: VAEStageSession, weights: tuple[float, ...] | None = None):
        """The block's decode plan, or RequestError. Depends on the message and the session's
        cache position only, which every shard of the group shares: they all refuse together."""
        self.faults.hit("check", msg.session)
        in_order(held, msg)
        state = held.state
        p = self.engine.preset
        if len(msg.shape) != 4 or min(msg.shape) < 1 or msg.shape[0] != p.dit.out_channels:
            raise RequestError(f"a latent block of shape {msg.shape}")
        c, f, h, w = msg.shape
        sf = p.vae.spatial_factor
        first = msg.reset or state.latent_frames == 0
        expected = p.vae.frames_out(f, first_block=first)
        if msg.frames_out != expected:
            raise RequestError(f"{f} latent frames decode to {expected} frames, not {msg.frames_out}")
        if c * f * h * w * 4 > self.latents.spec.slot_bytes:
            raise RequestError(f"a latent block of shape {msg.shape} does not fit a ring slot")
        if msg.frames_out * h * sf * w * sf * 3 > self.frames.spec.slot_bytes:
            raise RequestError(f"{msg.frames_out} frames of {w * sf}x{h * sf} do not fit a frame slot")
        if self.vae_cut:
            check_cut_change(held, cut_of(msg, self.vae_cut), self.stages, first)
            if len(msg.data_shape) != 4 or np.prod(msg.data_shape) * 4 > self.latents.spec.slot_bytes:
                raise RequestError(f"the first stages' output of shape {msg.data_shape} is not a block's")
        try:
            return self.engine.plan((c, f, h, w), self.world, 1, weights)
        except ValueError as exc:  # e.g. fewer latent rows than shards or bad weights
            raise RequestError(str(exc)) from None

    def _agree(self, verdicts: list[int]) -> list[int]:
        return group_max(verdicts, self.device) if self.world > 1 else verdicts

    def run_batch(
        self, msgs: list[m.DecodeBlock], closed: set[str], weights: tuple[float, ...] | None = None
    ) -> tuple[list, list]:
        """The supervisor's batch (one block per session), decoded in one call per set of blocks
        whose size and cache phase agree. Every shard checks every block, then the group agrees
        on each with one all-reduce (a cancel wins over a refusal) before any collective, so all
        shards run the same decodes. Returns (replies, refusals): FramesDone per block decoded or
        skipped, (message, RequestError) per block this shard refused (its peers answer
        skipped). Any other error propagates: the worker's own. `weights`: the group's band
        weights for shots that start in this batch (None: equal bands)."""
        verdicts, refusals = [], {}
        for msg in msgs:
            held = self.sessions.get(msg.session)
            verdict = SKIP if msg.session in closed or held is None else RUN
            if verdict == RUN:
                try:
                    self.check(msg, held, weights)
                except RequestError as exc:
                    verdict, refusals[msg.block, msg.session] = REFUSE, exc
            verdicts.append(verdict)
        agreed = self._agree(verdicts)
        replies, refused, run = [], [], []
        for msg, verdict in zip(msgs, agreed, strict=True):
            key = (msg.block, msg.session)
            if verdict == REFUSE and key in refusals:
                refused.append((msg, refusals[key]))
            elif verdict != RUN:
                replies.append(m.FramesDone(msg.session, msg.block, self.rank, msg.frame_slot, 0.0, skipped=True))
            else:
                run.append(msg)
        self.clock.start()
        groups: dict[tuple, list] = {}
        for msg in run:
            self.faults.hit("compute", msg.session)
            held = self.sessions[msg.session]
            if msg.reset:  # a new shot: the temporal cache starts afresh
                held.state = self.engine.open_session()
            self._rebalance(msg, held, weights)
            cut = cut_of(msg, self.vae_cut) if self.vae_cut else 0
            held.vae_cut = cut
            key = (tuple(msg.shape), tuple(msg.data_shape), cut, msg.frames_out, phase(held.state))
            groups.setdefault(key, []).append(msg)
        waited, rows = 0.0, 0
        for group in groups.values():
            w, rows = self._decode(group, weights)
            waited += w
        wall, own = self.clock.stop(waited)
        n = max(1, len(run))
        ms, busy = 1000 * wall / n, 1000 * own / n  # each block's share
        replies += [
            m.FramesDone(msg.session, msg.block, self.rank, msg.frame_slot, ms, batch=len(run), busy_ms=busy, rows=rows)
            for msg in run
        ]
        return replies, refused

    def _decode(self, msgs: list[m.DecodeBlock], weights: tuple[float, ...] | None) -> tuple[float, int]:
        """Decode blocks that share a shape, phase and bands in one call; returns the seconds
        spent waiting for neighbours and this shard's band height."""
        c, f, h, w = msgs[0].shape
        sf = self.engine.preset.vae.spatial_factor
        if self.vae_cut:
            return self._decode_rest(msgs), h
        plan = self.engine.plan((c, f, h, w), self.world, len(msgs), weights)
        latents = torch.stack(
            [torch.from_numpy(self.latents.array(msg.latent_slot, msg.shape, np.float32)) for msg in msgs]
        )
        halo = ExchangeHalo(self.rank, list(plan.bands), self.platform.wait_clock()) if self.world > 1 else None
        states = [self.sessions[msg.session].state for msg in msgs]
        strips = self.engine.decode_blocks(states, latents, plan, self.rank, halo, self.shard_front)
        r0, r1 = plan.rows(self.rank)
        self.platform.sync()
        for msg, strip in zip(msgs, strips, strict=True):
            out = self.frames.array(msg.frame_slot, (msg.frames_out, h * sf, w * sf, 3), np.uint8)
            out[:, r0 * sf : r1 * sf] = strip.numpy()  # this shard's row strip, in place: no gather copy
        return (halo.wait_s if halo else 0.0), r1 - r0

    def _decode_rest(self, msgs: list[m.DecodeBlock]) -> float:
        """With a cut: the decoder's stages after it on the blocks' first-stages outputs, in one
        call (`run_batch` grouped them by shape and cache phase; a group of one shard: no
        neighbours to wait for)."""
        from ..models.wan.vae import decode_stages_sessions, uint8_frames

        sf = self.engine.preset.vae.spatial_factor
        _, f, h, w = msgs[0].shape
        x = take_activations(self.latents, [msg.latent_slot for msg in msgs], msgs[0].data_shape)
        states = [self.sessions[msg.session].state for msg in msgs]
        y = decode_stages_sessions(self.engine.model, x, states, cut_of(msgs[0], self.vae_cut), self.stages, f)
        frames = uint8_frames(y)  # one copy off the device for the batch
        for i, msg in enumerate(msgs):
            out = self.frames.array(msg.frame_slot, (msg.frames_out, h * sf, w * sf, 3), np.uint8)
            out[...] = frames[i].numpy()
        return 0.0

    def shutdown(self) -> None:
        self.latents.close()
        self.frames.close()
        leave_group(self.world)
