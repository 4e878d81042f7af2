"""The scheduler's policy driven without processes: a recording transport instead of ZeroMQ,
slot counts instead of rings, sessions placed by hand. Deterministic (no sleeps): what is sent,
in what order, for a given state of the sessions' playback clocks."""

from __future__ import annotations

import time
from types import SimpleNamespace

from streamdiff.config import Config
from streamdiff.ipc import messages as m
from streamdiff.plan import Scene, plan_blocks
from streamdiff.supervisor.scheduler import RUNNING, Scheduler, Session
from streamdiff.supervisor.topology import Topology

FACTS = {"spatial_factor": 8, "size_multiple": 16}


class Sink:
    def on_start(self, session):
        pass

    def on_data(self, session, data, block):
        pass

    def on_end(self, session, state, error, code=None):
        pass


def scheduler(latent_slots: int = 8, frame_slots: int = 6) -> tuple[Scheduler, list]:
    sent: list = []
    rings = [SimpleNamespace(spec=SimpleNamespace(slots=n)) for n in (latent_slots, frame_slots)]
    topo = Topology(workers=[], dit_workers=["dit0"], vae_groups=[["vae0.0"]])
    sched = Scheduler(Config(), topo, *rings, lambda w, msg: sent.append((w, msg)), lambda w: True, FACTS)
    return sched, sent


def running(sched: Scheduler, name: str, seconds: float, first_fragment_ago_s: float | None) -> Session:
    """A session already placed and streaming: its player started `first_fragment_ago_s` ago."""
    scenes = [Scene("p", int(16 * seconds))]
    sess = Session(name, scenes, plan_blocks(scenes, 3, 4), 128, 64, 16, 0, Sink())
    sess.state, sess.dit, sess.group, sess.vae_workers = RUNNING, "dit0", 0, ["vae0.0"]
    if first_fragment_ago_s is not None:
        sess.fragment_times = [time.monotonic() - first_fragment_ago_s]
    sched.sessions[name] = sess
    return sess


def generated(sent: list) -> list[tuple[str, int]]:
    return [(msg.session, msg.block) for _, msg in sent if isinstance(msg, m.GenerateBlock)]


def test_the_session_behind_its_player_goes_first():
    sched, sent = scheduler()
    running(sched, "ahead", 20, first_fragment_ago_s=0.0)  # its player just started
    running(sched, "behind", 20, first_fragment_ago_s=10.0)  # its player is 10 s in
    sched.pump()
    # Earliest deadline first: every block "behind" may have in flight, then "ahead".
    assert generated(sent) == [("behind", 0), ("behind", 1), ("behind", 2), ("ahead", 0), ("ahead", 1), ("ahead", 2)]


def test_work_conserving_a_slot_goes_to_whoever_can_use_it():
    sched, sent = scheduler(latent_slots=8)
    short = running(sched, "short", 0.1, first_fragment_ago_s=30.0)  # one block, far behind
    running(sched, "long", 20, first_fragment_ago_s=0.0)
    sched.pump()
    assert len(short.blocks) == 1
    assert generated(sent) == [("short", 0), ("long", 0), ("long", 1), ("long", 2)]
    assert sched.latent_pool.used == 4  # the rest stay free: nobody has a block it may run


def test_decodes_go_earliest_deadline_first_and_in_order_per_session():
    sched, sent = scheduler(frame_slots=2)
    a = running(sched, "a", 20, first_fragment_ago_s=0.0)
    b = running(sched, "b", 20, first_fragment_ago_s=5.0)
    shape = [16, 3, 8, 16]
    for sess, block in ((a, 0), (a, 1), (b, 3), (b, 4)):
        sched.decode_wait.append((sess, block, sched.latent_pool.take(), shape))
    sched.pump()
    decoded = [(msg.session, msg.block) for _, msg in sent if isinstance(msg, m.DecodeBlock)]
    assert decoded == [("b", 3), ("b", 4)]  # two frame slots: both to the session that is behind
    assert [(s.id, blk) for s, blk, *_ in sched.decode_wait] == [("a", 0), ("a", 1)]


def test_a_lost_block_message_is_reclaimed_once_its_worker_waits_idle():
    sched, sent = scheduler()
    sess = running(sched, "s", 20, first_fragment_ago_s=0.0)
    sched.pump()
    used = sched.latent_pool.used
    lost_at = sess.dit_sent[0]
    sched.worker_idle("dit0", since=lost_at + 0.01)  # its wait began as they went out: not proof
    assert sess.state == RUNNING and sched.latent_pool.used == used == 3
    sched.worker_idle("dit0", since=lost_at + 5.0)  # waiting idle long after all three went out
    assert sess.state == "failed" and "lost" in sess.error
    assert sched.latent_pool.used == 0  # every slot back: no worker will write them
