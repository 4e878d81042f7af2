"""Sessions, placement, ring slots and the block pipeline (supervisor process).

The life of a block: the scheduler takes a free latent slot and sends GenerateBlock to the
session's DiT worker; LatentDone puts it in the decode queue; when a frame slot is free,
DecodeBlock goes to every shard of the session's VAE group; when all shards report, the latent
slot frees and the encoder turns the frames into one CMAF fragment; then the frame slot frees
and the fragment goes to the session's sink. Blocks of different sessions interleave at block
boundaries; each session has at most `max_blocks_in_flight` blocks between "sent to the DiT"
and "taken by its consumer", so a slow client throttles only its own session while the DiT
runs ahead by up to that many blocks for everyone else.

Slot ownership is exact: a slot is only freed by the reply of the worker that held it (a
cancelled session's blocks are answered `skipped`), or after the pool reports that worker dead.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..config import Config
from ..ipc import messages as m
from ..ipc.shm import Ring, SlotPool
from ..media.encoder import FragmentWriter, open_encoder
from ..metrics import Metrics
from ..plan import Block, Scene
from .capacity import CapacityModel, Demand
from .engine import CANCELLED, DONE, FAILED, QUEUED, RUNNING, QueueFull
from .topology import Topology

log = logging.getLogger("streamdiff.scheduler")

# A message on a local socket arrives within milliseconds: a block sent this long before a worker
# began a wait (nothing running, nothing queued) that then lasted a second never reached it.
LOST_AFTER_S = 0.05


class SessionSink(Protocol):
    """Where a session's bytes go (the API's job)."""

    def on_start(self, session: Session) -> None: ...
    def on_data(self, session: Session, data: bytes, block: Block | None) -> None: ...
    def on_end(self, session: Session, state: str, error: str | None, code: str | None = None) -> None: ...


def scheduler_time(method):
    """Count the time spent deciding (an entry point of the scheduler, not nested ones) in
    streamdiff_scheduler_seconds: its overhead per block, against the blocks' own time."""

    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        if self._in_handler:
            return method(self, *args, **kwargs)
        self._in_handler = True
        t0 = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._in_handler = False
            self.metrics.scheduler_seconds.inc(time.perf_counter() - t0)

    return timed


@dataclass
class VaeWork:
    latent_slot: int
    frame_slot: int
    sent_at: float = 0.0
    reported: set[int] = field(default_factory=set)
    skipped: bool = False


@dataclass
class Session:
    id: str
    scenes: list[Scene]
    blocks: list[Block]
    width: int
    height: int
    fps: int
    seed: int
    sink: SessionSink
    state: str = QUEUED
    dit: str | None = None
    group: int | None = None
    vae_workers: list[str] = field(default_factory=list)  # the shards of its VAE group
    issued: int = 0  # blocks sent to the DiT
    encoded: int = 0  # fragments made
    delivered: int = 0  # fragments taken by the consumer
    at_dit: dict[int, int] = field(default_factory=dict)  # block -> latent slot
    dit_sent: dict[int, float] = field(default_factory=dict)  # block -> when GenerateBlock went out
    at_vae: dict[int, VaeWork] = field(default_factory=dict)
    writer: FragmentWriter | None = None
    encode_thread: ThreadPoolExecutor | None = None  # this session's encoder runs here, nowhere else
    encode_tail: asyncio.Future | None = None
    error: str | None = None
    created: float = field(default_factory=time.monotonic)
    started: float | None = None
    fragment_times: list[float] = field(default_factory=list)  # monotonic, one per block
    stall_s: float = 0.0  # playback delay accumulated so far (a player rebuffers, then continues)
    demand: Demand | None = None  # what it asks of its units (the capacity model), once placed
    stalls: int = 0

    @property
    def frames(self) -> int:
        return sum(b.emit for b in self.blocks)

    @property
    def outstanding(self) -> int:
        """Blocks some process or the encoder still holds slots for."""
        return len(self.at_dit) + len(self.at_vae) + (1 if self.encode_tail and not self.encode_tail.done() else 0)

    @property
    def active(self) -> bool:
        return self.state in (QUEUED, RUNNING)


class Scheduler:
    def __init__(
        self,
        cfg: Config,
        topology: Topology,
        latent_ring: Ring,
        frame_ring: Ring,
        send: Callable[[str, m.Message], None],
        worker_ready: Callable[[str], bool],
        facts: dict | None = None,
    ) -> None:
        self.cfg = cfg
        self.facts = facts or {"spatial_factor": 8, "size_multiple": 16}
        self.capacity = CapacityModel(cfg.limits.target_utilization)
        self.topology = topology
        self.latent_ring, self.frame_ring = latent_ring, frame_ring
        self.latent_pool = SlotPool(latent_ring.spec.slots)
        self.frame_pool = SlotPool(frame_ring.spec.slots)
        self.send = send
        self.worker_ready = worker_ready
        self.sessions: dict[str, Session] = {}  # every session with work or slots outstanding
        self.queue: deque[Session] = deque()
        self.decode_wait: deque[tuple[Session, int, int, list[int]]] = deque()
        self.stage_ms = {"dit": 0.0, "vae": 0.0, "encode": 0.0}  # summed compute time per stage
        self.metrics = Metrics()
        self.accepting = True
        self._in_handler = False  # for scheduler_time: only the outermost entry point counts
        self.idle_since: dict[str, float] = {}  # worker -> since when it has waited with nothing to do

    # -- admission and placement ------------------------------------------------------------
    @property
    def running(self) -> list[Session]:
        return [s for s in self.sessions.values() if s.state == RUNNING]

    @scheduler_time
    def submit(self, sess: Session) -> None:
        """Admit now, queue (when predicted to start within max_queue_wait_s), or QueueFull with
        the predicted wait as Retry-After."""
        lim = self.cfg.limits
        running = len(self.running)
        if running >= lim.max_sessions and len(self.queue) >= lim.max_queue:
            raise QueueFull(f"{running} sessions running and {len(self.queue)} queued")
        wait = self.predicted_wait(sess)
        if wait > 0 and (wait > lim.max_queue_wait_s or len(self.queue) >= lim.max_queue):
            raise QueueFull(f"predicted to start in {wait:.0f}s beside the {running} running sessions", wait)
        self.sessions[sess.id] = sess
        self.queue.append(sess)
        self.pump()

    # -- the capacity model ---------------------------------------------------------------------
    def worker_info(self, name: str, info: dict) -> None:
        """A worker's READY: its calibration block and memory facts seed the capacity model."""
        if "dit_cost" in info:
            self.capacity.calibrate(name, info["dit_cost"]["size"], info["dit_cost"]["block_ms"], info["dit_memory"])
        if "vae_cost" in info and info.get("vae_rank") == 0:
            unit = self._group_unit(next(i for i, g in enumerate(self.topology.vae_groups) if name in g))
            self.capacity.calibrate(unit, info["vae_cost"]["size"], info["vae_cost"]["block_ms"], info["vae_memory"])

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

    def _candidate(self, sess: Session, ready_only: bool = True) -> tuple[str, int] | None:
        """The DiT worker and VAE group a session would go to: the least busy by predicted share
        (an aggregated worker's session decodes in its own process)."""
        dits = [w for w in self.topology.dit_workers if not ready_only or self.worker_ready(w)]
        groups = [
            i for i, g in enumerate(self.topology.vae_groups) if not ready_only or all(self.worker_ready(w) for w in g)
        ]
        if not dits or not groups:
            return None
        share, _ = self.capacity.load([s.demand for s in self.running if s.demand is not None])
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
            (sum(b.emit for b in s.blocks[s.encoded :]) / s.fps, s.demand) for s in self.running if s.demand is not None
        ]
        ahead = [(q.frames / q.fps, self._demand(q, *cand)) for q in self.queue]
        return self.capacity.predicted_start(new, running, ahead)

    def _place(self, sess: Session) -> bool:
        """Place the session if a ready pipeline has room for it (capacity and memory)."""
        cand = self._candidate(sess)
        if cand is None:
            return False
        demand = self._demand(sess, *cand)
        if not self.capacity.fits(demand, [s.demand for s in self.running if s.demand is not None]):
            return False
        sess.dit, sess.group = cand
        sess.vae_workers = list(self.topology.vae_groups[sess.group])
        sess.demand = demand
        return True

    def _start(self, sess: Session) -> None:
        sess.state, sess.started = RUNNING, time.monotonic()
        self.metrics.queue_seconds.observe(sess.started - sess.created)
        every = self.cfg.encoder.keyframe_every_blocks
        keyframes = [b.start_frame for b in sess.blocks if b.index % every == 0]
        opened = m.OpenSession(sess.id, sess.width, sess.height, sess.seed)
        for w in self._workers_of(sess):
            self.send(w, opened)
        sess.sink.on_start(sess)
        # The encoder opens on the session's own thread (an FFmpeg child or a hardware probe can
        # take a while) while the workers start on its first block; encoding waits for it.
        sess.encode_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"encode-{sess.id[-12:]}")
        sess.encode_tail = asyncio.ensure_future(self._open_writer(sess, keyframes))
        sess.encode_tail.add_done_callback(lambda _t, s=sess: self._maybe_forget(s))

    def _make_writer(self, sess: Session, keyframes: list[int]) -> tuple[FragmentWriter, bytes]:
        enc = self.cfg.encoder
        encoder = open_encoder(
            enc.kind,
            sess.width,
            sess.height,
            sess.fps,
            keyframes,
            crf=enc.crf,
            bitrate_kbps=enc.bitrate_kbps,
            device=enc.vaapi_device,
        )
        writer = FragmentWriter(encoder, sess.width, sess.height, sess.fps)
        return writer, writer.init_segment()

    async def _open_writer(self, sess: Session, keyframes: list[int]) -> None:
        try:
            sess.writer, init = await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(sess.encode_thread, self._make_writer, sess, keyframes),
                self.cfg.encoder.encode_timeout_s,
            )
        except Exception as exc:
            log.error("session %s: the encoder could not open: %r", sess.id, exc)
            self._finish(sess, FAILED, f"could not start: the encoder did not open: {exc!r}")
            return
        if init and sess.state == RUNNING:
            sess.sink.on_data(sess, init, None)

    def _workers_of(self, sess: Session) -> list[str]:
        names = [sess.dit] + self.topology.vae_groups[sess.group]
        return list(dict.fromkeys(names))  # an aggregated worker runs both stages: once

    # -- the pump -----------------------------------------------------------------------------
    @scheduler_time
    def pump(self) -> None:
        """Hand out free slots, earliest playback deadline first: decodes (they hold latent
        slots), then admissions, then new blocks. Work-conserving: a slot stays free only while
        no session has a block it could run; a session far ahead of its player yields to one
        that is behind (its next deadline is later)."""
        while self.decode_wait and self.frame_pool.free:
            # The waiting block due first; a session's own blocks come in order (their deadlines
            # grow with the block), which its VAE's temporal cache needs.
            i = min(range(len(self.decode_wait)), key=lambda k: self._deadline(*self.decode_wait[k][:2]))
            sess, block, lslot, shape = self.decode_wait[i]
            del self.decode_wait[i]
            if sess.state != RUNNING:
                self.latent_pool.give(lslot)
                self._maybe_forget(sess)
                continue
            fslot = self.frame_pool.take()
            b = sess.blocks[block]
            msg = m.DecodeBlock(sess.id, block, lslot, fslot, shape, b.frames_out, reset=b.shot_start)
            sess.at_vae[block] = VaeWork(lslot, fslot, time.monotonic())
            for w in self.topology.vae_groups[sess.group]:
                self.send(w, msg)
        while self.queue and self.accepting and len(self.running) < self.cfg.limits.max_sessions:
            sess = self.queue[0]
            if not self._place(sess):
                break
            self.queue.popleft()
            self._start(sess)  # the encoder opens on the session's thread: its failure ends the session there
        limit = self.cfg.pipeline.max_blocks_in_flight
        while self.latent_pool.free:
            ready = [
                s
                for s in self.running
                if s.issued < len(s.blocks) and s.issued - s.delivered < limit and self.worker_ready(s.dit)
            ]
            if not ready:
                break
            self._issue(min(ready, key=lambda s: (self._deadline(s, s.issued), s.created)))

    def _deadline(self, sess: Session, block: int) -> float:
        """When the session's player needs the block's first frame (monotonic seconds): its first
        fragment's arrival + the start-up buffer + the stalls so far + the block's media time.
        Before the first fragment, the clock starts at the request (the first block is due one
        start-up buffer after it)."""
        start = sess.fragment_times[0] if sess.fragment_times else sess.created
        b = sess.blocks[min(block, len(sess.blocks) - 1)]
        return start + self.cfg.pipeline.startup_buffer_s + sess.stall_s + b.start_frame / sess.fps

    def _issue(self, sess: Session) -> None:
        b = sess.blocks[sess.issued]
        scene = sess.scenes[b.scene]
        slot = self.latent_pool.take()
        first = b.first_of_scene
        self.send(
            sess.dit,
            m.GenerateBlock(
                sess.id,
                b.index,
                b.latent_frames,
                slot,
                prompt=scene.prompt if first else None,
                cut=b.shot_start and first,
                seed=scene.seed if first else None,
            ),
        )
        sess.at_dit[b.index] = slot
        sess.dit_sent[b.index] = time.monotonic()
        sess.issued += 1

    # -- replies ------------------------------------------------------------------------------
    @scheduler_time
    def on_latent(self, msg: m.LatentDone) -> None:
        sess = self.sessions.get(msg.session)
        if sess is None or sess.at_dit.pop(msg.block, None) is None:
            log.warning("latent for unknown block %s/%s", msg.session, msg.block)
            return
        if msg.skipped or sess.state != RUNNING:
            self.latent_pool.give(msg.slot)
            self._maybe_forget(sess)
        else:
            self.stage_ms["dit"] += msg.compute_ms
            self.metrics.stage_seconds.labels("dit").observe(msg.compute_ms / 1000)
            self._observe_cost("dit", sess.dit, sess, msg.compute_ms)
            self.metrics.dit_batched_blocks.labels(str(msg.batch)).inc()
            self.decode_wait.append((sess, msg.block, msg.slot, msg.shape))
        self.pump()

    def _observe_cost(self, stage: str, unit: str, sess: Session, ms: float) -> None:
        predicted = self.capacity.observe(unit, (sess.width, sess.height), ms)
        if predicted:
            self.metrics.block_cost_ratio.labels(stage).observe(ms / predicted)

    @scheduler_time
    def on_frames(self, msg: m.FramesDone) -> None:
        sess = self.sessions.get(msg.session)
        work = sess.at_vae.get(msg.block) if sess else None
        if work is None:
            log.warning("frames for unknown block %s/%s", msg.session, msg.block)
            return
        work.reported.add(msg.rank)
        work.skipped |= msg.skipped
        if not msg.skipped and msg.rank == 0:
            self.stage_ms["vae"] += msg.compute_ms
            self.metrics.stage_seconds.labels("vae").observe(msg.compute_ms / 1000)
            self._observe_cost("vae", self._group_unit(sess.group), sess, msg.compute_ms)
        if len(work.reported) < len(self.topology.vae_groups[sess.group]):
            return
        del sess.at_vae[msg.block]
        self.latent_pool.give(work.latent_slot)
        if work.skipped or sess.state != RUNNING:
            self.frame_pool.give(work.frame_slot)
            self._maybe_forget(sess)
        else:
            prev = sess.encode_tail
            sess.encode_tail = asyncio.ensure_future(self._encode(sess, msg.block, work.frame_slot, prev))
            sess.encode_tail.add_done_callback(lambda _t, s=sess: self._maybe_forget(s))
        self.pump()

    async def _encode(self, sess: Session, block: int, fslot: int, prev: asyncio.Future | None) -> None:
        if prev is not None:
            await asyncio.shield(prev)  # fragments leave in block order
        b = sess.blocks[block]
        data, error = None, None
        try:
            if sess.state == RUNNING:
                frames = self.frame_ring.array(fslot, (b.frames_out, sess.height, sess.width, 3), np.uint8)[: b.emit]
                idr = b.index % self.cfg.encoder.keyframe_every_blocks == 0
                events = []
                if b.first_of_scene:
                    sc = sess.scenes[b.scene]
                    events.append(
                        (
                            0,
                            str(b.scene),
                            json.dumps(
                                {
                                    "scene": b.scene,
                                    "prompt": sc.prompt,
                                    "start_frame": b.start_frame,
                                    "frames": sc.frames,
                                    "transition": sc.transition,
                                }
                            ).encode(),
                        )
                    )
                t0 = time.perf_counter()
                # On the session's own thread, bounded: a stuck encoder fails its session only.
                data = await asyncio.wait_for(
                    asyncio.get_running_loop().run_in_executor(
                        sess.encode_thread, sess.writer.fragment, frames, idr, events
                    ),
                    self.cfg.encoder.encode_timeout_s,
                )
                dt = time.perf_counter() - t0
                self.stage_ms["encode"] += 1000 * dt
                self.metrics.stage_seconds.labels("encode").observe(dt)
        except Exception as exc:
            log.error("encoding block %d of %s failed: %r", block, sess.id, exc)
            error = exc if not isinstance(exc, TimeoutError) else TimeoutError("no fragment within encode_timeout_s")
        finally:
            self.frame_pool.give(fslot)
        if error is not None:
            self._finish(sess, FAILED, f"encoder failed: {error}")
        elif data is not None and sess.state == RUNNING:
            sess.encoded += 1
            self._observe_fragment(sess, b)
            sess.sink.on_data(sess, data, b)
            if sess.encoded == len(sess.blocks):
                self._finish(sess, DONE, None)
        self.pump()

    def _observe_fragment(self, sess: Session, b: Block) -> None:
        """Time to first fragment, intervals, and stalls against real-time playback: playback
        starts with the first fragment; a fragment that arrives after its first frame was due
        is a stall, and the player's clock slips by the difference."""
        now = time.monotonic()
        mt = self.metrics
        if sess.fragment_times:
            mt.fragment_interval_seconds.observe(now - sess.fragment_times[-1])
            due = sess.fragment_times[0] + sess.stall_s + b.start_frame / sess.fps
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

    @scheduler_time
    def acknowledge(self, session_id: str, blocks: int = 1) -> None:
        """The consumer took `blocks` more fragments: room for more blocks in flight."""
        sess = self.sessions.get(session_id)
        if sess is not None:
            sess.delivered += blocks
            self.pump()

    @scheduler_time
    def worker_idle(self, name: str, since: float) -> None:
        """A heartbeat from `name` said it has been waiting for messages, none queued, since
        `since`. A block sent to it well before that never arrived (a lost control message):
        without this its session would wait forever and its slots never come back. The session
        fails; its slots are safe to reuse, since no process will write them."""
        self.idle_since[name] = since
        for sess in list(self.sessions.values()):
            lost = []
            if sess.dit == name:
                lost += [b for b in sess.at_dit if sess.dit_sent.get(b, since) < since - LOST_AFTER_S]
            if name in sess.vae_workers:
                # A group's block is lost when no shard got it: every shard idle since it went out.
                # (Had some shards got it, they wait in its collectives and fail at their timeout.)
                lost += [
                    b
                    for b, work in sess.at_vae.items()
                    if not work.reported
                    and all(self.idle_since.get(w, 0.0) > work.sent_at + LOST_AFTER_S for w in sess.vae_workers)
                ]
            for block in lost:
                log.error("session %s: block %d never reached its worker (a lost control message)", sess.id, block)
                if block in sess.at_dit:
                    self.latent_pool.give(sess.at_dit.pop(block))
                if block in sess.at_vae:
                    work = sess.at_vae.pop(block)
                    self.latent_pool.give(work.latent_slot)
                    self.frame_pool.give(work.frame_slot)
                if sess.active:
                    self._finish(sess, FAILED, f"block {block} was lost on its way to a worker")
                self._maybe_forget(sess)
        self.pump()

    @scheduler_time
    def on_failed(self, msg: m.Failed) -> None:
        sess = self.sessions.get(msg.session) if msg.session else None
        if sess is None:
            return
        if msg.kind in ("request", "session"):
            # The worker carries on and answers nothing else for this block: its reply stands
            # for the block's (a VAE group's shards each send one).
            if msg.block in sess.at_dit and msg.worker == sess.dit:
                self.latent_pool.give(sess.at_dit.pop(msg.block))
                if msg.kind == "session":  # a gap: the earlier blocks it never got are lost (FIFO)
                    for b in [b for b in sess.at_dit if b < msg.block]:
                        log.error(
                            "session %s: block %d never reached %s (a lost control message)", sess.id, b, msg.worker
                        )
                        self.latent_pool.give(sess.at_dit.pop(b))
            elif msg.block in sess.at_vae and msg.worker in sess.vae_workers:
                work = sess.at_vae[msg.block]
                work.reported.add(sess.vae_workers.index(msg.worker))
                work.skipped = True
                if len(work.reported) == len(sess.vae_workers):
                    del sess.at_vae[msg.block]
                    self.latent_pool.give(work.latent_slot)
                    self.frame_pool.give(work.frame_slot)
        # kind "worker": the worker exits; its slots come back in workers_lost once it has.
        code = "invalid_request" if msg.kind == "request" else "generation_failed"
        self._finish(sess, FAILED, f"{msg.worker}: {msg.message}", code)
        self.pump()

    # -- ending -------------------------------------------------------------------------------
    @scheduler_time
    def cancel(self, session_id: str, reason: str = "cancelled") -> bool:
        sess = self.sessions.get(session_id)
        if sess is None or not sess.active:
            return False
        self._finish(sess, CANCELLED, reason)
        self.pump()
        return True

    def _finish(self, sess: Session, state: str, error: str | None, code: str | None = None) -> None:
        if not sess.active:
            return
        was_running = sess.state == RUNNING
        sess.state, sess.error = state, error
        if sess in self.queue:
            self.queue.remove(sess)
        if was_running:
            closing = m.CloseSession(sess.id)
            for w in self._workers_of(sess):
                self.send(w, closing)
        self.metrics.sessions.labels(state).inc()
        if state != DONE:
            log.info("session %s %s: %s", sess.id, state, error)
        sess.sink.on_end(sess, state, error, code)
        self._maybe_forget(sess)

    def _maybe_forget(self, sess: Session) -> None:
        """Drop an ended session once nothing holds a slot for it; close its encoder."""
        if sess.active or sess.outstanding or any(s is sess for s, *_ in self.decode_wait):
            return
        if self.sessions.pop(sess.id, None) is not None and sess.encode_thread is not None:
            if sess.writer is not None:
                sess.encode_thread.submit(sess.writer.close)
            sess.encode_thread.shutdown(wait=False)

    @scheduler_time
    def workers_lost(self, names: set[str], why: str) -> None:
        """The pool killed these workers and saw them exit: their slots are free again."""
        for sess in list(self.sessions.values()):
            dit_lost = sess.dit in names
            group_lost = sess.group is not None and bool(names & set(self.topology.vae_groups[sess.group]))
            if not (dit_lost or group_lost):
                continue
            if dit_lost:
                for slot in sess.at_dit.values():
                    self.latent_pool.give(slot)
                sess.at_dit.clear()
            if group_lost:
                for work in sess.at_vae.values():
                    self.latent_pool.give(work.latent_slot)
                    self.frame_pool.give(work.frame_slot)
                sess.at_vae.clear()
            if sess.state == RUNNING:
                self._finish(sess, FAILED, why)
            self._maybe_forget(sess)
        self.pump()

    def snapshot(self) -> dict:
        return {
            "running": len(self.running),
            "queued": len(self.queue),
            "tracked": len(self.sessions),
            "latent_slots_used": self.latent_pool.used,
            "latent_slots": self.latent_pool.total,
            "frame_slots_used": self.frame_pool.used,
            "frame_slots": self.frame_pool.total,
            "decode_wait": len(self.decode_wait),
        }

    def close(self) -> None:
        for sess in self.sessions.values():
            if sess.encode_thread is not None:
                sess.encode_thread.shutdown(wait=False, cancel_futures=True)
