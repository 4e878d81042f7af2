"""torch.compile in this process: the functions it compiles, eager again at a compile error
where `--compile auto` allows it, and what it has compiled so far (dynamo's counters).
Whether it compiles at all is `toolchain.decide`'s."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import torch

from . import toolchain

log = logging.getLogger("streamdiff.worker")

BACKEND = "inductor"


class Compiler:
    """What `--compile` made of one model's functions (`wrap`): compiled, with dynamic shapes
    (a block's token count, frame count and batch are symbols, so a new size or batch reuses the
    graph; dynamo specialises a size of 1, so those compile once more), or eager.

    `auto` (not `strict`): the first compile error (no C compiler, no Triton, an inductor bug)
    turns every function of the model eager for good, and the call is run again eagerly;
    `fallback` says why, for the log and /health. `on` (`strict`) raises it: the worker fails at
    start (calibration compiles), naming it. A device out of memory while compiling (inductor's
    autotuning allocates; dynamo wraps the error as a backend's) is no compile error: the
    out-of-memory error itself is raised, for the worker's memory path, and compile stays on."""

    def __init__(self, mode: str, device: str | torch.device, backend: str | None = None) -> None:
        self.mode = mode
        self.on, self.why = toolchain.decide(mode, torch.device(device).type)
        self.strict = mode == "on"
        self.backend = backend or BACKEND
        self.fallback: str | None = None

    @property
    def active(self) -> bool:
        """Compiled functions run (compiled and not fallen back)."""
        return self.on and self.fallback is None

    def wrap(self, fn: Callable) -> Callable:
        if not self.on:
            return fn
        compiled = torch.compile(fn, backend=self.backend, dynamic=True)

        def run(*args):
            if self.fallback is None:
                try:
                    return compiled(*args)
                except Exception as exc:
                    oom = out_of_memory(exc)
                    if oom is not None and oom is not exc:
                        raise oom from exc  # the memory path's, not a reason to run eager
                    if self.strict or not is_compile_error(exc):
                        raise
                    self.fallback = describe_error(exc)
                    log.warning("torch.compile failed; running eager from now on (--compile auto): %s", self.fallback)
            return fn(*args)

        run.__wrapped__ = fn
        return run

    def report(self) -> dict:
        """For the log, /health and /v1/models: the mode, whether it runs compiled, and why not."""
        out = {"mode": self.mode, "on": self.active, **compile_stats()}
        if not self.on:
            out["why"] = self.why
        if self.fallback:
            out["fallback"] = self.fallback
        return out


def describe_error(exc: BaseException) -> str:
    """One line: the compile error and what caused it (dynamo wraps a backend's own error)."""
    inner = getattr(exc, "inner_exception", None) or exc.__cause__
    lines = str(inner if inner is not None else exc).strip().splitlines() or [""]
    cause = f" ({type(inner).__name__}: {lines[0][:300]})" if inner is not None else f": {lines[0][:300]}"
    return type(exc).__name__ + cause


def out_of_memory(exc: BaseException) -> BaseException | None:
    """The device's out-of-memory error in `exc` or what it wraps (dynamo's `inner_exception`,
    a cause, a context), if any."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if type(exc).__name__ == "OutOfMemoryError":  # torch's, for CUDA and XPU
            return exc
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return None


def is_compile_error(exc: BaseException) -> bool:
    """An error of torch.compile's own making (dynamo, a backend, inductor's C++ or Triton build),
    not of the computation it runs (an out-of-memory error, a bad shape, a device fault), even
    where it happened while compiling."""
    if "torch._dynamo" not in sys.modules or out_of_memory(exc) is not None:
        return False
    from torch._dynamo.exc import TorchDynamoException

    if isinstance(exc, TorchDynamoException):
        return True
    inductor = sys.modules.get("torch._inductor.exc")
    return inductor is not None and isinstance(exc, (inductor.InductorError, inductor.InvalidCxxCompiler))


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
