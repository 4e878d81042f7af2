"""Captioned synthetic clips whose content can be checked (numpy only; no torch).

The grammar: "a {colour} {shape} moving {direction} on a {colour} background", with the nine
colours at their CSS keyword values, three shapes and four directions. `clip()` draws one at
256x144 (or any size) with per-frame ground truth: the object's centroid and box. `check()` reads
frames back — the background is the commonest border colour, the object is every pixel far from
it — and says the object's colour (nearest CSS value of its mean) and direction of motion (the
centroid's displacement along its larger axis), so generated video can be judged against its
prompt. It is the training data of the embedded default and the checker of what it draws.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import numpy as np

# CSS keyword values (CSS Color Module Level 4).
COLOURS = {
    "red": (255, 0, 0),
    "green": (0, 128, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "white": (255, 255, 255),
    "black": (0, 0, 0),
    "orange": (255, 165, 0),
    "purple": (128, 0, 128),
    "gray": (128, 128, 128),
}
SHAPES = ("ball", "square", "triangle")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}  # (dx, dy), y grows down
PROMPT = re.compile(r"a (\w+) (\w+) moving (\w+) on a (\w+) background")


@dataclass(frozen=True)
class Caption:
    colour: str
    shape: str
    direction: str
    background: str

    @property
    def prompt(self) -> str:
        return f"a {self.colour} {self.shape} moving {self.direction} on a {self.background} background"

    @classmethod
    def parse(cls, prompt: str) -> Caption:
        m = PROMPT.fullmatch(prompt.strip().lower())
        if not m or m[1] not in COLOURS or m[2] not in SHAPES or m[3] not in DIRECTIONS or m[4] not in COLOURS:
            raise ValueError(f"not a prompt of the grammar: {prompt!r}")
        return cls(m[1], m[2], m[3], m[4])

    @classmethod
    def random(cls, rng: random.Random) -> Caption:
        colour, background = rng.sample(sorted(COLOURS), 2)  # never the same colour twice
        return cls(colour, rng.choice(SHAPES), rng.choice(sorted(DIRECTIONS)), background)


# The prompts the embedded default never trains on (the first HELD_OUT of `held_out_prompts`'s
# draw), so that what it draws from them is judged on prompts it has not seen.
HELD_OUT = 48


def held_out_prompts(n: int = HELD_OUT, seed: int = 4242) -> list[Caption]:
    """`n` distinct captions drawn from their own seed; the first HELD_OUT are never trained on."""
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n:
        c = Caption.random(rng)
        if c.prompt not in seen:
            seen.add(c.prompt)
            out.append(c)
    return out


@dataclass(frozen=True)
class Clip:
    caption: Caption
    frames: np.ndarray  # (n, h, w, 3) uint8
    centroids: np.ndarray  # (n, 2) float: x, y of the object per frame
    boxes: np.ndarray  # (n, 4) int: x0, y0, x1, y1 per frame


def _mask(shape: str, size: int) -> np.ndarray:
    y, x = np.mgrid[0:size, 0:size] + 0.5
    c = size / 2
    if shape == "ball":
        return (x - c) ** 2 + (y - c) ** 2 <= c * c
    if shape == "square":
        return np.ones((size, size), dtype=bool)
    return np.abs(x - c) <= y / 2  # apex at the top, base along the bottom row


def clip(
    caption: Caption,
    frames: int = 48,
    width: int = 256,
    height: int = 144,
    rng: random.Random | None = None,
    spread: float = 1.0,
) -> Clip:
    """Draw the caption: an object of 20-36 px crossing part of the frame at 1-3 px per frame,
    from a start that keeps it inside the frame throughout. `spread` scales how far size, speed
    and start stray from the caption's own: at 0 the object is 28 px, moves 1.5 px a frame and
    starts centred across its path, at the edge it moves away from, so the whole clip is a
    function of its prompt (what a model that cannot yet sample a first frame from noise can still
    learn to draw); at 1 (the default) they are drawn at random over their whole ranges."""
    rng = rng or random.Random(0)
    size = round(28 + spread * (rng.randint(20, 36) - 28))
    speed = 1.5 + spread * (rng.uniform(1.0, 3.0) - 1.5)
    dx, dy = DIRECTIONS[caption.direction]
    travel = speed * (frames - 1)
    span_x, span_y = width - size, height - size
    if abs(dx) * travel > span_x or abs(dy) * travel > span_y:
        speed = min(span_x if dx else span_y, travel) / max(1, frames - 1) * 0.95
        travel = speed * (frames - 1)
    lo_x, hi_x = travel if dx < 0 else 0, span_x - (travel if dx > 0 else 0)
    lo_y, hi_y = travel if dy < 0 else 0, span_y - (travel if dy > 0 else 0)
    own_x = (lo_x + hi_x) / 2 if dx == 0 else (hi_x if dx < 0 else lo_x)  # the caption's own start
    own_y = (lo_y + hi_y) / 2 if dy == 0 else (hi_y if dy < 0 else lo_y)
    x0 = own_x + spread * (rng.uniform(lo_x, hi_x) - own_x)
    y0 = own_y + spread * (rng.uniform(lo_y, hi_y) - own_y)
    mask = _mask(caption.shape, size)
    out = np.empty((frames, height, width, 3), dtype=np.uint8)
    out[...] = COLOURS[caption.background]
    centroids, boxes = np.zeros((frames, 2)), np.zeros((frames, 4), dtype=int)
    my, mx = np.nonzero(mask)
    for i in range(frames):
        x, y = round(x0 + dx * speed * i), round(y0 + dy * speed * i)
        out[i, y + my, x + mx] = COLOURS[caption.colour]
        centroids[i] = (x + mx.mean() + 0.5, y + my.mean() + 0.5)
        boxes[i] = (x, y, x + size, y + size)
    return Clip(caption, out, centroids, boxes)


@dataclass(frozen=True)
class Verdict:
    colour: str | None  # None: no object found
    direction: str | None  # None: it did not move
    background: str
    object_pixels: float  # mean share of the frame the object covers


def _nearest(rgb: np.ndarray) -> str:
    names = list(COLOURS)
    d = ((np.array([COLOURS[n] for n in names], dtype=float) - rgb) ** 2).sum(1)
    return names[int(d.argmin())]


def check(frames: np.ndarray, min_move_px: float = 4.0, max_object_share: float = 0.25) -> Verdict:
    """What the frames show: (n, h, w, 3) uint8 -> the object's colour, direction, background.
    No object (None, None) when nothing differs from the background, or when more than
    `max_object_share` of the frame does (noise, or no background at all: the grammar's objects
    cover a few percent)."""
    f = np.asarray(frames, dtype=np.float32)  # an array or a list of (h, w, 3) frames
    border = np.concatenate([f[:, 0], f[:, -1], f[:, :, 0], f[:, :, -1]], axis=1).reshape(-1, 3)
    background = np.median(border, axis=0)  # the object rarely touches the border; the median ignores it
    far = np.sqrt(((f - background) ** 2).sum(-1)) > 60.0  # (n, h, w): the object
    share = float(far.mean())
    bg_name = _nearest(background)
    if far.sum() == 0 or share > max_object_share:
        return Verdict(None, None, bg_name, share)
    colour = _nearest(f[far].mean(0))
    cents = []
    for m in far:
        ys, xs = np.nonzero(m)
        if len(xs):
            cents.append((xs.mean(), ys.mean()))
    if len(cents) < 2:
        return Verdict(colour, None, bg_name, share)
    (xa, ya), (xb, yb) = np.mean(cents[: max(1, len(cents) // 4)], 0), np.mean(cents[-max(1, len(cents) // 4) :], 0)
    mx, my = xb - xa, yb - ya
    if max(abs(mx), abs(my)) < min_move_px:
        return Verdict(colour, None, bg_name, share)
    direction = ("right" if mx > 0 else "left") if abs(mx) >= abs(my) else ("down" if my > 0 else "up")
    return Verdict(colour, direction, bg_name, share)
