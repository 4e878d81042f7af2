"""Admission and placement: a session is admitted now, queued (when predicted to start within
max_queue_wait_s), or refused with the predicted wait, by the capacity model (capacity.py); it
goes to the least busy ready DiT worker and VAE group. The workers' READY timings seed the
capacity model and the controllers (band weights, the VAE cut)."""

from __future__ import annotations

import logging

from ...ipc import messages as m
from ...plan import most_held_frames
from ..handle import CANCELLED, RUNNING
from .capacity import Demand
from .events import OpenEncoder, Reject, Send, Start, StopAdmitting, Submit, WorkerReady
from .state import SchedulerState
from .tickets import T_EMITTED, Session

log = logging.getLogger("streamdiff.scheduler")


class Admission(SchedulerState):
    def _submit(self, ev: Submit) -> None:
        """Admit now, queue (when predicted to start within max_queue_wait_s), or Reject with the
        predicted wait as Retry-After."""
        sess, lim = ev.session, self.cfg.limits
        running = len(self.running)
        if not self.accepting:
            self._out.append(Reject(sess.id, "the server is not admitting sessions", 10.0))
            return
        if running >= lim.max_sessions and len(self.queue) >= lim.max_queue:
            self._out.append(Reject(sess.id, f"{running} sessions running and {len(self.queue)} queued", 10.0))
            return
        wait = self.predicted_wait(sess)
        if wait > 0 and (wait > lim.max_queue_wait_s or len(self.queue) >= lim.max_queue):
            message = f"predicted to start in {wait:.0f}s beside the {running} running sessions"
            self._out.append(Reject(sess.id, message, wait))
            return
        self.sessions[sess.id] = sess
        self.queue.append(sess)
        if wait > 0:
            log.info("session %s queued: predicted to start in %.1fs", sess.id, wait)

    def _worker_ready(self, ev: WorkerReady) -> None:
        """A worker's READY: its calibration blocks and memory facts seed the capacity model."""
        dit, vae = ev.info.dit, ev.info.vae
        for r in (dit, vae):  # one budget per process, whichever of its stages says it
            if r is not None and r.memory is not None:
                self.capacity.worker_budget(ev.worker, r.memory.budget_bytes)
        if dit is not None:
            cost = dit.cost
            self.capacity.calibrate(ev.worker, cost.size, cost.block_ms, dit.memory, self.topology.members(ev.worker))
            for b, ms in dit.batch_ms.items():
                self.capacity.calibrate_batch(ev.worker, cost.size, int(b), ms / cost.block_ms)
            busy = cost.block_ms if cost.busy_ms is None else cost.busy_ms
            self.balance.seed_dit(ev.worker, busy, self._latent_hw(*cost.size))
            if self.cuts is not None:  # its start-up block ran the configured cut's stages
                hw = self._latent_hw(*cost.size)
                self.cuts.observe_dit(ev.worker, None, cost.block_ms, self.cuts.start, hw)
        if vae is not None and vae.rank == 0:
            group = next(i for i, g in enumerate(self.topology.vae_groups) if ev.worker in g)
            unit = self._group_unit(group)
            cost = vae.cost
            self.capacity.calibrate(unit, cost.size, cost.block_ms, vae.memory, self.topology.vae_groups[group])
            self.balance.seed(group, cost.block_ms, self._latent_hw(*cost.size))
            for b, ms in vae.batch_ms.items():
                self.capacity.calibrate_batch(unit, cost.size, int(b), ms / cost.block_ms)
            if self.cuts is not None and vae.stages_ms is not None:  # its start-up block: a whole decode
                self.cuts.seed(vae.stages_ms.ms)
                self.cuts.observe_vae(unit, cost.block_ms, 0, self._latent_hw(*cost.size))

    def _held_frames(self, sess: Session) -> int:
        """The most latent frames a shot of this session can hold (`plan.most_held_frames`): its
        KV cache is sized for no more where that is shorter than the window. 0: a live video.
        Fixed when the session opens, as the worker's cache is: a steer after that replans its
        blocks, and admission keeps pricing the cache that was allocated."""
        if sess.place.held_frames is not None:
            return sess.place.held_frames
        return 0 if sess.live else most_held_frames(sess.blocks)

    def _demand(self, sess: Session, dit: str, group: int) -> Demand:
        block_s = max(b.frames_out for b in sess.blocks) / sess.fps
        return self.capacity.demand(
            {"dit": dit, "vae": self._group_unit(group)},
            (sess.width, sess.height),
            block_s,
            self.card.latent_size(sess.width, sess.height),
            self.card.tokens_per_frame(sess.width, sess.height),
            len(self.topology.vae_groups[group]),
            self._held_frames(sess),
        )

    def _running_demands(self) -> list[Demand]:
        """What the running sessions ask of their units at the costs measured now (a session
        placed on a start-up timing is counted at what its blocks have measured since)."""
        return [self._demand(s, s.place.dit, s.place.group) for s in self.running]

    def _candidate(self, sess: Session, ready_only: bool = True) -> tuple[str, int] | None:
        """The DiT worker and VAE group a session would go to: the least busy by predicted share
        (an aggregated worker's session decodes in its own process)."""
        dits = [w for w in self.topology.dit_workers if not ready_only or self._ready(w)]
        groups = [i for i, g in enumerate(self.topology.vae_groups) if not ready_only or all(self._ready(w) for w in g)]
        if not dits or not groups:
            return None
        share = self.capacity.load(self._running_demands())
        count: dict[str, int] = {}
        for s in self.running:
            count[s.place.dit] = count.get(s.place.dit, 0) + 1
            count[self._group_unit(s.place.group)] = count.get(self._group_unit(s.place.group), 0) + 1

        def busy(unit: str) -> tuple[float, int, str]:
            return (share.get(unit, 0.0), count.get(unit, 0), unit)

        dit = min(dits, key=busy)
        colocated = [i for i in groups if dit in self.topology.vae_groups[i]]
        group = colocated[0] if colocated else min(groups, key=lambda i: busy(self._group_unit(i)))
        return dit, group

    def predicted_wait(self, sess: Session) -> float:
        """Seconds until `sess` would be admitted (0: now), replaying the running sessions' ends
        at real-time pace and the queue ahead."""
        cand = self._candidate(sess, ready_only=False)
        if cand is None:
            return 0.0  # nothing to go by: the count limits decide
        new = self._demand(sess, *cand)
        running = [
            (
                sum(t.block.emit for t in s.tickets if t.state != T_EMITTED) / s.fps,
                self._demand(s, s.place.dit, s.place.group),
            )
            for s in self.running
        ]
        ahead = [(q.frames / q.fps, self._demand(q, *cand)) for q in self.queue]
        return self.capacity.predicted_start(new, running, ahead)

    def _place(self, sess: Session) -> bool:
        """Place the session if a ready pipeline has room for it (capacity and memory)."""
        cand = self._candidate(sess)
        if cand is None:
            return False
        demand = self._demand(sess, *cand)
        if not self.capacity.fits(demand, self._running_demands()):
            return False
        sess.place.dit, sess.place.group = cand
        sess.place.vae_workers = list(self.topology.vae_groups[sess.place.group])
        sess.place.demand = demand
        return True

    def _start(self, sess: Session) -> None:
        share = {u: round(x, 2) for u, x in sess.place.demand.share.items()}
        log.info(
            "session %s starts on %s and VAE group %d, busy shares %s", sess.id, sess.place.dit, sess.place.group, share
        )
        sess.state, sess.place.started = RUNNING, self.now
        self.metrics.queue_seconds.observe(sess.place.started - sess.created)
        sess.place.held_frames = self._held_frames(sess)
        opened = m.OpenSession(sess.id, sess.width, sess.height, sess.seed, sess.place.held_frames)
        for w in self._workers_of(sess):
            self._out.append(Send(w, opened))
        self._out.append(Start(sess.id, {"dit": sess.place.dit, "vae": list(sess.place.vae_workers)}))
        # The encoder opens off the loop (an FFmpeg child or a hardware probe can take a while)
        # while the workers start on the first block; encoding waits for it.
        every = self.cfg.encoder.keyframe_every_blocks
        keyframes = [b.start_frame for b in sess.blocks if b.index % every == 0]
        sess.playback.encoder = "opening"
        self._out.append(OpenEncoder(sess.id, sess.width, sess.height, sess.fps, keyframes))

    def _stop_admitting(self, ev: StopAdmitting) -> None:
        self.accepting = False
        for sess in list(self.queue):
            self._end(sess, CANCELLED, ev.reason)
