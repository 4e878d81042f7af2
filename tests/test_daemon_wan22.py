"""End to end, the Wan 2.2 family: streamdiffd serving a tiny TI2V-5B-shaped release in the
diffusers layout (48 latent channels, the Wan 2.2 VAE's residual stages and 2x2 patches, 16x in
space) streams exactly the frames asked for at 24 fps, its VAE height-sharded over two workers,
and the video equals the one an unsharded daemon streams; and with `--decoder taehv`, a file in
taew2_2's layout decodes the same latents."""

from __future__ import annotations

import json

import pytest
import torch

from streamdiff.models.wan.vae import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD

from .helpers import Daemon, assert_same_as_one_dit_and_vae, check_video, stream_video
from .models.conftest import SMALL_DIT
from .models.test_loading import T5_TINY

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """Wan-AI/Wan2.2-TI2V-5B-Diffusers' layout, narrowed: the DiT at SMALL_DIT's widths on 48
    channels, the VAE at widths 8 (encoder) and 12 (decoder), umT5 tiny."""
    from transformers import UMT5Config, UMT5EncoderModel

    from streamdiff.testing import write_tokenizer

    d = tmp_path_factory.mktemp("wan22") / "Wan2.2-TI2V-5B"
    torch.manual_seed(0)
    diffusers.WanTransformer3DModel(**{**SMALL_DIT, "in_channels": 48, "out_channels": 48}).eval().save_pretrained(
        str(d / "transformer")
    )
    diffusers.AutoencoderKLWan(
        base_dim=8,
        decoder_base_dim=12,
        z_dim=48,
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_temporal=4,
        scale_factor_spatial=16,
        latents_mean=list(WAN22_LATENTS_MEAN),
        latents_std=list(WAN22_LATENTS_STD),
    ).eval().save_pretrained(str(d / "vae"))
    UMT5EncoderModel(UMT5Config(**T5_TINY)).eval().save_pretrained(str(d / "text_encoder"))
    write_tokenizer(d / "tokenizer")
    (d / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    return d


def test_the_5b_streams_24_fps_sharded_equal_to_unsharded(release):
    """33 frames: 1 + 8 latent frames, three blocks of 3; 128x64 is 4 latent rows, 2 a shard."""
    body = {"prompt": "a red fox runs through snow", "num_frames": 33, "size": "128x64", "seed": 3}
    flags = ("--preset", "wan2.2-ti2v-5b", "--model", str(release), "--size", "128x64")
    sharded = Daemon(*flags, "--dit-gpus", "1", "--vae-gpus", "2")
    try:
        assert sharded.health()["model"]["preset"] == "wan2.2-ti2v-5b"
        got, _, _ = stream_video(sharded.url, body)
    finally:
        assert sharded.stop() == 0, sharded.logs()
    check_video(got, 33, 128, 64, 24, blocks_expected=3)
    # the same latents decoded in bands and whole, through the same H.264 encoder
    assert_same_as_one_dit_and_vae(got, body, *flags, min_psnr_db=40.0)


def test_the_5b_decodes_with_taew2_2(release, tmp_path):
    from streamdiff.models.wan.taehv import TAEW2_2, random_taehv

    weights = tmp_path / "taew2_2.pth"
    torch.save(random_taehv(TAEW2_2, seed=4).state_dict(), weights)
    flags = ("--preset", "wan2.2-ti2v-5b", "--model", str(release), "--size", "128x64", "--decoder", "taehv")
    d = Daemon(*flags, "--decoder-weights", str(weights))
    try:
        assert d.health()["model"]["decoder"]["name"] == "taehv"
        got, _, _ = stream_video(d.url, {"prompt": "a red fox", "num_frames": 33, "size": "128x64"})
    finally:
        assert d.stop() == 0, d.logs()
    check_video(got, 33, 128, 64, 24, blocks_expected=3)
