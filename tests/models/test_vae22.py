"""The Wan 2.2 VAE (48 latent channels, residual stages, 2x2 patches) against diffusers'
AutoencoderKLWan configured as the release converts it (`is_residual`, `patch_size=2`), at
small widths: the streamed decoder, its stages, the image encoder and the release's key names."""

from __future__ import annotations

import diffusers
import pytest
import torch

from streamdiff.models.presets import WAN22_5B, WAN22_VAE, get_preset
from streamdiff.models.spec import ModelSpec, preset_card
from streamdiff.models.wan.loading import (
    check_keys,
    load_into,
    normalize_vae_state_dict,
    vae_config_from_json,
    vae_config_from_state_dict,
)
from streamdiff.models.wan.vae import (
    WAN22_LATENTS_MEAN,
    WAN22_LATENTS_STD,
    VAEConfig,
    WanVAEDecoder,
    decode_stages,
    decoder_stages,
)
from streamdiff.models.wan.vae_blocks import Ctx, patchify, unpatchify
from streamdiff.models.wan.vae_encoder import WanVAEEncoder, encoder_state_dict
from streamdiff.models.wan.vae_shapes import stage_shapes

from .conftest import WAN22_5B_DIFFUSERS, diffusers_wan22_vae, perturb_

# The release's shape (base 160, decoder 256) narrowed: 8 and 12 keep every shortcut's channel
# arithmetic (DupUp3D 48 -> 48 -> 24, AvgDown3D 8 -> 8 -> 16 -> 32) and the 48 latent channels.
SMALL = dict(base_dim=8, decoder_base_dim=12, z_dim=48, num_res_blocks=2, residual=True, patch_size=2)
CFG = VAEConfig(**SMALL, latents_mean=WAN22_LATENTS_MEAN, latents_std=WAN22_LATENTS_STD)


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    ref = diffusers_wan22_vae(base_dim=8, decoder_base_dim=12).eval()
    perturb_(ref, 0.05, 3)
    cfg = vae_config_from_json(dict(ref.config), VAEConfig())
    assert cfg == CFG  # the diffusers config read as ours
    dec = WanVAEDecoder(cfg).eval()
    load_into(dec, normalize_vae_state_dict(ref.state_dict(), cfg), "diffusers Wan 2.2 VAE")
    enc = WanVAEEncoder(cfg).eval()
    load_into(enc, encoder_state_dict(ref.state_dict(), cfg), "diffusers Wan 2.2 VAE encoder")
    return ref, dec, enc


def reference_decode(ref, z):
    mean, std = torch.tensor(WAN22_LATENTS_MEAN).view(1, -1, 1, 1, 1), torch.tensor(WAN22_LATENTS_STD)
    with torch.no_grad():
        return ref.decode(z * std.view(1, -1, 1, 1, 1) + mean).sample


def test_the_release_shape():
    """16x spatial, 4x temporal; the release's widths and statistics."""
    assert CFG.spatial_factor == 16 and CFG.temporal_factor == 4 and CFG.rgb_channels == 12
    assert len(WAN22_LATENTS_MEAN) == len(WAN22_LATENTS_STD) == 48
    full = VAEConfig(base_dim=160, decoder_base_dim=256, z_dim=48, residual=True, patch_size=2)
    with torch.device("meta"):
        dec = WanVAEDecoder(full)
    widths = [dec.decoder.conv1.out_channels] + [s.upsamples[0].residual[2].out_channels for s in dec.decoder.upsamples]
    assert widths == [1024, 1024, 1024, 512, 256]
    assert dec.decoder.head[2].out_channels == 12


@pytest.mark.parametrize("shape", [(4, 3, 5), (2, 2, 3)], ids=["4x3x5", "2x2x3"])
def test_decode_matches_diffusers(pair, shape):
    ref, dec, _ = pair
    z = torch.randn(1, 48, *shape, generator=torch.Generator().manual_seed(7))
    expected = reference_decode(ref, z)
    got = dec.decode(z, dec.new_state())
    assert got.shape == expected.shape == (1, 3, 1 + 4 * (shape[0] - 1), 16 * shape[1], 16 * shape[2])
    assert (got - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("split", [[1, 1, 1, 1, 1], [3, 2], [1, 4], [2, 1, 2]], ids=str)
def test_block_by_block_equals_whole(pair, split):
    """Any first block (one latent frame as the release decodes it, or several) and any later
    blocks give the whole clip's frames: the shortcut keeps one frame of a shot's first latent
    frame, as the time_conv path does."""
    _, dec, _ = pair
    z = torch.randn(1, 48, sum(split), 2, 3, generator=torch.Generator().manual_seed(8))
    whole = dec.decode(z, dec.new_state())
    state, parts, start = dec.new_state(), [], 0
    for n in split:
        out = dec.decode(z[:, :, start : start + n], state)
        assert out.shape[2] == CFG.frames_out(n, first_block=start == 0)
        parts.append(out)
        start += n
    assert (torch.cat(parts, dim=2) - whole).abs().max().item() <= 1e-5


def test_a_cut_between_stages_equals_the_whole_and_stage_shapes_hold(pair):
    _, dec, _ = pair
    z = torch.randn(1, 48, 7, 2, 3, generator=torch.Generator().manual_seed(10))
    whole = dec.decode(z, dec.new_state())
    n = len(decoder_stages(dec))
    assert n == 6  # conv1 + middle, four stages, the head
    for cut in range(n + 1):
        front, back, out = dec.new_state(), dec.new_state(), []
        for start, frames in ((0, 1), (1, 3), (4, 3)):
            x = decode_stages(dec, z[:, :, start : start + frames], front, 0, cut, frames)
            out.append(decode_stages(dec, x, back, cut, n, frames))
        assert (torch.cat(out, dim=2) - whole).abs().max().item() <= 1e-5, cut
    state, x = dec.new_state(), torch.randn(1, 48, 1, 2, 3)
    decode_stages(dec, x, state, 0, n, 1)
    x, ctx, got = torch.randn(1, 48, 3, 2, 3), Ctx(state), []
    for stage in decoder_stages(dec):
        x = stage(x, ctx)
        got.append(tuple(x.shape[1:]))
    assert got == stage_shapes(CFG, 3, 2, 3)


def test_encode_image_matches_diffusers(pair):
    """One picture -> the shot's first latent frame: the distribution's mean, normalised."""
    ref, _, enc = pair
    image = torch.rand(1, 3, 1, 32, 48, generator=torch.Generator().manual_seed(4)) * 2 - 1
    with torch.no_grad():
        mu = ref.encode(image).latent_dist.mean
    expected = (mu - torch.tensor(WAN22_LATENTS_MEAN).view(1, -1, 1, 1, 1)) / torch.tensor(WAN22_LATENTS_STD).view(
        1, -1, 1, 1, 1
    )
    got = enc.encode_image(image)
    assert got.shape == expected.shape == (1, 48, 1, 2, 3)
    assert (got - expected).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="multiple of 16"):
        enc.encode_image(torch.zeros(1, 3, 1, 24, 48))


def test_patches_round_trip_in_the_release_order():
    """Channel c * 4 + w_off * 2 + h_off: not pixel_shuffle's order (h_off before w_off)."""
    x = torch.arange(12.0).view(1, 12, 1, 1, 1)
    rgb = unpatchify(x, 2)
    assert rgb[0, 0, 0].tolist() == [[0.0, 2.0], [1.0, 3.0]]  # row h_off, column w_off
    y = torch.randn(2, 3, 2, 6, 8)
    assert torch.equal(unpatchify(patchify(y, 2), 2), y)


def test_the_release_layout_loads_and_reads_its_own_config(pair):
    """The original `Wan2.2_VAE.pth` names (ours) carry no config: widths, blocks, patches and
    statistics are read off the weights and the release."""
    _, dec, enc = pair
    sd = {**dec.state_dict(), **enc.state_dict()}
    assert "decoder.upsamples.0.upsamples.3.resample.1.weight" in sd
    assert "decoder.upsamples.0.upsamples.3.time_conv.weight" in sd
    assert "decoder.upsamples.2.upsamples.0.shortcut.weight" in sd
    assert "encoder.downsamples.1.downsamples.2.resample.1.weight" in sd
    assert not any("avg_shortcut" in k for k in sd)  # parameter-free
    assert vae_config_from_state_dict(sd, VAEConfig()) == CFG


def test_the_release_vae_loads_into_ours_at_full_size():
    """Every key and shape of diffusers' Wan 2.2 VAE, as its converter configures it, in ours
    (on the meta device: no weights)."""
    with torch.device("meta"):
        ref, dec, enc = diffusers_wan22_vae(), WanVAEDecoder(WAN22_VAE), WanVAEEncoder(WAN22_VAE)
    assert vae_config_from_json(dict(ref.config), VAEConfig()) == WAN22_VAE
    check_keys(dec, normalize_vae_state_dict(ref.state_dict(), WAN22_VAE), "diffusers Wan 2.2 VAE")
    check_keys(enc, encoder_state_dict(ref.state_dict(), WAN22_VAE), "diffusers Wan 2.2 VAE encoder")


def test_a_wan22_directory_is_the_5b_preset(tmp_path):
    """`--model DIR --preset wan2.2-ti2v-5b` with diffusers' configs: the 5B DiT, the Wan 2.2 VAE,
    1280x704 at 24 fps; sizes are multiples of 32 (16x VAE, 2x2 patches)."""
    with torch.device("meta"):
        diffusers_wan22_vae().save_config(tmp_path / "vae")
        diffusers.WanTransformer3DModel(**WAN22_5B_DIFFUSERS).save_config(tmp_path / "transformer")
    p = get_preset(ModelSpec(preset="wan2.2-ti2v-5b", path=str(tmp_path)))
    assert (p.dit, p.vae, p.default_size, p.fps) == (WAN22_5B, WAN22_VAE, (1280, 704), 24)
    # the card the supervisor plans by before any worker starts is the one the loaded model reports
    assert p.card() == preset_card("wan2.2-ti2v-5b")
    assert p.card().size_multiple == 32 and p.card().tokens_per_frame(1280, 704) == 880


def test_the_wan22_release_folder_loads_its_vae_and_reads_the_encoders_widths(pair, tmp_path):
    """Wan-Video/Wan2.2's TI2V 5B folder: `Wan2.2_VAE.pth` at the root, no `vae/config.json`. Both
    halves load from it, at the widths its weights have (these narrow ones, not the preset's
    160 and 256: the encoder's read off its own first conv), and decode and encode as the
    diffusers reference's modules do."""
    from streamdiff.models.presets import build_vae, build_vae_encoder

    ref, dec, enc = pair
    torch.save({**dec.state_dict(), **enc.state_dict()}, tmp_path / "Wan2.2_VAE.pth")
    spec = ModelSpec(preset="wan2.2-ti2v-5b", path=str(tmp_path), dtype="float32")
    vae, preset = build_vae(spec)
    encoder = build_vae_encoder(spec)
    assert preset.vae == CFG and encoder.cfg.base_dim == 8 and encoder.cfg == CFG
    z = torch.randn(1, 48, 2, 4, 6, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        # within float32's rounding: the served decoder runs its norms through the decode kernels
        torch.testing.assert_close(vae.decode(z, vae.new_state()), dec.decode(z, dec.new_state()), atol=1e-5, rtol=0)
        x = torch.rand(1, 3, 1, 64, 96, generator=torch.Generator().manual_seed(6)) * 2 - 1
        assert torch.equal(encoder.encode_image(x), enc.encode_image(x))
