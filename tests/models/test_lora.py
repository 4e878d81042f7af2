"""LoRA merging at load: adapters written by PEFT exactly as LongLive trains and saves them
(`get_peft_model_state_dict` of the PEFT-wrapped `WanDiffusionWrapper.model`, under
`generator_lora`), checked against PEFT's own unmerged forward and `merge_and_unload`."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from streamdiff.models import presets
from streamdiff.models.presets import ModelSpec, build_dit
from streamdiff.models.wan.dit import DiTBlock, DiTConfig, WanDiT
from streamdiff.models.wan.loading import CheckpointError, normalize_dit_state_dict
from streamdiff.models.wan.lora import merge_lora, read_lora

from .conftest import perturb_
from .test_loading import DiffusionWrapper, training_state_dicts

peft = pytest.importorskip("peft")

CFG = DiTConfig(dim=48, ffn_dim=64, num_heads=2, num_layers=2, text_dim=32, text_len=12)
RANK, ALPHA = 4, 12.0  # unequal, so a merge scaled by 1 instead of alpha / r shows


def longlive_targets(model: nn.Module) -> list[str]:
    """LongLive's `configure_lora_for_model`: every Linear inside each transformer block."""
    return sorted(
        sub_name
        for name, m in model.named_modules()
        if isinstance(m, DiTBlock)
        for sub_name, sub in m.named_modules(prefix=name)
        if isinstance(sub, nn.Linear)
    )


def forward(model: WanDiT) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x, ctx = torch.randn(1, 16, 3, 4, 4, generator=g), torch.randn(1, CFG.text_len, CFG.text_dim, generator=g)
    state = model.new_state(4, 4, window_frames=6)
    model.set_prompt(state, ctx)
    return model.forward_block(x, torch.full((1, 3), 750.0), state, commit=False)


@pytest.fixture(scope="module")
def longlive(tmp_path_factory):
    root = tmp_path_factory.mktemp("longlive")
    torch.manual_seed(0)
    base = WanDiT(CFG).eval()
    perturb_(base, 0.1, 1)
    # The model directory only gives the config; the DiT comes from longlive_base.pt.
    (root / "config.json").write_text(
        json.dumps(dict(dim=48, ffn_dim=64, num_heads=2, num_layers=2, text_dim=32, text_len=12, freq_dim=256))
    )
    # longlive_base.pt: inference takes `generator` (use_ema: false); the other sets differ from it.
    gen = DiffusionWrapper(base).state_dict()
    ema = {k: v + 0.03 for k, v in training_state_dicts(base)[1].items()}  # FSDP-segmented keys
    other = {k: v + 0.05 for k, v in gen.items()}
    torch.save({"generator": gen, "generator_ema": ema, "model": other}, root / "longlive_base.pt")

    def lora_model(seed: int) -> nn.Module:
        wrapper = DiffusionWrapper(copy.deepcopy(base))
        cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=longlive_targets(base))
        wrapper.model = peft.get_peft_model(wrapper.model, cfg)  # LongLive wraps generator.model
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # PEFT starts B at zero: draw both halves
            for name, p in wrapper.model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        return wrapper.model

    gen_lora, critic_lora = lora_model(2), lora_model(3)
    gen_sd = peft.get_peft_model_state_dict(gen_lora)
    torch.save(
        {"generator_lora": gen_sd, "critic_lora": peft.get_peft_model_state_dict(critic_lora), "step": 600},
        root / "lora.pt",
    )
    save_file({k: v.contiguous() for k, v in gen_sd.items()}, str(root / "lora.safetensors"))
    unmerged_out = forward(gen_lora.base_model.model)  # PEFT's LoRA layers at run time
    merged = gen_lora.merge_and_unload()
    return dict(
        root=root,
        base=base.state_dict(),
        gen_sd=gen_sd,
        merged=merged,
        out=unmerged_out,
        targets=longlive_targets(base),
    )


def longlive_spec(ll, **kw) -> ModelSpec:
    args = dict(path=str(ll["root"]), dit_checkpoint=str(ll["root"] / "longlive_base.pt"), weights="generator")
    return ModelSpec(preset="wan2.1-t2v-1.3b", dtype="float32", **{**args, **kw})


def test_adapter_keys_are_peft_module_names(longlive):
    keys = set(longlive["gen_sd"])
    assert "base_model.model.blocks.0.self_attn.q.lora_A.weight" in keys
    assert "base_model.model.blocks.1.ffn.2.lora_B.weight" in keys
    assert len(keys) == 2 * len(longlive["targets"]) == 2 * 10 * CFG.num_layers


def test_merged_longlive_matches_peft(longlive):
    model, _ = build_dit(longlive_spec(longlive, lora=str(longlive["root"] / "lora.pt"), lora_alpha=ALPHA))
    ours, ref, base = model.state_dict(), longlive["merged"].state_dict(), longlive["base"]
    assert ours.keys() == ref.keys()
    for k in ours:
        assert torch.allclose(ours[k], ref[k], rtol=0, atol=1e-6), k
        adapted = k.removesuffix(".weight") in longlive["targets"] and k.endswith(".weight")
        assert adapted != torch.equal(ours[k], base[k]), k  # exactly the targets changed
    assert torch.allclose(forward(model), longlive["out"], rtol=0, atol=1e-5)


def test_plain_safetensors_adapter_and_rank_given(longlive):
    spec = longlive_spec(longlive, lora=str(longlive["root"] / "lora.safetensors"), lora_alpha=ALPHA, lora_rank=RANK)
    model, _ = build_dit(spec)
    ref = longlive["merged"].state_dict()
    assert all(torch.allclose(v, ref[k], rtol=0, atol=1e-6) for k, v in model.state_dict().items())


def test_merge_keeps_dtype_and_leaves_base_alone(longlive):
    base = {k: v.to(torch.bfloat16) for k, v in longlive["base"].items()}
    before = {k: v.clone() for k, v in base.items()}
    out = merge_lora(base, longlive["gen_sd"], ALPHA)
    assert all(torch.equal(base[k], before[k]) for k in base)
    assert out["blocks.0.ffn.0.weight"].dtype == torch.bfloat16
    assert not torch.equal(out["blocks.0.ffn.0.weight"], base["blocks.0.ffn.0.weight"])


def errors(longlive, lora_sd, **kw) -> str:
    base = normalize_dit_state_dict(longlive["base"])
    before = {k: v.clone() for k, v in base.items()}
    with pytest.raises(CheckpointError) as exc:
        merge_lora(base, lora_sd, ALPHA, **kw)
    assert all(torch.equal(base[k], before[k]) for k in base)
    return str(exc.value)


def test_adapter_for_another_model_names_each_problem(longlive):
    sd = dict(longlive["gen_sd"])
    sd["base_model.model.blocks.7.self_attn.q.lora_A.weight"] = torch.zeros(RANK, 48)  # deeper model
    sd["base_model.model.blocks.7.self_attn.q.lora_B.weight"] = torch.zeros(48, RANK)
    sd["base_model.model.blocks.0.cross_attn.k.lora_A.weight"] = torch.zeros(RANK, 64)  # wider model
    sd["base_model.model.blocks.0.ffn.0.lora_magnitude_vector"] = torch.ones(64)  # DoRA
    sd["base_model.model.blocks.0.self_attn.q.base_layer.weight"] = torch.zeros(48, 48)
    msg = errors(longlive, sd)
    assert "base_model.model.blocks.7.self_attn.q.lora_A.weight" in msg and "no Linear" in msg
    assert "blocks.0.cross_attn.k: lora_A (4, 64), lora_B (48, 4), base weight (48, 48)" in msg
    assert "DoRA" in msg and "blocks.0.self_attn.q.base_layer.weight" in msg


def test_lora_a_without_b(longlive):
    sd = {k: v for k, v in longlive["gen_sd"].items() if k != "base_model.model.blocks.1.self_attn.v.lora_B.weight"}
    assert "base_model.model.blocks.1.self_attn.v.lora_A.weight has no lora_B" in errors(longlive, sd)


def test_rank_disagreeing_with_the_preset(longlive):
    msg = errors(longlive, longlive["gen_sd"], rank=256)
    assert "rank 4 in the file, 256 given" in msg and f"{len(longlive['targets'])} with the wrong rank" in msg


def test_empty_adapter(longlive):
    assert "empty" in errors(longlive, {})


def test_bad_lora_loads_nothing(longlive, tmp_path, monkeypatch):
    torch.save({"generator_lora": {}, "step": 1}, tmp_path / "empty.pt")
    copied = []
    monkeypatch.setattr(presets, "load_into", lambda *a: copied.append(a))
    with pytest.raises(CheckpointError, match="empty"):
        build_dit(longlive_spec(longlive, lora=str(tmp_path / "empty.pt"), lora_alpha=ALPHA))
    with pytest.raises(ValueError, match="lora_alpha"):
        build_dit(longlive_spec(longlive, lora=str(longlive["root"] / "lora.pt")))
    with pytest.raises(CheckpointError, match="not found"):
        read_lora(tmp_path / "missing.pt")
    assert copied == []
