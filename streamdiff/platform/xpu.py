"""The XPU platform (Intel GPUs; oneCCL collectives)."""

from __future__ import annotations

from .accel import AcceleratorPlatform


class XpuPlatform(AcceleratorPlatform):
    kind = runtime_name = "xpu"
    # Arc parts without native fp64 raise on float64 kernels unless emulation is switched on;
    # none is asked for on any XPU.
    float64 = False


PLATFORM = XpuPlatform
