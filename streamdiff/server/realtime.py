"""`GET /v1/realtime/video`: a live video over a WebSocket, steered while it plays (supervisor
process; aiohttp's own WebSocket support).

The events are vLLM-Omni's realtime video protocol, so a client written for it needs no change:

    client  {"type": "session.start", ...}        the body of POST /v1/videos (without a length
                                                  it is live: it runs until stopped or its cap)
            {"type": "session.prompt_update", "prompt": ..., "transition"?: "continue"|"cut",
             "seed"?: ...}                        steer: a new scene from the next block
            {"type": "session.interaction", "interaction": {"event_id"?, "event": {"prompt"}}}
                                                  the same, in vLLM-Omni's newer form
            {"type": "session.control", "seq", ...}  a world model's control (controls.py)
            {"type": "session.stop"}              end cleanly at the next block boundary
            {"type": "session.ping"}
    server  {"type": "video.start", "request_id", "format": "m4s", "config": {...}}
            binary messages: the init segment, then one fMP4 fragment (with its emsg) each
            {"type": "session.prompt_updated" | "session.interaction.queued", "request_id",
             "scene", "start_frame", "start_seconds"[, "event_id"]}   where a steer lands
            {"type": "session.control.ack", "request_id", "seq", "block", "start_frame",
             "start_seconds"}                     where a control lands
            {"type": "session.done", "request_id", "chunks", "stopped"}
            {"type": "session.pong"}
            {"type": "error", "message", "code"}

A bad message gets an `error` event and the session goes on; a session that cannot start or
fails gets `error` and the socket closes. Closing the socket cancels the video.
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import WSMsgType, web

from ..card import ModelCard
from .api import APIError, bad, client_json, parse_steer
from .jobs import Job, JobExpired
from .jsonin import JSONLimits
from .keys import CONFIG, SUPERVISOR
from .steer import apply_landing, control_job, start_job

log = logging.getLogger("streamdiff.realtime")

START_TIMEOUT_S = 30.0  # the first message must be session.start within this
IGNORED = ("type", "format", "extra_params")  # vLLM-Omni fields with nothing to say here


class _Socket:
    """One WebSocket's sends, one at a time (the fragment sender and the control replies share it)."""

    def __init__(self, ws: web.WebSocketResponse) -> None:
        self.ws = ws
        self._lock = asyncio.Lock()

    async def json(self, event: dict) -> None:
        async with self._lock:
            if not self.ws.closed:
                await self.ws.send_str(json.dumps(event))

    async def bytes(self, data: bytes) -> None:
        async with self._lock:
            await self.ws.send_bytes(data)

    async def error(self, err: APIError) -> None:
        await self.json({"type": "error", "message": err.message, "code": err.code, "param": err.param})


async def realtime_video(request: web.Request) -> web.WebSocketResponse:
    # A message past the JSON limit (server.max_body_bytes) gets an `error` event and the session
    # goes on; one past four times it is not read at all: aiohttp closes the socket (1009).
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=4 * request.app[CONFIG].server.max_body_bytes)
    await ws.prepare(request)
    sock = _Socket(ws)
    job: Job | None = None
    try:
        job = await _start(request, ws, sock)
        if job is None:
            return ws
        sender = asyncio.create_task(_send_video(sock, job))
        receiver = asyncio.create_task(_controls(request, ws, sock, job))
        done, _ = await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_COMPLETED)
        if receiver in done:  # the client went away: its video goes too
            if not job.finished:
                job.cancel("websocket closed")
            sender.cancel()
        else:
            receiver.cancel()
        await asyncio.gather(sender, receiver, return_exceptions=True)
    finally:
        if job is not None and not job.finished:
            job.cancel("websocket closed")
        await ws.close()
    return ws


async def _start(request: web.Request, ws: web.WebSocketResponse, sock: _Socket) -> Job | None:
    try:
        msg = await ws.receive(timeout=START_TIMEOUT_S)
    except TimeoutError:
        await sock.error(bad(f"no session.start within {START_TIMEOUT_S:g}s", "type", "start_timeout"))
        return None
    if msg.type != WSMsgType.TEXT:
        if msg.type == WSMsgType.BINARY:
            await sock.error(bad("the first message must be session.start, a JSON object", "type", "invalid_body"))
        return None
    try:
        event = client_event(msg.data, request.app[CONFIG].server)
        if event.get("type") != "session.start":
            raise bad(f"the first message must be session.start, not {event.get('type')!r}", "type")
        if event.get("format", "m4s") != "m4s":
            raise bad(f"'format' must be 'm4s' (fragmented MP4), got {event['format']!r}", "format")
        body = {k: v for k, v in event.items() if k not in IGNORED}
        live = body.get("seconds") is None and body.get("num_frames") is None and body.get("live") is None
        job = await start_job(request.app, {**body, "stream": True, **({"live": True} if live else {})})
    except APIError as err:
        await sock.error(err)
        return None
    r = job.request
    config = {"width": r.width, "height": r.height, "fps": r.fps, "num_frames": r.frames, "live": r.live}
    await sock.json({"type": "video.start", "request_id": job.id, "format": "m4s", "config": config})
    return job


def client_event(text: str, server) -> dict:
    """A client's message on a socket (the WebSocket, a WHEP data channel): a JSON object within
    `[server]`'s JSON limits, or APIError."""
    event = client_json(text, JSONLimits.of(server), "a message")
    if not isinstance(event, dict):
        raise bad("a message must be a JSON object", None, "invalid_body")
    return event


async def _send_video(sock: _Socket, job: Job) -> None:
    """The init segment and each fragment as one binary message, then session.done (or error)."""
    sent = 0
    try:
        async for chunk, is_fragment in job.follow():
            await sock.bytes(chunk)
            if is_fragment:
                sent += 1
                job.ack()  # this socket is the video's consumer: a slow client slows only its own
    except JobExpired:
        pass
    except ConnectionResetError:
        if not job.finished:
            job.cancel("websocket closed")
        return
    if job.state == "done":
        await sock.json({"type": "session.done", "request_id": job.id, "chunks": sent, "stopped": job.stopped})
    else:
        err = job.error or {"code": "generation_failed", "message": job.state}
        await sock.json({"type": "error", "message": err["message"], "code": err["code"], "param": None})


async def _controls(request: web.Request, ws: web.WebSocketResponse, sock: _Socket, job: Job) -> None:
    """The client's messages until it closes the socket."""
    cfg = request.app[CONFIG]
    async for msg in ws:
        if msg.type != WSMsgType.TEXT:
            if msg.type == WSMsgType.BINARY:
                await sock.error(bad("binary messages are not accepted here", None, "invalid_body"))
            continue
        try:
            event = client_event(msg.data, cfg.server)
            kind = event.get("type")
            if kind == "session.ping":
                await sock.json({"type": "session.pong"})
            elif kind == "session.stop":
                if not job.finished:
                    apply_landing(job, job.handle.stop())
                    job.stopped = True
            elif kind in STEERING:
                await sock.json(await steer_event(job, kind, event, cfg, request.app[SUPERVISOR].card))
            else:
                raise bad(f"unknown event type {kind!r}", "type", "unknown_event")
        except APIError as err:
            await sock.error(err)


STEERING = ("session.prompt_update", "session.interaction", "session.control")


async def steer_event(job: Job, kind: str, event: dict, cfg, card: ModelCard) -> dict:
    """A steering event (a WebSocket's, a WHEP data channel's: one of STEERING) applied to the
    job: the reply that names where it lands, or APIError."""
    if kind == "session.control":
        landed = await control_job(job, {k: v for k, v in event.items() if k != "type"}, card)
        return {"type": "session.control.ack", "request_id": job.id, **landed}
    if kind == "session.interaction":
        inter = event.get("interaction")
        if not isinstance(inter, dict) or not isinstance(inter.get("event"), dict):
            raise bad("'interaction.event' must be an object", "interaction")
        body, event_id = {"prompt": inter["event"].get("prompt")}, inter.get("event_id")
    else:
        body, event_id = {k: v for k, v in event.items() if k != "type"}, None
    scene = parse_steer(body, cfg, card)
    if job.finished:
        raise APIError(409, f"video '{job.id}' has {job.state}: it cannot be steered", None, "video_finished")
    landed = job.handle.steer(scene)
    apply_landing(job, landed)
    reply = {
        "type": "session.prompt_updated" if kind == "session.prompt_update" else "session.interaction.queued",
        "request_id": job.id,
        "scene": landed.scene,
        "start_frame": landed.start_frame,
        "start_seconds": landed.start_frame / job.request.fps,
    }
    if event_id is not None:
        reply["event_id"] = event_id
    return reply
