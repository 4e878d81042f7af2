"""A session's blocks as tickets, and the one place a ticket changes state (`advance`).

Every block of every session is a ticket with one explicit state, and the ticket owns the ring
slots its state holds:

    queued -> dit -> latent_ready -> vae -> frames_ready -> emitted
    any state -> cancelled | failed, once no process holds a slot of it any more

    queued        nothing yet                     dit           latent slot (the DiT writes it)
    latent_ready  latent slot (waits for the VAE) vae           latent + frame slot (the group)
    frames_ready  frame slot (the encoder reads)  emitted, cancelled, failed: none

A ticket goes to its workers as the orders below (`generate_order`, `decode_order`). A block is
emitted once its fragment is encoded and handed to its session (one step: no state
between the two).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...controls import Timeline
from ...ipc import messages as m
from ...ipc.shm import SlotPool
from ...plan import Block, Scene, shot_left
from ..handle import QUEUED, RUNNING
from .capacity import Demand

# Ticket states.
T_QUEUED, T_DIT, T_LATENT, T_VAE, T_FRAMES, T_EMITTED = (
    "queued",
    "dit",
    "latent_ready",
    "vae",
    "frames_ready",
    "emitted",
)
T_CANCELLED, T_FAILED = "cancelled", "failed"
FINAL = (T_EMITTED, T_CANCELLED, T_FAILED)

# The slots each state owns ("latent", "frame"; given back in this order).
OWNS: dict[str, tuple[str, ...]] = {
    T_QUEUED: (),
    T_DIT: ("latent",),
    T_LATENT: ("latent",),
    T_VAE: ("latent", "frame"),
    T_FRAMES: ("frame",),
    T_EMITTED: (),
    T_CANCELLED: (),
    T_FAILED: (),
}

# Every legal transition: the life cycle forward one stage, or out (cancelled, failed) from any
# state not final.
NEXT: dict[str, tuple[str, ...]] = {
    T_QUEUED: (T_DIT, T_CANCELLED, T_FAILED),
    T_DIT: (T_LATENT, T_CANCELLED, T_FAILED),
    T_LATENT: (T_VAE, T_CANCELLED, T_FAILED),
    T_VAE: (T_FRAMES, T_CANCELLED, T_FAILED),
    T_FRAMES: (T_EMITTED, T_CANCELLED, T_FAILED),
    T_EMITTED: (),
    T_CANCELLED: (),
    T_FAILED: (),
}


class TicketError(RuntimeError):
    """A transition the ticket life cycle does not have (a scheduler bug, never a worker's)."""


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
    control_seq: int | None = None  # a world model's: the newest control that shaped it (its fragment's emsg)


@dataclass
class SessionPlace:
    """Where a session runs, fixed when it is admitted (admission.py)."""

    dit: str | None = None  # its DiT worker (a DiT group's rank 0)
    group: int | None = None  # its VAE group
    vae_workers: list[str] = field(default_factory=list)  # the shards of its VAE group
    vae_cut: int = 0  # its shot's VAE cut (topology.vae_cut; chosen at each shot's start)
    demand: Demand | None = None  # what it asked of its units when it was placed
    held_frames: int | None = None  # its KV cache's bound, fixed when it opens (admission._held_frames)
    started: float | None = None  # when it left the queue (the scheduler's clock)


@dataclass
class SessionPlayback:
    """How its video reaches its player: the encoder, the fragments, the stalls, the acks."""

    encoder: str = "none"  # none | opening | open
    fragment_times: list[float] = field(default_factory=list)  # one per block
    stall_s: float = 0.0  # playback delay accumulated so far (a player rebuffers, then continues)
    stalls: int = 0
    acked: int = 0  # fragments taken by the consumer


@dataclass
class Session:
    """One video in the scheduler: its plan (what was asked, planned into blocks and tickets),
    where it runs (`place`) and how it plays (`playback`)."""

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
    tickets: list[Ticket] = field(default_factory=list)
    issued: int = 0  # tickets past queued
    live: bool = False  # open-ended: paced to its player, ends at its cap or a stop
    steered_at: list[int] = field(default_factory=list)  # the blocks where steered scenes start
    controls: Timeline | None = None  # a world model's controls (controls.py); None: prompts only
    place: SessionPlace = field(default_factory=SessionPlace)
    playback: SessionPlayback = field(default_factory=SessionPlayback)

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


def advance(t: Ticket, to: str, latent: SlotPool, frames: SlotPool) -> None:
    """Move ticket `t` to state `to`: the one place a ticket changes state. Refuses a transition
    the life cycle does not have (TicketError); gives back the slots `to` no longer owns (latent
    before frame) and takes those it owns that `t` does not hold yet. The caller makes sure a
    slot it takes is free."""
    if to not in NEXT[t.state]:
        raise TicketError(f"block {t.block.index}: a ticket does not go from {t.state} to {to}")
    before, after = OWNS[t.state], OWNS[to]
    if "latent" in before and "latent" not in after:
        latent.give(t.latent_slot)
        t.latent_slot = None
    if "frame" in before and "frame" not in after:
        frames.give(t.frame_slot)
        t.frame_slot = None
    if "latent" in after and "latent" not in before:
        t.latent_slot = latent.take()
    if "frame" in after and "frame" not in before:
        t.frame_slot = frames.take()
    if t.state == T_FRAMES:
        t.encoding = False  # an encode is out only while the frames are ready
    t.state = to


class Slots:
    """The two rings' slots, one collaborator of the scheduler: `advance` moves a ticket and the
    slots its state holds."""

    def __init__(self, latent: int, frame: int) -> None:
        self.latent = SlotPool(latent)
        self.frame = SlotPool(frame)

    def advance(self, t: Ticket, to: str) -> None:
        advance(t, to, self.latent, self.frame)


def generate_order(sess: Session, t: Ticket, camera: list, actions: list) -> m.GenerateBlock:
    """What the DiT is told to make of the ticket's block: a scene's first block carries the
    scene (its prompt, seed, image, and whether it starts a shot or re-caches the window)."""
    b = t.block
    scene, first = sess.scenes[b.scene], b.first_of_scene
    return m.GenerateBlock(
        sess.id,
        b.index,
        b.latent_frames,
        t.latent_slot,
        prompt=scene.prompt if first else None,
        new_shot=b.shot_start and first,
        seed=scene.seed if first else None,
        recache=first and scene.recache and not b.shot_start,
        transition=first and scene.keeps_history,
        vae_cut=t.vae_cut,
        shot_left=0 if sess.live else shot_left(sess.blocks, b.index),
        image=scene.image if b.shot_start and first else None,
        camera=camera,
        actions=actions,
    )


def decode_order(sess: Session, t: Ticket) -> m.DecodeBlock:
    """What the VAE group is told to decode: the latent's slot and shape, the frame slot, and
    where the block sits in its shot's cache."""
    b = t.block
    return m.DecodeBlock(
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
