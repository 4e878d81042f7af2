"""Matrix-Game 2.0's action modules (models/wan/action.py) against a transcription of their
description (../shared/notes/world-models.md, "Action modules"), token by token and frame by
frame, through three blocks whose window of two blocks evicts the first: fp32, 1e-5, small dims
(the release's head width of 64, as its RoPE table requires)."""

from __future__ import annotations

import math

import pytest
import torch

from streamdiff.models.wan.action import ActionConfig, ActionModule, block_actions
from streamdiff.models.wan.dit import DiTConfig
from streamdiff.models.wan.kv_cache import KVCache

DIM, K, F_BLOCK, TPF = 48, 4, 3, 4


def rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # no weight: the release never applies it


def rope(x, pos, theta=256.0, n=8):
    """The first n channels of each head rotated in adjacent pairs by the frame index."""
    out = x.clone()
    for i in range(n // 2):
        ang = pos / theta ** (2 * i / n)
        a, b = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., 2 * i], out[..., 2 * i + 1] = (
            a * math.cos(ang) - b * math.sin(ang),
            a * math.sin(ang) + b * math.cos(ang),
        )
    return out


def pixel_actions(hist, j):
    """Latent frame j's 12 pixel actions: pixels [4j - 12, 4j), pixel p < 0 being pixel 0's;
    pixel p is latent ceil(p / 4)'s."""
    return [hist[0 if p <= 0 else math.ceil(p / 4)] for p in range(4 * j - 12, 4 * j)]


class Transcription:
    def __init__(self, m: ActionModule, window: int) -> None:
        self.m, self.window, self.mk, self.mv, self.kk, self.kv = m, window, {}, {}, {}, {}

    def __call__(self, x, start, hist):
        m, c = self.m, self.m.cfg
        h = x[0].view(F_BLOCK, TPF, DIM)
        out = h.clone()
        frames = range(start, start + F_BLOCK)
        seen = [j for j in range(start + F_BLOCK) if j >= start + F_BLOCK - self.window]
        q = {}
        for jj, j in enumerate(frames):  # mouse: keys of every token of the block's frames
            acts = torch.tensor([a[1] for a in pixel_actions(hist, j)]).flatten()
            for t in range(TPF):
                y = m.mouse_mlp(torch.cat([h[jj, t], acts]))
                qq, kk, vv = m.t_qkv(y).view(3, c.heads, -1)
                q[j, t] = rope(rms(qq), j)
                self.mk[j, t], self.mv[j, t] = rope(rms(kk), j), vv
        for jj, j in enumerate(frames):
            for t in range(TPF):
                ks = torch.stack([self.mk[s, t] for s in seen])  # (frames, H, D)
                vs = torch.stack([self.mv[s, t] for s in seen])
                w = torch.softmax(torch.einsum("hd,shd->hs", q[j, t], ks) / ks.shape[-1] ** 0.5, -1)
                out[jj, t] = out[jj, t] + m.proj_mouse(torch.einsum("hs,shd->hd", w, vs).flatten())
        for j in frames:  # keyboard: one key/value token a frame
            e = torch.cat([m.keyboard_embed(torch.tensor(a[0])) for a in pixel_actions(hist, j)])
            kk, vv = m.keyboard_attn_kv(e).view(2, c.heads, -1)
            self.kk[j], self.kv[j] = rope(rms(kk), j), vv
        final = out.clone()
        for jj, j in enumerate(frames):
            for t in range(TPF):
                qq = rope(rms(m.mouse_attn_q(out[jj, t]).view(c.heads, -1)), j)
                ks, vs = torch.stack([self.kk[s] for s in seen]), torch.stack([self.kv[s] for s in seen])
                w = torch.softmax(torch.einsum("hd,shd->hs", qq, ks) / ks.shape[-1] ** 0.5, -1)
                final[jj, t] = out[jj, t] + m.proj_keyboard(torch.einsum("hs,shd->hd", w, vs).flatten())
        return final.view(1, F_BLOCK * TPF, DIM)


@pytest.mark.parametrize("window_blocks", [3, 2])
def test_action_module_equals_the_transcription_through_the_cache(window_blocks):
    torch.manual_seed(0)
    cfg = ActionConfig(keyboard_dim=K, mouse=True, blocks=(0,), hidden_size=16, heads=2,
                       keyboard_hidden_dim=128, mouse_hidden_dim=128)  # fmt: skip
    m = ActionModule(cfg, DIM).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    window = window_blocks * F_BLOCK
    cache = KVCache(DiTConfig(dim=DIM, num_heads=1, num_layers=1, action=cfg), 1, TPF, window, 0,
                    torch.device("cpu"), torch.float32)  # fmt: skip
    ref = Transcription(m, window)
    g = torch.Generator().manual_seed(1)
    hist = []
    for b in range(3):
        start = b * F_BLOCK
        hist += [((torch.rand(K, generator=g) > 0.5).float().tolist(), (torch.randn(2, generator=g) * 0.1).tolist())
                 for _ in range(F_BLOCK)]  # fmt: skip
        x = torch.randn(1, F_BLOCK * TPF, DIM, generator=g)
        with torch.no_grad():
            cache.make_room(F_BLOCK)
            got = m(x, F_BLOCK, cache, 0, start, block_actions(cfg, hist, start, F_BLOCK, "cpu"))
            cache.frames += F_BLOCK
            want = ref(x, start, hist)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (got - x).abs().max() > 0.1  # the actions move it


def test_a_model_without_mouse_has_no_mouse_path():
    cfg = ActionConfig(keyboard_dim=7, mouse=False)
    m = ActionModule(cfg, 64)
    assert not hasattr(m, "mouse_mlp") and m.keyboard_embed[0].in_features == 7
    acts = block_actions(cfg, [([0.0] * 7, [0.0, 0.0])] * 4, 1, 3, "cpu")
    assert acts.mouse is None and tuple(acts.keyboard.shape) == (1, 3, 12, 7)
