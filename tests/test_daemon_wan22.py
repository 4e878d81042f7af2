"""End to end, the Wan 2.2 family: streamdiffd serving a tiny TI2V-5B-shaped release in the
diffusers layout (48 latent channels, the Wan 2.2 VAE's residual stages and 2x2 patches, 16x in
space) streams exactly the frames asked for at 24 fps, its VAE height-sharded over two workers,
and the video equals the one an unsharded daemon streams; and with `--decoder taehv`, a file in
taew2_2's layout decodes the same latents."""

from __future__ import annotations

import pytest
import torch

from .helpers import Daemon, assert_same_as_one_dit_and_vae, check_video, stream_video

pytest.importorskip("diffusers")
from .published import write_base  # noqa: E402


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """Wan-AI/Wan2.2-TI2V-5B-Diffusers' layout, narrowed (tests/published.py)."""
    return write_base(tmp_path_factory.mktemp("wan22"), "wan2.2-ti2v-5b")


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
