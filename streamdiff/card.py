"""What a model is, as everyone but its engine needs it: one typed, torch-free description.

The API checks a request against it (does the model take text, an image, controls), the
supervisor sizes its rings and plans blocks by it, the planner and the profile price by it, and
`/v1/models` prints it. `models/spec.py` writes one for each preset before any worker starts;
the DiT worker builds its own from the model it loaded and sends it in READY, where the
supervisor checks the fields its rings were sized by and takes the rest from the worker (a
`config.json` beside the weights may change a dimension).
"""

from __future__ import annotations

import msgspec

IMAGE_MODES = ("block", "first_frame", "condition")  # how an image starts a shot (ModelCard.image)
NEW_SHOT = ("fresh", "history")  # what a cut keeps (ModelCard.new_shot)
RECACHE = ("never", "on_request", "every_switch")
SAMPLERS = ("block", "rolling", "unipc")


class DiTDims(msgspec.Struct, frozen=True, kw_only=True):
    """A DiT's dimensions, for pricing it before any worker builds it (placement/cost.py)."""

    dim: int
    ffn_dim: int
    num_heads: int
    num_layers: int
    freq_dim: int = 256
    text_dim: int = 4096
    text_len: int = 512  # the context's tokens (Matrix-Game: CLIP's 257 image tokens)
    in_channels: int = 16
    out_channels: int = 16


class Lora(msgspec.Struct, frozen=True):
    """The PEFT adapter a preset's authors merge before inference."""

    rank: int
    alpha: float


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # the preset
    arch: str  # its DiT configuration
    embedded: bool = False  # weights built in the worker: no model.path

    # What it takes
    text: bool = True  # prompts (Matrix-Game's context is its start image's CLIP tokens instead)
    # How an image starts a shot (IMAGE_MODES): "block", a latent frame of its own before the
    # shot's first block (Causal Forcing); "first_frame", the first latent frame of the shot's first
    # block, held clean through its steps (LongLive 2.0); "condition", beside every block's noise
    # (Matrix-Game). None: no image-to-video.
    image: str | None = None
    controls: str | None = None  # its control space (controls.SPACES); None: prompts only

    # What a cut keeps: "fresh" (the window starts over) or "history" (LongLive 2.0's multi-shot:
    # the next shot's RoPE positions move on and its first block is pinned as a shot sink)
    new_shot: str = "fresh"
    recache: str = "on_request"  # when a prompt switch recomputes the window (RECACHE), unless configured
    can_recache: bool = True  # minWM: no (its held frames' cameras are not kept)
    dit_group: bool = True  # its DiT splits over a device group (Matrix-Game's action modules do not)
    sampler: str = "block"  # SAMPLERS; a rolling sampler's window holds whole blocks only
    steps: int = 4  # denoising passes of a steady block (the clean pass after them is one more)

    # What its weights need beside model.path
    checkpoint: str | None = None  # the authors' DiT checkpoint file (--dit-checkpoint)
    lora: Lora | None = None  # the LoRA that completes the weights (--lora)
    context_encoder: str = "umt5"  # what encodes its context, held beside the DiT: tiny | umt5 | clip (an image's)
    action_blocks: int = 0  # DiT blocks with an action module (Matrix-Game's keyboard and mouse)

    # Geometry
    latent_channels: int = 16
    spatial_factor: int = 8  # pixels a latent row (the VAE's)
    temporal_factor: int = 4  # frames a latent frame, after a shot's first
    size_multiple: int = 16  # widths and heights are multiples of this (the VAE's factor x the DiT's patch)
    frames_per_block: int = 3  # latent frames a block
    fps: int = 16  # the frame rate it was trained at
    default_size: tuple[int, int] = (832, 480)  # (width, height)

    # Its cache
    window_frames: int = 21  # the attention window in latent frames, the current block included
    sink_frames: int = 0  # frames at a shot's start never evicted
    kv_caches: int = 1  # caches a frame's keys/values fill (minWM's PRoPE: a second attention)
    dims: DiTDims | None = None  # None: the embedded default, whose depth is configured (priced by its profile)

    def __post_init__(self) -> None:
        for field, value, allowed in (
            ("image", self.image, (None, *IMAGE_MODES)),
            ("new_shot", self.new_shot, NEW_SHOT),
            ("recache", self.recache, RECACHE),
            ("sampler", self.sampler, SAMPLERS),
        ):
            if value not in allowed:
                raise ValueError(f"{self.name}: {field} must be one of {', '.join(map(str, allowed))}, got {value!r}")

    @property
    def i2v(self) -> bool:
        """Whether it takes an image (`input_reference`)."""
        return self.image is not None

    @property
    def image_block(self) -> bool:
        """Whether an image is a block of its own (plan.Scene.image_block)."""
        return self.image == "block"

    @property
    def block_frames(self) -> int:
        """Frames a steady-state block decodes to."""
        return self.frames_per_block * self.temporal_factor

    def latent_size(self, width: int, height: int) -> tuple[int, int]:
        """(rows, columns) of a latent frame at this pixel size."""
        return height // self.spatial_factor, width // self.spatial_factor

    def tokens_per_frame(self, width: int, height: int) -> int:
        """The DiT's tokens a latent frame at this pixel size."""
        return (height // self.size_multiple) * (width // self.size_multiple)

    def configured(self, frames_per_block: int | None = None, default_size: tuple[int, int] | None = None) -> ModelCard:
        """This card with a configured block (`[sampler] frames_per_block`) or default size."""
        changes: dict = {}
        if frames_per_block:
            changes["frames_per_block"] = frames_per_block
        if default_size:
            changes["default_size"] = tuple(default_size)
        return msgspec.structs.replace(self, **changes) if changes else self

    def differs(self, other: ModelCard, fields: tuple[str, ...]) -> list[str]:
        """'field=theirs, expected mine' for each of `fields` where the two differ."""
        return [
            f"{f}={getattr(other, f)}, expected {getattr(self, f)}"
            for f in fields
            if getattr(self, f) != getattr(other, f)
        ]


# The fields the supervisor sizes its shared-memory rings, plans blocks and prices sessions by
# before any worker starts: a worker's card must agree on these before any session opens.
PLANNED_FIELDS = ("frames_per_block", "spatial_factor", "temporal_factor", "latent_channels", "size_multiple")
