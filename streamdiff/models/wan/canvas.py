"""The position canvas (SamplerConfig.canvas): a latent frame that tells a Wan DiT where in the
picture each of its tokens is.

A Wan DiT has no absolute position: RoPE is relative and the patch embedding a strided
convolution, so on a shot's first block, pure noise with nothing before it, every place looks
like every other, and a prompt's object has nowhere to be drawn. Published models learn to break
that symmetry by distillation; the trained tiny default (issue 36) is trained by flow matching
alone, and cannot (docs/models.md#model-core-models). Committed
to the KV cache at t = 0 before the first block, as an image-to-video start latent is, the
canvas gives each token the sine and cosine of its column and row, at four frequencies: a token
reads its place from the canvas token at its own (y, x) in the frame before, which is what a
DiT continuing a video does anyway. The canvas is held as the shot's sink frame and never
decoded; its values do not depend on the frame size, so any size gets its own.
"""

from __future__ import annotations

import math

import torch


def position_canvas(channels: int, height: int, width: int, device=None) -> torch.Tensor:
    """(1, channels, 1, height, width) float32: channel 4(f-1)+{0,1,2,3} holds sin and cos of
    pi f x and of pi f y, f = 1 .. channels / 4, at the latent pixels' centres (x, y in (0, 1))."""
    if channels % 4:
        raise ValueError(f"a position canvas needs a multiple of 4 channels, not {channels}")
    y = (torch.arange(height, device=device, dtype=torch.float32) + 0.5) / height
    x = (torch.arange(width, device=device, dtype=torch.float32) + 0.5) / width
    planes = []
    for f in range(1, channels // 4 + 1):
        for along_x in (True, False):
            a = math.pi * f * (x[None, :] if along_x else y[:, None])
            planes += [torch.sin(a).expand(height, width), torch.cos(a).expand(height, width)]
    return torch.stack(planes)[None, :, None]


def commit_canvas(model, state, height: int, width: int, context_t: float = 0.0) -> None:
    """Commit the canvas to a fresh shot's KV cache at t = `context_t` under its prompt (set
    first), as its frame 0: what the daemon does at every cut and the evaluation does per video."""
    dev = model.patch_embedding.weight.device
    start = position_canvas(model.cfg.out_channels, height, width, dev)
    model.forward_block(start, torch.full((1, 1), float(context_t), device=dev), state, True)
