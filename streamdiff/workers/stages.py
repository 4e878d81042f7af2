"""The two stages inside a worker: DiT (latent blocks) and VAE shard (row strips of frames).

Each holds its engine, the rings it attached, and its sessions' state objects; one call handles
one block of one session and returns the reply message for the supervisor. A block is checked
before any work (RequestError: the request cannot be served; see errors.py); in a VAE group the
shards then agree with one all-reduce whether to run it, skip it (cancelled) or refuse it, so
they all run the block's collectives or none do.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ..ipc import messages as m
from ..ipc.shm import Ring
from ..parallel.vae_group import ExchangeHalo, group_max
from .errors import RequestError, SessionError
from .faults import Faults
from .spec import WorkerSpec

log = logging.getLogger("streamdiff.worker")


def _select_device(device: str) -> None:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    elif dev.type == "xpu":
        torch.xpu.set_device(dev)


def memory_budget_bytes(device: str, cpu_budget: int) -> int:
    """What this worker's sessions may hold: 90% of the device memory still free after the
    model loaded, or on the CPU the configured budget."""
    t = torch.device(device).type
    if t == "cuda":
        return int(0.9 * torch.cuda.mem_get_info(torch.device(device))[0])
    if t == "xpu" and hasattr(torch.xpu, "mem_get_info"):
        return int(0.9 * torch.xpu.mem_get_info(torch.device(device))[0])
    return cpu_budget


def _timed(device: str, fn) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return 1000 * (time.perf_counter() - t0)


def _sync(device: str) -> None:
    t = torch.device(device).type
    if t == "cuda":
        torch.cuda.synchronize()
    elif t == "xpu":
        torch.xpu.synchronize()


def in_order(next_block: dict[str, int], msg) -> None:
    """A session's blocks arrive in order on one socket: a gap means a message was lost, and
    running this block would build on state the lost one never made."""
    due = next_block.get(msg.session, 0)
    if msg.block != due:
        raise SessionError(f"block {msg.block} arrived but block {due} never did (a lost control message)")
    next_block[msg.session] = due + 1


# A VAE group's verdict on a block, agreed by an all-reduce MAX: a cancel wins over a refusal.
RUN, REFUSE, SKIP = 0, 1, 2


class DiTStage:
    def __init__(self, spec: WorkerSpec, faults: Faults) -> None:
        from ..models.engines import DiTEngine

        torch.set_num_threads(spec.threads)
        _select_device(spec.device)
        self.device = spec.device
        self.engine = DiTEngine(spec.model, spec.device)
        self.ring = Ring(spec.latent_ring)
        self.faults = faults
        self.sessions: dict = {}
        self.seeds: dict[str, int] = {}
        self.next_block: dict[str, int] = {}  # session -> the block index due next
        self.cpu_budget = spec.cpu_memory_budget_bytes
        self.max_batch = spec.max_batch
        self.calibration = self.calibrate()

    def info(self) -> dict:
        p = self.engine.preset
        return {
            "model": p.name,
            "frames_per_block": p.sampler.frames_per_block,
            "fps": p.fps,
            "spatial_factor": p.vae.spatial_factor,
            "temporal_factor": p.vae.temporal_factor,
            "size_multiple": p.vae.spatial_factor * p.dit.patch_size[1],
            "latent_channels": p.dit.in_channels,
            "default_size": list(p.default_size),
            "max_shot_latent_frames": p.dit.rope_max_positions,
            "embedded_weights": p.embedded,
            **self.calibration,
        }

    def calibrate(self) -> dict:
        """One steady-state block at the preset's default size, timed (the admission model's
        first estimate, refined by every block after), and what a session holds in memory."""
        p, w, h = self.engine.preset, *self.engine.preset.default_size
        sess = self.engine.open_session(w, h, seed=0)
        self.engine.set_scene(sess, "calibration", cut=True)
        self.engine.generate_block(sess, p.sampler.frames_per_block)  # the first block has its own steps
        ms = _timed(self.device, lambda: self.engine.generate_block(sess, p.sampler.frames_per_block))
        kv = sess.state.kv
        tokens = kv.k[0].shape[2]  # window * tokens per frame
        per_token = sum(t.numel() * t.element_size() for t in (*kv.k, *kv.v)) // tokens
        cross = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in sess.state.cross)
        budget = memory_budget_bytes(self.device, self.cpu_budget)
        # Per-block share of a batched forward, for each batch size the supervisor may choose
        # (as many sessions as half the memory budget holds: the rest is for the real ones).
        largest = min(self.max_batch, int(budget // 2 // max(1, per_token * tokens + cross)))
        others = [self.engine.open_session(w, h, seed=i) for i in range(1, largest)]
        for other in others:
            self.engine.set_scene(other, "calibration", cut=True)
            self.engine.generate_block(other, p.sampler.frames_per_block)
        batch_ms = {}
        for b in range(2, largest + 1):
            group = [sess, *others[: b - 1]]
            ms_b = _timed(self.device, lambda g=group: self.engine.generate_blocks(g, p.sampler.frames_per_block))
            batch_ms[str(b)] = ms_b / b
        return {
            "dit_cost": {"block_ms": ms, "size": [w, h]},
            "dit_batch_ms": batch_ms,
            "dit_memory": {
                "kv_bytes_per_token": per_token,  # every layer's keys and values
                "window_frames": kv.window,
                "cross_bytes": cross,
                "budget_bytes": budget,
            },
        }

    def open(self, msg: m.OpenSession) -> None:
        self.seeds[msg.session] = msg.seed
        self.faults.hit("open", msg.seed)
        try:
            self.sessions[msg.session] = self.engine.open_session(msg.width, msg.height, msg.seed)
        except ValueError as exc:
            raise RequestError(str(exc)) from None

    def close(self, session: str) -> None:
        self.sessions.pop(session, None)
        self.seeds.pop(session, None)
        self.next_block.pop(session, None)

    def check(self, msg: m.GenerateBlock, sess) -> None:
        seed = self.seeds.get(msg.session)
        self.faults.hit("check", seed)
        in_order(self.next_block, msg)
        c = self.engine.model.cfg.in_channels
        shape = (c, msg.frames, *sess.latent_hw)
        if msg.frames < 1:
            raise RequestError(f"a block of {msg.frames} latent frames")
        if np.prod(shape) * 4 > self.ring.spec.slot_bytes:
            raise RequestError(f"a latent block of shape {shape} does not fit a ring slot")

    def generate(self, msgs: list[m.GenerateBlock], closed: set[str]) -> tuple[list, list]:
        """The next block of each message's session (the supervisor's batch: one block per
        session), in one batched forward where sizes and step counts agree.
        Returns (replies, refusals): LatentDone per block run or skipped, (message, RequestError)
        per block refused at its check. Any other error propagates: the worker's own."""
        replies, refusals, run = [], [], []
        for msg in msgs:
            sess = self.sessions.get(msg.session)
            if msg.session in closed or sess is None:
                replies.append(m.LatentDone(msg.session, msg.block, msg.slot, [], 0.0, skipped=True))
                continue
            try:
                self.check(msg, sess)
            except RequestError as exc:
                refusals.append((msg, exc))
                continue
            run.append((msg, sess))
        t0 = time.perf_counter()
        for msg, sess in run:
            self.faults.hit("compute", self.seeds.get(msg.session))
            if msg.prompt is not None:
                self.engine.set_scene(sess, msg.prompt, cut=msg.cut, seed=msg.seed)
        groups: dict[tuple, list] = {}  # sessions denoise together where size and step count agree
        for msg, sess in run:
            groups.setdefault((sess.latent_hw, msg.frames, len(self.engine.steps_of(sess))), []).append((msg, sess))
        latents = {}
        for group in groups.values():
            outs = self.engine.generate_blocks([sess for _, sess in group], group[0][0].frames)
            latents.update({msg.session: out[0] for (msg, _), out in zip(group, outs, strict=True)})
        ms = 1000 * (time.perf_counter() - t0) / max(1, len(run))  # each block's share
        for msg, _ in run:
            latent = latents[msg.session]  # (C, f, h, w) float32, CPU
            self.ring.array(msg.slot, latent.shape, np.float32)[...] = latent.numpy()
            replies.append(m.LatentDone(msg.session, msg.block, msg.slot, list(latent.shape), ms, batch=len(run)))
        return replies, refusals

    def shutdown(self) -> None:
        self.ring.close()


class VAEStage:
    def __init__(self, spec: WorkerSpec, faults: Faults) -> None:
        from ..models.engines import VAEEngine

        torch.set_num_threads(spec.threads)
        _select_device(spec.device)
        self.device = spec.device
        self.engine = VAEEngine(spec.model, spec.device, spec.vae_working_set_bytes)
        self.latents = Ring(spec.latent_ring)
        self.frames = Ring(spec.frame_ring)
        self.faults = faults
        g = spec.group
        self.rank, self.world = (g.rank, g.world) if g else (0, 1)
        self.shard_front = bool(g and g.shard_front)
        if self.world > 1:
            from ..parallel.vae_group import init_group

            init_group(g.init_addr, g.rank, g.world, spec.device, g.timeout_s)
        self.sessions: dict = {}
        self.seeds: dict[str, int] = {}
        self.next_block: dict[str, int] = {}  # session -> the block index due next
        self.cpu_budget = spec.cpu_memory_budget_bytes
        self.calibration = self.calibrate()

    def info(self) -> dict:
        p = self.engine.preset
        return {
            "vae_rank": self.rank,
            "vae_world": self.world,
            "spatial_factor": p.vae.spatial_factor,
            "temporal_factor": p.vae.temporal_factor,
            **self.calibration,
        }

    def calibrate(self) -> dict:
        """One steady-state block at the preset's default size, decoded by the whole group
        (every shard runs it: the same collectives), timed; and the temporal cache it leaves,
        per latent pixel of this shard's share, for the memory side of admission."""
        p = self.engine.preset
        w, h = p.default_size
        sf, fpb = p.vae.spatial_factor, p.sampler.frames_per_block
        state = self.engine.open_session()
        halo_for = (lambda plan: ExchangeHalo(self.rank, list(plan.bands))) if self.world > 1 else (lambda plan: None)
        g = torch.Generator().manual_seed(0)
        for i, f in enumerate((1, fpb)):
            z = torch.randn(1, p.dit.in_channels, f, h // sf, w // sf, generator=g)
            plan = self.engine.plan(tuple(z.shape[1:]), self.world)

            def run(z=z, plan=plan):
                return self.engine.decode_block(state, z, plan, self.rank, halo_for(plan), self.shard_front)

            ms = _timed(self.device, run) if i else (run(), 0.0)[1]
        cache = sum(c.numel() * c.element_size() for c in state.cache if c is not None)
        return {
            "vae_cost": {"block_ms": ms, "size": [w, h]},
            "vae_memory": {
                "cache_bytes_per_latent_pixel": cache / ((h // sf) * (w // sf)),
                "budget_bytes": memory_budget_bytes(self.device, self.cpu_budget),
            },
        }

    def open(self, msg: m.OpenSession) -> None:
        self.seeds[msg.session] = msg.seed
        self.faults.hit("open", msg.seed)
        self.sessions[msg.session] = self.engine.open_session()

    def close(self, session: str) -> None:
        self.sessions.pop(session, None)
        self.seeds.pop(session, None)
        self.next_block.pop(session, None)

    def check(self, msg: m.DecodeBlock, state):
        """The block's decode plan, or RequestError. Depends on the message and the session's
        cache position only, which every shard of the group shares: they all refuse together."""
        self.faults.hit("check", self.seeds.get(msg.session))
        in_order(self.next_block, msg)
        p = self.engine.preset
        if len(msg.shape) != 4 or min(msg.shape) < 1 or msg.shape[0] != p.dit.in_channels:
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
        try:
            return self.engine.plan((c, f, h, w), self.world)
        except ValueError as exc:  # e.g. fewer latent rows than shards
            raise RequestError(str(exc)) from None

    def _agree(self, verdict: int) -> int:
        return group_max(verdict, self.device) if self.world > 1 else verdict

    def decode(self, msg: m.DecodeBlock, cancelled: bool) -> m.FramesDone:
        state = self.sessions.get(msg.session)
        verdict, plan, refusal = (SKIP if cancelled or state is None else RUN), None, None
        if verdict == RUN:
            try:
                plan = self.check(msg, state)
            except RequestError as exc:
                verdict, refusal = REFUSE, exc
        verdict = self._agree(verdict)
        if verdict == REFUSE and refusal is not None:
            raise refusal  # the shard that refused says why; its peers answer "skipped"
        if verdict != RUN:
            return m.FramesDone(msg.session, msg.block, self.rank, msg.frame_slot, 0.0, skipped=True)
        t0 = time.perf_counter()
        self.faults.hit("compute", self.seeds.get(msg.session))
        if msg.reset:  # a new shot: the temporal cache starts afresh
            state = self.sessions[msg.session] = self.engine.open_session()
        latent = torch.from_numpy(self.latents.array(msg.latent_slot, msg.shape, np.float32))[None]
        c, f, h, w = msg.shape
        sf = self.engine.preset.vae.spatial_factor
        halo = ExchangeHalo(self.rank, list(plan.bands)) if self.world > 1 else None
        strip = self.engine.decode_block(state, latent, plan, self.rank, halo, self.shard_front)
        r0, r1 = plan.rows(self.rank)
        _sync(self.device)
        out = self.frames.array(msg.frame_slot, (msg.frames_out, h * sf, w * sf, 3), np.uint8)
        out[:, r0 * sf : r1 * sf] = strip.numpy()  # this shard's row strip, in place: no gather copy
        ms = 1000 * (time.perf_counter() - t0)
        return m.FramesDone(msg.session, msg.block, self.rank, msg.frame_slot, ms)

    def shutdown(self) -> None:
        self.latents.close()
        self.frames.close()
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
