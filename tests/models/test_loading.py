"""Loading checkpoints written by the tests in each real format: the original Wan 2.1 release
layout, the diffusers layout, and Causal Forcing / Self-Forcing training checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from safetensors.torch import save_file

from streamdiff.models.engines import DiTEngine, VAEEngine
from streamdiff.models.presets import ModelSpec, build_dit, build_vae
from streamdiff.models.wan.loading import CheckpointError, load_into, read_state_dict
from streamdiff.models.wan.text import UMT5TextEncoder, t5_key_from_original

from .conftest import SMALL_DIT, perturb_

transformers = pytest.importorskip("transformers")
T5_TINY = dict(
    vocab_size=40,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6,
    dropout_rate=0.0,
)
WORDS = "a red fox runs through snow blue whale city at night".split()


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(str(path))


def original_t5_state(hf_sd: dict) -> dict:
    """Invert the documented original -> transformers key mapping, for writing the .pth."""
    names = {}
    for i in range(T5_TINY["num_layers"]):
        orig = [f"blocks.{i}.attn.{p}.weight" for p in "qkvo"] + [
            f"blocks.{i}.pos_embedding.embedding.weight",
            f"blocks.{i}.norm1.weight",
            f"blocks.{i}.norm2.weight",
            f"blocks.{i}.ffn.gate.0.weight",
            f"blocks.{i}.ffn.fc1.weight",
            f"blocks.{i}.ffn.fc2.weight",
        ]
        names.update({t5_key_from_original(k): k for k in orig})
    names.update({"shared.weight": "token_embedding.weight", "encoder.final_layer_norm.weight": "norm.weight"})
    return {names[k]: v for k, v in hf_sd.items() if k in names}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from transformers import UMT5Config, UMT5EncoderModel

    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    dit = WanTransformer3DModel(**SMALL_DIT).eval()
    perturb_(dit, 0.1, 1)
    vae = AutoencoderKLWan(base_dim=8, num_res_blocks=2).eval()
    perturb_(vae, 0.05, 2)
    t5 = UMT5EncoderModel(UMT5Config(**T5_TINY)).eval()

    d = root / "diffusers"  # Wan-AI/Wan2.1-T2V-1.3B-Diffusers layout
    dit.save_pretrained(str(d / "transformer"))
    vae.save_pretrained(str(d / "vae"))
    t5.save_pretrained(str(d / "text_encoder"))
    write_tokenizer(d / "tokenizer")
    (d / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))

    o = root / "original"  # Wan-AI/Wan2.1-T2V-1.3B layout, original key names
    o.mkdir()
    ours_dit, _ = build_dit(ModelSpec(preset="wan2.1-t2v-1.3b", path=str(d)))
    original_sd = {k: v.contiguous() for k, v in ours_dit.state_dict().items()}
    save_file(original_sd, str(o / "diffusion_pytorch_model.safetensors"))
    (o / "config.json").write_text(
        json.dumps(
            {
                "_class_name": "WanModel",
                "model_type": "t2v",
                "dim": 48,
                "ffn_dim": 64,
                "freq_dim": 256,
                "in_dim": 16,
                "out_dim": 16,
                "num_heads": 2,
                "num_layers": 2,
                "text_len": 512,
                "text_dim": 32,
                "eps": 1e-6,
                "patch_size": [1, 2, 2],
            }
        )
    )
    ours_vae, _ = build_vae(ModelSpec(preset="wan2.1-t2v-1.3b", path=str(d)))
    vae_sd = dict(ours_vae.state_dict())
    vae_sd["encoder.conv1.weight"] = torch.zeros(8, 3, 3, 3, 3)  # the release carries the encoder too
    vae_sd["conv1.weight"] = torch.zeros(32, 32, 1, 1, 1)
    torch.save(vae_sd, o / "Wan2.1_VAE.pth")
    torch.save(original_t5_state(t5.state_dict()), o / "models_t5_umt5-xxl-enc-bf16.pth")
    write_tokenizer(o / "google" / "umt5-xxl")

    # Causal Forcing / Self-Forcing: generator (training weights) and generator_ema.
    ema = {"model._fsdp_wrapped_module." + k: v for k, v in ours_dit.state_dict().items()}
    gen = {"model." + k: v + 0.01 for k, v in ours_dit.state_dict().items()}
    torch.save({"generator": gen, "generator_ema": ema}, root / "causal_forcing.pt")
    torch.save({"generator": gen}, root / "self_forcing_no_ema.pt")
    return root


def dit_out(spec: ModelSpec) -> torch.Tensor:
    model, _ = build_dit(spec)
    g = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(1, 16, 3, 4, 6, generator=g), torch.randn(1, 512, 32, generator=g)
    return model.forward_full(x, torch.tensor([500.0]), ctx)


def test_dit_formats_give_identical_outputs(checkpoints):
    r = checkpoints
    real = dict(preset="wan2.1-t2v-1.3b")
    diffusers_out = dit_out(ModelSpec(**real, path=str(r / "diffusers")))
    original_out = dit_out(ModelSpec(**real, path=str(r / "original")))
    cf_out = dit_out(ModelSpec(**real, path=str(r / "original"), dit_checkpoint=str(r / "causal_forcing.pt")))
    assert torch.equal(diffusers_out, original_out) and torch.equal(diffusers_out, cf_out)
    non_ema = dit_out(
        ModelSpec(**real, path=str(r / "original"), dit_checkpoint=str(r / "causal_forcing.pt"), use_ema=False)
    )
    assert not torch.equal(non_ema, cf_out)
    assert torch.equal(
        non_ema, dit_out(ModelSpec(**real, path=str(r / "original"), dit_checkpoint=str(r / "self_forcing_no_ema.pt")))
    )


def test_vae_formats_give_identical_frames(checkpoints):
    z = torch.randn(1, 16, 2, 4, 6, generator=torch.Generator().manual_seed(2))
    outs = []
    for layout in ("diffusers", "original"):
        vae, _ = build_vae(ModelSpec(preset="wan2.1-t2v-1.3b", path=str(checkpoints / layout)))
        outs.append(vae.decode(z, vae.new_state()))
    assert torch.equal(outs[0], outs[1])


def test_umt5_from_both_layouts(checkpoints):
    a = UMT5TextEncoder(checkpoints / "diffusers", text_len=16, dtype=torch.float32)
    b = UMT5TextEncoder(checkpoints / "original", text_len=16, dtype=torch.float32, t5_config=T5_TINY)
    ea, eb = a.encode(["a red fox runs"]), b.encode(["a red fox runs"])
    assert ea.shape == (1, 16, 32)
    assert torch.allclose(ea, eb, atol=1e-6)
    assert ea[0, 4:].abs().max() == 0 and ea[0, :4].abs().min() > 0  # padding positions are zero
    assert (a.encode(["a blue whale"]) - ea).abs().max() > 1e-3


def test_real_preset_engines_generate_from_a_diffusers_directory(checkpoints):
    spec = ModelSpec(preset="wan2.1-t2v-1.3b", path=str(checkpoints / "diffusers"))
    dit, vae = DiTEngine(spec), VAEEngine(spec)
    sess = dit.open_session(64, 32, seed=3)
    dit.set_scene(sess, "a red fox runs through snow", cut=True)
    latent = dit.generate_block(sess, 3)
    frames = vae.decode_block(vae.open_session(), latent)
    assert latent.shape == (1, 16, 3, 4, 8) and frames.shape == (9, 32, 64, 3)


def test_truncated_checkpoint_gives_a_clear_error(checkpoints, tmp_path):
    good = (checkpoints / "original" / "diffusion_pytorch_model.safetensors").read_bytes()
    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "diffusion_pytorch_model.safetensors").write_bytes(good[: len(good) // 2])
    (bad / "config.json").write_text((checkpoints / "original" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="cannot read checkpoint .*diffusion_pytorch_model.safetensors"):
        build_dit(ModelSpec(preset="wan2.1-t2v-1.3b", path=str(bad)))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="junk.pt"):
        read_state_dict(tmp_path / "junk.pt")


def test_mismatched_checkpoint_names_every_problem(checkpoints):
    model, _ = build_dit(ModelSpec(preset="wan2.1-t2v-1.3b", path=str(checkpoints / "original")))
    sd = dict(model.state_dict())
    del sd["blocks.1.ffn.2.bias"]
    sd["blocks.0.self_attn.q.weight"] = torch.zeros(3, 3)
    sd["blocks.9.extra.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError) as e:
        load_into(model, sd, "test checkpoint")
    msg = str(e.value)
    assert "1 missing: blocks.1.ffn.2.bias" in msg
    assert "1 unexpected: blocks.9.extra.weight" in msg
    assert "blocks.0.self_attn.q.weight: checkpoint (3, 3) vs model (48, 48)" in msg
    sd = dict(model.state_dict())
    sd["head.head.bias"] = torch.full_like(sd["head.head.bias"], float("nan"))
    with pytest.raises(CheckpointError, match="head.head.bias holds NaN"):
        load_into(model, sd, "test checkpoint")
