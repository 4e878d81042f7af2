"""A stage's start-up figures kept for the next start (`pipeline.calibration_dir`).

A stage calibrates at start: it times blocks at the preset's default size and measures what a
session holds (workers/dit_stage.py, vae_stage.py). With a calibration directory the figures
are stored there under a key of everything that shapes them (the model, the device, the
threads, the stage's group and cut, the batch and memory settings), and a later start with the
same key reads them instead of measuring: the test suite starts dozens of daemons of one model
on one machine, and a restart on the same host can skip seconds of timing blocks. A start with
another key, or with no directory (the default), measures. The figures are only the first
estimate: the supervisor's capacity model learns from every block after.

Given timings (`pipeline.calibration_given`, a file of them) replace the timed blocks of every
start: the test suite starts dozens of daemons of distinct models and layouts, each of which
would time its blocks once. What a session holds (its caches, exact) is still measured: the
DiT's caches once a session opens and its scene is set, the decoder's from two blocks. On an
accelerator a first block runs in each stage for its transients; the CPU counts none, so there
the DiT runs no block and a whole decoder decodes at a quarter of the preset's rows and columns
(its cache the same bytes per latent pixel at any size).

On an accelerator the calibration blocks also warm the compiled graphs; a stored or given
calibration skips them, so the first request compiles. That is for tests and development, not a
service."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import msgspec

from ..ipc import messages as m
from .spec import WorkerSpec

log = logging.getLogger("streamdiff.worker")

# What each stage's calibrate() returns, and the message field types they are stored as.
_READY = {"dit": m.DiTReady, "vae": m.VAEReady}
_FIELDS = {"dit": ("cost", "batch_ms", "memory"), "vae": ("cost", "batch_ms", "memory", "stages_ms")}


# Every WorkerSpec field is one of these two (tests/test_calibration.py holds that): what shapes a
# stage's figures, and what a start sets that does not. A field in neither fails that test, so a
# new one is a decision, not a key that silently changes at every start (and measures again).
SHAPES = (
    "roles",
    "device",
    "threads",
    "model",
    "group",
    "dit_group",
    "vae_working_set_bytes",
    "cpu_memory_budget_bytes",
    "max_batch",
    "low_priority",
    "lend",
    "vae_cut",
)
PER_START = (
    "name",
    "cpus",  # which cores it is pinned to; how many it has is `threads`
    "control_addr",
    "latent_ring",
    "frame_ring",
    "heartbeat_interval_s",
    "log_level",
    "incarnation",
    "host_processes",  # how many compile beside it: its start-up's time, not its figures
    "supervisor_pid",
    "calibration_dir",
    "calibration_given",  # given timings are never stored: a start with them measures nothing to keep
    "faults",
)


def key(spec: WorkerSpec, stage: str) -> str:
    """The fields of the spec that shape the stage's figures (SHAPES), hashed. Of a group, its
    rank, size and sharding, not its name or address; of the lending ledger, whether there is
    one."""
    group = dataclasses.replace(spec.group, name="", init_addr="") if spec.group else None
    shapes = {f: getattr(spec, f) for f in SHAPES} | {"group": group, "lend": spec.lend is not None}
    return hashlib.sha256(f"{stage} {shapes!r}".encode()).hexdigest()[:20]


def _read(path: Path, stage: str) -> dict | None:
    try:
        ready = msgspec.json.decode(path.read_bytes(), type=_READY[stage])
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("stored calibration %s unreadable (%s): measuring", path, exc)
        return None
    return {f: getattr(ready, f) for f in _FIELDS[stage] if getattr(ready, f) is not None}


def calibrated(
    spec: WorkerSpec,
    stage: str,
    measure: Callable[[m.GivenTimes | None], dict],
    agree: Callable[[list[int]], list[int]],
) -> dict:
    """`measure(None)`, or the figures an earlier start with the same key stored, or with
    `spec.calibration_given`, `measure(given)`: the given timings, and what a session holds
    measured from as little work as that needs (the same on every rank of a group: no
    collective hangs on a rank that timed blocks). `agree`: the stage's group-wide maximum; a
    group's ranks read stored figures only if every rank has them, since measuring runs
    collectives that all must join."""
    if spec.calibration_given:
        return measure(getattr(m.read_given_calibration(spec.calibration_given), stage))
    if not spec.calibration_dir:
        return measure(None)
    path = Path(spec.calibration_dir) / f"{stage}-{key(spec, stage)}.json"
    stored = _read(path, stage)
    if not agree([int(stored is None)])[0]:
        log.info("%s calibration read from %s", stage, path)
        return stored
    out = measure(None)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # whole or absent: a concurrent start reads one or the other
    tmp.write_bytes(msgspec.json.encode(_READY[stage](**{f: out[f] for f in _FIELDS[stage] if f in out})))
    os.replace(tmp, path)
    return out
