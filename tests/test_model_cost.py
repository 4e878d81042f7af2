"""The planner's model cost from the DiT configuration: the 14B's memory and time priced from the
1.3B's profile, placed on a device that holds it and refused by name on one that does not."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest
import torch

from streamdiff.cli import placement as commands
from streamdiff.config import Config, ConfigError, ModelConfig, TopologyConfig
from streamdiff.models.presets import WAN22_5B, WAN_14B
from streamdiff.models.spec import ARCH_CARDS, preset_card
from streamdiff.models.wan.dit import DiTConfig, WanDiT, count_params
from streamdiff.models.wan.sampler import SamplerConfig
from streamdiff.placement.auto import check_memory
from streamdiff.placement.cost import (
    GIB,
    DoesNotFit,
    dit_params,
    model_cost,
    priced_profile,
)
from streamdiff.placement.planner import plan
from streamdiff.placement.profile.schema import Profile

ROOT = Path(__file__).resolve().parents[1]
B70 = ROOT / "docs" / "results" / "profile-b70.json"  # published 1.3B figures
SIZE = (832, 480)
CONFIGS = {"wan2.1-t2v-1.3b": DiTConfig(), "wan2.1-t2v-14b": WAN_14B, "wan2.2-ti2v-5b": WAN22_5B}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dims_and_params_are_the_models(name):
    cfg, dims = CONFIGS[name], preset_card(name).dims
    assert {k: getattr(cfg, k) for k in dims.__struct_fields__} == msgspec.structs.asdict(dims)
    with torch.device("meta"):
        model = WanDiT(cfg)
    assert dit_params(dims) == count_params(model)


@pytest.mark.parametrize("name", [n for n, c in ARCH_CARDS.items() if not c.embedded])
def test_a_bare_dit_configurations_card_is_the_block_samplers(name):
    """A DiT configuration's card prices the block sampler's defaults."""
    s, card = SamplerConfig(), preset_card(name)
    assert (card.steps, card.window_frames, card.frames_per_block) == (
        len(s.steps),
        s.window_frames,
        s.frames_per_block,
    )


def test_block_flops_count_the_models_linear_layers():
    """The FLOPs' linear part equals 2 x tokens x the weights each block token passes through,
    counted on the module tree (cross-attention k/v run once per prompt, not per block)."""
    with torch.device("meta"):
        model = WanDiT(WAN_14B)
    per_token = sum(
        m.weight.numel()
        for name, m in model.blocks.named_modules()
        if isinstance(m, torch.nn.Linear) and not name.endswith(("cross_attn.k", "cross_attn.v"))
    )
    tpf = (480 // 16) * (832 // 16)
    cost = model_cost("krea-realtime-14b", SIZE)
    n, d = 3 * tpf, preset_card("wan2.1-t2v-14b").dims
    attention = 4 * n * d.dim * (6 * tpf + d.text_len) * d.num_layers
    assert cost.block_flops == 6 * (2 * n * per_token + attention)  # 5 passes of the schedule + the recompute


def test_14b_kv_bytes_per_session():
    cost = model_cost("krea-realtime-14b", SIZE, dtype_bytes=2)
    tpf = 1560
    assert cost.session_bytes == 40 * 2 * (6 * tpf + 512) * 5120 * 2  # Krea's window of 6 + the prompt


def test_priced_time_scales_with_flops():
    prof = Profile.from_json(B70.read_text())
    priced = priced_profile(prof, "krea-realtime-14b")
    ratio = model_cost("krea-realtime-14b", SIZE).block_flops / model_cost("wan2.1-t2v-1.3b", SIZE).block_flops
    src, dst = prof.sizes["832x480"], priced.sizes["832x480"]
    assert dst["dit"]["1"]["block_ms"] == pytest.approx(src["dit"]["1"]["block_ms"] * ratio)
    assert dst["dit"]["1"]["batch_ms"]["2"] == pytest.approx(src["dit"]["1"]["batch_ms"]["2"] * ratio)
    assert dst["vae"] == src["vae"] and priced.preset == "krea-realtime-14b"
    assert ratio > 1  # the 14B's linear layers outweigh the 1.3B's longer window


def test_14b_placed_on_80gb():
    prof = dataclasses.replace(priced_profile(Profile.from_json(B70.read_text()), "krea-realtime-14b"), devices=1)
    cost = model_cost("krea-realtime-14b", SIZE, 2)
    cost.check(80 * 10**9)
    p = plan(Config(), prof, 1, "throughput", preset_card("krea-realtime-14b"), SIZE)
    lay, pred = p.best
    assert lay.mode == "aggregated" and pred.w1_fps > 0
    p2 = plan(Config(), dataclasses.replace(prof, devices=2), 2, "throughput", preset_card("krea-realtime-14b"), SIZE)
    assert any(x.mode == "disaggregated" and x.dit == 1 and x.vae == 1 for x, _ in p2.ranked)


def test_14b_refused_on_24gb_by_name_and_numbers():
    cost = model_cost("krea-realtime-14b", SIZE, 2)
    fixed = (cost.weight_bytes + cost.activation_bytes) / GIB
    with pytest.raises(DoesNotFit) as e:
        cost.check(24 * 10**9)
    msg = str(e.value)
    assert "krea-realtime-14b" in msg and "wan2.1-t2v-14b" in msg
    assert f"{fixed:.1f} GiB" in msg and f"{cost.session_bytes / GIB:.2f} GiB per session" in msg
    assert f"{24 * 10**9 / GIB:.1f} GiB" in msg


def test_refused_at_start_before_workers():
    cfg = Config(model=ModelConfig(preset="krea-realtime-14b"), topology=TopologyConfig(device="cuda"))
    with pytest.raises(ConfigError, match="krea-realtime-14b"):
        check_memory(cfg, SIZE, 24 * 10**9)
    assert check_memory(cfg, SIZE, 80 * 10**9) is not None
    assert check_memory(Config(), (256, 144), 1) is None  # tiny: nothing to price


def test_plan_command_prices_14b_from_a_13b_profile(capsys):
    args = ["--devices", "2", "--profile", str(B70), "--preset", "krea-realtime-14b", "--objective", "throughput"]
    assert commands.plan_main([*args, "--memory-gib", "80"]) == 0
    out = capsys.readouterr()
    assert "disagg-1+1" in out.out and "priced from wan2.1-t2v-1.3b" in out.err
    assert commands.plan_main([*args, "--memory-gib", "24"]) == 2
    assert "krea-realtime-14b (wan2.1-t2v-14b) needs" in capsys.readouterr().err


def test_the_5b_is_priced_at_its_own_tokens_per_frame():
    """Wan 2.2's VAE is 16x in space: 880 tokens a frame at 1280x704 (Self-Forcing's 1560 is
    832x480 at 8x). One session's KV window (21 frames, the block sampler's) in bf16: 30 layers
    x keys and values x 21 x 880 tokens x 3072."""
    cost = model_cost("wan2.2-ti2v-5b", (1280, 704), 2)
    kv = 30 * 2 * 21 * 880 * 3072 * 2
    assert cost.session_bytes == kv + 30 * 2 * 512 * 3072 * 2
    assert model_cost("wan2.2-ti2v-5b", (640, 352)).session_bytes - 30 * 2 * 512 * 3072 * 2 == kv // 4
    assert 4.9e9 < cost.params < 5.1e9


def test_the_5b_fits_80gb_and_is_refused_on_24gb_by_name():
    cfg = Config(model=ModelConfig(preset="wan2.2-ti2v-5b"), topology=TopologyConfig(device="cuda"))
    assert check_memory(cfg, (1280, 704), 80 * 10**9) is not None
    with pytest.raises(ConfigError, match=r"wan2.2-ti2v-5b \(wan2.2-ti2v-5b\) needs"):
        check_memory(cfg, (1280, 704), 24 * 10**9)


def test_a_wan21_profile_does_not_price_the_5b(capsys):
    """Its VAE is another (48 channels): the profile's decode figures do not carry."""
    with pytest.raises(ValueError, match="wan2.2-ti2v-5b decodes 48-channel latents .* profile wan2.2-ti2v-5b itself"):
        priced_profile(Profile.from_json(B70.read_text()), "wan2.2-ti2v-5b")
    with pytest.raises(SystemExit):
        commands.plan_main(["--profile", str(B70), "--preset", "wan2.2-ti2v-5b"])
    assert "--preset: wan2.2-ti2v-5b decodes 48-channel latents" in capsys.readouterr().err


def test_longlive2s_window_is_the_authors_10_4_gb():
    """LongLive 2.0's cache per layer is [1, 32 x 880, 24, 128] keys and values: 10.4 GB over 30
    layers in bf16 (../shared/notes/wan22.md); its 5B fits an 80 GB device with it."""
    cost = model_cost("longlive2-5b", (1280, 704), 2)
    assert cost.session_bytes - 30 * 2 * 512 * 3072 * 2 == 30 * 2 * 32 * 880 * 24 * 128 * 2 == 10_380_902_400
    cost.check(80 * 10**9)
    with pytest.raises(DoesNotFit, match="longlive2-5b"):
        cost.check(24 * 10**9)
