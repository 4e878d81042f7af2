"""Request validation and OpenAI-shaped errors for the Videos API (supervisor process).

A request is either JSON or multipart/form-data (what the official `openai` SDK sends for
`videos.create`); form values arrive as strings and are coerced here. Unknown fields are
rejected the way OpenAI does ("Unrecognized request argument supplied"), so a typo never
silently falls back to a default.
"""

from __future__ import annotations

import base64
import binascii
import io
import random
import re
from dataclasses import dataclass, replace

from ..card import ModelCard
from ..config import Config, LimitsConfig, parse_size
from ..controls import MAX_PENDING, SPACES, Control, ControlError
from ..controls import parse_control as _parse_control
from ..plan import Scene
from .jsonin import JSONLimits, JSONRefused, read_json

KNOWN_FIELDS = {
    "prompt",
    "model",
    "seconds",
    "num_frames",
    "size",
    "width",
    "height",
    "fps",
    "seed",
    "stream",
    "live",
    "scenes",
    "input_reference",
    "outputs",
    "controls",
    "negative_prompt",
    "num_inference_steps",
    "user",
}
SCENE_FIELDS = {"prompt", "seconds", "num_frames", "transition", "seed", "recache"}
STEER_FIELDS = {"prompt", "transition", "seed", "recache"}
MAX_SEED = 2**63 - 1


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def client_json(data: bytes | str, lim: JSONLimits, what: str = "the request body", param: str | None = None):
    """A client's JSON (jsonin.read_json), its refusal as a 400 naming the limit."""
    try:
        return read_json(data, lim, what)
    except JSONRefused as err:
        raise bad(err.message, param, err.code) from None


@dataclass(frozen=True)
class VideoRequest:
    model: str
    scenes: list[Scene]
    width: int
    height: int
    fps: int
    seed: int
    stream: bool
    live: bool = False  # open-ended: its length is a cap; steered and stopped while it plays
    input_reference: dict | None = None  # image-to-video: the input image as received (prepare_image)
    outputs: tuple[str, ...] = ()  # the configured ingests ([outputs] destinations) it is pushed to
    controls: tuple[Control, ...] = ()  # a world model's controls from the start, each at its block

    @property
    def frames(self) -> int:
        return sum(s.frames for s in self.scenes)

    @property
    def prompt(self) -> str:
        return self.scenes[0].prompt if len(self.scenes) == 1 else " | ".join(s.prompt for s in self.scenes)


def _number(value, param: str) -> float:
    if isinstance(value, bool):
        raise bad(f"'{param}' must be a number", param)
    if isinstance(value, int | float):
        v = float(value)
    elif isinstance(value, str):
        try:
            v = float(value.strip())
        except ValueError:
            raise bad(f"'{param}' must be a number, got {value!r}", param) from None
    else:
        raise bad(f"'{param}' must be a number", param)
    if v != v or v in (float("inf"), float("-inf")):
        raise bad(f"'{param}' must be finite", param)
    return v


def _integer(value, param: str, lo: int, hi: int) -> int:
    """An exact integer: a JSON integer, a float with an integral value below 2**53 (where a
    float still names one integer), or a decimal string (form fields). Never through float,
    so 2**63-1 stays 2**63-1 and 2**53+1 differs from 2**53+2."""
    if isinstance(value, bool):
        raise bad(f"'{param}' must be an integer", param)
    if isinstance(value, int):
        v = value
    elif isinstance(value, float):
        if value != value or not value.is_integer() or abs(value) > 2**53:
            raise bad(f"'{param}' must be an integer, got {value!r}", param)
        v = int(value)
    elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?[0-9]{1,20}\s*", value, re.ASCII):
        v = int(value)
    else:
        raise bad(f"'{param}' must be an integer, got {value!r}", param)
    if not lo <= v <= hi:
        raise bad(f"'{param}' must be between {lo} and {hi}, got {v}", param)
    return v


def _bool(value, param: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise bad(f"'{param}' must be true or false, got {value!r}", param)


def _prompt(value, param: str, max_chars: int) -> str:
    if not isinstance(value, str):
        raise bad(f"'{param}' must be a string", param)
    if not value.strip():
        raise bad(f"'{param}' must not be empty", param, "empty_prompt")
    if len(value) > max_chars:
        raise bad(f"'{param}' is {len(value)} characters; the limit is {max_chars}", param, "prompt_too_long")
    return value


def _length(obj: dict, fps: int, param: str, max_frames: int) -> int | None:
    """Frames from `num_frames` or `seconds` (both may be given if they agree)."""
    frames = None
    if obj.get("num_frames") is not None:
        frames = _integer(obj["num_frames"], f"{param}num_frames", 1, max_frames)
    if obj.get("seconds") is not None:
        secs = _number(obj["seconds"], f"{param}seconds")
        if secs <= 0:
            raise bad(f"'{param}seconds' must be positive, got {obj['seconds']!r}", f"{param}seconds")
        if secs * fps > max_frames:
            raise bad(
                f"'{param}seconds' ({secs:g}) at {fps} fps is more than {max_frames} frames",
                f"{param}seconds",
                "too_long",
            )
        from_secs = max(1, round(secs * fps))
        if frames is not None and frames != from_secs:
            raise bad(
                f"'{param}num_frames' ({frames}) and '{param}seconds' ({secs:g} s = {from_secs} frames at "
                f"{fps} fps) disagree",
                f"{param}num_frames",
            )
        frames = from_secs
    return frames


def parse_video_request(data, cfg: Config, card: ModelCard) -> VideoRequest:
    """Validate a POST /v1/videos body (already decoded to a dict) against the model's card."""
    if not isinstance(data, dict):
        raise bad("the request body must be a JSON object", None, "invalid_body")
    unknown = sorted(set(data) - KNOWN_FIELDS)
    if unknown:
        raise bad(f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0], "unknown_parameter")
    lim = cfg.limits
    for param, why in (
        ("negative_prompt", "the distilled causal models sample without classifier-free guidance"),
        ("num_inference_steps", "the step list is fixed by the model (see [sampler] steps)"),
    ):
        if data.get(param) not in (None, ""):
            raise bad(f"'{param}' is not supported: {why}", param, "unsupported_parameter")

    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    served = {cfg.model_name, cfg.model.preset, card.name}
    if model is not None and model not in served:
        raise APIError(
            404,
            f"The model '{model}' does not exist; this server serves '{cfg.model_name}'",
            "model",
            "model_not_found",
        )

    fps = _integer(data["fps"], "fps", lim.min_fps, lim.max_fps) if data.get("fps") is not None else card.fps
    width, height = card.default_size
    if data.get("size") is not None:
        size = data["size"]
        parsed = parse_size(size)
        if parsed is None:
            raise bad(f"'size' must look like '{width}x{height}', got {size!r}", "size")
        width, height = parsed
    if data.get("width") is not None or data.get("height") is not None:
        if data.get("size") is not None:
            raise bad("give either 'size' or 'width' and 'height', not both", "size")
        width = _integer(data.get("width", width), "width", 1, 1 << 16)
        height = _integer(data.get("height", height), "height", 1, 1 << 16)
    mult = card.size_multiple
    if not (lim.min_size <= width <= lim.max_width and lim.min_size <= height <= lim.max_height):
        raise bad(
            f"size {width}x{height} is outside {lim.min_size}x{lim.min_size} .. {lim.max_width}x{lim.max_height}",
            "size",
            "unsupported_size",
        )
    if width % mult or height % mult:
        raise bad(f"width and height must be multiples of {mult}, got {width}x{height}", "size", "unsupported_size")

    seed = _integer(data["seed"], "seed", 0, MAX_SEED) if data.get("seed") is not None else random.randrange(2**31)
    stream = _bool(data["stream"], "stream") if data.get("stream") is not None else False
    live = _bool(data["live"], "live") if data.get("live") is not None else False

    max_frames = round(lim.live_max_s * fps) if live else lim.max_frames
    total = _length(data, fps, "", max_frames)
    if live and total is None:
        total = round(lim.live_default_s * fps)  # a live video's length is its cap
    scenes_raw = data.get("scenes")
    if isinstance(scenes_raw, str):  # multipart forms carry it as JSON text
        scenes_raw = client_json(scenes_raw, JSONLimits.of(cfg.server), "'scenes'", "scenes")
    if scenes_raw is None:
        prompt = _prompt(data.get("prompt"), "prompt", lim.max_prompt_chars) if "prompt" in data else None
        if prompt is None:
            raise bad("Missing required parameter: 'prompt' (or 'scenes')", "prompt", "missing_required_parameter")
        scenes = [Scene(prompt, total or round(4 * fps), "cut", None)]
    else:
        if data.get("prompt") not in (None, ""):
            raise bad("give either 'prompt' or 'scenes', not both", "prompt")
        scenes = _parse_scenes(scenes_raw, total, fps, cfg, card)
    if not card.text and len(scenes) > 1:
        raise bad("this model takes no prompt (an image and controls drive it): one scene only", "scenes")
    frames = sum(s.frames for s in scenes)
    if frames > max_frames:
        raise bad(f"the request asks for {frames} frames; the limit is {max_frames}", "scenes", "too_long")
    reference = None
    if data.get("input_reference") not in (None, ""):
        if not card.i2v:
            raise bad(
                f"'input_reference' is not supported: model '{card.name}' does not "
                "condition on an image (image-to-video needs a preset that does, e.g. causal-forcing-framewise)",
                "input_reference",
                "unsupported_parameter",
            )
        png, reference = prepare_image(image_bytes(data["input_reference"], lim), width, height, lim)
        # the first scene's shot starts from it (Matrix-Game: every block of it is conditioned on it)
        scenes[0] = replace(scenes[0], image=png, image_block=card.image_block)
    elif not card.text:
        raise bad(
            f"model '{card.name}' starts every video from an image: 'input_reference' is required",
            "input_reference",
            "missing_required_parameter",
        )
    outputs = _outputs(data.get("outputs"), cfg)
    controls = _start_controls(data.get("controls"), card, cfg)
    return VideoRequest(
        model or cfg.model_name, scenes, width, height, fps, seed, stream, live, reference, outputs, controls
    )


def parse_control(body, card: ModelCard, param: str = "") -> Control:
    """A world model's control (POST /v1/videos/{id}/controls, `session.control`), checked against
    the model's control space (controls.py): a Control, or APIError naming the field."""
    try:
        return _parse_control(body, SPACES.get(card.controls))
    except ControlError as err:
        where = f"{param}{err.param}" if err.param else param.rstrip(".") or None
        raise APIError(err.status, err.message, where, err.code) from None


def _start_controls(raw, card: ModelCard, cfg: Config) -> tuple[Control, ...]:
    """`controls`: the controls a video starts with, in order, each landing at block 0 or at the
    one it names (a control script replayed from the start, as `streamdiffd generate --controls`)."""
    if raw is None:
        return ()
    if isinstance(raw, str):  # multipart forms carry it as JSON text
        raw = client_json(raw, JSONLimits.of(cfg.server), "'controls'", "controls")
    if not isinstance(raw, list):
        raise bad("'controls' must be a list of controls", "controls")
    if len(raw) > MAX_PENDING:
        raise bad(f"'controls' has {len(raw)} controls; at most {MAX_PENDING} (a script holds many frames)", "controls")
    out = [parse_control(c, card, f"controls[{i}].") for i, c in enumerate(raw)]
    if any(b.seq <= a.seq for a, b in zip(out, out[1:], strict=False)):
        raise bad("'controls': each 'seq' must be after the one before", "controls")
    if any((b.block or 0) < (a.block or 0) for a, b in zip(out, out[1:], strict=False)):
        raise bad("'controls': the blocks they name must not go back", "controls")
    return tuple(out)


def _outputs(raw, cfg: Config) -> tuple[str, ...]:
    """The ingests a request names: configured names only, never a URL (the server connects to
    nothing a request chooses)."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw) or len(set(raw)) != len(raw):
        raise bad("'outputs' must be a list of distinct output names", "outputs")
    known = cfg.outputs.destinations
    for i, name in enumerate(raw):
        if name not in known:
            have = ", ".join(sorted(known)) or "none are configured ([outputs] destinations)"
            raise bad(f"'outputs[{i}]': unknown output {name!r} (this server's: {have})", f"outputs[{i}]")
    return tuple(raw)


IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
_DATA_URL = re.compile(r"data:image/(png|jpeg|jpg|webp);base64,(.*)", re.S)


def image_bytes(value, lim: LimitsConfig) -> bytes:
    """input_reference as sent: a file's bytes (multipart), or a base64 data URL (JSON)."""
    if isinstance(value, bytes | bytearray):
        raw = bytes(value)
    elif isinstance(value, str):
        m = _DATA_URL.fullmatch(value.strip())
        if m is None:
            raise bad(
                "'input_reference' must be an image file (multipart) or a data URL "
                "'data:image/png|jpeg|webp;base64,...'",
                "input_reference",
                "invalid_image",
            )
        if len(m[2]) > (lim.max_image_bytes + 2) // 3 * 4 + 4:
            raise _too_big(len(m[2]) * 3 // 4, lim)
        try:
            raw = base64.b64decode(m[2], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise bad(f"'input_reference' is not valid base64: {exc}", "input_reference", "invalid_image") from None
    else:
        raise bad("'input_reference' must be an image file or a data URL", "input_reference", "invalid_image")
    if len(raw) > lim.max_image_bytes:
        raise _too_big(len(raw), lim)
    return raw


def _too_big(n: int, lim: LimitsConfig) -> APIError:
    return bad(
        f"'input_reference' is {n} bytes; the limit is {lim.max_image_bytes} (limits.max_image_bytes)",
        "input_reference",
        "image_too_large",
    )


def prepare_image(raw: bytes, width: int, height: int, lim: LimitsConfig) -> tuple[bytes, dict]:
    """Decode, check and fit an image to the video: cropped about its centre to the video's aspect
    ratio, then resized to width x height with PIL's bilinear filter (the authors' i2v images are
    cropped to the target aspect beforehand and resized by torchvision's `Resize`, which is PIL's
    bilinear on a PIL image), RGB (alpha dropped, as their `convert('RGB')`). Returns the result
    as PNG (lossless: the worker sees these exact pixels) and what the video object reports."""
    from PIL import Image

    param = "input_reference"
    try:
        img = Image.open(io.BytesIO(raw))
        fmt, (w, h) = img.format, img.size
    except Exception as exc:  # not an image PIL recognises (an SVG, text, a broken header)
        raise bad(f"'{param}' does not decode as a PNG, JPEG or WebP image: {exc}", param, "invalid_image") from None
    if fmt not in IMAGE_FORMATS:
        raise bad(f"'{param}' is a {fmt} image; send PNG, JPEG or WebP", param, "invalid_image")
    if w < 1 or h < 1:
        raise bad(f"'{param}' has no pixels ({w}x{h})", param, "invalid_image")
    if w * h > lim.max_image_pixels:
        raise bad(
            f"'{param}' is {w}x{h} = {w * h} pixels; the limit is {lim.max_image_pixels} (limits.max_image_pixels)",
            param,
            "image_too_large",
        )
    try:
        img.load()  # a truncated or corrupt file fails here, whole
        rgb = img.convert("RGB")
    except Exception as exc:
        raise bad(f"'{param}' does not decode ({fmt} {w}x{h}): {exc}", param, "invalid_image") from None
    if w * height > h * width:  # wider than the video: crop the sides
        cw, ch = max(1, round(h * width / height)), h
    else:
        cw, ch = w, max(1, round(w * height / width))
    left, top = (w - cw) // 2, (h - ch) // 2
    rgb = rgb.crop((left, top, left + cw, top + ch)).resize((width, height), Image.BILINEAR)
    out = io.BytesIO()
    rgb.save(out, "PNG", compress_level=1)
    info = {"format": fmt.lower(), "width": w, "height": h, "bytes": len(raw), "crop": [left, top, cw, ch]}
    return out.getvalue(), info


def parse_steer(data, cfg: Config, card: ModelCard) -> Scene:
    """Validate a POST /v1/videos/{id}/scenes body: the scene that takes over (its length is
    whatever is left of the video)."""
    if not isinstance(data, dict):
        raise bad("the request body must be a JSON object", None, "invalid_body")
    unknown = sorted(set(data) - STEER_FIELDS)
    if unknown:
        raise bad(f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0], "unknown_parameter")
    if "prompt" not in data:
        raise bad("Missing required parameter: 'prompt'", "prompt", "missing_required_parameter")
    if not card.text:
        raise bad(f"model '{card.name}' takes no prompt: steer it with controls (POST .../controls)", "prompt")
    prompt = _prompt(data["prompt"], "prompt", cfg.limits.max_prompt_chars)
    transition = data.get("transition", "continue")
    if transition not in ("cut", "continue"):
        raise bad(f"'transition' must be 'cut' or 'continue', got {transition!r}", "transition")
    seed = _integer(data["seed"], "seed", 0, MAX_SEED) if data.get("seed") is not None else None
    kept = transition == "cut" and card.new_shot == "history"
    return Scene(prompt, 1, transition, seed, _recache(data, transition, cfg, card), keeps_history=kept)


def _parse_scenes(raw, total: int | None, fps: int, cfg: Config, card: ModelCard) -> list[Scene]:
    lim = cfg.limits
    if not isinstance(raw, list) or not raw:
        raise bad("'scenes' must be a non-empty array", "scenes")
    if len(raw) > lim.max_scenes:
        raise bad(f"{len(raw)} scenes; the limit is {lim.max_scenes}", "scenes", "too_many_scenes")
    lengths, parsed = [], []
    for i, sc in enumerate(raw):
        p = f"scenes[{i}]."
        if not isinstance(sc, dict):
            raise bad(f"'scenes[{i}]' must be an object", f"scenes[{i}]")
        unknown = sorted(set(sc) - SCENE_FIELDS)
        if unknown:
            raise bad(
                f"Unrecognized scene argument supplied: {', '.join(unknown)}", p + unknown[0], "unknown_parameter"
            )
        prompt = _prompt(sc.get("prompt"), p + "prompt", lim.max_prompt_chars)
        transition = sc.get("transition", "cut")
        if transition not in ("cut", "continue"):
            raise bad(f"'{p}transition' must be 'cut' or 'continue', got {transition!r}", p + "transition")
        if i == 0 and transition == "continue":
            transition = "cut"  # the first scene always starts a shot
        seed = _integer(sc["seed"], p + "seed", 0, MAX_SEED) if sc.get("seed") is not None else None
        recache = _recache(sc, transition, cfg, card, p)
        lengths.append(_length(sc, fps, p, lim.max_frames))
        parsed.append((prompt, transition, seed, recache))
    missing = [i for i, n in enumerate(lengths) if n is None]
    if missing:
        if total is None:
            raise bad(
                f"scene {missing[0]} has no 'seconds' or 'num_frames' and the request gives no total",
                f"scenes[{missing[0]}].seconds",
                "missing_required_parameter",
            )
        left = total - sum(n for n in lengths if n is not None)
        if left < len(missing):
            raise bad(f"the scenes' lengths exceed the request's total of {total} frames", "scenes")
        share, extra = divmod(left, len(missing))
        for k, i in enumerate(missing):
            lengths[i] = share + (1 if k < extra else 0)
    elif total is not None and sum(lengths) != total:
        raise bad(f"the scenes add up to {sum(lengths)} frames but the request asks for {total}", "scenes")
    kept = card.new_shot == "history"  # a cut over the kept history (LongLive 2.0's multi-shot)
    return [
        Scene(p, n, t, s, r, keeps_history=kept and i > 0 and t == "cut")
        for i, ((p, t, s, r), n) in enumerate(zip(parsed, lengths))
    ]


def _recache(obj: dict, transition: str, cfg: Config, card: ModelCard, prefix: str = "") -> bool:
    recache = _bool(obj["recache"], prefix + "recache") if obj.get("recache") is not None else False
    if recache and transition != "continue":
        raise bad(f"'{prefix}recache' applies to a 'continue' transition (a cut starts afresh)", prefix + "recache")
    # An operator who set sampler.recache = "never" ruled the recompute out on this server:
    # honouring the request would make the setting mean nothing, ignoring it would hand back a
    # video without what was asked for. (every_switch re-caches anyway: the flag changes nothing.)
    if recache and (cfg.sampler.recache or card.recache) == "never":
        raise bad(
            f"'{prefix}recache' is refused: this server's model re-caches never (sampler.recache = 'never')",
            prefix + "recache",
        )
    return recache
