"""Video jobs: the OpenAI video object, the bytes of its MP4, readers that follow it live
(supervisor process).

A job follows one session through its SessionHandle (supervisor/handle.py): a task reads
the handle's events into the job. Its bytes are the CMAF stream: the init segment, then
one fragment per block; readers (the streaming POST, GET .../content) start from byte 0 and
follow new fragments as they arrive. Backpressure: when the job was created with
`"stream": true` its own response is the consumer whose pace throttles the session (a slow
client slows only itself); otherwise the job acknowledges each fragment as it arrives and
buffers. Finished videos are kept within a size and age budget, oldest first out, but never
while a reader is attached nor in the first `min_keep_s` after they finish (a client that saw
"completed" must still find the bytes).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

from ..plan import Block
from ..supervisor.handle import CANCELLED, DONE, Data, SessionHandle, Started

log = logging.getLogger("streamdiff.http")

STATUS = {"queued": "queued", "running": "in_progress", DONE: "completed", "failed": "failed", CANCELLED: "failed"}


class JobExpired(Exception):
    """The job's bytes were dropped while a reader followed it: its transfer must end truncated."""


class Job:
    def __init__(self, request, live_consumer: bool, node: str = "local") -> None:
        self.id = f"video_{secrets.token_hex(12)}_{node}"  # the node that holds it, for a balancer's routing
        self.request = request
        self.created_at = int(time.time())
        self.completed_at: int | None = None
        self.expires_at: int | None = None
        self.state = "queued"
        self.error: dict | None = None
        self.chunks: list[bytes] = []
        self.is_fragment: list[bool] = []  # False for a chunk that is only the init segment
        self.ends: list[int] = []  # byte offset just past each chunk, for ranges without a join
        self.fragment_chunks: list[int] = []  # the chunk index of each block's fragment, in order
        self.fragment_frames: list[int] = []  # the frames each fragment holds
        self.fragment_times: list[float] = []  # when each fragment was here (time.monotonic)
        self.nbytes = 0
        self.readers = 0  # transfers following or reading this job right now
        self.frames_done = 0
        self.handle: SessionHandle | None = None  # the engine session it follows
        self.placement: dict | None = None  # the workers the session runs on
        self.expired = False
        self.stopped = False  # a client asked it to end early (it completes there)
        self.keep_s: float | None = None  # set by the store: how long the finished video is kept
        self.on_finished: Callable[[Job], None] = lambda job: None
        self.live_consumer = live_consumer
        self._changed = asyncio.Event()
        self._follower: asyncio.Task | None = None
        self.t_created = time.monotonic()
        self.t_started: float | None = None  # admitted: the engine started its session
        self.t_first_fragment: float | None = None
        self.t_finished: float | None = None
        self.pushes: list = []  # its pushes to ingests (server/push.py)
        self.scenes: list = []  # the request's, and then as steering changes them
        self.scene_starts: list[int] = []
        self.set_scenes(request.scenes)

    def set_scenes(self, scenes: list) -> None:
        """The video's scenes now (a steer appends one and shortens the one it cuts into; a
        stop shortens the last)."""
        self.scenes = list(scenes)
        self.scene_starts, start = [], 0
        for sc in self.scenes:
            self.scene_starts.append(start)
            start += sc.frames

    # -- the engine session -------------------------------------------------------------------
    def follow_session(self, handle: SessionHandle) -> None:
        """Read the session's events into this job until it ends."""
        self.handle = handle
        self._follower = asyncio.ensure_future(self._read(handle))

    async def _read(self, handle: SessionHandle) -> None:
        async for ev in handle:
            if isinstance(ev, Started):
                self.state, self.placement = "running", ev.placement
                self.t_started = time.monotonic()
            elif isinstance(ev, Data):
                self._append(ev.data, ev.block)
            else:
                self._end(ev.state, ev.error, ev.code)
            self._notify()
        self.on_finished(self)

    def _append(self, data: bytes, block: Block | None) -> None:
        self.chunks.append(data)
        self.is_fragment.append(block is not None)
        self.nbytes += len(data)
        self.ends.append(self.nbytes)
        if block is not None:
            self.fragment_chunks.append(len(self.chunks) - 1)
            self.fragment_frames.append(block.emit)
            self.fragment_times.append(time.monotonic())
            self.frames_done += block.emit
            if self.t_first_fragment is None:
                self.t_first_fragment = time.monotonic()
            if not self.live_consumer:  # buffered here: the engine may go on at once
                self.handle.ack()

    def _end(self, state: str, error: str | None, code: str | None) -> None:
        self.state = state
        self.completed_at = int(time.time())
        self.t_finished = time.monotonic()
        if state != DONE:
            code = "cancelled" if state == CANCELLED else code or "generation_failed"
            self.error = {"code": code, "message": error or state}
        elif self.keep_s is not None:
            self.expires_at = int(self.completed_at + self.keep_s)

    def cancel(self, reason: str) -> None:
        if self.handle is not None and not self.finished:
            self.handle.cancel(reason)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- readers ------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.state in (DONE, "failed", CANCELLED)

    async def follow(self, start_chunk: int = 0) -> AsyncIterator[tuple[bytes, bool]]:
        """Yield (chunk, is_fragment) from `start_chunk` on, waiting for new ones until the job
        ends. Raises JobExpired if the bytes go away under the reader (never a clean short end)."""
        i = start_chunk
        self.readers += 1
        try:
            while True:
                while i < len(self.chunks):
                    yield self.chunks[i], self.is_fragment[i]
                    i += 1
                if self.expired:
                    raise JobExpired(self.id)
                if self.finished:
                    return
                await self._changed.wait()
        finally:
            self.readers -= 1

    def changed(self):
        """An awaitable that is done at the job's next event (a fragment, its end, its expiry)."""
        return self._changed.wait()

    def fragment(self, n: int) -> bytes:
        """Block n's fragment (an LL-HLS part)."""
        if self.expired:
            raise JobExpired(self.id)
        return self.chunks[self.fragment_chunks[n]]

    def ack(self, blocks: int = 1) -> None:
        if self.handle is not None:
            self.handle.ack(blocks)

    def expire(self) -> None:
        """Drop the bytes (the video object stays); a reader still following is woken to fail."""
        now = int(time.time())
        self.expired, self.chunks, self.is_fragment, self.ends = True, [], [], []
        self.fragment_chunks, self.fragment_frames, self.fragment_times = [], [], []
        self.expires_at = min(self.expires_at or now, now)
        self._notify()

    def read(self, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of the video, joined from the chunks that hold them only."""
        if self.expired:
            raise JobExpired(self.id)
        first = bisect.bisect_right(self.ends, start)
        last = bisect.bisect_left(self.ends, stop)
        parts = self.chunks[first : last + 1]
        if not parts:
            return b""
        base = self.ends[first - 1] if first else 0
        return b"".join(parts)[start - base : stop - base]

    # -- the OpenAI video object --------------------------------------------------------------
    def video_object(self) -> dict:
        r = self.request
        total = sum(sc.frames for sc in self.scenes)
        progress = 100 if self.state == DONE else int(100 * self.frames_done / total) if total else 0
        obj = {
            "id": self.id,
            "object": "video",
            "model": r.model,
            "status": STATUS[self.state],
            "progress": min(progress, 100),
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "expires_at": self.expires_at,
            "prompt": self.scenes[0].prompt if len(self.scenes) == 1 else " | ".join(s.prompt for s in self.scenes),
            "seconds": f"{total / r.fps:g}",
            "size": f"{r.width}x{r.height}",
            "error": self.error,
            "remixed_from_video_id": None,
            "fps": r.fps,
            "num_frames": total,
            "frames_done": self.frames_done,
            "seed": r.seed,
            # image-to-video: the image was the video's first frame (what was received, and the crop)
            "input_reference": r.input_reference,
            "scenes": [
                {
                    "index": i,
                    "prompt": s.prompt,
                    "start_frame": self.scene_starts[i],
                    "num_frames": s.frames,
                    "start_seconds": self.scene_starts[i] / r.fps,
                    "transition": s.transition,
                    "seed": s.seed,
                    "recache": s.recache,
                }
                for i, s in enumerate(self.scenes)
            ],
            "live": r.live,
        }
        if self.placement is not None:
            obj["workers"] = self.placement
        if self.t_started is not None:
            obj["queued_s"] = round(self.t_started - self.t_created, 3)  # waiting for admission
        if self.t_first_fragment is not None:
            obj["time_to_first_fragment_s"] = round(self.t_first_fragment - self.t_created, 3)
        if self.pushes:  # each ingest it is pushed to: state, attempts, the last error
            obj["outputs"] = [p.describe() for p in self.pushes]
        return obj


class JobStore:
    def __init__(self, max_jobs: int, keep_bytes: int, keep_s: float, min_keep_s: float, disk=None) -> None:
        self.jobs: OrderedDict[str, Job] = OrderedDict()
        self.max_jobs, self.keep_bytes, self.keep_s, self.min_keep_s = max_jobs, keep_bytes, keep_s, min_keep_s
        self.disk = disk  # a VideoStore: finished videos are written there too
        self._writes: set = set()

    def add(self, job: Job) -> None:
        job.keep_s = self.keep_s
        job.on_finished = self._finished
        self.jobs[job.id] = job
        self.prune()

    def _finished(self, job: Job) -> None:
        if self.disk is not None and job.state == DONE:
            # Off the loop; the chunk list is copied now, before any expiry can drop it.
            fut = asyncio.get_running_loop().run_in_executor(
                None, self.disk.save, job.id, list(job.chunks), job.video_object()
            )
            self._writes.add(fut)
            fut.add_done_callback(self._written)
        self.prune()

    def _written(self, fut) -> None:
        self._writes.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.error("writing a finished video to the store failed: %s", fut.exception())

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def remove(self, job_id: str) -> None:
        self.jobs.pop(job_id, None)

    def _protected(self, job: Job, now: float) -> bool:
        """Not to be expired now: somebody is reading it, or it finished moments ago."""
        return job.readers > 0 or job.t_finished is None or now - job.t_finished < self.min_keep_s

    def prune(self) -> None:
        """Expire the oldest finished videos beyond the byte or age budget (running jobs' bytes
        count towards the budget, but only finished, unprotected ones are expired); forget the
        oldest finished jobs beyond max_jobs."""
        now = time.monotonic()
        kept = sum(j.nbytes for j in self.jobs.values() if not j.expired)
        for j in list(self.jobs.values()):  # oldest first
            if not j.finished or j.expired or self._protected(j, now):
                continue
            too_old = now - j.t_finished > self.keep_s
            if too_old or kept > self.keep_bytes:
                kept -= j.nbytes
                j.expire()
        while len(self.jobs) > self.max_jobs:
            oldest = next((j for j in self.jobs.values() if j.finished and not self._protected(j, now)), None)
            if oldest is None:
                break
            del self.jobs[oldest.id]

    def page(self, after: str | None, limit: int, order: str) -> tuple[list[Job], bool]:
        jobs = sorted(self.jobs.values(), key=lambda j: (j.created_at, j.t_created), reverse=order == "desc")
        if after is not None:
            ids = [j.id for j in jobs]
            jobs = jobs[ids.index(after) + 1 :]
        return jobs[:limit], len(jobs) > limit
