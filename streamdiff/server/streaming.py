"""A video's bytes to a client: a running job's, written as they come (`stream_job`), and the
byte range a request for a finished one asks for (`byte_range`)."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from .api import APIError
from .jobs import Job, JobExpired
from .keys import CONFIG

log = logging.getLogger("streamdiff.http")


def _start_failure(job: Job) -> APIError:
    """The JSON error for a streaming job that ended before its first fragment."""
    err = job.error or {"code": "generation_failed", "message": job.state}
    if err["code"] == "invalid_request":
        return APIError(400, err["message"], None, "invalid_request")
    if err["code"] == "cancelled":
        return APIError(503, err["message"], None, "cancelled", "server_error", {"Retry-After": "5"})
    return APIError(500, f"the video could not start: {err['message']}", None, err["code"], "server_error")


async def stream_job(request: web.Request, job: Job, live: bool, start_chunk: int = 0) -> web.StreamResponse:
    """Write the job's bytes as they come. `live`: this response is the job's consumer (acks
    each fragment: backpressure) and its disconnect cancels the job.

    The status line waits for the first fragment: a session that fails before it (a request
    its workers refuse, an encoder that cannot open) answers a JSON error, not a 200 followed
    by a cut. The init segment alone would not play anyway."""
    resp = web.StreamResponse(
        headers={
            "Content-Type": "video/mp4",
            "Cache-Control": "no-store",
            "X-Video-Id": job.id,
            "X-Content-Type-Options": "nosniff",
        }
    )
    resp.enable_chunked_encoding()
    timeout = request.app[CONFIG].server.client_write_timeout_s
    held: list[bytes] = []  # chunks before the first fragment
    complete = False
    try:
        async for chunk, is_fragment in job.follow(start_chunk):
            if not resp.prepared:
                held.append(chunk)
                if not is_fragment:
                    continue
                await resp.prepare(request)
                chunk, held = b"".join(held), []
            try:
                async with asyncio.timeout(timeout):
                    await resp.write(chunk)
            except TimeoutError:
                log.warning("job %s: client accepted no bytes for %.0fs; dropping it", job.id, timeout)
                raise ConnectionResetError("client too slow") from None
            if live and is_fragment:
                job.ack()
        complete = job.state == "done"
    except (ConnectionResetError, asyncio.CancelledError):
        if live and not job.finished:
            job.cancel("client disconnected")
        raise
    except JobExpired:
        log.warning("job %s expired under a reader: ending its transfer truncated", job.id)
    if not resp.prepared:
        if complete:  # a video without fragments cannot be asked for; be exact anyway
            await resp.prepare(request)
            await resp.write(b"".join(held))
        else:
            raise _start_failure(job)
    if not complete:
        # A failed or cancelled stream must not look like a finished short clip: end the
        # connection without the terminating chunk, so clients see a truncated transfer.
        if request.transport is not None:
            request.transport.close()
        return resp
    await resp.write_eof()
    return resp


def byte_range(request: web.Request, size: int, etag: str, last_modified: str) -> tuple[int, int] | None:
    """The one byte range to send, per RFC 9110 section 14: (start, stop), or None for the whole
    representation. A malformed or multi-range Range header is ignored (200), and so is one
    whose If-Range names another version; an unsatisfiable single range raises 416.
    aiohttp's `http_range` parses the header (its slice is start/stop with a negative start for
    a suffix range)."""
    header = request.headers.get("Range")
    if header is None:
        return None
    if_range = request.headers.get("If-Range")
    if if_range is not None and if_range.strip() not in (etag, last_modified):
        return None  # a weak or stale validator: the client wants the whole new representation
    try:
        rng = request.http_range
    except ValueError:
        return None
    start, stop = rng.start, rng.stop
    if start is not None and start < 0:  # suffix range: the last -start bytes
        start = max(0, size + start)
    elif start is None or header.strip().lower().endswith("=-0"):
        start = size  # "bytes=-0": an empty suffix is unsatisfiable
    if start >= size:
        raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"})
    return start, min(size, stop) if stop is not None else size
