"""--compile: `on` refused where torch.compile cannot work, naming what is missing; `auto` eager
on a compile error, saying why (models/toolchain.py, models/compiled.py). The failure is injected
as a dynamo backend that raises as inductor does without a C compiler: dynamo's own error path."""

from __future__ import annotations

import pytest
import torch

from streamdiff.models import compiled, toolchain
from streamdiff.models.engines import DiTEngine
from streamdiff.models.spec import ModelSpec


def no_compiler(gm, example_inputs):
    raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found in torch._inductor.config.cpp.cxx")


def test_on_is_refused_by_what_is_missing_and_auto_runs_eager(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(toolchain.CompileUnavailable, match=r"needs a C\+\+ compiler .*'/nonexistent/g\+\+'"):
        toolchain.decide("on", "cpu")
    assert toolchain.decide("auto", "cpu") == (False, "auto: eager on the CPU")
    assert toolchain.decide("off", "cuda") == (False, "off")
    monkeypatch.delenv("CXX")
    assert toolchain.decide("on", "cpu") == (True, "on")  # g++ is here
    if toolchain.missing("cuda"):  # this CPU build has no Triton
        with pytest.raises(toolchain.CompileUnavailable, match="needs Triton"):
            toolchain.decide("on", "cuda")
        on, why = toolchain.decide("auto", "cuda")
        assert not on and why.startswith("auto: eager, torch.compile needs Triton")
    with pytest.raises(ValueError, match="compile must be auto, on or off"):
        toolchain.decide("yes", "cpu")


@pytest.fixture
def wanted_but_failing(monkeypatch):
    """`auto` as on an accelerator with its toolchain (it compiles), and a compile that fails."""
    real = toolchain.decide
    monkeypatch.setattr(toolchain, "decide", lambda mode, kind: (True, mode) if mode == "auto" else real(mode, kind))
    monkeypatch.setattr(compiled, "BACKEND", no_compiler)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_auto_serves_eager_after_a_compile_error_and_says_so(wanted_but_failing):
    spec = ModelSpec(preset="tiny-random", dtype="float32")
    eager = DiTEngine(ModelSpec(preset="tiny-random", dtype="float32", compile="off"))
    auto = DiTEngine(spec)
    assert auto.compiler.on and auto.compiler.fallback is None
    outs = []
    for eng in (eager, auto):
        s = eng.open_session(128, 64, seed=3)
        eng.set_scene(s, "a red ball", new_shot=True)
        outs.append([eng.generate_block(s, 3) for _ in range(2)])
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    assert "BackendCompilerFailed" in auto.compiler.fallback and "No working C++ compiler" in auto.compiler.fallback
    report = auto.compiler.report()
    assert report["mode"] == "auto" and report["on"] is False and report["fallback"] == auto.compiler.fallback


def test_on_raises_the_compile_error_at_the_first_block(wanted_but_failing):
    eng = DiTEngine(ModelSpec(preset="tiny-random", dtype="float32", compile="on"))
    s = eng.open_session(128, 64, seed=3)
    eng.set_scene(s, "a red ball", new_shot=True)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="No working C"):
        eng.generate_block(s, 3)


def test_out_of_memory_while_compiling_reaches_the_memory_path_and_compile_stays_on(monkeypatch):
    """Inductor allocates while it autotunes; dynamo wraps a device's out-of-memory error there as
    its backend's (BackendCompilerFailed). That is the worker's memory path (errors.classify:
    MEMORY, the batch's sessions fail, the budget drops), not a reason to serve eager for good."""
    from streamdiff.workers.errors import MEMORY, classify

    calls = []

    def short_of_memory(gm, example_inputs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return gm.forward  # compiles the second time

    monkeypatch.setattr(toolchain, "decide", lambda mode, kind: (True, mode))
    torch._dynamo.reset()
    try:
        c = compiled.Compiler("auto", "cpu", backend=short_of_memory)
        fn = c.wrap(lambda x: x * 2 + 1)
        with pytest.raises(torch.OutOfMemoryError) as caught:
            fn(torch.ones(3))
        assert isinstance(caught.value.__cause__, torch._dynamo.exc.BackendCompilerFailed)
        assert classify(caught.value, sharded=False) == MEMORY
        assert c.active and c.fallback is None  # compile stays on
        assert torch.equal(fn(torch.ones(3)), torch.full((3,), 3.0)) and len(calls) == 2  # compiled again
    finally:
        torch._dynamo.reset()


def test_an_error_of_the_computation_is_never_taken_for_a_compile_error():
    assert not compiled.is_compile_error(torch.OutOfMemoryError("CUDA out of memory"))
    assert not compiled.is_compile_error(ValueError("bad shape"))


def test_the_daemon_refuses_compile_on_at_start_naming_the_missing_compiler():
    import os
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "streamdiff.cli", "--compile", "on", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CXX": "/nonexistent/g++"},
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "model.compile: --compile on: torch.compile on cpu needs a C++ compiler" in r.stderr, r.stderr
    assert "'/nonexistent/g++'" in r.stderr and "--compile auto" in r.stderr
