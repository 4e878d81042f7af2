"""Starting and steering jobs, the same for POST /v1/videos and the realtime WebSocket
(supervisor process). Every refusal is an APIError: the HTTP layer answers it in OpenAI's error
envelope, the WebSocket as an `error` event."""

from __future__ import annotations

import logging
import math

from aiohttp import web

from ..card import ModelCard
from ..supervisor.core import RUNNING
from ..supervisor.handle import QueueFull
from .api import APIError, parse_control, parse_video_request
from .bodies import off_loop
from .jobs import Job
from .keys import CONFIG, JOBS, SUPERVISOR
from .push import start_pushes

log = logging.getLogger("streamdiff.http")
SCRIPT_ON_LOOP = 64  # a control script of more entries is checked on a thread (64: about 0.6 ms)


def supervisor_ready(app: web.Application) -> None:
    sup = app[SUPERVISOR]
    if sup.state != RUNNING:
        raise APIError(
            503,
            "the server is shutting down" if sup.state != "starting" else "the server is starting",
            None,
            "unavailable",
            "server_error",
            {"Retry-After": "5"},
        )


async def start_job(app: web.Application, data: dict) -> Job:
    """Validate a request body, hand it to the engine, keep its job: the job, or APIError (400,
    404 unknown model, 429 with Retry-After, 503).

    A body with an image or controls is validated on a thread: decoding, cropping and
    re-encoding a large image takes hundreds of milliseconds, and checking a control script
    tens, which on the event loop would stall every stream's writes and the workers' replies.
    Validation is pure (the config and the model's card), so it may run there."""
    sup, cfg, jobs = app[SUPERVISOR], app[CONFIG], app[JOBS]
    supervisor_ready(app)
    heavy = data.get("input_reference") not in (None, "") or bool(data.get("controls"))
    req = await off_loop(heavy, parse_video_request, data, cfg, sup.card)
    supervisor_ready(app)  # it may have begun draining meanwhile
    job = Job(req, live_consumer=req.stream, node=cfg.node)
    try:
        job.follow_session(sup.submit(req, job.id))
    except QueueFull as exc:
        raise APIError(
            429,
            f"the server is busy ({exc}); retry later",
            None,
            "rate_limit_exceeded",
            "rate_limit_error",
            {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))},
        ) from None
    jobs.add(job)
    job.pushes = start_pushes(job, cfg.outputs.destinations, cfg.outputs.retry_max_s)
    log.info(
        "job %s: %d frames %dx%d@%d, %d scene(s), stream=%s%s",
        job.id,
        req.frames,
        req.width,
        req.height,
        req.fps,
        len(req.scenes),
        req.stream,
        ", live" if req.live else "",
    )
    return job


def apply_landing(job: Job, landed) -> None:
    """A steer's or stop's answer from the engine: the job's scenes follow it, or APIError."""
    if landed.refused is not None:
        status, message = landed.refused
        if status == 429:
            raise APIError(429, message, None, "too_many_pending_scenes", "rate_limit_error")
        raise APIError(status, message, None, "video_finished")
    job.set_scenes(landed.scenes)


async def control_job(job: Job, body, card: ModelCard) -> dict:
    """A world model's control applied to the job: where it lands ({seq, block, start_frame,
    start_seconds}), or APIError (400 bad, 409 finished or out of order, 429 too many waiting).
    A script is checked on a thread (tens of milliseconds at its longest)."""
    script = body.get("script") if isinstance(body, dict) else None
    c = await off_loop(isinstance(script, list) and len(script) > SCRIPT_ON_LOOP, parse_control, body, card)
    if job.finished or job.handle is None:
        raise APIError(409, f"video '{job.id}' has {job.state}: it takes no controls", None, "video_finished")
    landed = job.handle.control(c)
    if landed.refused is not None:
        status, param, code, message = landed.refused
        raise APIError(status, message, param, code, "rate_limit_error" if status == 429 else "invalid_request_error")
    return {
        "seq": c.seq,
        "block": landed.block,
        "start_frame": landed.start_frame,
        "start_seconds": landed.start_frame / job.request.fps,
    }
