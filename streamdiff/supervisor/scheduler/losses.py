"""Losses: no silent loss. A ticket sent to a worker leaves only by that worker's answer, by the
worker proving it never got it (idle since before it went out: a lost message), by the socket
refusing the message (SendFailed), or by the worker's death; a ticket unanswered after
`block_timeout_s` fails its session at once (its slots come back by one of those)."""

from __future__ import annotations

import logging

from ...ipc import messages as m
from ..handle import FAILED
from .events import SendFailed, WorkerIdle, WorkersLost
from .replies import Replies
from .tickets import T_DIT, T_VAE, Session, Ticket

log = logging.getLogger("streamdiff.scheduler")

# A message on a local socket arrives within milliseconds: a block sent this long before a worker
# began a wait (nothing running, nothing queued) that then lasted a second never reached it.
LOST_AFTER_S = 0.05


class Losses(Replies):
    def _worker_idle(self, ev: WorkerIdle) -> None:
        """A heartbeat said the worker has waited with nothing queued since `since`: a block
        sent to it well before that never arrived (a lost control message). Its session fails;
        its slots are safe to reuse, since no process will write them."""
        name, since = ev.worker, ev.since
        self.idle_since[name] = since
        for sess in list(self.sessions.values()):
            lost = []
            for t in sess.tickets:
                if t.state == T_DIT and sess.place.dit == name and t.sent_at < since - LOST_AFTER_S:
                    lost.append(t)
                # A group's block is lost when no shard got it: every shard idle since it went
                # out. (Had some got it, they wait in its collectives and fail at their timeout.)
                elif (
                    t.state == T_VAE
                    and name in sess.place.vae_workers
                    and not t.reported
                    and all(self.idle_since.get(w, 0.0) > t.sent_at + LOST_AFTER_S for w in sess.place.vae_workers)
                ):
                    lost.append(t)
            for t in lost:
                log.error("session %s: block %d never reached its worker (a lost message)", sess.id, t.block.index)
                self._end(sess, FAILED, f"block {t.block.index} was lost on its way to a worker")
                self._worker_gone(sess, t)

    def _failed(self, msg: m.Failed) -> None:
        sess = self.sessions.get(msg.session) if msg.session else None
        if sess is None:
            return
        code = "invalid_request" if msg.kind == "request" else "generation_failed"
        if msg.kind == "memory":
            self._learn_out_of_memory(sess, msg)
        self._end(sess, FAILED, f"{msg.worker}: {msg.message}", code)
        if msg.kind not in ("request", "session", "memory"):
            return  # the worker exits; its tickets come back in WorkersLost once it has
        # The worker carries on and answers nothing else for this block: its reply stands for
        # the block's (a VAE group's shards each send one).
        _, t = self._ticket(sess.id, msg.block, T_DIT)
        if t is not None and msg.worker == sess.place.dit:
            self._worker_gone(sess, t)
            if msg.kind == "session":  # a gap: the earlier blocks it never got are lost (FIFO)
                for e in sess.tickets[: msg.block]:
                    if e.state == T_DIT:
                        log.error("session %s: block %d never reached %s", sess.id, e.block.index, msg.worker)
                        self._worker_gone(sess, e)
            return
        _, t = self._ticket(sess.id, msg.block, T_VAE)
        if t is not None and msg.worker in sess.place.vae_workers:
            t.reported.add(sess.place.vae_workers.index(msg.worker))
            t.skipped = True
            self._vae_answered(sess, t)

    def _learn_out_of_memory(self, sess: Session, msg: m.Failed) -> None:
        """Admission learns from a device that ran out of memory: the worker's budget drops
        below what its running sessions held there (the failed batch's among them)."""
        on = {
            s.id: self.capacity.held([self._demand(s, s.place.dit, s.place.group)]).get(msg.worker, 0.0)
            for s in self.running
        }
        held = {k: v for k, v in on.items() if v}
        budget = self.capacity.out_of_memory(msg.worker, held)
        if budget is not None:
            log.warning(
                "%s ran out of memory with %d session(s) holding %.0f MB: its budget is now %.0f MB",
                msg.worker,
                len(held),
                sum(held.values()) / 1e6,
                budget / 1e6,
            )

    def _send_failed(self, ev: SendFailed) -> None:
        """A block message never left: its sessions fail now. A DiT batch's slots come back at
        once (nobody got it); a decode's only once the group is gone, since the shards that did
        get it may be writing."""
        msg = ev.msg
        if isinstance(msg, m.OpenSession | m.CloseSession):
            sess = self.sessions.get(msg.session)
            if sess is not None and isinstance(msg, m.OpenSession):
                self._end(sess, FAILED, f"could not reach {ev.worker}")
            return
        if not isinstance(msg, m.GenerateBatch | m.DecodeBatch):
            return
        for item in msg.blocks:
            state = T_DIT if isinstance(msg, m.GenerateBatch) else T_VAE
            sess, t = self._ticket(item.session, item.block, state)
            if t is None:
                continue
            self._end(sess, FAILED, f"could not reach {ev.worker}")
            if state == T_DIT:
                self._worker_gone(sess, t)

    def _workers_lost(self, ev: WorkersLost) -> None:
        """The pool killed these workers and saw them exit: their slots are free again."""
        for sess in list(self.sessions.values()):
            dit_lost = sess.place.dit in ev.workers
            group_lost = bool(ev.workers & set(sess.place.vae_workers))
            if not (dit_lost or group_lost):
                continue
            self._end(sess, FAILED, ev.why)
            for t in sess.tickets:
                if (t.state == T_DIT and dit_lost) or (t.state == T_VAE and group_lost):
                    self._worker_gone(sess, t)

    def _worker_gone(self, sess: Session, t: Ticket) -> None:
        """No worker holds the ticket's slots any more (it answered with a refusal, never got
        the message, or died)."""
        if t.state in (T_DIT, T_VAE):
            self._left_batch(t)
        self._release(sess, t)

    def _check_deadlines(self) -> None:
        """A ticket out at a worker for longer than block_timeout_s fails its session now; its
        slots come back once the worker answers, proves idle, or is gone."""
        limit = self.cfg.pipeline.block_timeout_s
        for sess in list(self.sessions.values()):
            if not sess.active:
                continue
            late = next((t for t in sess.tickets if t.state in (T_DIT, T_VAE) and self.now - t.sent_at > limit), None)
            if late is not None:
                where = sess.place.dit if late.state == T_DIT else f"VAE group {sess.place.group}"
                self._end(sess, FAILED, f"block {late.block.index} got no answer from {where} in {limit:.0f}s")
