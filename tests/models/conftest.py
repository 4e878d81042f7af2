"""Shared builders for the model tests: small diffusers references with every weight perturbed
(so no parameter keeps a trivially symmetric init) and our modules loaded from their state."""

from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from streamdiff.models.wan.dit import DiTConfig, WanDiT  # noqa: E402
from streamdiff.models.wan.loading import load_into, normalize_dit_state_dict, normalize_vae_state_dict  # noqa: E402
from streamdiff.models.wan.vae import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD, VAEConfig, WanVAEDecoder  # noqa: E402
from streamdiff.testing import WAN21_1_3B_DIFFUSERS  # noqa: E402

# The 1.3B's configuration narrowed: 2 heads of 24, 2 layers, text width 32
SMALL_DIT = {**WAN21_1_3B_DIFFUSERS, "num_attention_heads": 2, "attention_head_dim": 24, "text_dim": 32,
             "ffn_dim": 64, "num_layers": 2}  # fmt: skip
TEXT_LEN = 12
# Wan 2.2 TI2V 5B's: 24 heads of 128, 48 latent channels in and out
WAN22_5B_DIFFUSERS = {
    **WAN21_1_3B_DIFFUSERS,
    "num_attention_heads": 24,
    "ffn_dim": 14336,
    "in_channels": 48,
    "out_channels": 48,
}


def diffusers_wan22_vae(base_dim: int = 160, decoder_base_dim: int = 256):
    """diffusers' Wan 2.2 VAE as its converter configures the release (48 latent channels,
    residual stages, 2x2 patches, 16x in space), at these widths (the release's by default)."""
    return diffusers.AutoencoderKLWan(
        base_dim=base_dim,
        decoder_base_dim=decoder_base_dim,
        z_dim=48,
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_temporal=4,
        scale_factor_spatial=16,
        latents_mean=list(WAN22_LATENTS_MEAN),
        latents_std=list(WAN22_LATENTS_STD),
    )


def perturb_(module: torch.nn.Module, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def make_dit_pair(channels: int = 16):
    """diffusers' DiT at SMALL_DIT with `channels` latent channels in and out (16: Wan 2.1's, 48:
    Wan 2.2's), perturbed, and ours holding its weights."""
    torch.manual_seed(0)
    ref = diffusers.WanTransformer3DModel(**{**SMALL_DIT, "in_channels": channels, "out_channels": channels}).eval()
    perturb_(ref, 0.1, 1)
    small = dict(dim=48, ffn_dim=64, num_heads=2, num_layers=2, text_dim=32, text_len=TEXT_LEN)
    cfg = DiTConfig(**small, in_channels=channels, out_channels=channels)
    ours = WanDiT(cfg).eval()
    load_into(ours, normalize_dit_state_dict(ref.state_dict()), "diffusers DiT")
    return ref, ours


@pytest.fixture(scope="session")
def dit_pair():
    return make_dit_pair()


@pytest.fixture(scope="session")
def vae_pair():
    torch.manual_seed(0)
    ref = diffusers.AutoencoderKLWan(
        base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True]
    ).eval()
    perturb_(ref, 0.05, 2)
    cfg = VAEConfig(base_dim=8)
    ours = WanVAEDecoder(cfg).eval()
    load_into(ours, normalize_vae_state_dict(ref.state_dict(), cfg), "diffusers VAE")
    return ref, ours
