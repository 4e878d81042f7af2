"""What devices of a kind this machine has, asked without an accelerator context here (the
supervisor's side: placement and the profile cache).

On the CPU the answers come from this process (its cores, /proc/cpuinfo). An accelerator's
runtime would create a context in whichever process asks it (the supervisor must hold none:
it forks nothing that runs torch, and a context costs memory on every device), so the question
goes to a spawned child once per process and kind.
"""

from __future__ import annotations

import functools
import os
import platform as _stdlib_platform
from dataclasses import dataclass
from pathlib import Path

from .base import kind_of


@dataclass(frozen=True)
class Devices:
    count: int  # devices this daemon may use: cores it may run on (CPU), or visible accelerators
    name: str  # the CPU's model, or the first accelerator's name
    memory_bytes: int = 0  # one accelerator's total memory; 0 on the CPU or where the runtime does not say


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _stdlib_platform.processor() or _stdlib_platform.machine()


def _accelerator(kind: str) -> Devices:
    """In the child: the runtime's own answers."""
    import torch

    rt = getattr(torch, kind, None)
    if rt is None or not rt.is_available():
        return Devices(0, "")
    mem = int(rt.get_device_properties(0).total_memory) if hasattr(rt, "get_device_properties") else 0
    return Devices(rt.device_count(), rt.get_device_name(0), mem)


def _ask(kind: str) -> Devices:
    try:
        return _accelerator(kind)
    except Exception as exc:  # reported in the parent
        raise RuntimeError(f"asking the {kind} runtime failed: {exc!r}") from None


@functools.cache
def devices(kind: str) -> Devices:
    kind = kind_of(kind)
    if kind == "cpu":
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return Devices(n, cpu_model())
    from ..spawn import in_child

    return in_child(_ask, kind)


def device_count(kind: str) -> int:
    return devices(kind).count


def device_memory(kind: str) -> int:
    return devices(kind).memory_bytes


def device_name(kind: str) -> str:
    return devices(kind).name
