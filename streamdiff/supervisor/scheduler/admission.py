"""Admission and placement, one collaborator of the scheduler: a session is admitted now, queued
(when predicted to start within max_queue_wait_s), or refused with the predicted wait, by the
capacity model (capacity.py); it goes to the least busy ready DiT worker and VAE group. The
workers' READY timings seed the capacity model.

It owns the queue and the capacity model; the running sessions and which workers are ready are
its callers' (arguments), so it can be driven alone.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from ...card import ModelCard
from ...config import Config
from ...ipc import messages as m
from ...plan import most_held_frames
from ..topology import Topology
from .capacity import CapacityModel, Demand, group_unit
from .events import Reject
from .tickets import T_EMITTED, Session

log = logging.getLogger("streamdiff.scheduler")


def left_s(sess: Session) -> float:
    """The media time the session has still to emit."""
    return sum(t.block.emit for t in sess.tickets if t.state != T_EMITTED) / sess.fps


Ready = Callable[[str], bool]  # whether a worker (or a DiT group, by its rank 0) is ready now


class Admission:
    def __init__(self, cfg: Config, topology: Topology, card: ModelCard) -> None:
        self.limits = cfg.limits
        self.topology = topology
        self.card = card
        self.capacity = CapacityModel(cfg.limits.target_utilization)
        self.queue: deque[Session] = deque()
        self.accepting = True

    def submit(self, sess: Session, running: list[Session]) -> Reject | None:
        """Queue the session (admitted now or once predicted to start within max_queue_wait_s),
        or the refusal, with the predicted wait as Retry-After."""
        lim, n = self.limits, len(running)
        if not self.accepting:
            return Reject(sess.id, "the server is not admitting sessions", 10.0)
        if n >= lim.max_sessions and len(self.queue) >= lim.max_queue:
            return Reject(sess.id, f"{n} sessions running and {len(self.queue)} queued", 10.0)
        wait = self.predicted_wait(sess, running)
        if wait > 0 and (wait > lim.max_queue_wait_s or len(self.queue) >= lim.max_queue):
            return Reject(sess.id, f"predicted to start in {wait:.0f}s beside the {n} running sessions", wait)
        self.queue.append(sess)
        if wait > 0:
            log.info("session %s queued: predicted to start in %.1fs", sess.id, wait)
        return None

    def next_to_start(self, running: list[Session], ready: Ready) -> Session | None:
        """The queue's head, placed and taken off the queue, if a ready pipeline has room for it."""
        if not self.queue or not self.accepting or len(running) >= self.limits.max_sessions:
            return None
        sess = self.queue[0]
        if not self.place(sess, running, ready):
            return None
        return self.queue.popleft()

    def stop(self) -> list[Session]:
        """Admit no more; the queued sessions, taken off the queue, for their callers to end."""
        self.accepting = False
        queued = list(self.queue)
        self.queue.clear()  # in place: the books hold it too
        return queued

    def calibrate(self, worker: str, info: m.ReadyInfo) -> None:
        """A worker's READY: its calibration blocks and memory facts seed the capacity model."""
        dit, vae = info.dit, info.vae
        for r in (dit, vae):  # one budget per process, whichever of its stages says it
            if r is not None and r.memory is not None:
                self.capacity.worker_budget(worker, r.memory.budget_bytes)
        if dit is not None:
            cost = dit.cost
            self.capacity.calibrate(worker, cost.size, cost.block_ms, dit.memory, self.topology.members(worker))
            for b, ms in dit.batch_ms.items():
                self.capacity.calibrate_batch(worker, cost.size, int(b), ms / cost.block_ms)
        if vae is not None and vae.rank == 0:
            group = self.topology.group_of(worker)
            unit, cost = group_unit(group), vae.cost
            self.capacity.calibrate(unit, cost.size, cost.block_ms, vae.memory, self.topology.vae_groups[group])
            for b, ms in vae.batch_ms.items():
                self.capacity.calibrate_batch(unit, cost.size, int(b), ms / cost.block_ms)

    def held_frames(self, sess: Session) -> int:
        """The most latent frames a shot of this session can hold (`plan.most_held_frames`): its
        KV cache is sized for no more where that is shorter than the window. 0: a live video.
        Fixed when the session opens, as the worker's cache is: a steer after that replans its
        blocks, and admission keeps pricing the cache that was allocated."""
        if sess.place.held_frames is not None:
            return sess.place.held_frames
        return 0 if sess.live else most_held_frames(sess.blocks)

    def demand(self, sess: Session, dit: str, group: int) -> Demand:
        block_s = max(b.frames_out for b in sess.blocks) / sess.fps
        return self.capacity.demand(
            {"dit": dit, "vae": group_unit(group)},
            (sess.width, sess.height),
            block_s,
            self.card.latent_size(sess.width, sess.height),
            self.card.tokens_per_frame(sess.width, sess.height),
            len(self.topology.vae_groups[group]),
            self.held_frames(sess),
        )

    def running_demands(self, running: list[Session]) -> list[Demand]:
        """What the running sessions ask of their units at the costs measured now (a session
        placed on a start-up timing is counted at what its blocks have measured since)."""
        return [self.demand(s, s.place.dit, s.place.group) for s in running]

    def candidate(self, sess: Session, running: list[Session], ready: Ready | None) -> tuple[str, int] | None:
        """The DiT worker and VAE group a session would go to: the least busy by predicted share
        (an aggregated worker's session decodes in its own process). ready None: any worker."""
        topo = self.topology
        dits = [w for w in topo.dit_workers if ready is None or ready(w)]
        groups = [i for i, g in enumerate(topo.vae_groups) if ready is None or all(ready(w) for w in g)]
        if not dits or not groups:
            return None
        share = self.capacity.load(self.running_demands(running))
        count: dict[str, int] = {}
        for s in running:
            for unit in (s.place.dit, group_unit(s.place.group)):
                count[unit] = count.get(unit, 0) + 1

        def busy(unit: str) -> tuple[float, int, str]:
            return (share.get(unit, 0.0), count.get(unit, 0), unit)

        dit = min(dits, key=busy)
        colocated = [i for i in groups if dit in topo.vae_groups[i]]
        group = colocated[0] if colocated else min(groups, key=lambda i: busy(group_unit(i)))
        return dit, group

    def predicted_wait(self, sess: Session, running: list[Session]) -> float:
        """Seconds until `sess` would be admitted (0: now), replaying the running sessions' ends
        at real-time pace and the queue ahead."""
        cand = self.candidate(sess, running, None)
        if cand is None:
            return 0.0  # nothing to go by: the count limits decide
        new = self.demand(sess, *cand)
        ends = [(left_s(s), self.demand(s, s.place.dit, s.place.group)) for s in running]
        ahead = [(q.frames / q.fps, self.demand(q, *cand)) for q in self.queue]
        return self.capacity.predicted_start(new, ends, ahead)

    def place(self, sess: Session, running: list[Session], ready: Ready) -> bool:
        """Place the session if a ready pipeline has room for it (capacity and memory)."""
        cand = self.candidate(sess, running, ready)
        if cand is None:
            return False
        demand = self.demand(sess, *cand)
        if not self.capacity.fits(demand, self.running_demands(running)):
            return False
        p = sess.place
        p.dit, p.group = cand
        p.vae_workers = list(self.topology.vae_groups[p.group])
        p.demand = demand
        p.held_frames = self.held_frames(sess)
        return True

    def out_of_memory(self, worker: str, running: list[Session]) -> None:
        """A device ran out of memory: the worker's budget drops below what its running sessions
        held there (the failed batch's among them)."""
        on = {s.id: self.capacity.held([self.demand(s, s.place.dit, s.place.group)]).get(worker, 0.0) for s in running}
        held = {k: v for k, v in on.items() if v}
        budget = self.capacity.out_of_memory(worker, held)
        if budget is not None:
            log.warning(
                "%s ran out of memory with %d session(s) holding %.0f MB: its budget is now %.0f MB",
                worker,
                len(held),
                sum(held.values()) / 1e6,
                budget / 1e6,
            )
