"""The step scheduler (supervisor process; plain code: no I/O, no asyncio, no clock of its own).

`step(events, now, ready)` takes everything that happened since the last step — submissions,
worker replies, encoder results, acks, cancels, worker deaths and idle reports (events.py) —
with the time and the worker processes ready now, and returns the actions that follow:
messages to send, encoders to open, fragments to encode, bytes and ends to hand to the
sessions. `call(event, now, ready)` does the same for one event whose caller waits on its
answer (a submission's refusal, a steer's landing), and returns that answer apart. The driver
(`supervisor/driver.py`) carries the actions out and feeds their results back as events; the
policy tests drive it directly with a fake transport (deterministic: no processes, no sleeps,
the time and the readiness are arguments).

The Scheduler's handlers below run in the order of a block's life: a session is submitted and
started, its blocks are generated, decoded, encoded and taken; then steering, losses and the
ending. Each handler gets the step's actions list (`out`) to append to, and returns its answer.
A session's window: at most `max_blocks_in_flight` blocks between "sent to the DiT" and "taken
by its consumer"; a live one's next block waits until it is within `live_lead_s` of its
player's clock. What the handlers decide with is their collaborators', each a field and each
testable alone:
- `slots` (tickets.py): the rings' slots and a ticket's one transition, `advance`;
- `admission` (admission.py, with capacity.py): the queue; admit, queue or refuse; place;
- `books` (books.py): the sessions, and the ending of one;
- `batching` (batching.py): the batches each unit holds, and which blocks go out together
  (each stage earliest deadline first, work-conserving);
- `meters` (meters.py): the player's clock (deadlines, stalls) and the metrics;
- `balance` (supervisor/bands.py) and `cuts` (supervisor/cut.py): the controllers the measured
  timings feed;
- steering.py and losses.py: plain functions of the sessions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

from ...card import ModelCard
from ...config import Config
from ...controls import control_marker
from ...ipc import messages as m
from ...plan import scene_marker
from ..bands import Balance
from ..cut import CutBalance
from ..handle import CANCELLED, DONE, FAILED, RUNNING
from ..topology import Topology, model_card
from . import events as e
from . import losses, steering
from .admission import Admission
from .batching import Batching
from .books import Books
from .capacity import group_unit
from .meters import Meters
from .tickets import (
    FINAL,
    T_DIT,
    T_EMITTED,
    T_FAILED,
    T_FRAMES,
    T_LATENT,
    T_QUEUED,
    T_VAE,
    Session,
    Slots,
    Ticket,
    decode_order,
    generate_order,
)

log = logging.getLogger("streamdiff.scheduler")
Out = list[e.Action]


class Scheduler:
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
        self.cfg, self.topology = cfg, topology
        self.card = card or model_card(cfg)
        self.slots = Slots(latent_slots, frame_slots)
        self.admission = Admission(cfg, topology, self.card)
        self.batching = Batching(cfg.pipeline.max_batch, self.admission.capacity)
        self.meters = Meters(cfg.pipeline.startup_buffer_s)
        self.books = Books(topology, self.slots, self.admission.queue, self.meters.metrics)
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
        self.idle_since: dict[str, float] = {}  # worker -> since when it has waited with nothing to do
        self.now = 0.0
        self.ready: Collection[str] = ()  # the worker processes ready now (the step's argument)

    # -- the step -------------------------------------------------------------------------------
    def step(self, events: list[e.Event], now: float, ready: Collection[str]) -> Out:
        """Apply `events` in order, then hand out work to the `ready` worker processes (a DiT
        group counts once all its ranks are); return what to do. The answers a caller would
        wait on (a Reject, a Steered, a ControlLanded) are among the actions."""
        self.now, self.ready, out = now, ready, []
        self._apply_all(events, out)
        self._after(out)
        return out

    def call(self, event: e.Event, now: float, ready: Collection[str], pending: list[e.Event] = ()) -> tuple[Any, Out]:
        """One step over `pending` and then `event`, whose answer comes back apart from the
        actions: a Submit's Reject (None: admitted or queued), a Cancel's whether it ended the
        session, a Steer's or Stop's Steered, a Controlled's ControlLanded."""
        self.now, self.ready, out = now, ready, []
        self._apply_all(pending, out)
        answer = self._apply(event, out)
        self._after(out)
        return answer, out

    def _apply_all(self, events: list[e.Event], out: Out) -> None:
        for ev in events:
            answer = self._apply(ev, out)
            if answer is not None and not isinstance(answer, bool):
                out.append(answer)

    def _apply(self, ev: e.Event, out: Out):
        handler = {
            e.Submit: self._submit,
            e.WorkerReady: self._worker_ready,
            m.LatentDone: self._latent_done,
            m.FramesDone: self._frames_done,
            e.EncoderOpened: self._encoder_opened,
            e.Encoded: self._encoded,
            e.Ack: self._ack,
            e.Steer: self._steer,
            e.Stop: self._stop,
            e.Controlled: self._control,
            m.Failed: self._failed,
            e.SendFailed: self._send_failed,
            e.WorkerIdle: self._worker_idle,
            e.WorkersLost: self._workers_lost,
            e.Cancel: self._cancel,
            e.StopAdmitting: self._stop_admitting,
        }[type(ev)]
        return handler(ev, out)

    def _after(self, out: Out) -> None:
        """What every step does last: fail the late, hand out work, wake for the paced."""
        for sess, why in losses.late(list(self.books.sessions.values()), self.now, self.cfg.pipeline.block_timeout_s):
            self.books.end(sess, FAILED, why, out)
        self._dispatch(out)
        waits = [
            t
            for sess in self.books.running
            if sess.live and sess.issued < len(sess.blocks) and (t := self._paced_until(sess)) > self.now
        ]
        if waits:
            out.append(e.WakeAt(min(waits)))

    def _ready(self, name: str) -> bool:  # a worker, or a DiT group by its rank 0's name: all its ranks
        return all(n in self.ready for n in self.topology.members(name))

    # -- a session comes in -----------------------------------------------------------------------
    def _submit(self, ev: e.Submit, out: Out):
        refused = self.admission.submit(ev.session, self.books.running)
        if refused is None:
            self.books.sessions[ev.session.id] = ev.session
        return refused

    def _worker_ready(self, ev: e.WorkerReady, out: Out) -> None:
        """A worker's READY: its calibration blocks seed admission and the controllers."""
        self.admission.calibrate(ev.worker, ev.info)
        dit, vae = ev.info.dit, ev.info.vae
        if dit is not None:
            cost, hw = dit.cost, self.card.latent_size(*dit.cost.size)
            self.balance.seed_dit(ev.worker, cost.block_ms if cost.busy_ms is None else cost.busy_ms, hw)
            if self.cuts is not None:  # its start-up block ran the configured cut's stages
                self.cuts.observe_dit(ev.worker, None, cost.block_ms, self.cuts.start, hw)
        if vae is not None and vae.rank == 0:
            group = self.topology.group_of(ev.worker)
            cost, hw = vae.cost, self.card.latent_size(*vae.cost.size)
            self.balance.seed(group, cost.block_ms, hw)
            if self.cuts is not None and vae.stages_ms is not None:  # its start-up block: a whole decode
                self.cuts.seed(vae.stages_ms.ms)
                self.cuts.observe_vae(group_unit(group), cost.block_ms, 0, hw)

    def _start(self, sess: Session, out: Out) -> None:
        p = sess.place
        share = {u: round(x, 2) for u, x in p.demand.share.items()}
        log.info("session %s starts on %s and VAE group %d, busy shares %s", sess.id, p.dit, p.group, share)
        sess.state, p.started = RUNNING, self.now
        self.meters.metrics.queue_seconds.observe(p.started - sess.created)
        opened = m.OpenSession(sess.id, sess.width, sess.height, sess.seed, p.held_frames)
        out.extend(e.Send(w, opened) for w in self.books.workers_of(sess))
        out.append(e.Start(sess.id, {"dit": p.dit, "vae": list(p.vae_workers)}))
        # The encoder opens off the loop (an FFmpeg child or a hardware probe can take a while)
        # while the workers start on the first block; encoding waits for it.
        every = self.cfg.encoder.keyframe_every_blocks
        keyframes = [b.start_frame for b in sess.blocks if b.index % every == 0]
        sess.playback.encoder = "opening"
        out.append(e.OpenEncoder(sess.id, sess.width, sess.height, sess.fps, keyframes))

    def _dispatch(self, out: Out) -> None:
        """Decodes first (they hold latent slots the DiT needs), then admissions, then DiT
        batches; each earliest deadline first."""
        for gi in range(len(self.topology.vae_groups)):
            self._dispatch_decodes(gi, out)
        while (sess := self.admission.next_to_start(self.books.running, self._ready)) is not None:
            self._start(sess, out)
        for dit in self.topology.dit_workers:
            self._dispatch_dit(dit, out)

    # -- its blocks are generated ------------------------------------------------------------------
    def _issuable(self, sess: Session) -> bool:
        window = sess.issued - sess.playback.acked < self.cfg.pipeline.max_blocks_in_flight
        return sess.issued < len(sess.blocks) and window and self._paced_until(sess) <= self.now

    def _paced_until(self, sess: Session) -> float:
        return self.meters.paced_until(sess, self.cfg.pipeline.live_lead_s)

    def _dispatch_dit(self, dit: str, out: Out) -> None:
        if not self._ready(dit):
            return
        deadline = self.meters.deadline
        while self.batching.room(dit) and self.slots.latent.free:
            cands = [(s, s.tickets[s.issued]) for s in self.books.running if s.place.dit == dit and self._issuable(s)]
            if not cands:
                return
            head = min(cands, key=lambda c: (deadline(c[0], c[1].block.index), c[0].created))[0]
            after = self.admission.capacity.block_ms(group_unit(head.place.group), (head.width, head.height)) or 0.0
            key = lambda s, t: (s.width, s.height, t.block.latent_frames)  # noqa: E731
            batch = self.batching.choose(dit, cands, len(self.slots.latent.free), after, key, deadline, self.now)
            self.batching.open(dit, batch, self.now)
            msgs = [self._generate(dit, sess, t) for sess, t in batch]
            out.extend(e.Send(w, m.GenerateBatch(msgs)) for w in self.topology.members(dit))  # rank 0 answers

    def _generate(self, dit: str, sess: Session, t: Ticket) -> m.GenerateBlock:
        b = t.block
        self.slots.advance(t, T_DIT)
        t.sent_at = self.now
        sess.issued += 1
        if self.cuts is not None:
            if b.shot_start or not sess.place.vae_cut:  # both sides' stage caches start afresh here
                hw = self.card.latent_size(sess.width, sess.height)
                sess.place.vae_cut = self.cuts.cut(dit, group_unit(sess.place.group), hw, b.latent_frames)
            t.vae_cut = sess.place.vae_cut
        camera, actions = [], []
        if sess.controls is not None:  # the block takes the controls that have reached it
            ctl = sess.controls.block(b.index, b.latent_frames, b.shot_start)
            t.control_seq, camera, actions = ctl.seq, ctl.camera, ctl.actions
        return generate_order(sess, t, camera, actions)

    def _latent_done(self, msg: m.LatentDone, out: Out) -> None:
        sess, t = self.books.ticket(msg.session, msg.block, T_DIT)
        if t is None:
            log.warning("latent for unknown block %s/%s", msg.session, msg.block)
            return
        self.batching.left(t)
        if msg.skipped or sess.state != RUNNING:
            self.books.release(sess, t, out)
            return
        size, hw, ms = (sess.width, sess.height), self.card.latent_size(sess.width, sess.height), msg.compute_ms
        self.meters.stage("dit", ms, msg.batch, self.admission.capacity.observe(sess.place.dit, size, ms, msg.batch))
        self.balance.observe_dit(sess.place.dit, msg.busy_ms, hw)
        if self.cuts is not None:
            self.cuts.observe_dit(sess.place.dit, group_unit(sess.place.group), ms, t.vae_cut, hw)
        self.slots.advance(t, T_LATENT)
        t.shape, t.data_shape = list(msg.shape), list(msg.data_shape)

    # -- decoded ------------------------------------------------------------------------------------
    def _dispatch_decodes(self, gi: int, out: Out) -> None:
        """Per session its earliest latent_ready block, once every earlier block has gone to the
        VAE (the temporal cache needs them in order); blocks of one size and cache phase batch."""
        workers = self.topology.vae_groups[gi]
        if not all(self._ready(w) for w in workers):
            return
        unit = group_unit(gi)
        while self.batching.room(unit) and self.slots.frame.free:
            cands = []
            for sess in self.books.running:
                if sess.place.group != gi:
                    continue
                t = next((t for t in sess.tickets if t.state in (T_QUEUED, T_DIT, T_LATENT)), None)
                if t is not None and t.state == T_LATENT:
                    cands.append((sess, t))
            if not cands:
                return
            key = lambda s, t: (s.width, s.height, tuple(t.shape), t.block.frames_out, t.block.shot_start)  # noqa: E731
            slots, deadline = len(self.slots.frame.free), self.meters.deadline
            batch = self.batching.choose(unit, cands, slots, 0.0, key, deadline, self.now)
            self.batching.open(unit, batch, self.now)
            for _, t in batch:
                self.slots.advance(t, T_VAE)
                t.sent_at, t.reported, t.skipped = self.now, set(), False
            msgs = [decode_order(sess, t) for sess, t in batch]
            head = batch[0][0]
            weights = list(self.balance.weights(gi, self.card.latent_size(head.width, head.height)))
            out.extend(e.Send(w, m.DecodeBatch(msgs, weights=weights)) for w in workers)

    def _frames_done(self, msg: m.FramesDone, out: Out) -> None:
        sess, t = self.books.ticket(msg.session, msg.block, T_VAE)
        if t is None:
            log.warning("frames for unknown block %s/%s", msg.session, msg.block)
            return
        t.reported.add(msg.rank)
        t.skipped |= msg.skipped
        hw = self.card.latent_size(sess.width, sess.height)
        if not msg.skipped:
            self.balance.observe(sess.place.vae_workers[msg.rank], msg.busy_ms, msg.rows, hw[1])
        if not msg.skipped and msg.rank == 0:
            unit, ms = group_unit(sess.place.group), msg.compute_ms
            predicted = self.admission.capacity.observe(unit, (sess.width, sess.height), ms, msg.batch)
            self.meters.stage("vae", ms, msg.batch, predicted)
            if self.cuts is not None:
                self.cuts.observe_vae(unit, ms, t.vae_cut, hw)
        self._vae_answered(sess, t, out)

    def _vae_answered(self, sess: Session, t: Ticket, out: Out) -> None:
        if len(t.reported) < len(sess.place.vae_workers):
            return
        self.batching.left(t)
        if t.skipped or sess.state != RUNNING:
            self.books.release(sess, t, out)
            return
        self.slots.advance(t, T_FRAMES)
        self._encode_next(sess, out)

    # -- encoded and taken --------------------------------------------------------------------------
    def _encoder_opened(self, ev: e.EncoderOpened, out: Out) -> None:
        sess = self.books.sessions.get(ev.session)
        if sess is None or sess.playback.encoder != "opening":
            return
        if ev.error is not None:
            sess.playback.encoder = "none"
            log.error("session %s: the encoder could not open: %s", sess.id, ev.error)
            self.books.end(sess, FAILED, f"could not start: the encoder did not open: {ev.error}", out)
            return
        sess.playback.encoder = "open"
        if sess.state == RUNNING:
            if ev.init:
                out.append(e.Emit(sess.id, ev.init, None))
            self._encode_next(sess, out)

    def _encode_next(self, sess: Session, out: Out) -> None:
        """Encode the session's next block once its frames are ready (one at a time, in order)."""
        if sess.state != RUNNING or sess.playback.encoder != "open" or any(t.encoding for t in sess.tickets):
            return
        t = next((t for t in sess.tickets if t.state not in FINAL), None)
        if t is None or t.state != T_FRAMES:
            return
        b = t.block
        events = [scene_marker(b, sess.scenes[b.scene])] if b.first_of_scene else []
        if t.control_seq is not None:
            events.append(control_marker(b, t.control_seq))
        t.encoding = True
        idr = b.index % self.cfg.encoder.keyframe_every_blocks == 0
        out.append(e.Encode(sess.id, b, t.frame_slot, (b.frames_out, sess.height, sess.width, 3), idr, events))

    def _encoded(self, ev: e.Encoded, out: Out) -> None:
        sess, t = self.books.ticket(ev.session, ev.block, T_FRAMES)
        if t is None or not t.encoding:
            return
        if sess.state != RUNNING:
            self.books.release(sess, t, out)
            return
        if ev.error is not None:
            log.error("encoding block %d of %s failed: %s", ev.block, sess.id, ev.error)
            self.slots.advance(t, T_FAILED)
            self.books.end(sess, FAILED, f"encoder failed: {ev.error}", out)
            return
        self.meters.stage("encode", 1000 * ev.seconds)
        if self.cuts is not None:
            self.cuts.observe_host(1000 * ev.seconds)
        self.meters.fragment(sess, t.block, self.now)
        self.slots.advance(t, T_EMITTED)
        out.append(e.Emit(sess.id, ev.data, t.block))
        if sess.emitted == len(sess.tickets):
            self.books.end(sess, DONE, None, out)
        else:
            self._encode_next(sess, out)

    def _ack(self, ev: e.Ack, out: Out) -> None:
        if (sess := self.books.sessions.get(ev.session)) is not None:
            sess.playback.acked += ev.blocks

    # -- steered ------------------------------------------------------------------------------------
    def _steer(self, ev: e.Steer, out: Out):
        sess = self.books.active(ev.session)
        if sess is None:
            return steering.finished(ev.session)
        return steering.steer(sess, ev.scene, self.card, self.cfg.limits.max_pending_scenes)

    def _stop(self, ev: e.Stop, out: Out):
        sess = self.books.active(ev.session)
        if sess is None:
            return steering.finished(ev.session)
        landed = steering.stop(sess, self.card)
        if sess.state == RUNNING and sess.emitted == len(sess.tickets):
            self.books.end(sess, DONE, None, out)
        return landed

    def _control(self, ev: e.Controlled, out: Out):
        sess = self.books.active(ev.session)
        return steering.control_finished(ev.session, ev.control) if sess is None else steering.control(sess, ev.control)

    # -- lost -----------------------------------------------------------------------------------------
    def _failed(self, msg: m.Failed, out: Out) -> None:
        """A worker refused a block (the request, the session, its memory) or is exiting."""
        sess = self.books.sessions.get(msg.session) if msg.session else None
        if sess is None:
            return
        if msg.kind == "memory":
            self.admission.out_of_memory(msg.worker, self.books.running)
        code = "invalid_request" if msg.kind == "request" else "generation_failed"
        self.books.end(sess, FAILED, f"{msg.worker}: {msg.message}", out, code)
        if msg.kind not in ("request", "session", "memory"):
            return  # the worker exits; its tickets come back in WorkersLost once it has
        gone, answered = losses.refused(sess, msg)
        for t in gone:
            self._worker_gone(sess, t, out)
        if answered is not None:
            self._vae_answered(sess, answered, out)

    def _send_failed(self, ev: e.SendFailed, out: Out) -> None:
        """A message never left: its sessions fail now. A DiT batch's slots come back at once
        (nobody got it); a decode's only once the group is gone, since the shards that did get
        it may be writing."""
        msg = ev.msg
        if isinstance(msg, m.OpenSession):
            sess = self.books.sessions.get(msg.session)
            if sess is not None:
                self.books.end(sess, FAILED, f"could not reach {ev.worker}", out)
        if not isinstance(msg, m.GenerateBatch | m.DecodeBatch):
            return
        state = T_DIT if isinstance(msg, m.GenerateBatch) else T_VAE
        for item in msg.blocks:
            sess, t = self.books.ticket(item.session, item.block, state)
            if t is not None:
                self.books.end(sess, FAILED, f"could not reach {ev.worker}", out)
                if state == T_DIT:
                    self._worker_gone(sess, t, out)

    def _worker_idle(self, ev: e.WorkerIdle, out: Out) -> None:
        """A heartbeat said the worker has waited with nothing queued since `since`: a block
        sent to it well before that never arrived (a lost control message). Its session fails;
        its slots are safe to reuse, since no process will write them."""
        self.idle_since[ev.worker] = ev.since
        for sess, t in losses.lost_to_idle(list(self.books.sessions.values()), ev.worker, self.idle_since):
            log.error("session %s: block %d never reached its worker (a lost message)", sess.id, t.block.index)
            self.books.end(sess, FAILED, f"block {t.block.index} was lost on its way to a worker", out)
            self._worker_gone(sess, t, out)

    def _workers_lost(self, ev: e.WorkersLost, out: Out) -> None:
        """The pool killed these workers and saw them exit: their slots are free again."""
        for sess, held in losses.held_by(list(self.books.sessions.values()), ev.workers):
            self.books.end(sess, FAILED, ev.why, out)
            for t in held:
                self._worker_gone(sess, t, out)

    def _worker_gone(self, sess: Session, t: Ticket, out: Out) -> None:
        """No worker holds the ticket's slots any more (it answered with a refusal, never got
        the message, or died)."""
        if t.state in (T_DIT, T_VAE):
            self.batching.left(t)
        self.books.release(sess, t, out)

    # -- ended ------------------------------------------------------------------------------------------
    def _cancel(self, ev: e.Cancel, out: Out) -> bool:  # whether it ended now (it was queued or running)
        if (sess := self.books.active(ev.session)) is not None:
            self.books.end(sess, CANCELLED, ev.reason, out)
        return sess is not None

    def _stop_admitting(self, ev: e.StopAdmitting, out: Out) -> None:
        for sess in self.admission.stop():
            self.books.end(sess, CANCELLED, ev.reason, out)

    def snapshot(self) -> dict:
        tickets = self.books.tickets_out()
        cuts = self.cuts.report(self.topology.dit_workers) if self.cuts else {"vae_cuts": {}, "vae_cut_exchange": None}
        return {
            "vae_band_weights": {str(g): list(w) for g, w in self.balance.current.items()},
            "vae_cut": self.cfg.topology.vae_cut,  # decoder stages the DiT workers run (0: none)
            **cuts,
            "running": len(self.books.running),
            "queued": len(self.admission.queue),
            "tracked": len(self.books.sessions),
            "latent_slots_used": self.slots.latent.used,
            "latent_slots": self.slots.latent.total,
            "frame_slots_used": self.slots.frame.used,
            "frame_slots": self.slots.frame.total,
            "decode_wait": tickets.get(T_LATENT, 0),
            "tickets": tickets,
        }
