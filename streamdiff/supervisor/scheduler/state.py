"""What every part of the scheduler shares: its books (sessions, queue, ring slots, batches out,
the controllers it feeds) and the ending of a session, which every part may call for.

A session ends at once (the client hears at once); its tickets give back what nobody else holds
now, and the rest as their holders answer. An ended session is forgotten once none of its
tickets holds a slot.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Collection

from ...card import ModelCard
from ...config import Config
from ...ipc import messages as m
from ...ipc.shm import SlotPool
from ...metrics import Metrics
from ..bands import Balance
from ..cut import CutBalance
from ..handle import CANCELLED, DONE, FAILED, RUNNING
from ..topology import Topology, model_card
from .capacity import CapacityModel
from .events import Action, Cancel, CloseEncoder, End, Send
from .tickets import FINAL, T_CANCELLED, T_FAILED, T_FRAMES, T_LATENT, T_QUEUED, Session, Ticket, advance

log = logging.getLogger("streamdiff.scheduler")


class SchedulerState:
    def __init__(
        self,
        cfg: Config,
        topology: Topology,
        latent_slots: int,
        frame_slots: int,
        card: ModelCard | None = None,
        cut_fits: Callable[[int, tuple[int, int], int], bool] | None = None,
    ) -> None:
        """cut_fits(cut, latent_hw, latent_frames): whether a VAE cut's activation of a block fits
        a latent slot (supervisor/cut.py; None: any does); a function of its arguments alone."""
        self.cfg = cfg
        self.card = card or model_card(cfg)
        self.capacity = CapacityModel(cfg.limits.target_utilization)
        self.topology = topology
        t = cfg.topology
        self.balance = Balance(
            topology.vae_groups, topology.devices, topology.dit_workers, t.vae_band_weights, t.rebalance
        )
        on_dit = t.device == "cpu" and t.pin_cpus  # the supervisor's encoding shares the DiT's cores
        self.cuts = (
            CutBalance(t.vae_cut, t.vae_cut_adapt and t.rebalance, cut_fits, on_dit, t.vae_cut_exchange)
            if t.vae_cut
            else None
        )
        self.latent_pool = SlotPool(latent_slots)
        self.frame_pool = SlotPool(frame_slots)
        self.ready: Collection[str] = ()  # the worker processes ready now (the step's argument)
        self.sessions: dict[str, Session] = {}  # every session with work or slots outstanding
        self.queue: deque[Session] = deque()
        self.stage_ms = {"dit": 0.0, "vae": 0.0, "encode": 0.0}  # summed compute time per stage
        self.metrics = Metrics()
        self.accepting = True
        self.idle_since: dict[str, float] = {}  # worker -> since when it has waited with nothing to do
        self.batches: dict[int, tuple[str, int]] = {}  # batch -> (unit, tickets still out)
        self.free_at: dict[str, float] = {}  # unit -> when its batches are predicted done
        self._next_batch = 0
        self.now = 0.0
        self._out: list[Action] = []

    @property
    def running(self) -> list[Session]:
        return [s for s in self.sessions.values() if s.state == RUNNING]

    def _ready(self, name: str) -> bool:
        """A worker, or a DiT group by its rank 0's name: all its ranks are ready."""
        return all(n in self.ready for n in self.topology.members(name))

    def _latent_hw(self, width: int, height: int) -> tuple[int, int]:
        return self.card.latent_size(width, height)

    @staticmethod
    def _group_unit(group: int) -> str:
        return f"vae-group-{group}"

    def _workers_of(self, sess: Session) -> list[str]:
        names = self.topology.members(sess.place.dit) + self.topology.vae_groups[sess.place.group]
        return list(dict.fromkeys(names))  # an aggregated worker runs both stages: once

    def _ticket(self, session: str, block: int | None, state: str) -> tuple[Session | None, Ticket | None]:
        sess = self.sessions.get(session)
        if sess is None or block is None or not 0 <= block < len(sess.tickets):
            return sess, None
        t = sess.tickets[block]
        return sess, (t if t.state == state else None)

    def _advance(self, t: Ticket, to: str) -> None:
        advance(t, to, self.latent_pool, self.frame_pool)

    def _left_batch(self, t: Ticket) -> None:
        unit, out = self.batches.pop(t.batch)
        if out > 1:
            self.batches[t.batch] = (unit, out - 1)
        t.batch = None

    # -- ending -------------------------------------------------------------------------------
    def _cancel(self, ev: Cancel) -> None:
        sess = self.sessions.get(ev.session)
        if sess is not None and sess.active:
            self._end(sess, CANCELLED, ev.reason)

    def _end(self, sess: Session, state: str, error: str | None, code: str | None = None) -> None:
        """The session ends now (the client hears at once); its tickets give back what nobody
        else holds now, and the rest as their holders answer."""
        if sess.active:
            was_running = sess.state == RUNNING
            sess.state, sess.error = state, error
            if sess in self.queue:
                self.queue.remove(sess)
            if was_running:
                closing = m.CloseSession(sess.id)
                for w in self._workers_of(sess):
                    self._out.append(Send(w, closing))
                self._out.append(CloseEncoder(sess.id))  # after any encode already out
            self.metrics.sessions.labels(state).inc()
            if state != DONE:
                log.info("session %s %s: %s", sess.id, state, error)
            self._out.append(End(sess.id, state, error, code))
        for t in sess.tickets:
            if t.state in (T_QUEUED, T_LATENT) or (t.state == T_FRAMES and not t.encoding):
                self._release(sess, t)
        self._forget(sess)

    def _release(self, sess: Session, t: Ticket) -> None:
        """Give back the ticket's slots; it ends cancelled or failed with its session."""
        self._advance(t, T_CANCELLED if sess.state == CANCELLED else T_FAILED)
        if sess.active:  # a ticket lost while its session still ran: the session cannot go on
            self._end(sess, FAILED, f"block {t.block.index} was lost")
        self._forget(sess)

    def _forget(self, sess: Session) -> None:
        """Drop an ended session once none of its tickets holds a slot."""
        if not sess.active and all(t.state in FINAL for t in sess.tickets):
            self.sessions.pop(sess.id, None)
