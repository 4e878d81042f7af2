"""The CPU platform: a "device" is a core per thread.

A stage's own work is its process's CPU time per thread: what it took of its cores, not the
time another process (a hybrid VAE shard beside a DiT) held them. Collectives over gloo block
the calling thread, so the wall time around one is its wait. Affinity, SCHED_IDLE for a hybrid
DiT, core lending (`cpu_lending`) and the CPU conv checkpoint (`models/wan/kernels.py`) are
this platform's alone.
"""

from __future__ import annotations

import os
import time

from .base import Platform, Stopwatch


class CpuStopwatch(Stopwatch):
    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self.wall0 = self.cpu0 = 0.0

    def start(self) -> None:
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()

    def stop(self, waited_s: float = 0.0) -> tuple[float, float]:
        wall = time.perf_counter() - self.wall0
        own = (time.process_time() - self.cpu0) / self.threads
        return wall, min(wall, max(0.0, own))  # shared cores: a worker may borrow more threads


def yield_cpu() -> None:
    """Run below every normal process (hybrid DiT): SCHED_IDLE where the kernel has it (a waking
    VAE shard on the same core preempts it at once), else the lowest nice. Threads made later
    inherit it. Unprivileged processes may lower their own priority."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.nice(19)
        except OSError:
            pass


def available_cores() -> list[int]:
    """The cores this process may run on (all of them where the kernel does not say)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def worker_cores(index: int, threads: int, pin: bool = True) -> tuple[int, ...]:
    """The cores the worker on device index `index` is pinned to: `threads` of them, in turn
    around the available ones (none when not pinning, or the kernel does not say)."""
    avail = available_cores()
    if not pin or not avail:
        return ()
    return tuple(avail[(index * threads + k) % len(avail)] for k in range(threads))


def pin(cpus: tuple[int, ...]) -> None:
    """This process onto these cores (none: as it is)."""
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:
            pass


class CpuPlatform(Platform):
    kind = "cpu"
    low_priority_runs = True
    idle_timing = True

    def setup_process(
        self, threads: int, cpus: tuple[int, ...] = (), low_priority: bool = False, host_processes: int = 1
    ) -> None:
        super().setup_process(threads, cpus, host_processes=host_processes)
        pin(cpus)
        if low_priority:
            yield_cpu()

    def stopwatch(self, threads: int) -> Stopwatch:
        return CpuStopwatch(threads)


PLATFORM = CpuPlatform
