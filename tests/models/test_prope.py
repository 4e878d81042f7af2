"""minWM's camera path (models/wan/prope.py) against a transcription of its description
(../shared/notes/world-models.md, minWM's PRoPE): per token t of frame camera P_t = lift(K') w2c_t,
q' = P_t^T q, k' = P_t^-1 k, v' = P_t^-1 v on each head's channels as blocks of 4 (before RoPE),
softmax(q' k'^T / sqrt(d)) v' over the cached window, out = P_t o', added through `prope_o` to the
RoPE path's output. The transcription builds each token's block-diagonal matrix and inverts P
with a general inverse; ours does neither. fp32, 1e-5, small dims, through the KV cache's ring."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from streamdiff.controls import Entry, camera_row, move
from streamdiff.models.wan import prope
from streamdiff.models.wan.dit import DiTConfig, WanDiT, _mod, apply_rope, block_rest

CFG = DiTConfig(dim=48, ffn_dim=64, freq_dim=32, num_heads=2, num_layers=2, text_dim=32, text_len=8, prope=True)
H, W, F_BLOCK = 4, 6, 2  # latent 4x6: 2x3 = 6 tokens a frame


def cameras(frames: int, seed: int) -> torch.Tensor:
    """(frames, 20) rows from a walk of held keys and mouse turns, with focal lengths not 0.5."""
    rng = np.random.default_rng(seed)
    keys = ["w", "s", "a", "d", "u", "dn", "j", "l", "i", "k"]
    c2w, rows = np.eye(4), []
    for _ in range(frames):
        rows.append(camera_row(np.linalg.inv(c2w), (0.6, 0.8, 0.5, 0.5)))
        held = frozenset(rng.choice(keys, size=2, replace=False).tolist())
        c2w = move(c2w, Entry(held, tuple(rng.uniform(-3, 3, 2).tolist())))
    return torch.tensor(rows)


def model() -> WanDiT:
    torch.manual_seed(0)
    m = WanDiT(CFG).eval()
    with torch.no_grad():
        for blk in m.blocks:  # zero-initialised by minWM: give the path weight
            blk.self_attn.prope_o.weight.normal_(0, 0.2)
            blk.self_attn.prope_o.bias.normal_(0, 0.2)
    return m


def big_p(cam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per frame: P and P^-1 by the definition (a general inverse)."""
    w2c = cam[:, :16].view(-1, 4, 4).double()
    k = torch.zeros(len(cam), 4, 4, dtype=torch.float64)
    k[:, 0, 0], k[:, 1, 1], k[:, 2, 2], k[:, 3, 3] = cam[:, 16].double(), cam[:, 17].double(), 1, 1
    p = k @ w2c
    return p, torch.linalg.inv(p)


def per_token(x: torch.Tensor, mats: torch.Tensor, tpf: int) -> torch.Tensor:
    """x: (L, heads, d); mats: (frames, 4, 4): each token times kron(I_{d/4}, its frame's matrix)."""
    n, h, d = x.shape
    out = torch.empty_like(x, dtype=torch.float64)
    for t in range(n):
        big = torch.block_diag(*[mats[t // tpf]] * (d // 4))
        for j in range(h):
            out[t, j] = big @ x[t, j].double()
    return out


def reference_layer(m: WanDiT, layer: int, x: torch.Tensor, e6: torch.Tensor, f: int, hist: dict, ctx):
    """One block's output by the transcription, with `hist` holding the window's earlier tokens
    (q-free: RoPE'd keys, values, PRoPE keys, values, in shot order) and their cameras."""
    blk = m.blocks[layer]
    att = blk.self_attn
    tpf = (H // 2) * (W // 2)
    shift, scale = (blk.modulation.unsqueeze(1) + e6)[:, :, :2].unbind(2)
    y = _mod(blk.norm1(x), f, shift, scale)
    q0 = att.norm_q(att.q(y)).unflatten(2, (att.heads, -1))[0]
    k0 = att.norm_k(att.k(y)).unflatten(2, (att.heads, -1))[0]
    v0 = att.v(y).unflatten(2, (att.heads, -1))[0]
    cos, sin = m.rope().tables(hist["pos"], f, H // 2, W // 2)
    qr, kr = apply_rope(q0[None], cos, sin)[0], apply_rope(k0[None], cos, sin)[0]
    p, p_inv = big_p(hist["cam_block"])
    pq = per_token(q0, p.transpose(1, 2), tpf)
    pk, pv = per_token(k0, p_inv, tpf), per_token(v0, p_inv, tpf)
    keys = {name: torch.cat([hist[name][layer], new]) for name, new in (("k", kr), ("v", v0), ("pk", pk), ("pv", pv))}
    attn = F.scaled_dot_product_attention(qr.transpose(0, 1), keys["k"].transpose(0, 1), keys["v"].transpose(0, 1))
    d = q0.shape[-1]
    w = torch.softmax(torch.einsum("thd,shd->hts", pq, keys["pk"]) / d**0.5, dim=-1)
    o = torch.einsum("hts,shd->thd", w, keys["pv"])
    out = per_token(o, p, tpf).float()
    for name, new in (("k", kr), ("v", v0), ("pk", pk), ("pv", pv)):
        hist.setdefault("new_" + name, {})[layer] = new
    return block_rest(blk, x, attn.transpose(0, 1)[None], e6, f, *ctx[layer], out[None])


def test_projections_are_p_its_transpose_and_inverse():
    cam = cameras(5, 1)
    mats = prope.projections(cam, torch.float32)
    p, p_inv = big_p(cam)
    torch.testing.assert_close(mats[:, 2].double(), p, rtol=0, atol=1e-6)
    torch.testing.assert_close(mats[:, 0].double(), p.transpose(1, 2), rtol=0, atol=1e-6)
    torch.testing.assert_close(mats[:, 1].double(), p_inv, rtol=0, atol=1e-5)


@pytest.mark.parametrize("window_blocks", [3, 2])
def test_camera_path_equals_the_transcription_through_the_cache(window_blocks):
    """Three blocks of two frames through the KV cache (a window of two blocks evicts the first),
    each layer's output equal to the transcription's over the window's tokens."""
    m = model()
    state = m.new_state(H, W, window_frames=window_blocks * F_BLOCK)
    torch.manual_seed(3)
    m.set_prompt(state, torch.randn(1, CFG.text_len, CFG.text_dim))
    cams = cameras(3 * F_BLOCK, 2)
    hist = {"k": {}, "v": {}, "pk": {}, "pv": {}, "blocks": []}
    captured = {}
    for i, blk in enumerate(m.blocks):
        blk.register_forward_hook(lambda mod, args, out, i=i: captured.__setitem__(i, (args, out)))
    for b in range(3):
        x = torch.randn(1, CFG.in_channels, F_BLOCK, H, W)
        t = torch.full((1, F_BLOCK), 500.0)
        state.camera = cams[b * F_BLOCK : (b + 1) * F_BLOCK]
        hist["pos"], hist["cam_block"] = state.next_frame, state.camera
        m.forward_block(x, t, state, commit=True)
        kept = hist["blocks"][-(window_blocks - 1) :] if window_blocks > 1 else []
        for layer in range(CFG.num_layers):
            for name in ("k", "v", "pk", "pv"):
                hist[name][layer] = torch.cat([h[name][layer] for h in kept]) if kept else torch.empty(0)
            (tokens, e6, f, *_), out = captured[layer]
            ctx = [st for st in state.cross]
            ref = reference_layer(m, layer, tokens, e6, f, hist, ctx)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        hist["blocks"].append({n: dict(hist["new_" + n]) for n in ("k", "v", "pk", "pv")})


def test_zero_prope_o_is_the_model_without_the_camera_path():
    """minWM adds the path zero-initialised to the stock model: with prope_o at zero the camera
    changes nothing, and the RoPE path is the plain DiT's."""
    torch.manual_seed(0)
    plain = WanDiT(DiTConfig(**{**CFG.__dict__, "prope": False})).eval()
    cam = WanDiT(CFG).eval()
    cam.load_state_dict(plain.state_dict(), strict=False)
    ctx = torch.randn(1, CFG.text_len, CFG.text_dim)
    x, t = torch.randn(1, CFG.in_channels, F_BLOCK, H, W), torch.full((1, F_BLOCK), 700.0)
    outs = []
    for mdl in (plain, cam):
        st = mdl.new_state(H, W, 4)
        mdl.set_prompt(st, ctx)
        st.camera = cameras(F_BLOCK, 5)
        outs.append(mdl.forward_block(x, t, st, commit=False))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_a_camera_model_refuses_a_block_without_its_camera():
    m = model()
    st = m.new_state(H, W, 4)
    m.set_prompt(st, torch.randn(1, CFG.text_len, CFG.text_dim))
    with pytest.raises(ValueError, match="needs the block's camera"):
        m.forward_block(torch.randn(1, 16, F_BLOCK, H, W), torch.zeros(1, F_BLOCK), st, commit=False)
