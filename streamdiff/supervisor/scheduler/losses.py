"""Losses, one collaborator of the scheduler: which tickets a worker's silence, idleness or death
has lost. No silent loss: a ticket sent to a worker leaves only by that worker's answer, by the
worker proving it never got it (idle since before it went out: a lost message), by the socket
refusing the message (SendFailed), or by the worker's death; a ticket unanswered after
`block_timeout_s` fails its session at once (its slots come back by one of those).

Plain functions of the sessions: each says what was lost, and the scheduler ends the sessions
and gives the slots back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ...ipc import messages as m
from .tickets import T_DIT, T_VAE, Session, Ticket

log = logging.getLogger("streamdiff.scheduler")

# A message on a local socket arrives within milliseconds: a block sent this long before a worker
# began a wait (nothing running, nothing queued) that then lasted a second never reached it.
LOST_AFTER_S = 0.05


def lost_to_idle(
    sessions: Iterable[Session], worker: str, idle_since: dict[str, float]
) -> list[tuple[Session, Ticket]]:
    """The tickets a worker, idle with nothing queued since `idle_since[worker]`, never got."""
    since = idle_since[worker]
    lost = []
    for sess in sessions:
        for t in sess.tickets:
            if t.state == T_DIT and sess.place.dit == worker and t.sent_at < since - LOST_AFTER_S:
                lost.append((sess, t))
            # A group's block is lost when no shard got it: every shard idle since it went out.
            # (Had some got it, they wait in its collectives and fail at their timeout.)
            elif (
                t.state == T_VAE
                and worker in sess.place.vae_workers
                and not t.reported
                and all(idle_since.get(w, 0.0) > t.sent_at + LOST_AFTER_S for w in sess.place.vae_workers)
            ):
                lost.append((sess, t))
    return lost


def held_by(sessions: Iterable[Session], workers: frozenset[str]) -> list[tuple[Session, list[Ticket]]]:
    """The sessions that ran on any of `workers`, each with the tickets those workers held."""
    out = []
    for sess in sessions:
        dit_lost = sess.place.dit in workers
        group_lost = bool(workers & set(sess.place.vae_workers))
        if dit_lost or group_lost:
            held = [t for t in sess.tickets if (t.state == T_DIT and dit_lost) or (t.state == T_VAE and group_lost)]
            out.append((sess, held))
    return out


def late(sessions: Iterable[Session], now: float, limit: float) -> list[tuple[Session, str]]:
    """The active sessions with a ticket out at a worker for longer than `limit`, and why."""
    out = []
    for sess in sessions:
        if not sess.active:
            continue
        t = next((t for t in sess.tickets if t.state in (T_DIT, T_VAE) and now - t.sent_at > limit), None)
        if t is not None:
            where = sess.place.dit if t.state == T_DIT else f"VAE group {sess.place.group}"
            out.append((sess, f"block {t.block.index} got no answer from {where} in {limit:.0f}s"))
    return out


def refused(sess: Session, msg: m.Failed) -> tuple[list[Ticket], Ticket | None]:
    """A worker that refused a block carries on and answers nothing else for it: its reply
    stands for the block's. The DiT tickets it will never answer (the block's, and for a
    session it does not know the earlier ones it never got: FIFO), or the VAE ticket its
    reply answers (a group's shards each send one)."""
    t = sess.tickets[msg.block] if msg.block is not None and 0 <= msg.block < len(sess.tickets) else None
    if t is None:
        return [], None
    if t.state == T_DIT and msg.worker == sess.place.dit:
        gone = [t]
        if msg.kind == "session":
            for earlier in sess.tickets[: msg.block]:
                if earlier.state == T_DIT:
                    log.error("session %s: block %d never reached %s", sess.id, earlier.block.index, msg.worker)
                    gone.append(earlier)
        return gone, None
    if t.state == T_VAE and msg.worker in sess.place.vae_workers:
        t.reported.add(sess.place.vae_workers.index(msg.worker))
        t.skipped = True
        return [], t
    return [], None
