"""The suite's tiers, applied by rule here and nowhere else (README "Tests"):

- `slow`: the test starts a process — a daemon, a worker, a process group, the CLI, any
  subprocess. Found by reading the code the test runs: the test function and its fixtures, and
  every function of tests/ they call, transitively; a name that resolves to `Daemon`, to
  `torch_context` (streamdiff/spawn.py), to the `subprocess` or `multiprocessing` modules, or to
  a function that does, makes the test slow.
  A test the rule misses fails when it starts a daemon or a streamdiff process anyway
  (`_rule_miss`), so the fast tier stays in-process.
- `device`: needs a CUDA or XPU accelerator; skipped cleanly when none is present.

`pytest -m "not slow"` is the fast tier; `pytest` (`.ci/run`) runs everything."""

from __future__ import annotations

import functools
import inspect
import json
import multiprocessing
import os
import subprocess
import types
from pathlib import Path

import pytest

from streamdiff import spawn, testing

from . import helpers
from .helpers import shared_daemon, stop_shared_daemon

TESTS = __name__.rpartition(".")[0] or "tests"
# What starts a process: the daemon, the fork server torch's children come from, and the modules
# every other process start goes through.
STARTERS = (testing.Daemon, spawn.torch_context, subprocess, multiprocessing)
# A name imported inside a function is not in its module's globals: read it as the helpers'.
IMPORTED = {**vars(helpers), "subprocess": subprocess, "multiprocessing": multiprocessing}


def accelerator() -> str | None:
    """The device the `device` tests run on: CUDA or XPU where present. STREAMDIFF_TEST_DEVICE
    names one instead, `cpu` too: tools/device/check.py runs them so on the CPU, so that they
    do not rot between the sessions that have a device (tests that only an accelerator can
    answer skip themselves there)."""
    import torch

    if os.environ.get("STREAMDIFF_TEST_DEVICE"):
        return os.environ["STREAMDIFF_TEST_DEVICE"]
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return None


def _codes(code: types.CodeType):
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _codes(c)


@functools.cache
def starts_processes(fn) -> bool:
    """Whether `fn` (a test, a fixture or a helper of tests/) starts a process, by the names its
    code (nested functions included) resolves in its module."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    scope = fn.__globals__
    for c in _codes(code):
        for name in c.co_names:
            obj = scope.get(name, IMPORTED.get(name))
            if obj is None:
                continue
            if any(obj is s for s in STARTERS) or obj is torch_mp():
                return True
            if isinstance(obj, types.FunctionType) and obj.__module__.startswith(TESTS):
                if obj is not fn and starts_processes(obj):
                    return True
            if isinstance(obj, type) and obj.__module__.startswith(TESTS):  # a test helper class
                init = obj.__dict__.get("__init__")
                if init is not None and starts_processes(init):
                    return True
    return False


@functools.cache
def torch_mp():
    import torch.multiprocessing

    return torch.multiprocessing


OWN = {
    "_rule_miss",
    "_stop_the_shared_daemon",
    "_given_calibration",
}  # this file's autouse fixtures: every test has them


def _fixture_funcs(item) -> list:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return [d.func for name, defs in info.name2fixturedefs.items() if name not in OWN for d in defs]


def pytest_configure(config):
    """Under pytest-xdist each test process runs its in-process torch on one thread (`.ci/run`
    starts one process per core and one more: a thread per core each would oversubscribe them)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    for item in items:
        fn = getattr(item, "function", None)
        if fn is not None and any(starts_processes(f) for f in [fn, *_fixture_funcs(item)]):
            item.add_marker(pytest.mark.slow)
    _longest_files_first(items)
    if accelerator() is None:
        skip = pytest.mark.skip(reason="no CUDA or XPU accelerator on this machine")
        for item in items:
            if "device" in item.keywords:
                item.add_marker(skip)


# Each test file's seconds in a whole run (its tests' setup, call and teardown, three processes
# on two cores): the order `.ci/run` hands files out in. `pytest --record-durations` writes it.
DURATIONS = Path(__file__).with_name("durations.json")
# A file the record does not hold yet: about this long a slow test, and any other.
GUESS_S = {True: 5.0, False: 0.1}


def _longest_files_first(items) -> None:
    """Files in order of their recorded seconds (DURATIONS), longest first, each file's tests
    together (stable otherwise). `.ci/run` hands whole files to its processes in this order
    (`--dist loadfile --no-loadscope-reorder`): the process that draws a long one early still has
    the many short files to balance against, and the run ends on short ones. In pytest-xdist's
    own order (most tests first) a one-minute test was left to the end, run by one process while
    the others idled; ordered by how many slow tests a file held, the device check (one test, a
    minute) or the in-process compile tests (none slow, 50 s) ran alone at the end."""
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    guess: dict[str, float] = {}
    for item in items:
        f = item.nodeid.split("::")[0]
        guess[f] = guess.get(f, 0.0) + GUESS_S["slow" in item.keywords]
    first = {f: i for i, f in enumerate(guess)}

    def key(item):
        f = item.nodeid.split("::")[0]
        return (-recorded.get(f, guess[f]), first[f])

    items.sort(key=key)


_seconds: dict[str, float] = {}


def pytest_addoption(parser):
    parser.addoption(
        "--record-durations",
        action="store_true",
        help="write each test file's seconds in this run to tests/durations.json (the suite's file order)",
    )


def pytest_runtest_logreport(report):
    f = report.nodeid.split("::")[0]
    _seconds[f] = _seconds.get(f, 0.0) + report.duration


def pytest_sessionfinish(session):
    """With --record-durations, the run's seconds per file over those recorded before (a run of
    some files records those), written once by the process that ran or drove them all
    (pytest-xdist's test processes report to it)."""
    if session.config.getoption("record_durations") and not os.environ.get("PYTEST_XDIST_WORKER"):
        recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
        ranked = sorted({**recorded, **_seconds}.items(), key=lambda kv: -kv[1])
        DURATIONS.write_text(json.dumps({f: round(s, 1) for f, s in ranked}, indent=0) + "\n")


@pytest.fixture(autouse=True)
def _rule_miss(request, monkeypatch):
    """A test the rule left in the fast tier may not start a daemon or a streamdiff process."""
    if "slow" in request.keywords:
        yield
        return

    def refuse(*args, **kwargs):
        raise AssertionError(
            f"{request.node.nodeid} starts a process, but tests/conftest.py's rule did not mark it slow: "
            "call the starter from the test or a fixture, where the rule can see it"
        )

    monkeypatch.setattr(testing.Daemon, "__init__", refuse)
    popen = subprocess.Popen.__init__

    def guarded(self, args, *a, **kw):
        if "streamdiff" in " ".join(map(str, args if isinstance(args, list | tuple) else [args])):
            refuse()
        popen(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)
    yield


@pytest.fixture
def plain_daemon():
    """The run's shared plain daemon (tests/helpers.py `shared_daemon`), idle."""
    return shared_daemon()


# What every daemon of the suite reports as its workers' start-up timings instead of timing
# blocks (pipeline.calibration_given): the tiny default's at 256x144 on a 2-vCPU Xeon, a pair of
# DiT blocks as dear per block as one, a pair of decodes 15% dearer. About 60 daemons of 30-odd
# models and layouts each timed its own (3-4 s a start on two cores); the capacity model refines
# the figures from every block a stream runs. Timing them is tested in tests/test_calibration.py
# and by a daemon of its own (tests/test_daemon_calibration.py).
GIVEN_CALIBRATION = {
    "dit": {"block_ms": 130.0, "batch_ms": {"2": 130.0}},
    "vae": {"block_ms": 260.0, "batch_ms": {"2": 300.0}},
}


@pytest.fixture(scope="session", autouse=True)
def _given_calibration(tmp_path_factory):
    path = tmp_path_factory.getbasetemp() / "given-calibration.json"
    path.write_text(json.dumps(GIVEN_CALIBRATION))
    testing.Daemon.flags = ("--calibration-given", str(path))
    yield
    testing.Daemon.flags = ()


@pytest.fixture(scope="session", autouse=True)
def _stop_the_shared_daemon():
    """Stops the shared daemon, if a test started it, once every test has run: it exits 0 and
    leaves no shared memory."""
    yield
    stop_shared_daemon()
