"""The published checkpoints through their presets: each file, written in its authors' real layout
(tests/published.py), loads through `--preset` exactly the tensors the authors' inference loads;
mismatched files are refused with one error; `streamdiffd models` and the README agree."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streamdiff.config import ConfigError
from streamdiff.config.loader import load
from streamdiff.flags import overrides_from_args, parse_args
from streamdiff.models.catalog import CHECKPOINT_PRESETS, JSON_FIELDS
from streamdiff.models.presets import build_dit
from streamdiff.models.wan.loading import CheckpointError
from streamdiff.supervisor.topology import model_spec

from .helpers import ROOT
from .published import Bases, generator_sd, write_longlive_lora, write_published

pytest.importorskip("peft")
PRESETS = list(CHECKPOINT_PRESETS)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return Bases(tmp_path_factory.mktemp("published"))


@pytest.fixture(scope="module")
def base(bases):
    return bases("self-forcing")  # the Wan 2.1 base


def spec_from_flags(*flags: str):
    """The ModelSpec the daemon's workers get for these command-line flags."""
    return model_spec(load(None, overrides_from_args(parse_args(list(flags)))))


@pytest.mark.parametrize("preset", PRESETS)
def test_each_preset_loads_the_weights_its_authors_script_loads(preset, bases, tmp_path):
    pub = write_published(preset, tmp_path, bases)
    model, loaded = build_dit(spec_from_flags(*pub.flags))
    got = model.state_dict()
    assert got.keys() == pub.expected.keys()
    tol = 1e-6 if CHECKPOINT_PRESETS[preset].lora else 0.0  # the LoRA: PEFT's merge in fp32
    for k, v in got.items():
        assert torch.allclose(v, pub.expected[k], rtol=0, atol=tol), k
    cp = CHECKPOINT_PRESETS[preset]
    assert loaded.checkpoint == cp and loaded.sampler.frames_per_block == cp.frames_per_block
    assert loaded.sampler.steps == cp.steps and loaded.sampler.kind == cp.sampler


def test_the_weight_set_can_be_overridden_and_a_missing_one_is_named(base, tmp_path):
    pub = write_published("causal-forcing", tmp_path, base)  # the authors load `generator` here
    ema, _ = build_dit(spec_from_flags(*pub.flags, "--weights", "ema"))
    assert not torch.equal(ema.state_dict()["head.head.weight"], pub.expected["head.head.weight"])
    rolling = write_published("rolling-forcing", tmp_path, base)  # holds `generator_ema` only
    with pytest.raises(CheckpointError, match=r"no 'generator' weight set .*it holds: generator_ema"):
        build_dit(spec_from_flags(*rolling.flags, "--weights", "generator"))


def test_a_file_of_another_layout_is_refused_whole(base, tmp_path):
    pub = write_published("self-forcing", tmp_path, base)
    sd = torch.load(pub.files["checkpoint"], weights_only=True)
    sd["generator_ema"] = {k.replace("blocks.1.", "blocks.7."): v for k, v in sd["generator_ema"].items()}
    torch.save(sd, pub.files["checkpoint"])
    with pytest.raises(CheckpointError, match=r"missing: blocks\.1\..*unexpected: blocks\.7\."):
        build_dit(spec_from_flags(*pub.flags))


def test_a_matrix_game_file_of_another_action_space_is_refused_by_name(bases, tmp_path):
    """Matrix-Game's three checkpoints take three action spaces: the universal file under the
    Temple Run preset is refused naming whose it is, before anything is loaded; so is a config.json
    that says another space."""
    pub = write_published("matrix-game-2-universal", tmp_path, bases)
    flags = [f if f != "matrix-game-2-universal" else "matrix-game-2-templerun" for f in pub.flags]
    with pytest.raises(CheckpointError, match=r"a keyboard of 4 keys and a mouse \(matrix-game-2-universal's\); "
                       r"preset matrix-game-2-templerun takes a keyboard of 7 keys, no mouse"):  # fmt: skip
        build_dit(spec_from_flags(*flags))
    base = Path(pub.flags[pub.flags.index("--model") + 1])
    cfg = json.loads((base / "config.json").read_text())
    cfg["action_config"].update(keyboard_dim_in=2, enable_mouse=True)  # GTA's
    (base / "config.json").write_text(json.dumps(cfg))
    try:
        with pytest.raises(ValueError, match=r"keyboard of 2 keys and a mouse \(matrix-game-2-gta-drive's\)"):
            build_dit(spec_from_flags(*pub.flags))
    finally:
        cfg["action_config"].pop("keyboard_dim_in"), cfg["action_config"].pop("enable_mouse")
        (base / "config.json").write_text(json.dumps(cfg))


def test_a_lora_for_another_model_is_refused_naming_its_keys(base, tmp_path):
    from streamdiff.models.presets import ModelSpec

    pub = write_published("longlive", tmp_path, base)
    wider = build_dit(ModelSpec(preset="tiny"))[0]  # another width: 64 against the base's 48
    other, _ = write_longlive_lora(wider, 256, 256.0, tmp_path / "other-lora.pt")
    flags = [f if f != str(pub.files["lora"]) else str(other) for f in pub.flags]
    with pytest.raises(CheckpointError, match=r"blocks\.0\.self_attn\.q"):
        build_dit(spec_from_flags(*flags))


def test_a_preset_without_its_files_is_refused_by_name(base):
    with pytest.raises(ConfigError, match="dit_checkpoint.*--dit-checkpoint"):
        load(None, overrides_from_args(parse_args(["--preset", "self-forcing", "--model", str(base)])))
    with pytest.raises(ConfigError, match="model.lora.*--lora"):
        args = ["--preset", "longlive", "--model", str(base), "--dit-checkpoint", str(base / "x.pt")]
        load(None, overrides_from_args(parse_args(args)))
    with pytest.raises(ConfigError, match="model.preset.*self-forcing"):
        load(None, overrides_from_args(parse_args(["--preset", "self-forcin", "--model", str(base)])))


def test_the_loaded_model_is_described(base, tmp_path):
    from streamdiff.models.presets import describe_load, get_preset

    pub = write_published("longlive", tmp_path, base)
    spec = spec_from_flags(*pub.flags)
    d = describe_load(spec, get_preset(spec))
    assert d["preset"] == "longlive" and d["dit"] == "wan2.1-t2v-1.3b" and d["weights"] == "generator"
    assert d["checkpoint"] == str(pub.files["checkpoint"]) and d["lora"]["file"] == str(pub.files["lora"])
    assert d["lora"]["rank"] == 256 and d["lora"]["alpha"] == 256.0
    assert d["sampler"]["window_frames"] == 12 and d["sampler"]["recache"] == "every_switch"


def models_json() -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "streamdiff.cli", "models", "--json"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_streamdiffd_models_lists_every_preset_with_exactly_its_fields():
    rows = models_json()
    assert [r["name"] for r in rows] == [
        "self-forcing", "causvid", "causal-forcing", "causal-forcing-framewise", "causal-forcing-2step",
        "causal-forcing-1step", "causal-forcing-longvideo", "longlive", "rolling-forcing", "krea-realtime-14b",
        "longlive2-5b", "minwm-action2v", "matrix-game-2-universal", "matrix-game-2-gta-drive",
        "matrix-game-2-templerun",
    ]  # fmt: skip
    for r in rows:
        assert list(r) == list(JSON_FIELDS)
        assert r["weights"] in ("ema", "generator") and r["recache"] in ("never", "on_request", "every_switch")
        assert isinstance(r["steps"], list) and isinstance(r["warp"], bool) and isinstance(r["global_sink"], bool)
        assert r["lora"] is None or set(r["lora"]) == {"rank", "alpha"}
    by = {r["name"]: r for r in rows}
    assert by["minwm-action2v"]["controls"] == "camera" and by["self-forcing"]["controls"] is None
    assert by["matrix-game-2-templerun"]["controls"] == "matrix-game-templerun"
    assert by["longlive"]["lora"] == {"rank": 256, "alpha": 256.0} and by["longlive"]["window"] == 12
    assert by["causvid"]["steps"] == [1000, 757, 522] and by["causvid"]["warp"] is False
    assert by["causal-forcing-1step"]["first_block_steps"] == [1000, 750, 500, 250]


def test_the_readme_table_matches_streamdiffd_models():
    """README's presets table: one row per preset, its cells as `models --json` prints them."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| preset | source |") :].split("\n\n")[0].splitlines()[2:]
    cells = {}
    for line in table:
        c = [x.strip() for x in line.strip("|").split("|")]
        cells[re.sub(r"`", "", c[0])] = c
    for r in models_json():
        c = cells.pop(r["name"])
        assert f"https://github.com/{r['source']})" in c[1] and r["checkpoint"] in c[2], r["name"]
        assert c[3] == r["weights"] and c[4] == ", ".join(map(str, r["steps"])), r["name"]
        assert c[5] == f"{r['shift']:g}" and c[6] == ("yes" if r["warp"] else "no"), r["name"]
        first = r["first_block_steps"]
        assert c[7] == (", ".join(map(str, first)) if first else "—"), r["name"]
        assert c[8] == str(r["frames_per_block"]), r["name"]
        assert c[9] == ("global" if r["window"] is None else str(r["window"])), r["name"]
        assert c[10] == f"{r['sink']}{' (global)' if r['global_sink'] else ''}", r["name"]
        assert c[11] == r["recache"] and c[13] == r["dit"], r["name"]
        lora = r["lora"]
        assert c[12] == (f"rank {lora['rank']}, alpha {lora['alpha']:g}" if lora else "—"), r["name"]
    assert not cells, f"README rows without a preset: {sorted(cells)}"


def test_generator_sd_has_the_authors_prefix(base):
    from streamdiff.models.presets import ModelSpec

    dit, _ = build_dit(ModelSpec(preset="wan2.1-t2v-1.3b", path=str(base)))
    assert all(k.startswith("model.") for k in generator_sd(dit))


@pytest.mark.parametrize("layout", ["model", "raw"])
def test_longlive2s_file_loads_in_each_of_its_layouts(layout, bases, tmp_path):
    """LongLive 2.0's `model_bf16.pt` holds the generator under `generator` (above), under `model`,
    or bare (utils/nvfp4_checkpoint.py): each loads the same weights."""
    pub = write_published("longlive2-5b", tmp_path, bases)
    ck = pub.files["checkpoint"]
    sd = torch.load(ck, weights_only=True)["generator"]
    torch.save({"model": sd} if layout == "model" else sd, ck)
    model, loaded = build_dit(spec_from_flags(*pub.flags))
    assert loaded.dit.in_channels == 48 and loaded.sampler.kind == "unipc" and loaded.fps == 24
    for k, v in model.state_dict().items():
        assert torch.allclose(v, pub.expected[k], rtol=0, atol=1e-6), k
