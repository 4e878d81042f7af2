"""What a block must bring to its model: the check a DiT worker makes of each block it is sent,
read off the model's card (streamdiff/card.py). The API admits only requests the card allows;
this is the same rule at the worker, for a message no client wrote (a replanned block, a
steer), so that a block the model cannot make is refused with its reason before it runs."""

from __future__ import annotations

import math

from ..card import ModelCard
from ..controls import SPACES

CAMERA_ROW = 20  # controls.camera_row: a 4x4 world-to-camera, row-major, then fx, fy, cx, cy


class BlockRefused(ValueError):
    """This block cannot be made by this model: the message says why."""


def check_block(
    card: ModelCard,
    frames: int,
    shot_start: bool,
    image: bool,
    actions: list[list[float]],
    camera: list[list[float]],
    transition: bool,
    prompt: str | None,
) -> None:
    """Raise BlockRefused where a block of `frames` latent frames (the first of a shot where
    `shot_start`, with a start image where `image`, these control rows, a shot transition over
    the kept history where `transition`) is not one `card`'s model makes."""
    name = card.name
    if card.sampler == "rolling" and frames != card.frames_per_block:  # its window holds whole blocks
        raise BlockRefused(
            f"the rolling sampler makes whole blocks of {card.frames_per_block} latent frames, not {frames}"
        )
    if image:
        if not card.i2v:
            raise BlockRefused(f"model {name!r} does not condition on an image")
        if not card.image_block:  # in the shot's first block (LongLive 2.0), or beside every block
            if not shot_start:
                raise BlockRefused("an image starts a shot: it comes with the shot's first block")
        elif not shot_start or frames != 1 or card.sampler == "rolling":
            raise BlockRefused("an image is a shot's first block of one latent frame (no rolling sampler)")
    if card.image == "condition" and shot_start and not image:
        raise BlockRefused(f"model {name!r} starts every shot from an image")
    if transition and (shot_start or card.new_shot != "history" or prompt is None):
        raise BlockRefused(f"model {name!r} takes no shot transition here")
    space = SPACES.get(card.controls)
    if space is not None and not space.camera:  # an action model: an action per latent frame (controls.action_row)
        width = len(space.keys) + (2 if space.mouse else 0)
        if actions and not _rows(actions, frames, width):
            raise BlockRefused(f"an action model's block needs {frames} finite action rows of {width} values")
    elif actions:
        raise BlockRefused(f"model {name!r} takes no actions")
    if space is not None and space.camera:  # a camera model: a camera per latent frame (controls.camera_row)
        if not _rows(camera, frames, CAMERA_ROW):
            raise BlockRefused(f"a camera model's block needs {frames} finite camera rows of {CAMERA_ROW} values")
    elif camera:
        raise BlockRefused(f"model {name!r} takes no camera")


def _rows(rows: list[list[float]], frames: int, width: int) -> bool:
    return len(rows) == frames and all(len(r) == width and all(map(math.isfinite, r)) for r in rows)
