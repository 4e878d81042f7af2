"""A discrete-event model of the pipeline: what a layout would do with a workload, from a profile.

The policy is not modelled but run: the daemon's own `Scheduler` (admission, EDF, batching,
band weights, pacing) takes the simulated events and its actions are carried out on simulated
processes whose service times come from the profile (profile.py):

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

`simulate` returns the figures `tools/bench` measures: W1 frames/s (from the request to the last
fragment), steady frames/s, time to first fragment, and W2 goodput (concurrent streams that
all play without a stall).
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import deque
from dataclasses import dataclass, field, replace

from ..config import Config
from ..ipc import messages as m
from ..models.wan.rows import split_rows
from ..plan import Scene, plan_blocks
from ..supervisor import scheduler as s
from ..supervisor.topology import Topology, layout_processes
from .profile.schema import Profile

HOP_S = 0.001  # a message's way through ZeroMQ and back, and the ring copies around it
BUSY_GAP_S = 0.01  # a process whose last job ended this recently is still busy (an aggregated
# worker's VAE batch starts a hop or two after its DiT batch ends)
SPATIAL = 8


@dataclass(frozen=True)
class Layout:
    mode: str  # disaggregated | aggregated | hybrid
    dit: int  # DiT devices (workers)
    vae: int  # VAE devices (shards)
    group: int = 0  # shards per VAE group (0: all)
    threads: int = 1  # per worker (CPU)
    weights: tuple[float, ...] = ()
    dit_group: int = 1  # devices per DiT (Ulysses; disaggregated)
    cut: int = 0  # the DiT workers also run the VAE decoder's first `cut` stages (topology.vae_cut)
    shared: bool = False  # CPU: a waiting worker lends its cores to the other (topology.share_cores)

    @property
    def group_size(self) -> int:
        return self.group or self.vae

    @property
    def devices(self) -> int:
        """Devices it occupies (on the CPU a device is a core: threads count)."""
        n = self.dit + self.vae if self.mode == "disaggregated" else max(self.dit, self.vae)
        return n * self.threads

    @property
    def name(self) -> str:
        k = self.group_size
        if self.mode == "disaggregated":
            base = f"disagg-{self.dit}+{self.vae}" + (f"/k{k}" if k != self.vae else "")
            base += f"/sp{self.dit_group}" if self.dit_group > 1 else ""
            base += f"/cut{self.cut}" if self.cut else ""
        elif self.mode == "hybrid":
            base = f"hybrid-{self.dit}+{self.vae}" + (f"/k{k}" if k != self.vae else "")
        elif self.dit_group > 1:  # one DiT and one VAE group over the same devices, in sequence
            base = f"agg-sp{self.dit_group}"
        elif self.dit == 1 and self.vae == 1:
            base = "agg-1"
        elif self.dit == self.vae and k == 1:
            base = f"agg-{self.dit}rep"
        elif self.dit == 1 and k == self.vae:
            base = f"agg-seq-k{self.vae}"
        else:
            base = f"agg-{self.dit}+{self.vae}/k{k}"
        return base + (f"x{self.threads}t" if self.threads > 1 else "") + ("/shared" if self.shared else "")

    def flags(self) -> list[str]:
        out = ["--mode", self.mode, "--dit-gpus", str(self.dit), "--vae-gpus", str(self.vae)]
        if self.group and self.group != self.vae:
            out += ["--vae-group-size", str(self.group)]
        if self.dit_group > 1:
            out += ["--dit-group-size", str(self.dit_group)]
        if self.threads > 1:
            out += ["--threads-per-worker", str(self.threads)]
        if self.cut:
            out += ["--vae-cut", str(self.cut)]
        if self.shared:
            out += ["--share-cores"]
        return out

    def topology(self) -> Topology:
        lay = layout_processes(self.mode, self.dit, self.vae, self.group_size, self.dit_group)
        dit_groups = {g[0]: g for g in lay.dit_groups if len(g) > 1}
        return Topology([], lay.dit_names, lay.group_names, {name: dev for name, _, dev in lay.procs}, dit_groups)


def _clamp(factor: float) -> float:
    """A measured cost factor kept to what a noisy probe can be trusted for."""
    return min(4.0, max(0.25, factor))


@dataclass
class Costs:
    """Service times of one frame size, in seconds, from a profile."""

    profile: Profile
    size: tuple[int, int]
    threads: int
    dit_group: int = 1
    cut: int = 0  # the layout's; a block may carry its own (an adapting cut, placement/cut.py)

    def __post_init__(self) -> None:
        fig = self.profile.size(*self.size)
        t = str(self.threads) if str(self.threads) in fig["dit"] else "1"
        self.dit, self.vae1, self.enc = fig["dit"][t], fig["vae"][t], fig["encode"]
        if self.dit_group > 1:  # one DiT over g devices: its rank 0's times, all-to-alls included
            self.dit = fig["dit_group"][str(self.dit_group)]
        # On the CPU the supervisor (the encoder threads) shares the DiT workers' cores: what
        # encoding a block takes from the DiT, measured beside it (0 where not measured).
        self.host_ms = max(0.0, self.dit.get("host_block_ms", self.dit["block_ms"]) - self.dit["block_ms"])
        # an image-to-video request's first block: the image encoded and committed (profile/probes.py `_image_ms`;
        # where not measured, a first block's time)
        self.image_ms = self.dit.get("image_ms", self.dit["first_ms"])
        self.fig = fig
        self.factors = self.cut_factors()
        self.cut_ms = self.dit_cut_ms(self.cut)
        self.groups = fig.get("vae_group", {})
        self.rows = self.size[1] // SPATIAL
        self.beside = self._beside(fig.get("hybrid"))
        self._fit()

    def _stages_off_vae(self, cut: int) -> float:
        """A cut's first stages' share of the VAE's measured time."""
        return self.vae1["block_ms"] * cut_fraction(self.fig, cut)

    def _stages_on_dit(self, cut: int) -> float:
        """The stages as the profile timed them in the DiT's process after its block (profiles
        from before that: the time they leave the VAE)."""
        beside_dit = self.dit.get("cut_stages_ms")
        return sum(beside_dit[:cut]) if beside_dit and cut else self._stages_off_vae(cut)

    def _cut_probes(self) -> tuple[float, float, float, float] | None:
        """Over the cuts the profile ran side by side (profile/cpu_probes.py `levels`): what they added to
        the DiT's block, took off the VAE's, and the stage times they moved as timed on the DiT
        and as a share of the VAE's decode; None where none was (probes are of one-thread
        workers)."""
        probes = self.fig.get("levels", {}).get("cuts", {}) if self.threads == 1 else {}
        on = sum(self._stages_on_dit(int(c)) for c in probes)
        off = sum(self._stages_off_vae(int(c)) for c in probes)
        if not probes or on <= 0 or off <= 0:
            return None
        grew = sum(p["dit"] for p in probes.values()) - len(probes) * self.dit["block_ms"]
        fell = len(probes) * self.vae1["block_ms"] - sum(p["vae"] for p in probes.values())
        return grew, fell, on, off

    def cut_factors(self) -> tuple[float, float]:
        """(DiT, VAE): what the cut probes added to the DiT's block against the stages' times
        there, and took off the VAE's against their share of its decode; (1, 1) unmeasured."""
        p = self._cut_probes()
        return (1.0, 1.0) if p is None else (_clamp(p[0] / p[2]), _clamp(p[1] / p[3]))

    def cut_exchange(self) -> tuple[float, float]:
        """(DiT, VAE): the same per ms of the VAE's decode that a cut moves, as the daemon's cut
        balance prices a cut (placement/cut.py, topology.vae_cut_exchange)."""
        p = self._cut_probes()
        return (1.0, 1.0) if p is None else (_clamp(p[0] / p[3]), _clamp(p[1] / p[3]))

    def vae_cut_ms(self, cut: int) -> float:
        """What a cut takes off the VAE."""
        return self.factors[1] * self._stages_off_vae(cut)

    def dit_cut_ms(self, cut: int) -> float:
        """What a cut adds to the DiT's block."""
        return self.factors[0] * self._stages_on_dit(cut)

    def lent_speedups(self, cores: int, first: bool = False) -> tuple[float, float]:
        """(DiT, VAE): each stage's speed on `cores` threads (its own and those lent to it while
        the other waits) against its speed on its own, from the profile's thread rounds; 1 where
        the profile has no figure at that count. `first`: a shot's first block, timed after
        idle (on the EPYC two threads made the DiT's no faster: 71 ms against 72)."""
        key = "first_ms" if first else "block_ms"

        def up(role: str, own: dict) -> float:
            alone = self.fig[role].get(str(cores))
            return max(1.0, own[key] / alone[key]) if alone and alone.get(key, 0) > 0 and own.get(key) else 1.0

        return up("dit", self.dit), up("vae", self.vae1)

    def _beside(self, probe: dict | None) -> float:
        """How much of the time a decoding shard leaves free on its core a low-priority DiT turns
        into work (the profile's hybrid probe): the two switch at every halo exchange, and the
        DiT's caches go cold. 1 when not measured. The DiT's time alone is the probe's own, taken
        seconds before it (profiles from before it was recorded: the DiT's measurement)."""
        if not probe:
            return 1.0
        shard0 = probe["group"][0]
        free = 1.0 - shard0["own_ms"] / shard0["block_ms"]
        if free <= 0 or probe["dit"]["wall_ms"] <= 0:
            return 1.0
        alone = probe["dit"].get("alone_ms", self.dit["block_ms"])
        return min(1.0, max(0.05, alone / (probe["dit"]["wall_ms"] * free)))

    def _fit(self) -> None:
        """own(rows) = front + rows * per_row, least squares over the profile's bands."""
        pts = [(self.rows, self.vae1["own_ms"])]
        for splits in self.groups.values():
            for shards in splits.values():
                pts += [(x["rows"], x["own_ms"]) for x in shards]
        n = len(pts)
        mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
        var = sum((p[0] - mx) ** 2 for p in pts)
        b = sum((p[0] - mx) * (p[1] - my) for p in pts) / var if var > 0 else my / max(mx, 1)
        b = max(b, 1e-3)
        self.per_row_ms, self.front_ms = b, max(0.0, my - b * mx)

    @staticmethod
    def _batch(fig: dict, n: int, block_ms: float) -> float:
        """Per-block ms in a batch of n (the nearest batch size measured)."""
        if n <= 1 or not fig.get("batch_ms"):
            return block_ms
        sizes = sorted(int(k) for k in fig["batch_ms"])
        near = min(sizes, key=lambda k: (abs(k - n), k))
        return fig["batch_ms"][str(near)]

    def dit_s(self, n: int, shot_starts: int, cuts: list[int] | None = None, host: bool = True) -> float:
        """A batch of n blocks (every block is whole: plan.py); `cuts`: each block's VAE cut
        (default: the layout's); `host`: the encoder is at work beside it (not before the first
        fragment)."""
        d = self.dit
        per = self._batch(d, n, d["block_ms"])
        # A shot's first block: its prompt, its own steps, an empty cache (cheaper on the CPU).
        first = shot_starts * (d["first_ms"] - d["block_ms"]) * per / d["block_ms"]
        stages = sum(self.dit_cut_ms(c) for c in cuts) if cuts is not None else self.cut_ms * n
        return (per * n + first + stages + (self.host_ms * n if host else 0.0)) / 1000

    def dit_own_ms(self) -> float:
        return self.dit["own_ms"]

    def _overhead_ms(self, k: int) -> float:
        g = self.groups.get(str(k), {}).get("equal")
        if g:
            return max(0.0, g[0]["block_ms"] - max(x["own_ms"] for x in g))
        two = self.groups.get("2", {}).get("equal")  # not measured at this k: as at 2
        return max(0.0, two[0]["block_ms"] - max(x["own_ms"] for x in two)) if two else 0.0

    def vae(
        self,
        k: int,
        rows: list[int],
        n: int,
        first: bool,
        cut: int | None = None,
        busy: bool = False,
    ) -> tuple[float, list[float]]:
        """(seconds for the group's batch, each shard's own seconds); `cut`: the batch's VAE cut
        (default: the layout's); `busy`: the process ran other work
        until now (a shot's first block after idle is slower on two threads, profile.py)."""
        v = self.vae1
        scale = self._batch(v, n, v["block_ms"]) / v["block_ms"] * n
        if first:
            scale *= ((v.get("first_busy_ms") if busy else None) or v["first_ms"]) / v["block_ms"]
        if k == 1:
            own = (v["block_ms"] - self.vae_cut_ms(self.cut if cut is None else cut)) * scale / 1000
            return own, [own]
        own = [(self.front_ms + r * self.per_row_ms) * scale / 1000 for r in rows]
        return max(own) + self._overhead_ms(k) * scale / 1000, own

    def encode_s(self, first: bool) -> float:
        return self.enc["first_ms" if first else "block_ms"] / 1000


def cut_fraction(fig: dict, cut: int) -> float:
    """The share of the VAE's time in its decoder's first `cut` stages (the profile's per-stage
    times; 0 without a cut)."""
    if not cut:
        return 0.0
    stages = fig["vae"]["1"].get("stages_ms")
    if not stages or cut >= len(stages):
        raise ValueError(f"the profile has no VAE stage times for a cut of {cut}")
    return sum(stages[:cut]) / sum(stages)


@dataclass
class Job:
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
    job: Job | None = None
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


def cut_exchange(profile: Profile, layout: Layout, size: tuple[int, int], default: tuple[float, ...]) -> tuple:
    """The exchange the daemon's cut balance prices a layout's cut at (topology.vae_cut_exchange):
    the profile's, for a layout with a cut; `default` for one without."""
    if not layout.cut:
        return default
    return Costs(profile, size, layout.threads, layout.dit_group, layout.cut).cut_exchange()


class Sim:
    def __init__(self, cfg: Config, profile: Profile, layout: Layout, size: tuple[int, int], facts: dict) -> None:
        t = replace(
            cfg.topology,
            mode=layout.mode,
            dit_devices=layout.dit,
            vae_devices=layout.vae,
            vae_group_size=layout.group,
            dit_group_size=layout.dit_group,
            vae_cut=layout.cut,
            share_cores=layout.shared,
            vae_cut_exchange=cut_exchange(profile, layout, size, cfg.topology.vae_cut_exchange),
            threads_per_worker=layout.threads,
            vae_band_weights=layout.weights,
        )
        self.cfg = replace(cfg, topology=t)
        self.layout, self.facts = layout, facts
        self.topo = layout.topology()
        self.costs: dict[tuple[int, int], Costs] = {}
        self.profile = profile
        self.procs = {
            name: Proc(name, dev, low=layout.mode == "hybrid" and name in self.topo.dit_workers, shared=layout.shared)
            for name, dev in self.topo.devices.items()
        }
        p = self.cfg.pipeline
        self.sched = s.Scheduler(self.cfg, self.topo, p.latent_slots, p.frame_slots, lambda w: True, facts)
        self.now = 0.0
        self.heap: list = []
        self.seq = itertools.count()
        self.pending: list = []  # events for the next step
        self.vae_busy_s = 0.0  # summed VAE batch time per block decoded (the speed check of tools/bench_placement)
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
                self.profile, (w, h), self.layout.threads, self.layout.dit_group, self.layout.cut
            )
        return self.costs[(w, h)]

    def _seed(self, size: tuple[int, int]) -> None:
        """The workers' READY timings, as they would report them (at the preset's size when the
        profile has it)."""
        default = tuple(self.facts.get("default_size", size))
        w, h = default if f"{default[0]}x{default[1]}" in self.profile.sizes else size
        c = self.cost(w, h)
        events = []
        for dit in self.topo.dit_workers:
            info = {
                "dit_cost": {"block_ms": c.dit["block_ms"] + c.cut_ms, "busy_ms": c.dit["own_ms"], "size": [w, h]},
                "dit_batch_ms": {"2": c.dit["batch_ms"]["2"]} if "2" in c.dit.get("batch_ms", {}) else {},
                "dit_memory": None,
            }
            events.append(s.WorkerReady(dit, info))
        stages = c.vae1.get("stages_ms")
        for group in self.topo.vae_groups:
            k = len(group)
            # The worker's start-up block is a whole decode, with a cut too (stages.VAEStage.calibrate).
            g_ms, _ = c.vae(k, [r1 - r0 for r0, r1 in split_rows(h // SPATIAL, k)], 1, False, 0)
            b2 = c.vae1.get("batch_ms", {}).get("2")
            info = {
                "vae_rank": 0,
                "vae_cost": {"block_ms": 1000 * g_ms, "size": [w, h]},
                "vae_batch_ms": {"2": b2 * g_ms * 1000 / c.vae1["block_ms"]} if b2 else {},
                "vae_memory": None,
            }
            if self.layout.cut and stages:
                info["vae_stages_ms"] = {"ms": stages, "size": [w, h]}
            events.append(s.WorkerReady(group[0], info))
        self.step(events)

    # -- the event loop -----------------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), fn, args))

    def step(self, events: list) -> None:
        actions = self.sched.step([*self.pending, *events], self.now)
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
                    self._enqueue(Job("dit", msg, ranks))
            elif isinstance(msg, m.DecodeBatch):
                gi = next(i for i, g in enumerate(self.topo.vae_groups) if a.worker in g)
                if a.worker == self.topo.vae_groups[gi][0]:  # one job for the whole group
                    self._enqueue(Job("vae", msg, list(self.topo.vae_groups[gi]), gi))
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
    def _enqueue(self, job: Job) -> None:
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

    def _start(self, job: Job) -> None:
        job.started = self.now
        if job.kind == "dit":
            blocks = job.msg.blocks
            sess = self.sessions[blocks[0].session]
            c = self.cost(sess.width, sess.height)
            # an image-to-video shot's first block is the image, encoded and committed: once a request
            # (no VAE cut runs with an image: the worker refuses one)
            text = [b for b in blocks if b.image is None]
            cuts = [b.vae_cut or self.layout.cut for b in text]
            # the encoder takes from the DiT's cores once it has a block to encode
            host = bool(self.result.fragments)
            dur = c.dit_s(len(text), sum(1 for b in text if b.cut), cuts, host) if text else 0.0
            dur += (len(blocks) - len(text)) * c.image_ms / 1000
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
        dur, own = c.vae(k, rows, len(blocks), blocks[0].reset, blocks[0].vae_cut or self.layout.cut, busy)
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
            first = any(b.cut for b in blocks) if dit else bool(blocks and blocks[0].reset)
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

    def _vae_done(self, job: Job) -> None:
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
        blocks = plan_blocks(scenes, self.facts["frames_per_block"], self.facts.get("temporal_factor", 4))
        sess = s.Session(name, scenes, blocks, width, height, fps, 0, created=self.now)
        self.sessions[name] = sess
        self.pending.append(s.Submit(sess))
        self.at(self.now, lambda: None)


def storyboard(scene_seconds: float = 4.0, fps: int = 16) -> list[Scene]:
    """tools/bench's W1: three scenes, continue then cut."""
    n = int(scene_seconds * fps)
    return [Scene("a red fox", n), Scene("the fox stops", n, "continue"), Scene("a city street", n, "cut")]


def playback_stalls(frags: list[tuple[float, int]], fps: int, startup_s: float = 0.0) -> int:
    """tools/bench's player: starts `startup_s` after the first fragment, rebuffers when late."""
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
    facts: dict,
    size: tuple[int, int],
    w2_size: tuple[int, int] | None = None,
    max_streams: int = 8,
    scene_seconds: float = 4.0,
    w2_seconds: float = 6.0,
    fps: int = 16,
    image: bool = False,
) -> Prediction:
    """W1 (one storyboard; `image`: its first scene starts from an image) and, with w2_size, W2's
    goodput, as tools/bench runs them."""
    sim = Sim(cfg, profile, layout, size, facts)
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
            sim = Sim(cfg, profile, layout, w2_size, facts)
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
