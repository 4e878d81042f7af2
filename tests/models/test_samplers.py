"""The samplers behind one interface (models/samplers.py): each published preset gets its
authors' kind; their numerics are the authors' in test_rolling, test_unipc and test_krea."""

from __future__ import annotations

import dataclasses

import pytest

from streamdiff.models.catalog import CHECKPOINT_PRESETS
from streamdiff.models.samplers import RecomputeSampler, RollingSampler, UniPCSampler, sampler_for
from streamdiff.models.wan.sampler import SamplerConfig

KIND = {"rolling-forcing": RollingSampler, "causal-forcing-longvideo": RollingSampler}
KIND |= {"krea-realtime-14b": RecomputeSampler, "longlive2-5b": UniPCSampler}


@pytest.mark.parametrize("name", list(CHECKPOINT_PRESETS))
def test_each_preset_runs_its_authors_sampler(name):
    cfg = dataclasses.replace(SamplerConfig(), **CHECKPOINT_PRESETS[name].sampler_settings())
    sampler = sampler_for(cfg)
    assert type(sampler).__name__ == KIND.get(name, type(sampler_for(SamplerConfig()))).__name__
    assert len(sampler.timesteps) == len(cfg.steps) and sampler.commits == (name != "krea-realtime-14b")
    renoises = 0 if name == "longlive2-5b" else len(cfg.steps) - 1
    assert sampler.renoises(sampler.timesteps) == renoises


@pytest.mark.parametrize("kind", ["rolling", "unipc"])
def test_krea_s_recompute_is_the_block_samplers_only(kind):
    steps = (1000, 937, 833, 625) if kind == "unipc" else (1000, 750, 500, 250)
    with pytest.raises(ValueError, match=f"kv_recompute needs the block sampler, not '{kind}'"):
        SamplerConfig(kind=kind, kv_recompute=True, steps=steps, shift=5.0, warp=kind != "unipc").validate()
