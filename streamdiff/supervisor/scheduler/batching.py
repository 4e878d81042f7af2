"""Batching, one collaborator of the scheduler: which blocks go out together, and the batches
each unit (a DiT worker, a VAE group) holds.

Each stage serves the earliest deadline first and is work-conserving: a slot stays free only
while no session has a block it may run; a session far ahead of its player yields to one that
is behind. A VAE group's shards all get the same batch messages, so they always agree.

A unit gets at most STAGE_DEPTH batches at once (one running, one queued), so the choice of
what runs next is made late. A batch is the most urgent block plus other sessions' blocks that
can run with it, added while the measured per-block cost falls with the batch size (the first
few batches of a size are trials that measure it) and the batch does not make its most urgent
block late that would have been on time.
"""

from __future__ import annotations

from collections.abc import Callable

from .capacity import CapacityModel
from .tickets import Session, Ticket

STAGE_DEPTH = 2  # batches a DiT worker or VAE group holds at once: one running, one queued behind it

Candidate = tuple[Session, Ticket]
Deadline = Callable[[Session, int], float]  # when a session's player needs a block's first frame


class Batching:
    def __init__(self, max_batch: int, capacity: CapacityModel) -> None:
        self.max_batch = max_batch
        self.capacity = capacity
        self.out: dict[int, tuple[str, int]] = {}  # batch -> (unit, tickets still out)
        self.free_at: dict[str, float] = {}  # unit -> when its batches are predicted done
        self._next = 0

    def room(self, unit: str) -> bool:
        """Whether the unit may take another batch now."""
        return sum(u == unit for u, _ in self.out.values()) < STAGE_DEPTH

    def choose(
        self,
        unit: str,
        cands: list[Candidate],
        slots: int,
        after_ms: float,
        key: Callable[[Session, Ticket], tuple],
        deadline: Deadline,
        now: float,
    ) -> list[Candidate]:
        """The most urgent block and, while it pays, other sessions' blocks that `key` says can
        run with it: the measured per-block cost must fall with each one added, and the batch
        must not make the head late that would have been on time alone (`after_ms`: the stages
        still ahead of it)."""
        cands = sorted(cands, key=lambda c: (deadline(c[0], c[1].block.index), c[0].created))
        head = cands[0]
        size = (head[0].width, head[0].height)
        base = self.capacity.block_ms(unit, size)
        cap = min(self.max_batch, slots, self.capacity.batch_limit(unit) or self.max_batch)
        batch = [head]
        if base is None or cap < 2:
            return batch
        due = deadline(head[0], head[1].block.index) - after_ms / 1000
        start = max(now, self.free_at.get(unit, 0.0))  # after the batch already queued there

        def finish(n: int) -> float:
            return start + self._batch_ms(unit, size, base, n) / 1000

        for c in cands[1:]:
            if len(batch) >= cap:
                break
            if key(*c) != key(*head):
                continue
            n = len(batch) + 1
            cheaper = self.capacity.batch_factor(unit, size, n) < self.capacity.batch_factor(unit, size, n - 1)
            if not cheaper and not self.capacity.on_trial(unit, size, n):
                break  # measured no cheaper per block: not worth the wait
            if finish(n) > due >= finish(n - 1):
                break  # would make the head late
            batch.append(c)
        return batch

    def open(self, unit: str, batch: list[Candidate], now: float) -> int:
        """A new batch out at `unit`: its id, and when the unit is predicted free again."""
        bid = self._next
        self._next += 1
        self.out[bid] = (unit, len(batch))
        size = (batch[0][0].width, batch[0][0].height)
        base = self.capacity.block_ms(unit, size) or 0.0
        self.free_at[unit] = max(now, self.free_at.get(unit, 0.0)) + self._batch_ms(unit, size, base, len(batch)) / 1000
        for _, t in batch:
            t.batch = bid
        return bid

    def left(self, t: Ticket) -> None:
        """The ticket is no longer out in its batch (answered, or lost with its worker)."""
        unit, out = self.out.pop(t.batch)
        if out > 1:
            self.out[t.batch] = (unit, out - 1)
        t.batch = None

    def _batch_ms(self, unit: str, size: tuple[int, int], base: float, n: int) -> float:
        return base * n * self.capacity.batch_factor(unit, size, n)
