"""A DiT session's state (runs in the DiT worker process): the KV cache and what the DiT keeps
between blocks. The model (`dit.py`) holds only weights; one instance serves any number of
sessions, each through its own `DiTState`."""

from __future__ import annotations

import torch

from .dit_config import DiTConfig


class KVCache:
    """Self-attention keys/values of one session, all layers, in frames.

    Layout per layer: `[B, heads, capacity_tokens, head_dim]` (SDPA's layout, so attention reads
    a view with no copy), allocated once when the session opens and reused by every shot (`reset`),
    so a session never holds two caches. `capacity` is `window` frames, the current block's included.

    Each held frame has a slot of the buffer (`order`: the slots of the held frames in shot
    order). The first `sink` frames of the shot hold slots 0..sink-1 and are never evicted.
    Evicting frames frees their slots and the next block's keys overwrite them; nothing is
    copied. A new frame takes the lowest free slot, so until the first eviction the held frames
    are a prefix of the buffer in order; eviction only happens when a block fills the window
    exactly, so from then on every slot is held. Attention without a mask does not depend on the
    order of the keys (RoPE is applied before they are cached), so it reads the valid slots as
    one view: a prefix of `frames` + the block's frames, the whole buffer once full.
    `read` gives frames back in shot order where order matters (the rolling sampler's context).
    The current block's keys are written to the slots it will hold during the denoising steps
    and committed by the clean pass.

    Which frames go: the oldest past the sinks, except a pinned shot sink (`pin`: LongLive 2.0's
    multi-shot, the first frames of a new shot's first block), which stays until the next pin.

    The clean latents behind the held frames (`latents`, for re-caches) stay in shot order: they are
    1/5000 of the keys/values, and their users index them by position.
    """

    def __init__(
        self,
        cfg: DiTConfig,
        batch: int,
        tokens_per_frame: int,
        window_frames: int,
        sink_frames: int,
        device: torch.device,
        dtype: torch.dtype,
        heads: int | None = None,
        latent_hw: tuple[int, int] | None = None,
    ) -> None:
        if sink_frames >= window_frames:
            raise ValueError(f"sink_frames ({sink_frames}) must be < window_frames ({window_frames})")
        self.tpf = tokens_per_frame
        self.window = window_frames
        self.sink = sink_frames
        self.order: list[int] = []  # the slot of each held (committed) frame, in shot order
        self.pinned: tuple[int, int] | None = None  # the shot sink: (first held frame, frames)
        self._runs: dict[tuple[int, int], list[tuple[int, int]]] = {}  # _frame_slots, until a change
        # `heads`: this rank's share in a DiT group (parallel/dit_group.py), else all of them.
        shape = (batch, heads or cfg.num_heads, window_frames * tokens_per_frame, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        # PRoPE's keys/values (cfg.prope): the same slots of a second pair of buffers, so the same
        # ring, sinks and eviction hold both paths
        self.pk = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)] if cfg.prope else []
        self.pv = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)] if cfg.prope else []
        # Matrix-Game's action caches (action.py), per action layer, frame-major slots of the same
        # ring: the mouse path's keys/values of every token, the keyboard's one token a frame
        self.action: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        if cfg.action is not None:
            a = cfg.action
            for layer in a.blocks:
                bufs = {}
                if a.mouse:
                    d = a.mouse_hidden_dim // a.heads
                    mshape = (batch, window_frames, tokens_per_frame, a.heads, d)
                    bufs["mouse"] = tuple(torch.zeros(mshape, device=device, dtype=dtype) for _ in range(2))
                if a.keyboard_dim:
                    kshape = (batch, window_frames, a.heads, a.keyboard_hidden_dim // a.heads)
                    bufs["keyboard"] = tuple(torch.zeros(kshape, device=device, dtype=dtype) for _ in range(2))
                self.action[layer] = bufs
        # The clean latents behind the held frames, their RoPE positions and the block each was
        # committed with: what a re-cache recomputes the keys/values from (float32, small).
        # Allocated here where the latent size is known, so that a session's bytes are fixed at open.
        self.latents: torch.Tensor | None = None  # (batch, C, window, h, w)
        self.positions: list[int] = []
        self.blocks: list[int] = []
        self._next_block = 0
        # The last `sink` evicted frames' latents and positions: LongLive's re-cache without a
        # global sink recomputes the last `window` frames, which reach back past the held ones.
        self.tail: torch.Tensor | None = None  # (batch, C, len(tail_positions), h, w), a view of _tail
        self._tail: torch.Tensor | None = None
        self.tail_positions: list[int] = []
        if latent_hw is not None:
            lat = (batch, cfg.out_channels, window_frames, *latent_hw)
            self.latents = torch.zeros(lat, device=device, dtype=torch.float32)
            self._tail = torch.zeros((*lat[:2], sink_frames, *lat[3:]), device=device, dtype=torch.float32)

    @property
    def frames(self) -> int:
        """Committed frames held. Setting it more holds the next frames (the slots the block was
        written to); less drops the newest."""
        return len(self.order)

    @frames.setter
    def frames(self, n: int) -> None:
        if n < len(self.order):
            del self.order[n:]
        else:
            self.order += self._free()[: n - len(self.order)]
        self._runs.clear()

    @property
    def wrapped(self) -> bool:
        """Whether a frame has been evicted since the shot (or re-cache) began: the held frames
        are no longer the buffer's first slots in order."""
        return self.order != list(range(len(self.order)))

    def _free(self) -> list[int]:
        held = set(self.order)
        return [s for s in range(self.window) if s not in held]

    def reset(self, frames: int = 0) -> None:
        """Keep only the first `frames` frames (at most the sinks once the ring has wrapped: they
        never move) and restart; their keys/values stay as written. For a re-cache."""
        if self.order[:frames] != list(range(frames)):
            raise ValueError(f"only the {self.sink} sink frames can be kept once the ring has wrapped")
        self.frames, self.pinned = frames, None
        del self.positions[frames:], self.blocks[frames:]

    def pin(self, block_frames: int) -> None:
        """Pin the first frames (at most `sink`) of the block just committed as the shot sink,
        in place of any earlier one: LongLive 2.0's multi-shot sink (the authors'
        `_pin_current_chunk`). It is evicted by nothing until the next pin; attention reads it
        as any held frame. Needs sinks (the authors pin only with a sink size)."""
        if not self.sink:
            raise ValueError("a shot sink needs sink frames")
        if not 0 < block_frames <= self.frames:
            raise ValueError(f"a block of {block_frames} frames is not among the {self.frames} held")
        self.pinned = (self.frames - block_frames, min(self.sink, block_frames))

    def new_shot(self) -> None:
        """Empty the cache for the session's next shot: the same buffers, nothing held."""
        self.reset(0)
        self.tail, self.tail_positions, self._next_block = None, [], 0

    @property
    def nbytes(self) -> int:
        """Every byte this cache holds: keys, values, latents and the evicted tail."""
        bufs = [*self.k, *self.v, *self.pk, *self.pv, *(t for t in (self.latents, self._tail) if t is not None)]
        bufs += [t for kinds in self.action.values() for pair in kinds.values() for t in pair]
        return sum(t.numel() * t.element_size() for t in bufs)

    def _frame_slots(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Frame slots holding frames [lo, hi) of the held sequence (in shot order; frames past
        the held ones: the slots the next block takes), as runs of consecutive slots."""
        runs = self._runs.get((lo, hi))
        if runs is None:
            held = len(self.order)
            runs = _runs(self.order[lo:hi] + self._free()[: max(0, hi - max(lo, held))])
            self._runs[(lo, hi)] = runs
        return runs

    def _slots(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Token ranges of the buffer holding frames [lo, hi) (`_frame_slots` in tokens)."""
        return [(a * self.tpf, b * self.tpf) for a, b in self._frame_slots(lo, hi)]

    def write_action(self, layer: int, kind: str, k: torch.Tensor, v: torch.Tensor):
        """Matrix-Game's action caches (action.py): a block's keys/values (1, f, ...) per frame at
        the slots of the frames just past the committed ones, in the same ring as the self-
        attention's; returns the buffers and how many of their frames attention reads (a prefix)."""
        ks, vs = self.action[layer][kind]
        f, i = k.shape[1], 0
        for a, b in self._frame_slots(self.frames, self.frames + f):
            ks[:, a:b], vs[:, a:b] = k[:, i : i + b - a], v[:, i : i + b - a]
            i += b - a
        return ks, vs, self.frames + f

    def read(self, layer: int, lo: int, hi: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The keys/values of held frames [lo, hi) in shot order, as views of contiguous pieces."""
        return [(self.k[layer][:, :, a:b], self.v[layer][:, :, a:b]) for a, b in self._slots(lo, hi)]

    def buffers(self, prope: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The per-layer key and value buffers of the RoPE path, or of PRoPE's."""
        return (self.pk, self.pv) if prope else (self.k, self.v)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, prope: bool = False) -> int:
        """Put a block's keys/values (B, heads, n, head_dim) in the slots of the frames just past the
        committed ones (PRoPE's buffers with `prope`); returns how many tokens attention reads (a
        prefix of the buffer). Under autograd (training, streamdiff/train) the buffers are
        replaced, the old stay in the graph."""
        ks, vs = self.buffers(prope)
        n = k.shape[2]
        f = n // self.tpf
        i = 0
        for a, b in self._slots(self.frames, self.frames + f):
            ki, vi = k[:, :, i : i + b - a], v[:, :, i : i + b - a]
            if torch.is_grad_enabled():
                ks[layer] = torch.cat([ks[layer][:, :, :a], ki, ks[layer][:, :, b:]], 2)
                vs[layer] = torch.cat([vs[layer][:, :, :a], vi, vs[layer][:, :, b:]], 2)
            else:
                ks[layer][:, :, a:b] = ki
                vs[layer][:, :, a:b] = vi
            i += b - a
        return (self.frames + f) * self.tpf  # a prefix: the whole buffer once full

    def make_room(self, new_frames: int) -> None:
        """Evict the oldest frames past the sinks and the pinned shot sink so that `new_frames`
        more fit in the window: their slots are freed (the keys/values stay, to be overwritten)."""
        excess = self.frames + new_frames - self.window
        if excess <= 0:
            return
        p0, pn = self.pinned or (0, 0)
        gone = [i for i in range(self.sink, self.frames) if not p0 <= i < p0 + pn][:excess]
        if len(gone) < excess:  # an empty cache takes a window; only unpinned frames past the sinks go
            raise ValueError(
                f"a block of {new_frames} frames does not fit a window of {self.window} "
                f"frames with {self.sink} sink frames" + (f" and a shot sink of {pn}" if pn else "")
            )
        out = set(gone)
        kept = [i for i in range(self.frames) if i not in out]
        if self.latents is not None:
            lat = self.latents
            if self.sink:  # (slices, not a list index: that would be an index tensor made on the host)
                gone_lat = torch.cat([lat[:, :, a:b] for a, b in _runs(gone)], dim=2)
                self._keep_tail(gone_lat, [self.positions[i] for i in gone])
            # The latents stay in shot order (small: a copy of a few frames' latents).
            at = 0
            for a, b in _runs(kept):
                if a != at:
                    lat[:, :, at : at + b - a] = lat[:, :, a:b].clone()
                at += b - a
        # (a cache used without `keep_latents`, as the action modules' tests use it, has no positions)
        self.positions = [self.positions[i] for i in kept if i < len(self.positions)]
        self.blocks = [self.blocks[i] for i in kept if i < len(self.blocks)]
        self.order = [self.order[i] for i in kept]
        if self.pinned is not None:  # it keeps its frames; those before it went
            self.pinned = (p0 - sum(1 for i in gone if i < p0), pn)
        self._runs.clear()

    def _keep_tail(self, gone: torch.Tensor, positions: list[int]) -> None:
        """The last `sink` evicted frames, oldest first, in the preallocated `_tail`."""
        old = len(self.tail_positions)
        self.tail_positions = (self.tail_positions + positions)[-self.sink :]
        keep_old = len(self.tail_positions) - min(len(positions), self.sink)
        buf = self._tail
        if keep_old:
            buf[:, :, :keep_old] = buf[:, :, old - keep_old : old].clone()
        buf[:, :, keep_old : len(self.tail_positions)] = gone[
            :, :, gone.shape[2] - (len(self.tail_positions) - keep_old) :
        ]
        self.tail = buf[:, :, : len(self.tail_positions)]

    def keep_latents(self, x: torch.Tensor, first_position: int) -> None:
        """Remember a committed block's clean latents (x: (batch, C, f, h, w)) after the frames
        held; call before `frames` counts them."""
        f = x.shape[2]
        if self.latents is None:  # a cache built without its latent size
            self.latents = torch.zeros(
                (x.shape[0], x.shape[1], self.window, *x.shape[3:]), device=x.device, dtype=torch.float32
            )
            self._tail = torch.zeros((*x.shape[:2], self.sink, *x.shape[3:]), device=x.device, dtype=torch.float32)
        self.latents[:, :, self.frames : self.frames + f] = x.float()
        self.positions += range(first_position, first_position + f)
        self.blocks += [self._next_block] * f
        self._next_block += 1

    def commit_latents(self, x: torch.Tensor, first_position: int) -> None:
        """Hold a denoised block (x: (batch, C, f, h, w)) by its clean latents only, evicting to
        make room; its keys/values are left for a `WanDiT.recompute` to write."""
        self.make_room(x.shape[2])
        self.keep_latents(x, first_position)
        self.frames += x.shape[2]

    def latents_at(self, positions: range) -> torch.Tensor:
        """The clean latents of the frames at `positions` (held, or among the last evicted)."""
        known = {p: (self.latents, i) for i, p in enumerate(self.positions[: self.frames])}
        known.update({p: (self.tail, i) for i, p in enumerate(self.tail_positions) if p not in known})
        missing = [p for p in positions if p not in known]
        if missing:
            raise ValueError(f"frames {missing} are neither held nor among the last evicted")
        return torch.cat([known[p][0][:, :, known[p][1] : known[p][1] + 1] for p in positions], dim=2)


def _runs(items: list[int]) -> list[tuple[int, int]]:
    """Ascending runs of consecutive integers, as [start, end) pairs, in the order given."""
    runs: list[tuple[int, int]] = []
    for i in items:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


class DiTState:
    """Everything the DiT keeps for one session between blocks."""

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self.cross: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer (k, v) of the prompt
        self.next_frame = 0  # absolute frame index of the next block in this shot
        # LongLive 2.0's multi-shot (SamplerConfig.shot_offset): the frames' RoPE positions are
        # next_frame + rope_offset (shot index x offset); `pin_next` pins the next committed block
        self.rope_offset = 0
        self.pin_next = False
        # A camera model's (cfg.prope): the next block's camera per latent frame, (f, 20) rows of
        # w2c and fx, fy, cx, cy (controls.camera_row), set before the block, read by every pass of it
        self.camera: torch.Tensor | None = None
        # Matrix-Game's, set the same way: the block's conditioning latents (1, cfg.cond_channels,
        # f, h, w) and its actions (action.BlockActions)
        self.cond: torch.Tensor | None = None
        self.actions = None

    def new_shot(self) -> None:
        """The next shot reuses this state's buffers (a cut never holds two caches)."""
        self.kv.new_shot()
        self.cross, self.next_frame, self.rope_offset, self.pin_next = [], 0, 0, False
