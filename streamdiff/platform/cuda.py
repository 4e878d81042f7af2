"""The CUDA platform (NCCL collectives)."""

from __future__ import annotations

from .accel import AcceleratorPlatform


class CudaPlatform(AcceleratorPlatform):
    kind = runtime_name = "cuda"


PLATFORM = CudaPlatform
