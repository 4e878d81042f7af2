"""What a DiT engine's blocks are conditioned on besides their noise, behind one interface: each
conditioning has its own check of a block, its part of a scene's start, and its preparation of
each block (as vLLM's models declare what they support and the engine asks).

- `TextPrompt`: the scene's prompt through the text encoder into the cross-attention cache.
- `ImageContext`: Matrix-Game's: no text; a shot starts from a picture (its CLIP tokens are the
  context, the VAE encoder's latents of it lie beside every block's noise) and every block takes
  its actions (image_condition.py).
- `ImageBlock`: image-to-video as Causal Forcing's framewise and Self-Forcing's scripts do it:
  the picture's latent is the shot's first block, of one latent frame, committed to the cache.
- `FirstFrame`: LongLive 2.0's: the picture's latent is the first latent frame of the shot's
  first block, held at t = 0 through every step (that block runs in a batch of its own).
- `Camera`: minWM's PRoPE: every block takes its camera, a row per latent frame.

The engine builds its list once (`conditionings_for`, from the card and the model) and asks each
in turn; it does not branch on which it has.
"""

from __future__ import annotations

import numpy as np
import torch

from ..card import ModelCard
from ..controls import SPACES, Space, camera_row
from .blocks import CAMERA_ROW, BlockOrder, BlockRefused, rows_fit
from .image_condition import ImageCondition


class Conditioning:
    """The hooks, each a no-op here: a conditioning overrides those it has."""

    takes: frozenset[str] = frozenset()  # what a block may bring it: "image", "actions", "camera"
    own_block = False  # whether a start picture is a block of its own (`start_image` makes its latent)

    def check(self, card: ModelCard, order: BlockOrder) -> None:
        """BlockRefused where the block is not one it can condition (torch-free)."""

    def scene(self, eng, sess, prompt: str, new_shot: bool, image: torch.Tensor | None) -> None:
        """Its part of a scene's start (after the caches and the noise: DiTEngine.set_scene)."""

    def start_image(self, eng, sess, image: torch.Tensor):
        """What a start picture costs at a shot's start, once (the profile times it)."""

    def prepare(self, eng, sess, frames: int, order: BlockOrder | None) -> None:
        """Its part of the session's next block, on the session's DiT state, before the denoise
        (`order`: the block's, with its controls; None: none given)."""

    def alone(self, sess) -> bool:
        """Whether the session's next block must run in a batch of its own."""
        return False

    def hold(self, sess) -> torch.Tensor | None:
        """A latent the block's first frames are held at through every step (taken by this block)."""
        return None


def picture(eng, sess, image: torch.Tensor) -> torch.Tensor:
    """A start picture checked against the video: (H, W, 3) uint8 at its size."""
    h, w = sess.latent_hw
    f = eng.preset.vae.spatial_factor
    if tuple(image.shape) != (h * f, w * f, 3) or image.dtype != torch.uint8:
        raise ValueError(f"the image is {tuple(image.shape)} {image.dtype}, not ({h * f}, {w * f}, 3) uint8")
    return image


def to_unit(image: torch.Tensor) -> torch.Tensor:
    """(H, W, 3) uint8 -> (1, 3, 1, H, W) in [-1, 1], as the VAE encoder takes a picture."""
    return image.permute(2, 0, 1)[None, :, None].float() / 127.5 - 1.0


class TextPrompt(Conditioning):
    def scene(self, eng, sess, prompt, new_shot, image) -> None:
        if new_shot or prompt != sess.prompt:
            eng.model.set_prompt(sess.state, eng.encode_prompt(prompt))
            sess.prompt = prompt


def check_shot_start(order: BlockOrder) -> None:
    if order.image is not None and not order.new_shot:
        raise BlockRefused("an image starts a shot: it comes with the shot's first block")


class ImageContext(Conditioning):
    def __init__(self, space: Space | None, encoder, clip) -> None:
        self.space, self.encoder, self.clip = space, encoder, clip
        self.takes = frozenset({"image", "actions"} if space is not None else {"image"})

    def check(self, card, order) -> None:
        check_shot_start(order)
        if order.new_shot and order.image is None:
            raise BlockRefused(f"model {card.name!r} starts every shot from an image")
        width = len(self.space.keys) + (2 if self.space.mouse else 0) if self.space else 0
        if order.actions and not rows_fit(order.actions, order.frames, width):
            raise BlockRefused(f"an action model's block needs {order.frames} finite action rows of {width} values")

    def scene(self, eng, sess, prompt, new_shot, image) -> None:
        """The prompt is ignored: a cut starts from `image`, or, where none is given (the
        calibration's and the profile's shots), from a blank picture."""
        if new_shot:
            h, w = (n * eng.preset.vae.spatial_factor for n in sess.latent_hw)
            self.start_image(eng, sess, image if image is not None else torch.zeros(h, w, 3, dtype=torch.uint8))

    @torch.no_grad()
    def start_image(self, eng, sess, image) -> None:
        """The picture gives the shot's context (its CLIP tokens through `img_emb`) and the first
        of its conditioning latents (the VAE encoder's first chunk); every block after is
        conditioned on the latents of zero frames after it, encoded as the blocks come."""
        picture(eng, sess, image)
        if sess.shot_blocks or sess.state.next_frame:
            raise ValueError("an image starts a shot: it must come before the shot's first block")
        eng.model.set_prompt(sess.state, self.clip.encode(image))
        sess.conditioned["image_context"] = ImageCondition(self.encoder, image)

    def prepare(self, eng, sess, frames, order) -> None:
        """The block's mask and latents beside its noise, and its actions (the idle action
        where the block brings none)."""
        cond = sess.conditioned.get("image_context")
        if cond is None:
            raise ValueError("an image model's shot needs its image first")
        st, actions = sess.state, (order.actions if order is not None else None) or None
        st.cond, st.actions = cond.block(st.next_frame, frames, eng.model.cfg.action, actions)


class ImageBlock(Conditioning):
    takes = frozenset({"image"})
    own_block = True

    def __init__(self, encoder) -> None:
        self.encoder = encoder

    def check(self, card, order) -> None:
        if order.image is not None and (not order.new_shot or order.frames != 1 or card.sampler == "rolling"):
            raise BlockRefused("an image is a shot's first block of one latent frame (no rolling sampler)")

    @torch.no_grad()
    def start_image(self, eng, sess, image) -> torch.Tensor:
        """As the authors' `initial_latent`: the picture encoded into the shot's first latent
        frame, committed to the KV cache with one forward at t = 0 at position 0 (1 after a
        position canvas, which holds 0); returned (1, C, 1, h, w) float32 on the CPU: the shot's
        first block, which the VAE decodes as the video's first frame. After the cut's scene
        start (with the noise of the blocks after this one: the authors draw F - 1 frames)."""
        picture(eng, sess, image)
        if sess.shot_blocks or sess.state.next_frame != int(eng.preset.sampler.canvas):
            raise ValueError("an image starts a shot: it must be the shot's first block")
        dev = eng.model.patch_embedding.weight.device
        # the authors' generator takes the latent in the model's dtype (they encode under bf16)
        z = self.encoder.encode_image(to_unit(image)).to(dev, eng.noise_dtype).float()
        eng.model.forward_block(z, torch.zeros(1, 1, device=dev), sess.state, True)
        return z.cpu()


class FirstFrame(Conditioning):
    takes = frozenset({"image"})

    def __init__(self, encoder) -> None:
        self.encoder = encoder

    def check(self, card, order) -> None:
        check_shot_start(order)

    def scene(self, eng, sess, prompt, new_shot, image) -> None:
        if new_shot:  # held as the first latent frame of the shot's first block, at t = 0
            sess.conditioned["first_frame"] = self.start_image(eng, sess, image) if image is not None else None

    def start_image(self, eng, sess, image) -> torch.Tensor:
        """The picture through the VAE encoder: (1, C, 1, h, w) float32 on the model's device, by
        way of the model's dtype (the authors encode under bf16)."""
        picture(eng, sess, image)
        dev = eng.model.patch_embedding.weight.device
        return self.encoder.encode_image(to_unit(image)).to(dev, eng.noise_dtype).float()

    def alone(self, sess) -> bool:
        return sess.conditioned.get("first_frame") is not None

    def hold(self, sess) -> torch.Tensor | None:
        return sess.conditioned.pop("first_frame", None)


class Camera(Conditioning):
    takes = frozenset({"camera"})

    def check(self, card, order) -> None:
        if not rows_fit(order.camera, order.frames, CAMERA_ROW):
            raise BlockRefused(f"a camera model's block needs {order.frames} finite camera rows of {CAMERA_ROW} values")

    def prepare(self, eng, sess, frames, order) -> None:
        """The block's camera on the session's DiT state, where every pass of the block reads it
        (standing still where the shot is, with none given)."""
        rows = (order.camera if order is not None else None) or [camera_row(np.eye(4))] * frames
        if len(rows) != frames:
            raise ValueError(f"a camera of {len(rows)} latent frames for a block of {frames}")
        sess.state.camera = torch.tensor(rows, dtype=torch.float32)


def conditionings_for(card: ModelCard, encoder=None, clip=None) -> list[Conditioning]:
    """A model's conditionings, in the order the engine asks them: its context (the prompt, or
    Matrix-Game's picture and actions), how a picture starts a shot, its camera. `encoder`,
    `clip`: the VAE encoder and the image encoder, where the card's image mode loads them (None:
    for the checks alone)."""
    space = SPACES.get(card.controls)
    camera = space is not None and space.camera
    if camera and card.recache != "never":  # the held frames' cameras are not kept
        raise ValueError(f"model {card.name!r} takes a camera and cannot re-cache: sampler.recache must be 'never'")
    if card.image == "condition":
        context: Conditioning = ImageContext(None if camera else space, encoder, clip)
    else:
        context = TextPrompt()
    image = {"block": ImageBlock, "first_frame": FirstFrame}.get(card.image)
    return [context, *([image(encoder)] if image else []), *([Camera()] if camera else [])]
