"""Quantized checkpoints, recognised so that they are refused by name (models/presets.py
`build_dit`) rather than loaded, or cast, as if their tensors were the model's weights."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .loading import CheckpointError

# Quantized releases (LongLive 2.0's NVFP4 repositories, TorchAO or TransformerEngine FP8 files)
# hold codes and scales for GPU kernels this project does not carry, not the model's weights:
# refused by name (`refuse_quantized`) rather than loaded, or cast, as if they were.
_FLOAT8 = {
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, n)
}
_FLOAT4 = {getattr(torch, n) for n in ("float4_e2m1fn_x2",) if hasattr(torch, n)}


def refuse_quantized(sd: Mapping, origin: str) -> None:
    """A `CheckpointError` naming what makes `sd` a quantized checkpoint, if it is one: NVFP4's
    4-bit codes (FourOverSix's `quantized_weight_*` buffers, or float4 tensors), or FP8 tensors."""
    tail = "; streamdiff serves BF16, FP16 or FP32 weights (LongLive 2.0: its model_bf16.pt)"
    codes = [k for k in sd if "quantized_weight" in k]
    fp4 = [k for k, v in sd.items() if getattr(v, "dtype", None) in _FLOAT4]
    if codes or fp4:
        raise CheckpointError(
            f"{origin} is an NVFP4 checkpoint ({(codes or fp4)[0]}: 4-bit codes): it needs NVFP4 kernels on a "
            f"Blackwell GPU (TransformerEngine or FourOverSix), which streamdiff does not carry{tail}"
        )
    fp8 = [k for k, v in sd.items() if getattr(v, "dtype", None) in _FLOAT8]
    if fp8:
        raise CheckpointError(
            f"{origin} holds FP8 weights ({fp8[0]}: {sd[fp8[0]].dtype}): they need FP8 kernels on a GPU "
            f"(TorchAO on SM 8.9 or newer), which streamdiff does not carry{tail}"
        )
