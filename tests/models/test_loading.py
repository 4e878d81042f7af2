"""Loading checkpoints written by the tests in each real format: the original Wan 2.1 release
layout, the diffusers layout, and Causal Forcing / Self-Forcing training checkpoints."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from safetensors.torch import save_file
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp._common_utils import FSDP_WRAPPED_MODULE

from streamdiff.models.engines import DiTEngine, VAEEngine
from streamdiff.models.presets import ModelSpec, build_dit, build_vae
from streamdiff.models.wan.loading import CheckpointError, load_into, read_state_dict
from streamdiff.models.wan.text import UMT5TextEncoder

from ..helpers import write_tokenizer
from .conftest import SMALL_DIT, perturb_
from .wan_t5_reference import WanT5Encoder

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


def wan_t5() -> WanT5Encoder:
    """T5_TINY's shape, built as Wan builds umT5 (its module tree gives the .pth's key names)."""
    torch.manual_seed(3)
    t = T5_TINY
    enc = WanT5Encoder(
        t["vocab_size"],
        t["d_model"],
        t["d_kv"] * t["num_heads"],
        t["d_ff"],
        t["num_heads"],
        t["num_layers"],
        t["relative_attention_num_buckets"],
    ).eval()
    perturb_(enc, 0.3, 4)
    return enc


class FSDPUnit(nn.Module):
    """Where FSDP1's auto-wrap puts a FullyShardedDataParallel unit: the wrapped module under
    torch's own attribute name. (FSDP1 itself needs an accelerator to be constructed.)"""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        setattr(self, FSDP_WRAPPED_MODULE, module)


class DiffusionWrapper(nn.Module):
    """Self-Forcing / Causal Forcing hold the WanModel as `.model` of their generator wrapper."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def training_state_dicts(dit: nn.Module) -> tuple[dict, dict]:
    """(generator, generator_ema) as the training scripts save them: the EMA is taken from the
    named parameters of the FSDP-wrapped generator, whose transformer blocks are FSDP units
    around activation-checkpoint wrappers; the training copy from a torch.compile'd model."""
    ema_gen = DiffusionWrapper(copy.deepcopy(dit))
    blocks = ema_gen.model.blocks
    for i in range(len(blocks)):
        blocks[i] = FSDPUnit(checkpoint_wrapper(blocks[i]))
    ema_gen = FSDPUnit(ema_gen)  # the root unit
    ema = {n: p.detach().clone() for n, p in getattr(ema_gen, FSDP_WRAPPED_MODULE).named_parameters()}
    train_gen = DiffusionWrapper(torch.compile(copy.deepcopy(dit)))
    with torch.no_grad():
        for p in train_gen.parameters():
            p.add_(0.01)
    return dict(train_gen.state_dict()), ema


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
    torch.save(wan_t5().state_dict(), o / "models_t5_umt5-xxl-enc-bf16.pth")
    write_tokenizer(o / "google" / "umt5-xxl")

    # Causal Forcing / Self-Forcing: generator (training weights) and generator_ema.
    gen, ema = training_state_dicts(ours_dit)
    assert any("._fsdp_wrapped_module._checkpoint_wrapped_module." in k for k in ema)
    assert any(k.startswith("model._orig_mod.") for k in gen)
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
        ModelSpec(**real, path=str(r / "original"), dit_checkpoint=str(r / "causal_forcing.pt"), weights="generator")
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
    ea = a.encode(["a red fox runs"])
    assert ea.shape == (1, 16, 32)
    assert ea[0, 4:].abs().max() == 0 and ea[0, :4].abs().min() > 0  # padding positions are zero
    assert (a.encode(["a blue whale"]) - ea).abs().max() > 1e-3
    # The original layout: Wan's own module tree, computed by a Wan-structured reference.
    b = UMT5TextEncoder(checkpoints / "original", text_len=16, dtype=torch.float32, t5_config=T5_TINY)
    tok = b.tokenizer(["a red fox runs"], padding="max_length", max_length=16, return_tensors="pt")
    ref = wan_t5()(tok.input_ids, tok.attention_mask) * tok.attention_mask[..., None]
    eb = b.encode(["a red fox runs"])
    assert (eb - ref).abs().max() < 1e-5 and ref[0, :4].abs().min() > 0


def test_umt5_beside_a_float16_dit_runs_in_bf16(checkpoints):
    """T5 outgrows float16 (transformers clamps its hidden states there, the values are lost):
    beside a float16 DiT the encoder runs in bf16, Wan's dtype for it. With activations past
    float16's range, as umT5-XXL's grow, bf16 stays near float32 and float16 does not."""

    def scaled(enc):  # feed-forward outputs past 65504
        for layer in enc.model.encoder.block:
            layer.layer[-1].DenseReluDense.wo.weight.data *= 3e5
        return enc.encode(["a red fox runs"]).float()

    enc = UMT5TextEncoder(checkpoints / "diffusers", text_len=16, dtype=torch.float16)
    assert next(enc.model.parameters()).dtype == torch.bfloat16
    ref = scaled(UMT5TextEncoder(checkpoints / "diffusers", text_len=16, dtype=torch.float32))
    f16 = UMT5TextEncoder(checkpoints / "diffusers", text_len=16, dtype=torch.float32)
    f16.model.to(torch.float16)

    def err(x):
        return ((x - ref).norm() / ref.norm()).item()

    assert err(scaled(enc)) < 0.05 and not err(scaled(f16)) < 0.05  # float16's: NaN here


def test_real_preset_engines_generate_from_a_diffusers_directory(checkpoints):
    spec = ModelSpec(preset="wan2.1-t2v-1.3b", path=str(checkpoints / "diffusers"))
    dit, vae = DiTEngine(spec), VAEEngine(spec)
    sess = dit.open_session(64, 32, seed=3)
    dit.set_scene(sess, "a red fox runs through snow", new_shot=True)
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


@pytest.mark.parametrize("layout", ["original", "diffusers"])
def test_a_release_loads_in_the_served_dtype_from_its_file_tensor_by_tensor(checkpoints, monkeypatch, layout):
    """bfloat16 from a float32 release: each parameter is made once in the served dtype and filled
    from the file (`StoredTensor`), never through a whole-file read nor a float32 model on the
    host; the precision-sensitive parts stay float32 as `WanDiT.cast` keeps them."""
    import safetensors.torch

    from streamdiff.models.wan.loading import StoredTensor, normalize_dit_state_dict, read_state_dicts

    files = sorted((checkpoints / layout).rglob("diffusion_pytorch_model*.safetensors"))
    raw = read_state_dicts(files)  # the file's float32 tensors, whole
    source = normalize_dit_state_dict(raw)
    monkeypatch.setattr(safetensors.torch, "load_file", lambda *a, **k: pytest.fail("read the whole file"))
    model, _ = build_dit(ModelSpec(preset="wan2.1-t2v-1.3b", path=str(checkpoints / layout), dtype="bfloat16"))
    for k, p in model.state_dict().items():
        kept = k.startswith("time_embedding") or "modulation" in k or ".norm3." in k
        assert p.dtype == (torch.float32 if kept else torch.bfloat16), k
        assert torch.equal(p, source[k].to(p.dtype)), k
    # A CPU parameter of the file's dtype is read into in place: no buffer between.
    (name, stored), staging = next(iter(read_state_dicts(files, stored=True).items())), []
    assert isinstance(stored, StoredTensor)
    dest = torch.empty(stored.shape, dtype=stored.dtype)
    with open(stored.path, "rb") as f:
        stored.copy_into(dest, f, staging)
    assert staging == [] and torch.equal(dest, raw[name])


def test_a_nan_in_a_stored_tensor_is_named_after_the_whole_model_is_read(checkpoints, tmp_path):
    from streamdiff.models.wan.loading import read_state_dict

    sd = read_state_dict(checkpoints / "original" / "diffusion_pytorch_model.safetensors")
    sd["blocks.0.ffn.0.weight"][3, 3] = float("nan")
    sd["head.head.bias"][0] = float("inf")
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(sd, str(bad / "diffusion_pytorch_model.safetensors"))
    (bad / "config.json").write_text((checkpoints / "original" / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"tensor blocks\.0\.ffn\.0\.weight, head\.head\.bias holds NaN or Inf"):
        build_dit(ModelSpec(preset="wan2.1-t2v-1.3b", path=str(bad)))


def test_an_fp8_release_is_refused_by_name(checkpoints, tmp_path):
    """A TorchAO-style FP8 file in the release layout: refused naming the tensor and its dtype,
    not read as weights (safetensors' F8_E4M3 included)."""
    sd = read_state_dict(checkpoints / "original" / "diffusion_pytorch_model.safetensors")
    sd["blocks.0.ffn.0.weight"] = sd["blocks.0.ffn.0.weight"].to(torch.float8_e4m3fn)
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    save_file(sd, str(fp8 / "diffusion_pytorch_model.safetensors"))
    (fp8 / "config.json").write_text((checkpoints / "original" / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"holds FP8 weights \(blocks\.0\.ffn\.0\.weight: torch\.float8_e4m3fn\)"):
        build_dit(ModelSpec(preset="wan2.1-t2v-1.3b", path=str(fp8)))


def test_an_nvfp4_generator_is_refused_by_name(checkpoints, tmp_path):
    """LongLive 2.0's NVFP4 layout: a generator whose linears carry FourOverSix's 4-bit codes."""
    sd = read_state_dict(checkpoints / "original" / "diffusion_pytorch_model.safetensors")
    sd = {f"model.{k}": v for k, v in sd.items() if k != "blocks.0.self_attn.q.weight"}
    sd["model.blocks.0.self_attn.q.quantized_weight_values"] = torch.zeros(8, 4, dtype=torch.uint8)
    torch.save({"generator": sd}, str(tmp_path / "model_4o6.pt"))
    spec = ModelSpec(
        preset="wan2.1-t2v-1.3b", path=str(checkpoints / "original"), dit_checkpoint=str(tmp_path / "model_4o6.pt")
    )
    with pytest.raises(CheckpointError, match=r"model_4o6\.pt is an NVFP4 checkpoint \(model\.blocks\.0\.self_attn"):
        build_dit(spec)
