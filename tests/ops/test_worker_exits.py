"""The worker pool reads each exit as its own incarnation's: a group member's exit that the event
loop reads only after the group was restarted is not taken for the new process's. And a group's
failure names the member that died, whichever report the pool reads first.

A CI run saw it: a killed VAE shard's partner exited of itself, the loss waited it out and
restarted the group, and the old exit, read then, was logged as the new vae0.0 "exited with code
None"; the pool killed the group it had just started and counted a second restart."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from multiprocessing.connection import wait

import pytest

from streamdiff.config.loader import load
from streamdiff.ipc import messages as m
from streamdiff.ipc.shm import RingSpec
from streamdiff.supervisor.topology import build_topology
from streamdiff.supervisor.workers import WorkerPool, proc_stat


def idle_worker(spec) -> None:
    """A worker process that only waits (a stand-in for workers/main.py's, in a fork)."""
    time.sleep(60)


def pool_of(overrides: dict, monkeypatch, restart: bool) -> WorkerPool:
    """A pool of stand-in workers, forked."""
    import streamdiff.workers.main as worker_main

    monkeypatch.setattr(worker_main, "worker_main", idle_worker)
    ring = RingSpec("x", 2, 64)
    topo = build_topology(load(None, {"topology": overrides}), "tcp://127.0.0.1:1", ring, ring)
    pool = WorkerPool(topo, send=lambda name, msg: None, heartbeat_timeout_s=60, block_timeout_s=60, restart=restart)
    pool.ctx = multiprocessing.get_context("fork")  # the stand-in needs no fork server
    return pool


@pytest.mark.timeout(60)
def test_an_old_incarnations_exit_read_after_the_restart_leaves_the_new_group_up(monkeypatch):
    group = ["vae0.0", "vae0.1"]

    async def scenario() -> dict[str, tuple[int, bool]]:
        pool = pool_of({"dit_devices": 1, "vae_devices": 2}, monkeypatch, restart=True)
        assert pool.topology.vae_groups == [group]
        pool.spawn_all()
        try:
            for w in pool.workers.values():
                w.ready = True
            # The group goes down between two turns of the event loop, as `_lose` can find it
            # (a shard killed, its partner exited of itself): both exits reaped, neither read.
            for n in group:
                p = pool.workers[n].process
                os.kill(p.pid, signal.SIGKILL)
                while p.is_alive():
                    time.sleep(0.01)
                pool.workers[n].ready = False
            await pool._respawn(set(group))
            await asyncio.sleep(1.0)  # the loop reads whatever exits it is still watching
            return {n: (pool.workers[n].restarts, pool.workers[n].process.is_alive()) for n in group}
        finally:
            await pool.shutdown(timeout_s=1.0)

    assert asyncio.run(scenario()) == {n: (1, True) for n in group}


@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_killed_ranks_peers_failure_and_the_groups_loss_both_name_it(monkeypatch):
    """A CI run saw it: rank 1 of a DiT group was killed, rank 0's broken collective was read
    first, and the stream's error named only dit0. The daemon's fork server, which reaps the
    workers, had not yet told the supervisor of rank 1's exit: here it is stopped meanwhile."""
    seen: list[str] = []

    async def scenario() -> tuple[m.Failed, ...]:
        pool = pool_of({"dit_devices": 2, "dit_group_size": 2, "vae_devices": 1}, monkeypatch, restart=False)
        pool.ctx = multiprocessing.get_context("forkserver")  # the daemon's, as torch_context sets it
        assert list(pool.topology.dit_groups.values()) == [["dit0", "dit1"]]
        pool.on_lost = lambda names, why: seen.append(why)
        pool.spawn_all()
        rank1 = pool.workers["dit1"].process
        server = int(proc_stat(rank1.pid)[1])  # the fork server
        assert server != os.getpid()
        try:
            echo = m.Failed("dit0", "group dit0: dit0 failed (or a peer died): RuntimeError: gloo", "s1", 3)
            before = pool.blame(echo)  # nobody has died: the report stands as it is
            os.kill(server, signal.SIGSTOP)
            os.kill(rank1.pid, signal.SIGKILL)
            while proc_stat(rank1.pid)[0] != b"Z":
                await asyncio.sleep(0.01)
            assert rank1.is_alive()  # what multiprocessing says until its fork server reaps it
            unreaped = pool.blame(echo)
            own = pool.blame(m.Failed("dit0", "out of memory", "s1", 3, "memory"))  # dit0 carries on
        finally:
            os.kill(server, signal.SIGCONT)
        try:
            wait([rank1.sentinel], timeout=10)
            reaped = pool.blame(echo)
            await pool._lose({"dit0"}, "worker dit0 died (exit code 3)")
            return before, unreaped, reaped, own
        finally:
            await pool.shutdown(timeout_s=1.0)

    before, unreaped, reaped, own = asyncio.run(scenario())
    assert before.message.startswith("group dit0")
    assert unreaped.message == f"dit1 died; {before.message}"
    assert reaped.message == f"dit1 died (exit code -9); {before.message}"
    assert reaped.session == "s1" and reaped.block == 3 and reaped.kind == "worker"
    assert own.message == "out of memory"
    assert seen == ["worker dit0 died (exit code 3); dit1 died (exit code -9)"]
