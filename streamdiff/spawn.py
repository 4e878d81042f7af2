"""How the daemon starts the processes that run torch: its questions to a device, its workers,
the profile's children."""

from __future__ import annotations

import multiprocessing as mp
import os


def torch_context():
    """The context of every process that runs torch: a fork server that has imported torch and
    the workers' modules once. The daemon's first child pays for them (the supervisor's first
    question to a device or a decoder, `in_child`); every worker start and restart, every
    profile probe forks from it, where a spawned child imported torch itself: about 2 s of
    CPU a process on the 2-vCPU EPYC. The server runs no torch op and touches no accelerator, so
    nothing a fork would break (an OpenMP pool, a CUDA context) exists when it forks; each child
    sets its own threads and device. Its environment is this process's at the first start, with
    OMP_WAIT_POLICY=PASSIVE unless set: the children's OpenMP threads then sleep while they wait
    (on the CPU a worker shares cores with the supervisor's encoder, or with the other stage
    under --share-cores, and two-thread sharing ran at half the frames/s with spinning threads).
    A worker's parent is the server, which exits when the daemon does."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    ctx = mp.get_context("forkserver")
    # The engines too (the models, presets and text encoder, ftfy's tables): each worker imported
    # them after its fork, about 0.13 s of CPU apiece.
    ctx.set_forkserver_preload(
        ["torch", "streamdiff.workers.dit_stage", "streamdiff.workers.vae_stage", "streamdiff.models.engines"]
    )
    return ctx


def _answer(fn, args, out) -> None:
    try:
        out.put(fn(*args))
    except Exception as exc:  # raised again in the parent
        out.put(exc)


def in_child(fn, *args, timeout_s: float = 300.0):
    """`fn(*args)` in a child, its result (or exception) back in this process: what the
    supervisor asks of torch (a device's facts, a decoder's shape) without importing it. `fn`
    must be a module-level function and its result picklable."""
    ctx = torch_context()
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
