"""Steering: a Steer or Stop replans the session's unstarted tickets (`plan.replan_from`); the
answer (`Steered`) names the frame where the new scene or the end lands. A world model's control
joins its session's timeline (controls.py) at the first unstarted block; the answer
(`ControlLanded`) names that block and its first frame."""

from __future__ import annotations

from dataclasses import replace

from ...controls import ControlError
from ...plan import Scene, replan_from
from ..handle import DONE, RUNNING
from .events import ControlLanded, Controlled, Steer, Steered, Stop
from .state import SchedulerState
from .tickets import Session, Ticket


class Steering(SchedulerState):
    def _steer(self, ev: Steer) -> None:
        sess = self.sessions.get(ev.session)
        if sess is None or not sess.active:
            self._out.append(Steered(ev.session, refused=(409, "the video has finished")))
            return
        pending = sum(b >= sess.issued for b in sess.steered_at)
        if pending >= self.cfg.limits.max_pending_scenes:
            limit = self.cfg.limits.max_pending_scenes
            why = f"{pending} scene changes are waiting for their first block; the limit is {limit}"
            self._out.append(Steered(ev.session, refused=(429, why)))
            return
        at = max(sess.issued, 1, *(b + 1 for b in sess.steered_at))  # after any steer still pending
        total = sum(sc.frames for sc in sess.scenes)
        start = sess.blocks[at].start_frame if at < len(sess.blocks) else total
        if start >= total:
            self._out.append(Steered(ev.session, refused=(409, "no block of the video is left to steer")))
            return
        new = replace(ev.scene, frames=total - start)
        self._replan(sess, at, new)
        sess.steered_at.append(at)
        self._out.append(Steered(sess.id, len(sess.scenes) - 1, start, list(sess.scenes)))

    def _control(self, ev: Controlled) -> None:
        sess, c = self.sessions.get(ev.session), ev.control
        try:
            if sess is None or not sess.active:
                raise ControlError("the video has finished", None, 409, "video_finished")
            if sess.controls is None:
                raise ControlError("this model takes no controls", None, 400, "controls_unsupported")
            if sess.issued >= len(sess.blocks):
                raise ControlError("no block of the video is left to control", None, 409, "video_finished")
            if c.block is not None and c.block >= len(sess.blocks):
                why = f"block {c.block} is past the video's {len(sess.blocks)} blocks"
                raise ControlError(why, "block", 409, "past_the_end")
            at = sess.controls.receive(c, sess.issued)
        except ControlError as err:
            self._out.append(ControlLanded(ev.session, c.seq, refused=(err.status, err.param, err.code, err.message)))
            return
        self._out.append(ControlLanded(sess.id, c.seq, at, sess.blocks[at].start_frame))

    def _stop(self, ev: Stop) -> None:
        sess = self.sessions.get(ev.session)
        if sess is None or not sess.active:
            self._out.append(Steered(ev.session, refused=(409, "the video has finished")))
            return
        at = max(sess.issued, 1)
        if at < len(sess.blocks):
            self._replan(sess, at, None)
        end = sess.blocks[-1].start_frame + sess.blocks[-1].emit
        self._out.append(Steered(sess.id, None, end, list(sess.scenes)))
        if sess.state == RUNNING and sess.emitted == len(sess.tickets):
            self._end(sess, DONE, None)

    def _replan(self, sess: Session, at: int, new: Scene | None) -> None:
        """Blocks from `at` on (none of them started) follow the new plan."""
        fpb, tf = self.card.frames_per_block, self.card.temporal_factor
        sess.scenes, sess.blocks = replan_from(sess.scenes, sess.blocks, at, new, fpb, tf)
        blocks = sess.blocks
        sess.tickets = sess.tickets[:at] + [Ticket(b) for b in blocks[at:]]
