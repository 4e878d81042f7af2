"""HTTP front end: the OpenAI-compatible Videos API, health, metrics, the player page
(supervisor process; aiohttp on the supervisor's own event loop).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from email.utils import formatdate
from pathlib import Path

from aiohttp import web

from ..config import Config
from ..supervisor.core import Supervisor
from .api import APIError, bad, parse_steer
from .control import apply_landing, start_job
from .jobs import Job, JobExpired, JobStore
from .keys import API_KEYS, CONFIG, JOBS, STORE, SUPERVISOR
from .realtime import realtime_video
from .store import VideoStore, node_of

log = logging.getLogger("streamdiff.http")

STATIC = Path(__file__).with_name("static")


def error_json(err: APIError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


@web.middleware
async def count_middleware(request: web.Request, handler):
    """streamdiff_http_requests_total by status class (a 5xx is always a bug or an outage)."""
    metrics = request.app[SUPERVISOR].metrics
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        if metrics is not None:
            metrics.requests.labels(f"{status // 100}xx").inc()


@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as err:
        return error_json(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        if exc.status == 413:
            message = f"request body too large (limit {request.app[CONFIG].server.max_body_bytes} bytes)"
        keep = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After", "WWW-Authenticate")}
        return error_json(APIError(exc.status, message, None, code, kind, keep))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return error_json(APIError(500, "internal server error", None, "internal_error", "server_error"))


@web.middleware
async def auth_middleware(request: web.Request, handler):
    keys = request.app[API_KEYS]
    open_paths = {"/health", "/livez", "/"} | (
        set() if request.app[CONFIG].server.metrics_require_auth else {"/metrics"}
    )
    if keys and request.path not in open_paths and not request.path.startswith("/static/"):
        header = request.headers.get("Authorization", "")
        token = header[7:].strip().encode() if header.lower().startswith("bearer ") else b""
        # Compare against every key in constant time (no early exit that leaks which matched).
        ok = False
        for key in keys:
            ok |= hmac.compare_digest(token, key)
        if not ok:
            raise APIError(
                401,
                "Incorrect API key provided",
                None,
                "invalid_api_key",
                "invalid_request_error",
                {"WWW-Authenticate": "Bearer"},
            )
    return await handler(request)


# ----------------------------------------------------------------------------- request bodies


async def read_request_data(request: web.Request) -> dict:
    ctype = request.content_type
    timeout = request.app[CONFIG].server.request_read_timeout_s
    try:
        async with asyncio.timeout(timeout):
            if ctype == "multipart/form-data":
                return await read_multipart(request)
            if ctype == "application/x-www-form-urlencoded":
                try:
                    form = await request.post()
                except (web.HTTPException, TimeoutError):
                    raise
                except Exception as exc:  # no boundary, broken parts, bad encoding
                    raise bad(f"malformed form body: {exc}", None, "invalid_body") from None
                data = {}
                for k, v in form.items():
                    if not isinstance(v, str):
                        raise bad(f"file uploads are not supported ('{k}')", k, "unsupported_parameter")
                    data[k] = v
                return data
            raw = await request.read()
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g}s", None, "request_timeout") from None
    if ctype not in ("application/json", "", "application/octet-stream", "text/plain"):
        raise APIError(
            415,
            f"unsupported content type {ctype!r}: send application/json or multipart/form-data",
            None,
            "unsupported_media_type",
        )
    limit = request.app[CONFIG].server.max_body_bytes
    if len(raw) > limit and b'"input_reference"' not in raw:  # only an image may take a body past the limit
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(raw))
    try:
        data = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad(f"We could not parse the JSON body of your request: {exc}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise bad("the request body must be a JSON object", None, "invalid_body")
    image = data.get("input_reference")
    if len(raw) - (len(image) if isinstance(image, str) else 0) > limit:  # the image has a limit of its own
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(raw))
    return data


def body_limit(cfg: Config) -> int:
    """The largest body aiohttp reads: server.max_body_bytes, plus room for an image as a base64
    data URL (limits.max_image_bytes, 4/3 larger); the JSON reader checks the rest is within
    server.max_body_bytes. Multipart bodies are read part by part (read_multipart)."""
    return cfg.server.max_body_bytes + -(-cfg.limits.max_image_bytes // 3) * 4 + 1024


async def read_multipart(request: web.Request) -> dict:
    """A multipart form, part by part: the fields together within server.max_body_bytes (else
    413), and one file, `input_reference`, within limits.max_image_bytes. An image over its limit
    is a 400 naming the limit; the rest of it is read and dropped (up to 8x the limit, beyond which
    413) so that the client, still sending, reads the answer rather than a reset connection."""
    cfg = request.app[CONFIG]
    limit, max_image = cfg.server.max_body_bytes, cfg.limits.max_image_bytes
    try:
        reader = await request.multipart()
        data, fields, too_big = {}, 0, None
        while (part := await reader.next()) is not None:
            name = part.name or ""
            if part.filename is None:
                value = bytearray()
                while chunk := await part.read_chunk(1 << 16):
                    fields += len(chunk)
                    if fields > limit:
                        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=fields)
                    value += chunk
                data[name] = bytes(value).decode(part.get_charset(default="utf-8"))
                continue
            if name != "input_reference":
                raise bad(f"file uploads are not supported ('{name}')", name, "unsupported_parameter")
            buf, n = bytearray(), 0
            while chunk := await part.read_chunk(1 << 16):
                n += len(chunk)
                if n > 8 * max_image:
                    raise web.HTTPRequestEntityTooLarge(max_size=8 * max_image, actual_size=n)
                if n <= max_image:
                    buf += chunk
            if n > max_image:
                too_big = n
            data[name] = bytes(buf)
    except (web.HTTPException, APIError):
        raise
    except Exception as exc:  # no boundary, broken parts, bad encoding
        raise bad(f"malformed form body: {exc}", None, "invalid_body") from None
    if too_big is not None:
        raise bad(
            f"'input_reference' is {too_big} bytes; the limit is {max_image} (limits.max_image_bytes)",
            "input_reference",
            "image_too_large",
        )
    return data


# ----------------------------------------------------------------------------- handlers


async def create_video(request: web.Request) -> web.StreamResponse:
    job = await start_job(request.app, await read_request_data(request))
    if not job.request.stream:
        return web.json_response(job.video_object(), headers={"openai-poll-after-ms": "1000"})
    return await stream_job(request, job, live=True)


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


def get_job(request: web.Request) -> Job:
    """The job this node holds for the path's id; otherwise APIError (see `_elsewhere`)."""
    job = request.app[JOBS].get(request.match_info["video_id"])
    if job is None:
        raise _elsewhere(request)
    return job


def _elsewhere(request: web.Request) -> APIError:
    """Why this node cannot answer for an id it does not hold: another node made it (421, so a
    client never gets another video's answer), or it does not exist here (404)."""
    vid, ours = request.match_info["video_id"], request.app[CONFIG].node
    node = node_of(vid)
    if node is not None and node != ours:
        return APIError(
            421,
            f"video '{vid}' was made by node '{node}', and this is node '{ours}': send its requests to "
            f"'{node}' (behind the balancer this means that node is not answering)",
            "video_id",
            "wrong_node",
        )
    return APIError(404, f"No video found with id '{vid}'", "video_id", "not_found")


def _stored(request: web.Request) -> dict | None:
    store = request.app[STORE]
    return store.video(request.match_info["video_id"]) if store is not None else None


async def retrieve_video(request: web.Request) -> web.Response:
    job = request.app[JOBS].get(request.match_info["video_id"])
    if job is not None:
        return web.json_response(job.video_object())
    stored = _stored(request)
    if stored is None:
        raise _elsewhere(request)
    return web.json_response(stored)


def _steerable(request: web.Request) -> Job:
    """The running job an id names (404 unknown, 421 another node's, 409 finished)."""
    job = request.app[JOBS].get(request.match_info["video_id"])
    if job is None:
        raise _elsewhere(request)
    if job.finished or job.handle is None:
        raise APIError(409, f"video '{job.id}' has {job.state}: it cannot be steered", "video_id", "video_finished")
    return job


async def steer_video(request: web.Request) -> web.Response:
    """POST /v1/videos/{id}/scenes: a new scene from the first block not yet started; the answer
    names the exact frame where it lands (the stream carries an emsg there)."""
    job = _steerable(request)
    scene = parse_steer(await read_request_data(request), request.app[CONFIG])
    landed = job.handle.steer(scene)
    apply_landing(job, landed)
    log.info("job %s: scene %d (%s) from frame %d", job.id, landed.scene, scene.transition, landed.start_frame)
    fps = job.request.fps
    return web.json_response(
        {"scene": landed.scene, "start_frame": landed.start_frame, "start_seconds": landed.start_frame / fps}
    )


async def stop_video(request: web.Request) -> web.Response:
    """POST /v1/videos/{id}/stop: end cleanly at the next block boundary (the stream's last
    fragment is sent and the job completes); DELETE still cancels at once."""
    job = _steerable(request)
    landed = job.handle.stop()
    apply_landing(job, landed)
    job.stopped = True
    log.info("job %s: stopping at frame %d", job.id, landed.start_frame)
    return web.json_response(job.video_object())


async def list_videos(request: web.Request) -> web.Response:
    q = request.query
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad("'order' must be 'asc' or 'desc'", "order")
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        raise bad("'limit' must be an integer", "limit") from None
    if not 1 <= limit <= 100:
        raise bad("'limit' must be between 1 and 100", "limit")
    after = q.get("after")
    if after is not None and request.app[JOBS].get(after) is None:
        raise bad(f"'after' names no video: {after!r}", "after")
    jobs, more = request.app[JOBS].page(after, limit, order)
    data = [j.video_object() for j in jobs]
    return web.json_response(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }
    )


async def delete_video(request: web.Request) -> web.Response:
    vid, store = request.match_info["video_id"], request.app[STORE]
    job = request.app[JOBS].get(vid)
    if job is None and (node_of(vid) != request.app[CONFIG].node or _stored(request) is None):
        raise _elsewhere(request)  # only the node that made a video deletes it
    if job is not None:
        if not job.finished:
            job.cancel("cancelled by DELETE")
        request.app[JOBS].remove(job.id)
    if store is not None:
        await asyncio.get_running_loop().run_in_executor(None, store.remove, vid)
    return web.json_response({"id": vid, "object": "video.deleted", "deleted": True})


def _byte_range(request: web.Request, size: int, etag: str, last_modified: str) -> tuple[int, int] | None:
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


async def video_content(request: web.Request) -> web.StreamResponse:
    variant = request.query.get("variant", "video")
    if variant != "video":
        raise bad(f"variant {variant!r} is not available; only 'video'", "variant")
    job = request.app[JOBS].get(request.match_info["video_id"])
    if job is None or job.expired:
        path = request.app[STORE].content(request.match_info["video_id"]) if request.app[STORE] else None
        if path is not None:  # a finished video from the store (any node's): ranges by aiohttp
            return web.FileResponse(path, headers={"Content-Type": "video/mp4", "Cache-Control": "no-cache"})
    if job is None:
        raise _elsewhere(request)
    if job.expired:
        raise APIError(404, f"the content of video '{job.id}' has expired", "video_id", "expired")
    if job.state in ("failed", "cancelled"):
        raise APIError(
            409,
            f"video '{job.id}' {job.state}: {job.error['message'] if job.error else ''}",
            "video_id",
            "video_failed",
        )
    if not job.finished:
        return await stream_job(request, job, live=False)
    size = job.nbytes
    etag = f'"{job.id}"'
    last_modified = formatdate(job.completed_at, usegmt=True)
    headers = {
        "Content-Type": "video/mp4",
        "Accept-Ranges": "bytes",
        "ETag": etag,
        "Last-Modified": last_modified,
        "Content-Disposition": f'inline; filename="{job.id}.mp4"',
    }
    try:
        rng = _byte_range(request, size, etag, last_modified)
    except web.HTTPRequestRangeNotSatisfiable as exc:
        return web.Response(status=416, headers={**headers, **exc.headers})
    if rng is None:
        return web.Response(body=job.read(0, size), headers=headers)
    start, stop = rng
    headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
    return web.Response(status=206, body=job.read(start, stop), headers=headers)


async def list_models(request: web.Request) -> web.Response:
    cfg, sup = request.app[CONFIG], request.app[SUPERVISOR]
    return web.json_response({"object": "list", "data": [_model_object(cfg, sup)]})


def _model_object(cfg: Config, sup: Supervisor) -> dict:
    f = sup.facts
    return {
        "id": cfg.model_name,
        "object": "model",
        "created": int(sup.started_at),
        "owned_by": "streamdiff",
        "preset": cfg.model.preset,
        "fps": f["fps"],
        "default_size": "x".join(map(str, f["default_size"])),
        "frames_per_block": f["frames_per_block"],
        "embedded_weights": f.get("embedded_weights", False),
        "image_to_video": f.get("i2v", False),  # takes input_reference
        "max_size": f"{cfg.limits.max_width}x{cfg.limits.max_height}",
        "decoder": cfg.model.decoder,  # the latent decoder serving: wan (the Wan 2.1 VAE) or taehv
        "loaded": f.get("loaded"),  # the checkpoint, weight set, LoRA and sampler settings the DiT runs
    }


async def retrieve_model(request: web.Request) -> web.Response:
    cfg, sup = request.app[CONFIG], request.app[SUPERVISOR]
    if request.match_info["model"] not in (cfg.model_name, cfg.model.preset):
        raise APIError(404, f"The model '{request.match_info['model']}' does not exist", "model", "model_not_found")
    return web.json_response(_model_object(cfg, sup))


async def health(request: web.Request) -> web.Response:
    ok, detail = request.app[SUPERVISOR].health()
    detail["jobs"] = len(request.app[JOBS].jobs)
    return web.json_response(
        {"status": "ok" if ok else "unavailable", **detail},
        status=200 if ok else 503,
        headers={} if ok else {"Retry-After": "5"},
    )


async def livez(request: web.Request) -> web.Response:
    """Liveness: the supervisor's own loops go round (what systemd's watchdog follows). Draining
    or degraded is alive: a liveness probe must not kill the streams that still play."""
    alive = request.app[SUPERVISOR].loops_alive()
    return web.json_response({"alive": alive}, status=200 if alive else 503)


async def metrics(request: web.Request) -> web.Response:
    from ..metrics import CONTENT_TYPE

    metrics = request.app[SUPERVISOR].metrics
    body = metrics.render() if metrics is not None else b""
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def admin_drain(request: web.Request) -> web.Response:
    """Stop taking new sessions here (the agent says "drain"); running streams finish. Needs a
    bearer key when keys are configured, else a request from this host."""
    if not request.app[API_KEYS] and request.remote not in ("127.0.0.1", "::1"):
        raise APIError(403, "POST /admin/drain without API keys is only taken from this host", None, "forbidden")
    sup = request.app[SUPERVISOR]
    sup.begin_drain()
    log.info("drain requested by %s", request.remote)
    return web.json_response(
        {"state": sup.state, "node": request.app[CONFIG].node, "running": sup.running_sessions}, status=202
    )


async def add_node_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["X-Streamdiff-Node"] = request.app[CONFIG].node


async def index(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


def make_app(sup: Supervisor, cfg: Config, api_keys: list[bytes]) -> web.Application:
    app = web.Application(
        middlewares=[count_middleware, errors_middleware, auth_middleware], client_max_size=body_limit(cfg)
    )
    app[SUPERVISOR], app[CONFIG], app[API_KEYS] = sup, cfg, api_keys
    lim = cfg.limits
    app[STORE] = VideoStore(cfg.store.dir) if cfg.store.dir else None
    app[JOBS] = JobStore(
        lim.max_jobs, lim.keep_completed_bytes, lim.keep_completed_s, lim.keep_completed_min_s, app[STORE]
    )
    app.on_response_prepare.append(add_node_header)
    if sup.metrics is not None:
        sup.metrics.watch(sup, app[JOBS])

    async def prune_jobs(app: web.Application):
        async def loop():
            while True:
                await asyncio.sleep(5)
                app[JOBS].prune()

        task = asyncio.create_task(loop())
        yield
        task.cancel()

    app.cleanup_ctx.append(prune_jobs)
    r = app.router
    for prefix in ("/v1", ""):
        r.add_post(f"{prefix}/videos", create_video)
        r.add_get(f"{prefix}/videos", list_videos)
        r.add_get(f"{prefix}/videos/{{video_id}}", retrieve_video)
        r.add_delete(f"{prefix}/videos/{{video_id}}", delete_video)
        r.add_get(f"{prefix}/videos/{{video_id}}/content", video_content)
        r.add_post(f"{prefix}/videos/{{video_id}}/scenes", steer_video)
        r.add_post(f"{prefix}/videos/{{video_id}}/stop", stop_video)
        r.add_get(f"{prefix}/realtime/video", realtime_video)
        r.add_get(f"{prefix}/models", list_models)
        r.add_get(f"{prefix}/models/{{model}}", retrieve_model)
    r.add_post("/admin/drain", admin_drain)
    r.add_get("/health", health)
    r.add_get("/livez", livez)
    r.add_get("/metrics", metrics)
    r.add_get("/", index)
    if STATIC.is_dir():
        r.add_static("/static/", STATIC)
    return app
