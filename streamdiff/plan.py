"""Frame arithmetic of a request: scenes -> blocks (supervisor process; no torch).

A shot (the first scene, and every scene after a `cut`) starts the VAE's causal cache afresh:
its first latent frame decodes to 1 frame, every later one to `temporal_factor` (4) frames. A
`continue` scene keeps the shot going, so all of its latent frames give 4. Each scene asks for
an exact number of frames; we generate the fewest whole blocks of `frames_per_block` latent
frames that cover it, and emit only the frames asked for: the surplus frames at the end of a
scene's last block are decoded (the VAE's causal cache runs through them) and dropped.

Whole blocks because the published models were trained on blocks of one size only: a scene's
last block of 1-2 latent frames, or a `continue` scene starting off the block grid, shows the
DiT a block it never saw in training. The price is up to `frames_per_block - 1` latent frames
generated and not shown at a scene's end.

Image-to-video: a shot that starts from an image has the image's latent as its first latent
frame, a block of one latent frame (1 output frame: the picture through the VAE) ahead of the
whole blocks, as the authors' pipeline commits `initial_latent` before its first noise block.
With frame-wise models (1 latent frame per block, the only ones their i2v runs) this is the
same grid as text-to-video.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Scene:
    prompt: str
    frames: int  # output frames of this scene
    transition: str = "cut"  # how this scene starts: cut (new shot) | continue (same shot, new prompt)
    seed: int | None = None
    recache: bool = False  # continue: recompute the held frames' keys/values under the new prompt
    # image-to-video (a shot's first scene): the input picture, resized and cropped to the video's
    # size, as PNG bytes. It is the shot's first latent frame, a block of its own (see plan_blocks).
    image: bytes | None = field(default=None, repr=False)
    # whether the image is the shot's first latent frame, a block of its own (Causal Forcing), or
    # conditions every block of the shot from its first (Matrix-Game: no block of its own)
    image_block: bool = True
    # a cut the model makes over its kept history (LongLive 2.0's multi-shot transition): planned
    # as a continue (the VAE's causal cache goes on), the DiT told it starts a shot
    keeps_history: bool = False


@dataclass(frozen=True)
class Block:
    index: int  # block number within the session
    scene: int  # scene index
    latent_frames: int
    frames_out: int  # frames the VAE decodes from this block
    emit: int  # frames that go into the video (== frames_out except at a scene's end)
    start_frame: int  # timeline index of the first emitted frame
    first_of_scene: bool
    shot_start: bool  # a new shot: fresh DiT KV cache and VAE temporal cache


def latent_frames_for(frames: int, shot_start: bool, temporal_factor: int = 4) -> int:
    if frames < 1:
        raise ValueError("a scene needs at least one frame")
    if shot_start:
        return 1 + -(-(frames - 1) // temporal_factor)
    return -(-frames // temporal_factor)


def plan_blocks(scenes: list[Scene], frames_per_block: int, temporal_factor: int = 4) -> list[Block]:
    blocks: list[Block] = []
    timeline = 0
    for si, scene in enumerate(scenes):
        shot_start = si == 0 or (scene.transition == "cut" and not scene.keeps_history)
        latent = latent_frames_for(scene.frames, shot_start, temporal_factor)
        remaining_out = scene.frames
        sizes = [frames_per_block] * -(-latent // frames_per_block)
        if shot_start and scene.image is not None and scene.image_block:  # the image's latent frame alone
            sizes = [1] + [frames_per_block] * -(-(latent - 1) // frames_per_block)
        for i, size in enumerate(sizes):
            starts_shot = shot_start and i == 0
            out = size * temporal_factor - (temporal_factor - 1 if starts_shot else 0)
            emit = min(out, remaining_out)
            blocks.append(Block(len(blocks), si, size, out, emit, timeline, i == 0, starts_shot))
            timeline += emit
            remaining_out -= emit
    return blocks


def scene_marker(block: Block, scene: Scene) -> tuple[int, str, bytes]:
    """The event a video carries where a scene starts (an emsg box at the block's first frame):
    (frame offset in the block, the scene's number, its facts as JSON). The daemon's streams and
    `streamdiffd generate`'s files both carry it."""
    info = {
        "scene": block.scene,
        "prompt": scene.prompt,
        "start_frame": block.start_frame,
        "frames": scene.frames,
        "transition": scene.transition,
    }
    return 0, str(block.scene), json.dumps(info).encode()


def replan_from(
    scenes: list[Scene],
    blocks: list[Block],
    at: int,
    new: Scene | None,
    frames_per_block: int,
    temporal_factor: int = 4,
) -> tuple[list[Scene], list[Block]]:
    """Steering a running video: blocks before `at` stay as they are (they may be generated
    already); the scene playing at block `at` ends there, and `new` (if any) starts there and
    runs for `new.frames`. Without `new` the video ends at block `at` (a stop). Scenes that had
    not started by then are dropped. Returns the new scenes and blocks."""
    if not 0 < at <= len(blocks):
        raise ValueError(f"block {at} of {len(blocks)}")
    end = blocks[at - 1].start_frame + blocks[at - 1].emit  # the frame where block `at` starts
    kept, start = [], 0
    for sc in scenes:
        if start >= end:
            break
        kept.append(replace(sc, frames=min(sc.frames, end - start)))
        start += sc.frames
    if new is not None:
        kept.append(new)
    replanned = plan_blocks(kept, frames_per_block, temporal_factor)
    if replanned[:at] != blocks[:at]:  # a scene cut at a block boundary keeps its blocks
        raise AssertionError(f"replanning changed blocks before {at}")
    return kept, replanned


def shot_left(blocks: list[Block], index: int) -> int:
    """Blocks of the shot of block `index` from it on, as planned now (all whole blocks): at a
    scene's start the DiT draws the rest of the shot's noise up front, as the
    authors draw a whole video's, and a rolling sampler stops letting new blocks into its window
    near the shot's end. A live video sends 0: open-ended, its noise drawn per block, its blocks
    entering until it is stopped."""
    end = next((b.index for b in blocks[index + 1 :] if b.shot_start), len(blocks))
    return end - index


def most_held_frames(blocks: list[Block]) -> int:
    """The most latent frames any shot of a fixed-length video can hold, however it is steered:
    the latent frames of all its planned blocks. A steer replans the rest of the video as one
    scene of the frames left; a `continue` scene packs 4 frames into every latent frame, the most
    any plan does, so its whole blocks never outnumber the blocks they replace, and a `cut` starts
    a shot of at most the whole video's frames. What a fixed-length session's KV cache needs at
    most (tests/test_plan.py holds it over random steers); a live video has no such bound."""
    return sum(b.latent_frames for b in blocks)


def cache_frames(window: int, least: int, frames: int = 0) -> int:
    """The frames a session's KV cache is allocated for: the attention window (the current block
    included), or `frames` (`most_held_frames`; 0 for a live video: unbounded) where that is
    shorter, but never fewer than `least` (the sinks and one block). A video that fits never
    evicts, so attention, sinks and re-caches see the frames a full window would hold."""
    return window if frames <= 0 else min(window, max(frames, least))
