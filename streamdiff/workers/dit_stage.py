"""The DiT stage of a worker: latent blocks, alone or as one rank of a DiT group
(workers/stage_common.py says what the stages share)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..ipc import messages as m
from ..ipc.shm import Ring
from ..models.blocks import BlockOrder, BlockRefused
from ..models.compiled import compile_stats
from ..parallel.vae_group import group_max
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
    decode_png,
    in_order,
    leave_group,
    phase,
    put_activation,
    timed_ms,
    transient_each,
)

if TYPE_CHECKING:
    from ..models.engines import DiTSession
    from ..models.wan.vae_blocks import VAEState

log = logging.getLogger("streamdiff.worker")


@dataclass(kw_only=True)
class DiTStageSession(StageSession):
    """What the DiT stage holds of one session."""

    dit: DiTSession  # the model's: its caches, noise and scene (models/engines.py)
    vae_state: VAEState | None = None  # with a VAE cut: the decoder's first stages' caches


class DiTStage:
    """A DiT worker, or one rank of a DiT group (parallel/dit_group.py). Every rank of a group
    gets every message, checks every block and agrees on it with the others (as a VAE group's
    shards do), so all run the same forwards; rank 0 alone writes the latents and answers."""

    def __init__(self, spec: WorkerSpec, faults: Faults) -> None:
        from ..models.engines import DiTEngine

        torch.set_num_threads(spec.threads)
        self.platform = select(spec.device)
        self.device = spec.device
        self.clock = self.platform.stopwatch(spec.threads)
        g = spec.group if spec.dit_group else None
        self.rank, self.world = (g.rank, g.world) if g else (0, 1)
        self.engine = DiTEngine(spec.model, spec.device, text=self.rank == 0)  # one text encoder per group
        if self.world > 1:  # joined once loaded, as a VAE shard joins: a slow load waits in no collective
            from ..parallel.dit_group import SeqParallel, shared_prompts
            from ..parallel.vae_group import init_group

            init_group(g.init_addr, g.rank, g.world, spec.device, g.timeout_s)
            cfg = self.engine.model.cfg
            sp = self.engine.model.parallel = SeqParallel(
                self.rank, self.world, cfg.num_heads, self.platform.wait_clock()
            )
            self.engine.share_prompt = shared_prompts(sp, (1, cfg.text_len, cfg.text_dim), spec.device)
        self.ring = Ring(spec.latent_ring)
        self.faults = faults
        self.sessions: dict[str, DiTStageSession] = {}
        self.cpu_budget = spec.cpu_memory_budget_bytes
        self.max_batch = spec.max_batch
        # topology.vae_cut: the VAE decoder's first stages run here on each block, each session
        # with its own cache for them; the latent slot carries their output to the VAE worker.
        # The supervisor may move a session's cut at a shot's start (GenerateBlock.vae_cut).
        self.vae_cut, self.vae, self.stages = spec.vae_cut, None, 0
        if self.vae_cut:
            from ..models.engines import VAEEngine

            self.vae = VAEEngine(spec.model, spec.device, spec.vae_working_set_bytes).model
            self.stages = check_cut(self.vae, self.vae_cut)
        self.calibration = calibrated(spec, "dit", self.calibrate, self._agree)
        compiler = self.engine.compiler  # the log, /health and /v1/models say what compiled, or why not
        self.engine.loaded["compile"] = report = compiler.report()
        if compiler.active:
            log.info("DiT blocks compiled: %(graphs)d graphs in %(compile_s).1f s", report)
        elif compiler.on:
            log.warning("DiT blocks run eager: torch.compile failed (%s)", compiler.fallback)
        self.graphs = report["graphs"]

    def models(self) -> list[torch.nn.Module]:
        """The modules this stage runs (shared cores install their hooks on them)."""
        return [self.engine.model] + ([self.vae] if self.vae is not None else [])

    def info(self) -> m.DiTReady:
        card, loaded = self.engine.card, self.engine.loaded
        return m.DiTReady(**self.calibration, rank=self.rank, world=self.world, card=card, loaded=loaded)

    def calibrate(self, given: m.GivenTimes | None = None) -> dict:
        """One steady-state block at the preset's default size, timed (the admission model's
        first estimate, refined by every block after), and what a session holds in memory.
        `given`: timings given instead (workers/calibration.py): only the shot's first block
        runs, for its transients, and on a platform that counts none (the CPU) no block: the
        caches are allocated when the session opens and its scene is set."""
        w, h = self.engine.card.default_size
        fpb = self.engine.frames_per_block
        sess = self.engine.open_session(w, h, seed=0)
        self.engine.set_scene(sess, "calibration", new_shot=True)
        first_t = 0
        if given is None or self.platform.counts_transients:  # the first block has its own steps
            _, first_t = self.platform.peak_during(lambda: self.engine.generate_block(sess, fpb))
        if given is None:
            ms, own_ms, alone_t = self._time_steady(sess)
        else:
            ms, own_ms, alone_t = given.block_ms, given.block_ms, first_t
        kv = sess.state.kv
        tokens = kv.k[0].shape[2]  # window * tokens per frame
        # Every buffer (the history; the rolling sampler's second, its window's context) is
        # allocated when the session opens and reused by its shots, and scales with the tokens
        # per frame: bytes per token of the window, exact at any frame size.
        per_token = sum(c.nbytes for c in sess.caches()) / tokens
        cross = sess.cross_nbytes
        # Per-block share of a batched forward of two sessions (larger batches are measured as
        # the supervisor runs them), if half the memory free now holds a second session (the
        # worker's budget is taken once all its stages have loaded and calibrated: Worker.start).
        batch_ms, pair_t, pair = ({} if given is None else dict(given.batch_ms)), None, [sess]
        budget = self.platform.memory_budget(self.cpu_budget, alone_t)
        fits = int(self.max_batch > 1 and budget // 2 >= 2 * (per_token * tokens + cross))
        if given is None and -self._agree([-fits])[0]:  # a group's ranks all time the pair or none does
            other = self.engine.open_session(w, h, seed=1)
            self.engine.set_scene(other, "calibration", new_shot=True)
            self.engine.generate_block(other, fpb)
            pair = [sess, other]
            self.engine.generate_blocks(pair, fpb)  # cold: a new shape
            ms2, pair_t = self.platform.peak_during(
                lambda: timed_ms(self.platform, lambda: self.engine.generate_blocks(pair, fpb))
            )
            batch_ms["2"] = ms2 / 2
        if self.engine.compiler.active:  # every shape it serves, so that none compiles after READY
            if batch_ms and len(pair) == 1:  # given timings: a second session for the batch's graph
                pair.append(self.engine.open_session(w, h, seed=1))
            self.engine.warm(pair)  # on calibration's sessions: no more caches than it held
        return {
            "cost": m.StageCost(ms, [w, h], busy_ms=own_ms),
            "batch_ms": batch_ms,
            # keys, values, latents and tail, exact (KVCache.nbytes)
            "memory": m.DiTMemory(
                per_token,
                kv.window,
                cross,
                0.0,
                self.engine.least_cache_frames,
                alone_t,
                transient_each(alone_t, pair_t),
            ),
        }

    def _time_steady(self, sess) -> tuple[float, float, int]:
        """A steady block of `sess` (after its first): (wall ms, this process's own ms, the
        bytes it allocated). A full attention window behind the timed block, as in most of a
        stream (timed after one block it came out 30-40% low, and sized a hybrid's first bands
        too wide). With a cut, the block's first VAE stages are part of its cost here (warmed
        like the DiT)."""
        fpb, held = self.engine.frames_per_block, DiTStageSession(dit=sess)
        for i in range(-(-sess.state.kv.window // fpb) - 1):
            self._cut_stages([(held, i == 0, self.engine.generate_block(sess, fpb)[0], self.vae_cut)])
        self.clock.start()
        ms, alone_t = self.platform.peak_during(
            lambda: timed_ms(
                self.platform,
                lambda: self._cut_stages([(held, False, self.engine.generate_block(sess, fpb)[0], self.vae_cut)]),
            )
        )
        _, own_s = self.clock.stop()
        return ms, 1000 * own_s, alone_t

    def open(self, msg: m.OpenSession) -> None:
        self.faults.hit("open", msg.session)
        try:
            sess = self.engine.open_session(msg.width, msg.height, msg.seed, msg.held_frames)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        self.sessions[msg.session] = DiTStageSession(dit=sess)

    def close(self, session: str) -> None:
        self.sessions.pop(session, None)

    def _cut_stages(self, blocks: list[tuple[DiTStageSession, bool, torch.Tensor, int]]) -> list[torch.Tensor]:
        """blocks: (session, starts a shot, latent (C, f, h, w), the block's cut). Each
        block's latent, or with a cut its first stages' output (float32, CPU): what goes into
        its ring slot. Blocks of one shape and cut whose stage caches are at the same phase run
        their stages in one call."""
        if not self.vae_cut:
            return [latent for _, _, latent, _ in blocks]
        from ..models.wan.vae import decode_stages_sessions

        groups: dict[tuple, list] = {}
        for i, (held, shot_start, latent, cut) in enumerate(blocks):
            if shot_start or held.vae_state is None:
                held.vae_state = self.vae.new_state()
            held.vae_cut = cut
            groups.setdefault((tuple(latent.shape), cut, phase(held.vae_state)), []).append((i, held, latent))
        out: list = [None] * len(blocks)
        for (_, cut, _), group in groups.items():
            x = torch.stack([latent for _, _, latent in group])
            states = [held.vae_state for _, held, _ in group]
            y = decode_stages_sessions(self.vae, x, states, 0, cut, x.shape[2]).float().cpu()
            for j, (i, _, _) in enumerate(group):
                out[i] = y[j]
        return out

    def check(self, msg: m.GenerateBlock, held: DiTStageSession) -> BlockOrder:
        """The block as the engine takes it, checked by the engine and for this stage's ring,
        group and cut (RequestError where it cannot run)."""
        self.faults.hit("check", msg.session)
        in_order(held, msg)
        sess = held.dit
        order = BlockOrder(
            msg.frames, msg.prompt, msg.new_shot, msg.seed, msg.recache, msg.transition, msg.shot_left,
            decode_png(msg.image) if msg.image is not None else None, msg.camera, msg.actions,
        )  # fmt: skip
        try:
            self.engine.check(sess, order)
        except BlockRefused as exc:
            raise RequestError(str(exc)) from None
        shape = (self.engine.model.cfg.out_channels, msg.frames, *sess.latent_hw)  # the latent the ring carries
        rows = sess.latent_hw[0] // self.engine.model.cfg.patch_size[1]
        if rows < self.world:  # each rank of a DiT group computes at least one row of patches
            raise RequestError(f"{rows} rows of patches cannot be split over a DiT group of {self.world}")
        if np.prod(shape) * 4 > self.ring.spec.slot_bytes:
            raise RequestError(f"a latent block of shape {shape} does not fit a ring slot")
        if self.vae_cut:
            from ..models.wan.vae_shapes import stage_shapes

            cut = cut_of(msg, self.vae_cut)
            check_cut_change(held, cut, self.stages, msg.new_shot or held.vae_state is None)
            out = stage_shapes(self.vae.cfg, msg.frames, *sess.latent_hw)[cut - 1]
            if np.prod(out) * 4 > self.ring.spec.slot_bytes:
                raise RequestError(f"the VAE's first {cut} stages make {list(out)} of a block: too big for a ring slot")
        return order

    def run_batch(self, msgs: list[m.GenerateBlock], closed: set[str]) -> tuple[list, list]:
        """The next block of each message's session (the supervisor's batch: one block per
        session), in one batched forward where sizes and step counts agree.
        Returns (replies, refusals): LatentDone per block run or skipped, (message, RequestError)
        per block refused at its check. Any other error propagates: the worker's own. In a DiT
        group the ranks agree on each block first (a cancel wins over a refusal); rank 0 answers
        for the group, and a rank that refused a block reports it (the others skip it)."""
        verdicts, refused, orders = [], {}, {}
        for msg in msgs:
            held = self.sessions.get(msg.session)
            verdict = SKIP if msg.session in closed or held is None else RUN
            if verdict == RUN:
                try:
                    orders[msg.session] = self.check(msg, held)
                except RequestError as exc:
                    verdict, refused[msg.block, msg.session] = REFUSE, exc
            verdicts.append(verdict)
        replies, refusals, run = [], [], []
        for msg, verdict in zip(msgs, self._agree(verdicts), strict=True):
            if verdict == REFUSE and (msg.block, msg.session) in refused:
                refusals.append((msg, refused[msg.block, msg.session]))
            elif verdict != RUN:
                replies.append(m.LatentDone(msg.session, msg.block, msg.slot, [], 0.0, skipped=True))
            else:
                run.append((msg, self.sessions[msg.session]))
        sp = self.engine.model.parallel if self.world > 1 else None
        waited = sp.wait_s if sp else 0.0
        self.clock.start()
        for msg, _ in run:
            self.faults.hit("compute", msg.session)
        made = self.engine.make([(held.dit, orders[msg.session]) for msg, held in run])
        latents = {msg.session: x[0] for (msg, _), x in zip(run, made, strict=True)}  # (C, f, h, w)
        if self.engine.compiler.active:  # a shape compiled after READY: `DiTEngine.warm` missed it
            stats = compile_stats()
            if stats["graphs"] != self.graphs:
                log.warning(
                    "DiT blocks: %d more graph(s) compiled after READY, %d in all, %.1f s compiling so far",
                    stats["graphs"] - self.graphs,
                    stats["graphs"],
                    stats["compile_s"],
                )
                self.graphs = stats["graphs"]
        data = self._cut_stages(
            [(held, msg.new_shot, latents[msg.session], cut_of(msg, self.vae_cut)) for msg, held in run]
        )
        waited = (sp.wait_s if sp else 0.0) - waited  # the group's all-to-alls: not this rank's own work
        wall, own = self.clock.stop(waited)
        if self.rank > 0:
            return [], refusals
        n = max(1, len(run))
        ms, busy = 1000 * wall / n, 1000 * own / n  # each block's share
        for (msg, _), out in zip(run, data, strict=True):
            latent = latents[msg.session]  # (C, f, h, w) float32, CPU; or `out`, a cut's
            if self.vae_cut:
                put_activation(self.ring, msg.slot, out)
            else:
                self.ring.array(msg.slot, out.shape, np.float32)[...] = out.numpy()
            cut_shape = list(out.shape) if self.vae_cut else []
            replies.append(
                m.LatentDone(
                    msg.session,
                    msg.block,
                    msg.slot,
                    list(latent.shape),
                    ms,
                    batch=len(run),
                    busy_ms=busy,
                    data_shape=cut_shape,
                )
            )
        return replies, refusals

    def _agree(self, verdicts: list[int]) -> list[int]:
        return group_max(verdicts, self.device) if self.world > 1 else verdicts

    def shutdown(self) -> None:
        self.ring.close()
        leave_group(self.world)
