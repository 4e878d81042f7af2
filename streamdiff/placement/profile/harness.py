"""The profile's children: one process per probe, pinned as the daemon pins a worker, run
one measurement at a time so none competes."""

from __future__ import annotations

import os
import queue
import statistics
import threading
import time

from ...platform import for_device, select
from ...spawn import torch_context, watched

STEADY_BLOCKS = 6  # steady blocks timed per measurement (after a shot's first): the DiT's window fills
GROUP_SIZES_MAX = 4
# A shot's first block is timed on this many fresh sessions after the steady blocks, as a worker
# meets one, and their median kept: timed just after the cold block, first blocks came out slower
# than a worker meets them (docs/placement.md#placement-placement).
FIRST_BLOCKS = 3
# ... each after this long idle, as a worker meets a new request: on two threads a first block
# after idle is slower than one straight after other blocks (a VAE block: 119-128 ms against
# 102-105 on a 2-vCPU EPYC).
FIRST_IDLE_S = 0.3


def pin(device: str, cpus: tuple[int, ...], threads: int) -> None:
    """As a worker of `threads` threads on these cores (the platform's process setup), with its
    device current before anything is allocated or timed, as a worker's stage makes it: a probe
    that left it would make its context on device 0, time device 0's stream and run its
    collectives there."""
    for_device(device).setup_process(threads, cpus)
    select(device)
    import torch

    torch.set_num_threads(threads)


def measured_batches(plat, batches, need, run) -> tuple[dict[str, float], list[int]]:
    """`run(b)` (per-block ms in a batch of b) for each batch size whose `need(b)` bytes the
    device's free memory covers; the others, and one that runs out of memory, do not fit (the
    probe goes on). The allocator's cache is given back after each batch (its sessions freed)."""
    from ...models.compiled import out_of_memory

    ms, unfit = {}, []
    for b in batches:
        n = need(b)
        if plat.memory_budget(n) < n:  # the CPU's budget is what is asked: no device to fill
            unfit.append(b)
            continue
        try:
            ms[str(b)] = run(b)
        except Exception as exc:
            if out_of_memory(exc) is None:
                raise
            unfit.append(b)
        finally:
            plat.free_cache()
    return ms, unfit


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def leave(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# Set when the daemon is told to stop while it profiles (cli/daemon.py): the probes running are
# killed at once, and the profile raises Stopped.
STOP = threading.Event()


class Stopped(Exception):
    """The profile was stopped (the daemon was told to stop while it measured)."""


def result(out, timeout_s: float):
    """The next child's result, watching STOP meanwhile (queue.Empty past `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if STOP.is_set():
            raise Stopped("stopped while profiling")
        try:
            return out.get(timeout=max(0.0, min(0.25, deadline - time.monotonic())))
        except queue.Empty:
            if time.monotonic() >= deadline:
                raise


def run_children(targets: list[tuple], timeout_s: float) -> list:
    """Start one process per (fn, args), wait for each one's result; raise on any error."""
    ctx = torch_context()
    out = ctx.Queue()
    me = os.getpid()  # each child exits with this process (a daemon killed while it profiles)
    procs = [ctx.Process(target=watched, args=(me, fn, *args, out), daemon=True) for fn, args in targets]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in procs:
            status, value = result(out, timeout_s)
            if status != "ok":
                raise RuntimeError(f"profiling failed:\n{value}")
            results.append(value)
    finally:
        for p in procs:
            p.join(timeout=0 if STOP.is_set() else 30)
            if p.is_alive():
                p.kill()
    return results


def cpus_of(device: int, threads: int) -> tuple[int, ...]:
    """The cores a worker on this device index is pinned to (as the daemon pins them)."""
    from ...platform.cpu import worker_cores

    return worker_cores(device, threads)


def heads_of(spec) -> int:
    from ...models.presets import get_preset

    return get_preset(spec).dit.num_heads
