"""torch.compile in this process: whether `--compile` compiles on a device, and what it has
compiled so far (dynamo's counters)."""

from __future__ import annotations

import sys

import torch


def use_compile(mode: str, device: str | torch.device) -> bool:
    """Whether `--compile mode` compiles on this device. `auto`: on accelerators; not on the CPU,
    where compiled blocks measured little faster than eager (docs/design.md#model-core-models)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"compile must be auto, on or off, got {mode!r}")
    return mode == "on" or (mode == "auto" and torch.device(device).type != "cpu")


def compile_stats() -> dict:
    """What torch.compile did in this process so far: graphs compiled (a recompile is one more
    graph of a function already compiled) and seconds spent compiling (dynamo's counters).
    Nothing, without importing dynamo, where nothing imported it: torch.compile does, and dynamo's
    import alone costs about 1.5 s of a worker's start on a CPU."""
    if "torch._dynamo" not in sys.modules:
        return {"graphs": 0, "compile_s": 0.0}
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "compile_s": round(sum(compilation_time_metrics.get("_compile.compile_inner", [])), 3),
    }
