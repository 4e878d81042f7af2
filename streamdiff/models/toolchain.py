"""What torch.compile needs from the machine, and whether `--compile` compiles (no torch at
import: the supervisor refuses `--compile on` at start with it, before any worker loads).

Inductor compiles C++ for the CPU (its `$CXX`, else g++) and Triton kernels for GPUs, whose
launchers Triton builds with a C compiler (`$CC`, else gcc or clang). A slim image without
them fails at the first compiled call, inside calibration: with `auto` that is eager, said in
the log and /health; with `on` the daemon refuses to start, naming what is missing."""

from __future__ import annotations

import importlib.util
import os
import shutil

MODES = ("auto", "on", "off")


def missing(device_type: str) -> str | None:
    """What this machine lacks for inductor on `device_type` ("cpu", "cuda", "xpu"), or None."""
    if device_type == "cpu":
        cxx = os.environ.get("CXX") or "g++"
        if shutil.which(cxx) is None:
            return f"a C++ compiler for inductor's CPU kernels ({cxx!r}: $CXX, else g++)"
        return None
    if importlib.util.find_spec("triton") is None:
        return "Triton (the triton package: inductor's GPU kernels)"
    cc = os.environ.get("CC")
    if (shutil.which(cc) if cc else shutil.which("gcc") or shutil.which("clang")) is None:
        return (
            f"a C compiler for Triton's kernel launchers ({cc!r} from $CC)"
            if cc
            else ("a C compiler for Triton's kernel launchers ($CC, gcc or clang)")
        )
    return None


class CompileUnavailable(ValueError):
    """`--compile on` where torch.compile cannot work: names what is missing."""


def decide(mode: str, device_type: str) -> tuple[bool, str]:
    """(compile, why) for `--compile mode` on `device_type`. `off`: eager. `on`: compiled, or
    CompileUnavailable naming what is missing. `auto`: compiled on accelerators where nothing is
    missing (a compile error later still falls back to eager: `compiled.Compiler`); eager on the
    CPU, where compiled blocks measured little faster than eager (docs/models.md#model-core-models)."""
    if mode not in MODES:
        raise ValueError(f"compile must be auto, on or off, got {mode!r}")
    if mode == "off":
        return False, "off"
    lack = missing(device_type)
    if mode == "on":
        if lack:
            raise CompileUnavailable(
                f"--compile on: torch.compile on {device_type} needs {lack}, and this machine has none; "
                "install it, or use --compile auto (eager where it cannot compile) or off"
            )
        return True, "on"
    if device_type == "cpu":
        return False, "auto: eager on the CPU"
    if lack:
        return False, f"auto: eager, torch.compile needs {lack}"
    return True, "auto"
