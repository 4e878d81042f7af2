"""Admission from a capacity model (supervisor process; plain arithmetic, no I/O).

A session plays in real time when each unit it runs on — its DiT worker and its VAE group —
spends less time on a block than the block lasts on screen. Each unit's cost per block is
measured: one calibration block at the preset's default size when the worker starts (READY),
then every block's reported compute time (an exponential average per unit and size). A DiT
call over B sessions' blocks costs B x block cost x batch_factor(B): the factor (per-block
share at B against alone) is measured at READY for a pair, extrapolated to larger batches, and
follows every batched block's reported share after. A size never seen yet is estimated from the nearest
measured one, scaled by pixels.

Admitting a session adds its demand — block cost / block duration — to its units. It is admitted
when every unit stays under `target_utilization` and the caches it will hold fit the memory
budget of every worker process they sit in (the DiT's KV window and prompt cache, the VAE's
temporal cache for its share of the rows): one budget per process, and so per device, shared by
the stages in it (an aggregated worker's DiT and VAE caches count against the same memory). A
worker whose device ran out of memory in a block learns it (`out_of_memory`): its budget drops
below what the sessions on it held then. Otherwise `predicted_start` replays the
running sessions' ends (each is expected to stream at real-time pace) to say when it would fit:
the API queues it when that is within `max_queue_wait_s`, else answers 429 with that wait as
Retry-After.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...ipc.messages import DiTMemory, VAEMemory
from ...plan import cache_frames

EWMA = 0.3  # weight of the newest block in a unit's cost
# After an out-of-memory error a unit's budget is this share of what its sessions held then: the
# same sessions again would not fit, and the transients the budget did not see get room.
OOM_MARGIN = 0.9
TRIALS = 3  # batches of a size run before its factor is trusted over a one-off timing at READY
TRIAL_MARGIN = 1.1  # ... where that timing put it within this of no gain (a one-off CPU timing's noise)


def group_unit(group: int) -> str:
    """A VAE group's name as a unit of capacity (a DiT's is its worker's)."""
    return f"vae-group-{group}"


@dataclass
class Demand:
    """What one session asks of its units: busy share and bytes held, per unit."""

    share: dict[str, float] = field(default_factory=dict)  # unit -> fraction of its time
    memory: dict[str, float] = field(default_factory=dict)  # unit -> bytes


class CapacityModel:
    def __init__(self, target_utilization: float) -> None:
        self.target = target_utilization
        self.cost_ms: dict[tuple[str, tuple[int, int]], float] = {}  # (unit, (w, h)) -> ms per block
        self.memory: dict[str, DiTMemory | VAEMemory] = {}  # unit -> what its worker said it holds per session
        self.factor: dict[tuple, float] = {}  # (unit, (w, h), batch size) -> per-block share / alone
        self.batches_seen: dict[tuple, int] = {}  # (unit, (w, h), batch size) -> blocks observed
        self.workers: dict[str, tuple[str, ...]] = {}  # unit -> the processes holding its sessions' caches
        self.budget: dict[str, float] = {}  # worker process -> what its sessions' caches may hold
        self._oom: dict[str, frozenset] = {}  # worker -> the sessions on it at its last out-of-memory

    # -- what the workers tell ----------------------------------------------------------------
    def calibrate(
        self,
        unit: str,
        size: list[int],
        block_ms: float,
        memory: DiTMemory | VAEMemory | None,
        workers: tuple[str, ...] | list[str] = (),
    ) -> None:
        """A unit's start-up figures; `workers`: the processes that hold each of its sessions'
        caches (a VAE group's shards, a DiT group's ranks; default the unit itself)."""
        self.cost_ms.setdefault((unit, (size[0], size[1])), block_ms)
        if memory:
            self.memory[unit] = memory
            self.workers[unit] = tuple(workers) or (unit,)

    def batch_limit(self, unit: str) -> int | None:
        """The largest batch the unit's worker kept transients for (None: no limit said)."""
        mem = self.memory.get(unit)
        return mem.batch if mem is not None and mem.batch > 0 else None

    def worker_budget(self, worker: str, budget_bytes: float) -> None:
        """A worker process's memory budget, as its READY says (one for all its stages)."""
        self.budget[worker] = budget_bytes
        self._oom.pop(worker, None)

    def held(self, demands: list[Demand]) -> dict[str, float]:
        """Bytes the demands' caches hold in each worker process."""
        out: dict[str, float] = {}
        for d in demands:
            for u, x in d.memory.items():
                for w in self.workers.get(u, (u,)):
                    out[w] = out.get(w, 0.0) + x
        return out

    def out_of_memory(self, worker: str, held: dict[str, float]) -> float | None:
        """The worker's device ran out of memory in a block while its sessions held `held`
        (session -> bytes in that worker, as admission counts them): its budget is lowered to
        OOM_MARGIN x their sum, never raised. A batch's sessions each report the same error:
        learnt once for them. Returns the new budget (None: nothing learnt)."""
        if worker not in self.budget or (held and set(held) <= self._oom.get(worker, frozenset())):
            return None
        self._oom[worker] = frozenset(held)
        self.budget[worker] = min(self.budget[worker], OOM_MARGIN * sum(held.values()))
        return self.budget[worker]

    def calibrate_batch(self, unit: str, size: list[int], batch: int, factor: float) -> None:
        self.factor.setdefault((unit, (size[0], size[1]), batch), factor)

    def _factor_known(self, unit: str, size: tuple[int, int], batch: int) -> tuple[float, bool]:
        """(factor, measured at this very size). Measured at this size; else a pair's factor
        compounded per doubling; else the nearest size's (by pixels) for this batch size; else
        1.0 (assumed to save nothing)."""
        if (unit, size, batch) in self.factor:
            return self.factor[(unit, size, batch)], True
        if (unit, size, 2) in self.factor:
            return self.factor[(unit, size, 2)] ** math.log2(batch), False
        known = [(s, f) for (u, s, b), f in self.factor.items() if u == unit and b == batch]
        if not known:
            return 1.0, False
        px = size[0] * size[1]
        return min(known, key=lambda item: abs(math.log(item[0][0] * item[0][1] / px)))[1], False

    def batch_factor(self, unit: str, size: tuple[int, int], batch: int) -> float:
        """Per-block cost of a block in a batch of `batch` against alone."""
        return 1.0 if batch <= 1 else self._factor_known(unit, size, batch)[0]

    def on_trial(self, unit: str, size: tuple[int, int], batch: int) -> bool:
        """Whether batches of this size are still being tried. A factor timed once at READY is a
        prior: where it says "about no gain" (on a CPU a pair's gain is a few percent, inside the
        noise of one timing), or where it was timed at another frame size (the gain depends on
        it: small matrices gain most), the first few real batches run anyway and their measured
        shares decide after. A factor timed clearly dearer at this very size is believed."""
        if self.batches_seen.get((unit, size, batch), 0) >= TRIALS * batch:
            return False
        f, here = self._factor_known(unit, size, batch)
        return not here or f < TRIAL_MARGIN * self.batch_factor(unit, size, batch - 1)

    def observe(self, unit: str, size: tuple[int, int], block_ms: float, batch: int = 1) -> float | None:
        """A block's measured time (its share of a batch of `batch`); returns what the model had
        predicted for it. Alone, it updates the unit's cost; in a batch, the batch factor."""
        alone = self.block_ms(unit, size)
        predicted = None if alone is None else alone * self.batch_factor(unit, size, batch)
        if batch > 1:
            key = (unit, size, batch)
            self.batches_seen[key] = self.batches_seen.get(key, 0) + 1
            if alone:
                old = self.factor.get(key)
                f = block_ms / alone
                self.factor[key] = f if old is None else (1 - EWMA) * old + EWMA * f
            return predicted
        key = (unit, size)
        old = self.cost_ms.get(key)
        self.cost_ms[key] = block_ms if old is None else (1 - EWMA) * old + EWMA * block_ms
        return predicted

    def block_ms(self, unit: str, size: tuple[int, int]) -> float | None:
        """Measured cost at this size, else the nearest measured size of the unit scaled by
        pixels; None when the unit has reported nothing."""
        if (unit, size) in self.cost_ms:
            return self.cost_ms[(unit, size)]
        known = [(s, ms) for (u, s), ms in self.cost_ms.items() if u == unit]
        if not known:
            return None
        px = size[0] * size[1]
        s, ms = min(known, key=lambda item: abs(math.log(item[0][0] * item[0][1] / px)))
        return ms * px / (s[0] * s[1])

    # -- sessions -------------------------------------------------------------------------------
    def demand(
        self,
        units: dict[str, str],
        size: tuple[int, int],
        block_s: float,
        latent_hw,
        tokens: int,
        k: int,
        held_frames: int = 0,
    ):
        """units: stage -> unit name; block_s: one block's duration on screen; tokens: the DiT's
        tokens per latent frame; k: shards of the VAE group; held_frames: the most latent frames
        a shot of the session holds (0: unbounded), which its KV cache is sized for where that is
        shorter than the window (`plan.cache_frames`, as the DiT worker allocates it)."""
        d = Demand()
        for stage, unit in units.items():
            ms = self.block_ms(unit, size)
            if ms is not None:
                d.share[unit] = ms / 1000 / block_s
            mem = self.memory.get(unit)
            if mem is None:
                continue
            if stage == "dit":
                frames = cache_frames(mem.window_frames, mem.least_frames, held_frames)
                d.memory[unit] = mem.kv_bytes_per_token * frames * tokens + mem.cross_bytes
            else:  # each shard holds about its share of the rows (the calibration measured one shard)
                d.memory[unit] = mem.cache_bytes_per_latent_pixel * latent_hw[0] * latent_hw[1]
        return d

    def load(self, running: list[Demand]) -> dict[str, float]:
        """The busy share the demands ask of each unit (their memory, per process: `held`)."""
        share: dict[str, float] = {}
        for d in running:
            for u, x in d.share.items():
                share[u] = share.get(u, 0.0) + x
        return share

    def fits(self, new: Demand, running: list[Demand]) -> bool:
        """Whether `new` can join `running` on its units. A unit with nothing running takes any
        session: one that cannot stream in real time even alone still gets made, just not
        beside others (a job that is not watched live does not need real time)."""
        procs = set(self.held([new]))
        mine = set(new.share) | set(new.memory)
        running = [d for d in running if mine & (set(d.share) | set(d.memory)) or procs & set(self.held([d]))]
        if not running:
            return True
        share = self.load(running)
        if any(share.get(u, 0.0) + x > self.target for u, x in new.share.items()):
            return False
        held = self.held([*running, new])
        return all(held[w] <= self.budget[w] for w in procs if w in self.budget)

    def predicted_start(
        self, new: Demand, running: list[tuple[float, Demand]], ahead: list[tuple[float, Demand]]
    ) -> float:
        """Seconds from now until `new` fits, given running sessions (seconds left, demand) and
        sessions queued ahead of it (their length, demand), each streaming at real-time pace."""
        ends = sorted(running, key=lambda r: r[0])
        now, active = 0.0, [d for _, d in ends]
        pending = [*ahead, (0.0, new)]
        while pending:
            length, d = pending[0]
            if self.fits(d, active):
                pending.pop(0)
                if not pending:
                    return now
                active.append(d)
                ends.append((now + length, d))
                ends.sort(key=lambda r: r[0])
                continue
            t, done = ends.pop(0)  # an empty unit takes anything, so this never runs dry
            now = max(now, t)
            active.remove(done)
        return now
