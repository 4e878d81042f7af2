"""How the daemon starts the processes that run torch: its workers and the profile's children."""

from __future__ import annotations

import multiprocessing as mp
import os


def spawn_context():
    """multiprocessing's spawn context, whose children's OpenMP threads sleep while they wait
    (OMP_WAIT_POLICY is read when a child loads torch; one set in the environment stays). On
    the CPU a worker shares cores with the supervisor's encoder, or with the other stage
    (--share-cores), and a spinning thread holds a core they need: two-thread sharing ran at
    half the frames/s with spinning threads."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return mp.get_context("spawn")


def worker_context():
    """The workers' context: a fork server that has imported torch and the worker's modules once
    (a daemon's first worker start pays for them; every other start and restart forks from it,
    where each spawned worker imported torch itself: about 2 s of CPU a worker on the 2-vCPU
    EPYC). The server runs no torch op and touches no accelerator, so nothing a fork would break
    (an OpenMP pool, a CUDA context) exists when it forks; each worker sets its own threads and
    device. Its environment is this process's at the first start (OMP_WAIT_POLICY as in
    `spawn_context`). A worker's parent is the server, which exits when the daemon does."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "streamdiff.workers.dit_stage", "streamdiff.workers.vae_stage"])
    return ctx


def _answer(fn, args, out) -> None:
    try:
        out.put(fn(*args))
    except Exception as exc:  # raised again in the parent
        out.put(exc)


def in_child(fn, *args, timeout_s: float = 300.0):
    """`fn(*args)` in a spawned child, its result (or exception) back in this process: what the
    supervisor asks of torch (a device's facts, a decoder's shape) without importing it. `fn`
    must be a module-level function and its result picklable."""
    ctx = spawn_context()
    out = ctx.Queue()
    p = ctx.Process(target=_answer, args=(fn, args, out), daemon=True)
    p.start()
    try:
        got = out.get(timeout=timeout_s)
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if isinstance(got, Exception):
        raise got
    return got
