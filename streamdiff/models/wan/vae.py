"""The Wan VAE decoder, 2.1's and 2.2's, with an explicit causal temporal cache (runs in the VAE
worker process). Its blocks are in vae_blocks.py.

Parameter names follow the original releases (`conv2`, `decoder.conv1`, `decoder.middle.N`,
`decoder.upsamples.N`, `decoder.head.N`; Wan 2.2's stages `decoder.upsamples.N.upsamples.M`), so
`Wan2.1_VAE.pth` and `Wan2.2_VAE.pth` load directly and diffusers' `AutoencoderKLWan` maps onto
them (see `loading.py`). Wan 2.2's decoder is wider (48 latent channels, 1024 at the middle),
adds a parameter-free DupUp3D shortcut around each up stage, and ends in 2x2 patches: 16x in
space, where 2.1's is 8x.

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
from dataclasses import dataclass

import torch
from torch import nn

from ..host import to_host
from .kernels import DecodePlan, conv2d, frames, layout, unframes
from .vae_blocks import (
    AttentionBlock,
    CausalConv3d,
    ChannelRMSNorm,
    Ctx,
    Halo,
    Resample,
    ResBlock,
    ResidualUpStage,
    VAEState,
    rms_norm,
    unpatchify,
)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split())


# The latents' per-channel mean and std (the DiT generates (z - mean) / std): Wan 2.1's 16, from
# the release's `WanVAE`, and Wan 2.2's 48, from its `Wan2_2_VAE` (the same in diffusers' config).
WAN21_LATENTS_MEAN = _floats(
    "-0.7571 -0.7089 -0.9113 0.1075 -0.1745 0.9653 -0.1517 1.5508 "
    "0.4134 -0.0715 0.5517 -0.3632 -0.1922 -0.9497 0.2503 -0.2921"
)
WAN21_LATENTS_STD = _floats(
    "2.8184 1.4541 2.3275 2.6558 1.2196 1.7708 2.6052 2.0743 3.2687 2.1526 2.8652 1.5579 1.6382 1.1253 2.8251 1.9160"
)
WAN22_LATENTS_MEAN = _floats(
    "-0.2289 -0.0052 -0.1323 -0.2339 -0.2799 0.0174 0.1838 0.1557 -0.1382 0.0542 0.2813 0.0891 "
    "0.1570 -0.0098 0.0375 -0.1825 -0.2246 -0.1207 -0.0698 0.5109 0.2665 -0.2108 -0.2158 0.2502 "
    "-0.2055 -0.0322 0.1109 0.1567 -0.0729 0.0899 -0.2799 -0.1230 -0.0313 -0.1649 0.0117 0.0723 "
    "-0.2839 -0.2083 -0.0520 0.3748 0.0152 0.1957 0.1433 -0.2944 0.3573 -0.0548 -0.1681 -0.0667"
)
WAN22_LATENTS_STD = _floats(
    "0.4765 1.0364 0.4514 1.1677 0.5313 0.4990 0.4818 0.5013 0.8158 1.0344 0.5894 1.0901 "
    "0.6885 0.6165 0.8454 0.4978 0.5759 0.3523 0.7135 0.6804 0.5833 1.4146 0.8986 0.5659 "
    "0.7069 0.5338 0.4889 0.4917 0.4069 0.4999 0.6866 0.4093 0.5709 0.6065 0.6415 0.4944 "
    "0.5726 1.2042 0.5458 1.6887 0.3971 1.0600 0.3943 0.5537 0.5444 0.4089 0.7468 0.7744"
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
    # Wan 2.2's VAE: a decoder of its own width (0: base_dim, Wan 2.1's one width), residual
    # stages (a DupUp3D/AvgDown3D shortcut around each, resampling that keeps the channels), and
    # RGB in 2x2 patches (12 channels at the encoder's input and the decoder's output).
    decoder_base_dim: int = 0
    residual: bool = False
    patch_size: int = 1

    @property
    def decoder_dim(self) -> int:
        return self.decoder_base_dim or self.base_dim

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.dim_mult) - 1) * self.patch_size

    @property
    def rgb_channels(self) -> int:
        """The decoder's output and the encoder's input: RGB, in patches."""
        return 3 * self.patch_size**2

    @property
    def temporal_factor(self) -> int:
        return 2 ** sum(self.temporal_downsample)

    def frames_out(self, latent_frames: int, first_block: bool) -> int:
        """Output frames for a block: the first latent frame of a shot yields 1, others 4."""
        return latent_frames * self.temporal_factor - (self.temporal_factor - 1 if first_block else 0)


class Decoder3d(nn.Module):
    """conv1, the middle (residual block, attention, residual block), the up stages, the head.
    Wan 2.1's up stages are one flat list (residual blocks, a Resample after each stage but the
    last); Wan 2.2's are one `ResidualUpStage` each."""

    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        dims = [cfg.decoder_dim * u for u in (cfg.dim_mult[-1], *cfg.dim_mult[::-1])]
        temporal_up = cfg.temporal_downsample[::-1]
        last = len(cfg.dim_mult) - 1
        self.patch = cfg.patch_size
        self.conv1 = CausalConv3d(cfg.z_dim, dims[0], 3, padding=1)
        self.middle = nn.Sequential(ResBlock(dims[0], dims[0]), AttentionBlock(dims[0]), ResBlock(dims[0], dims[0]))
        ups: list[nn.Module] = []
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:], strict=False)):
            if cfg.residual:
                up = i != last
                ups.append(ResidualUpStage(cin, cout, cfg.num_res_blocks + 1, up and temporal_up[i], up))
                continue
            if i > 0:
                cin //= 2  # each Resample halves the channels
            for _ in range(cfg.num_res_blocks + 1):
                ups.append(ResBlock(cin, cout))
                cin = cout
            if i != last:
                ups.append(Resample(cout, temporal=temporal_up[i]))
        self.upsamples = nn.Sequential(*ups)
        self.head = nn.Sequential(
            ChannelRMSNorm(dims[-1], images=False), nn.SiLU(), CausalConv3d(dims[-1], cfg.rgb_channels, 3, padding=1)
        )
        # Where height sharding starts. Wan 2.1: the first upsampler (everything before it is
        # the low-resolution front: conv1, the middle with its global attention, the first
        # stage's blocks). Wan 2.2: the first stage, whose shortcut spans its upsampler.
        self.split = 0 if cfg.residual else next(i for i, m in enumerate(ups) if isinstance(m, Resample))

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
        return self.out(x, ctx)

    def out(self, x: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        """The head: norm, SiLU, the last causal conv, and Wan 2.2's patches to pixels."""
        return unpatchify(self.head[2](self.head[0](x, silu=True), ctx), self.patch)


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
            if isinstance(m, ChannelRMSNorm):
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

    return [first, *d.upsamples, d.out]


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


def uint8_frames(x: torch.Tensor) -> torch.Tensor:
    """(B, 3, T, H, W) in [-1, 1] -> (B, T, H, W, 3) uint8 on the CPU, contiguous: converted and
    laid out where `x` is (frame by frame, so float32 only a frame at a time), then one copy off
    the device for the whole batch (models/host.py). The frames' channels come interleaved from
    the device, so the ring's writes are plain copies."""
    b, _, t, h, w = x.shape
    out = torch.empty(b, t, h, w, 3, dtype=torch.uint8, device=x.device)
    for i in range(t):
        out[:, i] = ((x[:, :, i].float() + 1.0) * 127.5).round_().clamp_(0, 255).permute(0, 2, 3, 1)
    return to_host(out, torch.uint8)


def to_uint8_frames(x: torch.Tensor) -> torch.Tensor:
    """(1, 3, T, H, W) in [-1, 1] -> (T, H, W, 3) uint8 on the CPU, contiguous (`uint8_frames`)."""
    return uint8_frames(x)[0]
