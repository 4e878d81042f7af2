"""Steering, one collaborator of the scheduler: a Steer or Stop replans a session's unstarted
tickets (`plan.replan_from`); the answer (`Steered`) names the frame where the new scene or the
end lands. A world model's control joins its session's timeline (controls.py) at the first
unstarted block; the answer (`ControlLanded`) names that block and its first frame.

Plain functions of an active session: each returns its answer. The scheduler answers for a
session that has ended, and ends one a stop has finished.
"""

from __future__ import annotations

from dataclasses import replace

from ...card import ModelCard
from ...controls import Control, ControlError
from ...plan import Scene, replan_from
from .events import ControlLanded, Steered
from .tickets import Session, Ticket

FINISHED = "the video has finished"


def finished(session: str) -> Steered:
    return Steered(session, refused=(409, FINISHED))


def control_finished(session: str, c: Control) -> ControlLanded:
    return ControlLanded(session, c.seq, refused=(409, None, "video_finished", FINISHED))


def steer(sess: Session, scene: Scene, card: ModelCard, max_pending: int) -> Steered:
    """A new scene from the first block that has not started (after any steer still pending)."""
    pending = sum(b >= sess.issued for b in sess.steered_at)
    if pending >= max_pending:
        why = f"{pending} scene changes are waiting for their first block; the limit is {max_pending}"
        return Steered(sess.id, refused=(429, why))
    at = max(sess.issued, 1, *(b + 1 for b in sess.steered_at))
    total = sum(sc.frames for sc in sess.scenes)
    start = sess.blocks[at].start_frame if at < len(sess.blocks) else total
    if start >= total:
        return Steered(sess.id, refused=(409, "no block of the video is left to steer"))
    replan(sess, at, replace(scene, frames=total - start), card)
    sess.steered_at.append(at)
    return Steered(sess.id, len(sess.scenes) - 1, start, list(sess.scenes))


def stop(sess: Session, card: ModelCard) -> Steered:
    """The video ends after the blocks that have started."""
    at = max(sess.issued, 1)
    if at < len(sess.blocks):
        replan(sess, at, None, card)
    end = sess.blocks[-1].start_frame + sess.blocks[-1].emit
    return Steered(sess.id, None, end, list(sess.scenes))


def control(sess: Session, c: Control) -> ControlLanded:
    """A world model's control, on its session's timeline from the first unstarted block."""
    try:
        if sess.controls is None:
            raise ControlError("this model takes no controls", None, 400, "controls_unsupported")
        if sess.issued >= len(sess.blocks):
            raise ControlError("no block of the video is left to control", None, 409, "video_finished")
        if c.block is not None and c.block >= len(sess.blocks):
            why = f"block {c.block} is past the video's {len(sess.blocks)} blocks"
            raise ControlError(why, "block", 409, "past_the_end")
        at = sess.controls.receive(c, sess.issued)
    except ControlError as err:
        return ControlLanded(sess.id, c.seq, refused=(err.status, err.param, err.code, err.message))
    return ControlLanded(sess.id, c.seq, at, sess.blocks[at].start_frame)


def replan(sess: Session, at: int, new: Scene | None, card: ModelCard) -> None:
    """Blocks from `at` on (none of them started) follow the new plan."""
    fpb, tf = card.frames_per_block, card.temporal_factor
    sess.scenes, sess.blocks = replan_from(sess.scenes, sess.blocks, at, new, fpb, tf)
    sess.tickets = sess.tickets[:at] + [Ticket(b) for b in sess.blocks[at:]]
