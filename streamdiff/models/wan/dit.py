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

import torch
import torch.nn.functional as F
from torch import nn

from ...platform import KINDS, for_device
from . import prope
from .action import ActionModule
from .dit_config import DiTConfig
from .kv_cache import DiTState, KVCache

# ----------------------------------------------------------------------------- building blocks


def sinusoidal_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[cos | sin] embedding of timesteps t (any shape) -> (*t.shape, dim), computed in float64
    as the reference does, or in float32 (as diffusers does) on a device without float64
    kernels (`Platform.float64`: Intel GPUs without native fp64 raise on them)."""
    half = dim // 2
    kind = t.device.type  # meta (building and checking a model unmaterialised) computes as the CPU
    dtype = torch.float64 if kind not in KINDS or for_device(kind).float64 else torch.float32
    t = t.to(dtype)
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=dtype, device=t.device) / half)
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
    """3-axis rotary tables (t, h, w), cos/sin per complex pair, float32, kept on the model's device.

    Height and width come from tables of `rope_max_positions` rows, as in Wan. The frame axis is
    the same formula at any position: a live shot runs past Wan's 1024-entry table (its attention
    stays within the KV window and sinks, and RoPE scores depend only on distances, LongLive-style),
    and below 1024 it equals the table exactly. Every table is computed once in float64 on the CPU
    (some GPUs have slow float64) and uploaded once; the frame table grows (doubling) when a shot
    runs past it, so a block's tables are slices and a concatenation on the device, no upload."""

    def __init__(self, cfg: DiTConfig, device: torch.device) -> None:
        self.inv = []
        for pairs in cfg.rope_split():
            d = 2 * pairs
            self.inv.append(1.0 / torch.pow(cfg.rope_theta, torch.arange(0, d, 2, dtype=torch.float64) / d))
        self.device = device
        self.cos, self.sin = [], []
        for inv in self.inv:
            c, s = self._table(0, cfg.rope_max_positions, inv)
            self.cos.append(c)
            self.sin.append(s)
        self._hw: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, lo: int, hi: int, inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ang = torch.outer(torch.arange(lo, hi, dtype=torch.float64), inv)
        return torch.cos(ang).float().to(self.device), torch.sin(ang).float().to(self.device)

    def frames(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The frame axis' cos, sin tables (positions, pairs) covering positions [0, end)."""
        n = self.cos[0].shape[0]
        if end > n:  # a live shot past the table: extend it once, doubling
            c, s = self._table(n, max(2 * n, end), self.inv[0])
            self.cos[0], self.sin[0] = torch.cat([self.cos[0], c]), torch.cat([self.sin[0], s])
        return self.cos[0], self.sin[0]

    def tables(
        self, start_frame: int, f: int, h: int, w: int, rows: tuple[int, int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (f*h'*w, 1, pairs) for frames [start_frame, start_frame+f) and rows
        `rows` (default all h) of each."""
        r0, r1 = rows or (0, h)
        n = r1 - r0
        hw = self._hw.get((r0, r1, w))
        if hw is None:  # the height and width pairs of every token of a frame, per (rows, width)
            hw = tuple(
                torch.cat(
                    [tabs[1][r0:r1].view(n, 1, -1).expand(n, w, -1), tabs[2][:w].view(1, w, -1).expand(n, w, -1)],
                    dim=-1,
                ).reshape(n * w, -1)
                for tabs in (self.cos, self.sin)
            )
            self._hw[(r0, r1, w)] = hw
        out = []
        for tf, thw in zip(self.frames(start_frame + f), hw, strict=True):
            ct = tf[start_frame : start_frame + f].view(f, 1, -1).expand(f, n * w, -1)
            out.append(torch.cat([ct, thw.view(1, n * w, -1).expand(f, n * w, -1)], dim=-1).reshape(f * n * w, 1, -1))
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
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__(cfg)
        if cfg.prope:  # minWM's camera path out (zero-initialised, as minWM adds it to a trained model)
            self.prope_o = nn.Linear(cfg.dim, cfg.dim)
            nn.init.zeros_(self.prope_o.weight)
            nn.init.zeros_(self.prope_o.bias)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kvs: list[KVCache],
        layer: int,
        sp=None,
        grid=None,
        prope: bool = False,
    ) -> torch.Tensor:
        """q, k, v: (S, L_block, heads, head_dim) after RoPE, one row per session (a batch of
        sessions at the same step), each with its own cache (`kvs`; or one cache holding a batch
        of its own, forward_full). Writes the block's keys/values into each cache, then attends
        over what each holds: one SDPA call for the batch where the sessions' lengths agree (the
        common case: a copy of their keys/values into one batch), else one per session. In a DiT
        group (`sp`, parallel/dit_group.py) the rows hold this rank's tokens only: q, k, v go to
        every token of this rank's heads before attention and the output comes back after.
        `prope`: PRoPE's path, over its own buffers of the same caches. Returns (S, L_block, heads,
        head_dim)."""
        if sp is not None:
            q, k, v = sp.to_heads(torch.stack([q, k, v], dim=2), grid).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (S, heads, L, d)
        bufs = [kv.buffers(prope) for kv in kvs]
        if len(kvs) == 1:
            n = kvs[0].write(layer, k, v, prope)
            (ks, vs) = bufs[0]
            out = F.scaled_dot_product_attention(q, ks[layer][:, :, :n], vs[layer][:, :, :n])
        else:
            lens = [kv.write(layer, k[i : i + 1], v[i : i + 1], prope) for i, kv in enumerate(kvs)]
            if len(set(lens)) == 1:
                n = lens[0]
                out = F.scaled_dot_product_attention(
                    q,
                    torch.cat([ks[layer][:, :, :n] for ks, _ in bufs]),
                    torch.cat([vs[layer][:, :, :n] for _, vs in bufs]),
                )
            else:
                out = torch.cat(
                    [
                        F.scaled_dot_product_attention(q[i : i + 1], ks[layer][:, :, :n], vs[layer][:, :, :n])
                        for i, ((ks, vs), n) in enumerate(zip(bufs, lens, strict=True))
                    ]
                )
        out = out.transpose(1, 2)
        return sp.to_tokens(out, grid) if sp is not None else out


class CrossAttention(Attention):
    def project_context(self, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L_text, C) -> k, v as (B, heads, L_text, head_dim); computed once per prompt."""
        k = self.norm_k(self.k(ctx)).unflatten(2, (self.heads, -1)).transpose(1, 2)
        v = self.v(ctx).unflatten(2, (self.heads, -1)).transpose(1, 2)
        return k, v

    def forward(self, x: torch.Tensor, kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """x: (S, L, C); kvs: each session's prompt keys/values (B_i, heads, L_text, head_dim),
        concatenated into one batch: one SDPA call, each row over its own prompt."""
        q = self.norm_q(self.q(x)).unflatten(2, (self.heads, -1)).transpose(1, 2)
        k, v = kvs[0] if len(kvs) == 1 else (torch.cat([k for k, _ in kvs]), torch.cat([v for _, v in kvs]))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o(out.transpose(1, 2).flatten(2))


def _per_frame(t: torch.Tensor, f: int) -> torch.Tensor:  # (B, L, C) -> (B, f, L/f, C)
    b, n, c = t.shape
    return t.view(b, f, n // f, c)


def _mod(y: torch.Tensor, f: int, sh: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    return (_per_frame(y.float(), f) * (1 + sc.unsqueeze(2)) + sh.unsqueeze(2)).view(y.shape)


def block_qkv(blk: DiTBlock, x: torch.Tensor, e: torch.Tensor, f: int, cos: torch.Tensor, sin: torch.Tensor):
    """A block up to its self-attention: q, k, v (S, L, heads, head_dim), RoPE applied, and q, k
    before RoPE (PRoPE's; a model without it drops them at once). No cache and no Python state:
    the part `torch.compile` takes (`WanDiT.compile_blocks`)."""
    shift, scale = (blk.modulation.unsqueeze(1) + e)[:, :, :2].unbind(2)
    att = blk.self_attn
    y = _mod(blk.norm1(x), f, shift, scale).type_as(x)
    q = att.norm_q(att.q(y)).unflatten(2, (att.heads, -1))
    k = att.norm_k(att.k(y)).unflatten(2, (att.heads, -1))
    v = att.v(y).unflatten(2, (att.heads, -1))
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, q, k


def block_cross(
    blk: DiTBlock,
    x: torch.Tensor,
    attn: torch.Tensor,
    e: torch.Tensor,
    f: int,
    ck: torch.Tensor,
    cv: torch.Tensor,
    cam: torch.Tensor | None = None,
) -> torch.Tensor:
    """A block after its self-attention (attn: (S, L, heads, head_dim)) up to its FFN: output
    projection and gate, cross-attention over the prompts' keys/values (ck, cv). `cam`: PRoPE's
    attention output, back through P (prope.py), added through `prope_o`."""
    b, n, c = x.shape
    gate = (blk.modulation.unsqueeze(1) + e)[:, :, 2]
    y = blk.self_attn.o(attn.flatten(2))
    if cam is not None:
        y = y + blk.self_attn.prope_o(cam.flatten(2))
    x = (x.float() + (_per_frame(y.float(), f) * gate.unsqueeze(2)).view(b, n, c)).type_as(x)
    return x + blk.cross_attn(blk.norm3(x), [(ck, cv)])


def block_ffn(blk: DiTBlock, x: torch.Tensor, e: torch.Tensor, f: int) -> torch.Tensor:
    """A block's FFN and its gate."""
    b, n, c = x.shape
    c_shift, c_scale, c_gate = (blk.modulation.unsqueeze(1) + e)[:, :, 3:].unbind(2)
    y = blk.ffn(_mod(blk.norm2(x), f, c_shift, c_scale).type_as(x))
    return (x.float() + (_per_frame(y.float(), f) * c_gate.unsqueeze(2)).view(b, n, c)).type_as(x)


def block_rest(
    blk: DiTBlock,
    x: torch.Tensor,
    attn: torch.Tensor,
    e: torch.Tensor,
    f: int,
    ck: torch.Tensor,
    cv: torch.Tensor,
    cam: torch.Tensor | None = None,
) -> torch.Tensor:
    """A block after its self-attention: `block_cross` then `block_ffn`; compiled alike."""
    return block_ffn(blk, block_cross(blk, x, attn, e, f, ck, cv, cam), e, f)


class DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig, index: int = 0) -> None:
        super().__init__()
        self.norm1 = LayerNorm(cfg.dim, cfg.eps, elementwise_affine=False)
        self.self_attn = SelfAttention(cfg)
        self.norm3 = LayerNorm(cfg.dim, cfg.eps, elementwise_affine=True)
        self.cross_attn = CrossAttention(cfg)
        self.norm2 = LayerNorm(cfg.dim, cfg.eps, elementwise_affine=False)
        self.ffn = nn.Sequential(
            nn.Linear(cfg.dim, cfg.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn_dim, cfg.dim)
        )
        # In place: on meta tensors (a checkpoint's model, built before it is filled) an
        # out-of-place division runs torch's Python reference, whose first call imports dynamo,
        # about 0.85 s of a worker's start that compiles nothing.
        self.modulation = nn.Parameter(torch.randn(1, 6, cfg.dim).div_(cfg.dim**0.5))
        # Matrix-Game's keyboard and mouse conditioning, between the cross-attention and the FFN
        a = cfg.action
        self.action_model = ActionModule(a, cfg.dim) if a is not None and index in a.blocks else None

    def forward(
        self,
        x: torch.Tensor,
        e: torch.Tensor,
        f: int,
        rope: tuple[torch.Tensor, torch.Tensor],
        kvs: list[KVCache],
        cross: tuple[torch.Tensor, torch.Tensor],
        layer: int,
        sp=None,
        grid=None,
        fns=(block_qkv, block_rest),
        cams: torch.Tensor | None = None,
        acts: list | None = None,
    ):
        """x: (S, L, C) with L = f * tokens_per_frame, one row per session; e: (S, f, 6, C) float32;
        rope: cos, sin broadcasting to (S, L, heads, pairs); cross: the prompts' (k, v) of this
        layer, (S, heads, L_text, head_dim); fns: the two halves, eager or compiled; cams: a
        camera model's (S, f, 3, 4, 4) P^T, P^-1, P per frame (prope.projections); acts: an action
        model's (start frame, action.BlockActions) per session (each row through its own caches)."""
        qkv, rest = fns
        q, k, v, q0, k0 = qkv(self, x, e, f, *rope)
        attn = self.self_attn.attend(q, k, v, kvs, layer, sp, grid)
        cam = None
        if cams is not None:
            pt, p_inv, p = cams.unbind(2)
            qp, kp, vp = prope.transform(q0, pt), prope.transform(k0, p_inv), prope.transform(v, p_inv)
            cam = prope.transform(self.self_attn.attend(qp, kp, vp, kvs, layer, sp, grid, prope=True), p)
        if self.action_model is None:
            return rest(self, x, attn, e, f, *cross, cam)
        if sp is not None:
            raise ValueError("an action model does not run in a DiT group")
        x = block_cross(self, x, attn, e, f, *cross, cam)
        x = torch.cat(
            [self.action_model(x[i : i + 1], f, kvs[i], layer, start, a) for i, (start, a) in enumerate(acts)]
        )
        return block_ffn(self, x, e, f)


class Head(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.norm = LayerNorm(cfg.dim, cfg.eps, elementwise_affine=False)
        self.head = nn.Linear(cfg.dim, cfg.out_channels * math.prod(cfg.patch_size))
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim).div_(cfg.dim**0.5))  # in place: DiTBlock's

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
        if cfg.image_dim:  # Matrix-Game: the context is CLIP's image tokens (its `MLPProj`)
            self.img_emb = ImageProjection(cfg.image_dim, cfg.dim)
        else:
            self.text_embedding = nn.Sequential(
                nn.Linear(cfg.text_dim, cfg.dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.dim, cfg.dim)
            )
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(cfg.dim, 6 * cfg.dim))
        self.blocks = nn.ModuleList([DiTBlock(cfg, i) for i in range(cfg.num_layers)])
        self.head = Head(cfg)
        self._rope: Rope | None = None
        # A DiT group's sequence parallelism (parallel/dit_group.py's SeqParallel), set by the
        # engine of a group's worker: this rank computes its band of tokens and its heads.
        self.parallel = None
        # The halves of a block around its attention: eager, or compiled by `compile_blocks`.
        self.block_fns = (block_qkv, block_rest)

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
            (latent_h, latent_w),
        )
        return DiTState(kv)

    @torch.no_grad()
    def set_prompt(self, state: DiTState, context: torch.Tensor) -> None:
        """Replace the cross-attention cache with `context` (B, L_text, text_dim) embeddings, or an
        image model's CLIP tokens (B, 257, image_dim)."""
        w = self.patch_embedding.weight
        embed = self.img_emb if self.cfg.image_dim else self.text_embedding
        ctx = embed(context.to(device=w.device, dtype=w.dtype))
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
        kv.reset(keep)
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
        kv.reset(0)
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

    def compile_blocks(self, compiler=None) -> None:
        """Run each block's two halves around its attention (`block_qkv`, `block_rest`) through
        `compiler` (models/compiled.py: torch.compile with dynamic shapes, or eager), or eager
        with None. The halves take tensors and the block's weights only (the KV cache and the
        sessions' bookkeeping stay outside, eager), so one graph serves every layer and every
        position in a shot, and, its token count, frame count and batch being symbols, every
        frame size, re-cache and batch of two or more: what differs is a batch of one and a
        block of one frame (dynamo specialises a size of 1), which `DiTEngine.warm` compiles
        before a worker is ready."""
        wrap = compiler.wrap if compiler is not None else (lambda fn: fn)
        self.block_fns = (wrap(block_qkv), wrap(block_rest))

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
        if self._rope is None or self._rope.cos[1].device != dev:
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
        x_in = x
        if cfg.cond_channels:  # Matrix-Game: the block's mask and image latents beside the noise
            for st in states:
                if st.cond is None or tuple(st.cond.shape[1:3]) != (cfg.cond_channels, f):
                    raise ValueError(f"an image model needs the block's {cfg.cond_channels}-channel conditioning")
            cond = torch.cat([st.cond.to(x.device, x.dtype) for st in states]).expand(b, -1, -1, -1, -1)
            x_in = torch.cat([x, cond], dim=1)
        band = x_in[..., rows[0] * ph : rows[1] * ph, :]
        # (B, L, C), laid out as every later block's output is: a transposed view here would make
        # the compiled halves (`compile_blocks`) compile once more for the first block, whose
        # input alone would be a view, and it runs the first block's projections on contiguous rows.
        tokens = self.patch_embedding(band.to(wdt.dtype)).flatten(2).transpose(1, 2).contiguous()

        # Timestep embeddings per frame. The time MLP stays float32 (see `cast`), and the
        # modulation arithmetic is float32 as in the reference.
        sin = sinusoidal_embedding(t, cfg.freq_dim).to(self.time_embedding[0].weight.dtype)
        emb = self.time_embedding(sin).float()  # (B, f, C)
        e6 = self.time_projection(emb.to(wdt.dtype)).float().unflatten(2, (6, cfg.dim))  # (B, f, 6, C)

        rope = self.rope()
        if len(states) == 1:  # (L, 1, pairs), broadcast over the state's own batch
            ropes = rope.tables(states[0].next_frame + states[0].rope_offset, fp, hp, wp, rows)
        else:  # (S, L, 1, pairs): each session at its own positions
            tabs = (rope.tables(st.next_frame + st.rope_offset, fp, hp, wp, rows) for st in states)
            ropes = tuple(torch.stack(t) for t in zip(*tabs))
        kvs = [st.kv for st in states]
        cams = self._cameras(states, b, fp) if cfg.prope else None
        acts = None
        if cfg.action is not None:
            if any(st.actions is None for st in states) or b != len(states):
                raise ValueError("an action model needs each session's block actions, one session a row")
            acts = [(st.next_frame, st.actions) for st in states]
        for i, blk in enumerate(self.blocks):
            if len(states) == 1:
                cross = states[0].cross[i]
            else:  # the prompts' keys/values as one batch (each row its own prompt): one SDPA call
                cross = (torch.cat([st.cross[i][0] for st in states]), torch.cat([st.cross[i][1] for st in states]))
            tokens = blk(tokens, e6, fp, ropes, kvs, cross, i, sp, grid, self.block_fns, cams, acts)
        out = self.head(tokens, emb, fp)  # (B, L, pt*ph*pw*C_out)
        if sp is not None:
            out = sp.gather(out, grid)

        if commit:
            for i, st in enumerate(states):
                st.kv.keep_latents(x if len(states) == 1 else x[i : i + 1], st.next_frame)
                st.kv.frames += fp
                st.next_frame += fp
                if st.pin_next:  # a multi-shot transition's first block: the new shot's sink
                    st.kv.pin(fp)
                    st.pin_next = False
        out = out.view(b, fp, hp, wp, pt, ph, pw, cfg.out_channels)
        return out.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, cfg.out_channels, f, h, w).float()

    def _cameras(self, states: list[DiTState], b: int, f: int) -> torch.Tensor:
        """Each row's P^T, P^-1, P per frame of the block, (b, f, 3, 4, 4), from its state's camera."""
        for st in states:
            if st.camera is None or tuple(st.camera.shape) != (f, 20):
                got = None if st.camera is None else tuple(st.camera.shape)
                raise ValueError(f"a camera model needs the block's camera, ({f}, 20) rows; got {got}")
        dev, dtype = self.patch_embedding.weight.device, self.patch_embedding.weight.dtype
        cams = torch.stack([prope.projections(st.camera.to(dev), dtype) for st in states])
        return cams.expand(b, *cams.shape[1:]) if len(states) == 1 else cams

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


class ImageProjection(nn.Module):
    """Matrix-Game's `MLPProj` (`img_emb.proj`): LayerNorm, Linear, GELU, Linear, LayerNorm."""

    def __init__(self, image_dim: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Sequential(
            nn.LayerNorm(image_dim), nn.Linear(image_dim, image_dim), nn.GELU(), nn.Linear(image_dim, dim),
            nn.LayerNorm(dim),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
