"""LL-HLS for the many who watch one video (supervisor process): its playlist, init segment,
parts and segments, cut from the CMAF fragments the job already holds (RFC 8216bis; Apple's
low-latency HLS).

Every block's fragment is one part (it starts with an IDR: INDEPENDENT=YES), PARTS_PER_SEGMENT
parts one segment. A viewer reads the job's bytes and nothing else: however many watch, the
video is generated once, and a viewer's join, stall or leaving never reaches the session (a
`"stream": true` job is still paced by its own client alone). While the video is live its
playlist is an EVENT playlist (nothing leaves it) that starts a new viewer near the live edge
(EXT-X-START), lists the parts of its last segments, hints the next part (EXT-X-PRELOAD-HINT) and
answers a blocking reload (`_HLS_msn`, `_HLS_part`) once that part exists; a request for a part
that does not exist yet waits a bounded time. A finished video's playlist is VOD: every segment,
an ENDLIST. Parts, segments and the init segment never change once served: a CDN or HAProxy may
keep them; a playlist only briefly.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

from aiohttp import web

from .api import APIError, bad
from .jobs import Job

PARTS_PER_SEGMENT = 4  # blocks of 12 frames at 16 fps: 3 s segments of 0.75 s parts
LISTED_SEGMENTS = 3  # a live playlist lists the parts of its last this many segments (the spec: >= 2)
IMMUTABLE = "public, max-age=86400, immutable"
# How far behind the newest part a player holds (PART-HOLD-BACK, in part targets): the spec's
# least, 2. Every part is a whole block beginning with an IDR, so a player never waits on a
# partial GOP, and a viewer who joins plays within two blocks of the live edge.
HOLD_BACK_PARTS = 2


@dataclass(frozen=True)
class Parts:
    """What a playlist is made of: each part's duration in seconds, the part target, whether the
    video is still being made."""

    durations: list[float]
    target: float  # PART-TARGET: the longest a part is (a whole block)
    live: bool

    @property
    def segments(self) -> int:
        """Complete segments: all their parts made (the last of a finished video may be short)."""
        n = len(self.durations)
        return n // PARTS_PER_SEGMENT if self.live else -(-n // PARTS_PER_SEGMENT)

    def segment(self, k: int) -> range:
        return range(k * PARTS_PER_SEGMENT, min((k + 1) * PARTS_PER_SEGMENT, len(self.durations)))


def parts_of(job: Job, block_frames: int) -> Parts:
    """The job's parts: one a fragment, `block_frames` frames the longest (a steady block)."""
    fps = job.request.fps
    durations = [n / fps for n in job.fragment_frames]
    return Parts(durations, max([block_frames / fps, *durations]), not job.finished)


def playlist(p: Parts) -> str:
    """The media playlist (URIs relative to it: `init.mp4`, `seg/K.m4s`, `part/I.m4s`)."""
    seg_target = math.ceil(PARTS_PER_SEGMENT * p.target)
    lines = [
        "#EXTM3U",
        "#EXT-X-VERSION:9",
        f"#EXT-X-TARGETDURATION:{seg_target}",
        f"#EXT-X-PART-INF:PART-TARGET={p.target:.5f}",
        f"#EXT-X-SERVER-CONTROL:CAN-BLOCK-RELOAD=YES,PART-HOLD-BACK={HOLD_BACK_PARTS * p.target:.5f}",
        f"#EXT-X-PLAYLIST-TYPE:{'EVENT' if p.live else 'VOD'}",
        "#EXT-X-INDEPENDENT-SEGMENTS",
    ]
    if p.live:  # a new viewer starts at the live edge (PART-HOLD-BACK behind the newest part)
        lines.append(f"#EXT-X-START:TIME-OFFSET={-HOLD_BACK_PARTS * p.target:.5f},PRECISE=YES")
    lines += ["#EXT-X-MEDIA-SEQUENCE:0", '#EXT-X-MAP:URI="init.mp4"']
    full = p.segments
    listed_from = full - LISTED_SEGMENTS + 1 if p.live else full  # parts listed for these segments
    for k in range(full + (1 if p.live else 0)):  # live: the segment being made, as its parts so far
        if k >= listed_from:
            lines += [
                f'#EXT-X-PART:DURATION={p.durations[i]:.5f},URI="part/{i}.m4s",INDEPENDENT=YES' for i in p.segment(k)
            ]
        if k < full:
            lines += [f"#EXTINF:{sum(p.durations[i] for i in p.segment(k)):.5f},", f"seg/{k}.m4s"]
    if p.live:
        lines.append(f'#EXT-X-PRELOAD-HINT:TYPE=PART,URI="part/{len(p.durations)}.m4s"')
    else:
        lines.append("#EXT-X-ENDLIST")
    return "\n".join(lines) + "\n"


class HLS:
    """The handlers of /v1/videos/{id}/hls/..., given how to find a job and the model's steady
    block length in frames."""

    def __init__(self, get_job, block_frames) -> None:
        self.get_job, self.block_frames = get_job, block_frames

    def routes(self, prefix: str) -> list[web.RouteDef]:
        base = f"{prefix}/videos/{{video_id}}/hls"
        return [
            web.get(f"{base}/index.m3u8", self.index),
            web.get(f"{base}/init.mp4", self.init),
            web.get(f"{base}/part/{{n}}.m4s", self.part),
            web.get(f"{base}/seg/{{n}}.m4s", self.segment),
        ]

    def _job(self, request: web.Request) -> Job:
        job = self.get_job(request)
        if job.expired:
            raise APIError(404, f"the content of video '{job.id}' has expired", "video_id", "expired")
        if job.state in ("failed", "cancelled"):
            raise APIError(409, f"video '{job.id}' {job.state}", "video_id", "video_failed")
        return job

    def _parts(self, job: Job) -> Parts:
        return parts_of(job, self.block_frames())

    async def _wait_part(self, job: Job, n: int, seconds: float) -> bool:
        """Until part n exists (True), the video ends without it or `seconds` pass (False)."""
        return await _wait(job, lambda: len(job.fragment_frames) > n, seconds)

    async def index(self, request: web.Request) -> web.Response:
        job = self._job(request)
        msn, part = request.query.get("_HLS_msn"), request.query.get("_HLS_part")
        blocking = msn is not None
        if part is not None and msn is None:
            raise bad("'_HLS_part' needs '_HLS_msn'", "_HLS_part")
        if blocking:
            m = _index(msn, "_HLS_msn")
            i = (m + 1) * PARTS_PER_SEGMENT - 1 if part is None else m * PARTS_PER_SEGMENT + _index(part, "_HLS_part")
            if part is not None and _index(part, "_HLS_part") >= PARTS_PER_SEGMENT:
                raise bad(f"'_HLS_part' {part} is past a segment's {PARTS_PER_SEGMENT} parts", "_HLS_part")
            if m > self._parts(job).segments + 2:  # the spec: more than two segments ahead is an error
                raise bad(f"'_HLS_msn' {m} is more than two segments past the live edge", "_HLS_msn")
            # waits at most three target durations for the part (the spec's bound), then answers
            await self._wait_part(job, i, 3 * PARTS_PER_SEGMENT * self._parts(job).target)
        p = self._parts(job)
        if not p.live:
            cache = "public, max-age=3600"
        elif blocking:  # the answer for that part is the same for every viewer who asks
            cache = f"public, max-age={math.ceil(6 * PARTS_PER_SEGMENT * p.target)}"
        else:
            cache = f"public, max-age={max(1, math.floor(p.target / 2))}"
        return web.Response(
            text=playlist(p), content_type="application/vnd.apple.mpegurl", headers={"Cache-Control": cache}
        )

    async def init(self, request: web.Request) -> web.Response:
        job = self._job(request)
        if not await _wait(job, lambda: bool(job.chunks), 10.0):
            raise APIError(404, f"video '{job.id}' has no init segment yet", "video_id", "not_ready")
        return _media(self._job(request).chunks[0], "video/mp4")

    async def part(self, request: web.Request) -> web.Response:
        job = self._job(request)
        n = _index(request.match_info["n"], "part")
        have = len(job.fragment_frames)
        if n > have:  # not hinted: a viewer asks only for listed parts and the one hint
            raise APIError(404, f"part {n} of video '{job.id}' is not made yet (the next is {have})", "part")
        if n == have and not await self._wait_part(job, n, 3 * self._parts(job).target + 5.0):
            if job.finished:
                raise APIError(410, f"video '{job.id}' ended with {have} parts", "part", "gone")
            raise APIError(404, f"part {n} of video '{job.id}' is not made yet", "part", "not_ready")
        return _media(self._job(request).fragment(n), "video/iso.segment")

    async def segment(self, request: web.Request) -> web.Response:
        job = self._job(request)
        k, p = _index(request.match_info["n"], "segment"), self._parts(job)
        if k >= p.segments:
            raise APIError(404, f"segment {k} of video '{job.id}' is not complete", "segment", "not_ready")
        return _media(b"".join(job.fragment(i) for i in p.segment(k)), "video/iso.segment")


async def _wait(job: Job, ready, seconds: float) -> bool:
    """Until `ready()` (True), or the video ends without it or `seconds` pass (False). The job
    is kept while a viewer waits on it."""
    deadline = time.monotonic() + seconds
    job.readers += 1
    try:
        while not ready():
            left = deadline - time.monotonic()
            if job.finished or job.expired or left <= 0:
                return False
            try:
                await asyncio.wait_for(job.changed(), left)
            except TimeoutError:
                return False
        return True
    finally:
        job.readers -= 1


def _index(raw: str, param: str) -> int:
    """A part's, segment's or playlist's number: ASCII digits only (str.isdigit takes '²' and
    '①', which int() then refuses), at most nine."""
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 9:
        raise bad(f"'{param}' must be a non-negative integer, got {raw!r}", param)
    return int(raw)


def _media(body: bytes, kind: str) -> web.Response:
    return web.Response(body=body, content_type=kind, headers={"Cache-Control": IMMUTABLE})
