"""The authors' seeding (Self-Forcing `inference.py` + `pipeline/causal_inference.py`; CausVid,
Causal Forcing and LongLive the same): `torch.manual_seed(seed)` once, the whole video's noise
drawn up front as `torch.randn([1, F, 16, h, w])` in the model dtype on the device, each block's
initial noise a slice of it, and after every step but the last `torch.randn_like` of the
flattened (B*f, 16, h, w) prediction, from the same global stream, block by block."""

from __future__ import annotations

import pytest
import torch

from streamdiff.models.engines import DiTEngine
from streamdiff.models.presets import ModelSpec
from streamdiff.models.wan.sampler import sigma_of

W, H = 64, 48  # latent 6 x 8
SEED = 11


@pytest.fixture(scope="module")
def dit():
    return DiTEngine(ModelSpec(preset="tiny-random"))


def authors_draws(seed, blocks, fpb, c, h, w, steps, dtype=torch.float32):
    """Their draws in their order and layout: [B, F, C, H, W] up front, then per block per step
    after the first one randn_like of (B*f, C, H, W)."""
    torch.manual_seed(seed)
    noise = torch.randn([1, blocks * fpb, c, h, w], dtype=dtype)
    per_block = []
    for k in range(blocks):
        first = noise[:, k * fpb : (k + 1) * fpb]
        again = [torch.randn_like(torch.empty(fpb, c, h, w, dtype=dtype)) for _ in range(steps - 1)]
        per_block.append((first, again))
    return per_block


def ours_layout(x):  # [B, f, C, H, W] -> (B, C, f, H, W)
    return x.permute(0, 2, 1, 3, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_draws_the_authors_noise_in_their_order(dit, dtype, monkeypatch):
    monkeypatch.setattr(dit, "noise_dtype", dtype)  # a bf16 model's (the authors' GPU runs) without one here
    fpb, c, (h, w) = dit.frames_per_block, dit.model.cfg.in_channels, dit.latent_size(W, H)
    blocks, steps = 3, len(dit.timesteps)
    sess = dit.open_session(W, H, 0)
    dit.set_scene(sess, "a red fox", new_shot=True, seed=SEED, shot_left=blocks)
    assert sess.seeding == "authors"
    ref = authors_draws(SEED, blocks, fpb, c, h, w, steps, dtype)
    for first, again in ref:
        got_first, got_again = dit.draw_noise(sess, fpb, steps - 1)
        assert got_first.dtype == dtype and torch.equal(got_first, ours_layout(first))
        assert len(got_again) == steps - 1
        for g, r in zip(got_again, again, strict=True):
            assert torch.equal(g, ours_layout(r.unsqueeze(0)))


def test_a_live_shot_draws_per_block_from_the_same_stream(dit):
    """Live (no length): per block, the initial noise drawn as the block starts, then its re-noise."""
    fpb, c, (h, w) = dit.frames_per_block, dit.model.cfg.in_channels, dit.latent_size(W, H)
    steps = len(dit.timesteps)
    sess = dit.open_session(W, H, SEED)
    dit.set_scene(sess, "a red fox", new_shot=True)
    assert sess.seeding == "per_block"
    torch.manual_seed(SEED)
    for _ in range(2):
        first = torch.randn([1, fpb, c, h, w])
        again = [torch.randn(fpb, c, h, w) for _ in range(steps - 1)]
        got_first, got_again = dit.draw_noise(sess, fpb, steps - 1)
        assert torch.equal(got_first, ours_layout(first))
        assert all(torch.equal(g, ours_layout(r.unsqueeze(0))) for g, r in zip(got_again, again, strict=True))


def test_the_denoised_blocks_equal_the_authors_block_loop(dit):
    """Two blocks through the engine equal a transcription of the authors' loop: per block the
    slice of the up-front noise, x0 = x - sigma v per step, add_noise with randn_like between
    steps, then the clean pass at t = context_noise, with the model's plain block forward."""
    fpb, c, (h, w) = dit.frames_per_block, dit.model.cfg.in_channels, dit.latent_size(W, H)
    ts = dit.timesteps
    sig = sigma_of(ts, dit.preset.sampler.shift)
    sess = dit.open_session(W, H, 0)
    dit.set_scene(sess, "a red fox", new_shot=True, seed=SEED, shot_left=2)
    got = [dit.generate_block(sess, fpb) for _ in range(2)]

    model, s = dit.model, dit.preset.sampler
    state = model.new_state(h, w, s.window_frames, s.sink_frames)
    model.set_prompt(state, dit.encode_prompt("a red fox"))
    torch.manual_seed(SEED)
    noise = torch.randn([1, 2 * fpb, c, h, w])  # [B, F, C, H, W]
    for k in range(2):
        x = noise[:, k * fpb : (k + 1) * fpb]
        for i, t in enumerate(ts):
            v = model.forward_block(ours_layout(x), torch.full((1, fpb), t), state, commit=False)
            pred = ours_layout(x) - sig[i] * v  # (B, C, f, H, W)
            pred = pred.permute(0, 2, 1, 3, 4)  # their layout
            if i + 1 < len(ts):
                x = (
                    (1 - sig[i + 1]) * pred.flatten(0, 1) + sig[i + 1] * torch.randn_like(pred.flatten(0, 1))
                ).unflatten(0, pred.shape[:2])
        model.forward_block(ours_layout(pred), torch.full((1, fpb), s.context_t), state, commit=True)
        assert (got[k] - ours_layout(pred)).abs().max().item() <= 1e-5


def test_batched_sessions_equal_each_alone_under_both_schemes(dit):
    fpb = dit.frames_per_block

    def open_(seed, shot):
        sess = dit.open_session(W, H, seed)
        dit.set_scene(sess, f"prompt {seed}", new_shot=True, seed=seed, shot_left=shot)
        return sess

    alone = [[dit.generate_block(s, fpb) for _ in range(2)] for s in (open_(1, 2), open_(2, 0))]
    a, b = open_(1, 2), open_(2, 0)
    together = [dit.generate_blocks([a, b], fpb) for _ in range(2)]
    for k in range(2):
        assert (together[k][0] - alone[0][k]).abs().max().item() <= 1e-5
        assert (together[k][1] - alone[1][k]).abs().max().item() <= 1e-5
