"""Wan 2.1 diffusion transformer with block-causal inference (runs in the DiT worker process).

The module tree and parameter names follow the original Wan 2.1 release (`patch_embedding`,
`blocks.N.self_attn.q`, `head.head`, ...), so original, diffusers and Causal Forcing checkpoints
all map onto it (see `loading.py`). There is one forward path: a block of latent frames attends
to the session's cached keys/values plus itself (bidirectional inside the block). A whole clip in
one block with an empty cache is ordinary full attention, which is what the diffusers
conformance test checks.

Per-session state (`DiTState`: the KV cache with its window and sinks, the cross-attention
cache of the current prompt) is an explicit object passed into every call; the module holds
only weights, so one model instance serves any number of interleaved sessions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DiTConfig:
    dim: int = 1536  # model width
    ffn_dim: int = 8960  # FFN hidden width
    freq_dim: int = 256  # sinusoidal timestep embedding size
    num_heads: int = 12  # head_dim = dim / num_heads = 128 for the real models
    num_layers: int = 30
    in_channels: int = 16  # latent channels (VAE z_dim)
    out_channels: int = 16
    text_dim: int = 4096  # umT5-XXL hidden size
    text_len: int = 512  # context is zero-padded to this many tokens, no mask
    patch_size: tuple[int, int, int] = (1, 2, 2)  # (t, h, w)
    eps: float = 1e-6
    rope_max_positions: int = 1024  # height and width table rows; frames are computed at any position
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def rope_split(self) -> tuple[int, int, int]:
        """Complex pairs per axis (t, h, w): [22, 21, 21] for head_dim 128."""
        d = self.head_dim
        hw = 2 * (d // 6)
        return ((d - 2 * hw) // 2, hw // 2, hw // 2)

    def tokens_per_frame(self, latent_h: int, latent_w: int) -> int:
        return (latent_h // self.patch_size[1]) * (latent_w // self.patch_size[2])


# ----------------------------------------------------------------------------- session state


class KVCache:
    """Self-attention keys/values of one session, all layers, in frames.

    Layout per layer: `[B, heads, capacity_tokens, head_dim]` (SDPA's layout, so attention reads
    a view with no copy). Frames are stored oldest first. `capacity` is `window` frames: the
    first `sink` frames of the shot are never evicted; when a new block does not fit, the oldest
    non-sink frames are dropped and the rest shift down. The current block's keys are written
    just past the committed frames during the denoising steps and committed by the clean pass.
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
    ) -> None:
        if sink_frames >= window_frames:
            raise ValueError(f"sink_frames ({sink_frames}) must be < window_frames ({window_frames})")
        self.tpf = tokens_per_frame
        self.window = window_frames
        self.sink = sink_frames
        self.frames = 0  # committed frames held
        # `heads`: this rank's share in a DiT group (parallel/dit_group.py), else all of them.
        shape = (batch, heads or cfg.num_heads, window_frames * tokens_per_frame, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        # The clean latents behind the held frames, their RoPE positions and the block each was
        # committed with: what a re-cache recomputes the keys/values from (float32, small).
        self.latents: torch.Tensor | None = None  # (batch, C, window, h, w), allocated on first commit
        self.positions: list[int] = []
        self.blocks: list[int] = []
        self._next_block = 0
        # The last `sink` evicted frames' latents and positions: LongLive's re-cache without a
        # global sink recomputes the last `window` frames, which reach back past the held ones.
        self.tail: torch.Tensor | None = None
        self.tail_positions: list[int] = []

    def make_room(self, new_frames: int) -> None:
        """Evict the oldest non-sink frames so that `new_frames` more fit in the window."""
        excess = self.frames + new_frames - self.window
        if excess <= 0:
            return
        if excess > self.frames - self.sink:  # only frames past the sinks can go (an empty cache takes a window)
            raise ValueError(
                f"a block of {new_frames} frames does not fit a window of {self.window} "
                f"frames with {self.sink} sink frames"
            )
        t = self.tpf
        lo, hi = self.sink * t, self.frames * t
        for buf in (*self.k, *self.v):
            # Shift the kept tail down over the evicted frames (clone: the ranges overlap).
            buf[:, :, lo : hi - excess * t] = buf[:, :, lo + excess * t : hi].clone()
        if self.latents is not None:
            lat = self.latents
            if self.sink:
                gone = lat[:, :, self.sink : self.sink + excess].clone()
                tail = gone if self.tail is None else torch.cat([self.tail, gone], dim=2)
                self.tail = tail[:, :, -self.sink :]
                self.tail_positions = (self.tail_positions + self.positions[self.sink : self.sink + excess])[
                    -self.sink :
                ]
            lat[:, :, self.sink : self.frames - excess] = lat[:, :, self.sink + excess : self.frames].clone()
        del self.positions[self.sink : self.sink + excess], self.blocks[self.sink : self.sink + excess]
        self.frames -= excess

    def keep_latents(self, x: torch.Tensor, first_position: int) -> None:
        """Remember a committed block's clean latents (x: (batch, C, f, h, w)) after the frames
        held; call before `frames` counts them."""
        f = x.shape[2]
        if self.latents is None:
            self.latents = torch.zeros(
                (x.shape[0], x.shape[1], self.window, *x.shape[3:]), device=x.device, dtype=torch.float32
            )
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


class DiTState:
    """Everything the DiT keeps for one session between blocks."""

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self.cross: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer (k, v) of the prompt
        self.next_frame = 0  # absolute frame index (RoPE position) of the next block in this shot


# ----------------------------------------------------------------------------- building blocks


def sinusoidal_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[cos | sin] embedding of timesteps t (any shape) -> (*t.shape, dim), computed in float64."""
    half = dim // 2
    t = t.to(torch.float64)
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=t.device) / half)
    angles = t.unsqueeze(-1) * freqs
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32 whatever the activation dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float()).type_as(x)


class Rope:
    """3-axis rotary tables (t, h, w), cos/sin per complex pair, float32.

    Height and width come from tables of `rope_max_positions` rows, as in Wan. The frame axis is
    computed for the frames asked for, the same formula at any position: a live shot runs past
    Wan's 1024-entry table (its attention stays within the KV window and sinks, and RoPE scores
    depend only on distances, LongLive-style), and below 1024 it equals the table exactly."""

    def __init__(self, cfg: DiTConfig, device: torch.device) -> None:
        pos = torch.arange(cfg.rope_max_positions, dtype=torch.float64)
        cos, sin, self.inv = [], [], []
        for pairs in cfg.rope_split():
            d = 2 * pairs
            inv = 1.0 / torch.pow(cfg.rope_theta, torch.arange(0, d, 2, dtype=torch.float64) / d)
            ang = torch.outer(pos, inv)
            cos.append(torch.cos(ang).float().to(device))
            sin.append(torch.sin(ang).float().to(device))
            self.inv.append(inv)
        self.cos, self.sin = cos, sin
        self.device = device

    def tables(
        self, start_frame: int, f: int, h: int, w: int, rows: tuple[int, int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (f*h'*w, 1, pairs) for frames [start_frame, start_frame+f) and rows
        `rows` (default all h) of each."""
        r0, r1 = rows or (0, h)
        ang = torch.outer(torch.arange(start_frame, start_frame + f, dtype=torch.float64), self.inv[0])
        frame = (torch.cos(ang).float().to(self.device), torch.sin(ang).float().to(self.device))
        out = []
        for tabs, tf in zip((self.cos, self.sin), frame, strict=True):
            n = r1 - r0
            ct = tf.view(f, 1, 1, -1).expand(f, n, w, -1)
            ch = tabs[1][r0:r1].view(1, n, 1, -1).expand(f, n, w, -1)
            cw = tabs[2][:w].view(1, 1, w, -1).expand(f, n, w, -1)
            out.append(torch.cat([ct, ch, cw], dim=-1).reshape(f * n * w, 1, -1))
        return out[0], out[1]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, L, heads, head_dim); rotates adjacent pairs (2i, 2i+1)."""
    xf = x.float().unflatten(-1, (-1, 2))
    x1, x2 = xf[..., 0], xf[..., 1]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """q/k/v/o projections with RMSNorm on q and k over the full width (before the head split)."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.heads = cfg.num_heads
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.o = nn.Linear(cfg.dim, cfg.dim)
        self.norm_q = RMSNorm(cfg.dim, cfg.eps)
        self.norm_k = RMSNorm(cfg.dim, cfg.eps)


class SelfAttention(Attention):
    def forward(self, x: torch.Tensor, ropes: list, kvs: list[KVCache], layer: int, sp=None, grid=None) -> torch.Tensor:
        """x: (S, L_block, C), one row per session (a batch of sessions at the same step), each
        with its own cache (`kvs`) and RoPE positions (`ropes`). The projections run batched;
        attention runs per session over its own cached frames (their lengths differ). In a DiT
        group (`sp`, parallel/dit_group.py) x holds this rank's tokens only: q, k, v go to every
        token of this rank's heads before attention and the output comes back after."""
        s_, n, _ = x.shape
        q = self.norm_q(self.q(x)).unflatten(2, (self.heads, -1))
        k = self.norm_k(self.k(x)).unflatten(2, (self.heads, -1))
        v = self.v(x).unflatten(2, (self.heads, -1))
        # One state may also hold a batch of its own (forward_full): then it takes every row.
        rows = [slice(None)] if len(kvs) == 1 else [slice(i, i + 1) for i in range(s_)]
        if len(rows) == 1:
            q, k = apply_rope(q, *ropes[0]), apply_rope(k, *ropes[0])
        else:
            q = torch.cat([apply_rope(q[r], *rope) for r, rope in zip(rows, ropes, strict=True)])
            k = torch.cat([apply_rope(k[r], *rope) for r, rope in zip(rows, ropes, strict=True)])
        if sp is not None:
            q, k, v = sp.to_heads(torch.stack([q, k, v], dim=2), grid).unbind(2)
            n = q.shape[1]
        outs = []
        for r, kv in zip(rows, kvs, strict=True):
            # Write this block's keys just past the committed frames (keys are cached after
            # RoPE), then attend over committed + block as one view of the buffer: no copy.
            lo = kv.frames * kv.tpf
            if torch.is_grad_enabled():  # training (streamdiff/train): new buffers, the old stay in the graph
                kv.k[layer] = torch.cat([kv.k[layer][:, :, :lo], k[r].transpose(1, 2), kv.k[layer][:, :, lo + n :]], 2)
                kv.v[layer] = torch.cat([kv.v[layer][:, :, :lo], v[r].transpose(1, 2), kv.v[layer][:, :, lo + n :]], 2)
            else:
                kv.k[layer][:, :, lo : lo + n] = k[r].transpose(1, 2)
                kv.v[layer][:, :, lo : lo + n] = v[r].transpose(1, 2)
            outs.append(
                F.scaled_dot_product_attention(
                    q[r].transpose(1, 2), kv.k[layer][:, :, : lo + n], kv.v[layer][:, :, : lo + n]
                )
            )
        out = (outs[0] if len(outs) == 1 else torch.cat(outs)).transpose(1, 2)
        if sp is not None:
            out = sp.to_tokens(out, grid)
        return self.o(out.flatten(2))


class CrossAttention(Attention):
    def project_context(self, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L_text, C) -> k, v as (B, heads, L_text, head_dim); computed once per prompt."""
        k = self.norm_k(self.k(ctx)).unflatten(2, (self.heads, -1)).transpose(1, 2)
        v = self.v(ctx).unflatten(2, (self.heads, -1)).transpose(1, 2)
        return k, v

    def forward(self, x: torch.Tensor, kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """x: (S, L, C); kvs: each session's prompt keys/values (its own prompt)."""
        q = self.norm_q(self.q(x)).unflatten(2, (self.heads, -1)).transpose(1, 2)
        if len(kvs) == 1:
            out = F.scaled_dot_product_attention(q, *kvs[0])
        else:
            out = torch.cat([F.scaled_dot_product_attention(q[i : i + 1], *kv) for i, kv in enumerate(kvs)])
        return self.o(out.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.norm1 = LayerNorm(cfg.dim, cfg.eps, elementwise_affine=False)
        self.self_attn = SelfAttention(cfg)
        self.norm3 = LayerNorm(cfg.dim, cfg.eps, elementwise_affine=True)
        self.cross_attn = CrossAttention(cfg)
        self.norm2 = LayerNorm(cfg.dim, cfg.eps, elementwise_affine=False)
        self.ffn = nn.Sequential(
            nn.Linear(cfg.dim, cfg.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn_dim, cfg.dim)
        )
        self.modulation = nn.Parameter(torch.randn(1, 6, cfg.dim) / cfg.dim**0.5)

    def forward(
        self, x: torch.Tensor, e: torch.Tensor, f: int, ropes, states: list[DiTState], layer: int, sp=None, grid=None
    ):
        # x: (S, L, C) with L = f * tokens_per_frame, one row per session; e: (S, f, 6, C) float32.
        b, n, c = x.shape
        shift, scale, gate, c_shift, c_scale, c_gate = (self.modulation.unsqueeze(1) + e).unbind(2)

        def per_frame(t: torch.Tensor) -> torch.Tensor:  # (B, L, C) <-> (B, f, L/f, C)
            return t.view(b, f, n // f, c)

        def mod(y: torch.Tensor, sh: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
            return (per_frame(y.float()) * (1 + sc.unsqueeze(2)) + sh.unsqueeze(2)).view(b, n, c)

        kvs = [st.kv for st in states]
        y = self.self_attn(mod(self.norm1(x), shift, scale).type_as(x), ropes, kvs, layer, sp, grid)
        x = (x.float() + (per_frame(y.float()) * gate.unsqueeze(2)).view(b, n, c)).type_as(x)
        x = x + self.cross_attn(self.norm3(x), [st.cross[layer] for st in states])
        y = self.ffn(mod(self.norm2(x), c_shift, c_scale).type_as(x))
        x = (x.float() + (per_frame(y.float()) * c_gate.unsqueeze(2)).view(b, n, c)).type_as(x)
        return x


class Head(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.norm = LayerNorm(cfg.dim, cfg.eps, elementwise_affine=False)
        self.head = nn.Linear(cfg.dim, cfg.out_channels * math.prod(cfg.patch_size))
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim) / cfg.dim**0.5)

    def forward(self, x: torch.Tensor, e: torch.Tensor, f: int) -> torch.Tensor:
        b, n, c = x.shape
        shift, scale = (self.modulation.unsqueeze(1) + e.unsqueeze(2)).unbind(2)  # (B, f, C) each
        y = self.norm(x).float().view(b, f, n // f, c) * (1 + scale.unsqueeze(2)) + shift.unsqueeze(2)
        return self.head(y.view(b, n, c).type_as(x))


# ----------------------------------------------------------------------------- the model


class WanDiT(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embedding = nn.Conv3d(cfg.in_channels, cfg.dim, cfg.patch_size, cfg.patch_size)
        self.text_embedding = nn.Sequential(
            nn.Linear(cfg.text_dim, cfg.dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.dim, cfg.dim)
        )
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(cfg.dim, 6 * cfg.dim))
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.num_layers)])
        self.head = Head(cfg)
        self._rope: Rope | None = None
        # A DiT group's sequence parallelism (parallel/dit_group.py's SeqParallel), set by the
        # engine of a group's worker: this rank computes its band of tokens and its heads.
        self.parallel = None

    # -- session state ------------------------------------------------------------------
    def new_state(
        self, latent_h: int, latent_w: int, window_frames: int, sink_frames: int = 0, batch: int = 1
    ) -> DiTState:
        p = self.cfg.patch_size
        if latent_h % p[1] or latent_w % p[2]:
            raise ValueError(f"latent size {latent_h}x{latent_w} is not divisible by the patch {p[1:]}")
        w = self.patch_embedding.weight
        kv = KVCache(
            self.cfg,
            batch,
            self.cfg.tokens_per_frame(latent_h, latent_w),
            window_frames,
            sink_frames,
            w.device,
            w.dtype,
            self.parallel.local_heads if self.parallel else None,
        )
        return DiTState(kv)

    @torch.no_grad()
    def set_prompt(self, state: DiTState, context: torch.Tensor) -> None:
        """Replace the cross-attention cache with `context` (B, L_text, text_dim) embeddings."""
        w = self.patch_embedding.weight
        ctx = self.text_embedding(context.to(device=w.device, dtype=w.dtype))
        state.cross = [blk.cross_attn.project_context(ctx) for blk in self.blocks]

    @torch.no_grad()
    def recache(
        self, state: DiTState, context: torch.Tensor, context_t: float = 0.0, global_sink: bool = False
    ) -> None:
        """Switch the prompt and recompute the window's keys/values under it, as LongLive's
        `_recache_after_switch` does, so the new scene is not dragged along by the old prompt.

        The last n = min(window, t) frames of the shot (t frames so far) pass again, clean, at
        timestep `context_t` and their own positions, in ONE forward. In that forward they attend
        to each other in both directions and to the frames kept before them: LongLive builds a
        block-causal mask for it, but its attention with a KV cache never reads the mask.
        - t <= window: every frame from 0 on is recomputed, sinks included (LongLive protects the
          sinks only when the recompute does not start at frame 0).
        - t > window with `global_sink`: the sinks keep the keys/values they were written with;
          the other held frames are recomputed attending to them.
        - t > window without: the cache is emptied and the last `window` frames (reaching back
          past the held ones by `sink` frames) are recomputed; the first `sink` of them become the
          sinks from now on, as in LongLive's cache.
        """
        self.set_prompt(state, context)
        kv, t = state.kv, state.next_frame
        if kv.frames == 0:
            return
        n = min(kv.window, t)
        first = t - n
        keep = kv.sink if first > 0 and global_sink else 0
        if keep:  # LongLive recomputes the frames behind the sinks too, but stores none of them
            first = t - (kv.frames - keep)
        latents = kv.latents_at(range(first, t))
        kv.frames = keep
        del kv.positions[keep:], kv.blocks[keep:]
        state.next_frame = first
        b = latents.shape[0]
        self._forward(latents, torch.full((b, t - first), context_t, device=latents.device), [state], commit=True)
        assert state.next_frame == t

    @torch.no_grad()
    def recompute(self, state: DiTState, chunk_frames: int, context_t: float = 0.0) -> None:
        """Rewrite the keys/values of every held frame from its clean latent under the current
        prompt (Krea Realtime's per-block KV recompute): the held frames are laid at consecutive
        positions from 0, passed at timestep `context_t` in chunks of `chunk_frames` from the
        oldest (each chunk sees itself and the chunks before: the authors' block-causal mask),
        and the next block follows them at position `frames`."""
        kv = state.kv
        n = kv.frames
        if n == 0:
            state.next_frame = 0
            return
        latents = kv.latents[:, :, :n].clone()
        kv.frames, kv.positions, kv.blocks = 0, [], []
        state.next_frame = 0
        for i in range(0, n, chunk_frames):
            j = min(i + chunk_frames, n)
            t = torch.full((latents.shape[0], j - i), context_t, device=latents.device)
            self._forward(latents[:, :, i:j], t, [state], commit=True)

    @torch.no_grad()
    def commit_and_recompute(self, state: DiTState, x0: torch.Tensor, block_frames: int, context_t: float = 0.0):
        """Commit a denoised block Krea's way, in place of the clean pass: hold its latents,
        evict down to the context the next block keeps (the window less one block: the sinks and
        the newest frames), and recompute that context under the prompt the block was made with.
        Krea recomputes at the start of the next block, before a prompt switch reaches the
        cross-attention cache, so doing it here gives the same keys from the same inputs."""
        kv = state.kv
        kv.commit_latents(x0, state.next_frame)
        kv.make_room(block_frames)
        self.recompute(state, block_frames, context_t)

    def cast(self, dtype: torch.dtype) -> WanDiT:
        """Cast to `dtype`, keeping the small precision-sensitive parts (time MLP, modulation
        tables, affine LayerNorm) in float32 as the reference implementations do."""
        self.to(dtype)
        for name, p in self.named_parameters():
            if name.startswith("time_embedding") or "modulation" in name or ".norm3." in name:
                p.data = p.data.float()
        return self

    def rope(self) -> Rope:
        dev = self.patch_embedding.weight.device
        if self._rope is None or self._rope.cos[0].device != dev:
            self._rope = Rope(self.cfg, dev)
        return self._rope

    # -- one block ------------------------------------------------------------------------
    @torch.no_grad()
    def forward_block(self, x: torch.Tensor, t: torch.Tensor, state: DiTState, commit: bool) -> torch.Tensor:
        """Flow prediction for one block of latent frames of one session.

        x: (B, C, f, H, W) latents of the block; t: (B, f) timesteps, one per frame (0..1000).
        The block attends to the cached frames of `state` plus itself. `commit=True` keeps this
        block's keys/values in the cache (the clean pass at t=0 after a block is denoised).
        """
        if not state.cross:
            raise RuntimeError("set_prompt() must be called before forward_block()")
        if x.shape[0] != state.kv.k[0].shape[0]:
            raise ValueError(f"a batch of {x.shape[0]} for a state of batch {state.kv.k[0].shape[0]}")
        return self._forward(x, t, [state], commit)

    @torch.no_grad()
    def forward_sessions(self, x: torch.Tensor, t: torch.Tensor, states: list[DiTState], commit: bool) -> torch.Tensor:
        """`forward_block` for several sessions in one forward: x (S, C, f, H, W), row i the
        block of session `states[i]` (same latent size; any prompts, cache positions, windows);
        t (S, f). Equal to running each alone: only the projections and FFN are batched."""
        if len(states) != x.shape[0] or any(st.kv.k[0].shape[0] != 1 for st in states):
            raise ValueError(f"{x.shape[0]} blocks for {len(states)} single-session states")
        if any(not st.cross for st in states):
            raise RuntimeError("set_prompt() must be called for every session before forward_sessions()")
        return self._forward(x, t, states, commit)

    def _forward(self, x: torch.Tensor, t: torch.Tensor, states: list[DiTState], commit: bool) -> torch.Tensor:
        cfg = self.cfg
        b, _, f, h, w = x.shape
        if t.shape != (b, f):
            raise ValueError(f"timesteps must be (B, f) = {(b, f)}, got {tuple(t.shape)}")
        pt, ph, pw = cfg.patch_size
        fp, hp, wp = f // pt, h // ph, w // pw
        for st in states:
            if hp * wp != st.kv.tpf:
                raise ValueError(f"latent {h}x{w} does not match the session's {st.kv.tpf} tokens per frame")
            st.kv.make_room(fp)
        wdt = self.patch_embedding.weight
        sp, grid, rows = self.parallel, None, (0, hp)
        if sp is not None:  # this rank's band of patch rows in every frame
            grid = sp.grid(fp, hp, wp)
            rows = sp.rows(grid)
        band = x[..., rows[0] * ph : rows[1] * ph, :]
        tokens = self.patch_embedding(band.to(wdt.dtype)).flatten(2).transpose(1, 2)  # (B, L, C)

        # Timestep embeddings per frame. The time MLP stays float32 (see `cast`), and the
        # modulation arithmetic is float32 as in the reference.
        sin = sinusoidal_embedding(t, cfg.freq_dim).to(self.time_embedding[0].weight.dtype)
        emb = self.time_embedding(sin).float()  # (B, f, C)
        e6 = self.time_projection(emb.to(wdt.dtype)).float().unflatten(2, (6, cfg.dim))  # (B, f, 6, C)

        ropes = [self.rope().tables(st.next_frame, fp, hp, wp, rows) for st in states]
        for i, blk in enumerate(self.blocks):
            tokens = blk(tokens, e6, fp, ropes, states, i, sp, grid)
        out = self.head(tokens, emb, fp)  # (B, L, pt*ph*pw*C_out)
        if sp is not None:
            out = sp.gather(out, grid)

        if commit:
            for i, st in enumerate(states):
                st.kv.keep_latents(x if len(states) == 1 else x[i : i + 1], st.next_frame)
                st.kv.frames += fp
                st.next_frame += fp
        out = out.view(b, fp, hp, wp, pt, ph, pw, cfg.out_channels)
        return out.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, cfg.out_channels, f, h, w).float()

    @torch.no_grad()
    def forward_full(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Plain bidirectional forward over a whole clip (one block, empty cache).

        t: (B,) or (B, f). The reference behaviour of `WanTransformer3DModel.forward`.
        """
        b, _, f, h, w = x.shape
        if t.dim() == 1:
            t = t[:, None].expand(b, f)
        state = self.new_state(h, w, window_frames=f + 1, batch=b)
        self.set_prompt(state, context)
        return self.forward_block(x, t, state, commit=False)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
