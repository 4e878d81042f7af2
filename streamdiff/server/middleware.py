"""The HTTP front end's middleware: requests counted by status class, errors answered as the
API's JSON errors, and bearer keys checked (supervisor process)."""

from __future__ import annotations

import asyncio
import hmac
import logging

from aiohttp import web

from .api import APIError
from .keys import API_KEYS, CONFIG, SUPERVISOR

log = logging.getLogger("streamdiff.http")


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
