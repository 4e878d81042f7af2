"""Meters, one collaborator of the scheduler: each session's player clock (when a block is due,
time to first fragment, stalls) and what the stages measured (metrics.py's counters, the compute
time per stage).

A block is due when its session's player needs its first frame: first fragment + start-up
buffer + stalls so far + the block's media time (before the first fragment the clock counts
from the request). A fragment that arrives after its first frame was due is a stall, and the
player's clock slips by the difference: a player rebuffers, then continues.
"""

from __future__ import annotations

from ...metrics import Metrics
from ...plan import Block
from .tickets import Session


class Meters:
    def __init__(self, startup_buffer_s: float) -> None:
        self.startup_buffer_s = startup_buffer_s
        self.metrics = Metrics()
        self.stage_ms = {"dit": 0.0, "vae": 0.0, "encode": 0.0}  # summed compute time per stage

    def deadline(self, sess: Session, block: int) -> float:
        """When the session's player needs the block's first frame."""
        p = sess.playback
        start = p.fragment_times[0] if p.fragment_times else sess.created
        b = sess.blocks[min(block, len(sess.blocks) - 1)]
        return start + self.startup_buffer_s + p.stall_s + b.start_frame / sess.fps

    def paced_until(self, sess: Session, lead_s: float) -> float:
        """When a live session's next block may start: at most `lead_s` ahead of its player's
        clock (a steer must show soon, not after all that was generated ahead)."""
        if not sess.live or not sess.playback.fragment_times:
            return 0.0
        return self.deadline(sess, sess.issued) - lead_s

    def stage(self, stage: str, ms: float, batch: int | None = None, predicted: float | None = None) -> None:
        """A stage's block took `ms` (in a batch of `batch`; `predicted`: what the capacity
        model expected)."""
        mt = self.metrics
        self.stage_ms[stage] += ms
        mt.stage_seconds.labels(stage).observe(ms / 1000)
        if stage == "dit":
            mt.dit_batched_blocks.labels(str(batch)).inc()
        elif stage == "vae":
            mt.vae_batched_blocks.labels(str(batch)).inc()
        if predicted:
            mt.block_cost_ratio.labels(stage).observe(ms / predicted)

    def fragment(self, sess: Session, b: Block, now: float) -> None:
        """A block's fragment reached its session at `now`."""
        mt, p = self.metrics, sess.playback
        if p.fragment_times:
            mt.fragment_interval_seconds.observe(now - p.fragment_times[-1])
            due = self.deadline(sess, b.index)
            if now > due:
                p.stalls += 1
                p.stall_s += now - due
                mt.stalls.inc()
                mt.stall_seconds.inc(now - due)
        else:
            mt.ttff_seconds.observe(now - sess.created)
        p.fragment_times.append(now)
        mt.fragments.inc()
        mt.frames.inc(b.emit)
