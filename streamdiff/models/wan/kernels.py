"""How the Wan VAE decoder runs on a device (worker processes): the CPU kernels, the memory
layout, and the per-block decode plan that every shard of a VAE group shares.

The model definition (vae.py) says what is computed; this module says how, per device:

- On the CPU, PyTorch's conv3d falls back to a slow im2col kernel (docs/models.md#model-core-models),
  so a 3D conv runs as one conv2d per temporal tap, summed; 1x1 convs run as a matmul over
  channels (PyTorch's 1x1 CPU conv returns channels-first and would push every later op off
  oneDNN's fast path); activations stay frames-major channels-last. Elsewhere the native ops and
  the default layout are used.
- On the CPU a block is decoded a few latent frames per call so the full-resolution activations
  stay in cache (the causal cache makes this exact). That choice, and the row bands of a VAE
  group, form a `DecodePlan` computed from the block's global shape alone: every rank of a group
  derives the same plan, so neighbours run the same number of halo exchanges with the same
  shapes (a plan per band once made neighbours disagree, and gloo aborted the whole group).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .rows import split_rows

# CPU decode works on about this many bytes of full-resolution activations per call (a few latent
# frames; the estimate counts input, output and the conv buffer): what stays in cache. It separates
# the measured sizes: at 416x240 one latent frame per call beat three, at 256x144 three beat one.
CPU_DECODE_WORKING_SET_BYTES = 48 * 2**20

# ----------------------------------------------------------------------------- the block plan


@dataclass(frozen=True)
class DecodePlan:
    """How a group decodes one block; identical on every rank (a function of the global shape)."""

    bands: tuple[tuple[int, int], ...]  # latent rows [r0, r1) of each rank
    frames_per_call: int  # latent frames decoded per call (as many as the working set holds)

    def rows(self, rank: int) -> tuple[int, int]:
        return self.bands[rank]


def plan_block(
    latent_shape: tuple[int, ...],
    world: int,
    device_type: str,
    base_dim: int,
    spatial_factor: int,
    temporal_factor: int,
    element_size: int,
    working_set_bytes: int = CPU_DECODE_WORKING_SET_BYTES,
    batch: int = 1,
    weights: tuple[float, ...] | None = None,
) -> DecodePlan:
    """The plan for `batch` blocks of normalised latents shaped (..., T, h, w) decoded together
    by `world` shards, with bands in proportion to `weights` (None: equal).

    The chunk size is sized for the largest band, so a group's chunking is what its busiest
    shard needs and every shard agrees on it. The same rule on every device, with the device's
    working set (`Platform.decode_working_set`: the CPU's cache, a share of an accelerator's
    free memory)."""
    t, h, w = latent_shape[-3:]
    bands = tuple(split_rows(h, world, weights))
    rows = max(r1 - r0 for r0, r1 in bands)
    px = rows * spatial_factor * w * spatial_factor
    per_frame = base_dim * temporal_factor * px * element_size * 3 * batch
    return DecodePlan(bands, max(1, min(t, working_set_bytes // per_frame)))


# ----------------------------------------------------------------------------- layout


def frames(x: torch.Tensor) -> torch.Tensor:
    """(B, C, T, H, W) -> (B*T, C, H, W); a view for channels_last_3d tensors with B == 1."""
    b, c, t, h, w = x.shape
    return x.transpose(1, 2).reshape(b * t, c, h, w)


def unframes(y: torch.Tensor, b: int) -> torch.Tensor:
    """(B*T, C, H, W) -> (B, C, T, H, W); a view."""
    n, c, h, w = y.shape
    return y.view(b, n // b, c, h, w).transpose(1, 2)


def layout(x: torch.Tensor) -> torch.memory_format:
    """Channels-last (frames-major for 5D) on the CPU, oneDNN's fast path; the default elsewhere."""
    if x.device.type != "cpu":
        return torch.contiguous_format
    return torch.channels_last_3d if x.dim() == 5 else torch.channels_last


def empty(shape, like: torch.Tensor) -> torch.Tensor:
    """A fresh tensor of `like`'s dtype and device in the device's layout."""
    fmt = layout(like) if like.dim() in (4, 5) and len(shape) == like.dim() else torch.contiguous_format
    return torch.empty(tuple(shape), dtype=like.dtype, device=like.device, memory_format=fmt)


def cat_frames(prev: torch.Tensor | None, x: torch.Tensor, pad: int) -> torch.Tensor:
    """[prev; x] along time in a fresh tensor of the device's layout; prev=None means `pad`
    zero frames. Explicit because torch.cat and clone pick a layout from their inputs, and a
    one-frame tensor is ambiguous between channels-first and channels-last."""
    b, c, t, h, w = x.shape
    n = pad if prev is None else prev.shape[2]
    out = empty((b, c, n + t, h, w), x)
    if prev is None:
        out[:, :, :n].zero_()
    else:
        out[:, :, :n] = prev
    out[:, :, n:] = x
    return out


# ----------------------------------------------------------------------------- convolutions


def conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    padding: tuple[int, int] = (0, 0),
    checkpoint: Callable[[], None] | None = None,
) -> torch.Tensor:
    """conv2d over frames that keeps the CPU's channels-last layout (1x1: a matmul).

    `checkpoint`: called before the CPU conv when given: the CPU platform's shared cores
    (platform/cpu_lending.py) change a worker's thread count there (the decoder's `checkpoint`,
    set by the worker). A full-resolution 3D conv of the tiny preset's 256x144 block takes up
    to 38 ms on one EPYC core, long beside the DiT's idle spells of about 20 ms."""
    if x.device.type != "cpu":
        return F.conv2d(x, weight, bias, padding=padding)
    if checkpoint is not None:
        checkpoint()
    cl = torch.channels_last
    if weight.shape[2] == weight.shape[3] == 1:
        y = F.linear(x.contiguous(memory_format=cl).permute(0, 2, 3, 1), weight.flatten(1), bias)
        return y.permute(0, 3, 1, 2)
    return F.conv2d(x.contiguous(memory_format=cl), weight.contiguous(memory_format=cl), bias, padding=padding)


def conv3d_valid_t(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    h_pad: int,
    w_pad: int,
    checkpoint: Callable[[], None] | None = None,
) -> torch.Tensor:
    """3D conv with no temporal padding (the causal frames are already in x), zero padding in
    H and W as given; on the CPU one conv2d per temporal tap over all frames, summed."""
    if x.device.type != "cpu":
        return F.conv3d(x, weight, bias, padding=(0, h_pad, w_pad))
    kt = weight.shape[2]
    b, t = x.shape[0], x.shape[2] - kt + 1
    out = None
    for dt in range(kt):
        b_dt = bias if dt == 0 else None
        y = conv2d(frames(x[:, :, dt : dt + t]), weight[:, :, dt], b_dt, (h_pad, w_pad), checkpoint)
        out = y if out is None else out.add_(y)
    return unframes(out, b)
