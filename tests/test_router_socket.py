"""The supervisor's control socket (ipc/sockets.py) against libzmq itself: a worker restarted
under its old name is heard even while the dead one's connection is still open."""

from __future__ import annotations

import zmq

from streamdiff.ipc import sockets


def dealer(ctx: zmq.Context, name: bytes, addr: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IDENTITY, name)
    s.connect(addr)
    return s


def test_a_restarted_worker_is_heard_before_the_dead_ones_connection_closes(tmp_path):
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/control"
    router = sockets.router(ctx, addr)
    try:
        old = dealer(ctx, b"dit0", addr)
        old.send(b"ready")
        assert router.recv_multipart() == [b"dit0", b"ready"]
        # The restart connects under the same name while the old connection is still up (the
        # ROUTER has not seen it close): what the new one sends must arrive, and replies go to it.
        new = dealer(ctx, b"dit0", addr)
        new.send(b"ready again")
        assert router.poll(5000), "the restarted worker's READY was dropped"
        assert router.recv_multipart() == [b"dit0", b"ready again"]
        router.send_multipart([b"dit0", b"gen"])
        assert new.poll(5000) and new.recv() == b"gen"
        assert not old.poll(100)
    finally:
        ctx.destroy(linger=0)  # every socket, whatever failed


def test_a_message_to_a_worker_not_connected_raises(tmp_path):
    ctx = zmq.Context()
    router = sockets.router(ctx, f"ipc://{tmp_path}/control")
    try:
        try:
            router.send_multipart([b"vae0.0", b"dec"])
        except zmq.ZMQError as exc:
            assert exc.errno == zmq.EHOSTUNREACH
        else:
            raise AssertionError("sent to a worker that is not there")
    finally:
        ctx.destroy(linger=0)
