"""Matrix-Game's conditioning of every block on the shot's start picture (DiT worker process).

Beside each block's noise the DiT takes 20 channels: a 4-channel mask (1 on the shot's first
latent frame) and the conditioning latents of the VAE encoder run over the start picture and
then frames of zeros, four frames a latent frame (the release encodes that whole video up front;
we encode it as the blocks come, equal by tests/models/test_vae_encoder.py). And its actions,
from every latent frame's action so far (`action.block_actions`). One `ImageCondition` per
session's shot; the engine (`conditionings.ImageContext.start_image`) makes it and puts each block's
conditioning on the session's DiT state.
"""

from __future__ import annotations

import torch

from .wan.action import ActionConfig, BlockActions, block_actions
from .wan.vae_encoder import WanVAEEncoder


class ImageCondition:
    """One shot's conditioning: the encoder's causal state over the start picture then frames of
    zeros, the picture's latent until the first block takes it, the zeros' latent once the
    encoder's state stops changing (from then on every later one equals it, bit for bit, and is
    reused), and every latent frame's action so far."""

    def __init__(self, encoder: WanVAEEncoder, image: torch.Tensor) -> None:
        """`image`: (H, W, 3) uint8 at the video's size."""
        self.encoder = encoder
        self.size = tuple(image.shape[:2])
        x = image.permute(2, 0, 1)[None, :, None].float() / 127.5 - 1.0  # (1, 3, 1, H, W) in [-1, 1]
        self.state = encoder.new_state()
        self.image: torch.Tensor | None = encoder.encode_chunk(x, self.state)
        self.steady: torch.Tensor | None = None
        self.actions: list[tuple[list[float], list[float]]] = []

    def _next_latent(self) -> torch.Tensor:
        """The next latent frame's conditioning latent: the picture's first, then the zeros'."""
        if self.state.latent_frames == 1 and self.image is not None:
            out, self.image = self.image, None
            return out
        if self.steady is not None:
            return self.steady
        dev = self.encoder.conv1.weight.device
        # The encoder replaces its cache's tensors (never writes into them): the old ones, kept by
        # reference, are what it held before; one host read decides whether any changed.
        before = list(self.state.cache)
        z = self.encoder.encode_chunk(torch.zeros(1, 3, 4, *self.size, device=dev), self.state)
        if all(a is not None for a in before):
            changed = torch.stack([(a != b).any() for a, b in zip(before, self.state.cache, strict=True)]).any()
            if not changed.item():
                self.steady = z
        return z

    def block(
        self, start: int, frames: int, action: ActionConfig | None, rows: list[list[float]] | None
    ) -> tuple[torch.Tensor, BlockActions | None]:
        """A block of `frames` latent frames from frame `start` of the shot: its (1, 20, f, h, w)
        mask and latents, and its actions (`rows`, one a latent frame: the keyboard's multi-hot
        then the mouse; None: the idle action)."""
        z = torch.cat([self._next_latent() for _ in range(frames)], dim=2)  # (1, 16, f, h, w)
        mask = torch.zeros(1, 4, frames, *z.shape[3:], device=z.device)
        if start == 0:
            mask[:, :, 0] = 1
        if action is None:
            return torch.cat([mask, z], dim=1), None
        rows = rows or [[0.0] * action.keyboard_dim + [0.0, 0.0] * action.mouse] * frames
        if len(rows) != frames:
            raise ValueError(f"actions for {len(rows)} latent frames in a block of {frames}")
        self.actions += [(r[: action.keyboard_dim], r[action.keyboard_dim :] or [0.0, 0.0]) for r in rows]
        return torch.cat([mask, z], dim=1), block_actions(action, self.actions, start, frames, z.device)
