"""Our DiT against diffusers' WanTransformer3DModel, and our key names against the real configs."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers, convert_wan_vae_to_diffusers

from streamdiff.models.presets import WAN22_5B
from streamdiff.models.wan.dit import DiTConfig, WanDiT, count_params, sinusoidal_embedding
from streamdiff.models.wan.loading import (
    dit_config_from_json,
    normalize_dit_state_dict,
    normalize_vae_state_dict,
)
from streamdiff.models.wan.vae import VAEConfig, WanVAEDecoder

from .conftest import TEXT_LEN, WAN21_1_3B_DIFFUSERS, WAN22_5B_DIFFUSERS, make_dit_pair


@pytest.mark.parametrize("shape", [(5, 6, 10), (3, 8, 8), (2, 4, 14)], ids=["5x6x10", "3x8x8", "2x4x14"])
@pytest.mark.parametrize("t", [999.0, 437.5, 0.0])
def test_full_attention_forward_matches_diffusers(dit_pair, shape, t):
    ref, ours = dit_pair
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 16, *shape, generator=g)
    ctx = torch.randn(1, TEXT_LEN, 32, generator=g)
    tt = torch.tensor([t])
    with torch.no_grad():
        expected = ref(x, tt, ctx).sample
    got = ours.forward_full(x, tt, ctx)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-4


def test_per_frame_timesteps_match_diffusers_per_token(dit_pair):
    ref, ours = dit_pair
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 16, 5, 6, 10, generator=g)
    ctx = torch.randn(1, TEXT_LEN, 32, generator=g)
    per_frame = torch.tensor([[1000.0, 937.5, 833.3, 625.0, 0.0]])
    with torch.no_grad():
        expected = ref(x, per_frame.repeat_interleave(3 * 5, dim=1), ctx).sample
    assert (ours.forward_full(x, per_frame, ctx) - expected).abs().max().item() <= 1e-4


def test_batch_of_two(dit_pair):
    ref, ours = dit_pair
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 16, 3, 4, 6, generator=g)
    ctx = torch.randn(2, TEXT_LEN, 32, generator=g)
    tt = torch.tensor([250.0, 750.0])
    with torch.no_grad():
        expected = ref(x, tt, ctx).sample
    assert (ours.forward_full(x, tt, ctx) - expected).abs().max().item() <= 1e-4


def shapes(module: torch.nn.Module) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def test_real_dit_config_key_mapping_covers_diffusers():
    with torch.device("meta"):
        ref = WanTransformer3DModel(**WAN21_1_3B_DIFFUSERS)
        ours = WanDiT(DiTConfig())
    assert count_params(ours) == count_params(ref)
    assert round(count_params(ours) / 1e9, 3) == 1.419
    assert len(ours.state_dict()) == 825
    mapped = {k: tuple(v.shape) for k, v in normalize_dit_state_dict(ref.state_dict()).items()}
    assert mapped == shapes(ours)


# diffusers' configuration of Wan2.2-TI2V-5B (its convert_wan_to_diffusers.py), and the
# original release's config.json (../shared/notes/wan22.md, section 1).
WAN22_5B_ORIGINAL = {
    "_class_name": "WanModel",
    "model_type": "ti2v",
    "dim": 3072,
    "ffn_dim": 14336,
    "freq_dim": 256,
    "in_dim": 48,
    "out_dim": 48,
    "num_heads": 24,
    "num_layers": 30,
    "text_len": 512,
    "eps": 1e-06,
}


def test_the_wan22_5b_configuration_is_diffusers_and_the_releases():
    with torch.device("meta"):
        ref = WanTransformer3DModel(**WAN22_5B_DIFFUSERS)
        ours = WanDiT(WAN22_5B)
    assert count_params(ours) == count_params(ref)
    mapped = {k: tuple(v.shape) for k, v in normalize_dit_state_dict(ref.state_dict()).items()}
    assert mapped == shapes(ours)
    for cfg in (WAN22_5B_ORIGINAL, {k: v for k, v in WAN22_5B_DIFFUSERS.items() if k != "qk_norm"}):
        assert dit_config_from_json(cfg) == WAN22_5B
    # 880 tokens a latent frame at 1280x704 (44 x 80 latent pixels, 2x2 patches), not a constant
    assert WAN22_5B.tokens_per_frame(704 // 16, 1280 // 16) == 880


def test_48_channels_with_an_image_frame_at_t0_match_diffusers_per_token():
    """The 5B's shape at small dims: 48 latent channels in and out, and a block whose first
    frame is the start image's latent at t = 0 (image-to-video), the rest at the step's t."""
    ref, ours = make_dit_pair(48)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, 48, 4, 4, 6, generator=g)
    ctx = torch.randn(1, TEXT_LEN, 32, generator=g)
    per_frame = torch.tensor([[0.0, 999.8, 999.8, 999.8]])
    with torch.no_grad():
        expected = ref(x, per_frame.repeat_interleave(2 * 3, dim=1), ctx).sample
    got = ours.forward_full(x, per_frame, ctx)
    assert got.shape == expected.shape == x.shape
    assert (got - expected).abs().max().item() <= 1e-4


def test_our_names_are_the_original_names_diffusers_converts():
    """diffusers' own converter for original Wan checkpoints, applied to our state dict, must
    produce exactly diffusers' keys and shapes: our naming is the original release's."""
    with torch.device("meta"):
        ref = WanTransformer3DModel(**WAN21_1_3B_DIFFUSERS)
        ours = WanDiT(DiTConfig())
    converted = convert_wan_transformer_to_diffusers(dict(ours.state_dict()))
    assert {k: tuple(v.shape) for k, v in converted.items()} == shapes(ref)


def test_real_vae_config_key_mapping_covers_diffusers_decoder():
    with torch.device("meta"):
        ref = AutoencoderKLWan()
        ours = WanVAEDecoder(VAEConfig())
    mapped = {k: tuple(v.shape) for k, v in normalize_vae_state_dict(ref.state_dict(), VAEConfig()).items()}
    assert mapped == shapes(ours)
    decoder_params = sum(v.numel() for v in ours.state_dict().values())
    assert round(decoder_params / 1e6, 1) == 73.3
    converted = convert_wan_vae_to_diffusers(dict(ours.state_dict()))
    ref_shapes = shapes(ref)
    assert {k: tuple(v.shape) for k, v in converted.items()} == {
        k: s for k, s in ref_shapes.items() if k.startswith(("decoder.", "post_quant_conv."))
    }


@pytest.mark.parametrize("t", [999.0, 437.5, 0.0])
def test_a_device_without_float64_gets_the_timestep_embedding_in_float32(dit_pair, monkeypatch, t):
    """Intel Arc parts without native fp64 raise on float64 kernels (`Platform.float64` is off
    for XPU); there the embedding is float32, as diffusers computes it, and the forward still
    matches diffusers. Elsewhere it stays float64, as the reference."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from streamdiff.platform import for_device

    class Dtypes(TorchDispatchMode):
        seen: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seen.update(o.dtype for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor))
            return out

    ref, ours = dit_pair
    tt = torch.full((1, 2), t)
    exact = sinusoidal_embedding(tt, 256)
    monkeypatch.setattr(for_device("cpu"), "float64", False)
    with Dtypes() as mode:
        got = sinusoidal_embedding(tt, 256)
    assert torch.float64 not in mode.seen and got.dtype == torch.float32
    assert (got - exact).abs().max().item() <= 1e-4
    g = torch.Generator().manual_seed(3)
    x, ctx = torch.randn(1, 16, 3, 8, 8, generator=g), torch.randn(1, TEXT_LEN, 32, generator=g)
    with torch.no_grad():
        expected = ref(x, torch.tensor([t]), ctx).sample
    assert (ours.forward_full(x, torch.tensor([t]), ctx) - expected).abs().max().item() <= 1e-4
