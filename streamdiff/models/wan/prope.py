"""PRoPE, projective positional encoding of the camera (minWM's second attention path).

minWM (shengshu-ai/minWM, Wan21/wan/modules/prope.py and causal_model.py) gives each latent frame
a camera: w2c (4x4, OpenCV) and intrinsics K. With K' = diag(fx, fy, 1) (the principal point
zeroed) and P = lift(K') w2c, each self-attention block runs a second attention beside its RoPE
one, over the same normalised q, k, v before RoPE, each head's 128 channels taken as 32 blocks of
4 that the token's frame's matrix transforms:

    q' = P^T q,   k' = P^-1 k,   v' = P^-1 v,   o' = softmax(q' k'^T / sqrt(d)) v',   out = P o'

and adds `prope_o(out)` (a zero-initialised Linear) to the block's attention output. Scores then
depend only on P_t P_s^-1, the cameras relative to each other. Its keys and values are cached
beside the RoPE ones with the same window (`KVCache`, `prope=True`).

Written here from that description (tests/models/test_prope.py holds it to a transcription of it,
token by token); the matrices are computed in the model's dtype, as the authors pass their
cameras (bfloat16 on an accelerator).
"""

from __future__ import annotations

import torch


def projections(camera: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """camera: (..., 20) rows of w2c (16, row-major) and fx, fy, cx, cy -> (..., 3, 4, 4): P^T,
    P^-1 and P per frame, in `dtype`."""
    w2c = camera[..., :16].unflatten(-1, (4, 4)).to(dtype)
    fx, fy = camera[..., 16].to(dtype), camera[..., 17].to(dtype)
    one = torch.ones_like(fx)
    k = torch.diag_embed(torch.stack([fx, fy, one, one], -1))  # lift(K'), principal point zeroed
    k_inv = torch.diag_embed(torch.stack([1 / fx, 1 / fy, one, one], -1))
    r_inv = w2c[..., :3, :3].transpose(-1, -2)
    w2c_inv = torch.zeros_like(w2c)
    w2c_inv[..., :3, :3] = r_inv
    w2c_inv[..., :3, 3] = -(r_inv @ w2c[..., :3, 3:]).squeeze(-1)
    w2c_inv[..., 3, 3] = 1
    p = k @ w2c
    return torch.stack([p.transpose(-1, -2), w2c_inv @ k_inv, p], dim=-3)


def transform(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x: (S, L, heads, d) with L = f frames of equal token counts, frame-major; m: (S, f, 4, 4),
    a matrix per frame -> each token's channels, as d/4 vectors of 4, times its frame's matrix."""
    s, n, h, d = x.shape
    f = m.shape[1]
    xv = x.view(s, f, n // f, h, d // 4, 4)
    return torch.einsum("sfij,sfnhkj->sfnhki", m.to(x.dtype), xv).reshape(x.shape)
