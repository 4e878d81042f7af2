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
from ..models.wan.dit import compile_stats
from ..models.wan.kernels import split_rows
from ..parallel.vae_group import ExchangeHalo, group_max, move_bands
from .errors import RequestError, SessionError
from .faults import Faults
from .spec import WorkerSpec

log = logging.getLogger("streamdiff.worker")


def decode_png(data: bytes) -> torch.Tensor:
    """GenerateBlock.image -> (H, W, 3) uint8 (the API made it: a PNG at the video's size)."""
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            return torch.from_numpy(np.asarray(img.convert("RGB")).copy())
    except Exception as exc:
        raise RequestError(f"the image does not decode: {exc}") from None


def _select_device(device: str) -> None:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    elif dev.type == "xpu":
        torch.xpu.set_device(dev)


def put_activation(ring: Ring, slot: int, x: torch.Tensor) -> None:
    """A cut's activation (C, T, H, W; float32, CPU) into a ring slot, channels last (T, H, W, C):
    the order the decoder's stages make and take it in, so neither side reorders it. A row-major
    slot cost the two sides 4.8 and 3.1 ms a block at cut 5 of 256x144, against 0.6 each now."""
    c, t, h, w = x.shape
    ring.array(slot, (t, h, w, c), np.float32)[...] = x.permute(1, 2, 3, 0).numpy()


def take_activations(ring: Ring, slots: list[int], shape) -> torch.Tensor:
    """`put_activation`'s tensors of one shape back, stacked: (N, C, T, H, W), channels last."""
    c, t, h, w = shape
    x = torch.stack([torch.from_numpy(ring.array(slot, (t, h, w, c), np.float32)) for slot in slots])
    return x.permute(0, 4, 1, 2, 3)


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


class Stopwatch:
    """Wall time and a stage's own work. On the CPU its own work is the process's CPU time per
    thread: what it took of its cores, not the time another process (a hybrid VAE shard
    beside a DiT) held them. Elsewhere the wall time, less what `waited` says was spent
    waiting for neighbours."""

    def __init__(self, device: str, threads: int) -> None:
        self.cpu, self.threads = torch.device(device).type == "cpu", max(1, threads)
        self.wall0 = self.cpu0 = 0.0

    def start(self) -> None:
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()

    def stop(self, waited_s: float = 0.0) -> tuple[float, float]:
        """(wall seconds, own seconds) since start."""
        wall = time.perf_counter() - self.wall0
        own = (time.process_time() - self.cpu0) / self.threads if self.cpu else wall - waited_s
        return wall, min(wall, max(0.0, own))  # shared cores: a worker may borrow more threads


def _leave_group(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _phase(state) -> tuple:
    """A VAE state's cache shapes: sessions whose caches agree decode their blocks in one call."""
    return tuple(None if c is None else tuple(c.shape) for c in state.cache)


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


def cut_of(msg: m.GenerateBlock | m.DecodeBlock, worker_cut: int) -> int:
    """The VAE decoder stages a block's DiT runs (topology.vae_cut): the supervisor's choice for
    its shot, else the worker's own cut."""
    return msg.vae_cut or worker_cut


def check_cut_change(cuts: dict[str, int], msg, cut: int, n: int, shot_start: bool) -> None:
    """A block's cut against the stages [1, n) and its session's cut so far: a cut moves only
    where a shot starts, when the stage caches on both sides start afresh."""
    if not 0 < cut < n:
        raise RequestError(f"a VAE cut after stage {cut}: this decoder has {n} stages (1-{n - 1})")
    if not shot_start and cuts.get(msg.session, cut) != cut:
        raise RequestError(f"the VAE cut moves from {cuts[msg.session]} to {cut} inside a shot")


def _check_cut(vae, cut: int) -> int:
    """topology.vae_cut against this decoder: its number of stages (the cut must leave both
    sides at least one)."""
    from ..models.wan.vae import decoder_stages

    n = len(decoder_stages(vae))
    if not 0 < cut < n:
        raise ValueError(f"topology.vae_cut: this VAE decoder has {n} stages; a cut is 1-{n - 1}, got {cut}")
    return n


# A VAE group's verdict on a block, agreed by an all-reduce MAX: a cancel wins over a refusal.
RUN, REFUSE, SKIP = 0, 1, 2


class DiTStage:
    """A DiT worker, or one rank of a DiT group (parallel/dit_group.py). Every rank of a group
    gets every message, checks every block and agrees on it with the others (as a VAE group's
    shards do), so all run the same forwards; rank 0 alone writes the latents and answers."""

    def __init__(self, spec: WorkerSpec, faults: Faults) -> None:
        from ..models.engines import DiTEngine

        torch.set_num_threads(spec.threads)
        _select_device(spec.device)
        self.device = spec.device
        self.clock = Stopwatch(spec.device, spec.threads)
        g = spec.group if spec.dit_group else None
        self.rank, self.world = (g.rank, g.world) if g else (0, 1)
        if self.world > 1:
            from ..parallel.dit_group import SeqParallel
            from ..parallel.vae_group import init_group

            init_group(g.init_addr, g.rank, g.world, spec.device, g.timeout_s)
        self.engine = DiTEngine(spec.model, spec.device)
        if self.world > 1:
            heads = self.engine.model.cfg.num_heads
            self.engine.model.parallel = SeqParallel(self.rank, self.world, heads)
        self.ring = Ring(spec.latent_ring)
        self.faults = faults
        self.sessions: dict = {}
        self.seeds: dict[str, int] = {}
        self.next_block: dict[str, int] = {}  # session -> the block index due next
        self.images: dict[str, torch.Tensor] = {}  # session -> its checked image, until its block runs
        self.cpu_budget = spec.cpu_memory_budget_bytes
        self.max_batch = spec.max_batch
        # topology.vae_cut: the VAE decoder's first stages run here on each block, each session
        # with its own cache for them; the latent slot carries their output to the VAE worker.
        # The supervisor may move a session's cut at a shot's start (GenerateBlock.vae_cut).
        self.cut, self.vae, self.vae_states, self.vae_cuts, self.stages = spec.vae_cut, None, {}, {}, 0
        if self.cut:
            from ..models.engines import VAEEngine

            self.vae = VAEEngine(spec.model, spec.device, spec.vae_working_set_bytes).model
            self.stages = _check_cut(self.vae, self.cut)
        self.calibration = self.calibrate()

    def models(self) -> list[torch.nn.Module]:
        """The modules this stage runs (shared cores install their hooks on them)."""
        return [self.engine.model] + ([self.vae] if self.vae is not None else [])

    def info(self) -> m.DiTReady:
        p = self.engine.preset
        facts = m.ModelFacts(
            model=p.name,
            frames_per_block=p.sampler.frames_per_block,
            fps=p.fps,
            spatial_factor=p.vae.spatial_factor,
            temporal_factor=p.vae.temporal_factor,
            size_multiple=p.vae.spatial_factor * p.dit.patch_size[1],
            latent_channels=p.dit.in_channels,
            default_size=list(p.default_size),
            embedded_weights=p.embedded,
            i2v=self.engine.i2v,
            loaded=self.engine.loaded,
        )
        return m.DiTReady(**self.calibration, rank=self.rank, world=self.world, facts=facts)

    def calibrate(self) -> dict:
        """One steady-state block at the preset's default size, timed (the admission model's
        first estimate, refined by every block after), and what a session holds in memory."""
        p, w, h = self.engine.preset, *self.engine.preset.default_size
        sess = self.engine.open_session(w, h, seed=0)
        self.engine.set_scene(sess, "calibration", cut=True)
        self.engine.generate_block(sess, p.sampler.frames_per_block)  # the first block has its own steps
        # Steady state: a full attention window behind the timed block, as in most of a stream
        # (timed after one block, the cost came out 30-40% low and a hybrid's first bands too wide).
        # With a cut, the block's first VAE stages are part of its cost here (warmed like the DiT).
        fpb = p.sampler.frames_per_block
        for i in range(-(-sess.state.kv.window // fpb) - 1):
            self._cut_stages([("calibration", i == 0, self.engine.generate_block(sess, fpb)[0], self.cut)])
        self.clock.start()
        ms = _timed(
            self.device,
            lambda: self._cut_stages([("calibration", False, self.engine.generate_block(sess, fpb)[0], self.cut)]),
        )
        _, own_s = self.clock.stop()
        self.vae_states.pop("calibration", None)
        self.vae_cuts.pop("calibration", None)
        kv = sess.state.kv
        tokens = kv.k[0].shape[2]  # window * tokens per frame
        # The rolling sampler holds a second cache (its window's context) beside the history.
        # Every buffer is allocated when the session opens and reused by its shots, and scales
        # with the tokens per frame: bytes per token of the window, exact at any frame size.
        held = [kv] + ([sess.rolling.scratch.kv] if sess.rolling is not None else [])
        per_token = sum(c.nbytes for c in held) / tokens
        cross = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in sess.state.cross)
        budget = memory_budget_bytes(self.device, self.cpu_budget)
        # Per-block share of a batched forward of two sessions (larger batches are measured as
        # the supervisor runs them), if half the memory budget holds a second session.
        batch_ms = {}
        fits = int(self.max_batch > 1 and budget // 2 >= 2 * (per_token * tokens + cross))
        if -self._agree([-fits])[0]:  # a group's ranks all time the pair or none does
            other = self.engine.open_session(w, h, seed=1)
            self.engine.set_scene(other, "calibration", cut=True)
            self.engine.generate_block(other, p.sampler.frames_per_block)
            pair, fpb = [sess, other], p.sampler.frames_per_block
            self.engine.generate_blocks(pair, fpb)  # cold: a new shape
            batch_ms["2"] = _timed(self.device, lambda: self.engine.generate_blocks(pair, fpb)) / 2
        self.graphs = compile_stats()["graphs"]
        if self.engine.compiled:  # compiled at the first calibration blocks
            self.engine.loaded["compile"] = {"mode": self.engine.loaded["compile"], "on": True, **compile_stats()}
            log.info("DiT blocks compiled: %(graphs)d graphs in %(compile_s).1f s", self.engine.loaded["compile"])
        return {
            "cost": m.StageCost(ms, [w, h], busy_ms=1000 * own_s),
            "batch_ms": batch_ms,
            # keys, values, latents and tail, exact (KVCache.nbytes)
            "memory": m.DiTMemory(per_token, kv.window, cross, budget, self.engine.least_cache_frames),
        }

    def open(self, msg: m.OpenSession) -> None:
        self.seeds[msg.session] = msg.seed
        self.faults.hit("open", msg.seed)
        try:
            self.sessions[msg.session] = self.engine.open_session(msg.width, msg.height, msg.seed, msg.held_frames)
        except ValueError as exc:
            raise RequestError(str(exc)) from None

    def close(self, session: str) -> None:
        self.sessions.pop(session, None)
        self.seeds.pop(session, None)
        self.next_block.pop(session, None)
        self.images.pop(session, None)
        self.vae_states.pop(session, None)
        self.vae_cuts.pop(session, None)

    def _cut_stages(self, blocks: list[tuple[str, bool, torch.Tensor, int]]) -> dict[str, torch.Tensor]:
        """blocks: (session, starts a shot, latent (C, f, h, w), the block's cut). Each
        session's latent, or with a cut its first stages' output (float32, CPU): what goes into
        its ring slot. Blocks of one shape and cut whose stage caches are at the same phase run
        their stages in one call."""
        if not self.cut:
            return {key: latent for key, _, latent, _ in blocks}
        from ..models.wan.vae import decode_stages_sessions

        groups: dict[tuple, list] = {}
        for key, shot_start, latent, cut in blocks:
            if shot_start or key not in self.vae_states:
                self.vae_states[key] = self.vae.new_state()
            self.vae_cuts[key] = cut
            groups.setdefault((tuple(latent.shape), cut, _phase(self.vae_states[key])), []).append((key, latent))
        out = {}
        for (_, cut, _), group in groups.items():
            x = torch.stack([latent for _, latent in group])
            states = [self.vae_states[key] for key, _ in group]
            y = decode_stages_sessions(self.vae, x, states, 0, cut, x.shape[2]).float().cpu()
            out.update({key: y[i] for i, (key, _) in enumerate(group)})
        return out

    def check(self, msg: m.GenerateBlock, sess) -> None:
        seed = self.seeds.get(msg.session)
        self.faults.hit("check", seed)
        in_order(self.next_block, msg)
        c = self.engine.model.cfg.in_channels
        shape = (c, msg.frames, *sess.latent_hw)
        if msg.frames < 1:
            raise RequestError(f"a block of {msg.frames} latent frames")
        fpb = self.engine.frames_per_block
        if self.engine.rolling_schedule is not None and msg.frames != fpb:  # its window holds whole blocks
            raise RequestError(f"the rolling sampler makes whole blocks of {fpb} latent frames, not {msg.frames}")
        if msg.image is not None:
            if not self.engine.i2v:
                raise RequestError(f"model {self.engine.preset.name!r} does not condition on an image")
            if not msg.cut or msg.frames != 1 or self.engine.rolling_schedule is not None or self.cut:
                raise RequestError(
                    "an image is a shot's first block of one latent frame (no rolling sampler, no VAE cut)"
                )
            img, f = decode_png(msg.image), self.engine.preset.vae.spatial_factor
            if tuple(img.shape) != (sess.latent_hw[0] * f, sess.latent_hw[1] * f, 3):
                raise RequestError(f"the image is {img.shape[1]}x{img.shape[0]}, not the video's size")
            self.images[msg.session] = img
        rows = sess.latent_hw[0] // self.engine.model.cfg.patch_size[1]
        if rows < self.world:  # each rank of a DiT group computes at least one row of patches
            raise RequestError(f"{rows} rows of patches cannot be split over a DiT group of {self.world}")
        if np.prod(shape) * 4 > self.ring.spec.slot_bytes:
            raise RequestError(f"a latent block of shape {shape} does not fit a ring slot")
        if self.cut:
            from ..models.wan.vae import stage_shapes

            cut = cut_of(msg, self.cut)
            check_cut_change(self.vae_cuts, msg, cut, self.stages, msg.cut or msg.session not in self.vae_states)
            out = stage_shapes(self.vae.cfg, msg.frames, *sess.latent_hw)[cut - 1]
            if np.prod(out) * 4 > self.ring.spec.slot_bytes:
                raise RequestError(f"the VAE's first {cut} stages make {list(out)} of a block: too big for a ring slot")

    def run_batch(self, msgs: list[m.GenerateBlock], closed: set[str]) -> tuple[list, list]:
        """The next block of each message's session (the supervisor's batch: one block per
        session), in one batched forward where sizes and step counts agree.
        Returns (replies, refusals): LatentDone per block run or skipped, (message, RequestError)
        per block refused at its check. Any other error propagates: the worker's own. In a DiT
        group the ranks agree on each block first (a cancel wins over a refusal); rank 0 answers
        for the group, and a rank that refused a block reports it (the others skip it)."""
        verdicts, refused = [], {}
        for msg in msgs:
            sess = self.sessions.get(msg.session)
            verdict = SKIP if msg.session in closed or sess is None else RUN
            if verdict == RUN:
                try:
                    self.check(msg, sess)
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
        self.clock.start()
        for msg, sess in run:
            self.faults.hit("compute", self.seeds.get(msg.session))
            if msg.prompt is not None:
                # an image block is not drawn: the authors draw the F - 1 frames after it
                left = max(0, msg.shot_left - 1) if msg.image is not None else msg.shot_left
                self.engine.set_scene(sess, msg.prompt, cut=msg.cut, seed=msg.seed, recache=msg.recache, shot_left=left)
        latents = {}
        for msg, sess in run:  # image-to-video: the picture's latent is the shot's first block
            if msg.image is not None:
                latents[msg.session] = self.engine.start_from_image(sess, self.images.pop(msg.session))[0]
        groups: dict[tuple, list] = {}  # sessions denoise together where size and step count agree
        for msg, sess in (r for r in run if r[0].image is None):
            groups.setdefault((sess.latent_hw, msg.frames, len(self.engine.steps_of(sess))), []).append((msg, sess))
        for group in groups.values():
            left = [msg.shot_left for msg, _ in group]
            outs = self.engine.generate_blocks([sess for _, sess in group], group[0][0].frames, left)
            latents.update({msg.session: out[0] for (msg, _), out in zip(group, outs, strict=True)})
        if self.engine.compiled:  # a new shape compiled: few, and each one said
            stats = compile_stats()
            if stats["graphs"] != self.graphs:
                log.info(
                    "DiT blocks: %d more graph(s) compiled, %d in all, %.1f s compiling so far",
                    stats["graphs"] - self.graphs,
                    stats["graphs"],
                    stats["compile_s"],
                )
                self.graphs = stats["graphs"]
        data = self._cut_stages([(msg.session, msg.cut, latents[msg.session], cut_of(msg, self.cut)) for msg, _ in run])
        wall, own = self.clock.stop()
        if self.rank > 0:
            return [], refusals
        n = max(1, len(run))
        ms, busy = 1000 * wall / n, 1000 * own / n  # each block's share
        for msg, _ in run:
            latent, out = latents[msg.session], data[msg.session]  # (C, f, h, w) float32, CPU; or a cut's
            if self.cut:
                put_activation(self.ring, msg.slot, out)
            else:
                self.ring.array(msg.slot, out.shape, np.float32)[...] = out.numpy()
            cut_shape = list(out.shape) if self.cut else []
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
        _leave_group(self.world)


class VAEStage:
    def __init__(self, spec: WorkerSpec, faults: Faults) -> None:
        from ..models.engines import VAEEngine

        torch.set_num_threads(spec.threads)
        _select_device(spec.device)
        self.device = spec.device
        self.clock = Stopwatch(spec.device, spec.threads)
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
        self.weights: dict[str, tuple[float, ...] | None] = {}  # session -> the band weights its cache holds
        self.slots = self.engine.model.band_slots(self.shard_front)
        # topology.vae_cut: the DiT ran the decoder's first stages; this worker runs the rest.
        self.cut, self.vae_cuts = spec.vae_cut, {}  # the worker's cut; each session's (DecodeBlock.vae_cut)
        self.stages = _check_cut(self.engine.model, self.cut) if self.cut else 0
        self.cpu_budget = spec.cpu_memory_budget_bytes
        self.max_batch = spec.max_batch
        self.calibration = self.calibrate()

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

    def calibrate(self) -> dict:
        """One steady-state block at the preset's default size, decoded by the whole group
        (every shard runs it: the same collectives), timed, alone and in batches of the sizes
        the supervisor may choose; and the temporal cache it leaves, per latent pixel of this
        shard's share, for the memory side of admission."""
        p = self.engine.preset
        w, h = p.default_size
        sf, fpb = p.vae.spatial_factor, p.sampler.frames_per_block
        budget = memory_budget_bytes(self.device, self.cpu_budget)
        g = torch.Generator().manual_seed(0)

        def decode(states, frames: int) -> float:
            z = torch.randn(len(states), p.dit.in_channels, frames, h // sf, w // sf, generator=g)
            plan = self.engine.plan(tuple(z.shape[1:]), self.world, len(states))
            halo = ExchangeHalo(self.rank, list(plan.bands)) if self.world > 1 else None
            front = self.shard_front
            return _timed(self.device, lambda: self.engine.decode_blocks(states, z, plan, self.rank, halo, front))

        state = self.engine.open_session()
        decode([state], 1)  # a shot's first block, then steady ones: the first of a shape is cold
        decode([state], fpb)
        ms = decode([state], fpb)
        cache = sum(c.numel() * c.element_size() for c in state.cache if c is not None)
        # A pair decoded in one call, if half the memory budget holds it on every rank (their
        # free memory differs; all must run the same calibration collectives or none).
        batch_ms = {}
        fits = int(self.max_batch > 1 and budget // 2 >= 2 * cache)
        if -self._agree([-fits])[0]:
            other = self.engine.open_session()
            decode([other], 1)
            decode([other], fpb)  # the same cache phase as `state`
            decode([state, other], fpb)  # cold: a new shape
            batch_ms["2"] = decode([state, other], fpb) / 2
        out = {
            "cost": m.StageCost(ms, [w, h]),
            "batch_ms": batch_ms,
            "memory": m.VAEMemory(cache / ((h // sf) * (w // sf)), budget),
        }
        if self.cut:  # each decoder stage's time: what the supervisor moves a cut by (placement/cut.py)
            from ..placement.profile import stage_times

            z = (1, p.dit.in_channels, fpb, h // sf, w // sf)
            stages = stage_times(self.engine.model, state, lambda: torch.randn(z, generator=g), self.device, runs=2)
            out["stages_ms"] = m.StageTimes(stages, [w, h])
        return out

    def open(self, msg: m.OpenSession) -> None:
        self.seeds[msg.session] = msg.seed
        self.faults.hit("open", msg.seed)
        self.sessions[msg.session] = self.engine.open_session()

    def close(self, session: str) -> None:
        self.sessions.pop(session, None)
        self.seeds.pop(session, None)
        self.next_block.pop(session, None)
        self.weights.pop(session, None)
        self.vae_cuts.pop(session, None)

    def _rebalance(self, msg: m.DecodeBlock, state, weights: tuple[float, ...] | None) -> None:
        """Decode this block under the batch's band weights: in the middle of a shot whose
        bands differ, first move the cache's rows to the new bands (every shard does, in the
        batch's order: the same collectives)."""
        h = msg.shape[2]
        before = self.weights.get(msg.session)
        self.weights[msg.session] = weights
        if msg.reset or state.latent_frames == 0 or self.world == 1:
            return
        old, new = split_rows(h, self.world, before), split_rows(h, self.world, weights)
        if old != new:
            move_bands(state, self.slots, old, new, self.rank)

    def check(self, msg: m.DecodeBlock, state, weights: tuple[float, ...] | None = None):
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
        if self.cut:
            check_cut_change(self.vae_cuts, msg, cut_of(msg, self.cut), self.stages, first)
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
            state = self.sessions.get(msg.session)
            verdict = SKIP if msg.session in closed or state is None else RUN
            if verdict == RUN:
                try:
                    self.check(msg, state, weights)
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
            self.faults.hit("compute", self.seeds.get(msg.session))
            if msg.reset:  # a new shot: the temporal cache starts afresh
                self.sessions[msg.session] = self.engine.open_session()
            state = self.sessions[msg.session]
            self._rebalance(msg, state, weights)
            cut = cut_of(msg, self.cut) if self.cut else 0
            self.vae_cuts[msg.session] = cut
            key = (tuple(msg.shape), tuple(msg.data_shape), cut, msg.frames_out, _phase(state))
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
        if self.cut:
            return self._decode_rest(msgs), h
        plan = self.engine.plan((c, f, h, w), self.world, len(msgs), weights)
        latents = torch.stack(
            [torch.from_numpy(self.latents.array(msg.latent_slot, msg.shape, np.float32)) for msg in msgs]
        )
        halo = ExchangeHalo(self.rank, list(plan.bands)) if self.world > 1 else None
        states = [self.sessions[msg.session] for msg in msgs]
        strips = self.engine.decode_blocks(states, latents, plan, self.rank, halo, self.shard_front)
        r0, r1 = plan.rows(self.rank)
        _sync(self.device)
        for msg, strip in zip(msgs, strips, strict=True):
            out = self.frames.array(msg.frame_slot, (msg.frames_out, h * sf, w * sf, 3), np.uint8)
            out[:, r0 * sf : r1 * sf] = strip.numpy()  # this shard's row strip, in place: no gather copy
        return (halo.wait_s if halo else 0.0), r1 - r0

    def _decode_rest(self, msgs: list[m.DecodeBlock]) -> float:
        """With a cut: the decoder's stages after it on the blocks' first-stages outputs, in one
        call (`run_batch` grouped them by shape and cache phase; a group of one shard: no
        neighbours to wait for)."""
        from ..models.wan.vae import decode_stages_sessions, to_uint8_frames

        sf = self.engine.preset.vae.spatial_factor
        _, f, h, w = msgs[0].shape
        x = take_activations(self.latents, [msg.latent_slot for msg in msgs], msgs[0].data_shape)
        states = [self.sessions[msg.session] for msg in msgs]
        y = decode_stages_sessions(self.engine.model, x, states, cut_of(msgs[0], self.cut), self.stages, f)
        for i, msg in enumerate(msgs):
            out = self.frames.array(msg.frame_slot, (msg.frames_out, h * sf, w * sf, 3), np.uint8)
            out[...] = to_uint8_frames(y[i : i + 1]).numpy()
        return 0.0

    def shutdown(self) -> None:
        self.latents.close()
        self.frames.close()
        _leave_group(self.world)
