"""A block as its caller orders it (`BlockOrder`: what the scheduler's GenerateBlock carries, or
what `generate` plans), and the check a DiT engine makes of each before it runs.

The API admits only requests the card allows; this is the same rule at the worker, for a message
no client wrote (a replanned block, a steer), so that a block the model cannot make is refused
with its reason before it runs. The sampler's rules are here; each conditioning
(conditionings.py) declares what it takes (an image, actions, a camera) and checks its own part,
so a block bringing what no conditioning takes is refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..card import ModelCard

CAMERA_ROW = 20  # controls.camera_row: a 4x4 world-to-camera, row-major, then fx, fy, cx, cy
TAKES_NONE = {"image": "does not condition on an image", "actions": "takes no actions", "camera": "takes no camera"}


class BlockRefused(ValueError):
    """This block cannot be made by this model: the message says why."""


@dataclass
class BlockOrder:
    """One block of one session. A scene's first block carries the scene (`prompt` set): a new
    shot, a seed, a re-cache, a transition over the kept history, the blocks left in the shot
    (plan.shot_left; 0: open-ended), a start picture. Every block may carry its controls."""

    frames: int  # latent frames
    prompt: str | None = None
    new_shot: bool = False
    seed: int | None = None
    recache: bool = False
    transition: bool = False
    shot_left: int = 0
    image: Any = None  # the start picture: (H, W, 3) uint8, a torch tensor, at the video's size
    camera: list[list[float]] = field(default_factory=list)  # a row per latent frame (controls.camera_row)
    actions: list[list[float]] = field(default_factory=list)  # a row per latent frame (controls.action_row)

    def given(self) -> dict[str, bool]:
        return {"image": self.image is not None, "actions": bool(self.actions), "camera": bool(self.camera)}


def check_block(card: ModelCard, conditionings: list, order: BlockOrder) -> None:
    """Raise BlockRefused where `order` is not a block `card`'s model, conditioned by
    `conditionings` (conditionings.conditionings_for), makes."""
    if order.frames < 1:
        raise BlockRefused(f"a block of {order.frames} latent frames")
    if card.sampler == "rolling" and order.frames != card.frames_per_block:  # its window holds whole blocks
        raise BlockRefused(
            f"the rolling sampler makes whole blocks of {card.frames_per_block} latent frames, not {order.frames}"
        )
    if order.transition and (order.new_shot or card.new_shot != "history" or order.prompt is None):
        raise BlockRefused(f"model {card.name!r} takes no shot transition here")
    taken = set().union(*(c.takes for c in conditionings))
    for kind, given in order.given().items():
        if given and kind not in taken:
            raise BlockRefused(f"model {card.name!r} {TAKES_NONE[kind]}")
    for c in conditionings:
        c.check(card, order)


def rows_fit(rows: list[list[float]], frames: int, width: int) -> bool:
    """A row of `width` finite values per latent frame."""
    return len(rows) == frames and all(len(r) == width and all(map(math.isfinite, r)) for r in rows)
