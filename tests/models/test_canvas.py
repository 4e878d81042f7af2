"""The position canvas (models/wan/canvas.py, SamplerConfig.canvas): a latent frame that gives a
Wan DiT each token's place, committed at every cut as the shot's sink, exactly as the trained
default learnt it (train/dit.py commits it the same way; issue 36)."""

from __future__ import annotations

import pytest
import torch

from streamdiff.models.engines import DiTEngine
from streamdiff.models.spec import ModelSpec
from streamdiff.models.wan.canvas import position_canvas
from streamdiff.models.wan.sampler import SamplerConfig, denoise_block

CANVAS = {"canvas": True, "sink_frames": 1, "window_frames": 13}


def test_the_canvas_gives_every_latent_pixel_its_own_place():
    c = position_canvas(16, 18, 32)
    assert c.shape == (1, 16, 1, 18, 32) and c.abs().max() <= 1.0
    per_pixel = c[0, :, 0].flatten(1).T  # (h * w, 16)
    assert len(torch.unique(per_pixel, dim=0)) == 18 * 32
    assert (c[0, 1, 0, 0].diff() < 0).all() and (c[0, 3, 0, :, 0].diff() < 0).all()  # cos(pi x), cos(pi y) fall
    assert torch.allclose(c[0, 0, 0, 0], c[0, 0, 0, 5])  # sin(pi x) does not depend on the row
    with pytest.raises(ValueError, match="multiple of 4"):
        position_canvas(6, 4, 4)


@torch.no_grad()
def test_the_engine_commits_the_canvas_at_every_cut_and_keeps_it_as_the_sink():
    eng = DiTEngine(ModelSpec(preset="tiny-random", sampler=CANVAS))
    assert eng.cache_frames(6) == eng.least_cache_frames == 13  # the canvas is no planned block
    prompt = "a red ball moving left on a white background"
    sess = eng.open_session(64, 48, seed=7)
    eng.set_scene(sess, prompt, new_shot=True)
    assert sess.state.next_frame == 1  # the canvas at position 0, the first block from 1
    got = eng.generate_block(sess, 3)

    # the same block by hand: the canvas committed under the prompt at t = 0, then the sampler
    model, (h, w), c = eng.model, sess.latent_hw, eng.model.cfg.in_channels
    st = model.new_state(h, w, 13, 1)
    model.set_prompt(st, eng.encode_prompt(prompt))
    model.forward_block(position_canvas(c, h, w), torch.zeros(1, 1), st, True)
    g = torch.Generator().manual_seed(7)
    ts = eng.steps_of(sess)
    noise = torch.randn((1, 3, c, h, w), generator=g).permute(0, 2, 1, 3, 4)
    renoise = [torch.randn((3, c, h, w), generator=g)[None].permute(0, 2, 1, 3, 4) for _ in ts[1:]]
    want = denoise_block(model, st, noise, ts, renoise, 0.0, eng._sigmas_of(ts, eng.preset.sampler.shift))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    for _ in range(4):  # past the window: 1 + 15 frames in a 13-frame cache
        eng.generate_block(sess, 3)
    assert torch.equal(sess.state.kv.latents_at(range(0, 1))[:, :, :1], position_canvas(c, h, w))
    eng.set_scene(sess, prompt, new_shot=True)
    assert sess.state.next_frame == 1  # a cut starts from the canvas again


@torch.no_grad()
def test_an_image_starts_the_shot_after_the_canvas():
    """Image-to-video on a canvas model: the canvas keeps position 0, the picture's latent is
    committed at 1 as the shot's first frame, and the first denoised block follows at 2."""
    eng = DiTEngine(ModelSpec(preset="tiny-random", sampler=CANVAS))
    sess = eng.open_session(64, 48, seed=7)
    eng.set_scene(sess, "a red ball moving left on a white background", new_shot=True)
    image = torch.randint(0, 256, (48, 64, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    z = eng.start_image(sess, image)
    assert sess.state.next_frame == 2
    c, (h, w) = eng.model.cfg.in_channels, sess.latent_hw
    held = sess.state.kv.latents_at(range(0, 2))
    assert torch.equal(held[:, :, :1], position_canvas(c, h, w))
    torch.testing.assert_close(held[:, :, 1:2], z.to(held.dtype))
    with pytest.raises(ValueError, match="first block"):
        eng.start_image(sess, image)
    assert eng.generate_block(sess, 3).shape == (1, c, 3, h, w)


def test_the_canvas_needs_a_sink_and_the_block_sampler():
    for bad in ({"sink_frames": 0}, {"kind": "rolling"}, {"kv_recompute": True}):
        with pytest.raises(ValueError, match="canvas"):
            SamplerConfig(**{**CANVAS, **bad}).validate()
    SamplerConfig(**CANVAS).validate()
