"""A model's conditionings, chosen from its card when the engine is built (models/conditionings.py):
each preset gets the context, the picture's way and the camera its card says, and the engine's
blocks with them equal what they were (the published and feature tests hold the frames)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from streamdiff.models import conditionings as c
from streamdiff.models.blocks import BlockOrder, BlockRefused
from streamdiff.models.engines import DiTEngine
from streamdiff.models.presets import ModelSpec
from streamdiff.models.spec import known_presets, preset_card


@pytest.mark.parametrize("preset", known_presets())
def test_each_presets_conditionings_are_what_its_card_says(preset):
    card = preset_card(preset)
    kinds = [type(x) for x in c.conditionings_for(card)]
    context = c.ImageContext if card.image == "condition" else c.TextPrompt
    image = {"block": [c.ImageBlock], "first_frame": [c.FirstFrame]}.get(card.image, [])
    camera = [c.Camera] if card.controls == "camera" else []
    assert kinds == [context, *image, *camera]
    assert not (card.text and context is c.ImageContext)  # a picture's context is no prompt


def test_a_camera_model_that_would_re_cache_is_refused_when_built():
    card = msgspec.structs.replace(preset_card("minwm-action2v"), recache="on_request")
    with pytest.raises(ValueError, match="cannot re-cache"):
        c.conditionings_for(card)


def test_the_engine_checks_a_start_picture_against_the_video_and_makes_it_a_block_of_its_own():
    eng = DiTEngine(ModelSpec(preset="tiny-random"))  # an image is a block of its own here
    sess = eng.open_session(64, 48, seed=3)
    wrong = torch.zeros(32, 64, 3, dtype=torch.uint8)
    with pytest.raises(BlockRefused, match="the image is 64x32, not the video's size"):
        eng.check(sess, BlockOrder(1, "a ball", new_shot=True, image=wrong))
    image = torch.randint(0, 256, (48, 64, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    order = BlockOrder(1, "a ball", new_shot=True, image=image, shot_left=3)
    eng.check(sess, order)
    (z,) = eng.make([(sess, order)])
    assert z.shape == (1, eng.model.cfg.in_channels, 1, *sess.latent_hw) and sess.state.next_frame == 1
    # the same as the steps spelled out: the scene with the noise of the 2 blocks after the picture
    ref = eng.open_session(64, 48, seed=3)
    eng.set_scene(ref, "a ball", new_shot=True, shot_left=2)
    assert torch.equal(eng.start_image(ref, image), z)
    (a,), b = eng.make([(sess, BlockOrder(3))]), eng.generate_block(ref, 3)
    assert torch.equal(a, b)
