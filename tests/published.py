"""Tiny random models written in each published checkpoint's real layout (test helper).

A base in the Wan 2.1 diffusers layout (small widths, a word-level tokenizer), and for each
checkpoint preset the file its authors ship, holding the sets their training code writes:
`generator` and `generator_ema` under the generator wrapper's `model.` prefix, the EMA with the
FSDP and activation-checkpoint segments at the root and inside every block, a `critic` beside
them where the authors keep one, LongLive's base with its `model` set and its PEFT LoRA file,
Krea's flat safetensors. Every set holds other values, so loading the wrong one shows.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp._common_utils import FSDP_WRAPPED_MODULE

from streamdiff.models.catalog import CHECKPOINT_PRESETS
from streamdiff.models.presets import ModelSpec, build_dit, get_preset
from streamdiff.models.wan.dit import DiTBlock, WanDiT

from .helpers import write_tokenizer
from .models.conftest import SMALL_DIT, diffusers_wan22_vae  # SMALL_DIT: 2 heads of 24, 2 layers, text width 32
from .models.test_loading import T5_TINY as SMALL_T5  # its text width matches


class _Wrapper(nn.Module):
    """The authors' generator wrapper (`WanDiffusionWrapper`): the WanModel as `.model`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


class _FSDPUnit(nn.Module):
    """Where FSDP1's auto-wrap puts a unit: the wrapped module under torch's attribute name."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        setattr(self, FSDP_WRAPPED_MODULE, module)


def generator_sd(dit: nn.Module) -> dict[str, torch.Tensor]:
    """`generator` as the trainers save it: `model.` + the original Wan names."""
    return {k: v.clone() for k, v in _Wrapper(dit).state_dict().items()}


def ema_sd(dit: nn.Module) -> dict[str, torch.Tensor]:
    """`generator_ema`: named parameters of the FSDP-wrapped generator, whose blocks are FSDP units
    around activation-checkpoint wrappers (the segments sit at the root and inside each block)."""
    wrapped = _Wrapper(copy.deepcopy(dit))
    blocks = wrapped.model.blocks
    for i in range(len(blocks)):
        blocks[i] = _FSDPUnit(checkpoint_wrapper(blocks[i]))
    root = _FSDPUnit(wrapped)
    return {n: p.detach().clone() for n, p in root.named_parameters()}


def shifted(dit: WanDiT, by: float) -> WanDiT:
    out = copy.deepcopy(dit)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(by)
    return out


def write_base(root: Path, dit: str = "wan2.1-t2v-1.3b") -> Path:
    """The base a preset's DiT configuration names, in the diffusers layout, small: Wan 2.1
    (Wan-AI/Wan2.1-T2V-1.3B-Diffusers; the 14B's too, whose widths the config sets), or Wan 2.2
    TI2V 5B (Wan-AI/Wan2.2-TI2V-5B-Diffusers: 48 channels, the 2.2 VAE at widths 8 and 12)."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    if dit == "matrix-game-2":
        return write_matrix_game_base(root)
    wan22 = dit == "wan2.2-ti2v-5b"
    d = root / ("wan22-base" if wan22 else "wan-base")
    torch.manual_seed(0)
    channels = {"in_channels": 48, "out_channels": 48} if wan22 else {}
    WanTransformer3DModel(**{**SMALL_DIT, **channels}).eval().save_pretrained(str(d / "transformer"))
    vae = diffusers_wan22_vae(8, 12) if wan22 else AutoencoderKLWan(base_dim=8, num_res_blocks=1)
    vae.eval().save_pretrained(str(d / "vae"))
    UMT5EncoderModel(UMT5Config(**SMALL_T5)).eval().save_pretrained(str(d / "text_encoder"))
    write_tokenizer(d / "tokenizer")
    (d / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    return d


@dataclass
class Published:
    """One preset's files: the flags that serve it, and the DiT weights its authors' script
    loads (original key names), to compare against."""

    preset: str
    flags: list[str]
    expected: dict[str, torch.Tensor]
    files: dict[str, Path]


# Matrix-Game's DiT at small sizes, in its authors' config.json form (configs/distilled_model/*):
# the keys and mouse of the action space left to each preset; its action block 0 of 2.
MATRIX_GAME_CONFIG = {
    "_class_name": "CausalWanModel", "model_type": "i2v", "dim": 48, "ffn_dim": 64, "freq_dim": 256, "num_heads": 2,
    "num_layers": 2, "in_dim": 36, "out_dim": 16, "local_attn_size": 6, "sink_size": 0, "eps": 1e-6,
    "action_config": {"blocks": [0], "heads_num": 2, "hidden_size": 16, "img_hidden_size": 48,
                      "keyboard_hidden_dim": 128, "mouse_hidden_dim": 128, "windows_size": 3,
                      "vae_time_compression_ratio": 4, "rope_dim_list": [8, 28, 28], "rope_theta": 256},
}  # fmt: skip


def write_matrix_game_base(root: Path) -> Path:
    """What Matrix-Game's DiT stands on, small: the Wan 2.1 VAE (diffusers layout), the CLIP
    vision tower (transformers' layout, 2 layers: the authors take the output of all but the
    last) and the DiT's config.json."""
    from diffusers import AutoencoderKLWan
    from transformers import CLIPVisionConfig, CLIPVisionModel

    d = root / "matrix-game-base"
    torch.manual_seed(0)
    AutoencoderKLWan(base_dim=8, num_res_blocks=1).eval().save_pretrained(str(d / "vae"))
    clip = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                            image_size=28, patch_size=14, hidden_act="gelu")  # fmt: skip
    CLIPVisionModel(clip).eval().save_pretrained(str(d / "image_encoder"))
    (d / "config.json").write_text(json.dumps(MATRIX_GAME_CONFIG))
    return d


class Bases:
    """The small bases, each written once, on first use: `bases(preset)` is the one its DiT
    configuration needs."""

    def __init__(self, root: Path) -> None:
        self.root, self.written = root, {}

    def __call__(self, preset: str) -> Path:
        dit = CHECKPOINT_PRESETS[preset].dit
        family = dit if dit in ("wan2.2-ti2v-5b", "matrix-game-2") else "wan2.1-t2v-1.3b"
        if family not in self.written:
            self.written[family] = write_base(self.root, family)
        return self.written[family]


def write_published(preset: str, root: Path, base: Path | Bases) -> Published:
    """The file(s) the authors of `preset` ship, with a tiny DiT on its base's configuration
    (`base`, or the one of `Bases` its DiT configuration needs)."""
    cp = CHECKPOINT_PRESETS[preset]
    base = base(preset) if isinstance(base, Bases) else base
    arch = cp.dit if cp.dit in ("wan2.2-ti2v-5b", "matrix-game-2") else "wan2.1-t2v-1.3b"
    if cp.dit == "matrix-game-2":  # no base DiT: the authors' file is the whole DiT
        torch.manual_seed(hash(preset) % 2**31)
        dit = WanDiT(get_preset(ModelSpec(preset=preset, path=str(base))).dit).eval()
        with torch.no_grad():
            for p in dit.parameters():
                p.copy_(torch.randn(p.shape) * 0.1)
    else:
        dit, _ = build_dit(ModelSpec(preset=arch, path=str(base)))
    if cp.prope:  # minWM: the stock model plus a `self_attn.prope_o` per block (given values here)
        dit = with_prope(dit)
    trained, ema = shifted(dit, 0.01), shifted(dit, -0.01)  # the two sets differ from each other
    d = root / preset
    d.mkdir(parents=True)
    ck = d / Path(cp.checkpoint).name
    files = {"checkpoint": ck}
    flags = ["--preset", preset, "--model", str(base), "--dit-checkpoint", str(ck)]
    critic = {"critic": {"model.head.head.weight": torch.zeros(3, 3)}}
    if preset == "krea-realtime-14b" or cp.dit == "matrix-game-2":  # a flat safetensors, `model.blocks.*`
        save_file({k: v.contiguous() for k, v in generator_sd(trained).items()}, str(ck))
        expected = trained
    elif preset == "causvid":  # the generator alone
        torch.save({"generator": generator_sd(trained)}, ck)
        expected = trained
    elif preset == "rolling-forcing":  # the EMA alone, FSDP segments in its keys
        torch.save({"generator_ema": ema_sd(ema)}, ck)
        expected = ema
    elif preset == "longlive":
        torch.save({"generator": generator_sd(trained), "generator_ema": ema_sd(ema), "model": generator_sd(dit)}, ck)
        lora_file, expected = write_longlive_lora(trained, cp.lora.rank, cp.lora.alpha, d / "lora.pt")
        files["lora"] = lora_file
        flags += ["--lora", str(lora_file)]
    elif preset == "longlive2-5b":  # the merged generator (scripts/merge_lora_generator.py's output)
        torch.save({"generator": generator_sd(trained)}, ck)
        lora_file, expected = write_longlive_lora(trained, cp.lora.rank, cp.lora.alpha, d / "lora.pt")
        files["lora"] = lora_file
        flags += ["--lora", str(lora_file)]
    elif preset == "minwm-action2v":  # Wan21/wan_inference.py: `generator_ema`, else `generator`
        torch.save({"generator": generator_sd(trained), "generator_ema": generator_sd(ema)}, ck)
        expected = ema
    else:  # Self-Forcing, CausVid's successors, Causal Forcing: both sets (and a critic)
        sets = {"generator": generator_sd(trained), "generator_ema": ema_sd(ema)}
        torch.save({**sets, **(critic if preset == "self-forcing" else {})}, ck)
        expected = ema if cp.weights == "ema" else trained
    return Published(preset, flags, {k: v.clone() for k, v in expected.state_dict().items()}, files)


def with_prope(dit: WanDiT) -> WanDiT:
    """`dit` with minWM's `add_prope_parameters`: a Linear `self_attn.prope_o` per block, here
    with random values (minWM's start at zero; its trained ones do not)."""
    out = WanDiT(replace(dit.cfg, prope=True)).eval()
    missing, unexpected = out.load_state_dict(dit.state_dict(), strict=False)
    assert not unexpected and all(".prope_o." in k for k in missing), (missing, unexpected)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for blk in out.blocks:
            for p in blk.self_attn.prope_o.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return out.requires_grad_(False)


def longlive_targets(model: nn.Module) -> list[str]:
    """LongLive's `configure_lora_for_model`: every Linear inside each transformer block."""
    return sorted(
        sub_name
        for name, m in model.named_modules()
        if isinstance(m, DiTBlock)
        for sub_name, sub in m.named_modules(prefix=name)
        if isinstance(sub, nn.Linear)
    )


def write_longlive_lora(base: WanDiT, rank: int, alpha: float, path: Path) -> tuple[Path, WanDiT]:
    """LongLive's lora.pt: PEFT's adapter state of the wrapped `.model` under `generator_lora`,
    beside `critic_lora` and `step`; returns it and PEFT's own merge of it (the reference)."""
    import peft

    model = copy.deepcopy(base)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=longlive_targets(model))
    wrapped = peft.get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:  # PEFT starts B at zero: give both factors values
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    adapter = peft.get_peft_model_state_dict(wrapped)
    torch.save({"generator_lora": adapter, "critic_lora": {}, "step": 100}, path)
    return path, wrapped.merge_and_unload()
