"""The Wan VAE's building blocks, 2.1's and 2.2's: the causal temporal cache (`VAEState`), the
height-sharding hook (`Halo`), the causal convolution, the per-pixel RMS norm, the residual
block, the middle attention, the resampling convolutions, and the parameter-free shortcuts of
Wan 2.2's residual stages (`DupUp3D`, `AvgDown3D`). The decoder (vae.py) and the image encoder
(vae_encoder.py) are built from them; this file has no communication code (see vae.py on
sharding)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import cat_frames, conv2d, conv3d_valid_t, empty, frames, unframes

CACHE_T = 2  # frames each causal 3x3x3 conv keeps: its temporal kernel is 3

# ----------------------------------------------------------------------------- state and hooks


@dataclass
class VAEState:
    """Causal temporal cache of one session (one decoder shard): one entry per cached conv."""

    cache: list[torch.Tensor | None]
    latent_frames: int = 0  # latent frames decoded so far in this shot

    @property
    def nbytes(self) -> int:
        """What the cache holds (what admission prices: VAEMemory)."""
        return sum(c.nbytes for c in self.cache if c is not None)


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


class ChannelRMSNorm(nn.Module):
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
            ChannelRMSNorm(cin, images=False),
            nn.SiLU(),
            CausalConv3d(cin, cout, 3, padding=1),
            ChannelRMSNorm(cout, images=False),
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
        self.norm = ChannelRMSNorm(dim)
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
    in space and a 3x3 conv to `out_dim` channels (Wan 2.1 halves them, 2.2 keeps them)."""

    def __init__(self, dim: int, temporal: bool, out_dim: int | None = None) -> None:
        super().__init__()
        self.resample = nn.Sequential(
            nn.Upsample(scale_factor=2.0, mode="nearest-exact"), nn.Conv2d(dim, out_dim or dim // 2, 3, padding=1)
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
        # in the served dtype: a nearest upsample copies values (no rounding to save), and a
        # float32 round trip made three full-resolution copies of each upsampler's output
        y = F.interpolate(frames(x), scale_factor=2.0, mode="nearest-exact")
        y = with_halo(y, ctx.halo)
        conv = self.resample[1]
        return unframes(conv2d(y, conv.weight, conv.bias, (1 - ctx.halo.rows, 1), ctx.checkpoint), x.shape[0])


# ----------------------------------------------------------------------------- Wan 2.2's stages


class DupUp3D(nn.Module):
    """Wan 2.2's parameter-free upsampling shortcut: every input channel repeated, then spread
    over `factor_t` frames and a `factor_s` x `factor_s` block of pixels (depth to space, the
    channels split in the order (c, t, h, w)). A shot's first latent frame keeps only its last
    temporal copy, as the residual path does not double that frame either. Row-local: input row
    i gives output rows [factor_s * i, factor_s * (i + 1)), so a height band needs no halo."""

    def __init__(self, cin: int, cout: int, factor_t: int, factor_s: int) -> None:
        super().__init__()
        factor = factor_t * factor_s * factor_s
        if cout * factor % cin:
            raise ValueError(f"DupUp3D: {cout} x {factor} channels is not a multiple of {cin}")
        self.cout, self.factor_t, self.factor_s, self.repeats = cout, factor_t, factor_s, cout * factor // cin

    def forward(self, x: torch.Tensor, first: bool) -> torch.Tensor:
        b, _, t, h, w = x.shape
        ft, fs = self.factor_t, self.factor_s
        y = x.repeat_interleave(self.repeats, dim=1).reshape(b, self.cout, ft, fs, fs, t, h, w)
        y = y.permute(0, 1, 5, 2, 6, 3, 7, 4).reshape(b, self.cout, t * ft, h * fs, w * fs)
        return y[:, :, ft - 1 :] if first else y


class AvgDown3D(nn.Module):
    """Wan 2.2's parameter-free downsampling shortcut, DupUp3D's inverse: space (and time) to
    depth, then the mean of each group of channels. Frames short of a multiple of `factor_t`
    are zero frames in front (an image: one zero frame before it)."""

    def __init__(self, cin: int, cout: int, factor_t: int, factor_s: int) -> None:
        super().__init__()
        factor = factor_t * factor_s * factor_s
        if cin * factor % cout:
            raise ValueError(f"AvgDown3D: {cin} x {factor} channels is not a multiple of {cout}")
        self.cout, self.factor_t, self.factor_s, self.group = cout, factor_t, factor_s, cin * factor // cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ft, fs = self.factor_t, self.factor_s
        x = F.pad(x, (0, 0, 0, 0, (ft - x.shape[2] % ft) % ft, 0))
        b, c, t, h, w = x.shape
        y = x.reshape(b, c, t // ft, ft, h // fs, fs, w // fs, fs).permute(0, 1, 3, 5, 7, 2, 4, 6)
        return y.reshape(b, self.cout, self.group, t // ft, h // fs, w // fs).mean(dim=2)


class ResidualUpStage(nn.Module):
    """A Wan 2.2 decoder stage: `blocks` residual blocks, then (all but the last stage) a
    Resample that keeps the channels, plus the DupUp3D shortcut of the stage's input.
    `upsamples.N` as the release names them, the Resample last. Whether a call starts its shot
    is the state's (no latent frame decoded yet), as the Resample's `time_conv` cache says."""

    def __init__(self, cin: int, cout: int, blocks: int, temporal: bool, up: bool) -> None:
        super().__init__()
        mods: list[nn.Module] = []
        self.avg_shortcut = DupUp3D(cin, cout, 2 if temporal else 1, 2) if up else None
        for _ in range(blocks):
            mods.append(ResBlock(cin, cout))
            cin = cout
        if up:
            mods.append(Resample(cout, temporal, out_dim=cout))
        self.upsamples = nn.Sequential(*mods)

    def forward(self, x: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        # The shortcut is made from the stage's input once its blocks are done, and added in
        # place: it is as large as the stage's output, and made first it stayed alive through
        # every block of the stage (the input it is made from is a fraction of that).
        first, x0 = ctx.state.latent_frames == 0, x
        for m in self.upsamples:
            x = m(x, ctx)
        return x if self.avg_shortcut is None else x.add_(self.avg_shortcut(x0, first))


def unpatchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """Wan 2.2's 2x2 depth to space of the decoder's output: channel c * p * p + w_off * p +
    h_off goes to pixel (h_off, w_off) of colour c. Not `F.pixel_shuffle`, whose order has
    h_off before w_off. Row-local."""
    if p == 1:
        return x
    b, c, t, h, w = x.shape
    y = x.reshape(b, c // (p * p), p, p, t, h, w).permute(0, 1, 4, 5, 3, 6, 2)
    return y.reshape(b, c // (p * p), t, h * p, w * p)


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """unpatchify's inverse: the encoder's input (RGB -> 3 * p * p channels)."""
    if p == 1:
        return x
    b, c, t, h, w = x.shape
    y = x.reshape(b, c, t, h // p, p, w // p, p).permute(0, 1, 6, 4, 2, 3, 5)
    return y.reshape(b, c * p * p, t, h // p, w // p)
