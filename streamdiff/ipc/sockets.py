"""The supervisor's control socket: one ZeroMQ ROUTER that every worker's DEALER connects to,
addressed by the worker's name (its ZeroMQ identity)."""

from __future__ import annotations

import zmq


def router(ctx: zmq.Context, addr: str) -> zmq.Socket:
    """The ROUTER bound at `addr`.

    - LINGER 0: a stopping supervisor does not wait on messages to dead workers.
    - ROUTER_MANDATORY: a message to a worker that is not connected raises (the caller fails the
      sessions it was for) instead of vanishing.
    - ROUTER_HANDOVER: a restarted worker connects under its old name, and may do so before
      the ROUTER has noticed the dead one's connection close (a restart that reads its stored
      calibration is READY within a few hundred ms). Without handover the ROUTER keeps the
      stale connection for that name and silently drops everything the new one sends, READY
      included, so the worker never counts as up again."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.bind(addr)
    return sock
