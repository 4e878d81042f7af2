"""Wan 2.1 VAE decoder with an explicit causal temporal cache (runs in the VAE worker process).

Parameter names follow the original release (`conv2`, `decoder.conv1`, `decoder.middle.N`,
`decoder.upsamples.N`, `decoder.head.N`), so `Wan2.1_VAE.pth` loads directly and diffusers'
`AutoencoderKLWan` maps onto it (see `loading.py`).

Streaming: every causal conv keeps the last two input frames of the session in `VAEState`
(one slot per conv, assigned when the decoder is built), so decoding a latent block by block,
in blocks of any size, gives the same frames as decoding the whole latent at once. The first
latent frame of a shot passes the temporal upsamplers without `time_conv` and yields 1 frame;
every later latent frame yields 4.

Height sharding hooks in through `Halo`: every 3x3 convolution asks the halo for one extra row
above and below its input (zero rows for an unsharded decode or at the global edges, the
neighbours' rows inside a VAE group), and the middle attention asks it to gather whole frames.
This file has no communication code; `streamdiff.parallel.vae_group` supplies the exchanging
halo. The cached frames are stored with their halo rows, so a shard never re-exchanges them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import DecodePlan, cat_frames, conv2d, conv3d_valid_t, empty, frames, layout, unframes

CACHE_T = 2  # frames each causal 3x3x3 conv keeps: its temporal kernel is 3
WAN21_LATENTS_MEAN = (
    -0.7571,
    -0.7089,
    -0.9113,
    0.1075,
    -0.1745,
    0.9653,
    -0.1517,
    1.5508,
    0.4134,
    -0.0715,
    0.5517,
    -0.3632,
    -0.1922,
    -0.9497,
    0.2503,
    -0.2921,
)
WAN21_LATENTS_STD = (
    2.8184,
    1.4541,
    2.3275,
    2.6558,
    1.2196,
    1.7708,
    2.6052,
    2.0743,
    3.2687,
    2.1526,
    2.8652,
    1.5579,
    1.6382,
    1.1253,
    2.8251,
    1.9160,
)


@dataclass(frozen=True)
class VAEConfig:
    base_dim: int = 96  # channels at full resolution; x dim_mult at lower ones
    z_dim: int = 16  # latent channels
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2  # the decoder has num_res_blocks + 1 per stage
    temporal_downsample: tuple[bool, ...] = (False, True, True)  # encoder order; decoder reverses it
    latents_mean: tuple[float, ...] = WAN21_LATENTS_MEAN
    latents_std: tuple[float, ...] = WAN21_LATENTS_STD

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)

    @property
    def temporal_factor(self) -> int:
        return 2 ** sum(self.temporal_downsample)

    def frames_out(self, latent_frames: int, first_block: bool) -> int:
        """Output frames for a block: the first latent frame of a shot yields 1, others 4."""
        return latent_frames * self.temporal_factor - (self.temporal_factor - 1 if first_block else 0)


# ----------------------------------------------------------------------------- state and hooks


@dataclass
class VAEState:
    """Causal temporal cache of one session (one decoder shard): one entry per cached conv."""

    cache: list[torch.Tensor | None]
    latent_frames: int = 0  # latent frames decoded so far in this shot


class Halo:
    """Unsharded behaviour: zero rows at the top and bottom, whole frames already local.

    `rows` is how many neighbour rows each side a 3x3 conv's input gets from the halo: 0 here
    (the convolution pads with zeros itself, no copy), 1 in a VAE group. `post(x)` starts the
    exchange of x's edge rows and `complete(pending, dest)` writes the received rows into the
    first and last row of `dest`, so the transfer overlaps filling the conv's input buffer.
    """

    rows = 0

    def post(self, x: torch.Tensor):
        return None

    def complete(self, pending, dest: torch.Tensor) -> None:
        pass

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def local(self, x: torch.Tensor) -> torch.Tensor:
        return x


NO_HALO = Halo()


@dataclass
class Ctx:
    state: VAEState
    halo: Halo = field(default_factory=Halo)
    checkpoint: Callable[[], None] | None = None  # before each CPU conv2d (WanVAEDecoder.checkpoint)


# ----------------------------------------------------------------------------- building blocks


class CausalConv3d(nn.Conv3d):
    """3D conv, causal in time (pads 2*p_t frames in front, or takes them from the cache)."""

    def __init__(self, cin: int, cout: int, kernel, padding=0) -> None:
        super().__init__(cin, cout, kernel, padding=padding)
        self.slot = -1  # cache slot, assigned by the decoder when kernel_t > 1

    def forward(self, x: torch.Tensor, ctx: Ctx | None = None) -> torch.Tensor:
        kt, kh, kw = self.kernel_size
        halo = ctx.halo if kh > 1 else NO_HALO
        n = kt - 1  # cached frames in front; none at the start of a shot: zeros
        x = with_halo(x, halo, ctx.state.cache[self.slot] if n else None, n)
        if n:
            ctx.state.cache[self.slot] = cat_frames(None, x[:, :, -n:], 0)  # stored with their halo rows
        h_pad = 1 if kh > 1 and halo.rows == 0 else 0
        return conv3d_valid_t(x, self.weight, self.bias, h_pad, self.padding[2], ctx.checkpoint)


def with_halo(x: torch.Tensor, halo: Halo, prev: torch.Tensor | None = None, front: int = 0) -> torch.Tensor:
    """A conv's input: `front` cached frames (prev, or zeros) before x in time (5D inputs) and
    `halo.rows` neighbour rows above and below, in one fresh buffer of the device's layout.
    The neighbours' rows travel while the buffer is being filled."""
    r = halo.rows
    if r == 0 and front == 0:
        return x
    pending = halo.post(x) if r else None
    shape = list(x.shape)
    shape[-2] += 2 * r
    if front:
        shape[2] += front
    buf = empty(shape, x)
    body = buf
    if front:
        if prev is None:
            buf[:, :, :front].zero_()
        else:
            buf[:, :, :front] = prev
        body = buf[:, :, front:]
    body[..., r : r + x.shape[-2], :] = x
    if pending is not None:
        halo.complete(pending, body)
    return buf


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, silu: bool) -> torch.Tensor:
    """Inference's per-pixel RMS norm over channels (gamma already times sqrt(C)), then SiLU if
    asked: three passes over x instead of five, in place. Tensors in, a tensor out, no Python
    state: the part `torch.compile` takes (`WanVAEDecoder.compile_pointwise`), where the passes
    fuse into one kernel."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    inv = torch.linalg.vector_norm(xf, dim=1, keepdim=True).clamp_min_(1e-12).reciprocal_()
    y = (xf * inv).to(x.dtype).mul_(gamma)
    return F.silu(y, inplace=True) if silu else y


class RMSNorm(nn.Module):
    """Per-pixel RMS norm over channels: normalize(x, dim=1) * sqrt(C) * gamma."""

    def __init__(self, dim: int, images: bool = True) -> None:
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, *((1, 1) if images else (1, 1, 1))))
        self.kernel = rms_norm  # eager, or compiled by `WanVAEDecoder.compile_pointwise`

    def forward(self, x: torch.Tensor, silu: bool = False) -> torch.Tensor:
        """With silu=True also applies SiLU. Under autograd (training the embedded default) the
        same arithmetic out of place."""
        if torch.is_grad_enabled():
            y = F.normalize(x, dim=1, eps=1e-12) * (self.gamma * self.scale)
            return F.silu(y) if silu else y
        return self.kernel(x, self.gamma * self.scale, silu)


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        # Indices match the original nn.Sequential: norm 0, conv 2, norm 3, conv 6.
        self.residual = nn.Sequential(
            RMSNorm(cin, images=False),
            nn.SiLU(),
            CausalConv3d(cin, cout, 3, padding=1),
            RMSNorm(cout, images=False),
            nn.SiLU(),
            nn.Dropout(0.0),
            CausalConv3d(cout, cout, 3, padding=1),
        )
        self.shortcut = CausalConv3d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        r = self.residual
        h = self.shortcut(x, ctx) if isinstance(self.shortcut, CausalConv3d) else x
        x = r[2](r[0](x, silu=True), ctx)
        x = r[6](r[3](x, silu=True), ctx)
        return x + h


class AttentionBlock(nn.Module):
    """Single-head self-attention over all positions of each frame (global in H*W)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        x = ctx.halo.gather(x)
        b, c, t, h, w = x.shape
        y = conv2d(self.norm(frames(x)), self.to_qkv.weight, self.to_qkv.bias, checkpoint=ctx.checkpoint)
        # Contiguous (b*t, h*w, 3c) first: chunks of a transposed view have a last dimension of
        # stride h*w, which the fused SDPA kernels refuse (the math path materialises every
        # frame's (h*w)^2 scores). Chunks of the contiguous copy have stride 1 there.
        q, k, v = y.reshape(b * t, 3 * c, h * w).transpose(1, 2).contiguous().unsqueeze(1).chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v)  # (b*t, 1, h*w, c)
        y = y.squeeze(1).transpose(1, 2).reshape(b * t, c, h, w)
        y = conv2d(y, self.proj.weight, self.proj.bias, checkpoint=ctx.checkpoint)
        return ctx.halo.local(x + unframes(y, b))


class Resample(nn.Module):
    """Decoder upsampling: optional causal temporal doubling (`time_conv`), then nearest 2x
    in space and a 3x3 conv that halves the channels."""

    def __init__(self, dim: int, temporal: bool) -> None:
        super().__init__()
        self.resample = nn.Sequential(
            nn.Upsample(scale_factor=2.0, mode="nearest-exact"), nn.Conv2d(dim, dim // 2, 3, padding=1)
        )
        self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0)) if temporal else None

    def _double_frames(self, x: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        slot = self.time_conv.slot
        head = None
        if ctx.state.cache[slot] is None:
            # The shot's first frame is not doubled; after it the cache starts from zeros.
            head, x = x[:, :, :1], x[:, :, 1:]
            ctx.state.cache[slot] = cat_frames(None, head[:, :, :0], CACHE_T)
            if x.shape[2] == 0:
                return head
        b, c, t, h, w = x.shape
        y = self.time_conv(x, ctx)  # (B, 2C, T, H, W): channel halves are the two output frames
        out = empty((b, c, 2 * t, h, w), y)
        out[:, :, 0::2] = y[:, :c]
        out[:, :, 1::2] = y[:, c:]
        return out if head is None else cat_frames(head, out, 0)

    def forward(self, x: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        if self.time_conv is not None:
            x = self._double_frames(x, ctx)
        y = F.interpolate(frames(x).float(), scale_factor=2.0, mode="nearest-exact").to(x.dtype)
        y = with_halo(y, ctx.halo)
        conv = self.resample[1]
        return unframes(conv2d(y, conv.weight, conv.bias, (1 - ctx.halo.rows, 1), ctx.checkpoint), x.shape[0])


class Decoder3d(nn.Module):
    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        dim = cfg.base_dim
        dims = [dim * u for u in (cfg.dim_mult[-1], *cfg.dim_mult[::-1])]
        temporal_up = cfg.temporal_downsample[::-1]
        self.conv1 = CausalConv3d(cfg.z_dim, dims[0], 3, padding=1)
        self.middle = nn.Sequential(ResBlock(dims[0], dims[0]), AttentionBlock(dims[0]), ResBlock(dims[0], dims[0]))
        ups: list[nn.Module] = []
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:], strict=False)):
            if i > 0:
                cin //= 2  # each Resample halves the channels
            for _ in range(cfg.num_res_blocks + 1):
                ups.append(ResBlock(cin, cout))
                cin = cout
            if i != len(cfg.dim_mult) - 1:
                ups.append(Resample(cout, temporal=temporal_up[i]))
        self.upsamples = nn.Sequential(*ups)
        self.head = nn.Sequential(RMSNorm(dims[-1], images=False), nn.SiLU(), CausalConv3d(dims[-1], 3, 3, padding=1))
        # Where height sharding starts: the first upsampler (everything before it is the
        # low-resolution front: conv1, middle with its global attention, the first stage).
        self.split = next(i for i, m in enumerate(ups) if isinstance(m, Resample))

    def front(self, x: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        x = self.conv1(x, ctx)
        x = self.middle[0](x, ctx)
        x = self.middle[1](x, ctx)
        x = self.middle[2](x, ctx)
        for m in self.upsamples[: self.split]:
            x = m(x, ctx)
        return x

    def back(self, x: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        for m in self.upsamples[self.split :]:
            x = m(x, ctx)
        return self.head[2](self.head[0](x, silu=True), ctx)


class WanVAEDecoder(nn.Module):
    """`conv2` (post-quant 1x1x1) + `decoder`. Decodes normalised latents block by block."""

    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.conv2 = CausalConv3d(cfg.z_dim, cfg.z_dim, 1)
        self.decoder = Decoder3d(cfg)
        slots = [m for m in self.modules() if isinstance(m, CausalConv3d) and m.kernel_size[0] > 1]
        for i, m in enumerate(slots):
            m.slot = i
        self.num_slots = len(slots)
        # Called before every CPU conv2d when set (each temporal tap of a 3D conv is one): the CPU
        # platform's shared cores set it (workers/lend.py, platform/cpu_lending.py).
        self.checkpoint: Callable[[], None] | None = None
        self.register_buffer("mean", torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1), persistent=False)

    def new_state(self) -> VAEState:
        return VAEState(cache=[None] * self.num_slots)

    def compile_pointwise(self, compiler=None) -> None:
        """Run every norm (+ SiLU) of the decoder through `compiler` (models/compiled.py), or
        eager with None. The convolutions, the halo exchange and the causal cache stay eager:
        their Python state (the cache slots, a group's exchanges, the CPU's channels-last conv
        kernels) is what dynamo would break on, and a norm is where a fused kernel saves passes
        over the largest activations. One compiled function serves every norm, with dynamic
        shapes, so the decoder's many sizes (each stage, a shot's first block, a batch, a band)
        compile a few graphs once rather than one each."""
        kernel = compiler.wrap(rms_norm) if compiler is not None else rms_norm
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.kernel = kernel

    def band_slots(self, shard_front: bool = False) -> list[int | None]:
        """How a height-sharded decode keeps each cache slot: None = the whole height (the
        replicated front), else the band's rows plus this many halo rows above and below (1 for
        a 3x3 conv, 0 for a temporal-only conv). What moving a band needs to know."""
        d = self.decoder
        front = {id(m) for part in (d.conv1, d.middle, *d.upsamples[: d.split]) for m in part.modules()}
        out: list[int | None] = [None] * self.num_slots
        for m in self.modules():
            if isinstance(m, CausalConv3d) and m.slot >= 0 and (shard_front or id(m) not in front):
                out[m.slot] = 1 if m.kernel_size[1] > 1 else 0
        return out

    def _prologue(self, z: torch.Tensor) -> torch.Tensor:
        w = self.conv2.weight
        z = z.to(device=w.device, dtype=torch.float32) * self.std + self.mean  # de-normalise
        z = z.to(w.dtype).contiguous(memory_format=layout(z))
        return unframes(conv2d(frames(z), w[:, :, 0], self.conv2.bias, checkpoint=self.checkpoint), z.shape[0])

    @torch.no_grad()
    def decode_sessions(
        self,
        z: torch.Tensor,
        states: list[VAEState],
        plan: DecodePlan | None = None,
        rank: int = 0,
        halo: Halo | None = None,
        shard_front: bool = False,
    ) -> torch.Tensor:
        """`decode_rows` for several sessions in one call: row i of z is a block of the session
        whose temporal cache is `states[i]`. Their caches are stacked along the batch for the
        call and handed back each its own row after, so each result equals its session decoded
        alone. All must be at the same phase of a shot (all at its first block, or none): the
        first latent frame of a shot decodes to 1 frame, later ones to 4."""
        merged = stack_states(states, z.shape[0])
        out = self.decode_rows(z, merged, plan, rank, halo, shard_front)
        unstack_states(merged, states, z.shape[2])
        return out

    def decode(self, z: torch.Tensor, state: VAEState) -> torch.Tensor:
        """z: (B, z_dim, T, h, w) normalised latents of one block -> (B, 3, T_out, 8h, 8w) in [-1, 1]."""
        return self.decode_rows(z, state)

    @torch.no_grad()
    def decode_rows(
        self,
        z: torch.Tensor,
        state: VAEState,
        plan: DecodePlan | None = None,
        rank: int = 0,
        halo: Halo | None = None,
        shard_front: bool = False,
    ) -> torch.Tensor:
        """Rank `rank`'s part of a block under `plan`: output rows [8*r0, 8*r1) of every frame,
        for its band (r0, r1) of latent rows. No plan: the whole block in one call.

        shard_front=False: the low-resolution front runs on the whole latent here (replicated on
        every shard, no communication) and the rows are cut before the first upsampler.
        shard_front=True: only the band of the latent is decoded from the start; the halo
        exchanges rows at every 3x3 conv and gathers whole frames for the middle attention.
        """
        plan = plan or DecodePlan(((0, z.shape[-2]),), z.shape[2])
        rows = plan.rows(rank)
        halo = halo or Halo()
        step = plan.frames_per_call
        outs = [
            self._decode_chunk(z[:, :, i : i + step], state, rows, halo, shard_front)
            for i in range(0, z.shape[2], step)
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _decode_chunk(
        self, z: torch.Tensor, state: VAEState, rows: tuple[int, int], halo: Halo, shard_front: bool
    ) -> torch.Tensor:
        ctx = Ctx(state, halo, self.checkpoint)
        r0, r1 = rows
        if shard_front:
            x = self.decoder.front(self._prologue(z[..., r0:r1, :]), ctx)
        else:
            x = self.decoder.front(self._prologue(z), Ctx(state, checkpoint=self.checkpoint))
            s = x.shape[-2] // z.shape[-2]
            x = x[..., r0 * s : r1 * s, :]
        x = self.decoder.back(x, ctx)
        state.latent_frames += z.shape[2]
        return x.clamp_(-1.0, 1.0)


def stack_states(states: list[VAEState], blocks: int) -> VAEState:
    """Several sessions' caches stacked along the batch, for one call on `blocks` blocks (row i
    the session of `states[i]`). All must be at the same phase of a shot: the first latent frame
    of a shot decodes to 1 frame, later ones to 4."""
    if len(states) != blocks:
        raise ValueError(f"{blocks} blocks for {len(states)} sessions")
    if len({st.latent_frames == 0 for st in states}) > 1:
        raise ValueError("sessions at a shot's first block and later ones cannot decode together")
    return VAEState(
        [None if c is None else torch.cat([st.cache[i] for st in states]) for i, c in enumerate(states[0].cache)],
        states[0].latent_frames,
    )


def unstack_states(merged: VAEState, states: list[VAEState], latent_frames: int) -> None:
    """Each session its own row of the stacked caches back, after a call on `latent_frames`."""
    for i, st in enumerate(states):
        st.cache = [None if c is None else c[i : i + 1] for c in merged.cache]
        st.latent_frames += latent_frames


def decoder_stages(vae: WanVAEDecoder) -> list:
    """The decoder as a sequence of stages a decode can be cut between: the prologue with conv1
    and the middle (stage 0), each upsampler module, the head (last). Each stage touches only
    its own cache slots, so two processes can each run a range of stages of the same sessions
    with their own `VAEState`s (a stage-cut layout; tools/bench/vae_cut.py)."""
    d = vae.decoder

    def first(x, ctx):
        x = d.conv1(vae._prologue(x), ctx)
        for m in d.middle:
            x = m(x, ctx)
        return x

    def head(x, ctx):
        return d.head[2](d.head[0](x, silu=True), ctx)

    return [first, *d.upsamples, head]


@torch.no_grad()
def decode_stages(
    vae: WanVAEDecoder, x: torch.Tensor, state: VAEState, lo: int, hi: int, latent_frames: int
) -> torch.Tensor:
    """Stages [lo, hi) of one block of one session: x is stage lo's input (normalised latents
    for lo = 0), the result stage hi - 1's output (frames in [-1, 1] when hi is the last).
    `latent_frames`: the block's latent frames, which the state counts. Running [0, c) and then
    [c, end) equals `decode` exactly."""
    stages = decoder_stages(vae)
    ctx = Ctx(state, checkpoint=vae.checkpoint)
    if lo > 0:  # an activation from another process: this decoder's device, dtype and layout
        x = x.to(device=vae.conv2.weight.device, dtype=vae.conv2.weight.dtype)
        x = x.contiguous(memory_format=layout(x))  # the ring holds it so already; row-major: ~8% slower stages
    for stage in stages[lo:hi]:
        x = stage(x, ctx)
    state.latent_frames += latent_frames
    return x.clamp_(-1.0, 1.0) if hi == len(stages) else x


def decode_stages_sessions(
    vae: WanVAEDecoder, x: torch.Tensor, states: list[VAEState], lo: int, hi: int, latent_frames: int
) -> torch.Tensor:
    """`decode_stages` for several sessions in one call: row i of x is a block of the session
    whose stage caches are `states[i]`; each result equals its session's alone (to the
    batched kernels' summation order)."""
    merged = stack_states(states, x.shape[0])
    out = decode_stages(vae, x, merged, lo, hi, latent_frames)
    unstack_states(merged, states, latent_frames)
    return out


def decode_clip(vae: WanVAEDecoder, z: torch.Tensor, state: VAEState | None = None) -> torch.Tensor:
    """A clip from the start of a shot (or, given `state`, its next chunk), with autograd and no
    clamp: what training the embedded default's decoder backpropagates through
    (tools/train/default.py). The same modules and kernels as `decode_rows`, so the trained weights
    mean the same at inference."""
    ctx = Ctx(state or vae.new_state())
    out = vae.decoder.back(vae.decoder.front(vae._prologue(z), ctx), ctx)
    ctx.state.latent_frames += z.shape[2]
    return out


def to_uint8_frames(x: torch.Tensor) -> torch.Tensor:
    """(1, 3, T, H, W) in [-1, 1] -> (T, H, W, 3) uint8 on the CPU."""
    return ((x[0].float() + 1.0) * 127.5).round_().clamp_(0, 255).to(torch.uint8).permute(1, 2, 3, 0).cpu()
