"""The platform seam: the one place that knows the device kind (cpu, cuda, xpu).

A worker selects its platform once (`select(device)`); everything else asks it: how to wait for
the device (`sync`), how to time a stage's own work and its waits on collectives (`stopwatch`,
`wait_clock`), what memory its sessions may hold (`memory_budget`), how the process is set up
(`setup_process`). The CPU's own mechanisms (core lending, the conv checkpoint, affinity,
SCHED_IDLE, the profile's idle sleeps) live in `cpu` and `cpu_lending` and are reached only
through the CPU platform; GPU code never passes through them.

Importing this package does not import torch: the supervisor uses `KINDS`, `devices` (run in a
child on accelerators, so the supervisor never holds an accelerator context) and
`cpu_lending.HostSlot`. Each device kind's module imports torch when it is selected.
"""

from __future__ import annotations

import importlib

from .base import KINDS, Platform, kind_of

_platforms: dict[str, Platform] = {}
_current: Platform | None = None


def for_device(device: str) -> Platform:
    """The platform of a device ("cpu", "cuda", "cuda:1", "xpu:0"), one instance per device."""
    if device not in _platforms:
        kind = kind_of(device)
        mod = importlib.import_module(f"{__name__}.{kind}")
        _platforms[device] = mod.PLATFORM(device)
    return _platforms[device]


def select(device: str) -> Platform:
    """This process's device: made current on its runtime (accelerators) and for `current()`."""
    global _current
    plat = for_device(device)
    plat.select()
    _current = plat
    return plat


def current() -> Platform:
    """The platform `select` chose in this process (the CPU's before any)."""
    return _current or for_device("cpu")


__all__ = ["KINDS", "Platform", "current", "for_device", "kind_of", "select"]
