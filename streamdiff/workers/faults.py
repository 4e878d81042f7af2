"""Deliberate faults for the fault-injection tests and drills (worker processes).

Off unless `STREAMDIFF_FAULTS` is set (read in config/__init__.py, handed to each worker in its spec).
Each entry is `WORKER:POINT:KIND`, optionally `@seed=N` (only sessions opened with that seed)
and `#I` (only the I-th start of that worker: 0 is the first, 1 the first restart); entries are
separated by commas. For example `vae0.1:check:request@seed=7` makes shard 1 of group 0 refuse
the blocks of seed-7 sessions, `dit0:start:hang#1` makes the DiT's first restart hang.

Points: `start` (before READY), `open` (a session opens), `receive` (a block's message arrives),
`check` (a block is validated, before any collective), `compute` (inside a block's work). Kinds:
`request` (the request cannot be served: a RequestError), `device` (an accelerator error; the
context stays broken, so every later block fails too, as a real CUDA/XPU error leaves it),
`oom` (torch's OutOfMemoryError, as a CUDA allocation raises it; the context stays usable),
`hang`, `exit`, `drop` (at `receive`: the first block message of each matching session is lost).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

from .errors import RequestError

_ENTRY = re.compile(
    r"^(?P<worker>[\w.]+):(?P<point>start|open|receive|check|compute):(?P<kind>request|device|oom|hang|exit|drop)"
    r"(?:@seed=(?P<seed>\d+))?(?:#(?P<inc>\d+))?$"
)


class DeviceFault(RuntimeError):
    """Stands for an accelerator error (torch.AcceleratorError on CUDA/XPU)."""


@dataclass(frozen=True)
class Fault:
    worker: str
    point: str
    kind: str
    seed: int | None = None
    incarnation: int | None = None


def parse(text: str) -> tuple[Fault, ...]:
    out = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        mt = _ENTRY.match(entry)
        if mt is None:
            raise ValueError(f"STREAMDIFF_FAULTS: cannot parse {entry!r} (WORKER:POINT:KIND[@seed=N][#I])")
        seed, inc = mt["seed"], mt["inc"]
        out.append(Fault(mt["worker"], mt["point"], mt["kind"], int(seed) if seed else None, int(inc) if inc else None))
    return tuple(out)


class Faults:
    """The faults meant for one worker process."""

    def __init__(self, faults: tuple[Fault, ...], worker: str, incarnation: int) -> None:
        self.mine = [f for f in faults if f.worker == worker and f.incarnation in (None, incarnation)]
        self.poisoned = False
        self.dropped: set[str] = set()  # sessions whose first block message was dropped
        self.seeds: dict[str, int] = {}  # session -> its seed: `@seed=N` matches by it (the worker's only use of it)

    def opened(self, session: str, seed: int) -> None:
        self.seeds[session] = seed

    def closed(self, session: str) -> None:
        self.seeds.pop(session, None)

    def drop(self, session: str) -> bool:
        """True if this block message of `session` is to be lost (once per session)."""
        if session in self.dropped:
            return False
        seed = self.seeds.get(session)
        if any(f.kind == "drop" and f.seed in (None, seed) for f in self.mine):
            self.dropped.add(session)
            return True
        return False

    def hit(self, point: str, session: str | None = None) -> None:
        """The faults of `point` (for the session's seed, where one is named) happen here."""
        seed = self.seeds.get(session) if session is not None else None
        if self.poisoned and point == "compute":
            raise DeviceFault("CUDA error: an illegal memory access was encountered (injected, sticky)")
        for f in self.mine:
            if f.point != point or (f.seed is not None and f.seed != seed):
                continue
            if f.kind == "request":
                raise RequestError(f"injected request fault at {point}")
            if f.kind == "oom":
                import torch

                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
            if f.kind == "device":
                self.poisoned = True
                raise DeviceFault("CUDA error: an illegal memory access was encountered (injected)")
            if f.kind == "hang":
                while True:
                    time.sleep(3600)
            if f.kind == "exit":
                os._exit(7)
