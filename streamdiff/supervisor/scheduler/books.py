"""The books, one collaborator of the scheduler: every session with work or slots outstanding,
the rings' slots its tickets hold, and the ending of a session, which any handler may call for.

A session ends at once (the client hears at once); its tickets give back what nobody else holds
now, and the rest as their holders answer. An ended session is forgotten once none of its
tickets holds a slot.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from ...ipc import messages as m
from ...metrics import Metrics
from ..handle import CANCELLED, DONE, FAILED, RUNNING
from ..topology import Topology
from .events import Action, CloseEncoder, End, Send
from .tickets import FINAL, T_CANCELLED, T_FAILED, T_FRAMES, T_LATENT, T_QUEUED, Session, Slots, Ticket

log = logging.getLogger("streamdiff.scheduler")


class Books:
    def __init__(self, topology: Topology, slots: Slots, queue: Collection[Session], metrics: Metrics) -> None:
        self.topology = topology
        self.slots = slots
        self.queue = queue  # admission's: a session that ends while queued leaves it
        self.metrics = metrics
        self.sessions: dict[str, Session] = {}

    @property
    def running(self) -> list[Session]:
        return [s for s in self.sessions.values() if s.state == RUNNING]

    def active(self, session: str) -> Session | None:
        sess = self.sessions.get(session)
        return sess if sess is not None and sess.active else None

    def ticket(self, session: str, block: int | None, state: str) -> tuple[Session | None, Ticket | None]:
        """The session, and its block's ticket if that is in `state` now."""
        sess = self.sessions.get(session)
        if sess is None or block is None or not 0 <= block < len(sess.tickets):
            return sess, None
        t = sess.tickets[block]
        return sess, (t if t.state == state else None)

    def workers_of(self, sess: Session) -> list[str]:
        names = self.topology.members(sess.place.dit) + self.topology.vae_groups[sess.place.group]
        return list(dict.fromkeys(names))  # an aggregated worker runs both stages: once

    def end(self, sess: Session, state: str, error: str | None, out: list[Action], code: str | None = None) -> None:
        """The session ends now (the client hears at once); its tickets give back what nobody
        else holds now, and the rest as their holders answer."""
        if sess.active:
            was_running = sess.state == RUNNING
            sess.state, sess.error = state, error
            if sess in self.queue:
                self.queue.remove(sess)
            if was_running:
                closing = m.CloseSession(sess.id)
                out.extend(Send(w, closing) for w in self.workers_of(sess))
                out.append(CloseEncoder(sess.id))  # after any encode already out
            self.metrics.sessions.labels(state).inc()
            if state != DONE:
                log.info("session %s %s: %s", sess.id, state, error)
            out.append(End(sess.id, state, error, code))
        for t in sess.tickets:
            if t.state in (T_QUEUED, T_LATENT) or (t.state == T_FRAMES and not t.encoding):
                self.release(sess, t, out)
        self._forget(sess)

    def release(self, sess: Session, t: Ticket, out: list[Action]) -> None:
        """Give back the ticket's slots; it ends cancelled or failed with its session."""
        self.slots.advance(t, T_CANCELLED if sess.state == CANCELLED else T_FAILED)
        if sess.active:  # a ticket lost while its session still ran: the session cannot go on
            self.end(sess, FAILED, f"block {t.block.index} was lost", out)
        self._forget(sess)

    def _forget(self, sess: Session) -> None:
        """Drop an ended session once none of its tickets holds a slot."""
        if not sess.active and all(t.state in FINAL for t in sess.tickets):
            self.sessions.pop(sess.id, None)

    def tickets_out(self) -> dict[str, int]:
        """How many tickets are in each state not final."""
        counts: dict[str, int] = {}
        for s in self.sessions.values():
            for t in s.tickets:
                if t.state not in FINAL:
                    counts[t.state] = counts.get(t.state, 0) + 1
        return counts
