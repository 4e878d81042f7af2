"""Dispatch and batching: what runs next on each DiT worker and VAE group, and each session's
next encode.

Each stage serves the earliest deadline first and is work-conserving: a slot stays free only
while no session has a block it may run; a session far ahead of its player yields to one that
is behind. A block is due when its session's player needs its first frame: first fragment +
start-up buffer + stalls so far + the block's media time (before the first fragment the clock
counts from the request).

A DiT worker or VAE group gets at most STAGE_DEPTH batches at once (one running, one queued),
so the choice of what runs next is made late, here. A batch is the most urgent block plus other
sessions' blocks that can run with it, added while the measured per-block cost falls with the
batch size (the first few batches of a size are trials that measure it) and the batch does not
make its most urgent block late that would have been on time. A VAE group's shards all get the
same batch messages, so they always agree.

A session's window: at most `max_blocks_in_flight` blocks between "sent to the DiT" and "taken
by its consumer"; a live session's next block waits until it is within `live_lead_s` of its
player's clock.
"""

from __future__ import annotations

from ...controls import control_marker
from ...ipc import messages as m
from ...plan import scene_marker, shot_left
from ..handle import RUNNING
from .admission import Admission
from .events import Encode, Send
from .tickets import FINAL, T_DIT, T_FRAMES, T_LATENT, T_QUEUED, T_VAE, Session, Ticket

STAGE_DEPTH = 2  # batches a DiT worker or VAE group holds at once: one running, one queued behind it


class Dispatch(Admission):
    def deadline(self, sess: Session, block: int) -> float:
        """When the session's player needs the block's first frame: its first fragment's arrival
        + the start-up buffer + the stalls so far + the block's media time. Before the first
        fragment, the clock starts at the request."""
        start = sess.playback.fragment_times[0] if sess.playback.fragment_times else sess.created
        b = sess.blocks[min(block, len(sess.blocks) - 1)]
        return start + self.cfg.pipeline.startup_buffer_s + sess.playback.stall_s + b.start_frame / sess.fps

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
            if not all(self._ready(w) for w in workers):
                continue
            unit = self._group_unit(gi)
            while self._depth(unit) < STAGE_DEPTH and self.frame_pool.free:
                # Per session its earliest latent_ready block, once every earlier block has gone
                # to the VAE (the temporal cache needs them in order).
                cands = []
                for sess in self.running:
                    if sess.place.group != gi:
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
        if not (sess.issued < len(sess.blocks) and sess.issued - sess.playback.acked < limit):
            return False
        return self._paced_until(sess) <= self.now

    def _paced_until(self, sess: Session) -> float:
        """When a live session's next block may start: at most `live_lead_s` ahead of its
        player's clock (a steer must show soon, not after all that was generated ahead)."""
        if not sess.live or not sess.playback.fragment_times:
            return 0.0
        return self.deadline(sess, sess.issued) - self.cfg.pipeline.live_lead_s

    def _depth(self, unit: str) -> int:
        return sum(u == unit for u, _ in self.batches.values())

    def _dispatch_dit(self, dit: str) -> None:
        if not self._ready(dit):
            return
        while self._depth(dit) < STAGE_DEPTH and self.latent_pool.free:
            cands = [(s, s.tickets[s.issued]) for s in self.running if s.place.dit == dit and self._issuable(s)]
            if not cands:
                return
            head = min(cands, key=lambda c: (self.deadline(c[0], c[1].block.index), c[0].created))[0]
            after = self.capacity.block_ms(self._group_unit(head.place.group), (head.width, head.height)) or 0.0
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
            self._advance(t, T_DIT)
            t.sent_at, t.batch = self.now, bid
            sess.issued += 1
            if self.cuts is not None:
                if b.shot_start or not sess.place.vae_cut:  # both sides' stage caches start afresh here
                    hw = self._latent_hw(sess.width, sess.height)
                    sess.place.vae_cut = self.cuts.cut(dit, self._group_unit(sess.place.group), hw, b.latent_frames)
                t.vae_cut = sess.place.vae_cut
            camera, actions = [], []
            if sess.controls is not None:  # the block takes the controls that have reached it
                ctl = sess.controls.block(b.index, b.latent_frames, b.shot_start)
                t.control_seq, camera, actions = ctl.seq, ctl.camera, ctl.actions
            msgs.append(
                m.GenerateBlock(
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
            )
        for w in self.topology.members(dit):  # a DiT group's ranks all run it (rank 0 answers)
            self._out.append(Send(w, m.GenerateBatch(msgs)))

    def _send_decodes(self, group: int, unit: str, batch: list) -> None:
        bid = self._new_batch(unit, batch)
        msgs = []
        for sess, t in batch:
            b = t.block
            self._advance(t, T_VAE)
            t.sent_at, t.batch, t.reported, t.skipped = self.now, bid, set(), False
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
        if sess.state != RUNNING or sess.playback.encoder != "open" or any(t.encoding for t in sess.tickets):
            return
        t = next((t for t in sess.tickets if t.state not in FINAL), None)
        if t is None or t.state != T_FRAMES:
            return
        b = t.block
        events = []
        if b.first_of_scene:
            events.append(scene_marker(b, sess.scenes[b.scene]))
        if t.control_seq is not None:
            events.append(control_marker(b, t.control_seq))
        t.encoding = True
        shape = (b.frames_out, sess.height, sess.width, 3)
        idr = b.index % self.cfg.encoder.keyframe_every_blocks == 0
        self._out.append(Encode(sess.id, b, t.frame_slot, shape, idr, events))
