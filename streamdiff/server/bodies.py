"""Request bodies: JSON, URL-encoded and multipart forms, read within their time and size limits
(server.request_read_timeout_s, server.max_body_bytes, limits.max_image_bytes)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from ..config import Config
from .api import APIError, bad, client_json
from .jsonin import JSONLimits
from .keys import CONFIG

# Work on a client's input that grows past this many bytes runs on a thread, not on the event
# loop every stream's writes and the workers' replies share (a 256 KB body's JSON: about 3 ms).
OFF_LOOP_BYTES = 64 * 1024


async def off_loop(heavy: bool, fn, *args):
    """fn(*args): on the default executor where the work is `heavy` (it grows with a client's
    input past what the loop may spend on it), else here."""
    if not heavy:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


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
    cfg = request.app[CONFIG]
    limit = cfg.server.max_body_bytes
    if len(raw) > limit and b'"input_reference"' not in raw:  # only an image may take a body past the limit
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(raw))
    data = await off_loop(len(raw) > OFF_LOOP_BYTES, client_json, raw, JSONLimits.of(cfg.server, body_limit(cfg)))
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
