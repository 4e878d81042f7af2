"""The pipeline-facing engines on the embedded tiny preset: sessions, scenes, determinism."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from streamdiff.models.engines import DiTEngine, VAEEngine
from streamdiff.models.presets import ModelSpec, get_preset, tiny_layers, trained_dit
from streamdiff.models.wan.text import TinyTextEncoder

W, H = 64, 48


@pytest.fixture(scope="module")
def dit():
    return DiTEngine(ModelSpec())


@pytest.fixture(scope="module")
def vae():
    return VAEEngine(ModelSpec())


def run(dit, scenes, seed=5):
    """scenes: list of (prompt, cut, seed, blocks); returns the latents of every block."""
    sess = dit.open_session(W, H, seed)
    out = []
    for prompt, cut, scene_seed, blocks in scenes:
        dit.set_scene(sess, prompt, new_shot=cut, seed=scene_seed)
        out += [dit.generate_block(sess, dit.frames_per_block) for _ in range(blocks)]
    return out


def test_interleaved_sessions_equal_each_alone(dit):
    a_alone = run(dit, [("a red fox", True, None, 3)], seed=1)
    b_alone = run(dit, [("a blue whale", True, None, 3)], seed=2)
    sa, sb = dit.open_session(W, H, 1), dit.open_session(W, H, 2)
    dit.set_scene(sa, "a red fox", new_shot=True)
    dit.set_scene(sb, "a blue whale", new_shot=True)
    a, b = [], []
    for _ in range(3):
        a.append(dit.generate_block(sa, 3))
        b.append(dit.generate_block(sb, 3))
    assert all(torch.equal(x, y) for x, y in zip(a, a_alone, strict=False))
    assert all(torch.equal(x, y) for x, y in zip(b, b_alone, strict=False))


def test_cut_starts_a_fresh_shot(dit):
    """After a cut with a scene seed, the blocks equal a brand-new session with that prompt."""
    story = run(dit, [("a red fox", True, None, 2), ("a city at night", True, 77, 2)])
    fresh = run(dit, [("a city at night", True, 77, 2)], seed=999)
    assert torch.equal(story[2], fresh[0]) and torch.equal(story[3], fresh[1])


def test_continue_keeps_history(dit):
    story = run(dit, [("a red fox", True, None, 2), ("a city at night", False, 77, 2)])
    fresh = run(dit, [("a city at night", True, 77, 2)], seed=999)
    assert not torch.equal(story[2], fresh[0])


def test_same_seed_same_video_different_prompt_different_video(dit):
    a1, a2 = run(dit, [("a red fox", True, None, 2)]), run(dit, [("a red fox", True, None, 2)])
    b = run(dit, [("a red box", True, None, 2)])
    assert all(torch.equal(x, y) for x, y in zip(a1, a2, strict=False))
    assert not torch.equal(a1[1], b[1])


def test_vae_engine_frames(dit, vae):
    latents = run(dit, [("a red fox", True, None, 2)])
    state = vae.open_session()
    assert vae.frames_out(3, state) == 9
    f1 = vae.decode_block(state, latents[0])
    assert vae.frames_out(3, state) == 12
    f2 = vae.decode_block(state, latents[1])
    assert f1.shape == (9, H, W, 3) and f2.shape == (12, H, W, 3) and f1.dtype == torch.uint8
    assert f2.float().std() > 1.0  # not a constant picture


def test_tiny_text_encoder_is_deterministic_and_prompt_sensitive():
    enc1, enc2 = TinyTextEncoder(64, 32), TinyTextEncoder(64, 32)
    a, a2, b = enc1.encode(["a red fox"]), enc2.encode(["a red fox"]), enc1.encode(["a red box"])
    assert torch.equal(a, a2)
    assert (a - b).abs().max() > 0.1
    n = len(b"a red fox") + 1
    assert a[0, n:].abs().max() == 0 and a[0, :n].abs().min() >= 0  # zero after the text
    assert enc1.encode(["  a   red fox "]).equal(a)  # whitespace is cleaned like Wan's tokenizer


def test_dit_vae_ratio_sets_depth_and_bad_values_are_rejected():
    seeded = ModelSpec(preset="tiny-random")
    assert get_preset(replace(seeded, dit_vae_ratio=1.5)).dit.num_layers > get_preset(seeded).dit.num_layers
    assert get_preset(ModelSpec()).dit.num_layers == get_preset(seeded).dit.num_layers  # 0.74: trained or not
    if trained_dit("tiny") is not None:  # the trained default's depth is its weights'
        with pytest.raises(ValueError, match="tiny-random"):
            get_preset(ModelSpec(dit_vae_ratio=1.5))
    assert tiny_layers(0.01) == 1
    with pytest.raises(ValueError, match="dit_vae_ratio"):
        get_preset(ModelSpec(dit_vae_ratio=0))
    with pytest.raises(ValueError, match="unknown model preset"):
        get_preset(ModelSpec(preset="nope"))
    with pytest.raises(ValueError, match="sampler option"):
        get_preset(ModelSpec(sampler={"stepz": [1]}))
    with pytest.raises(ValueError, match="multiple of 16"):
        DiTEngine.latent_size(type("E", (), {"preset": get_preset(ModelSpec())})(), 100, 48)


def test_a_probe_engine_times_the_dit_without_loading_the_text_encoder(tmp_path):
    """The profile's probes build `DiTEngine(..., probe=True)`: a release without its
    text encoder still generates (umT5-XXL is minutes to load, and no probe times it), while the
    serving engine refuses it."""
    import shutil

    from ..published import write_base

    base = write_base(tmp_path)
    shutil.rmtree(base / "text_encoder")
    spec = ModelSpec(preset="wan2.1-t2v-1.3b", path=str(base))
    with pytest.raises(Exception, match="text_encoder|config|No such file"):
        DiTEngine(spec)
    eng = DiTEngine(spec, probe=True)
    sess = eng.open_session(64, 32, seed=1)
    eng.set_scene(sess, "a red fox", new_shot=True)
    assert eng.text is None and eng.generate_block(sess, 3).shape == (1, 16, 3, 4, 8)
