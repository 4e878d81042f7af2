"""The step scheduler (supervisor process; plain code: no I/O, no asyncio, no clock of its own).

Every block of every session is a ticket with one explicit state, and the ticket owns the ring
slots its state holds:

    queued -> dit -> latent_ready -> vae -> frames_ready -> encoded -> emitted
    any state -> cancelled | failed, once no process holds a slot of it any more

    queued        nothing yet                     dit           latent slot (the DiT writes it)
    latent_ready  latent slot (waits for the VAE) vae           latent + frame slot (the group)
    frames_ready  frame slot (the encoder reads)  encoded, emitted, cancelled, failed: none

`step(events, now)` takes everything that happened since the last step — submissions, worker
replies, encoder results, acks, cancels, worker deaths and idle reports — and returns the actions
that follow: messages to send, encoders to open, fragments to encode, bytes and ends to hand to
the sessions. The driver (`driver.py`) carries the actions out and feeds their results back as
events; the policy tests drive `step` directly with a fake transport (deterministic: no
processes, no sleeps, the time is an argument).

The policy:
- Deadlines. A block is due when its session's player needs its first frame: first fragment +
  start-up buffer + stalls so far + the block's media time (before the first fragment the clock
  counts from the request). Each stage serves the earliest deadline first and is work-conserving:
  a slot stays free only while no session has a block it may run; a session far ahead of its
  player yields to one that is behind.
- Batches. A DiT worker or VAE group gets at most STAGE_DEPTH batches at once (one running, one
  queued), so the choice of what runs next is made late, here. A batch is the most urgent block
  plus other sessions' blocks that can run with it, added while the measured per-block cost
  falls with the batch size (the first few batches of a size are trials that measure it) and
  the batch does not make its most urgent block late that would have been on time. A VAE
  group's shards all get the same batch messages, so they always agree.
- Admission from the capacity model (capacity.py); a session's window: at most
  `max_blocks_in_flight` blocks between "sent to the DiT" and "taken by its consumer".
- Steering. A Steer or Stop replans the session's unstarted tickets (`plan.replan_from`): the
  answer (`Steered`) names the frame where the new scene or the end lands. A live session's next
  block waits until it is within `live_lead_s` of its player's clock; `WakeAt` asks the driver to
  step again then.
- No silent loss. A ticket sent to a worker leaves only by that worker's answer, by the worker
  proving it never got it (idle since before it went out: a lost message), by the socket refusing
  the message (SendFailed), or by the worker's death; a ticket unanswered after
  `block_timeout_s` fails its session at once (its slots come back by one of those).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import Config
from ..ipc import messages as m
from ..ipc.shm import SlotPool
from ..metrics import Metrics
from .bands import Balance
from .cut import CutBalance
from ..plan import Block, Scene, replan_from, scene_marker, shot_left
from .capacity import CapacityModel, Demand
from .engine import CANCELLED, DONE, FAILED, QUEUED, RUNNING
from .topology import Topology

log = logging.getLogger("streamdiff.scheduler")

# A message on a local socket arrives within milliseconds: a block sent this long before a worker
# began a wait (nothing running, nothing queued) that then lasted a second never reached it.
LOST_AFTER_S = 0.05
STAGE_DEPTH = 2  # batches a DiT worker or VAE group holds at once: one running, one queued behind it

# Ticket states.
T_QUEUED, T_DIT, T_LATENT, T_VAE, T_FRAMES, T_ENCODED, T_EMITTED = (
    "queued",
    "dit",
    "latent_ready",
    "vae",
    "frames_ready",
    "encoded",
    "emitted",
)
T_CANCELLED, T_FAILED = "cancelled", "failed"
FINAL = (T_EMITTED, T_CANCELLED, T_FAILED)


# -- events (in) --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Submit:
    session: Session


@dataclass(frozen=True)
class Cancel:
    session: str
    reason: str = "cancelled"


@dataclass(frozen=True)
class Ack:
    session: str
    blocks: int = 1


@dataclass(frozen=True)
class WorkerReady:
    worker: str
    info: dict


@dataclass(frozen=True)
class WorkerIdle:
    worker: str
    since: float  # when its wait with nothing queued began (the scheduler's clock)


@dataclass(frozen=True)
class WorkersLost:
    workers: frozenset[str]
    why: str


@dataclass(frozen=True)
class SendFailed:
    """A message could not be handed to the worker's socket (it is not connected)."""

    worker: str
    msg: m.Message


@dataclass(frozen=True)
class EncoderOpened:
    session: str
    init: bytes | None = None
    error: str | None = None


@dataclass(frozen=True)
class Encoded:
    session: str
    block: int
    data: bytes | None = None
    error: str | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class StopAdmitting:
    reason: str


@dataclass(frozen=True)
class Steer:
    """A new scene for a running session, from the first block the DiT has not started."""

    session: str
    scene: Scene  # its frames are ignored: it runs to the end (a live session's cap)


@dataclass(frozen=True)
class Stop:
    """End the session cleanly at the next block boundary."""

    session: str


Event = (
    Submit
    | Cancel
    | Ack
    | WorkerReady
    | WorkerIdle
    | WorkersLost
    | SendFailed
    | EncoderOpened
    | Encoded
    | StopAdmitting
    | Steer
    | Stop
    | m.LatentDone
    | m.FramesDone
    | m.Failed
)


# -- actions (out) ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Send:
    worker: str
    msg: m.Message


@dataclass(frozen=True)
class OpenEncoder:
    session: str
    width: int
    height: int
    fps: int
    keyframes: list[int]


@dataclass(frozen=True)
class Encode:
    session: str
    block: Block
    frame_slot: int
    shape: tuple[int, int, int, int]  # the slot's frames: (frames_out, height, width, 3)
    idr: bool
    events: list[tuple[int, str, bytes]]  # emsg boxes: (presentation offset, id, JSON)


@dataclass(frozen=True)
class CloseEncoder:
    session: str


@dataclass(frozen=True)
class Start:
    session: str
    placement: dict


@dataclass(frozen=True)
class Emit:
    session: str
    data: bytes
    block: Block | None  # None: the init segment


@dataclass(frozen=True)
class End:
    session: str
    state: str
    error: str | None = None
    code: str | None = None


@dataclass(frozen=True)
class Reject:
    session: str
    message: str
    retry_after_s: float


@dataclass(frozen=True)
class Steered:
    """Where a Steer (scene set) or a Stop (scene None) landed; or why not (`refused`: an HTTP
    status and a message)."""

    session: str
    scene: int | None = None  # the new scene's index
    start_frame: int = 0  # where the new scene, or the stop, lands
    scenes: list[Scene] = field(default_factory=list)  # the session's scenes now
    refused: tuple[int, str] | None = None


@dataclass(frozen=True)
class WakeAt:
    """Step again at this time (a paced live session's next block becomes due)."""

    at: float


Action = Send | OpenEncoder | Encode | CloseEncoder | Start | Emit | End | Reject | Steered | WakeAt


@dataclass
class Ticket:
    block: Block
    state: str = T_QUEUED
    latent_slot: int | None = None
    frame_slot: int | None = None
    shape: list[int] | None = None  # the latent's, once made
    data_shape: list[int] | None = None  # what its slot holds, when not the latent (topology.vae_cut)
    vae_cut: int = 0  # the decoder stages its DiT runs (topology.vae_cut; its shot's)
    sent_at: float = 0.0  # when it went to its current worker(s)
    batch: int | None = None  # the DiT batch it went in
    reported: set[int] = field(default_factory=set)  # VAE ranks that answered
    skipped: bool = False  # some shard answered without decoding
    encoding: bool = False  # an Encode is out for it


@dataclass
class Session:
    id: str
    scenes: list[Scene]
    blocks: list[Block]
    width: int
    height: int
    fps: int
    seed: int
    created: float  # the scheduler's clock
    state: str = QUEUED
    error: str | None = None
    dit: str | None = None
    group: int | None = None
    vae_workers: list[str] = field(default_factory=list)  # the shards of its VAE group
    vae_cut: int = 0  # its shot's VAE cut (topology.vae_cut; chosen at each shot's start)
    tickets: list[Ticket] = field(default_factory=list)
    issued: int = 0  # tickets past queued
    acked: int = 0  # fragments taken by the consumer
    encoder: str = "none"  # none | opening | open
    started: float | None = None
    fragment_times: list[float] = field(default_factory=list)  # one per block
    stall_s: float = 0.0  # playback delay accumulated so far (a player rebuffers, then continues)
    stalls: int = 0
    demand: Demand | None = None  # what it asked of its units when it was placed
    live: bool = False  # open-ended: paced to its player, ends at its cap or a stop
    steered_at: list[int] = field(default_factory=list)  # the blocks where steered scenes start

    def __post_init__(self) -> None:
        if not self.tickets:
            self.tickets = [Ticket(b) for b in self.blocks]

    @property
    def frames(self) -> int:
        return sum(b.emit for b in self.blocks)

    @property
    def active(self) -> bool:
        return self.state in (QUEUED, RUNNING)

    @property
    def emitted(self) -> int:
        return sum(t.state == T_EMITTED for t in self.tickets)


class Scheduler:
    def __init__(
        self,
        cfg: Config,
        topology: Topology,
        latent_slots: int,
        frame_slots: int,
        worker_ready: Callable[[str], bool],
        facts: dict | None = None,
        cut_fits: Callable[[int, tuple[int, int], int], bool] | None = None,
    ) -> None:
        """cut_fits(cut, latent_hw, latent_frames): whether a VAE cut's activation of a block fits
        a latent slot (supervisor/cut.py; None: any does)."""
        self.cfg = cfg
        self.facts = facts or {"spatial_factor": 8, "size_multiple": 16}
        self.capacity = CapacityModel(cfg.limits.target_utilization)
        self.topology = topology
        t = cfg.topology
        self.balance = Balance(
            topology.vae_groups, topology.devices, topology.dit_workers, t.vae_band_weights, t.rebalance
        )
        on_dit = t.device == "cpu" and t.pin_cpus  # the supervisor's encoding shares the DiT's cores
        self.cuts = (
            CutBalance(t.vae_cut, t.vae_cut_adapt and t.rebalance, cut_fits, on_dit, t.vae_cut_exchange)
            if t.vae_cut
            else None
        )
        self.latent_pool = SlotPool(latent_slots)
        self.frame_pool = SlotPool(frame_slots)
        self.worker_ready = worker_ready
        self.sessions: dict[str, Session] = {}  # every session with work or slots outstanding
        self.queue: deque[Session] = deque()
        self.stage_ms = {"dit": 0.0, "vae": 0.0, "encode": 0.0}  # summed compute time per stage
        self.metrics = Metrics()
        self.accepting = True
        self.idle_since: dict[str, float] = {}  # worker -> since when it has waited with nothing to do
        self.batches: dict[int, tuple[str, int]] = {}  # batch -> (unit, tickets still out)
        self.free_at: dict[str, float] = {}  # unit -> when its batches are predicted done
        self._next_batch = 0
        self.now = 0.0
        self._out: list[Action] = []

    # -- the step -------------------------------------------------------------------------------
    def step(self, events: list[Event], now: float) -> list[Action]:
        """Apply `events` in order, then hand out work; return what to do."""
        self.now, self._out = now, []
        for ev in events:
            self._apply(ev)
        self._check_deadlines()
        self._dispatch()
        waits = [
            t
            for sess in self.running
            if sess.live and sess.issued < len(sess.blocks) and (t := self._paced_until(sess)) > self.now
        ]
        if waits:
            self._out.append(WakeAt(min(waits)))
        out, self._out = self._out, []
        return out

    def _apply(self, ev: Event) -> None:
        handler = {
            Submit: self._submit,
            Cancel: self._cancel,
            Ack: self._ack,
            WorkerReady: self._worker_ready,
            WorkerIdle: self._worker_idle,
            WorkersLost: self._workers_lost,
            SendFailed: self._send_failed,
            EncoderOpened: self._encoder_opened,
            Encoded: self._encoded,
            StopAdmitting: self._stop_admitting,
            Steer: self._steer,
            Stop: self._stop,
            m.LatentDone: self._latent_done,
            m.FramesDone: self._frames_done,
            m.Failed: self._failed,
        }[type(ev)]
        handler(ev)

    @property
    def running(self) -> list[Session]:
        return [s for s in self.sessions.values() if s.state == RUNNING]

    # -- admission and placement ------------------------------------------------------------
    def _submit(self, ev: Submit) -> None:
        """Admit now, queue (when predicted to start within max_queue_wait_s), or Reject with the
        predicted wait as Retry-After."""
        sess, lim = ev.session, self.cfg.limits
        running = len(self.running)
        if not self.accepting:
            self._out.append(Reject(sess.id, "the server is not admitting sessions", 10.0))
            return
        if running >= lim.max_sessions and len(self.queue) >= lim.max_queue:
            self._out.append(Reject(sess.id, f"{running} sessions running and {len(self.queue)} queued", 10.0))
            return
        wait = self.predicted_wait(sess)
        if wait > 0 and (wait > lim.max_queue_wait_s or len(self.queue) >= lim.max_queue):
            message = f"predicted to start in {wait:.0f}s beside the {running} running sessions"
            self._out.append(Reject(sess.id, message, wait))
            return
        self.sessions[sess.id] = sess
        self.queue.append(sess)
        if wait > 0:
            log.info("session %s queued: predicted to start in %.1fs", sess.id, wait)

    def _worker_ready(self, ev: WorkerReady) -> None:
        """A worker's READY: its calibration blocks and memory facts seed the capacity model."""
        info = ev.info
        if "dit_cost" in info:
            cost = info["dit_cost"]
            self.capacity.calibrate(ev.worker, cost["size"], cost["block_ms"], info["dit_memory"])
            for b, ms in info.get("dit_batch_ms", {}).items():
                self.capacity.calibrate_batch(ev.worker, cost["size"], int(b), ms / cost["block_ms"])
            self.balance.seed_dit(ev.worker, cost.get("busy_ms", cost["block_ms"]), self._latent_hw(*cost["size"]))
            if self.cuts is not None:  # its start-up block ran the configured cut's stages
                hw = self._latent_hw(*cost["size"])
                self.cuts.observe_dit(ev.worker, None, cost["block_ms"], self.cuts.start, hw)
        if "vae_cost" in info and info.get("vae_rank") == 0:
            group = next(i for i, g in enumerate(self.topology.vae_groups) if ev.worker in g)
            unit = self._group_unit(group)
            cost = info["vae_cost"]
            self.capacity.calibrate(unit, cost["size"], cost["block_ms"], info["vae_memory"])
            self.balance.seed(group, cost["block_ms"], self._latent_hw(*cost["size"]))
            for b, ms in info.get("vae_batch_ms", {}).items():
                self.capacity.calibrate_batch(unit, cost["size"], int(b), ms / cost["block_ms"])
            if self.cuts is not None and "vae_stages_ms" in info:  # its start-up block: a whole decode
                self.cuts.seed(info["vae_stages_ms"]["ms"])
                self.cuts.observe_vae(unit, cost["block_ms"], 0, self._latent_hw(*cost["size"]))

    def _latent_hw(self, width: int, height: int) -> tuple[int, int]:
        sf = self.facts["spatial_factor"]
        return height // sf, width // sf

    @staticmethod
    def _group_unit(group: int) -> str:
        return f"vae-group-{group}"

    def _demand(self, sess: Session, dit: str, group: int) -> Demand:
        f = self.facts
        block_s = max(b.frames_out for b in sess.blocks) / sess.fps
        mult, sf = f.get("size_multiple", 16), f["spatial_factor"]
        return self.capacity.demand(
            {"dit": dit, "vae": self._group_unit(group)},
            (sess.width, sess.height),
            block_s,
            (sess.height // sf, sess.width // sf),
            (sess.height // mult) * (sess.width // mult),
            len(self.topology.vae_groups[group]),
        )

    def _running_demands(self) -> list[Demand]:
        """What the running sessions ask of their units at the costs measured now (a session
        placed on a start-up timing is counted at what its blocks have measured since)."""
        return [self._demand(s, s.dit, s.group) for s in self.running]

    def _candidate(self, sess: Session, ready_only: bool = True) -> tuple[str, int] | None:
        """The DiT worker and VAE group a session would go to: the least busy by predicted share
        (an aggregated worker's session decodes in its own process)."""
        dits = [w for w in self.topology.dit_workers if not ready_only or self.worker_ready(w)]
        groups = [
            i for i, g in enumerate(self.topology.vae_groups) if not ready_only or all(self.worker_ready(w) for w in g)
        ]
        if not dits or not groups:
            return None
        share, _ = self.capacity.load(self._running_demands())
        count: dict[str, int] = {}
        for s in self.running:
            count[s.dit] = count.get(s.dit, 0) + 1
            count[self._group_unit(s.group)] = count.get(self._group_unit(s.group), 0) + 1

        def busy(unit: str) -> tuple[float, int, str]:
            return (share.get(unit, 0.0), count.get(unit, 0), unit)

        dit = min(dits, key=busy)
        colocated = [i for i in groups if dit in self.topology.vae_groups[i]]
        group = colocated[0] if colocated else min(groups, key=lambda i: busy(self._group_unit(i)))
        return dit, group

    def predicted_wait(self, sess: Session) -> float:
        """Seconds until `sess` would be admitted (0: now), replaying the running sessions' ends
        at real-time pace and the queue ahead."""
        cand = self._candidate(sess, ready_only=False)
        if cand is None:
            return 0.0  # nothing to go by: the count limits decide
        new = self._demand(sess, *cand)
        running = [
            (sum(t.block.emit for t in s.tickets if t.state != T_EMITTED) / s.fps, self._demand(s, s.dit, s.group))
            for s in self.running
        ]
        ahead = [(q.frames / q.fps, self._demand(q, *cand)) for q in self.queue]
        return self.capacity.predicted_start(new, running, ahead)

    def _place(self, sess: Session) -> bool:
        """Place the session if a ready pipeline has room for it (capacity and memory)."""
        cand = self._candidate(sess)
        if cand is None:
            return False
        demand = self._demand(sess, *cand)
        if not self.capacity.fits(demand, self._running_demands()):
            return False
        sess.dit, sess.group = cand
        sess.vae_workers = list(self.topology.vae_groups[sess.group])
        sess.demand = demand
        return True

    def _start(self, sess: Session) -> None:
        share = {u: round(x, 2) for u, x in sess.demand.share.items()}
        log.info("session %s starts on %s and VAE group %d, busy shares %s", sess.id, sess.dit, sess.group, share)
        sess.state, sess.started = RUNNING, self.now
        self.metrics.queue_seconds.observe(sess.started - sess.created)
        opened = m.OpenSession(sess.id, sess.width, sess.height, sess.seed)
        for w in self._workers_of(sess):
            self._out.append(Send(w, opened))
        self._out.append(Start(sess.id, {"dit": sess.dit, "vae": list(sess.vae_workers)}))
        # The encoder opens off the loop (an FFmpeg child or a hardware probe can take a while)
        # while the workers start on the first block; encoding waits for it.
        every = self.cfg.encoder.keyframe_every_blocks
        keyframes = [b.start_frame for b in sess.blocks if b.index % every == 0]
        sess.encoder = "opening"
        self._out.append(OpenEncoder(sess.id, sess.width, sess.height, sess.fps, keyframes))

    def _workers_of(self, sess: Session) -> list[str]:
        names = self.topology.members(sess.dit) + self.topology.vae_groups[sess.group]
        return list(dict.fromkeys(names))  # an aggregated worker runs both stages: once

    def _stop_admitting(self, ev: StopAdmitting) -> None:
        self.accepting = False
        for sess in list(self.queue):
            self._end(sess, CANCELLED, ev.reason)

    # -- dispatch -----------------------------------------------------------------------------
    def deadline(self, sess: Session, block: int) -> float:
        """When the session's player needs the block's first frame: its first fragment's arrival
        + the start-up buffer + the stalls so far + the block's media time. Before the first
        fragment, the clock starts at the request."""
        start = sess.fragment_times[0] if sess.fragment_times else sess.created
        b = sess.blocks[min(block, len(sess.blocks) - 1)]
        return start + self.cfg.pipeline.startup_buffer_s + sess.stall_s + b.start_frame / sess.fps

    def _dispatch(self) -> None:
        """Decodes first (they hold latent slots the DiT needs), then admissions, then DiT
        batches; each earliest deadline first."""
        self._dispatch_decodes()
        while self.queue and self.accepting and len(self.running) < self.cfg.limits.max_sessions:
            sess = self.queue[0]
            if not self._place(sess):
                break
            self.queue.popleft()
            self._start(sess)
        for dit in self.topology.dit_workers:
            self._dispatch_dit(dit)

    def _dispatch_decodes(self) -> None:
        for gi, workers in enumerate(self.topology.vae_groups):
            if not all(self.worker_ready(w) for w in workers):
                continue
            unit = self._group_unit(gi)
            while self._depth(unit) < STAGE_DEPTH and self.frame_pool.free:
                # Per session its earliest latent_ready block, once every earlier block has gone
                # to the VAE (the temporal cache needs them in order).
                cands = []
                for sess in self.running:
                    if sess.group != gi:
                        continue
                    t = next((t for t in sess.tickets if t.state in (T_QUEUED, T_DIT, T_LATENT)), None)
                    if t is not None and t.state == T_LATENT:
                        cands.append((sess, t))
                if not cands:
                    break
                batch = self._choose_batch(unit, cands, len(self.frame_pool.free), 0.0, self._decode_key)
                self._send_decodes(gi, unit, batch)

    @staticmethod
    def _decode_key(sess: Session, t: Ticket) -> tuple:
        """Blocks that can decode in one call: same size and cache phase."""
        return (sess.width, sess.height, tuple(t.shape), t.block.frames_out, t.block.shot_start)

    @staticmethod
    def _generate_key(sess: Session, t: Ticket) -> tuple:
        return (sess.width, sess.height, t.block.latent_frames)

    def _issuable(self, sess: Session) -> bool:
        limit = self.cfg.pipeline.max_blocks_in_flight
        if not (sess.issued < len(sess.blocks) and sess.issued - sess.acked < limit):
            return False
        return self._paced_until(sess) <= self.now

    def _paced_until(self, sess: Session) -> float:
        """When a live session's next block may start: at most `live_lead_s` ahead of its
        player's clock (a steer must show soon, not after all that was generated ahead)."""
        if not sess.live or not sess.fragment_times:
            return 0.0
        return self.deadline(sess, sess.issued) - self.cfg.pipeline.live_lead_s

    def _depth(self, unit: str) -> int:
        return sum(u == unit for u, _ in self.batches.values())

    def _dispatch_dit(self, dit: str) -> None:
        if not self.worker_ready(dit):
            return
        while self._depth(dit) < STAGE_DEPTH and self.latent_pool.free:
            cands = [(s, s.tickets[s.issued]) for s in self.running if s.dit == dit and self._issuable(s)]
            if not cands:
                return
            head = min(cands, key=lambda c: (self.deadline(c[0], c[1].block.index), c[0].created))[0]
            after = self.capacity.block_ms(self._group_unit(head.group), (head.width, head.height)) or 0.0
            batch = self._choose_batch(dit, cands, len(self.latent_pool.free), after, self._generate_key)
            self._send_generates(dit, batch)

    def _choose_batch(self, unit: str, cands: list, slots: int, after_ms: float, key) -> list:
        """The most urgent block and, while it pays, other sessions' blocks that `key` says can
        run with it: the measured per-block cost must fall with each one added, and the batch
        must not make the head late that would have been on time alone (`after_ms`: the stages
        still ahead of it). cands: (session, ticket); returns the batch in the same form."""
        cands = sorted(cands, key=lambda c: (self.deadline(c[0], c[1].block.index), c[0].created))
        head = cands[0]
        size = (head[0].width, head[0].height)
        base = self.capacity.block_ms(unit, size)
        cap = min(self.cfg.pipeline.max_batch, slots)
        batch = [head]
        if base is None or cap < 2:
            return batch
        due = self.deadline(head[0], head[1].block.index) - after_ms / 1000
        start = max(self.now, self.free_at.get(unit, 0.0))  # after the batch already queued there

        def finish(n: int) -> float:
            return start + self._batch_ms(unit, size, base, n) / 1000

        for c in cands[1:]:
            if len(batch) >= cap:
                break
            if key(*c) != key(*head):
                continue
            n = len(batch) + 1
            cheaper = self.capacity.batch_factor(unit, size, n) < self.capacity.batch_factor(unit, size, n - 1)
            if not cheaper and not self.capacity.on_trial(unit, size, n):
                break  # measured no cheaper per block: not worth the wait
            if finish(n) > due >= finish(n - 1):
                break  # would make the head late
            batch.append(c)
        return batch

    def _batch_ms(self, unit: str, size: tuple[int, int], base: float, n: int) -> float:
        return base * n * self.capacity.batch_factor(unit, size, n)

    def _new_batch(self, unit: str, batch: list) -> int:
        bid = self._next_batch
        self._next_batch += 1
        self.batches[bid] = (unit, len(batch))
        size = (batch[0][0].width, batch[0][0].height)
        base = self.capacity.block_ms(unit, size) or 0.0
        busy_s = self._batch_ms(unit, size, base, len(batch)) / 1000
        self.free_at[unit] = max(self.now, self.free_at.get(unit, 0.0)) + busy_s
        return bid

    def _send_generates(self, dit: str, batch: list) -> None:
        bid = self._new_batch(dit, batch)
        msgs = []
        for sess, t in batch:
            b = t.block
            scene = sess.scenes[b.scene]
            first = b.first_of_scene
            t.latent_slot = self.latent_pool.take()
            t.state, t.sent_at, t.batch = T_DIT, self.now, bid
            sess.issued += 1
            if self.cuts is not None:
                if b.shot_start or not sess.vae_cut:  # both sides' stage caches start afresh here
                    hw = self._latent_hw(sess.width, sess.height)
                    sess.vae_cut = self.cuts.cut(dit, self._group_unit(sess.group), hw, b.latent_frames)
                t.vae_cut = sess.vae_cut
            msgs.append(
                m.GenerateBlock(
                    sess.id,
                    b.index,
                    b.latent_frames,
                    t.latent_slot,
                    prompt=scene.prompt if first else None,
                    cut=b.shot_start and first,
                    seed=scene.seed if first else None,
                    recache=first and scene.recache and not b.shot_start,
                    vae_cut=t.vae_cut,
                    shot_left=0 if sess.live else shot_left(sess.blocks, b.index),
                    image=scene.image if b.shot_start and first else None,
                )
            )
        for w in self.topology.members(dit):  # a DiT group's ranks all run it (rank 0 answers)
            self._out.append(Send(w, m.GenerateBatch(msgs)))

    def _send_decodes(self, group: int, unit: str, batch: list) -> None:
        bid = self._new_batch(unit, batch)
        msgs = []
        for sess, t in batch:
            b = t.block
            t.frame_slot = self.frame_pool.take()
            t.state, t.sent_at, t.batch, t.reported, t.skipped = T_VAE, self.now, bid, set(), False
            item = m.DecodeBlock(
                sess.id,
                b.index,
                t.latent_slot,
                t.frame_slot,
                t.shape,
                b.frames_out,
                b.shot_start,
                t.data_shape or [],
                t.vae_cut,
            )
            msgs.append(item)
        head = batch[0][0]
        weights = list(self.balance.weights(group, self._latent_hw(head.width, head.height)))
        for w in self.topology.vae_groups[group]:
            self._out.append(Send(w, m.DecodeBatch(msgs, weights=weights)))

    def _encode_next(self, sess: Session) -> None:
        """Encode the session's next block once its frames are ready (one at a time, in order)."""
        if sess.state != RUNNING or sess.encoder != "open" or any(t.encoding for t in sess.tickets):
            return
        t = next((t for t in sess.tickets if t.state not in FINAL), None)
        if t is None or t.state != T_FRAMES:
            return
        b = t.block
        events = []
        if b.first_of_scene:
            events.append(scene_marker(b, sess.scenes[b.scene]))
        t.encoding = True
        shape = (b.frames_out, sess.height, sess.width, 3)
        idr = b.index % self.cfg.encoder.keyframe_every_blocks == 0
        self._out.append(Encode(sess.id, b, t.frame_slot, shape, idr, events))

    # -- replies ------------------------------------------------------------------------------
    def _ticket(self, session: str, block: int | None, state: str) -> tuple[Session | None, Ticket | None]:
        sess = self.sessions.get(session)
        if sess is None or block is None or not 0 <= block < len(sess.tickets):
            return sess, None
        t = sess.tickets[block]
        return sess, (t if t.state == state else None)

    def _left_batch(self, t: Ticket) -> None:
        unit, out = self.batches.pop(t.batch)
        if out > 1:
            self.batches[t.batch] = (unit, out - 1)
        t.batch = None

    def _latent_done(self, msg: m.LatentDone) -> None:
        sess, t = self._ticket(msg.session, msg.block, T_DIT)
        if t is None:
            log.warning("latent for unknown block %s/%s", msg.session, msg.block)
            return
        self._left_batch(t)
        if msg.skipped or sess.state != RUNNING:
            self._release(sess, t)
            return
        self.stage_ms["dit"] += msg.compute_ms
        self.metrics.stage_seconds.labels("dit").observe(msg.compute_ms / 1000)
        self.metrics.dit_batched_blocks.labels(str(msg.batch)).inc()
        ms, busy = msg.compute_ms, msg.busy_ms
        predicted = self.capacity.observe(sess.dit, (sess.width, sess.height), ms, msg.batch)
        if predicted:
            self.metrics.block_cost_ratio.labels("dit").observe(ms / predicted)
        self.balance.observe_dit(sess.dit, busy, self._latent_hw(sess.width, sess.height))
        if self.cuts is not None:
            hw = self._latent_hw(sess.width, sess.height)
            self.cuts.observe_dit(sess.dit, self._group_unit(sess.group), ms, t.vae_cut, hw)
        t.state, t.shape, t.data_shape = T_LATENT, list(msg.shape), list(msg.data_shape)

    def _frames_done(self, msg: m.FramesDone) -> None:
        sess, t = self._ticket(msg.session, msg.block, T_VAE)
        if t is None:
            log.warning("frames for unknown block %s/%s", msg.session, msg.block)
            return
        t.reported.add(msg.rank)
        t.skipped |= msg.skipped
        if not msg.skipped:
            shard = self.topology.vae_groups[sess.group][msg.rank]
            self.balance.observe(shard, msg.busy_ms, msg.rows, self._latent_hw(sess.width, sess.height)[1])
        if not msg.skipped and msg.rank == 0:
            self.stage_ms["vae"] += msg.compute_ms
            self.metrics.stage_seconds.labels("vae").observe(msg.compute_ms / 1000)
            self.metrics.vae_batched_blocks.labels(str(msg.batch)).inc()
            unit, ms = self._group_unit(sess.group), msg.compute_ms
            predicted = self.capacity.observe(unit, (sess.width, sess.height), ms, msg.batch)
            if predicted:
                self.metrics.block_cost_ratio.labels("vae").observe(ms / predicted)
            if self.cuts is not None:
                self.cuts.observe_vae(unit, ms, t.vae_cut, self._latent_hw(sess.width, sess.height))
        self._vae_answered(sess, t)

    def _vae_answered(self, sess: Session, t: Ticket) -> None:
        if len(t.reported) < len(sess.vae_workers):
            return
        self._left_batch(t)
        self.latent_pool.give(t.latent_slot)
        t.latent_slot = None
        if t.skipped or sess.state != RUNNING:
            self._release(sess, t)
            return
        t.state = T_FRAMES
        self._encode_next(sess)

    def _encoder_opened(self, ev: EncoderOpened) -> None:
        sess = self.sessions.get(ev.session)
        if sess is None or sess.encoder != "opening":
            return
        if ev.error is not None:
            sess.encoder = "none"
            log.error("session %s: the encoder could not open: %s", sess.id, ev.error)
            self._end(sess, FAILED, f"could not start: the encoder did not open: {ev.error}")
            return
        sess.encoder = "open"
        if sess.state == RUNNING:
            if ev.init:
                self._out.append(Emit(sess.id, ev.init, None))
            self._encode_next(sess)

    def _encoded(self, ev: Encoded) -> None:
        sess, t = self._ticket(ev.session, ev.block, T_FRAMES)
        if t is None or not t.encoding:
            return
        t.encoding = False
        self.frame_pool.give(t.frame_slot)
        t.frame_slot = None
        if sess.state != RUNNING:
            self._release(sess, t)
            return
        if ev.error is not None:
            log.error("encoding block %d of %s failed: %s", ev.block, sess.id, ev.error)
            t.state = T_FAILED
            self._end(sess, FAILED, f"encoder failed: {ev.error}")
            return
        self.stage_ms["encode"] += 1000 * ev.seconds
        self.metrics.stage_seconds.labels("encode").observe(ev.seconds)
        if self.cuts is not None:
            self.cuts.observe_host(1000 * ev.seconds)
        t.state = T_ENCODED
        self._observe_fragment(sess, t.block)
        t.state = T_EMITTED
        self._out.append(Emit(sess.id, ev.data, t.block))
        if sess.emitted == len(sess.tickets):
            self._end(sess, DONE, None)
        else:
            self._encode_next(sess)

    def _observe_fragment(self, sess: Session, b: Block) -> None:
        """Time to first fragment, intervals, and stalls against real-time playback: the player
        starts startup_buffer_s after the first fragment (the same clock as `deadline`); a
        fragment that arrives after its first frame was due is a stall, and the player's clock
        slips by the difference."""
        now, mt = self.now, self.metrics
        if sess.fragment_times:
            mt.fragment_interval_seconds.observe(now - sess.fragment_times[-1])
            due = self.deadline(sess, b.index)
            if now > due:
                sess.stalls += 1
                sess.stall_s += now - due
                mt.stalls.inc()
                mt.stall_seconds.inc(now - due)
        else:
            mt.ttff_seconds.observe(now - sess.created)
        sess.fragment_times.append(now)
        mt.fragments.inc()
        mt.frames.inc(b.emit)

    def _ack(self, ev: Ack) -> None:
        sess = self.sessions.get(ev.session)
        if sess is not None:
            sess.acked += ev.blocks

    # -- losses -------------------------------------------------------------------------------
    def _worker_idle(self, ev: WorkerIdle) -> None:
        """A heartbeat said the worker has waited with nothing queued since `since`: a block
        sent to it well before that never arrived (a lost control message). Its session fails;
        its slots are safe to reuse, since no process will write them."""
        name, since = ev.worker, ev.since
        self.idle_since[name] = since
        for sess in list(self.sessions.values()):
            lost = []
            for t in sess.tickets:
                if t.state == T_DIT and sess.dit == name and t.sent_at < since - LOST_AFTER_S:
                    lost.append(t)
                # A group's block is lost when no shard got it: every shard idle since it went
                # out. (Had some got it, they wait in its collectives and fail at their timeout.)
                elif (
                    t.state == T_VAE
                    and name in sess.vae_workers
                    and not t.reported
                    and all(self.idle_since.get(w, 0.0) > t.sent_at + LOST_AFTER_S for w in sess.vae_workers)
                ):
                    lost.append(t)
            for t in lost:
                log.error("session %s: block %d never reached its worker (a lost message)", sess.id, t.block.index)
                self._end(sess, FAILED, f"block {t.block.index} was lost on its way to a worker")
                self._worker_gone(sess, t)

    def _failed(self, msg: m.Failed) -> None:
        sess = self.sessions.get(msg.session) if msg.session else None
        if sess is None:
            return
        code = "invalid_request" if msg.kind == "request" else "generation_failed"
        self._end(sess, FAILED, f"{msg.worker}: {msg.message}", code)
        if msg.kind not in ("request", "session"):
            return  # the worker exits; its tickets come back in WorkersLost once it has
        # The worker carries on and answers nothing else for this block: its reply stands for
        # the block's (a VAE group's shards each send one).
        _, t = self._ticket(sess.id, msg.block, T_DIT)
        if t is not None and msg.worker == sess.dit:
            self._worker_gone(sess, t)
            if msg.kind == "session":  # a gap: the earlier blocks it never got are lost (FIFO)
                for e in sess.tickets[: msg.block]:
                    if e.state == T_DIT:
                        log.error("session %s: block %d never reached %s", sess.id, e.block.index, msg.worker)
                        self._worker_gone(sess, e)
            return
        _, t = self._ticket(sess.id, msg.block, T_VAE)
        if t is not None and msg.worker in sess.vae_workers:
            t.reported.add(sess.vae_workers.index(msg.worker))
            t.skipped = True
            self._vae_answered(sess, t)

    def _send_failed(self, ev: SendFailed) -> None:
        """A block message never left: its sessions fail now. A DiT batch's slots come back at
        once (nobody got it); a decode's only once the group is gone, since the shards that did
        get it may be writing."""
        msg = ev.msg
        if isinstance(msg, m.OpenSession | m.CloseSession):
            sess = self.sessions.get(msg.session)
            if sess is not None and isinstance(msg, m.OpenSession):
                self._end(sess, FAILED, f"could not reach {ev.worker}")
            return
        if not isinstance(msg, m.GenerateBatch | m.DecodeBatch):
            return
        for item in msg.blocks:
            state = T_DIT if isinstance(msg, m.GenerateBatch) else T_VAE
            sess, t = self._ticket(item.session, item.block, state)
            if t is None:
                continue
            self._end(sess, FAILED, f"could not reach {ev.worker}")
            if state == T_DIT:
                self._worker_gone(sess, t)

    def _workers_lost(self, ev: WorkersLost) -> None:
        """The pool killed these workers and saw them exit: their slots are free again."""
        for sess in list(self.sessions.values()):
            dit_lost = sess.dit in ev.workers
            group_lost = bool(ev.workers & set(sess.vae_workers))
            if not (dit_lost or group_lost):
                continue
            self._end(sess, FAILED, ev.why)
            for t in sess.tickets:
                if (t.state == T_DIT and dit_lost) or (t.state == T_VAE and group_lost):
                    self._worker_gone(sess, t)

    def _worker_gone(self, sess: Session, t: Ticket) -> None:
        """No worker holds the ticket's slots any more (it answered with a refusal, never got
        the message, or died)."""
        if t.state in (T_DIT, T_VAE):
            self._left_batch(t)
        self._release(sess, t)

    def _check_deadlines(self) -> None:
        """A ticket out at a worker for longer than block_timeout_s fails its session now; its
        slots come back once the worker answers, proves idle, or is gone."""
        limit = self.cfg.pipeline.block_timeout_s
        for sess in list(self.sessions.values()):
            if not sess.active:
                continue
            late = next((t for t in sess.tickets if t.state in (T_DIT, T_VAE) and self.now - t.sent_at > limit), None)
            if late is not None:
                where = sess.dit if late.state == T_DIT else f"VAE group {sess.group}"
                self._end(sess, FAILED, f"block {late.block.index} got no answer from {where} in {limit:.0f}s")

    # -- steering -----------------------------------------------------------------------------
    def _steer(self, ev: Steer) -> None:
        sess = self.sessions.get(ev.session)
        if sess is None or not sess.active:
            self._out.append(Steered(ev.session, refused=(409, "the video has finished")))
            return
        pending = sum(b >= sess.issued for b in sess.steered_at)
        if pending >= self.cfg.limits.max_pending_scenes:
            limit = self.cfg.limits.max_pending_scenes
            why = f"{pending} scene changes are waiting for their first block; the limit is {limit}"
            self._out.append(Steered(ev.session, refused=(429, why)))
            return
        at = max(sess.issued, 1, *(b + 1 for b in sess.steered_at))  # after any steer still pending
        total = sum(sc.frames for sc in sess.scenes)
        start = sess.blocks[at].start_frame if at < len(sess.blocks) else total
        if start >= total:
            self._out.append(Steered(ev.session, refused=(409, "no block of the video is left to steer")))
            return
        new = Scene(ev.scene.prompt, total - start, ev.scene.transition, ev.scene.seed, ev.scene.recache)
        self._replan(sess, at, new)
        sess.steered_at.append(at)
        self._out.append(Steered(sess.id, len(sess.scenes) - 1, start, list(sess.scenes)))

    def _stop(self, ev: Stop) -> None:
        sess = self.sessions.get(ev.session)
        if sess is None or not sess.active:
            self._out.append(Steered(ev.session, refused=(409, "the video has finished")))
            return
        at = max(sess.issued, 1)
        if at < len(sess.blocks):
            self._replan(sess, at, None)
        end = sess.blocks[-1].start_frame + sess.blocks[-1].emit
        self._out.append(Steered(sess.id, None, end, list(sess.scenes)))
        if sess.state == RUNNING and sess.emitted == len(sess.tickets):
            self._end(sess, DONE, None)

    def _replan(self, sess: Session, at: int, new: Scene | None) -> None:
        """Blocks from `at` on (none of them started) follow the new plan."""
        f = self.facts
        fpb, tf = f["frames_per_block"], f["temporal_factor"]
        sess.scenes, sess.blocks = replan_from(sess.scenes, sess.blocks, at, new, fpb, tf)
        blocks = sess.blocks
        sess.tickets = sess.tickets[:at] + [Ticket(b) for b in blocks[at:]]

    # -- ending -------------------------------------------------------------------------------
    def _cancel(self, ev: Cancel) -> None:
        sess = self.sessions.get(ev.session)
        if sess is not None and sess.active:
            self._end(sess, CANCELLED, ev.reason)

    def _end(self, sess: Session, state: str, error: str | None, code: str | None = None) -> None:
        """The session ends now (the client hears at once); its tickets give back what nobody
        else holds now, and the rest as their holders answer."""
        if sess.active:
            was_running = sess.state == RUNNING
            sess.state, sess.error = state, error
            if sess in self.queue:
                self.queue.remove(sess)
            if was_running:
                closing = m.CloseSession(sess.id)
                for w in self._workers_of(sess):
                    self._out.append(Send(w, closing))
                self._out.append(CloseEncoder(sess.id))  # after any encode already out
            self.metrics.sessions.labels(state).inc()
            if state != DONE:
                log.info("session %s %s: %s", sess.id, state, error)
            self._out.append(End(sess.id, state, error, code))
        for t in sess.tickets:
            if t.state in (T_QUEUED, T_LATENT) or (t.state == T_FRAMES and not t.encoding):
                self._release(sess, t)
        self._forget(sess)

    def _release(self, sess: Session, t: Ticket) -> None:
        """Give back the ticket's slots; it ends cancelled or failed with its session."""
        if t.latent_slot is not None:
            self.latent_pool.give(t.latent_slot)
        if t.frame_slot is not None:
            self.frame_pool.give(t.frame_slot)
        t.latent_slot = t.frame_slot = None
        t.encoding = False
        t.state = T_CANCELLED if sess.state == CANCELLED else T_FAILED
        if sess.active:  # a ticket lost while its session still ran: the session cannot go on
            self._end(sess, FAILED, f"block {t.block.index} was lost")
        self._forget(sess)

    def _forget(self, sess: Session) -> None:
        """Drop an ended session once none of its tickets holds a slot."""
        if not sess.active and all(t.state in FINAL for t in sess.tickets):
            self.sessions.pop(sess.id, None)

    def snapshot(self) -> dict:
        tickets: dict[str, int] = {}
        for s in self.sessions.values():
            for t in s.tickets:
                if t.state not in FINAL:
                    tickets[t.state] = tickets.get(t.state, 0) + 1
        return {
            "vae_band_weights": {str(g): list(w) for g, w in self.balance.current.items()},
            # decoder stages the DiT workers run (0: none): each one's cut for its next shots
            "vae_cut": self.cfg.topology.vae_cut,
            "vae_cuts": {w: self.cuts.current.get(w, self.cuts.start) for w in self.topology.dit_workers}
            if self.cuts is not None
            else {},
            # what the cut balance takes a moved ms of decode to cost the DiT and save the VAE
            "vae_cut_exchange": [self.cuts.grow, self.cuts.relief] if self.cuts is not None else None,
            "running": len(self.running),
            "queued": len(self.queue),
            "tracked": len(self.sessions),
            "latent_slots_used": self.latent_pool.used,
            "latent_slots": self.latent_pool.total,
            "frame_slots_used": self.frame_pool.used,
            "frame_slots": self.frame_pool.total,
            "decode_wait": tickets.get(T_LATENT, 0),
            "tickets": tickets,
        }
