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


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone (another user's: the pid was reused)
        return False
    return True


def exit_with(pid: int, every_s: float = 0.5) -> None:
    """This process exits once process `pid` (the daemon) is gone, SIGKILLed included: a thread
    that watches it. A child of the fork server has the server as its parent, so no
    PR_SET_PDEATHSIG would fire when the daemon dies, and the server outlives it while a child
    holds its pipes (the workers watch the same way: workers/main.py)."""
    import threading
    import time

    def watch() -> None:
        while alive(pid):
            time.sleep(every_s)
        os._exit(70)

    threading.Thread(target=watch, name="exit-with-daemon", daemon=True).start()


def watched(pid: int, fn, *args) -> None:
    """`fn(*args)` in a child that exits with process `pid` (`exit_with`)."""
    exit_with(pid)
    fn(*args)


def _answer(asker: int, fn, args, out) -> None:
    exit_with(asker)
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
    p = ctx.Process(target=_answer, args=(os.getpid(), fn, args, out), daemon=True)
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
