"""The model card (streamdiff/card.py): the one torch-free description of a model, the same as
the model its worker builds."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from streamdiff.card import ModelCard
from streamdiff.models.presets import get_preset
from streamdiff.models.spec import ModelSpec, known_presets, preset_card

from ..helpers import ROOT


@pytest.mark.parametrize("name", known_presets())
def test_the_card_is_the_model_the_worker_builds(name, tmp_path):
    """What the supervisor, the API and the planner know before any worker starts is what the
    worker's loaded preset reports in READY (an empty weights directory: the preset's own configs)."""
    built = get_preset(ModelSpec(preset=name, path=str(tmp_path))).card()
    assert built == preset_card(name)


def test_a_config_json_beside_the_weights_changes_the_built_card(tmp_path):
    """A checkpoint of another size of the family: its card's dimensions are the file's, and the
    fields the supervisor planned by stay (planned_fields), so the worker's card is taken whole."""
    (tmp_path / "config.json").write_text('{"num_layers": 20, "dim": 1536, "ffn_dim": 8960, "num_heads": 12}')
    built = get_preset(ModelSpec(preset="self-forcing", path=str(tmp_path))).card()
    assert built.dims.num_layers == 20 and preset_card("self-forcing").dims.num_layers == 30
    assert not preset_card("self-forcing").differs(built, ("frames_per_block", "latent_channels", "size_multiple"))


def test_the_cards_say_what_each_model_takes():
    mg, ll, mw = preset_card("matrix-game-2-universal"), preset_card("longlive2-5b"), preset_card("minwm-action2v")
    assert (mg.text, mg.image, mg.controls, mg.dit_group) == (False, "condition", "matrix-game-universal", False)
    assert (ll.image, ll.new_shot, ll.size_multiple, ll.frames_per_block) == ("first_frame", "history", 32, 8)
    assert (mw.controls, mw.can_recache, mw.kv_caches, mw.image) == ("camera", False, 2, None)
    assert preset_card("causal-forcing-framewise").image_block and not preset_card("self-forcing").i2v


def test_a_card_with_an_unknown_value_is_refused_by_field():
    with pytest.raises(ValueError, match="x: image must be one of None, block, first_frame, condition, got 'pixels'"):
        ModelCard(name="x", arch="x", image="pixels")
    with pytest.raises(msgspec.ValidationError):  # off the wire: the same check
        msgspec.convert({"name": "x", "arch": "x", "new_shot": "sometimes"}, ModelCard)


def test_a_card_is_torch_free_and_crosses_the_wire():
    card = preset_card("longlive2-5b").configured(frames_per_block=4, default_size=(640, 352))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(card), type=ModelCard) == card
    code = "import sys, streamdiff.models.spec as s; s.preset_card('tiny'); sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


ACTION = [[1.0, 0.0, 0.0, 0.0, 0.1, 0.0]] * 3  # Matrix-Game universal: 4 keys and the mouse's pitch, yaw
CAMERA = [[1.0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0.5, 0.5, 0.5, 0.5]] * 4


@pytest.mark.parametrize(
    "preset,block,refused",
    [
        ("self-forcing", dict(frames=3, shot_start=True), None),
        ("self-forcing", dict(frames=1, shot_start=True, image=True), "does not condition on an image"),
        ("causal-forcing-framewise", dict(frames=1, shot_start=True, image=True), None),
        ("causal-forcing-framewise", dict(frames=1, image=True), "an image is a shot's first block"),
        ("longlive2-5b", dict(frames=8, shot_start=True, image=True), None),
        ("longlive2-5b", dict(frames=8, image=True), "an image starts a shot"),
        ("longlive2-5b", dict(frames=8, transition=True, prompt="a city"), None),
        ("self-forcing", dict(frames=3, transition=True, prompt="a city"), "takes no shot transition"),
        ("rolling-forcing", dict(frames=2), "whole blocks of 3 latent frames, not 2"),
        ("matrix-game-2-universal", dict(frames=3, shot_start=True, image=True, actions=ACTION), None),
        ("matrix-game-2-universal", dict(frames=3, shot_start=True), "starts every shot from an image"),
        ("matrix-game-2-universal", dict(frames=3, actions=ACTION[:2]), "3 finite action rows of 6 values"),
        ("matrix-game-2-universal", dict(frames=3, actions=[[float("nan")] * 6] * 3), "finite action rows"),
        ("self-forcing", dict(frames=3, actions=ACTION), "takes no actions"),
        ("minwm-action2v", dict(frames=4, camera=CAMERA), None),
        ("minwm-action2v", dict(frames=4, camera=CAMERA[:3]), "4 finite camera rows of 20 values"),
        ("self-forcing", dict(frames=4, camera=CAMERA), "takes no camera"),
    ],
)
def test_a_block_the_model_cannot_make_is_refused_with_its_reason(preset, block, refused):
    """The DiT worker's check of each block: the sampler's rules and each conditioning's, read
    off the card (models/blocks.py, models/conditionings.py)."""
    from streamdiff.models.blocks import BlockOrder, BlockRefused, check_block
    from streamdiff.models.conditionings import conditionings_for

    args = dict(block)
    args["new_shot"] = args.pop("shot_start", False)
    args["image"] = "a picture" if args.pop("image", False) else None  # the check asks only whether there is one
    card = preset_card(preset)
    if refused is None:
        check_block(card, conditionings_for(card), BlockOrder(**args))
    else:
        with pytest.raises(BlockRefused, match=refused):
            check_block(card, conditionings_for(card), BlockOrder(**args))
