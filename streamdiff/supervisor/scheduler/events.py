"""What the scheduler takes in (events: submissions, worker replies, encoder results, acks,
cancels, worker deaths and idle reports, steering) and what it hands out (actions: messages to
send, encoders to open, fragments to encode, bytes and ends for the sessions). The driver
(`supervisor/driver.py`) carries the actions out and feeds their results back as events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...controls import Control
from ...ipc import messages as m
from ...plan import Block, Scene

if TYPE_CHECKING:
    from .tickets import Session


# -- events (in) --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Submit:
    session: Session


@dataclass(frozen=True)
class Cancel:
    session: str
    reason: str = "cancelled"


@dataclass(frozen=True)
class Ack:
    session: str
    blocks: int = 1


@dataclass(frozen=True)
class WorkerReady:
    worker: str
    info: m.ReadyInfo


@dataclass(frozen=True)
class WorkerIdle:
    worker: str
    since: float  # when its wait with nothing queued began (the scheduler's clock)


@dataclass(frozen=True)
class WorkersLost:
    workers: frozenset[str]
    why: str


@dataclass(frozen=True)
class SendFailed:
    """A message could not be handed to the worker's socket (it is not connected)."""

    worker: str
    msg: m.Message


@dataclass(frozen=True)
class EncoderOpened:
    session: str
    init: bytes | None = None
    error: str | None = None


@dataclass(frozen=True)
class Encoded:
    session: str
    block: int
    data: bytes | None = None
    error: str | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class StopAdmitting:
    reason: str


@dataclass(frozen=True)
class Steer:
    """A new scene for a running session, from the first block the DiT has not started."""

    session: str
    scene: Scene  # its frames are ignored: it runs to the end (a live session's cap)


@dataclass(frozen=True)
class Stop:
    """End the session cleanly at the next block boundary."""

    session: str


@dataclass(frozen=True)
class Controlled:
    """A world model's control (controls.py) for a running session, from the first block the DiT
    has not started (or the later one it names)."""

    session: str
    control: Control


Event = (
    Submit
    | Cancel
    | Ack
    | WorkerReady
    | WorkerIdle
    | WorkersLost
    | SendFailed
    | EncoderOpened
    | Encoded
    | StopAdmitting
    | Steer
    | Stop
    | Controlled
    | m.LatentDone
    | m.FramesDone
    | m.Failed
)


# -- actions (out) ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Send:
    worker: str
    msg: m.Message


@dataclass(frozen=True)
class OpenEncoder:
    session: str
    width: int
    height: int
    fps: int
    keyframes: list[int]


@dataclass(frozen=True)
class Encode:
    session: str
    block: Block
    frame_slot: int
    shape: tuple[int, int, int, int]  # the slot's frames: (frames_out, height, width, 3)
    idr: bool
    events: list[tuple]  # emsg boxes: (presentation offset, id, JSON[, scheme]) (media.encoder)


@dataclass(frozen=True)
class CloseEncoder:
    session: str


@dataclass(frozen=True)
class Start:
    session: str
    placement: dict


@dataclass(frozen=True)
class Emit:
    session: str
    data: bytes
    block: Block | None  # None: the init segment


@dataclass(frozen=True)
class End:
    session: str
    state: str
    error: str | None = None
    code: str | None = None


@dataclass(frozen=True)
class Reject:
    session: str
    message: str
    retry_after_s: float


@dataclass(frozen=True)
class Steered:
    """Where a Steer (scene set) or a Stop (scene None) landed; or why not (`refused`: an HTTP
    status and a message)."""

    session: str
    scene: int | None = None  # the new scene's index
    start_frame: int = 0  # where the new scene, or the stop, lands
    scenes: list[Scene] = field(default_factory=list)  # the session's scenes now
    refused: tuple[int, str] | None = None


@dataclass(frozen=True)
class ControlLanded:
    """Where a control lands: its block and that block's first frame; or why not (`refused`:
    an HTTP status, the field to blame, a code and a message)."""

    session: str
    seq: int
    block: int = 0
    start_frame: int = 0
    refused: tuple[int, str | None, str, str] | None = None


@dataclass(frozen=True)
class WakeAt:
    """Step again at this time (a paced live session's next block becomes due)."""

    at: float


Action = Send | OpenEncoder | Encode | CloseEncoder | Start | Emit | End | Reject | Steered | ControlLanded | WakeAt
