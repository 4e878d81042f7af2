"""A discrete-event model of the pipeline: what a layout (layout.py) would do with a workload,
from a profile's service times (costs.py).

The policy is not modelled but run: the daemon's own `Scheduler` (admission, EDF, batching,
band weights, pacing) takes the simulated events and its actions are carried out on simulated
processes whose service times come from the profile (profile/):

- every worker is a process with one FIFO of batches, as the real ones are; an aggregated
  worker's DiT and VAE batches queue in the same FIFO;
- a VAE group's batch starts when it heads the queue of every shard (they run in lockstep) and
  takes the slowest shard's own time for its band (front + rows x per-row cost, fitted to the
  profile's equal and 1:3 splits) plus the group's measured exchange overhead;
- in a hybrid layout the DiT shares its device with a shard at lower priority: while the
  group decodes, the DiT runs at the rate the shard leaves free, times the share of that time
  the profile's hybrid probe saw a DiT turn into work (processor sharing);
- on shared cores (Layout.shared) each stage runs on its own threads while the other runs, and
  at its speed on all the cores while the other waits (it borrows them: platform/cpu_lending.py);
- each session's encoder is a thread of its own (libx264's measured time per block); the
  client takes every fragment at once. On the CPU the supervisor shares the DiT workers' cores,
  so each block's DiT work also carries what the encoder took from the DiT (the profile's DiT
  beside the host probe): an aggregated worker's two threads both stall while one shares its
  core;

`simulate` returns the figures `tools/bench/layouts.py` measures: W1 frames/s (from the request to the last
fragment), steady frames/s, time to first fragment, and W2 goodput (concurrent streams that
all play without a stall).
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import deque
from dataclasses import dataclass, field, replace

from ..card import ModelCard
from ..config import Config
from ..ipc import messages as m
from ..models.wan.rows import split_rows
from ..plan import Scene, plan_blocks
from ..supervisor import scheduler as s
from .costs import SPATIAL, Costs, cut_exchange
from .layout import Layout
from .profile.schema import Profile

HOP_S = 0.001  # a message's way through ZeroMQ and back, and the ring copies around it
BUSY_GAP_S = 0.01  # a process whose last job ended this recently is still busy (an aggregated
# worker's VAE batch starts a hop or two after its DiT batch ends)


@dataclass
class Work:
    kind: str  # dit | vae
    msg: m.Message
    procs: list[str]  # the processes that run it together (a VAE group's shards)
    group: int = -1
    started: float | None = None
    dur: float = 0.0  # a VAE batch's time, and each shard's own part of it and its rows
    own: list[float] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)


@dataclass
class Proc:
    name: str
    device: int
    queue: deque = field(default_factory=deque)
    job: Work | None = None
    # processor sharing (hybrid DiT): work left at full rate, the rate now, since when, and a
    # version that invalidates the completion event scheduled at an older rate
    left_s: float = 0.0
    rate: float = 1.0
    since: float = 0.0
    version: int = 0
    low: bool = False
    shared: bool = False  # on the same cores as every other shared process (Layout.shared)
    free_at: float = float("-inf")  # when its last job ended


@dataclass
class Result:
    rejected: int = 0
    fragments: dict = field(default_factory=dict)  # session -> [(time, frames)]


class Sim:
    def __init__(self, cfg: Config, profile: Profile, layout: Layout, size: tuple[int, int], card: ModelCard) -> None:
        exchange = cut_exchange(profile, layout, size, cfg.topology.vae_cut_exchange)
        self.cfg = replace(cfg, topology=layout.configure(cfg.topology, vae_cut_exchange=exchange))
        self.layout, self.card = layout, card
        self.topo = layout.topology()
        self.costs: dict[tuple[int, int], Costs] = {}
        self.profile = profile
        self.procs = {
            name: Proc(name, dev, low=layout.mode == "hybrid" and name in self.topo.dit_workers, shared=layout.shared)
            for name, dev in self.topo.devices.items()
        }
        p = self.cfg.pipeline
        self.sched = s.Scheduler(self.cfg, self.topo, p.latent_slots, p.frame_slots, card)
        self.now = 0.0
        self.heap: list = []
        self.seq = itertools.count()
        self.pending: list = []  # events for the next step
        self.vae_busy_s = 0.0  # summed VAE batch time per block decoded (the speed check of tools/bench/placement.py)
        self.vae_blocks = 0
        self.shot_weights: dict[tuple[int, str], tuple] = {}  # (group, session) -> its shot's weights
        self.encoding: dict[str, bool] = {}
        self.result = Result()
        self.ended: set[str] = set()
        self.sessions: dict[str, s.Session] = {}
        self._size = size
        self._seed(size)

    # -- costs --------------------------------------------------------------------------------
    def cost(self, w: int, h: int) -> Costs:
        if (w, h) not in self.costs:
            self.costs[(w, h)] = Costs(
                self.profile, (w, h), self.layout.threads, self.layout.dit_group, self.layout.vae_cut
            )
        return self.costs[(w, h)]

    def _seed(self, size: tuple[int, int]) -> None:
        """The workers' READY timings, as they would report them (at the preset's size when the
        profile has it)."""
        default = self.card.default_size
        w, h = default if f"{default[0]}x{default[1]}" in self.profile.sizes else size
        c = self.cost(w, h)
        events = []
        for dit in self.topo.dit_workers:
            cost = m.StageCost(c.dit["block_ms"] + c.cut_ms, [w, h], busy_ms=c.dit["own_ms"])
            batch_ms = {"2": c.dit["batch_ms"]["2"]} if "2" in c.dit.get("batch_ms", {}) else {}
            events.append(s.WorkerReady(dit, m.ReadyInfo(dit=m.DiTReady(cost, batch_ms))))
        stages = c.vae1.get("stages_ms")
        for group in self.topo.vae_groups:
            k = len(group)
            # The worker's start-up block is a whole decode, with a cut too (stages.VAEStage.calibrate).
            g_ms, _ = c.vae(k, [r1 - r0 for r0, r1 in split_rows(h // SPATIAL, k)], 1, False, 0)
            b2 = c.vae1.get("batch_ms", {}).get("2")
            vae = m.VAEReady(
                m.StageCost(1000 * g_ms, [w, h]),
                {"2": b2 * g_ms * 1000 / c.vae1["block_ms"]} if b2 else {},
                stages_ms=m.StageTimes(stages, [w, h]) if self.layout.vae_cut and stages else None,
            )
            events.append(s.WorkerReady(group[0], m.ReadyInfo(vae=vae)))
        self.step(events)

    # -- the event loop -----------------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), fn, args))

    def step(self, events: list) -> None:
        actions = self.sched.step([*self.pending, *events], self.now, self.topo.devices)
        self.pending = []
        for a in actions:
            self._take(a)

    def run(self, until_s: float = 3600.0) -> None:
        # The scheduler's log is the daemon's, not the model's. setLevel, not `.level =`: it also
        # clears the loggers' cached levels, which would otherwise keep the daemon's own INFO
        # lines (its cut moving) silent after a plan.
        quiet = logging.getLogger("streamdiff")
        level = quiet.level
        quiet.setLevel(logging.WARNING)
        try:
            self._run(until_s)
        finally:
            quiet.setLevel(level)

    def _run(self, until_s: float) -> None:
        while self.heap:
            t, _, fn, args = heapq.heappop(self.heap)
            if t > until_s:
                break
            self.now = t
            fn(*args)
            if self.pending:
                self.step([])

    def _take(self, a) -> None:
        if isinstance(a, s.Send):
            msg = a.msg
            if isinstance(msg, m.GenerateBatch):
                ranks = self.topo.members(self._dit_of(a.worker))
                if a.worker == ranks[0]:  # one job for a DiT group's ranks together
                    self._enqueue(Work("dit", msg, ranks))
            elif isinstance(msg, m.DecodeBatch):
                gi = next(i for i, g in enumerate(self.topo.vae_groups) if a.worker in g)
                if a.worker == self.topo.vae_groups[gi][0]:  # one job for the whole group
                    self._enqueue(Work("vae", msg, list(self.topo.vae_groups[gi]), gi))
        elif isinstance(a, s.OpenEncoder):
            self.at(self.now + HOP_S, self._post, s.EncoderOpened(a.session, init=b"init"))
        elif isinstance(a, s.Encode):
            first = a.block.shot_start
            w, h = a.shape[2], a.shape[1]
            done = s.Encoded(a.session, a.block.index, data=b"f", seconds=self.cost(w, h).encode_s(first))
            self.at(self.now + self.cost(w, h).encode_s(first), self._post, done)
        elif isinstance(a, s.Emit):
            if a.block is not None:
                self.result.fragments.setdefault(a.session, []).append((self.now, a.block.emit))
                self.pending.append(s.Ack(a.session))
        elif isinstance(a, s.End):
            self.ended.add(a.session)
        elif isinstance(a, s.Reject):
            self.result.rejected += 1
            self.ended.add(a.session)
        elif isinstance(a, s.WakeAt):
            self.at(a.at, lambda: None)

    def _dit_of(self, worker: str) -> str:
        return next((lead for lead, ranks in self.topo.dit_groups.items() if worker in ranks), worker)

    def _post(self, ev) -> None:
        self.pending.append(ev)

    # -- processes ----------------------------------------------------------------------------
    def _enqueue(self, job: Work) -> None:
        for p in job.procs:
            self.procs[p].queue.append(job)
        self.at(self.now + HOP_S / 2, self._try_start, job.procs)

    def _try_start(self, names: list[str]) -> None:
        for name in names:
            p = self.procs[name]
            if p.job is not None or not p.queue:
                continue
            job = p.queue[0]
            heads = [self.procs[q] for q in job.procs]
            if all(h.job is None and h.queue and h.queue[0] is job for h in heads):
                for q in job.procs:
                    self.procs[q].queue.popleft()
                    self.procs[q].job = job
                self._start(job)

    def _start(self, job: Work) -> None:
        job.started = self.now
        if job.kind == "dit":
            blocks = job.msg.blocks
            sess = self.sessions[blocks[0].session]
            c = self.cost(sess.width, sess.height)
            # an image-to-video shot's first block is the image, encoded and committed: once a request;
            # with a VAE cut the DiT runs the cut's stages on its latent frame too
            text = [b for b in blocks if b.image is None]
            cuts = [b.vae_cut or self.layout.vae_cut for b in text]
            # the encoder takes from the DiT's cores once it has a block to encode
            host = bool(self.result.fragments)
            dur = c.dit_s(len(text), sum(1 for b in text if b.new_shot), cuts, host) if text else 0.0
            fpb = self.card.frames_per_block
            for b in blocks:
                if b.image is not None:
                    dur += (c.image_ms + c.dit_cut_ms(b.vae_cut or self.layout.vae_cut) * b.frames / fpb) / 1000
            p = self.procs[job.procs[0]]
            p.left_s, p.since, p.rate = dur, self.now, self._free_rate(p)
            self._schedule(p)
            self._rates_changed()  # shared cores: the VAE beside it slows
            return
        blocks = job.msg.blocks
        sess = self.sessions[blocks[0].session]
        c = self.cost(sess.width, sess.height)
        k = len(job.procs)
        for b in blocks:
            if b.reset:
                self.shot_weights[(job.group, b.session)] = tuple(job.msg.weights) or None
        weights = self.shot_weights.get((job.group, blocks[0].session))
        bands = split_rows(sess.height // SPATIAL, k, weights)
        rows = [r1 - r0 for r0, r1 in bands]
        busy = all(self.now - self.procs[q].free_at <= BUSY_GAP_S for q in job.procs)
        dur, own = c.vae(k, rows, len(blocks), blocks[0].reset, blocks[0].vae_cut or self.layout.vae_cut, busy)
        job.own, job.rows, job.dur = own, rows, dur
        self.vae_blocks += len(blocks)
        if self.layout.shared:  # one shard (1+1), whose speed follows whether the DiT runs beside it
            p = self.procs[job.procs[0]]
            p.left_s, p.since, p.rate = dur, self.now, self._free_rate(p)
            self._schedule(p)
        else:
            self.vae_busy_s += dur
            self.at(self.now + dur, self._vae_done, job)
        self._rates_changed()

    def _free_rate(self, p: Proc) -> float:
        """The share of its device a low-priority process gets now: what running VAE shards on
        the same device leave free. On shared cores, a stage's speed against its speed on its
        own threads: 1 while another shared process runs, its speed on all the cores while none
        does."""
        if p.shared:
            if any(q is not p and q.shared and q.job is not None for q in self.procs.values()):
                return 1.0
            dit = p.job is not None and p.job.kind == "dit"
            blocks = p.job.msg.blocks if p.job is not None else []
            first = any(b.new_shot for b in blocks) if dit else bool(blocks and blocks[0].reset)
            up = self.cost(*self._size).lent_speedups(self.layout.devices, first)
            return up[0] if dit else up[1]
        if not p.low:
            return 1.0
        used = 0.0
        for q in self.procs.values():
            j = q.job
            if q is p or j is None or j.kind != "vae" or q.device != p.device:
                continue
            used += j.own[j.procs.index(q.name)] / j.dur if j.dur > 0 else 0.0
        if used == 0.0:
            return 1.0
        return max(0.02, (1.0 - used) * self.cost(*self._size).beside)

    def _rates_changed(self) -> None:
        for p in self.procs.values():
            if p.job is not None and (p.shared or (p.low and p.job.kind == "dit")):
                p.left_s -= (self.now - p.since) * p.rate
                p.since, p.rate = self.now, self._free_rate(p)
                self._schedule(p)

    def _schedule(self, p: Proc) -> None:
        """p's job ends when its work left is done at its rate now (a later change of rate
        schedules it anew, and the version drops the older end)."""
        p.version += 1
        self.at(self.now + max(0.0, p.left_s) / p.rate, self._done, p, p.version)

    def _done(self, p: Proc, version: int) -> None:
        if version != p.version or p.job is None:
            return
        if p.job.kind == "dit":
            self._dit_done(p)
            return
        job = p.job  # a shared shard's decode: what it took beside the DiT is its time
        job.dur = self.now - job.started
        job.own = [job.dur]
        self.vae_busy_s += job.dur
        self._vae_done(job)

    def _dit_done(self, p: Proc) -> None:
        job = p.job
        for q in job.procs:
            self.procs[q].job, self.procs[q].free_at = None, self.now
        n = len(job.msg.blocks)
        sess0 = self.sessions[job.msg.blocks[0].session]
        c = self.cost(sess0.width, sess0.height)
        wall_ms = 1000 * (self.now - job.started) / n
        for b in job.msg.blocks:
            sess = self.sessions[b.session]
            shape = [16, b.frames, sess.height // SPATIAL, sess.width // SPATIAL]
            done = m.LatentDone(b.session, b.block, b.slot, shape, wall_ms, batch=n, busy_ms=c.dit_own_ms())
            self.at(self.now + HOP_S / 2, self._post, done)
        self._rates_changed()  # shared cores: the VAE beside it speeds up
        self._try_start(job.procs)

    def _vae_done(self, job: Work) -> None:
        n = len(job.msg.blocks)
        for q in job.procs:
            self.procs[q].job, self.procs[q].free_at = None, self.now
        for rank in range(len(job.procs)):
            for d in job.msg.blocks:
                done = m.FramesDone(
                    d.session,
                    d.block,
                    rank,
                    d.frame_slot,
                    1000 * job.dur / n,
                    batch=n,
                    busy_ms=1000 * job.own[rank] / n,
                    rows=job.rows[rank],
                )
                self.at(self.now + HOP_S / 2, self._post, done)
        self._rates_changed()
        self._try_start(job.procs)

    # -- workloads ----------------------------------------------------------------------------
    def submit(self, name: str, scenes: list[Scene], width: int, height: int, fps: int = 16) -> None:
        blocks = plan_blocks(scenes, self.card.frames_per_block, self.card.temporal_factor)
        sess = s.Session(name, scenes, blocks, width, height, fps, 0, created=self.now)
        self.sessions[name] = sess
        self.pending.append(s.Submit(sess))
        self.at(self.now, lambda: None)


def storyboard(scene_seconds: float = 4.0, fps: int = 16) -> list[Scene]:
    """tools/bench/layouts.py's W1: three scenes, continue then cut."""
    n = int(scene_seconds * fps)
    return [Scene("a red fox", n), Scene("the fox stops", n, "continue"), Scene("a city street", n, "cut")]


def playback_stalls(frags: list[tuple[float, int]], fps: int, startup_s: float = 0.0) -> int:
    """tools/bench/layouts.py's player: starts `startup_s` after the first fragment, rebuffers when late."""
    if not frags:
        return 0
    start, shown, stall_s, stalls = frags[0][0] + startup_s, 0, 0.0, 0
    for t, n in frags:
        due = start + stall_s + shown / fps
        if t > due + 1e-3:
            stalls += 1
            stall_s += t - due
        shown += n
    return stalls


@dataclass
class Prediction:
    layout: str
    w1_fps: float
    w1_steady_fps: float
    w1_ttff_s: float
    goodput: int | None = None
    vae_ms_per_block: float = 0.0  # the VAE's mean time per block in W1 (a measured run's speed check)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def simulate(
    cfg: Config,
    profile: Profile,
    layout: Layout,
    card: ModelCard,
    size: tuple[int, int],
    w2_size: tuple[int, int] | None = None,
    max_streams: int = 8,
    scene_seconds: float = 4.0,
    w2_seconds: float = 6.0,
    fps: int = 16,
    image: bool = False,
) -> Prediction:
    """W1 (one storyboard; `image`: its first scene starts from an image) and, with w2_size, W2's
    goodput, as tools/bench/layouts.py runs them."""
    sim = Sim(cfg, profile, layout, size, card)
    scenes = storyboard(scene_seconds, fps)
    if image:
        scenes[0] = replace(scenes[0], image=b"image")  # the simulator never reads the picture
    sim.submit("w1", scenes, *size, fps)
    sim.run()
    frags = sim.result.fragments.get("w1", [])
    frames = sum(n for _, n in frags)
    last = frags[-1][0] if frags else float("inf")
    steady = sum(n for _, n in frags[1:]) / (last - frags[0][0]) if len(frags) > 1 else 0.0
    vae_ms = 1000 * sim.vae_busy_s / max(1, sim.vae_blocks)
    pred = Prediction(
        layout.name, frames / last if frags else 0.0, steady, frags[0][0] if frags else float("inf"), None, vae_ms
    )
    if w2_size is not None:
        good = 0
        for n in range(1, max_streams + 1):
            sim = Sim(cfg, profile, layout, w2_size, card)
            for i in range(n):
                sim.submit(f"s{i}", [Scene(f"stream {i}", int(w2_seconds * fps))], *w2_size, fps)
            sim.run()
            played = [sim.result.fragments.get(f"s{i}", []) for i in range(n)]
            ok = sim.result.rejected == 0 and all(played)
            if ok and all(playback_stalls(f, fps) == 0 for f in played):
                good = n
            else:
                break
        pred.goodput = good
    return pred
