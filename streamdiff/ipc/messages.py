"""Every control-plane message between the supervisor and the workers (both sides import this).

Messages are small msgpack maps, `{"t": <type>, ...fields}`: never tensors (those live in the
shared-memory rings; messages carry slot numbers and shapes) and never pickle. The supervisor
is the hub: workers only ever talk to it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

import msgpack


class ProtocolError(ValueError):
    pass


_TYPES: dict[str, type[Message]] = {}


@dataclass
class Message:
    type: ClassVar[str] = ""

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        _TYPES[cls.type] = cls

    def encode(self) -> bytes:
        return msgpack.packb({"t": self.type, **asdict(self)}, use_bin_type=True)


def decode(data: bytes) -> Message:
    try:
        obj = msgpack.unpackb(data, raw=False)
        cls = _TYPES[obj.pop("t")]
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in obj.items() if k in names})
    except (KeyError, TypeError, ValueError, msgpack.ExtraData, msgpack.FormatError) as exc:
        raise ProtocolError(f"bad control message: {exc!r}") from exc


# ----------------------------------------------------------------------------- supervisor -> worker


@dataclass
class OpenSession(Message):
    type: ClassVar[str] = "open"
    session: str
    width: int
    height: int
    seed: int


@dataclass
class GenerateBlock(Message):
    """DiT: denoise `frames` latent frames of `session` into latent ring slot `slot`.
    `prompt` is set on the first block of a scene (with `cut` and the scene's `seed`)."""

    type: ClassVar[str] = "gen"
    session: str
    block: int
    frames: int
    slot: int
    prompt: str | None = None
    cut: bool = False
    seed: int | None = None


@dataclass
class DecodeBlock(Message):
    """VAE shard: decode latent slot `latent_slot` (shape C, f, h, w) into frame slot
    `frame_slot` (frames_out, H, W, 3), its own rows only; `reset`: a new shot starts here."""

    type: ClassVar[str] = "dec"
    session: str
    block: int
    latent_slot: int
    frame_slot: int
    shape: list[int]
    frames_out: int
    reset: bool = False


@dataclass
class CloseSession(Message):
    type: ClassVar[str] = "close"
    session: str


@dataclass
class Shutdown(Message):
    type: ClassVar[str] = "shutdown"


# ----------------------------------------------------------------------------- worker -> supervisor


@dataclass
class Ready(Message):
    """Handshake: the worker's stages are built. `info` carries the model facts the supervisor
    needs without importing torch (frames per block, factors, fps, sizes)."""

    type: ClassVar[str] = "ready"
    worker: str
    pid: int
    info: dict = field(default_factory=dict)


@dataclass
class Heartbeat(Message):
    type: ClassVar[str] = "hb"
    worker: str
    busy_s: float  # seconds the current message has been running (0 when idle)


@dataclass
class LatentDone(Message):
    type: ClassVar[str] = "latent"
    session: str
    block: int
    slot: int
    shape: list[int]
    compute_ms: float
    skipped: bool = False  # the session was cancelled: nothing was written


@dataclass
class FramesDone(Message):
    type: ClassVar[str] = "frames"
    session: str
    block: int
    rank: int
    frame_slot: int
    compute_ms: float
    skipped: bool = False  # the group agreed the session was cancelled: nothing was written


@dataclass
class Failed(Message):
    """A block (or the worker itself, session None) failed; `message` says why. `kind`:
    "request" (the request cannot be served; the worker carries on) or "worker" (the worker
    exits after this message and is restarted with its VAE group)."""

    type: ClassVar[str] = "failed"
    worker: str
    message: str
    session: str | None = None
    block: int | None = None
    kind: str = "worker"
