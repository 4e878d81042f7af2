"""The scheduler's collaborators, each driven alone (no Scheduler around them): admission, batching,
the books, the player's clock, and the plain functions of losses and steering. The policy tests
(test_scheduler_policy.py) drive them together through `step`."""

from __future__ import annotations

from dataclasses import replace

import pytest

from streamdiff.config import Config
from streamdiff.ipc import messages as m
from streamdiff.models.spec import preset_card
from streamdiff.plan import Scene, plan_blocks
from streamdiff.supervisor.handle import FAILED, RUNNING
from streamdiff.supervisor.scheduler import events as e
from streamdiff.supervisor.scheduler import losses, steering
from streamdiff.supervisor.scheduler.admission import Admission
from streamdiff.supervisor.scheduler.batching import STAGE_DEPTH, Batching
from streamdiff.supervisor.scheduler.books import Books
from streamdiff.supervisor.scheduler.capacity import CapacityModel
from streamdiff.supervisor.scheduler.meters import Meters
from streamdiff.supervisor.scheduler.tickets import T_DIT, T_FAILED, T_LATENT, T_QUEUED, T_VAE, Session, Slots
from streamdiff.supervisor.topology import Topology

CARD = preset_card("tiny")
TOPO = Topology(workers=[], dit_workers=["dit0", "dit1"], vae_groups=[["vae0.0"], ["vae1.0"]])


def session(name: str, seconds: float = 2.0, width: int = 128, created: float = 0.0) -> Session:
    scenes = [Scene("p", int(16 * seconds))]
    return Session(name, scenes, plan_blocks(scenes, 3, 4), width, 64, 16, 0, created=created)


def ready_info(block_ms: float) -> m.ReadyInfo:
    return m.ReadyInfo(dit=m.DiTReady(m.StageCost(block_ms, [128, 64])))


def running(sess: Session, adm: Admission) -> Session:
    assert adm.place(sess, [], lambda w: True)
    sess.state = RUNNING
    return sess


def test_admission_places_on_the_least_busy_dit_and_refuses_past_the_predicted_wait():
    cfg = replace(Config(), limits=replace(Config().limits, max_queue_wait_s=5.0))
    adm = Admission(cfg, TOPO, CARD)
    for dit in TOPO.dit_workers:  # a block of 3 latent frames (0.75 s of video) in 0.5 s: 2/3 busy
        adm.calibrate(dit, ready_info(500.0))
    first = running(session("a", seconds=20), adm)
    second = session("b", seconds=20)
    assert adm.submit(second, [first]) is None and list(adm.queue) == [second]
    assert adm.next_to_start([first], lambda w: True) is second and not adm.queue
    assert (first.place.dit, second.place.dit) == ("dit0", "dit1")  # the idle one
    second.state = RUNNING
    third = session("c", seconds=20)
    refused = adm.submit(third, [first, second])  # both DiTs 2/3 busy: it waits for a 20 s video
    assert isinstance(refused, e.Reject) and refused.retry_after_s > 5.0 and not adm.queue
    assert adm.submit(session("d", seconds=20), []) is None  # alone it would start now


def test_admission_stops_and_hands_back_its_queue():
    adm = Admission(Config(), TOPO, CARD)
    queued = [session(n) for n in "ab"]
    for s in queued:
        assert adm.submit(s, []) is None
    books_view = adm.queue  # the books hold the same queue
    assert adm.stop() == queued and not books_view and not adm.accepting
    assert "not admitting" in adm.submit(session("c"), []).message


def test_batching_groups_one_key_while_it_pays_and_holds_two_batches_a_unit():
    capacity = CapacityModel(1.0)
    batching = Batching(4, capacity)
    sessions = [session(n, seconds=20) for n in "abc"] + [session("wide", seconds=20, width=256)]
    cands = [(s, s.tickets[0]) for s in sessions]
    key = lambda s, t: s.width  # noqa: E731

    def deadline(s, b):
        return 10.0 + s.blocks[b].start_frame / s.fps

    assert batching.choose("dit0", cands, 4, 0.0, key, deadline, 0.0) == cands[:1]  # nothing measured
    capacity.calibrate("dit0", [128, 64], 100.0, None)
    capacity.calibrate_batch("dit0", [128, 64], 2, 0.7)
    chosen = batching.choose("dit0", cands, 4, 0.0, key, deadline, 0.0)
    assert [s.id for s, _ in chosen] == ["a", "b", "c"]  # cheaper per block; never the other size
    assert [s.id for s, _ in batching.choose("dit0", cands, 2, 0.0, key, deadline, 0.0)] == ["a", "b"]  # slots
    for _ in range(STAGE_DEPTH):
        assert batching.room("dit0")
        bid = batching.open("dit0", chosen, 0.0)
    assert not batching.room("dit0") and batching.room("dit1")
    assert batching.free_at["dit0"] > 0.0
    for _, t in chosen:
        t.batch = bid
        batching.left(t)
    assert batching.room("dit0") and bid not in batching.out


def test_books_end_gives_back_what_nobody_holds_and_forgets_the_session_last():
    slots = Slots(4, 4)
    books = Books(TOPO, slots, [], Meters(0.5).metrics)
    sess = session("s", seconds=20)
    sess.state, sess.place.dit, sess.place.group = RUNNING, "dit0", 0
    books.sessions["s"] = sess
    at_dit, ready = sess.tickets[0], sess.tickets[1]
    slots.advance(at_dit, T_DIT)
    slots.advance(ready, T_DIT)
    slots.advance(ready, T_LATENT)
    out: list = []
    books.end(sess, FAILED, "a test", out)
    assert [(type(a), getattr(a, "worker", None)) for a in out] == [
        (e.Send, "dit0"),
        (e.Send, "vae0.0"),
        (e.CloseEncoder, None),
        (e.End, None),
    ]
    assert ready.state == T_FAILED and sess.tickets[2].state == T_FAILED
    assert at_dit.state == T_DIT and slots.latent.used == 1  # the DiT may still write its slot
    assert books.sessions == {"s": sess}
    books.release(sess, at_dit, out)  # the DiT answered
    assert slots.latent.used == 0 and books.sessions == {} and len(out) == 4  # ended once


def test_meters_clock_counts_from_the_request_then_the_first_fragment():
    meters = Meters(startup_buffer_s=0.5)
    sess = session("s", seconds=20, created=2.0)
    b = sess.blocks[2]
    assert meters.deadline(sess, 2) == pytest.approx(2.0 + 0.5 + b.start_frame / 16)
    meters.fragment(sess, sess.blocks[0], 3.0)
    assert meters.deadline(sess, 2) == pytest.approx(3.0 + 0.5 + b.start_frame / 16)
    assert meters.paced_until(sess, 1.0) == 0.0  # not a live session: never paced
    sess.live = True
    assert meters.paced_until(sess, 1.0) == pytest.approx(meters.deadline(sess, 0) - 1.0)


def test_losses_a_session_refusal_loses_the_earlier_blocks_the_worker_never_got():
    sess = session("s", seconds=20)
    sess.place.dit, sess.place.vae_workers = "dit0", ["vae0.0", "vae0.1"]
    slots = Slots(8, 8)
    for t in sess.tickets[:3]:
        slots.advance(t, T_DIT)
    gone, answered = losses.refused(sess, m.Failed("dit0", "no such session", "s", 2, "session"))
    assert [t.block.index for t in gone] == [2, 0, 1] and answered is None
    assert losses.refused(sess, m.Failed("dit1", "not mine", "s", 2, "session")) == ([], None)
    vae = sess.tickets[0]
    vae.state = T_VAE
    gone, answered = losses.refused(sess, m.Failed("vae0.1", "bad block", "s", 0, "request"))
    assert gone == [] and answered is vae and vae.reported == {1} and vae.skipped


def test_losses_late_and_idle_name_the_block_and_the_worker():
    sess = session("s", seconds=20)
    sess.state, sess.place.dit, sess.place.group, sess.place.vae_workers = RUNNING, "dit0", 0, ["vae0.0"]
    t = sess.tickets[0]
    t.state, t.sent_at = T_DIT, 1.0
    assert losses.late([sess], 5.0, 30.0) == []
    assert losses.late([sess], 40.0, 30.0) == [(sess, "block 0 got no answer from dit0 in 30s")]
    assert losses.lost_to_idle([sess], "dit0", {"dit0": 1.01}) == []  # idle since it went out: in flight
    assert losses.lost_to_idle([sess], "dit0", {"dit0": 2.0}) == [(sess, t)]
    assert losses.held_by([sess], frozenset({"vae0.0"})) == [(sess, [])]  # the group held nothing of it
    assert sess.tickets[1].state == T_QUEUED


def test_steering_lands_after_a_pending_steer_and_refuses_past_its_limit():
    sess = session("s", seconds=20)
    sess.issued = 2
    first = steering.steer(sess, Scene("b", 1), CARD, max_pending=2)
    second = steering.steer(sess, Scene("c", 1), CARD, max_pending=2)
    assert first.refused is None and second.start_frame > first.start_frame  # after the pending one
    assert steering.steer(sess, Scene("d", 1), CARD, max_pending=2).refused[0] == 429
    assert [sc.prompt for sc in sess.scenes] == ["p", "b", "c"]
    landed = steering.stop(sess, CARD)
    assert landed.refused is None and landed.start_frame == sess.blocks[-1].start_frame + sess.blocks[-1].emit
    assert len(sess.blocks) == 2  # the blocks that had started
    assert steering.finished("gone").refused == (409, steering.FINISHED)
