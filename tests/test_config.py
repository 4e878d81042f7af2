"""Config: the shipped file documents every key with its default; bad values name the key."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest

from streamdiff.config import Config, ConfigError
from streamdiff.config.loader import load, override, to_dict
from streamdiff.flags import overrides_from_args, parse_args

from .helpers import ROOT


def test_shipped_config_has_every_key_with_its_default():
    text = (ROOT / "etc" / "streamdiff.toml").read_text()
    shipped = tomllib.loads(text)
    defaults = to_dict(Config())
    assert set(shipped) == set(defaults)
    for section, values in defaults.items():
        unset = {k for k, v in values.items() if v is None}  # TOML has no null: shown commented out
        assert set(shipped[section]) == set(values) - unset, section
        for key in unset:
            assert f"\n# {key} = " in text, f"{section}.{key}"
        for key, value in values.items():
            if key in unset:
                continue
            got = shipped[section][key]
            assert (tuple(got) if isinstance(got, list) else got) == value, f"{section}.{key}"
    assert load(ROOT / "etc" / "streamdiff.toml") == Config()


_WORLD = "[model]\npreset = '{}'\npath = '/models'\ndit_checkpoint = '/models/m.pt'\n"


@pytest.mark.parametrize(
    "text,key",
    [
        ("[server]\nport = 0", "server.port"),
        ("[server]\nprot = 80", "prot"),
        ("[topology]\nvae_devices = 3\nvae_group_size = 2", "topology.vae_group_size"),
        ("[topology]\nmode = 'sideways'", "topology.mode"),
        ("[topology]\ndit_devices = 'two'", "topology.dit_devices"),
        ("[model]\npreset = 'wan2.1-t2v-1.3b'", "model.path"),
        ("[encoder]\nkind = 'h265'", "encoder.kind"),
        ("[encoder]\ncrf = 0", "encoder.crf"),  # lossless: libx264 refuses it in baseline
        ("[limits]\nmax_width = 833", "limits.max_width"),
        ("[model]\nsize = '832x48'", "model.size"),  # not a multiple of 16
        ("[model]\nsize = 'big'", "model.size"),
        ("[model]\nsize = '1024x576'", "model.size"),  # past limits.max_width
        ("[pipeline]\nheartbeat_timeout_s = 0.5", "pipeline.heartbeat_timeout_s"),
        ("[nonsense]\nx = 1", "nonsense"),
        ("[server\nport = 1", "invalid TOML"),
        (_WORLD.format("minwm-action2v") + "[sampler]\nrecache = 'on_request'", "sampler.recache"),  # no cameras held
        (
            _WORLD.format("matrix-game-2-universal") + "[topology]\nmode = 'disaggregated'\ndit_devices = 2\n"
            "dit_group_size = 2",
            "topology.dit_group_size",
        ),  # its action modules run on one device
    ],
)
def test_invalid_values_name_the_key(tmp_path, text, key):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load(f)


def test_flags_override_the_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[server]\nport = 9000\n[topology]\nvae_devices = 4\n")
    cfg = load(f, overrides_from_args(parse_args(["--port", "9100", "--dit-gpus", "2", "--vae-gpus", "2"])))
    assert cfg.server.port == 9100 and cfg.topology.dit_devices == 2 and cfg.topology.vae_devices == 2
    with pytest.raises(ConfigError, match="--model"):
        overrides_from_args(parse_args(["--model", "/no/such/dir"]))


def test_model_size_sets_the_default_frame_size_everywhere_it_is_read():
    """The API's default, the supervisor's and planner's facts, and the size the workers build
    their preset at (their start-up timing and READY)."""
    from streamdiff.models.presets import get_preset
    from streamdiff.server.api import parse_video_request
    from streamdiff.supervisor.topology import model_card, model_spec

    cfg = load(None, overrides_from_args(parse_args(["--size", "128x64"])))
    card = model_card(cfg)
    assert card.default_size == (128, 64) and model_card(Config()).default_size == (256, 144)
    assert get_preset(model_spec(cfg)).default_size == (128, 64)
    req = parse_video_request({"prompt": "a fox"}, cfg, card)
    assert (req.width, req.height) == (128, 64)


def test_cli_reports_bad_values_without_a_traceback(capsys):
    from streamdiff.cli import main

    assert main(["--vae-gpus", "0"]) == 2
    err = capsys.readouterr().err
    assert "topology.vae_devices" in err and "Traceback" not in err


def test_replace_validates():
    cfg = Config()
    assert override(cfg, server={"port": 1234}).server.port == 1234
    with pytest.raises(ConfigError):
        override(cfg, server={"port": -1})
    assert dataclasses.is_dataclass(cfg)


def test_sampler_overrides_are_sampler_settings():
    """[sampler] overrides fields of the one SamplerConfig (models/wan/sampler.py), by name."""
    import dataclasses

    from streamdiff.config import SamplerOverrides
    from streamdiff.models.wan.sampler import SamplerConfig

    assert {f.name for f in dataclasses.fields(SamplerOverrides)} <= set(SamplerConfig.__dataclass_fields__)
