"""Matrix-Game 2.0's action modules: keyboard and mouse conditioning inside the DiT's first blocks.

Matrix-Game 2.0 (SkyworkAI/Matrix-Game, Matrix-Game-2/wan/modules/action_module.py) puts one
module in each of blocks 0-14, after the cross-attention and before the FFN, with caches of its
own that follow the self-attention's window. Each latent frame j of a block is conditioned on the
12 pixel-frame actions before it, [4j - 12, 4j) (frame 0's action before the video's start):

- mouse ([pitch, yaw] a pixel frame): the 12 actions (24 values) beside each spatial token's
  hidden state through `mouse_mlp`, then `t_qkv` to 16 heads of 64, an RMS norm without its
  weight (the release's `WanRMSNorm.forward` never applies it), a 1-D RoPE on the latent frame
  index (the first 8 of each head's 64 channels, theta 256), and attention of each spatial token
  over its own keys in the window's frames; `proj_mouse` adds the result.
- keyboard (a multi-hot a pixel frame): each action through `keyboard_embed`, the 12 of a latent
  frame concatenated into one key/value token per frame (`keyboard_attn_kv`), queried by every
  token of the frame (`mouse_attn_q`, on the state after the mouse path), the same norm and RoPE;
  `proj_keyboard` adds the result.

Written here from that description; tests/models/test_action.py holds it to a transcription of
the description, and it was checked against the authors' module locally. Parameter names are
the release's (`blocks.N.action_model.*`), the unused norm weights included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ActionConfig:
    keyboard_dim: int  # keys in the multi-hot (0: no keyboard; -1 in a config that does not say)
    mouse: bool | None  # [pitch, yaw] per pixel frame (None in a config that does not say)
    blocks: tuple[int, ...] = tuple(range(15))
    hidden_size: int = 128  # keyboard embedding
    heads: int = 16
    keyboard_hidden_dim: int = 1024
    mouse_hidden_dim: int = 1024
    windows_size: int = 3  # latent frames of actions each latent frame sees
    time_compression: int = 4  # pixel frames a latent frame
    rope_dims: tuple[int, int, int] = (8, 28, 28)  # only the first rotates: the others index a grid of 1
    rope_theta: float = 256.0

    @property
    def span(self) -> int:
        """Pixel-frame actions a latent frame is conditioned on (12)."""
        return self.time_compression * self.windows_size


class WeightlessRMSNorm(nn.Module):
    """Matrix-Game's `WanRMSNorm` as its forward runs: normalised, its weight loaded and never used."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)


def frame_rope(x: torch.Tensor, positions: torch.Tensor, cfg: ActionConfig) -> torch.Tensor:
    """x: (..., f, heads, d) with frame axis -3; positions (f,): the first rope_dims[0] channels
    rotated in adjacent pairs by the frame index, in float32, as the release does."""
    n = cfg.rope_dims[0]
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, n, 2, device=x.device)[: n // 2].float() / n)
    ang = torch.outer(positions.float(), inv)  # (f, n/2)
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]  # broadcast over heads
    xf = x.float()
    pairs = xf[..., :n].unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return torch.cat([rot, xf[..., n:]], dim=-1).type_as(x)


class ActionModule(nn.Module):
    def __init__(self, cfg: ActionConfig, dim: int) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.keyboard_dim:
            h = cfg.hidden_size
            self.keyboard_embed = nn.Sequential(nn.Linear(cfg.keyboard_dim, h), nn.SiLU(), nn.Linear(h, h))
            d = cfg.keyboard_hidden_dim // cfg.heads
            self.key_attn_q_norm, self.key_attn_k_norm = WeightlessRMSNorm(d), WeightlessRMSNorm(d)
            self.mouse_attn_q = nn.Linear(dim, cfg.keyboard_hidden_dim, bias=False)
            self.keyboard_attn_kv = nn.Linear(h * cfg.span, 2 * cfg.keyboard_hidden_dim, bias=False)
            self.proj_keyboard = nn.Linear(cfg.keyboard_hidden_dim, dim, bias=False)
        if cfg.mouse:
            c = cfg.mouse_hidden_dim
            self.mouse_mlp = nn.Sequential(
                nn.Linear(2 * cfg.span + dim, c), nn.GELU(approximate="tanh"), nn.Linear(c, c), nn.LayerNorm(c)
            )
            self.t_qkv = nn.Linear(c, 3 * c, bias=False)
            d = c // cfg.heads
            self.img_attn_q_norm, self.img_attn_k_norm = WeightlessRMSNorm(d), WeightlessRMSNorm(d)
            self.proj_mouse = nn.Linear(c, dim, bias=False)

    def forward(self, x: torch.Tensor, f: int, cache, layer: int, start: int, actions) -> torch.Tensor:
        """x: (1, f * tpf, C), one session's block; actions: its `BlockActions` (per latent frame
        of the block, the 12 pixel actions before it); `cache`: the session's KVCache, whose
        action buffers for `layer` take this block's keys and values at its frames' slots."""
        cfg = self.cfg
        s, n, c = x.shape
        tpf = n // f
        pos = torch.arange(start, start + f, device=x.device)
        if cfg.mouse:
            h = x.view(s, f, tpf, c)
            m = actions.mouse.to(x.dtype).flatten(2)  # (1, f, 24)
            y = self.mouse_mlp(torch.cat([h, m[:, :, None].expand(s, f, tpf, m.shape[-1])], dim=-1))
            q, k, v = self.t_qkv(y).unflatten(-1, (3, cfg.heads, -1)).unbind(-3)  # (1, f, tpf, H, D) each
            q, k = self.img_attn_q_norm(q).to(v), self.img_attn_k_norm(k).to(v)
            q = frame_rope(q.transpose(1, 2), pos, cfg)  # (1, tpf, f, H, D): frames on axis -3
            k = frame_rope(k.transpose(1, 2), pos, cfg).transpose(1, 2)
            mk, mv, held = cache.write_action(layer, "mouse", k, v)  # (1, frames, tpf, H, D)
            qs = q.reshape(s * tpf, f, cfg.heads, -1).transpose(1, 2)  # (tpf, H, f, D): each token alone
            ks = mk[:, :held].permute(0, 2, 3, 1, 4).reshape(s * tpf, cfg.heads, held, -1)
            vs = mv[:, :held].permute(0, 2, 3, 1, 4).reshape(s * tpf, cfg.heads, held, -1)
            o = F.scaled_dot_product_attention(qs, ks, vs)  # (tpf, H, f, D)
            o = o.transpose(1, 2).reshape(s, tpf, f, -1).transpose(1, 2).reshape(s, n, -1)
            x = x + self.proj_mouse(o)
        if cfg.keyboard_dim:
            e = self.keyboard_embed(actions.keyboard.to(x.dtype)).flatten(2)  # (1, f, 12 * 128)
            k, v = self.keyboard_attn_kv(e).unflatten(-1, (2, cfg.heads, -1)).unbind(-3)  # (1, f, H, D)
            q = self.mouse_attn_q(x).view(s, f, tpf, cfg.heads, -1)
            q, k = self.key_attn_q_norm(q).to(v), self.key_attn_k_norm(k).to(v)
            q = frame_rope(q.transpose(1, 2), pos, cfg)  # (1, tpf, f, H, D)
            k = frame_rope(k, pos, cfg)
            kk, kv, held = cache.write_action(layer, "keyboard", k, v)  # (1, frames, H, D)
            qs = q.transpose(1, 2).reshape(s, n, cfg.heads, -1).transpose(1, 2)  # (1, H, f * tpf, D)
            o = F.scaled_dot_product_attention(qs, kk[:, :held].transpose(1, 2), kv[:, :held].transpose(1, 2))
            x = x + self.proj_keyboard(o.transpose(1, 2).reshape(s, n, -1))
        return x


@dataclass
class BlockActions:
    """One block's actions as the action modules take them: per latent frame, the 12 pixel-frame
    actions before it. keyboard (1, f, 12, K) multi-hot, mouse (1, f, 12, 2); None where the
    model has no such input."""

    keyboard: torch.Tensor | None
    mouse: torch.Tensor | None


def block_actions(
    cfg: ActionConfig, history: list[tuple[list[float], list[float]]], start: int, f: int, device
) -> BlockActions:
    """The actions of latent frames [start, start + f) from `history`: a (keyboard, mouse) per
    latent frame of the shot so far, this block's included. Pixel frame p belongs to latent frame
    ceil(p / 4) (pixel 0 to latent 0); a latent frame j sees pixel frames [4j - 12, 4j), those
    before the video's start being pixel 0's, as the release pads them."""
    r = cfg.time_compression

    def latent_of(p: int) -> int:
        return 0 if p <= 0 else (p + r - 1) // r

    rows = [[history[latent_of(p)] for p in range(r * j - cfg.span, r * j)] for j in range(start, start + f)]
    kb = torch.tensor([[a[0] for a in row] for row in rows], dtype=torch.float32, device=device)[None]
    ms = torch.tensor([[a[1] for a in row] for row in rows], dtype=torch.float32, device=device)[None]
    return BlockActions(kb if cfg.keyboard_dim else None, ms if cfg.mouse else None)
