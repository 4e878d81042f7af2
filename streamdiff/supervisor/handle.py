"""A session as the API sees it (supervisor process): submit a request, get a SessionHandle.

The HTTP layer never builds scheduler sessions nor calls the scheduler: it hands a validated
request to `Supervisor.submit` and reads what happens from the handle — an async iterator of
events (`Started`, `Data` for the init segment and each fragment, `Ended`) — and it steers the
session through the handle (`ack` a fragment taken by a live consumer: backpressure; `cancel`).
The driver feeds the handle from the scheduler's actions, on the event loop, in order.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..plan import Block

QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "failed", "cancelled"


class QueueFull(Exception):
    """The session can be neither admitted nor queued (429): retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 10.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Started:
    placement: dict  # the workers the session runs on: {"dit": name, "vae": [names]}


@dataclass(frozen=True)
class Data:
    data: bytes
    block: Block | None  # None for the init segment


@dataclass(frozen=True)
class Ended:
    state: str  # done | failed | cancelled
    error: str | None = None
    code: str | None = None


Event = Started | Data | Ended


class SessionHandle:
    def __init__(self, session_id: str, engine) -> None:
        self.id = session_id
        self._engine = engine  # ack(id, blocks) and cancel(id, reason)
        self._events: asyncio.Queue[Event] = asyncio.Queue()

    # -- the engine's side ------------------------------------------------------------------------
    def on_start(self, placement: dict) -> None:
        self._events.put_nowait(Started(placement))

    def on_data(self, data: bytes, block: Block | None) -> None:
        self._events.put_nowait(Data(data, block))

    def on_end(self, state: str, error: str | None, code: str | None = None) -> None:
        self._events.put_nowait(Ended(state, error, code))

    # -- the consumer's side ----------------------------------------------------------------------
    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while True:
            event = await self._events.get()
            yield event
            if isinstance(event, Ended):
                return

    def ack(self, blocks: int = 1) -> None:
        """The consumer took `blocks` more fragments: room for more in flight."""
        self._engine.ack(self.id, blocks)

    def cancel(self, reason: str = "cancelled") -> bool:
        return self._engine.cancel(self.id, reason)

    def steer(self, scene):
        """A new scene from the first block the DiT has not started: where it lands (a
        `Steered`: scene index, start frame, the scenes now; or `refused` with a status)."""
        return self._engine.steer(self.id, scene)

    def stop(self):
        """End at the next block boundary: the video completes there (a `Steered`)."""
        return self._engine.stop(self.id)

    def control(self, control):
        """A world model's control (controls.Control) from the first block not started: where it
        lands (a `ControlLanded`: block, start frame; or `refused`)."""
        return self._engine.control(self.id, control)
