"""Shared cores, the CPU platform's own mechanism: a worker lends its cores to the other while
it waits (`Lender` runs in a worker; the supervisor's side is `HostSlot`).

With `--share-cores` (one DiT and one VAE worker on the CPU) each worker owns `threads` cores,
as in disagg-1+1. A file that the supervisor creates in its runtime directory holds one byte per
worker (1 while it runs a batch) and one for the supervisor's encoder threads, which run on the
DiT's cores; bytes of the same cores form a group. Before each DiT block, each module of the VAE
decoder and each CPU conv2d (the decoder's `checkpoint`, models/wan/kernels.py), a worker sets
its OpenMP thread count to its own threads plus those of every other group whose bytes are all
0, and while it borrows, the thread that runs its forward may run on every shared core. So the
VAE decodes on both cores while the DiT waits for a ring slot, and on its own core again once
the DiT (or an encode) runs.

Why thread counts and affinity, not the kernel alone: two workers that each keep two threads on
two cores run every OpenMP region at the pace of whichever thread shares its core, and an encoder
beside a borrowed thread holds the region back the same way (docs/placement.md#the-layouts).
A stale byte (a worker killed mid-batch) only stops the other from
borrowing its cores until its restart clears it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class LendSpec:
    """The ledger file, this worker's byte in it, and every worker's own threads, in ledger
    order (workers/spec.py carries it to a worker; the supervisor keeps its own, `HostSlot`)."""

    path: str
    index: int
    threads: tuple[int, ...]
    groups: tuple[int, ...] = ()  # each byte's cores: a group's threads are free while all its bytes are 0
    cores: tuple[int, ...] = ()  # every shared core: where the worker's thread runs while it borrows


def create_ledger(path: str, workers: int) -> None:
    """The supervisor's side: one zero byte per worker (all waiting)."""
    with open(path, "wb") as f:
        f.write(bytes(workers))


def _map(spec: LendSpec) -> mmap.mmap:
    fd = os.open(spec.path, os.O_RDWR)
    try:
        return mmap.mmap(fd, len(spec.threads))
    finally:
        os.close(fd)


class Lender:
    def __init__(self, spec: LendSpec) -> None:
        self.spec = spec
        self.buf = _map(spec)
        self.own = spec.threads[spec.index]
        self.current, self.since, self.borrowed = 0, 0.0, 0.0
        self.lock = threading.Lock()  # the heartbeat thread reads borrowed_s()
        self.home = os.sched_getaffinity(0) if spec.cores else set()
        self.buf[spec.index] = 0
        self.set_threads(self.own)

    def set_threads(self, n: int) -> None:
        if n != self.current:
            import torch

            now = time.monotonic()
            with self.lock:
                if self.current > self.own:
                    self.borrowed += now - self.since
                self.since = now

            if self.spec.cores and (n > self.own) != (self.current > self.own):
                # the thread that runs the forward stays on its own cores unless it borrows, so
                # an encoder on the DiT's cores never lands beside it there; OpenMP's pool
                # threads start with the affinity it has when first needed (all, once borrowed)
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(0, self.spec.cores if n > self.own else self.home)
            torch.set_num_threads(n)
            with self.lock:
                self.current = n

    def borrowed_s(self) -> float:
        """Seconds this worker has run on more threads than its own (the heartbeat reports it)."""
        with self.lock:
            extra = time.monotonic() - self.since if self.current > self.own else 0.0
            return self.borrowed + extra

    def running(self, on: bool) -> None:
        """This worker starts (True) or ends (False) a batch."""
        self.buf[self.spec.index] = 1 if on else 0
        self.set_threads(self.threads_now() if on else self.own)

    def threads_now(self) -> int:
        """Own threads plus those of every other group of cores whose workers all wait now."""
        buf, spec = self.buf, self.spec
        groups = spec.groups or tuple(range(len(spec.threads)))
        mine = groups[spec.index]
        busy = {g for i, g in enumerate(groups) if buf[i]}
        n = self.own + sum(t for g, t in zip(groups, spec.threads, strict=True) if g != mine and g not in busy)
        return max(self.own, min(n, len(spec.cores))) if spec.cores else n

    def adjust(self, *_args) -> None:
        """A forward pre-hook: take the cores of whoever is waiting now, give back the rest."""
        self.set_threads(self.threads_now())

    def install(self, modules) -> int:
        """Adjust before each of `modules` runs (a forward pre-hook; the worker chooses them:
        workers/lend.py); returns how many."""
        n = 0
        for sub in modules:
            sub.register_forward_pre_hook(self.adjust)
            n += 1
        return n

    def close(self) -> None:
        try:
            self.buf[self.spec.index] = 0
            self.buf.close()
        except (ValueError, BufferError):
            pass


class HostSlot:
    """The supervisor's byte: how many of its encoder threads run now. It shares the DiT's
    cores, so a worker borrows those only while neither the DiT nor an encoder runs: an encoder
    beside a borrowed thread holds back every OpenMP region of the borrower (libx264 took 63-69
    ms a block there, 9 beside a DiT of its own)."""

    def __init__(self, spec: LendSpec) -> None:
        self.index, self.buf = spec.index, _map(spec)
        self.lock, self.n = threading.Lock(), 0
        self.buf[self.index] = 0

    @contextlib.contextmanager
    def running(self):
        with self.lock:
            self.n += 1
            self.buf[self.index] = min(255, self.n)
        try:
            yield
        finally:
            with self.lock:
                self.n -= 1
                self.buf[self.index] = min(255, self.n)

    def close(self) -> None:
        with contextlib.suppress(ValueError, BufferError):
            self.buf.close()
