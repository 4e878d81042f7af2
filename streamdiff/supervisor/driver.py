"""Carries out the step scheduler's actions (supervisor process, on the event loop).

Events come from the control socket, the worker pool, the encoders and the API; `post` collects
them, and one `step` runs per batch of what arrived meanwhile (a call_soon after the first).
The actions that come back are done here and nowhere else: control messages go out on the
socket, encoders open and encode on each session's own thread (bounded by encode_timeout_s, so a
stuck encoder fails its own session only and never blocks the loop), and bytes and ends go to
the sessions' handles. `submit` and `cancel` step at once: the API needs their answer now.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..config import Config
from ..ipc import messages as m
from ..ipc.shm import Ring
from ..media.encoder import FragmentWriter, open_encoder
from . import scheduler as s
from .handle import QueueFull, SessionHandle

log = logging.getLogger("streamdiff.driver")


class _Encoder:
    """One session's encoder: its own thread, so its work runs in order and off the loop."""

    def __init__(self, session: str) -> None:
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"encode-{session[-12:]}")
        self.writer: FragmentWriter | None = None


class Driver:
    def __init__(
        self,
        cfg: Config,
        scheduler: s.Scheduler,
        send: Callable[[str, m.Message], None],
        ready: Callable[[], Collection[str]],  # the worker processes ready now (the pool's)
        frame_ring: Ring,
        host_gate=None,  # the platform's gate around host work on the workers' devices (CPU shared cores: HostSlot)
    ) -> None:
        self.cfg = cfg
        self.host_gate = host_gate
        self.scheduler = scheduler
        self.send = send
        self.ready = ready
        self.frame_ring = frame_ring
        self.handles: dict[str, SessionHandle] = {}
        self.encoders: dict[str, _Encoder] = {}
        self._pending: list[s.Event] = []
        self._flush_scheduled = False
        self._tasks: set[asyncio.Task] = set()
        self._timer: asyncio.TimerHandle | None = None  # the next WakeAt

    # -- events in ----------------------------------------------------------------------------
    def post(self, event: s.Event) -> None:
        self._pending.append(event)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        self.step()

    def step(self, *events: s.Event) -> list[s.Action]:
        """One step over everything pending (and `events`); returns what it decided."""
        batch, self._pending = [*self._pending, *events], []
        t0 = time.perf_counter()
        actions = self.scheduler.step(batch, time.monotonic(), self.ready())
        return self._carry_out(actions, t0)

    def _call(self, event: s.Event):
        """One step over everything pending and then `event`, whose answer the caller waits on."""
        pending, self._pending = self._pending, []
        t0 = time.perf_counter()
        answer, actions = self.scheduler.call(event, time.monotonic(), self.ready(), pending)
        self._carry_out(actions, t0)
        return answer

    def _carry_out(self, actions: list[s.Action], t0: float) -> list[s.Action]:
        self.scheduler.meters.metrics.scheduler_seconds.inc(time.perf_counter() - t0)
        for action in actions:
            try:
                self._do(action)
            except Exception:
                log.exception("carrying out %r failed", action)
        return actions

    # -- the API's entry points -----------------------------------------------------------------
    def submit(self, session: s.Session) -> SessionHandle:
        handle = SessionHandle(session.id, self)
        self.handles[session.id] = handle
        refused = self._call(s.Submit(session))
        if refused is not None:
            self.handles.pop(session.id, None)
            raise QueueFull(refused.message, refused.retry_after_s)
        return handle

    def ack(self, session: str, blocks: int = 1) -> None:
        self.post(s.Ack(session, blocks))

    def cancel(self, session: str, reason: str = "cancelled") -> bool:
        return self._call(s.Cancel(session, reason))

    def steer(self, session: str, scene) -> s.Steered:
        return self._call(s.Steer(session, scene))

    def stop(self, session: str) -> s.Steered:
        return self._call(s.Stop(session))

    def control(self, session: str, control) -> s.ControlLanded:
        return self._call(s.Controlled(session, control))

    # -- actions out ----------------------------------------------------------------------------
    def _do(self, a: s.Action) -> None:
        if isinstance(a, s.Send):
            if not self.send(a.worker, a.msg):
                self.post(s.SendFailed(a.worker, a.msg))
        elif isinstance(a, s.Emit):
            self.handles[a.session].on_data(a.data, a.block)
        elif isinstance(a, s.Encode):
            self._spawn(self._encode(self.encoders[a.session], a))
        elif isinstance(a, s.Start):
            self.handles[a.session].on_start(a.placement)
        elif isinstance(a, s.OpenEncoder):
            self.encoders[a.session] = enc = _Encoder(a.session)
            self._spawn(self._open_encoder(enc, a))
        elif isinstance(a, s.CloseEncoder):
            self._close_encoder(a.session)
        elif isinstance(a, s.End):
            handle = self.handles.pop(a.session, None)
            if handle is not None:
                handle.on_end(a.state, a.error, a.code)
        elif isinstance(a, s.WakeAt):
            self._wake_at(a.at)

    def _wake_at(self, at: float) -> None:
        """One timer: the earliest wake asked for that has not passed (a step asks again)."""
        loop = asyncio.get_running_loop()
        t = self._timer
        if t is not None and not t.cancelled() and loop.time() <= t.when() <= at:
            return
        if t is not None:
            t.cancel()
        self._timer = loop.call_at(at, self.step)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _bounded(self, enc: _Encoder, fn, *args):
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(loop.run_in_executor(enc.thread, fn, *args), self.cfg.encoder.encode_timeout_s)

    async def _open_encoder(self, enc: _Encoder, a: s.OpenEncoder) -> None:
        def open_writer() -> bytes:
            c = self.cfg.encoder
            encoder = open_encoder(
                c.kind, a.width, a.height, a.fps, a.keyframes, c.crf, bitrate_kbps=c.bitrate_kbps, device=c.vaapi_device
            )
            # Set on its thread: a close queued behind it sees the writer.
            enc.writer = FragmentWriter(encoder, a.width, a.height, a.fps)
            return enc.writer.init_segment()

        try:
            init = await self._bounded(enc, open_writer)
        except Exception as exc:
            self.post(s.EncoderOpened(a.session, error=repr(exc) if not isinstance(exc, TimeoutError) else "timed out"))
            return
        self.post(s.EncoderOpened(a.session, init=init))

    def _fragment(self, writer: FragmentWriter, *args) -> bytes:
        """On the encoder's thread."""
        if self.host_gate is None:
            return writer.fragment(*args)
        with self.host_gate.running():
            return writer.fragment(*args)

    async def _encode(self, enc: _Encoder, a: s.Encode) -> None:
        frames = self.frame_ring.array(a.frame_slot, a.shape, np.uint8)[: a.block.emit]
        t0 = time.perf_counter()
        try:
            data = await self._bounded(enc, self._fragment, enc.writer, frames, a.idr, a.events)
        except TimeoutError:
            self.post(s.Encoded(a.session, a.block.index, error="no fragment within encode_timeout_s"))
            return
        except Exception as exc:
            self.post(s.Encoded(a.session, a.block.index, error=repr(exc)))
            return
        self.post(s.Encoded(a.session, a.block.index, data=data, seconds=time.perf_counter() - t0))

    def _close_encoder(self, session: str) -> None:
        enc = self.encoders.pop(session, None)
        if enc is None:
            return

        def close() -> None:  # after whatever is already on its thread
            if enc.writer is not None:
                enc.writer.close()

        enc.thread.submit(close)
        enc.thread.shutdown(wait=False)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for enc in self.encoders.values():
            enc.thread.shutdown(wait=False, cancel_futures=True)
        self.encoders.clear()
