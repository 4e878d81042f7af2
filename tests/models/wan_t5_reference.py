"""A small umT5 encoder built the way Wan 2.1 builds its text encoder (wan/modules/t5.py:
`T5Encoder` with `shared_pos=False`, as `umt5_xxl` does), written here from that module's
structure and math. Its state dict therefore has Wan's own key names — the fixture for the
original-layout loader comes from the module tree, not from the loader's key table — and its
forward pass is the numerical reference for the transformers model the loader fills."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class T5LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps))


class T5Attention(nn.Module):
    def __init__(self, dim: int, dim_attn: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(dim, dim_attn, bias=False) for _ in range(3))
        self.o = nn.Linear(dim_attn, dim, bias=False)

    def forward(self, x, mask, bias):
        b, n = x.shape[0], self.heads
        q, k, v = (p(x).view(b, x.shape[1], n, -1) for p in (self.q, self.k, self.v))
        scores = torch.einsum("binc,bjnc->bnij", q, k) + bias  # T5: no 1/sqrt(d) scaling
        scores = scores.masked_fill(mask.view(b, 1, 1, -1) == 0, torch.finfo(x.dtype).min)
        y = torch.einsum("bnij,bjnc->binc", F.softmax(scores.float(), dim=-1).type_as(x), v)
        return self.o(y.reshape(b, x.shape[1], -1))


class T5FeedForward(nn.Module):
    def __init__(self, dim: int, dim_ffn: int) -> None:
        super().__init__()
        self.gate = nn.Sequential(nn.Linear(dim, dim_ffn, bias=False), nn.GELU(approximate="tanh"))
        self.fc1 = nn.Linear(dim, dim_ffn, bias=False)
        self.fc2 = nn.Linear(dim_ffn, dim, bias=False)

    def forward(self, x):
        return self.fc2(self.fc1(x) * self.gate(x))


class T5RelativeEmbedding(nn.Module):
    def __init__(self, num_buckets: int, heads: int, max_dist: int = 128) -> None:
        super().__init__()
        self.num_buckets, self.max_dist = num_buckets, max_dist
        self.embedding = nn.Embedding(num_buckets, heads)

    def forward(self, length: int):
        rel = torch.arange(length)[None, :] - torch.arange(length)[:, None]
        half = self.num_buckets // 2  # bidirectional: half the buckets for each sign
        bucket = (rel > 0).long() * half
        rel = rel.abs()
        exact = half // 2
        large = exact + (torch.log(rel.float() / exact) / math.log(self.max_dist / exact) * (half - exact)).long()
        bucket += torch.where(rel < exact, rel, large.clamp(max=half - 1))
        return self.embedding(bucket).permute(2, 0, 1)[None]  # (1, heads, L, L)


class T5SelfAttention(nn.Module):
    def __init__(self, dim: int, dim_attn: int, dim_ffn: int, heads: int, num_buckets: int) -> None:
        super().__init__()
        self.norm1 = T5LayerNorm(dim)
        self.attn = T5Attention(dim, dim_attn, heads)
        self.norm2 = T5LayerNorm(dim)
        self.ffn = T5FeedForward(dim, dim_ffn)
        self.pos_embedding = T5RelativeEmbedding(num_buckets, heads)  # per layer: shared_pos=False

    def forward(self, x, mask):
        x = x + self.attn(self.norm1(x), mask, self.pos_embedding(x.shape[1]))
        return x + self.ffn(self.norm2(x))


class WanT5Encoder(nn.Module):
    def __init__(self, vocab: int, dim: int, dim_attn: int, dim_ffn: int, heads: int, layers: int, buckets: int):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(T5SelfAttention(dim, dim_attn, dim_ffn, heads, buckets) for _ in range(layers))
        self.norm = T5LayerNorm(dim)

    @torch.no_grad()
    def forward(self, ids, mask):
        x = self.token_embedding(ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x)
