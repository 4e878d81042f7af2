"""The Wan VAE encoder (2.1's, and 2.2's residual one) for one image (runs in the DiT worker
process of an image-to-video preset).

Image-to-video (Causal Forcing's frame-wise checkpoint, `inference.py --i2v`) encodes the input
picture into the shot's first latent frame. That is the Wan VAE's first causal chunk: one frame,
whose every temporal 3x3x3 conv sees two zero frames in front and whose temporal downsamplers
(`time_conv`, stride 2) are skipped, exactly as the first frame of a video is encoded. So one
image needs no temporal cache across calls: a fresh `VAEState` per call, the decoder's own
building blocks (same parameter names), and the latent distribution's mean, normalised with
latents_mean/std as the DiT expects it (the decoder's `_prologue` undoes the same).

Parameter names follow the original release (`encoder.conv1`, `encoder.downsamples.N`,
`encoder.middle.N`, `encoder.head.N`, `conv1` = quant conv), so `Wan2.1_VAE.pth` loads directly;
diffusers' `AutoencoderKLWan` maps onto it with `encoder_state_dict`. The temporal downsamplers'
weights are loaded with the rest (a file that lacks them is not a Wan VAE) but never run.

Wan 2.2's encoder takes the picture in 2x2 patches (12 channels) and adds each stage's
AvgDown3D shortcut; for one frame the shortcut's temporal pair is a zero frame and the frame,
as the release's first chunk.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .loading import _RES_DIFFUSERS, strip_prefixes
from .vae import VAEConfig
from .vae_blocks import AttentionBlock, AvgDown3D, CausalConv3d, ChannelRMSNorm, Ctx, ResBlock, VAEState, patchify


class Downsample(nn.Module):
    """Encoder downsampling: zero-pad right/bottom, 3x3 stride-2 conv per frame; `time_conv`
    halves the frames after a video's first chunk: the release keeps the first chunk's frames
    whole and caches them; each later chunk passes with the last frame before it, stride 2."""

    def __init__(self, dim: int, temporal: bool) -> None:
        super().__init__()
        self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=(2, 2)))
        self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), padding=0) if temporal else None
        if self.time_conv is not None:
            self.time_conv.stride = (2, 1, 1)

    def forward(self, x: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        b, c, t, h, w = x.shape
        y = self.resample(x.transpose(1, 2).reshape(b * t, c, h, w))  # (B*T, C, h/2, w/2)
        y = y.reshape(b, t, c, *y.shape[-2:]).transpose(1, 2)
        conv = self.time_conv
        if conv is None:
            return y
        prev = ctx.state.cache[conv.slot]
        ctx.state.cache[conv.slot] = y[:, :, -1:].clone()
        if prev is not None:
            return F.conv3d(torch.cat([prev, y], 2), conv.weight, conv.bias, stride=(2, 1, 1))
        if t == 1:  # a shot's first chunk: its first frame, alone
            return y
        # a shot's first chunk of 1 + 2k frames at once (training's whole clips): the first
        # frame alone, then each later pair with the frame before it, as chunk by chunk
        return torch.cat([y[:, :, :1], F.conv3d(y, conv.weight, conv.bias, stride=(2, 1, 1))], 2)


class ResidualDownStage(nn.Module):
    """A Wan 2.2 encoder stage: residual blocks, a Downsample (all but the last stage), and the
    AvgDown3D shortcut of the stage's input added (`downsamples.N` as the release names them)."""

    def __init__(self, cin: int, cout: int, blocks: int, temporal: bool, down: bool) -> None:
        super().__init__()
        self.avg_shortcut = AvgDown3D(cin, cout, 2 if temporal else 1, 2 if down else 1)
        mods: list[nn.Module] = []
        for _ in range(blocks):
            mods.append(ResBlock(cin, cout))
            cin = cout
        if down:
            mods.append(Downsample(cout, temporal))
        self.downsamples = nn.Sequential(*mods)

    def forward(self, x: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        short = self.avg_shortcut(x)
        for m in self.downsamples:
            x = m(x, ctx)
        return x + short


class Encoder3d(nn.Module):
    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        # The blocks widen the channels before each downsampler: at least one a stage (the
        # embedded default's decoder has none of its own beyond the one every stage adds).
        blocks = max(1, cfg.num_res_blocks)
        dims = [cfg.base_dim * u for u in (1, *cfg.dim_mult)]
        self.conv1 = CausalConv3d(cfg.rgb_channels, dims[0], 3, padding=1)
        downs: list[nn.Module] = []
        last = len(cfg.dim_mult) - 1
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            if cfg.residual:
                down = i != last
                downs.append(ResidualDownStage(cin, cout, blocks, down and cfg.temporal_downsample[i], down))
                continue
            for _ in range(blocks):
                downs.append(ResBlock(cin, cout))
                cin = cout
            if i != len(cfg.dim_mult) - 1:
                downs.append(Downsample(cout, temporal=cfg.temporal_downsample[i]))
        self.downsamples = nn.Sequential(*downs)
        d = dims[-1]
        self.middle = nn.Sequential(ResBlock(d, d), AttentionBlock(d), ResBlock(d, d))
        # mean and log-variance: the quant conv splits them
        self.head = nn.Sequential(
            ChannelRMSNorm(d, images=False), nn.SiLU(), CausalConv3d(d, cfg.z_dim * 2, 3, padding=1)
        )

    def forward(self, x: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        x = self.conv1(x, ctx)
        for m in (*self.downsamples, *self.middle):
            x = m(x, ctx)
        return self.head[2](self.head[0](x, silu=True), ctx)


class WanVAEEncoder(nn.Module):
    """`encoder` + `conv1` (quant conv, 1x1x1). `encode_image`: pixels in [-1, 1] -> the
    normalised latent frame the DiT generates in."""

    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder3d(cfg)
        self.conv1 = CausalConv3d(cfg.z_dim * 2, cfg.z_dim * 2, 1)
        slots = [m for m in self.modules() if isinstance(m, CausalConv3d) and m.kernel_size[0] > 1]
        for i, m in enumerate(slots):
            m.slot = i
        self.num_slots = len(slots)
        self.register_buffer("mean", torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1), persistent=False)

    def new_state(self) -> VAEState:
        """A video's causal cache for `encode_chunk`."""
        return VAEState(cache=[None] * self.num_slots)

    def forward(self, x: torch.Tensor, state: VAEState | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw mean and log-variance, autograd on (training the embedded default,
        streamdiff/train/vae.py): (B, 3, T, H, W) in [-1, 1] -> (B, z_dim, T', H/8, W/8). A
        shot's first chunk is 1 + 4k frames (with a fresh `state`, or none: a whole clip), each
        later one 4k frames with the state the chunk before left. Wan 2.1's VAE."""
        state = self.new_state() if state is None else state
        first, tf = state.latent_frames == 0, self.cfg.temporal_factor
        if x.dim() != 5 or x.shape[1] != 3 or x.shape[2] < 1 or (x.shape[2] - first) % tf:
            shape = "1 + 4k" if first else "4k"
            raise ValueError(f"a chunk of {shape} RGB frames (B, 3, T, H, W), got {tuple(x.shape)}")
        if self.cfg.residual and not (first and x.shape[2] == 1):
            raise ValueError("the Wan 2.2 encoder is built for single images here")
        w = self.conv1.weight
        h = self.encoder(x.to(device=w.device, dtype=w.dtype), Ctx(state))
        state.latent_frames += h.shape[2]
        mu, logvar = F.conv3d(h, w, self.conv1.bias).chunk(2, dim=1)
        return mu, logvar.clamp(-30.0, 20.0)

    @torch.no_grad()
    def encode_chunk(self, x: torch.Tensor, state: VAEState) -> torch.Tensor:
        """A video encoded as it comes, as the release's `encode` runs it: the first frame alone,
        then chunks of 4 frames, each with the causal cache of what came before. (B, 3, 1 or 4,
        H, W) in [-1, 1] -> (B, z_dim, 1, H/8, W/8) float32, normalised. Wan 2.1's VAE (the 2.2
        one's shortcuts take a single image only)."""
        first = state.latent_frames == 0
        want = 1 if first else self.cfg.temporal_factor
        if x.dim() != 5 or x.shape[1] != 3 or x.shape[2] != want:
            raise ValueError(f"a chunk of {want} RGB frames (B, 3, {want}, H, W), got {tuple(x.shape)}")
        mu = self(x, state)[0].float()
        return (mu - self.mean.float()) / self.std.float()

    @torch.no_grad()
    def encode_image(self, image: torch.Tensor) -> torch.Tensor:
        """(B, 3, 1, H, W) in [-1, 1], H and W multiples of the spatial factor f -> (B, z_dim, 1,
        H/f, W/f) float32: (mu - latents_mean) / latents_std, as the authors' `encode_to_latent`."""
        f = self.cfg.spatial_factor
        if image.dim() != 5 or image.shape[1] != 3 or image.shape[2] != 1:
            raise ValueError(f"encode_image takes one RGB frame (B, 3, 1, H, W), got {tuple(image.shape)}")
        if image.shape[-2] % f or image.shape[-1] % f:
            raise ValueError(f"image size {image.shape[-1]}x{image.shape[-2]} must be a multiple of {f}")
        w = self.conv1.weight
        x = patchify(image.to(device=w.device, dtype=w.dtype), self.cfg.patch_size)
        ctx = Ctx(VAEState(cache=[None] * self.num_slots))  # a fresh shot: zeros before the frame
        h = self.encoder(x, ctx)
        mu = F.conv3d(h, w, self.conv1.bias)[:, : self.cfg.z_dim].float()
        return (mu - self.mean.float()) / self.std.float()


def encoder_key_from_diffusers(key: str, cfg: VAEConfig) -> str | None:
    """diffusers AutoencoderKLWan key -> original key of the encoder half; None for the decoder's."""
    if key.startswith("quant_conv."):
        return key.replace("quant_conv.", "conv1.", 1)
    if not key.startswith("encoder."):
        return None
    k = key.replace("encoder.conv_in.", "encoder.conv1.", 1)
    k = k.replace("encoder.norm_out.", "encoder.head.0.", 1).replace("encoder.conv_out.", "encoder.head.2.", 1)
    k = k.replace("encoder.mid_block.attentions.0.", "encoder.middle.1.", 1)
    m = re.match(r"^encoder\.mid_block\.resnets\.(\d)\.(\w+)\.(.*)$", k)
    if m:
        k = f"encoder.middle.{2 * int(m[1])}.{_RES_DIFFUSERS[m[2]]}.{m[3]}"
    m = re.match(r"^encoder\.down_blocks\.(\d+)\.(norm1|conv1|norm2|conv2|conv_shortcut)\.(.*)$", k)
    if m:  # diffusers keeps the original's flat list of blocks: same indices
        k = f"encoder.downsamples.{m[1]}.{_RES_DIFFUSERS[m[2]]}.{m[3]}"
    m = re.match(r"^encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(\w+)\.(.*)$", k)
    if m:  # Wan 2.2: one module per stage, its blocks then its downsampler
        k = f"encoder.downsamples.{m[1]}.downsamples.{m[2]}.{_RES_DIFFUSERS[m[3]]}.{m[4]}"
    m = re.match(r"^encoder\.down_blocks\.(\d+)\.downsampler\.(.*)$", k)
    if m:
        k = f"encoder.downsamples.{m[1]}.downsamples.{cfg.num_res_blocks}.{m[2]}"
    return k.replace("encoder.down_blocks.", "encoder.downsamples.", 1)


def encoder_state_dict(sd: Mapping[str, torch.Tensor], cfg: VAEConfig) -> dict[str, torch.Tensor]:
    """Any accepted VAE layout (original `Wan2.1_VAE.pth`, diffusers) -> the encoder half's
    original keys (`encoder.*`, `conv1.*`); the decoder half is left out."""
    sd = strip_prefixes(sd)
    diffusers = any(k.startswith(("quant_conv.", "encoder.down_blocks.", "encoder.conv_in.")) for k in sd)
    out = {}
    for k, v in sd.items():
        k = encoder_key_from_diffusers(k, cfg) if diffusers else (k if k.startswith(("encoder.", "conv1.")) else None)
        if k is not None:
            out[k] = v
    return out
