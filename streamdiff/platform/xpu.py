"""The XPU platform (Intel GPUs; oneCCL collectives)."""

from __future__ import annotations

from .accel import AcceleratorPlatform


class XpuPlatform(AcceleratorPlatform):
    kind = runtime_name = "xpu"


PLATFORM = XpuPlatform
