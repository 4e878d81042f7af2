"""The Wan 2.1 VAE encoder, for training the embedded default's decoder (tools/train/default.py).

Only the decoder ships (models/wan/vae.py); the encoder exists to give it latents to learn from,
so it is written for training, in standard torch ops: a whole clip from the start of a shot, or a
long clip chunk by chunk (`stream`: each causal conv keeps its last input frames for the next
chunk, as the decoder's cache does, so a chunk's latents equal the whole clip's).

The structure is Wan's `Encoder3d` + `conv1`: a causal 3x3x3 stem, per stage residual blocks
then a downsampler (zero pad right/bottom, 3x3 stride-2 conv; with a causal stride-2 temporal
conv where the stage downsamples time, the shot's first frame passing alone), a middle of
residual block, per-frame attention, residual block, and a head to mean and log-variance.
1 + 4k frames give 1 + k latent frames, as the decoder expects.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models.wan.vae import VAEConfig


class CausalConv3d(nn.Conv3d):
    """Pads 2 * p_t frames in front (zeros at a shot's start; in a stream, the previous chunk's
    last frames), p_h and p_w on both sides."""

    def __init__(self, cin: int, cout: int, kernel, stride=1, padding=0) -> None:
        super().__init__(cin, cout, kernel, stride=stride, padding=0)
        p = (padding,) * 3 if isinstance(padding, int) else padding
        self._pad = (p[2], p[2], p[1], p[1], 2 * p[0], 0)
        self.streaming, self.prev = False, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        front = self._pad[4]
        if not (self.streaming and front):
            return super().forward(F.pad(x, self._pad))
        prev = self.prev if self.prev is not None else x.new_zeros(*x.shape[:2], front, *x.shape[3:])
        x = torch.cat([prev, x], dim=2)
        self.prev = x[:, :, -front:]
        return super().forward(F.pad(x, self._pad[:4]))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, images: bool = False) -> None:
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, *((1, 1) if images else (1, 1, 1))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=1) * self.scale * self.gamma


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.residual = nn.Sequential(
            RMSNorm(cin),
            nn.SiLU(),
            CausalConv3d(cin, cout, 3, padding=1),
            RMSNorm(cout),
            nn.SiLU(),
            CausalConv3d(cout, cout, 3, padding=1),
        )
        self.shortcut = CausalConv3d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shortcut(x) + self.residual(x)


class Attention(nn.Module):
    """Single-head self-attention over the positions of each frame."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, images=True)
        self.to_qkv = nn.Conv2d(dim, 3 * dim, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        f = x.transpose(1, 2).reshape(b * t, c, h, w)
        q, k, v = self.to_qkv(self.norm(f)).reshape(b * t, 3 * c, h * w).transpose(1, 2).chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b * t, c, h, w)
        return x + self.proj(y).view(b, t, c, h, w).transpose(1, 2)


class Downsample(nn.Module):
    def __init__(self, dim: int, temporal: bool) -> None:
        super().__init__()
        self.resample = nn.Conv2d(dim, dim, 3, stride=2)
        self.time_conv = nn.Conv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1)) if temporal else None
        self.streaming, self.prev = False, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        f = F.pad(x.transpose(1, 2).reshape(b * t, c, h, w), (0, 1, 0, 1))
        y = self.resample(f)
        x = y.view(b, t, c, *y.shape[-2:]).transpose(1, 2)
        if self.time_conv is None:
            return x
        if self.streaming and self.prev is not None:
            # A later chunk (an even number of frames): its pairs with the frame before each.
            x = torch.cat([self.prev, x], dim=2)
            self.prev = x[:, :, -1:]
            return self.time_conv(x)
        self.prev = x[:, :, -1:]
        if t > 1:
            # The first frame alone; each later pair of frames with the frame before it.
            x = torch.cat([x[:, :, :1], self.time_conv(x)], dim=2)
        return x


class WanVAEEncoder(nn.Module):
    def __init__(self, cfg: VAEConfig, num_res_blocks: int = 1) -> None:
        super().__init__()
        dims = [cfg.base_dim * u for u in (1, *cfg.dim_mult)]
        self.conv1 = CausalConv3d(3, dims[0], 3, padding=1)
        layers: list[nn.Module] = []
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            for _ in range(num_res_blocks):
                layers.append(ResBlock(cin, cout))
                cin = cout
            if cin != cout:
                layers.append(CausalConv3d(cin, cout, 1))
            if i != len(cfg.dim_mult) - 1:
                layers.append(Downsample(cout, cfg.temporal_downsample[i]))
        self.downsamples = nn.Sequential(*layers)
        d = dims[-1]
        self.middle = nn.Sequential(ResBlock(d, d), Attention(d), ResBlock(d, d))
        self.head = nn.Sequential(RMSNorm(d), nn.SiLU(), CausalConv3d(d, 2 * cfg.z_dim, 3, padding=1))
        self.quant = CausalConv3d(2 * cfg.z_dim, 2 * cfg.z_dim, 1)

    def stream(self, on: bool = True) -> None:
        """Start (or end) encoding a clip chunk by chunk: the first chunk 1 + 4k frames, each
        later one 4k frames; every call continues where the last chunk stopped."""
        for m in self.modules():
            if hasattr(m, "streaming"):
                m.streaming, m.prev = on, None

    def detach_stream(self) -> None:
        """Cut the graph at the chunk boundary (truncated backpropagation through time)."""
        for m in self.modules():
            if getattr(m, "prev", None) is not None:
                m.prev = m.prev.detach()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 3, 1 + 4k, H, W) in [-1, 1] -> mean and log-variance, (B, z_dim, 1 + k, H/8, W/8)."""
        h = self.quant(self.head(self.middle(self.downsamples(self.conv1(x)))))
        mu, logvar = h.chunk(2, dim=1)
        return mu, logvar.clamp(-30.0, 20.0)
