"""The Wan VAE encoder (image-to-video) against diffusers' `AutoencoderKLWan.encode(...).latent_dist.mean`,
normalised with latents_mean/std as the DiT expects (fp32, non-default dims, two image sizes)."""

from __future__ import annotations

import pytest
import torch

from streamdiff.models.wan.loading import load_into
from streamdiff.models.wan.vae import VAEConfig
from streamdiff.models.wan.vae_encoder import WanVAEEncoder, encoder_state_dict

from .conftest import diffusers, perturb_


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    ref = diffusers.AutoencoderKLWan(
        base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).eval()
    perturb_(ref, 0.05, 3)
    cfg = VAEConfig(base_dim=8, num_res_blocks=1)
    ours = WanVAEEncoder(cfg).eval()
    load_into(ours, encoder_state_dict(ref.state_dict(), cfg), "diffusers VAE encoder")
    return ref, ours


@pytest.mark.parametrize("h,w", [(64, 96), (48, 80)])
def test_encoder_equals_diffusers_mean(pair, h, w):
    ref, ours = pair
    x = torch.rand(1, 3, 1, h, w, generator=torch.Generator().manual_seed(h)) * 2 - 1
    with torch.no_grad():
        mu = ref.encode(x).latent_dist.mean
    mean = torch.tensor(ref.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(ref.config.latents_std).view(1, -1, 1, 1, 1)
    z = ours.encode_image(x)
    assert z.shape == (1, 16, 1, h // 8, w // 8)
    assert (z - (mu - mean) / std).abs().max().item() < 1e-5


def test_a_video_encoded_chunk_by_chunk_equals_its_whole_encode(pair):
    """Matrix-Game's conditioning: the start image then frames of zeros, which the release encodes
    whole (its first frame alone, then chunks of 4 with the causal cache): chunk by chunk as a
    live session needs them, the same latents."""
    ref, ours = pair
    x = torch.zeros(1, 3, 1 + 4 * 5, 48, 80)
    x[:, :, :1] = torch.rand(1, 3, 1, 48, 80, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        mu = ref.encode(x).latent_dist.mean
    mean = torch.tensor(ref.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(ref.config.latents_std).view(1, -1, 1, 1, 1)
    state = ours.new_state()
    z = torch.cat([ours.encode_chunk(x[:, :, :1], state)]
                  + [ours.encode_chunk(x[:, :, 1 + 4 * i : 5 + 4 * i], state) for i in range(5)], dim=2)  # fmt: skip
    assert (z - (mu - mean) / std).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="a chunk of 4"):
        ours.encode_chunk(x[:, :, :1], state)


def test_original_release_keys_load(pair):
    """Wan2.1_VAE.pth names: the encoder half under `encoder.*` and the quant conv as `conv1.*`."""
    ref, ours = pair
    original = {k: v.clone() for k, v in ours.state_dict().items()}
    again = WanVAEEncoder(ours.cfg)
    load_into(again, encoder_state_dict({**original, "conv2.weight": torch.zeros(1)}, ours.cfg), "release")
    x = torch.rand(1, 3, 1, 32, 48, generator=torch.Generator().manual_seed(1)) * 2 - 1
    assert torch.equal(again.encode_image(x), ours.encode_image(x))


def test_encoder_refuses_a_size_off_the_grid(pair):
    with pytest.raises(ValueError, match="multiple of 8"):
        pair[1].encode_image(torch.zeros(1, 3, 1, 36, 48))
