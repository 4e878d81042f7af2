"""The step scheduler's policy driven without processes: a fake world of workers and encoders
answers its actions one at a time, oldest first, and the clock is an argument. Deterministic (no
sleeps, no threads): cancellation, worker death and a lost message at every point of a session's
life, a slow stage, deadlines and batching."""

from __future__ import annotations

import json
from collections import deque
from dataclasses import replace

import pytest

from streamdiff.config import Config
from streamdiff.ipc import messages as m
from streamdiff.models.spec import preset_card
from streamdiff.plan import Scene, plan_blocks
from streamdiff.supervisor import scheduler as s
from streamdiff.supervisor.scheduler.batching import STAGE_DEPTH
from streamdiff.supervisor.scheduler.capacity import TRIALS
from streamdiff.supervisor.scheduler.meters import Meters
from streamdiff.supervisor.scheduler.tickets import T_DIT, T_EMITTED, T_FRAMES, T_LATENT, T_QUEUED, T_VAE
from streamdiff.supervisor.topology import Topology

CARD = preset_card("tiny")
TWO_PIPELINES = (["dit0", "dit1"], [["vae0.0"], ["vae1.0"]])
ONE_PIPELINE_K2 = (["dit0"], [["vae0.0", "vae0.1"]])


def config(**sections: dict) -> Config:
    """Config() with some fields of some sections changed: config(limits={"max_sessions": 1})."""
    base = Config()
    return replace(base, **{name: replace(getattr(base, name), **fields) for name, fields in sections.items()})


class World:
    """Fake workers and encoders: every message and encoder job waits in one FIFO; `advance`
    carries out the oldest and steps the scheduler with its result. Workers answer a closed
    session's blocks `skipped`, as the real ones do; a dead worker's queue is gone."""

    def __init__(
        self, layout=TWO_PIPELINES, latent_slots=8, frame_slots=6, cfg: Config | None = None, devices=None
    ) -> None:
        dits, groups = layout
        topo = Topology(workers=[], dit_workers=dits, vae_groups=groups, devices=devices or {})
        self.ready = set(dits) | {w for g in groups for w in g}
        self.groups = groups
        self.sched = s.Scheduler(cfg or Config(), topo, latent_slots, frame_slots, CARD)
        self.now = 0.0
        self.todo: deque = deque()  # (worker or "encoder", what)
        self.closed: set[tuple[str, str]] = set()  # (worker, session) closed at that worker
        self.emitted: dict[str, list] = {}
        self.ended: dict[str, s.End] = {}
        self.rejected: dict[str, s.Reject] = {}
        self.sent: list[tuple[str, m.Message]] = []
        self.encoded: list = []  # every Encode asked for
        self.drop = lambda worker, msg: False  # a message lost on its way
        self.unreachable = lambda worker, msg: False  # a message the socket refused (peer gone)
        self.acks: list[s.Event] = []
        self.acking = True  # the consumer takes every fragment at once
        self.slow: set[str] = set()  # workers that answer last
        self.share_ms = {"dit": lambda batch: 10.0, "vae": lambda batch: 20.0}  # a block's share of its batch

    # -- the scheduler's side -------------------------------------------------------------------
    def step(self, *events: s.Event, dt: float = 0.001) -> list[s.Action]:
        self.now += dt
        events, self.acks = [*self.acks, *events], []
        actions = self.sched.step(events, self.now, self.ready)
        for a in actions:
            self._take(a)
        return actions

    def _take(self, a: s.Action) -> None:
        if isinstance(a, s.Send):
            self.sent.append((a.worker, a.msg))
            if self.unreachable(a.worker, a.msg):  # the driver posts the failure for the next step
                self.acks.append(s.SendFailed(a.worker, a.msg))
            elif isinstance(a.msg, m.CloseSession):
                self.closed.add((a.worker, a.msg.session))
            elif isinstance(a.msg, m.GenerateBatch | m.DecodeBatch) and not self.drop(a.worker, a.msg):
                self.todo.append((a.worker, a.msg))
        elif isinstance(a, s.OpenEncoder | s.Encode):
            self.todo.append(("encoder", a))
            if isinstance(a, s.Encode):
                self.encoded.append(("encoder", a))
        elif isinstance(a, s.Emit):
            assert a.session not in self.ended, "bytes after the end"
            self.emitted.setdefault(a.session, []).append(a)
            if a.block is not None and self.acking:
                self.acks.append(s.Ack(a.session))
        elif isinstance(a, s.End):
            assert a.session not in self.ended, "ended twice"
            self.ended[a.session] = a
        elif isinstance(a, s.Reject):
            self.rejected[a.session] = a

    def session(self, name: str, seconds: float = 2.0, width: int = 128, height: int = 64) -> s.Session:
        scenes = [Scene("p", int(16 * seconds))]
        return s.Session(name, scenes, plan_blocks(scenes, 3, 4), width, height, 16, 0, created=self.now)

    def submit(self, name: str, seconds: float = 2.0, width: int = 128, height: int = 64) -> s.Session:
        sess = self.session(name, seconds, width, height)
        self.step(s.Submit(sess))
        return sess

    def submit_together(self, *sessions: s.Session) -> None:
        """Requests that arrive together: one step."""
        self.step(*(s.Submit(x) for x in sessions))

    # -- the world's side -----------------------------------------------------------------------
    def _answer(self, worker: str, what) -> list[s.Event]:
        if worker == "encoder":
            if isinstance(what, s.OpenEncoder):
                return [s.EncoderOpened(what.session, init=b"init")]
            return [s.Encoded(what.session, what.block.index, data=b"frag%d" % what.block.index, seconds=0.001)]
        n = len(what.blocks)
        if isinstance(what, m.GenerateBatch):
            return [
                m.LatentDone(b.session, b.block, b.slot, [16, b.frames, 8, 16], self.share_ms["dit"](n), batch=n)
                if (worker, b.session) not in self.closed
                else m.LatentDone(b.session, b.block, b.slot, [], 0.0, skipped=True)
                for b in what.blocks
            ]
        rank = next(g.index(worker) for g in self.groups if worker in g)
        return [
            m.FramesDone(d.session, d.block, rank, d.frame_slot, self.share_ms["vae"](n), batch=n)
            if (worker, d.session) not in self.closed
            else m.FramesDone(d.session, d.block, rank, d.frame_slot, 0.0, skipped=True)
            for d in what.blocks
        ]

    def advance(self) -> bool:
        """Carry out the oldest outstanding job (a slow worker's only when nothing else is
        left: the bottleneck); False when there is none."""
        if not self.todo:
            return False
        job = next((j for j in self.todo if j[0] not in self.slow), self.todo[0])
        self.todo.remove(job)
        self.step(*self._answer(*job))
        return True

    def run(self, limit: int = 1000) -> None:
        while self.advance():
            limit -= 1
            assert limit > 0, "no end"
        self.step()

    def kill(self, workers: set[str]) -> None:
        """The pool saw these exit (their queues are gone) and restarts them at once."""
        self.todo = deque((w, x) for w, x in self.todo if w not in workers)
        self.closed = {(w, x) for w, x in self.closed if w not in workers}
        self.step(s.WorkersLost(frozenset(workers), "worker died"))

    def states(self, name: str) -> list[str]:
        sess = self.sched.books.sessions.get(name)
        return [t.state for t in sess.tickets] if sess else []

    def assert_clean(self) -> None:
        """Nothing held, nothing tracked: every slot back, every session forgotten."""
        assert self.sched.slots.latent.used == 0
        assert self.sched.slots.frame.used == 0
        assert self.sched.books.sessions == {}
        assert self.sched.batching.out == {}

    def fragments(self, name: str) -> list[int]:
        return [a.block.index for a in self.emitted.get(name, []) if a.block is not None]


def test_two_sessions_stream_to_the_end_and_leave_nothing_behind():
    w = World()
    a, b = w.submit("a"), w.submit("b")
    w.run()
    for sess in (a, b):
        assert w.ended[sess.id].state == "done"
        assert w.fragments(sess.id) == list(range(len(sess.blocks)))
        assert w.emitted[sess.id][0].block is None and w.emitted[sess.id][0].data == b"init"
    w.assert_clean()


def test_work_goes_only_to_the_workers_each_step_names_ready():
    """The scheduler reads no live state: readiness is the step's argument. A session waits
    while its VAE shard is not ready, starts on the DiT whose ranks are, and goes on once the
    shard is named ready."""
    w = World(layout=ONE_PIPELINE_K2)
    w.ready.discard("vae0.1")
    w.submit("a")
    assert w.sent == [] and w.states("a") == [T_QUEUED] * len(w.states("a"))  # its group is not ready
    w.ready.add("vae0.1")
    w.step()  # nothing else happened: the next step places it
    w.run()
    assert w.ended["a"].state == "done"
    w.assert_clean()


def test_a_fixed_video_opens_with_its_held_frames_bound_and_a_live_one_without():
    """OpenSession tells the DiT how many latent frames a shot of the session can hold at most
    (`plan.most_held_frames`: all its planned blocks), so its KV cache is sized no larger; a
    live video's is unbounded (0: the full window)."""
    w = World()
    fixed = w.submit("fixed", seconds=1.0)  # 16 frames: 5 latent frames in 2 blocks of 3
    live = w.session("live", seconds=1.0)
    live.live = True
    w.step(s.Submit(live))
    opened = {msg.session: msg for _, msg in w.sent if isinstance(msg, m.OpenSession)}
    assert opened["fixed"].held_frames == sum(b.latent_frames for b in fixed.blocks) == 6
    assert opened["live"].held_frames == 0


# Two worlds: plenty of frame slots, and one frame slot for both sessions (blocks then wait in
# latent_ready for it).
FRAME_SLOTS = (6, 1)


def world(frame_slots: int) -> World:
    w = World(frame_slots=frame_slots)
    w.submit("victim")
    w.submit("neighbour")
    return w


def lifetime_steps() -> int:
    w = world(1)
    steps = 0
    while w.advance():
        steps += 1
    return steps


STEPS = lifetime_steps()


@pytest.mark.parametrize("k", range(STEPS + 1))
@pytest.mark.parametrize("frame_slots", FRAME_SLOTS)
def test_cancel_at_every_point(k, frame_slots):
    """Cancel after k jobs of the world: the victim ends cancelled once, nothing after its end,
    every slot comes back; its neighbour (the other pipeline) plays to the end."""
    w = world(frame_slots)
    for _ in range(k):
        w.advance()
    states = w.states("victim")
    w.step(s.Cancel("victim"))
    w.run()
    if states:
        assert w.ended["victim"].state == "cancelled", states
    assert w.ended["neighbour"].state == "done"
    assert w.fragments("neighbour") == [0, 1, 2]
    assert w.fragments("victim") == list(range(len(w.fragments("victim"))))  # a prefix, in order
    w.assert_clean()


def test_cancellation_points_cover_every_ticket_state():
    seen = set()
    for k, frame_slots in [(k, n) for k in range(STEPS + 1) for n in FRAME_SLOTS]:
        w = world(frame_slots)
        for _ in range(k):
            w.advance()
        seen |= set(w.states("victim"))
    assert {T_QUEUED, T_DIT, T_LATENT, T_VAE, T_FRAMES, T_EMITTED} <= seen


def test_a_session_cancelled_while_queued_for_admission_never_starts():
    w = World(cfg=config(limits={"max_sessions": 1}))
    w.submit("first")
    w.submit("second")
    assert [q.id for q in w.sched.admission.queue] == ["second"]
    w.step(s.Cancel("second"))
    w.run()
    assert w.ended["second"].state == "cancelled" and "second" not in w.emitted
    assert not any(msg.session == "second" for _, msg in w.sent if hasattr(msg, "session"))
    assert w.ended["first"].state == "done"
    w.assert_clean()


@pytest.mark.parametrize("k", range(STEPS + 1))
@pytest.mark.parametrize("dead", ["dit0", "vae0.0"])
@pytest.mark.parametrize("frame_slots", FRAME_SLOTS)
def test_worker_death_at_every_point(k, dead, frame_slots):
    """A worker of the victim's pipeline dies after k jobs: the victim fails (unless it had
    finished), every slot comes back, and the other pipeline's session plays to the end."""
    w = world(frame_slots)
    for _ in range(k):
        w.advance()
    finished = "victim" in w.ended
    w.kill({dead})
    w.run()
    assert w.ended["victim"].state == ("done" if finished else "failed")
    assert w.ended["neighbour"].state == "done" and w.fragments("neighbour") == [0, 1, 2]
    w.assert_clean()


def test_death_of_one_shard_of_a_group_frees_blocks_the_other_shard_answered():
    w = World(layout=ONE_PIPELINE_K2)
    w.submit("s")
    while not any(isinstance(x, m.DecodeBatch) for _, x in w.todo):
        w.advance()
    while w.todo[0][0] != "vae0.0":  # the first shard answers its decode, the second never will
        w.advance()
    w.advance()
    w.kill({"vae0.1"})
    w.run()
    assert w.ended["s"].state == "failed"
    w.assert_clean()


@pytest.mark.parametrize("nth", range(6))
def test_a_lost_message_fails_its_session_once_the_worker_proves_idle(nth):
    """The nth block message on its way to a worker is lost: nobody answers it. A heartbeat
    saying the worker has waited idle since well after it went out reclaims it."""
    w = World(layout=(["dit0"], [["vae0.0"]]))
    count = {"n": 0}

    def drop(worker, msg):
        count["n"] += 1
        return count["n"] == nth + 1

    w.drop = drop
    w.submit("s")
    w.run()
    assert "s" not in w.ended, "a lost message must not end anything by itself"
    lost_at = w.now
    w.step(s.WorkerIdle("dit0", since=lost_at + 0.01), s.WorkerIdle("vae0.0", since=lost_at + 0.01), dt=0.0)
    assert "s" not in w.ended  # its wait began as the message went out: not proof
    w.step(s.WorkerIdle("dit0", since=lost_at + 5), s.WorkerIdle("vae0.0", since=lost_at + 5), dt=6)
    w.run()
    assert w.ended["s"].state == "failed" and "lost" in w.ended["s"].error
    w.assert_clean()


@pytest.mark.parametrize(
    "layout, worker, kind",
    [
        (TWO_PIPELINES, "dit0", m.GenerateBatch),
        (TWO_PIPELINES, "vae0.0", m.DecodeBatch),
        (ONE_PIPELINE_K2, "vae0.1", m.DecodeBatch),
    ],
)
def test_a_send_the_socket_refuses_fails_its_session_at_once(layout, worker, kind):
    """The worker is not connected: the block's session fails in the same breath. A DiT batch's
    slots come back at once; a decode's once the group is gone (a shard that did get it may be
    writing). Another pipeline's session plays on."""
    w = World(layout=layout)
    refused = []

    def unreachable(to, msg):
        if to == worker and isinstance(msg, kind) and not refused:
            refused.append(msg)
            return True
        return False

    w.unreachable = unreachable
    w.submit("victim")
    if layout == TWO_PIPELINES:
        w.submit("neighbour")
    w.run()
    assert w.ended["victim"].state == "failed" and "could not reach" in w.ended["victim"].error
    if kind is m.DecodeBatch:
        assert w.sched.slots.latent.used == 1 and w.sched.slots.frame.used == 1  # until the group is gone
        w.kill(set(w.groups[0]))
        w.run()
    if layout == TWO_PIPELINES:
        assert w.ended["neighbour"].state == "done"
    w.assert_clean()


def test_a_slow_stage_bounds_what_runs_ahead_and_a_dead_slow_one_fails_at_its_deadline():
    """The VAE holds its first decode: the DiT runs ahead only by the session's window, and the
    session fails cleanly once the decode is past block_timeout_s; its slots come back when
    the stuck worker finally answers."""
    w = World(layout=(["dit0"], [["vae0.0"]]), cfg=config(pipeline={"block_timeout_s": 30}))
    w.acking = False
    w.submit("s", seconds=6)
    held = []
    for _ in range(50):
        if not w.todo:
            break
        if w.todo[0][0] == "vae0.0":
            held.append(w.todo.popleft())
            continue
        w.advance()
    limit = w.sched.cfg.pipeline.max_blocks_in_flight
    assert sum(st != T_QUEUED for st in w.states("s")) == limit  # no ack, no more than the window
    assert "s" not in w.ended
    w.step(dt=31)
    assert w.ended["s"].state == "failed" and "no answer" in w.ended["s"].error
    # The stuck worker holds what it was sent (two batches); the block waiting for it came back.
    assert w.sched.slots.frame.used == w.sched.slots.latent.used == STAGE_DEPTH
    w.todo.extend(held)
    w.run()
    w.assert_clean()


def test_the_session_behind_its_player_goes_first():
    w = World(layout=(["dit0"], [["vae0.0"]]))
    ahead, behind = w.session("ahead", seconds=20), w.session("behind", seconds=20)
    ahead.playback.fragment_times = [w.now]  # its player just started
    behind.playback.fragment_times = [w.now - 10]  # its player is 10 s in
    w.submit_together(ahead, behind)
    # One batch running, one queued behind it: both the most urgent session's. The rest wait here,
    # where the next choice is made when a batch finishes.
    assert first_batches(w) == [["behind"], ["behind"]]
    while len(first_batches(w)) < 3:  # the first batch done: the next choice
        w.advance()
    assert first_batches(w)[2][0] == "behind"  # still the one behind first, as long as its window allows


def test_work_conserving_a_slot_goes_to_whoever_can_use_it():
    w = World(layout=(["dit0"], [["vae0.0"]]))
    w.submit("short", seconds=0.5)  # one block
    w.submit("long", seconds=20)
    firsts = [[b.session for b in msg.blocks] for _, msg in w.sent if isinstance(msg, m.GenerateBatch)]
    assert firsts == [["short"], ["long"]]  # short has nothing more: the DiT's second place goes to long


ADMIT_ALL_SECTIONS = {"limits": {"target_utilization": 100.0}}
ADMIT_ALL = config(**ADMIT_ALL_SECTIONS)


def calibrated(world: World, factors: dict[int, float], block_ms: float = 100.0, vae_ms: float = 0.0) -> None:
    batch_ms = {str(b): f * block_ms for b, f in factors.items()}
    info = m.ReadyInfo(dit=m.DiTReady(m.StageCost(block_ms, [128, 64]), batch_ms))
    world.step(s.WorkerReady("dit0", info))
    if vae_ms:
        world.sched.admission.capacity.calibrate("vae-group-0", [128, 64], vae_ms, None)


def first_batches(w: World) -> list[list[str]]:
    return [[b.session for b in msg.blocks] for _, msg in w.sent if isinstance(msg, m.GenerateBatch)]


def test_sessions_of_one_size_batch_when_it_pays():
    w = World(layout=(["dit0"], [["vae0.0"]]), cfg=ADMIT_ALL)
    calibrated(w, {2: 0.8, 3: 0.75, 4: 0.7})
    w.submit_together(*(w.session(name, seconds=20) for name in "abcd"))
    assert first_batches(w)[0] == ["a", "b", "c", "d"]
    assert {(b.session, b.block) for b in w.sent[-1][1].blocks} == {(n, 1) for n in "abcd"}
    w.run()
    assert all(w.ended[n].state == "done" and w.fragments(n) == list(range(27)) for n in "abcd")
    w.assert_clean()


def test_no_batch_without_a_measured_gain_nor_across_sizes():
    w = World(layout=(["dit0"], [["vae0.0"]]), cfg=ADMIT_ALL)
    calibrated(w, {2: 1.05})  # a batch of two costs more per block than one alone ...
    for _ in range(2 * TRIALS):  # ... and real pairs confirmed it
        w.sched.admission.capacity.observe("dit0", (128, 64), 105.0, batch=2)
    w.submit_together(w.session("a", seconds=20), w.session("b", seconds=20))
    assert first_batches(w) == [["a"], ["b"]]
    w = World(layout=(["dit0"], [["vae0.0"]]), cfg=ADMIT_ALL)
    calibrated(w, {2: 0.8})
    w.submit_together(w.session("a", seconds=20), w.session("wide", seconds=20, width=256))
    assert first_batches(w) == [["a"], ["wide"]]


@pytest.mark.parametrize("prior, real", [(1.05, 0.8), (0.8, 1.3), (1.3, 0.8)])
def test_the_first_batches_of_a_size_are_trials_and_their_measured_cost_decides(prior, real):
    """The pair's factor timed at READY is a prior (one timing, inside a CPU's noise): where it
    says a gain or about none, the first pairs run and what they measure decides whether pairs
    go on; where it says clearly dearer, no pair runs."""
    w = World(layout=(["dit0"], [["vae0.0"]]), cfg=ADMIT_ALL)
    w.slow = {"dit0"}  # the DiT is the bottleneck: both sessions always have a block for it
    w.share_ms["dit"] = lambda n: 100.0 * (real if n == 2 else 1.0)
    calibrated(w, {2: prior})
    w.submit_together(w.session("a", seconds=20), w.session("b", seconds=20))
    w.run()
    sizes = [len(b) for b in first_batches(w)]
    pairs = sum(n == 2 for n in sizes)
    if prior > 1.1:
        assert pairs == 0
    elif real < 1:
        assert pairs == 27  # measured cheaper: every block of the two goes in a pair
    else:  # measured dearer: the trials (and the one already queued behind them), then alone
        assert sizes[0] == 2 and pairs <= TRIALS + 1 and sizes[-4:] == [1, 1, 1, 1]
    assert all(w.ended[n].state == "done" for n in "ab")
    w.assert_clean()


def test_a_batch_never_makes_an_on_time_block_late():
    """Alone the head's block takes 100 ms, in a batch of two 160 ms. Due in 150 ms: alone. Due
    in 50 ms (late anyway): the batch, which serves both sooner than one after the other."""
    for due_in, expected in ((0.150, ["head"]), (0.050, ["head", "other"])):
        w = World(layout=(["dit0"], [["vae0.0"]]), cfg=config(**ADMIT_ALL_SECTIONS, pipeline={"startup_buffer_s": 0.0}))
        calibrated(w, {2: 0.8})
        head, other = w.session("head", seconds=20), w.session("other", seconds=20)
        head.created = w.now + 0.001 + due_in  # block 0 is due startup_buffer_s (0) after the request
        other.created = head.created + 1.0
        w.submit_together(head, other)
        assert first_batches(w)[0] == expected, due_in


def test_admission_rejects_with_the_predicted_wait_when_full():
    w = World(layout=(["dit0"], [["vae0.0"]]), cfg=config(limits={"max_queue_wait_s": 5.0}))
    calibrated(w, {}, block_ms=600.0, vae_ms=600.0)  # blocks of 12 frames at 16 fps: each stage 80% busy
    w.submit("a", seconds=10)
    w.submit("b", seconds=10)
    assert "a" in w.sched.books.sessions and w.sched.books.sessions["a"].state == "running"
    assert "b" in w.rejected and w.rejected["b"].retry_after_s > 5
    assert "b" not in w.sched.books.sessions


def test_decodes_go_earliest_deadline_first_and_in_order_per_session():
    w = World(layout=(["dit0"], [["vae0.0"]]), frame_slots=2)
    a = w.submit("a", seconds=20)
    b = w.submit("b", seconds=20)
    b.playback.fragment_times = [w.now - 5]  # b's player is 5 s in: behind
    a.playback.fragment_times = [w.now]
    w.sched.slots.frame.free.clear()  # the frames are busy elsewhere: decodes wait
    while any(x[0] == "dit0" for x in w.todo):
        w.advance()
    w.sched.slots.frame.free.extend([0, 1])
    w.sent.clear()
    w.step()
    decoded = [[(d.session, d.block) for d in msg.blocks] for _, msg in w.sent if isinstance(msg, m.DecodeBatch)]
    assert decoded == [[("b", 0)], [("b", 1)]]  # both slots to the session that is behind, in block order


def vae_calibrated(world: World, factor: float, block_ms: float = 100.0) -> None:
    info = m.ReadyInfo(vae=m.VAEReady(m.StageCost(block_ms, [128, 64]), {"2": factor * block_ms}))
    world.step(s.WorkerReady(world.groups[0][0], info))


def decode_batches(w: World) -> dict[str, list[list[tuple[str, int]]]]:
    """Per VAE worker, the batches it was sent."""
    out: dict[str, list] = {}
    for worker, msg in w.sent:
        if isinstance(msg, m.DecodeBatch):
            out.setdefault(worker, []).append([(d.session, d.block) for d in msg.blocks])
    return out


@pytest.mark.parametrize("factor", [0.7, 1.2])
def test_a_vae_group_decodes_batches_only_where_its_measured_cost_falls(factor):
    """A k=2 group: decodes of two sessions go together once the group is busy and pairs measure
    cheaper per block; never where the group timed them clearly dearer (as on this CPU). Both
    shards get the very same batches, so they agree on every collective."""
    w = World(layout=ONE_PIPELINE_K2, cfg=ADMIT_ALL)
    w.slow = {"vae0.0", "vae0.1"}  # the bottleneck: blocks wait for it
    w.share_ms["vae"] = lambda n: 100.0 * (factor if n == 2 else 1.0)
    vae_calibrated(w, factor)
    w.submit_together(w.session("a", seconds=8), w.session("b", seconds=8))
    w.run()
    batches = decode_batches(w)
    assert batches["vae0.0"] == batches["vae0.1"]
    pairs = sum(len(b) == 2 for b in batches["vae0.0"])
    assert pairs > TRIALS + 1 if factor < 1 else pairs == 0  # a clearly dearer timing is believed
    assert all(w.ended[n].state == "done" and w.fragments(n) == list(range(11)) for n in "ab")
    w.assert_clean()


# -- steering, stop and pacing --------------------------------------------------------------------
def landing(actions: list) -> s.Steered:
    return next(a for a in actions if isinstance(a, s.Steered))


def test_a_steer_lands_on_the_first_block_not_started_and_the_video_keeps_its_length():
    w = World(layout=(["dit0"], [["vae0.0"]]))
    sess = w.submit("s", seconds=6)
    total = sess.frames
    for _ in range(6):
        w.advance()
    issued = sess.issued
    landed = landing(w.step(s.Steer("s", Scene("a red ball", 1, "continue", recache=True))))
    assert landed.refused is None and landed.scene == 1
    assert landed.start_frame == sess.blocks[issued].start_frame  # the first block the DiT had not started
    again = landing(w.step(s.Steer("s", Scene("a blue square", 1, "cut", seed=5))))
    assert again.scene == 2 and again.start_frame == sess.blocks[issued + 1].start_frame  # after the pending one
    third = landing(w.step(s.Steer("s", Scene("too soon", 1))))
    assert third.refused[0] == 429  # two scene changes are already waiting for their first block
    w.run()
    assert w.ended["s"].state == "done" and sum(a.block.emit for a in w.emitted["s"][1:]) == total
    gens = {b.block: b for _, msg in w.sent if isinstance(msg, m.GenerateBatch) for b in msg.blocks}
    assert gens[issued].prompt == "a red ball" and not gens[issued].new_shot and gens[issued].recache
    assert gens[issued + 1].prompt == "a blue square" and gens[issued + 1].new_shot and gens[issued + 1].seed == 5
    assert not gens[issued + 1].recache
    assert [sc.prompt for sc in landed.scenes] == ["p", "a red ball"]
    w.assert_clean()


def test_the_stream_marks_each_steered_scene_where_it_lands():
    w = World(layout=(["dit0"], [["vae0.0"]]))
    w.submit("s", seconds=6)
    for _ in range(5):
        w.advance()
    landed = landing(w.step(s.Steer("s", Scene("new", 1, "continue"))))
    w.run()
    marked = {a.block.start_frame for a in w.emitted["s"][1:] if a.block.first_of_scene}
    assert marked == {0, landed.start_frame}
    emsg = [json.loads(a.events[0][2]) for _, a in w.encoded if a.events]
    assert [(e["scene"], e["start_frame"], e["transition"]) for e in emsg] == [
        (0, 0, "cut"),
        (1, landed.start_frame, "continue"),
    ]


def test_stop_ends_the_video_at_the_next_block_boundary():
    w = World(layout=(["dit0"], [["vae0.0"]]))
    sess = w.submit("s", seconds=20)
    for _ in range(6):
        w.advance()
    issued = sess.issued
    landed = landing(w.step(s.Stop("s")))
    assert (
        landed.refused is None
        and landed.start_frame == sess.blocks[issued - 1].start_frame + sess.blocks[issued - 1].emit
    )
    w.run()
    assert w.ended["s"].state == "done"
    assert w.fragments("s") == list(range(issued))  # every block already started, and no other
    assert landing(w.step(s.Steer("s", Scene("late", 1)))).refused[0] == 409
    w.assert_clean()


def test_a_live_session_is_paced_to_its_player_and_wakes_the_scheduler_when_a_block_is_due():
    w = World(layout=(["dit0"], [["vae0.0"]]), cfg=config(pipeline={"live_lead_s": 1.0}))
    live = w.session("live", seconds=60)
    live.live = True
    w.submit_together(live)
    w.run()  # everything it may make now, with its player's clock running from the first fragment
    ahead = live.blocks[live.issued].start_frame / live.fps - (w.now - live.playback.fragment_times[0] - 0.5)
    assert live.issued < len(live.blocks) and ahead > 1.0  # its next block is more than the lead ahead
    wake = [a for a in w.step() if isinstance(a, s.WakeAt)]
    assert wake and abs(wake[0].at - (w.sched.meters.deadline(live, live.issued) - 1.0)) < 1e-9
    before = live.issued
    w.step(dt=wake[0].at - w.now + 0.001)  # the player's clock reaches it
    assert live.issued == before + 1
    w.step(s.Stop("live"))
    w.run()
    assert w.ended["live"].state == "done"
    w.assert_clean()


def test_a_fragment_inside_the_players_start_up_buffer_is_not_a_stall():
    """Stalls are counted on the same clock as deadlines (first fragment + startup_buffer_s +
    media time): a paced live fragment that arrives 0.3 s after its media time, inside the 0.5 s
    buffer, is on time — were it counted late, the deadlines would slip and the live video drift
    behind its player."""
    meters = Meters(startup_buffer_s=0.5)  # a collaborator of the scheduler, driven alone
    sess = World().session("s", seconds=20)
    sess.playback.fragment_times = [10.0]
    b = sess.blocks[3]
    meters.fragment(sess, b, 10.0 + b.start_frame / sess.fps + 0.3)
    assert sess.playback.stall_s == 0.0 and sess.playback.stalls == 0
    meters.fragment(sess, b, 10.0 + b.start_frame / sess.fps + 0.8)  # past the buffer too: a stall of 0.3 s
    assert sess.playback.stalls == 1 and abs(sess.playback.stall_s - 0.3) < 1e-9


def test_a_hybrid_groups_decodes_carry_band_weights_sized_to_the_dits_slack():
    """dit0 shares device 0 with shard vae0.0: from the READY timings on, every DecodeBatch
    carries weights that give vae0.0 the smaller band; the same group on devices of its own
    gets equal bands (no weights)."""
    for devices, small in (
        ({"dit0": 0, "vae0.0": 0, "vae0.1": 1}, True),
        ({"dit0": 0, "vae0.0": 1, "vae0.1": 2}, False),
    ):
        w = World(ONE_PIPELINE_K2, devices=devices)
        calibrated(w, {2: 1.0}, block_ms=100.0)
        info = m.ReadyInfo(vae=m.VAEReady(m.StageCost(150.0, [128, 64])))
        w.step(s.WorkerReady("vae0.0", info))
        w.submit("a")
        w.run()
        weights = [msg.weights for _, msg in w.sent if isinstance(msg, m.DecodeBatch)]
        assert weights and len({tuple(x) for x in weights}) == 1
        if small:
            assert weights[0][0] < 0.4 < 0.6 < weights[0][1]
        else:
            assert weights[0] == []
        w.assert_clean()


def test_three_concurrent_streams_of_one_size_share_dit_forwards():
    """Three 81-frame streams of one size whose requests arrive a millisecond apart (three
    clients at once), at the daemon's own settings: with a measured gain per block in a batch,
    the DiT runs their blocks in shared forwards, and each stream gets every fragment in order.
    (End to end, tests/test_daemon_stream.py asserts only what timing cannot change: each
    stream equals itself alone.)"""
    w = World(layout=(["dit0"], [["vae0.0"]]))
    w.slow = {"dit0"}  # the DiT is the bottleneck: the three have blocks waiting for it together
    calibrated(w, {2: 0.8, 3: 0.75}, block_ms=100.0, vae_ms=50.0)
    sessions = [w.submit(name, seconds=81 / 16) for name in "abc"]
    w.run()
    sizes = [len(b) for b in first_batches(w)]
    assert sizes[0] == 1  # the first request's first block goes at once, alone
    assert max(sizes) == 3 and sum(n for n in sizes if n > 1) >= 2 * len(sessions[0].blocks)
    for sess in sessions:
        assert w.ended[sess.id].state == "done" and w.fragments(sess.id) == list(range(len(sess.blocks)))
    w.assert_clean()


def test_an_out_of_memory_batch_fails_its_sessions_and_admission_learns_the_budget():
    """The DiT ran out of memory in a pair's block: it fails both sessions (one message each,
    the worker stays up), every slot comes back, and the unit's budget drops below what the two
    held, so two such sessions are not run together again while one still is."""
    w = World(layout=(["dit0"], [["vae0.0"]]), cfg=ADMIT_ALL)
    memory = m.DiTMemory(kv_bytes_per_token=1000.0, window_frames=12, cross_bytes=0.0, budget_bytes=1e12)
    w.step(s.WorkerReady("dit0", m.ReadyInfo(dit=m.DiTReady(m.StageCost(100.0, [128, 64]), {"2": 80.0}, memory))))
    w.submit_together(w.session("a", seconds=20), w.session("b", seconds=20))
    worker, batch = next((wk, x) for wk, x in w.todo if isinstance(x, m.GenerateBatch))
    assert [b.session for b in batch.blocks] == ["a", "b"]
    w.todo.remove((worker, batch))
    one = w.sched.books.sessions["a"].place.demand.memory["dit0"]
    why = "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    w.step(*(m.Failed("dit0", why, b.session, b.block, "memory") for b in batch.blocks))
    assert {n: (e.state, e.code) for n, e in w.ended.items()} == {
        "a": ("failed", "generation_failed"),
        "b": ("failed", "generation_failed"),
    }
    assert "dit0: OutOfMemoryError: CUDA out of memory" in w.ended["a"].error
    w.run()
    w.assert_clean()
    assert w.sched.admission.capacity.budget["dit0"] == pytest.approx(0.9 * 2 * one)
    w.submit_together(w.session("c", seconds=20), w.session("d", seconds=20))
    assert w.sched.books.sessions["c"].state == "running" and w.sched.books.sessions["d"].state != "running"
    w.run()
    assert w.ended["c"].state == w.ended["d"].state == "done"
    w.assert_clean()
