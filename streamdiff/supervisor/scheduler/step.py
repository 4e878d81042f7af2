"""The step scheduler (supervisor process; plain code: no I/O, no asyncio, no clock of its own).

`step(events, now, ready)` takes everything that happened since the last step — submissions,
worker replies, encoder results, acks, cancels, worker deaths and idle reports (events.py) —
with the time and the worker processes ready now, and returns the actions that follow:
messages to send, encoders to open, fragments to encode, bytes and ends to hand to the
sessions. The driver (`supervisor/driver.py`) carries the actions out and feeds their results
back as events; the policy tests drive `step` directly with a fake transport (deterministic: no
processes, no sleeps, the time and the readiness are arguments).

The parts, each a layer of the one Scheduler, in the order they build on each other:
- state.py: the books every part shares, and the ending of a session;
- tickets.py: a block's life cycle, `advance` (every legal transition, the slots of each state);
- admission.py (with capacity.py): admit, queue or refuse; place; READY timings;
- dispatch.py: deadlines, batches, what each stage runs next, the next encode;
- replies.py: the workers' and encoders' answers, and what they measured (the controllers'
  feed: supervisor/bands.py, supervisor/cut.py);
- losses.py: lost messages, refusals, deaths and timeouts;
- steering.py: Steer and Stop.
"""

from __future__ import annotations

from collections.abc import Collection

from ...ipc import messages as m
from .events import (
    Ack,
    Action,
    Cancel,
    Controlled,
    Encoded,
    EncoderOpened,
    Event,
    SendFailed,
    Steer,
    Stop,
    StopAdmitting,
    Submit,
    WakeAt,
    WorkerIdle,
    WorkerReady,
    WorkersLost,
)
from .losses import Losses
from .steering import Steering
from .tickets import FINAL, T_LATENT


class Scheduler(Losses, Steering):
    def step(self, events: list[Event], now: float, ready: Collection[str]) -> list[Action]:
        """Apply `events` in order, then hand out work to the `ready` worker processes (a DiT
        group counts once all its ranks are); return what to do."""
        self.now, self.ready, self._out = now, ready, []
        for ev in events:
            self._apply(ev)
        self._check_deadlines()
        self._dispatch()
        waits = [
            t
            for sess in self.running
            if sess.live and sess.issued < len(sess.blocks) and (t := self._paced_until(sess)) > self.now
        ]
        if waits:
            self._out.append(WakeAt(min(waits)))
        out, self._out = self._out, []
        return out

    def _apply(self, ev: Event) -> None:
        handler = {
            Submit: self._submit,
            Cancel: self._cancel,
            Ack: self._ack,
            WorkerReady: self._worker_ready,
            WorkerIdle: self._worker_idle,
            WorkersLost: self._workers_lost,
            SendFailed: self._send_failed,
            EncoderOpened: self._encoder_opened,
            Encoded: self._encoded,
            StopAdmitting: self._stop_admitting,
            Steer: self._steer,
            Stop: self._stop,
            Controlled: self._control,
            m.LatentDone: self._latent_done,
            m.FramesDone: self._frames_done,
            m.Failed: self._failed,
        }[type(ev)]
        handler(ev)

    def snapshot(self) -> dict:
        tickets: dict[str, int] = {}
        for s in self.sessions.values():
            for t in s.tickets:
                if t.state not in FINAL:
                    tickets[t.state] = tickets.get(t.state, 0) + 1
        return {
            "vae_band_weights": {str(g): list(w) for g, w in self.balance.current.items()},
            # decoder stages the DiT workers run (0: none): each one's cut for its next shots
            "vae_cut": self.cfg.topology.vae_cut,
            "vae_cuts": {w: self.cuts.current.get(w, self.cuts.start) for w in self.topology.dit_workers}
            if self.cuts is not None
            else {},
            # what the cut balance takes a moved ms of decode to cost the DiT and save the VAE
            "vae_cut_exchange": [self.cuts.grow, self.cuts.relief] if self.cuts is not None else None,
            "running": len(self.running),
            "queued": len(self.queue),
            "tracked": len(self.sessions),
            "latent_slots_used": self.latent_pool.used,
            "latent_slots": self.latent_pool.total,
            "frame_slots_used": self.frame_pool.used,
            "frame_slots": self.frame_pool.total,
            "decode_wait": tickets.get(T_LATENT, 0),
            "tickets": tickets,
        }
