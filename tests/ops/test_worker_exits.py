"""The worker pool reads each exit as its own incarnation's: a group member's exit that the event
loop reads only after the group was restarted is not taken for the new process's.

A CI run saw it: a killed VAE shard's partner exited of itself, the loss waited it out and
restarted the group, and the old exit, read then, was logged as the new vae0.0 "exited with code
None"; the pool killed the group it had just started and counted a second restart."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import pytest

from streamdiff.config.loader import load
from streamdiff.ipc.shm import RingSpec
from streamdiff.supervisor.topology import build_topology
from streamdiff.supervisor.workers import WorkerPool


def idle_worker(spec) -> None:
    """A worker process that only waits (a stand-in for workers/main.py's, in a fork)."""
    time.sleep(60)


@pytest.mark.timeout(60)
def test_an_old_incarnations_exit_read_after_the_restart_leaves_the_new_group_up(monkeypatch):
    import streamdiff.workers.main as worker_main

    monkeypatch.setattr(worker_main, "worker_main", idle_worker)
    ring = RingSpec("x", 2, 64)
    topo = build_topology(
        load(None, {"topology": {"dit_devices": 1, "vae_devices": 2}}), "tcp://127.0.0.1:1", ring, ring
    )
    group = ["vae0.0", "vae0.1"]
    assert topo.vae_groups == [group]

    async def scenario() -> dict[str, tuple[int, bool]]:
        pool = WorkerPool(topo, send=lambda name, msg: None, heartbeat_timeout_s=60, block_timeout_s=60, restart=True)
        pool.ctx = multiprocessing.get_context("fork")  # the stand-in needs no fork server
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
