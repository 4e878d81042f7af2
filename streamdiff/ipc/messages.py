"""Every control-plane message between the supervisor and the workers (both sides import this).

Messages are msgspec Structs sent as msgpack maps tagged by their type (`{"t": <type>, ...}`),
decoded into exactly one of the types below and validated against its field types: never
tensors (those live in the shared-memory rings; messages carry slot numbers and shapes) and
never pickle. The supervisor is the hub: workers only ever talk to it.
"""

from __future__ import annotations

from typing import Literal, Union

import msgspec

from ..card import ModelCard


class ProtocolError(ValueError):
    pass


class Message(msgspec.Struct, tag_field="t"):
    def encode(self) -> bytes:
        return _ENCODER.encode(self)

    @property
    def type(self) -> str:
        return self.__struct_config__.tag


# ----------------------------------------------------------------------------- supervisor -> worker


class OpenSession(Message, tag="open"):
    session: str
    width: int
    height: int
    seed: int
    held_frames: int = 0  # the most latent frames a shot can hold (plan.most_held_frames); 0: unbounded (live)


class GenerateBlock(Message, tag="gen"):
    """DiT: denoise `frames` latent frames of `session` into latent ring slot `slot`.
    `prompt` is set on the first block of a scene (with `new_shot` and the scene's `seed`)."""

    session: str
    block: int
    frames: int
    slot: int
    prompt: str | None = None
    new_shot: bool = False  # the first block of a shot (the API's `cut`)
    seed: int | None = None
    recache: bool = False  # with a continuing prompt: recompute the window's keys/values under it
    # a new shot over the kept history (LongLive 2.0's multi-shot; DiTEngine.set_scene): no `new_shot`
    transition: bool = False
    vae_cut: int = 0  # topology.vae_cut: the decoder stages to run on it (set at a shot's start; 0: the worker's)
    # blocks of its shot from this one on, as planned now (0: live, open-ended): the shot's noise drawn up
    # front at a scene's start, and the rolling sampler's window stops taking new blocks at its end
    shot_left: int = 0
    # image-to-video: the shot's input picture at the video's size, as PNG bytes (an encoded file,
    # not a tensor), on the shot's first block, which is then the picture's latent frame alone
    image: bytes | None = None
    # a camera model's (controls.py): the block's camera per latent frame, rows of w2c (16,
    # row-major) and fx, fy, cx, cy
    camera: list[list[float]] = []
    # an action model's (Matrix-Game): per latent frame, the keyboard multi-hot then the mouse
    actions: list[list[float]] = []


class GenerateBatch(Message, tag="genb"):
    """DiT: these blocks, of different sessions, in one batched forward where their sizes and
    step lists agree (the supervisor chose them together); one LatentDone each."""

    blocks: list[GenerateBlock]


class DecodeBlock(Message, tag="dec"):
    """VAE shard: decode latent slot `latent_slot` (shape C, f, h, w) into frame slot
    `frame_slot` (frames_out, H, W, 3), its own rows only; `reset`: a new shot starts here.
    `data_shape`: what the slot holds when the DiT ran the decoder's first `vae_cut` stages on
    it (topology.vae_cut): that activation's shape (empty: the latent itself)."""

    session: str
    block: int
    latent_slot: int
    frame_slot: int
    shape: list[int]
    frames_out: int
    reset: bool = False
    data_shape: list[int] = []
    vae_cut: int = 0  # the stages the DiT ran on it (with data_shape; 0: the worker's cut)


class DecodeBatch(Message, tag="decb"):
    """VAE: these blocks, of different sessions, in one decode call where their sizes and cache
    phases agree (the supervisor chose them; every shard of the group gets the same batch, so
    the shards agree by construction); one FramesDone each. `weights`: the group's band weights
    (models/wan/rows.split_rows; empty: equal bands); a running shot whose bands they change has its
    cached rows moved first (parallel/vae_group.move_bands)."""

    blocks: list[DecodeBlock]
    weights: list[float] = []


class CloseSession(Message, tag="close"):
    session: str


class Shutdown(Message, tag="shutdown"):
    """Stop: the worker finishes nothing more and exits."""


# ----------------------------------------------------------------------------- worker -> supervisor


class StageCost(msgspec.Struct, frozen=True):
    """One block at `size` ([w, h]) timed at start: the admission model's first estimate."""

    block_ms: float
    size: list[int]
    busy_ms: float | None = None  # the DiT: of block_ms, its own work


class DiTMemory(msgspec.Struct, frozen=True):
    """What one DiT session holds: its KV window, exact per token (KVCache.nbytes), and its
    cross-attention keys; and the budget it holds them in."""

    kv_bytes_per_token: float
    window_frames: int
    cross_bytes: float
    budget_bytes: float  # the worker's (its device's), shared by its stages: Worker.start
    least_frames: int = 0  # the fewest frames a cache is sized for (sinks and a block; plan.cache_frames)
    transient_bytes: float = 0.0  # a block's activations and workspaces, alone
    transient_each: float = 0.0  # what each more session of a batch adds to them
    batch: int = 0  # the largest batch the budget keeps transients for (Worker.start; 0: not set)


class VAEMemory(msgspec.Struct, frozen=True):
    """What one VAE session's temporal cache holds per latent pixel of a shard, and the budget."""

    cache_bytes_per_latent_pixel: float
    budget_bytes: float  # the worker's (its device's), shared by its stages: Worker.start
    transient_bytes: float = 0.0  # a decode's activations, alone
    transient_each: float = 0.0  # what each more session of a batch adds to them
    batch: int = 0  # the largest batch the budget keeps transients for (Worker.start; 0: not set)


class GivenTimes(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A stage's start-up timings given instead of measured (`pipeline.calibration_given`), at
    the preset's default size, as its calibration would have timed them."""

    block_ms: float
    batch_ms: dict[str, float] = {}  # per-block share of a batch of N sessions ("2": ...)


class GivenCalibration(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The file `pipeline.calibration_given` names (JSON): every DiT and VAE worker reports these
    timings instead of timing blocks at start; what a session holds is still measured, and so
    are a VAE cut's stage times."""

    dit: GivenTimes
    vae: GivenTimes


def read_given_calibration(path: str) -> GivenCalibration:
    """The file, checked: one ValueError naming the file and what is wrong with it."""
    try:
        given = msgspec.json.decode(open(path, "rb").read(), type=GivenCalibration)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"calibration file {path}: {exc}") from None
    for stage in ("dit", "vae"):
        t = getattr(given, stage)
        if not t.block_ms > 0 or not all(k.isdigit() and int(k) >= 2 and v > 0 for k, v in t.batch_ms.items()):
            raise ValueError(f"calibration file {path}: {stage}: block_ms and batch_ms ('2', ...) must be > 0")
    return given


class StageTimes(msgspec.Struct, frozen=True):
    """Each VAE decoder stage's time at `size` (what the supervisor moves a cut by)."""

    ms: list[float]
    size: list[int]


class DiTReady(msgspec.Struct, frozen=True):
    """A DiT stage's start-up: its calibration block, a pair's per-block share, its memory."""

    cost: StageCost
    batch_ms: dict[str, float] = {}  # batch size -> per-block ms in a batch of that many
    memory: DiTMemory | None = None
    rank: int = 0
    world: int = 1
    card: ModelCard | None = None  # the model it loaded (the supervisor checks its ring fields)
    loaded: dict = {}  # the checkpoint, weight set, LoRA and sampler settings it runs (engines.describe_load)


class VAEReady(msgspec.Struct, frozen=True):
    """A VAE stage's start-up (every shard of a group reports; rank 0's figures are the group's)."""

    cost: StageCost
    batch_ms: dict[str, float] = {}
    memory: VAEMemory | None = None
    rank: int = 0
    world: int = 1
    spatial_factor: int = 8
    temporal_factor: int = 4
    stages_ms: StageTimes | None = None  # with a VAE cut: each decoder stage's time
    compile: dict | None = None  # --compile on this device: graphs compiled and seconds spent (the Wan VAE's norms)


class ReadyInfo(msgspec.Struct, frozen=True):
    device: str = ""
    roles: list[str] = []
    dit: DiTReady | None = None
    vae: VAEReady | None = None


class Ready(Message, tag="ready"):
    """Handshake: the worker's stages are built. `info` carries what they measured at start and
    the model's card, which the supervisor checks without importing torch."""

    worker: str
    pid: int
    info: ReadyInfo = ReadyInfo()


class CpuStats(msgspec.Struct):
    """The CPU platform's own figures (platform/cpu_lending.py), in a heartbeat."""

    borrowed_s: float = 0.0  # shared cores: seconds this incarnation ran on waiting workers' threads too


class Heartbeat(Message, tag="hb"):
    worker: str
    busy_s: float  # seconds the current message has been running (0 when idle)
    idle_s: float = 0.0  # seconds it has been waiting for messages with none queued (0 when not)
    platform: CpuStats | None = None  # the platform's extra figures (None: it has none)


class LatentDone(Message, tag="latent"):
    session: str
    block: int
    slot: int
    shape: list[int]
    compute_ms: float  # this block's share of its batch's time
    skipped: bool = False  # the session was cancelled: nothing was written
    batch: int = 1  # blocks computed together in that forward
    # of compute_ms, the stage's own device work (the platform's Stopwatch: on the CPU its CPU time per thread)
    busy_ms: float = 0.0
    data_shape: list[int] = []  # the slot holds the decoder's first stages' output of this shape (vae_cut)


class FramesDone(Message, tag="frames"):
    session: str
    block: int
    rank: int
    frame_slot: int
    compute_ms: float  # this block's share of its batch's time
    skipped: bool = False  # the group agreed the session was cancelled: nothing was written
    batch: int = 1  # blocks decoded together in that call
    # of compute_ms, this shard's own device work, not its waits on collectives (the platform's Stopwatch)
    busy_ms: float = 0.0
    rows: int = 0  # the latent rows of this shard's band


class Failed(Message, tag="failed"):
    """A block (or the worker itself, session None) failed; `message` says why. `kind`:
    "request" (the request cannot be served), "session" (the session cannot go on, not the
    request's fault), "memory" (the device ran out of memory in the block's batch: one such
    message per session of the batch) — the worker carries on in these — or "worker" (the
    worker exits after this message and is restarted with its VAE group)."""

    worker: str
    message: str
    session: str | None = None
    block: int | None = None
    kind: Literal["request", "session", "memory", "worker"] = "worker"


MESSAGES = (
    OpenSession,
    GenerateBlock,
    GenerateBatch,
    DecodeBlock,
    DecodeBatch,
    CloseSession,
    Shutdown,
    Ready,
    Heartbeat,
    LatentDone,
    FramesDone,
    Failed,
)
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Union[MESSAGES])  # noqa: UP007 (a tuple of types, unpacked)


def decode(data: bytes) -> Message:
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"bad control message: {exc}") from exc
