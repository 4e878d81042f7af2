"""HTTP front end: the OpenAI-compatible Videos API, health, metrics, the player page
(supervisor process; aiohttp on the supervisor's own event loop): the routes and their
handlers. Beside it: middleware.py (counts, errors, keys), bodies.py (reading a request's body),
streaming.py (writing a video's bytes), control.py (starting jobs), realtime.py (the WebSocket),
hls.py (LL-HLS for many viewers of one video).
"""

from __future__ import annotations

import asyncio
import logging
from email.utils import formatdate
from pathlib import Path

import msgspec
from aiohttp import web

from ..config import Config
from ..controls import SPACES
from ..supervisor.core import Supervisor
from .api import APIError, bad, parse_steer
from .bodies import body_limit, read_request_data
from .hls import HLS
from .jobs import Job, JobStore
from .keys import API_KEYS, CONFIG, JOBS, STORE, SUPERVISOR
from .middleware import auth_middleware, count_middleware, errors_middleware
from .realtime import realtime_video, steer_event
from .steer import apply_landing, control_job, start_job
from .store import VideoStore, node_of
from .streaming import byte_range, stream_job
from .whep import WHEP

log = logging.getLogger("streamdiff.http")

STATIC = Path(__file__).with_name("static")


async def create_video(request: web.Request) -> web.StreamResponse:
    job = await start_job(request.app, await read_request_data(request))
    if not job.request.stream:
        return web.json_response(job.video_object(), headers={"openai-poll-after-ms": "1000"})
    return await stream_job(request, job, live=True)


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
    scene = parse_steer(await read_request_data(request), request.app[CONFIG], request.app[SUPERVISOR].card)
    landed = job.handle.steer(scene)
    apply_landing(job, landed)
    log.info("job %s: scene %d (%s) from frame %d", job.id, landed.scene, scene.transition, landed.start_frame)
    fps = job.request.fps
    return web.json_response(
        {"scene": landed.scene, "start_frame": landed.start_frame, "start_seconds": landed.start_frame / fps}
    )


async def control_video(request: web.Request) -> web.Response:
    """POST /v1/videos/{id}/controls: a world model's control (controls.py) from the first block
    not yet started; the answer names that block and its first frame (each fragment's emsg carries
    the newest control that shaped it)."""
    job = _steerable(request)
    landed = await control_job(job, await read_request_data(request), request.app[SUPERVISOR].card)
    return web.json_response(landed)


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
    raw = q.get("limit", "20")
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 3:
        raise bad(f"'limit' must be an integer between 1 and 100, got {raw!r}", "limit")
    limit = int(raw)
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
        rng = byte_range(request, size, etag, last_modified)
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
    card = sup.card
    return {
        "id": cfg.model_name,
        "object": "model",
        "created": int(sup.started_at),
        "owned_by": "streamdiff",
        "preset": cfg.model.preset,
        "fps": card.fps,
        "default_size": "x".join(map(str, card.default_size)),
        "frames_per_block": card.frames_per_block,
        "embedded_weights": card.embedded,
        "image_to_video": card.i2v,  # takes input_reference
        "max_size": f"{cfg.limits.max_width}x{cfg.limits.max_height}",
        "decoder": cfg.model.decoder,  # the latent decoder serving: wan (the Wan 2.1 VAE) or taehv
        "loaded": sup.loaded,  # the checkpoint, weight set, LoRA and sampler settings the DiT runs
        "controls": _controls_object(card.controls),  # a world model's control space (controls.py)
        # the whole description the server plans and checks requests by (card.py): what the model
        # takes (text, image, controls), what a cut keeps, whether it re-caches or splits its DiT
        "card": msgspec.to_builtins(card),
    }


def _controls_object(name: str | None) -> dict | None:
    space = SPACES.get(name)
    if space is None:
        return None
    return {
        "space": space.name,
        "keys": list(space.keys),
        "mouse": space.mouse,
        "mouse_max": space.mouse_max,  # |pitch| and |yaw| a latent frame, in the model's units
        "camera": space.camera,
        "idle": space.idle,  # the key held when none is
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
    hls = HLS(get_job, lambda: sup.card.block_frames)

    async def steer(job: Job, event: dict) -> dict:
        return await steer_event(job, event["type"], event, cfg, sup.card)

    whep = WHEP(get_job, steer, cfg.server)

    async def close_whep(app: web.Application):
        yield
        await whep.close_all()

    app.cleanup_ctx.append(close_whep)
    for prefix in ("/v1", ""):
        r.add_routes(hls.routes(prefix))
        r.add_routes(whep.routes(prefix))
        r.add_post(f"{prefix}/videos", create_video)
        r.add_get(f"{prefix}/videos", list_videos)
        r.add_get(f"{prefix}/videos/{{video_id}}", retrieve_video)
        r.add_delete(f"{prefix}/videos/{{video_id}}", delete_video)
        r.add_get(f"{prefix}/videos/{{video_id}}/content", video_content)
        r.add_post(f"{prefix}/videos/{{video_id}}/scenes", steer_video)
        r.add_post(f"{prefix}/videos/{{video_id}}/stop", stop_video)
        r.add_post(f"{prefix}/videos/{{video_id}}/controls", control_video)
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
