"""What a worker does with an error (worker processes): fail one session, or restart.

A request error is a property of the request: every rank of a VAE group meets it at the same
place, before any collective (the block's check), so the group fails that session together
and stays up and in step. An accelerator's out-of-memory error in a worker of its own (no
group) fails the sessions of the block's batch: it poisons no context, the worker empties its
allocator's cache and carries on, and the supervisor lowers that worker's memory budget
(`CapacityModel.out_of_memory`). Everything else raised while a block runs is the worker's: a
collective that broke, an accelerator error — after which a CUDA or XPU context is poisoned and
would fail every later block — an out-of-memory in a group, whose peers may wait in a
collective, or an error we did not foresee. Those restart the worker (and with it its group),
which fails only the sessions placed there.
"""

from __future__ import annotations


class RequestError(ValueError):
    """This session's request cannot be served here (shape, size, value): fail the session only."""


class SessionError(RequestError):
    """This session cannot go on, through no fault of its request (a block message never arrived):
    fail the session only, and say it was the server's doing."""


REQUEST, SESSION, MEMORY, WORKER = "request", "session", "memory", "worker"


def classify(exc: BaseException, sharded: bool) -> str:
    """REQUEST or SESSION: fail the session, keep the worker. MEMORY: fail the batch's sessions,
    keep the worker. WORKER: fail it, restart the worker.

    In a VAE group only a RequestError from the agreed check is a request error: anything
    raised inside the block's work may have left the peers waiting in a collective."""
    if isinstance(exc, SessionError):
        return SESSION
    if isinstance(exc, RequestError):
        return REQUEST
    if sharded:
        return WORKER
    if type(exc).__name__ == "OutOfMemoryError":  # torch's, for CUDA and XPU
        return MEMORY
    if isinstance(exc, MemoryError) or type(exc).__name__ == "AcceleratorError":
        return WORKER
    if isinstance(exc, ValueError | TypeError | KeyError | IndexError) and not _from_device(exc):
        return REQUEST
    return WORKER  # RuntimeError and the rest: device, collective, or not foreseen


def _from_device(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(w in text for w in ("cuda", "xpu", "nccl", "ccl", "gloo", "out of memory", "device-side"))
