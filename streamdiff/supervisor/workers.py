"""The worker processes: spawn, READY handshake, liveness, kill and restart (supervisor process).

A worker is alive while its process runs and its heartbeats are fresh; it is stuck when one
message has kept it busy longer than `block_timeout_s`. A dead or stuck worker is killed, and
so is every other member of its VAE group (their process group is broken: a survivor would
wait in a collective, or worse, write a strip into a slot the supervisor has already reused).
Only once every member has exited does the pool report the loss, so the caller may free the
slots they held; then the group is respawned with a fresh rendezvous port.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..ipc import messages as m
from ..workers.spec import WorkerSpec
from .topology import Topology, free_port, with_new_group_addr

log = logging.getLogger("streamdiff.supervisor")


@dataclass
class WorkerState:
    spec: WorkerSpec
    process: mp.process.BaseProcess | None = None
    ready: bool = False
    info: dict = field(default_factory=dict)
    last_heartbeat: float = 0.0
    busy_s: float = 0.0
    restarts: int = 0
    failure: str | None = None  # why its last start or run failed


class StartupError(RuntimeError):
    pass


class WorkerPool:
    def __init__(
        self,
        topology: Topology,
        send: Callable[[str, m.Message], None],
        heartbeat_timeout_s: float,
        block_timeout_s: float,
        restart: bool,
    ) -> None:
        self.topology = topology
        self.workers = {s.name: WorkerState(s) for s in topology.workers}
        self._send = send
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.block_timeout_s = block_timeout_s
        self.restart = restart
        self.ctx = mp.get_context("spawn")
        self.on_lost: Callable[[set[str], str], None] = lambda names, why: None
        self.on_worker_ready: Callable[[str], None] = lambda name: None
        self._ready_waiters: list[asyncio.Future] = []
        self._restarting: set[str] = set()
        self._closing = False

    # -- processes ------------------------------------------------------------------------
    def _spawn(self, w: WorkerState) -> None:
        from ..workers.main import worker_main

        w.ready, w.info, w.failure = False, {}, None
        w.last_heartbeat = time.monotonic()
        w.process = self.ctx.Process(target=worker_main, args=(w.spec,), name=w.spec.name, daemon=True)
        w.process.start()
        asyncio.get_running_loop().add_reader(w.process.sentinel, self._on_exit, w.spec.name)
        log.info(
            "started worker %s (pid %d, %s, roles %s)",
            w.spec.name,
            w.process.pid,
            w.spec.device,
            "+".join(w.spec.roles),
        )

    def spawn_all(self) -> None:
        for w in self.workers.values():
            self._spawn(w)

    async def wait_ready(self, timeout_s: float, names: set[str] | None = None) -> None:
        names = names or set(self.workers)
        deadline = time.monotonic() + timeout_s
        while True:
            failed = [n for n in names if self.workers[n].failure]
            if failed:
                w = self.workers[failed[0]]
                raise StartupError(f"worker {w.spec.name} failed to start: {w.failure}")
            if all(self.workers[n].ready for n in names):
                return
            if time.monotonic() > deadline:
                late = sorted(n for n in names if not self.workers[n].ready)
                raise StartupError(f"workers not ready after {timeout_s:.0f}s: {', '.join(late)}")
            fut = asyncio.get_running_loop().create_future()
            self._ready_waiters.append(fut)
            try:
                await asyncio.wait_for(fut, timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except TimeoutError:
                pass

    def _wake(self) -> None:
        for f in self._ready_waiters:
            if not f.done():
                f.set_result(None)
        self._ready_waiters.clear()

    # -- messages from workers ----------------------------------------------------------------
    def handle_ready(self, msg: m.Ready) -> None:
        w = self.workers.get(msg.worker)
        if w is None:
            return
        w.ready, w.info, w.last_heartbeat = True, msg.info, time.monotonic()
        self._restarting.discard(msg.worker)
        log.info("worker %s ready (pid %d)", msg.worker, msg.pid)
        self._wake()
        self.on_worker_ready(msg.worker)

    def handle_heartbeat(self, msg: m.Heartbeat) -> None:
        w = self.workers.get(msg.worker)
        if w is not None:
            w.last_heartbeat, w.busy_s = time.monotonic(), msg.busy_s

    def handle_startup_failure(self, msg: m.Failed) -> None:
        w = self.workers.get(msg.worker)
        if w is not None and not w.ready:
            w.failure = msg.message
            self._wake()

    # -- liveness -------------------------------------------------------------------------
    def _on_exit(self, name: str) -> None:
        w = self.workers[name]
        loop = asyncio.get_running_loop()
        loop.remove_reader(w.process.sentinel)
        w.process.join(timeout=0)
        code = w.process.exitcode
        was_ready, w.ready = w.ready, False
        if w.failure is None:
            w.failure = f"exited with code {code}"
        self._wake()
        if self._closing:
            return
        log.error("worker %s (pid %s) exited with code %s", name, w.process.pid, code)
        if was_ready or name in self._restarting:
            asyncio.ensure_future(self._lose({name}, f"worker {name} died (exit code {code})"))

    def check(self) -> None:
        """Called every heartbeat interval: kill silent or stuck workers."""
        now = time.monotonic()
        for w in self.workers.values():
            if not w.ready or w.process is None or not w.process.is_alive():
                continue
            silent = now - w.last_heartbeat
            if silent > self.heartbeat_timeout_s:
                log.error("worker %s silent for %.1fs: killing it", w.spec.name, silent)
                w.failure = f"no heartbeat for {silent:.0f}s"
                self._kill(w)
            elif w.busy_s > self.block_timeout_s:
                log.error("worker %s stuck on one block for %.0fs: killing it", w.spec.name, w.busy_s)
                w.failure = f"stuck on one block for {w.busy_s:.0f}s"
                self._kill(w)

    def _kill(self, w: WorkerState) -> None:
        if w.process is not None and w.process.is_alive():
            try:
                os.kill(w.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _partners(self, names: set[str]) -> set[str]:
        """The workers that go down with `names`: their whole VAE groups."""
        out = set(names)
        for g in self.topology.vae_groups:
            if out & set(g):
                out |= set(g)
        return out

    async def _lose(self, names: set[str], why: str) -> None:
        lost = self._partners(names)
        for n in lost:
            self.workers[n].ready = False
            self._kill(self.workers[n])
        # Wait until every member has exited: only then are their ring slots safe to reuse.
        for n in lost:
            p = self.workers[n].process
            while p is not None and p.is_alive():
                await asyncio.sleep(0.02)
        fresh = lost - self._restarting
        if fresh:
            self.on_lost(fresh, why)
        if self.restart and not self._closing:
            await self._respawn(lost)

    async def _respawn(self, names: set[str]) -> None:
        # Back off when a worker keeps dying (a crash loop must not spin the machine).
        tries = max(self.workers[n].restarts for n in names)
        if tries:
            await asyncio.sleep(min(30.0, 0.5 * 2 ** (tries - 1)))
        if self._closing:
            return
        new_addr: dict[str, str] = {}
        for g in self.topology.vae_groups:
            if names & set(g) and len(g) > 1:
                addr = f"tcp://127.0.0.1:{free_port()}"
                new_addr.update({n: addr for n in g})
        for n in sorted(names):
            w = self.workers[n]
            if w.process is not None and w.process.is_alive():
                continue
            if n in new_addr:
                w.spec = with_new_group_addr(w.spec, new_addr[n])
            w.restarts += 1
            self._restarting.add(n)
            self._spawn(w)

    # -- status and shutdown ----------------------------------------------------------------
    def ready(self, name: str) -> bool:
        return self.workers[name].ready

    def all_ready(self) -> bool:
        return all(w.ready for w in self.workers.values())

    def send(self, name: str, msg: m.Message) -> None:
        self._send(name, msg)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask every worker to stop, wait a bounded time, then kill."""
        self._closing = True
        for w in self.workers.values():
            if w.process is not None and w.process.is_alive():
                try:
                    self._send(w.spec.name, m.Shutdown())
                except Exception:
                    pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(w.process and w.process.is_alive() for w in self.workers.values()):
            await asyncio.sleep(0.05)
        for w in self.workers.values():
            if w.process is not None and w.process.is_alive():
                w.process.terminate()
        await asyncio.sleep(0.2)
        for w in self.workers.values():
            if w.process is not None:
                self._kill(w)
                w.process.join(timeout=5)
                try:
                    asyncio.get_running_loop().remove_reader(w.process.sentinel)
                except (ValueError, OSError):
                    pass
