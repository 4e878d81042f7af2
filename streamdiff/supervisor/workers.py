"""The worker processes: spawn, READY handshake, liveness, kill and restart (supervisor process).

A worker is alive while its process runs and its heartbeats are fresh; it is stuck when one
message has kept it busy longer than `block_timeout_s`. A dead or stuck worker is killed, and
so is every other member of its VAE group (their process group is broken: a survivor would
wait in a collective, or worse, write a strip into a slot the supervisor has already reused).
Only once every member has exited does the pool report the loss, so the caller may free the
slots they held; then the group is respawned with a fresh rendezvous port.

A respawned worker has `ready_timeout_s` to report READY again, or it is killed and tried
again. Restarts back off exponentially while a worker keeps dying; a worker that stayed up for
`restart_backoff_reset_s` starts the count afresh, so one crash a day never waits 30 s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import msgspec

from ..ipc import messages as m
from ..spawn import torch_context
from ..workers.spec import WorkerSpec
from .topology import Topology, free_port, with_new_group_addr

log = logging.getLogger("streamdiff.supervisor")


def exited(process: mp.process.BaseProcess) -> bool:
    """Whether the process has exited, as the kernel sees it. A worker is the fork server's child:
    multiprocessing hears of its exit once the server has reaped it and written the code, and on
    a loaded machine that came after the peers of a killed worker had reported their broken
    collectives. A zombie has exited; so has a process /proc no longer lists (reaped since)."""
    if not process.is_alive():
        return True
    if not os.path.isdir("/proc/self"):  # no procfs: what the fork server has said
        return False
    try:
        return proc_stat(process.pid)[0] in (b"Z", b"X")
    except FileNotFoundError:
        return True


def proc_stat(pid: int) -> list[bytes]:
    """/proc/PID/stat's fields after the name (which may hold spaces): state, parent pid, ..."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rpartition(b")")[2].split()


@dataclass
class WorkerState:
    spec: WorkerSpec
    process: mp.process.BaseProcess | None = None
    ready: bool = False
    info: dict = field(default_factory=dict)
    last_heartbeat: float = 0.0
    busy_s: float = 0.0
    borrowed_s: float = 0.0  # shared cores: over the daemon's life (platform/cpu_lending.py)
    borrowed_now: float = 0.0  # ... of which the current incarnation's
    restarts: int = 0  # over the daemon's life (shown in /health)
    recent_failures: int = 0  # deaths since it last stayed up restart_backoff_reset_s (sets the back-off)
    failure: str | None = None  # why its last start or run failed
    spawned_at: float = 0.0
    ready_since: float | None = None


MAX_BACKOFF_S = 30.0


def restart_delay_s(recent_failures: int) -> float:
    """Back-off before a restart: none for the first failure, then 0.5 s doubling up to 30 s."""
    return 0.0 if recent_failures <= 1 else min(MAX_BACKOFF_S, 0.5 * 2 ** (recent_failures - 2))


def note_death(w: WorkerState, now: float, reset_s: float) -> float:
    """Count a death of `w` and return the back-off before its restart. A worker that had stayed
    ready for `reset_s` starts the count afresh: a crash a day never waits 30 s."""
    if w.ready_since is not None and now - w.ready_since >= reset_s:
        w.recent_failures = 0
    w.recent_failures += 1
    w.ready_since = None
    return restart_delay_s(w.recent_failures)


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
        ready_timeout_s: float = 600.0,
        restart_backoff_reset_s: float = 300.0,
    ) -> None:
        self.topology = topology
        self.workers = {s.name: WorkerState(s) for s in topology.workers}
        # A DiT group's ranks -> its rank 0, the name the scheduler knows it by.
        self._leader = {n: lead for lead, ranks in topology.dit_groups.items() for n in ranks}
        self._send = send
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.block_timeout_s = block_timeout_s
        self.restart = restart
        self.ready_timeout_s = ready_timeout_s
        self.restart_backoff_reset_s = restart_backoff_reset_s
        self.ctx = torch_context()
        self.on_lost: Callable[[set[str], str], None] = lambda names, why: None
        self.on_worker_ready: Callable[[str], None] = lambda name: None
        self.on_idle: Callable[[str, float], None] = lambda name, since: None  # waiting, nothing queued, since
        self._ready_waiters: list[asyncio.Future] = []
        self._restarting: set[str] = set()
        self._closing = False
        self._tasks: set[asyncio.Task] = set()  # losses and respawns under way

    # -- processes ------------------------------------------------------------------------
    def _spawn(self, w: WorkerState) -> None:
        from ..workers.main import worker_main

        loop = asyncio.get_running_loop()
        if w.process is not None:  # a restart: stop watching the dead incarnation while its
            loop.remove_reader(w.process.sentinel)  # descriptor is open (a new one may reuse its number)
        w.ready, w.info, w.failure, w.ready_since = False, m.ReadyInfo(), None, None
        w.last_heartbeat = w.spawned_at = time.monotonic()
        spec = dataclasses.replace(w.spec, supervisor_pid=os.getpid())
        w.process = self.ctx.Process(target=worker_main, args=(spec,), name=w.spec.name, daemon=True)
        w.process.start()
        loop.add_reader(w.process.sentinel, self._on_exit, w.spec.name, w.process)
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
        w.ready_since = w.last_heartbeat
        self._restarting.discard(msg.worker)
        timed = []  # what it measured at start, for the capacity model
        for stage, ready in (("dit", msg.info.dit), ("vae", msg.info.vae)):
            if ready is not None:
                pair = ready.batch_ms.get("2")
                each = f", {pair:.0f} each in a pair" if pair else ""
                timed.append(f"{stage} {ready.cost.block_ms:.0f} ms per block{each}")
        log.info("worker %s ready (pid %d)%s", msg.worker, msg.pid, f": {'; '.join(timed)}" if timed else "")
        self._wake()
        unit = self._leader.get(msg.worker, msg.worker)
        if self.ready(unit):  # a DiT group is ready once all its ranks are
            self.on_worker_ready(unit)

    def handle_heartbeat(self, msg: m.Heartbeat) -> None:
        w = self.workers.get(msg.worker)
        if w is not None:
            w.last_heartbeat, w.busy_s = time.monotonic(), msg.busy_s
            # a restarted worker counts from 0 again: what it reports below the last is all new
            if msg.platform is not None:  # the CPU platform's figures (shared cores)
                borrowed = msg.platform.borrowed_s
                w.borrowed_s += borrowed - w.borrowed_now if borrowed >= w.borrowed_now else borrowed
                w.borrowed_now = borrowed
            # A second of waiting: every reply it sent before has arrived (loopback), and a
            # message sent before the wait began would have ended it: what it still owes us from
            # before then, it never received.
            if msg.idle_s >= 1.0 and w.ready:
                self.on_idle(msg.worker, w.last_heartbeat - msg.idle_s)

    def handle_startup_failure(self, msg: m.Failed) -> None:
        w = self.workers.get(msg.worker)
        if w is not None and not w.ready:
            w.failure = msg.message
            self._wake()

    # -- liveness -------------------------------------------------------------------------
    def _on_exit(self, name: str, process) -> None:
        w = self.workers[name]
        loop = asyncio.get_running_loop()
        loop.remove_reader(process.sentinel)
        process.join(timeout=0)
        if process is not w.process:
            # An earlier incarnation whose exit is read only now: its group's loss already
            # waited it out and started the next one (`_lose`, `_respawn`). Taken for the
            # new one's, it killed the group just restarted, and counted a second restart.
            return
        code = w.process.exitcode
        was_ready, w.ready = w.ready, False
        if w.failure is None:
            w.failure = f"exited with code {code}"
        self._wake()
        if self._closing:
            return
        log.error("worker %s (pid %s) exited with code %s", name, w.process.pid, code)
        if was_ready or name in self._restarting:
            self._background(self._lose({name}, f"worker {name} died (exit code {code})"))

    def _background(self, coro) -> None:
        """Run a loss/respawn task, keep a reference, and log (never drop) its failure."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("worker pool task failed", exc_info=t.exception())

        task.add_done_callback(done)

    def check(self, judge_silence: bool = True) -> None:
        """Called every heartbeat interval: kill silent or stuck workers, and restarted ones
        that do not report READY in time. `judge_silence` False: the caller's own stall may
        have kept heartbeats unread, so a stale one says nothing of its worker yet."""
        now = time.monotonic()
        for w in self.workers.values():
            if w.process is None or not w.process.is_alive():
                continue
            if not w.ready:
                late = now - w.spawned_at
                if w.spec.name in self._restarting and late > self.ready_timeout_s:
                    log.error("worker %s not ready %.0fs after its restart: killing it", w.spec.name, late)
                    w.failure = f"not ready {late:.0f}s after a restart"
                    self._kill(w)
                continue
            silent = now - w.last_heartbeat
            if judge_silence and silent > self.heartbeat_timeout_s:
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

    def _groups(self) -> list[list[str]]:
        """Workers joined in one process group: VAE groups and DiT groups."""
        return [*self.topology.vae_groups, *self.topology.dit_groups.values()]

    def _partners(self, names: set[str]) -> set[str]:
        """The workers that go down with `names`: their whole VAE or DiT groups."""
        out = set(names)
        for g in self._groups():
            if out & set(g):
                out |= set(g)
        return out

    def dead_peers(self, names: set[str]) -> list[str]:
        """The other members of `names`' groups that have exited, as "dit1 died (exit code -9)"."""
        out = []
        for n in sorted(self._partners(names) - names):
            p = self.workers[n].process
            if p is not None and exited(p):
                code = p.exitcode  # None until the fork server has reaped it
                out.append(f"{n} died" + (f" (exit code {code})" if code is not None else ""))
        return out

    def blame(self, msg: m.Failed) -> m.Failed:
        """A group member's failure, naming the peers already dead. A killed rank shows first
        as its peers' broken collectives ("dit0 failed (or a peer died)"), and which report or
        exit the supervisor reads first is a race: the session's error names the cause either
        way. (The kernel closes a dying process's sockets as it exits: by the time its peers'
        reports are read, it is a zombie at least, which `exited` counts.)"""
        dead = self.dead_peers({msg.worker}) if msg.kind == "worker" and msg.worker in self.workers else []
        return msgspec.structs.replace(msg, message="; ".join([*dead, msg.message])) if dead else msg

    async def _lose(self, names: set[str], why: str) -> None:
        lost = self._partners(names)
        # Whoever else in the group had already died is named too (see `blame`).
        why = "; ".join([why, *self.dead_peers(names)])
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
        # Back off when a worker keeps dying (a crash loop must not spin the machine); a worker
        # that had stayed up long enough starts counting afresh.
        now = time.monotonic()
        delay = max(note_death(self.workers[n], now, self.restart_backoff_reset_s) for n in names)
        if delay:
            await asyncio.sleep(delay)
        if self._closing:
            return
        new_addr: dict[str, str] = {}
        for g in self._groups():
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
            w.spec = replace(w.spec, incarnation=w.restarts)
            self._restarting.add(n)
            self._spawn(w)

    # -- status and shutdown ----------------------------------------------------------------
    def ready(self, name: str) -> bool:
        """A worker, or a DiT group by its rank 0's name: all its ranks."""
        return all(self.workers[n].ready for n in self.topology.members(name))

    def ready_workers(self) -> frozenset[str]:
        """Every worker process ready now (what the scheduler dispatches to)."""
        return frozenset(n for n, w in self.workers.items() if w.ready)

    def all_ready(self) -> bool:
        return all(w.ready for w in self.workers.values())

    def serving_pipelines(self) -> int:
        """Complete pipelines that can take a session now: ready DiT workers x ready VAE groups
        (any DiT worker can feed any group); in aggregated mode, the ready workers."""
        dit = sum(self.ready(n) for n in self.topology.dit_workers)
        groups = sum(all(self.ready(n) for n in g) for g in self.topology.vae_groups)
        return min(dit, groups)

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
        late = [w for w in self.workers.values() if w.process is not None and w.process.is_alive()]
        for w in late:
            w.process.terminate()
        if late:  # SIGTERM's moment to land before the kill below
            await asyncio.sleep(0.2)
        for w in self.workers.values():
            if w.process is not None:
                self._kill(w)
                w.process.join(timeout=5)
                try:
                    asyncio.get_running_loop().remove_reader(w.process.sentinel)
                except (ValueError, OSError):
                    pass
