"""Pushing a video to an operator's ingest (RTMP, SRT) while it is made (supervisor process).

A push is an ffmpeg child that reads the job's CMAF bytes on its stdin and repackages them for
the destination without re-encoding (`-c copy`: FLV for RTMP, MPEG-TS for SRT). It reads the
job as any viewer does, so it never paces or stops the video. A push that fails (the ingest
refuses it, goes away, or cannot be reached) is reported on the video object and retried after
1, 2, 4 ... s, at most `outputs.retry_max_s` apart; a retry starts from the init segment and the
next fragment made (the ingest's viewers are live: they want the edge, not a replay). It ends
when the video does. We run ffmpeg rather than write RTMP and SRT ourselves: both protocols are
ffmpeg's, and it repackages the track exactly.

SRT is a live protocol over UDP: its receiver holds what arrives for its latency (120 ms by
default) and drops what it holds when the sender closes. So an SRT push is sent at the video's
frame rate (`-re`: a video made faster than real time would otherwise arrive in one burst),
each packet as it is muxed (`-flush_packets 1`), and ffmpeg's input stays open until its last
frame is due and SRT_LINGER_S more, so that the ingest delivers the video's end (measured: a
48-frame push closed at once lost its last frame; sent in a burst and closed, all of them).
"Due" counts from ffmpeg's own start, its first progress report (`-progress`: ffmpeg writes it
one stats period, 0.5 s, after it starts, so the wait errs long; a shorter `-stats_period` would
need ffmpeg 4.4). Counted from when the push started ffmpeg, a loaded host that started it late
closed its input while it still paced the last frames, and the ingest lost them (43 of 45
frames, three test processes on two cores).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time

from .jobs import Job, JobExpired

log = logging.getLogger("streamdiff.push")
SRT_LINGER_S = 1.0  # an SRT push's wait after the last frame: the receiver's latency buffer drains


class Push:
    """One destination of one video: its state as the video object shows it."""

    def __init__(self, job: Job, name: str, url: str, retry_max_s: float) -> None:
        self.job, self.name, self.url, self.retry_max_s = job, name, url, retry_max_s
        self.state = "starting"  # starting | pushing | retrying | done | failed
        self.attempts = 0
        self.error: str | None = None
        self.task = asyncio.ensure_future(self._run())

    def describe(self) -> dict:
        return {"name": self.name, "state": self.state, "attempts": self.attempts, "error": self.error}

    @property
    def srt(self) -> bool:
        return self.url.startswith("srt")

    def _command(self) -> list[str]:
        exe = shutil.which("ffmpeg") or "ffmpeg"
        live = ["-re", "-nostats", "-progress", "pipe:1"] if self.srt else []
        out = ["-flush_packets", "1", "-f", "mpegts"] if self.srt else ["-f", "flv"]
        head = [exe, "-hide_banner", "-loglevel", "error", *live]
        return [*head, "-f", "mp4", "-i", "pipe:0", "-c", "copy", *out, self.url]

    async def _run(self) -> None:
        start, wait = 0, 1.0  # the first fragment to send (a chunk index of the job's bytes)
        while True:
            self.attempts += 1
            ok, start = await self._attempt(start)
            if ok:
                self.state, self.error = "done", None
                return
            if self.job.finished or self.job.expired:
                self.state = "failed"
                log.warning("push of %s to %s failed: %s", self.job.id, self.name, self.error)
                return
            self.state = "retrying"
            log.warning("push of %s to %s failed (%s); retrying in %.0f s", self.job.id, self.name, self.error, wait)
            await asyncio.sleep(wait)
            wait = min(2 * wait, self.retry_max_s)
            start = len(self.job.chunks)  # the edge: the next fragment made

    async def _attempt(self, start: int) -> tuple[bool, int]:
        """One ffmpeg: the init segment, then the job's chunks from `start` as they come, until
        the video ends or ffmpeg does. (whether it delivered the video to its end, the chunk to
        resume from)."""
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *self._command(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE if self.srt else asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        self.state = "pushing"
        sent = [start]
        began = _FirstReport(proc.stdout) if self.srt else None

        async def feed() -> None:
            try:
                if start > 0:  # a retry: the track's header first, then the edge
                    await self._write(proc, self.job.chunks[0])
                async with contextlib.aclosing(self.job.follow(start)) as chunks:  # a reader no more once cancelled
                    async for chunk, _ in chunks:
                        await self._write(proc, chunk)
                        sent[0] += 1
                if self.srt:  # ffmpeg reads the frames at their rate (-re); then the ingest delivers the last
                    per = dict(zip(self.job.fragment_chunks, self.job.fragment_frames, strict=True))
                    media_s = sum(per.get(i, 0) for i in range(start, sent[0])) / self.job.request.fps
                    paced_from = await began.time(timeout_s=media_s + SRT_LINGER_S) or t0
                    await asyncio.sleep(max(0.0, paced_from + media_s - time.monotonic()) + SRT_LINGER_S)
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError, JobExpired):
                pass  # ffmpeg gave up (its exit and stderr say why), or the video's bytes went

        feeding, exiting = asyncio.ensure_future(feed()), asyncio.ensure_future(proc.wait())
        await asyncio.wait({feeding, exiting}, return_when=asyncio.FIRST_COMPLETED)
        if not feeding.done():  # ffmpeg ended while the video goes on: a failure
            feeding.cancel()
        elif self.job.expired and proc.returncode is None:
            proc.kill()
        code = await exiting
        if began is not None:
            await began.reading
        err = (await proc.stderr.read()).decode(errors="replace").strip()
        if code == 0 and feeding.done() and not feeding.cancelled() and self.job.finished:
            return True, sent[0]
        self.error = f"ffmpeg exited {code} after {time.monotonic() - t0:.1f} s: {err[-300:] or 'no message'}"
        return False, sent[0]

    @staticmethod
    async def _write(proc, data: bytes) -> None:
        proc.stdin.write(data)
        await proc.stdin.drain()


def start_pushes(job: Job, destinations: dict[str, str], retry_max_s: float) -> list[Push]:
    return [Push(job, name, destinations[name], retry_max_s) for name in job.request.outputs]


class _FirstReport:
    """When an ffmpeg child wrote its first progress report (`-progress pipe:1`): when it began
    to write its output. Reads the reports to their end, so that ffmpeg never blocks on them."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self.at: float | None = None
        self.seen = asyncio.Event()
        self.reading = asyncio.ensure_future(self._read(stream))

    async def _read(self, stream: asyncio.StreamReader) -> None:
        async for line in stream:
            if self.at is None and line.startswith(b"out_time_us="):
                self.at = time.monotonic()
                self.seen.set()
        self.seen.set()  # ffmpeg ended

    async def time(self, timeout_s: float) -> float | None:
        """The first report's time, waiting up to `timeout_s` for it (None: none came)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.seen.wait(), timeout_s)
        return self.at
