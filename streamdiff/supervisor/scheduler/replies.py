"""Replies: the workers' and the encoders' answers move their tickets on, and feed what they
measured to the capacity model and the controllers (band weights, the VAE cut); a fragment's
arrival is timed against its player (time to first fragment, stalls)."""

from __future__ import annotations

import logging

from ...ipc import messages as m
from ...plan import Block
from ..handle import DONE, FAILED, RUNNING
from .dispatch import Dispatch
from .events import Ack, Emit, Encoded, EncoderOpened
from .tickets import T_DIT, T_EMITTED, T_FAILED, T_FRAMES, T_LATENT, T_VAE, Session, Ticket

log = logging.getLogger("streamdiff.scheduler")


class Replies(Dispatch):
    def _latent_done(self, msg: m.LatentDone) -> None:
        sess, t = self._ticket(msg.session, msg.block, T_DIT)
        if t is None:
            log.warning("latent for unknown block %s/%s", msg.session, msg.block)
            return
        self._left_batch(t)
        if msg.skipped or sess.state != RUNNING:
            self._release(sess, t)
            return
        self.stage_ms["dit"] += msg.compute_ms
        self.metrics.stage_seconds.labels("dit").observe(msg.compute_ms / 1000)
        self.metrics.dit_batched_blocks.labels(str(msg.batch)).inc()
        ms, busy = msg.compute_ms, msg.busy_ms
        predicted = self.capacity.observe(sess.place.dit, (sess.width, sess.height), ms, msg.batch)
        if predicted:
            self.metrics.block_cost_ratio.labels("dit").observe(ms / predicted)
        self.balance.observe_dit(sess.place.dit, busy, self._latent_hw(sess.width, sess.height))
        if self.cuts is not None:
            hw = self._latent_hw(sess.width, sess.height)
            self.cuts.observe_dit(sess.place.dit, self._group_unit(sess.place.group), ms, t.vae_cut, hw)
        self._advance(t, T_LATENT)
        t.shape, t.data_shape = list(msg.shape), list(msg.data_shape)

    def _frames_done(self, msg: m.FramesDone) -> None:
        sess, t = self._ticket(msg.session, msg.block, T_VAE)
        if t is None:
            log.warning("frames for unknown block %s/%s", msg.session, msg.block)
            return
        t.reported.add(msg.rank)
        t.skipped |= msg.skipped
        if not msg.skipped:
            shard = self.topology.vae_groups[sess.place.group][msg.rank]
            self.balance.observe(shard, msg.busy_ms, msg.rows, self._latent_hw(sess.width, sess.height)[1])
        if not msg.skipped and msg.rank == 0:
            self.stage_ms["vae"] += msg.compute_ms
            self.metrics.stage_seconds.labels("vae").observe(msg.compute_ms / 1000)
            self.metrics.vae_batched_blocks.labels(str(msg.batch)).inc()
            unit, ms = self._group_unit(sess.place.group), msg.compute_ms
            predicted = self.capacity.observe(unit, (sess.width, sess.height), ms, msg.batch)
            if predicted:
                self.metrics.block_cost_ratio.labels("vae").observe(ms / predicted)
            if self.cuts is not None:
                self.cuts.observe_vae(unit, ms, t.vae_cut, self._latent_hw(sess.width, sess.height))
        self._vae_answered(sess, t)

    def _vae_answered(self, sess: Session, t: Ticket) -> None:
        if len(t.reported) < len(sess.place.vae_workers):
            return
        self._left_batch(t)
        if t.skipped or sess.state != RUNNING:
            self._release(sess, t)
            return
        self._advance(t, T_FRAMES)
        self._encode_next(sess)

    def _encoder_opened(self, ev: EncoderOpened) -> None:
        sess = self.sessions.get(ev.session)
        if sess is None or sess.playback.encoder != "opening":
            return
        if ev.error is not None:
            sess.playback.encoder = "none"
            log.error("session %s: the encoder could not open: %s", sess.id, ev.error)
            self._end(sess, FAILED, f"could not start: the encoder did not open: {ev.error}")
            return
        sess.playback.encoder = "open"
        if sess.state == RUNNING:
            if ev.init:
                self._out.append(Emit(sess.id, ev.init, None))
            self._encode_next(sess)

    def _encoded(self, ev: Encoded) -> None:
        sess, t = self._ticket(ev.session, ev.block, T_FRAMES)
        if t is None or not t.encoding:
            return
        if sess.state != RUNNING:
            self._release(sess, t)
            return
        if ev.error is not None:
            log.error("encoding block %d of %s failed: %s", ev.block, sess.id, ev.error)
            self._advance(t, T_FAILED)
            self._end(sess, FAILED, f"encoder failed: {ev.error}")
            return
        self.stage_ms["encode"] += 1000 * ev.seconds
        self.metrics.stage_seconds.labels("encode").observe(ev.seconds)
        if self.cuts is not None:
            self.cuts.observe_host(1000 * ev.seconds)
        self._observe_fragment(sess, t.block)
        self._advance(t, T_EMITTED)
        self._out.append(Emit(sess.id, ev.data, t.block))
        if sess.emitted == len(sess.tickets):
            self._end(sess, DONE, None)
        else:
            self._encode_next(sess)

    def _observe_fragment(self, sess: Session, b: Block) -> None:
        """Time to first fragment, intervals, and stalls against real-time playback: the player
        starts startup_buffer_s after the first fragment (the same clock as `deadline`); a
        fragment that arrives after its first frame was due is a stall, and the player's clock
        slips by the difference."""
        now, mt = self.now, self.metrics
        if sess.playback.fragment_times:
            mt.fragment_interval_seconds.observe(now - sess.playback.fragment_times[-1])
            due = self.deadline(sess, b.index)
            if now > due:
                sess.playback.stalls += 1
                sess.playback.stall_s += now - due
                mt.stalls.inc()
                mt.stall_seconds.inc(now - due)
        else:
            mt.ttff_seconds.observe(now - sess.created)
        sess.playback.fragment_times.append(now)
        mt.fragments.inc()
        mt.frames.inc(b.emit)

    def _ack(self, ev: Ack) -> None:
        sess = self.sessions.get(ev.session)
        if sess is not None:
            sess.playback.acked += ev.blocks
