"""The one copy off an accelerator: into page-locked (pinned) memory, issued non-blocking (a DMA
with no staging copy) and waited for once, where the caller needs the result. On the CPU the
tensor is the result itself."""

from __future__ import annotations

import torch


def to_host(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as `dtype` on the CPU, with its layout (make it contiguous on the device first)."""
    if x.device.type == "cpu":
        return x.to(dtype)
    out = torch.empty(x.shape, dtype=dtype, pin_memory=True)
    out.copy_(x, non_blocking=True)
    getattr(torch, x.device.type).current_stream(x.device).synchronize()
    return out
