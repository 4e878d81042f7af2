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


@pytest.fixture(scope="module")
def longlive2(tmp_path_factory):
    """LongLive 2.0's tiny model in its checkpoint's layout, and one daemon serving it for the
    module's tests."""
    from .published import Bases, write_published

    root = tmp_path_factory.mktemp("longlive2")
    pub = write_published("longlive2-5b", root, Bases(root))
    d = Daemon(*pub.flags, "--mode", "aggregated", "--dit-gpus", "1", "--vae-gpus", "1", "--size", "128x64")
    try:
        yield d, pub
    finally:
        assert d.stop() == 0, d.logs()


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
    # the same latents decoded in bands and whole (by `generate`), through the same H.264 encoder
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


def test_longlive2_from_a_picture_streams_what_generate_writes(longlive2, tmp_path):
    """LongLive 2.0's image-to-video: the picture is the first latent frame of the first block,
    held clean through its steps (no block of its own): exact frames, the video generate writes
    for the same request, and not the text-to-video of the same seed."""
    import base64

    from .helpers import generate_here, http
    from .test_daemon_i2v import picture

    d, pub = longlive2
    (tmp_path / "start.png").write_bytes(picture(96, 80))
    url = "data:image/png;base64," + base64.b64encode(picture(96, 80)).decode()
    body = {"prompt": "a red fox", "num_frames": 61, "size": "128x64", "seed": 4, "input_reference": url}
    assert http.get(d.url + "/v1/models", timeout=10).json()["data"][0]["image_to_video"] is True
    video, _, _ = stream_video(d.url, body)
    text, _, _ = stream_video(d.url, {k: v for k, v in body.items() if k != "input_reference"})
    check_video(video, 61, 128, 64, 24, blocks_expected=2)  # 1 + 15 latent frames: two blocks of 8
    assert video != text
    out = tmp_path / "out.mp4"
    status, _, err = generate_here(
        *pub.flags, "--prompt", "a red fox", "--num-frames", "61", "--size", "128x64", "--seed", "4",
        "--image", str(tmp_path / "start.png"), "-o", str(out),
    )  # fmt: skip
    assert status == 0, err
    assert out.read_bytes() == video


def test_longlive2_storyboard_cuts_over_the_kept_history(longlive2, tmp_path):
    """A storyboard of a shot, a cut and a continue on longlive2-5b: the cut is LongLive 2.0's
    shot transition (tests/models/test_multishot.py holds it to the authors' loop), planned as a
    continuing scene (the VAE goes on: 4 frames a latent frame) and told to the DiT. Exact frames,
    one fragment per block, each scene marked with its transition; the bytes `generate` writes
    for the same storyboard; and not the video of the same storyboard with the cut a continue."""
    import json

    import numpy as np

    from .helpers import decode, generate_here

    d, pub = longlive2
    scenes = [
        {"prompt": "a red fox runs through snow", "num_frames": 29},  # 1 + 7 latent frames: a block
        {"prompt": "a city at night", "num_frames": 18, "transition": "cut"},  # 5 of a block of 8
        {"prompt": "the city in rain", "num_frames": 16, "transition": "continue"},  # 4 of a block
    ]
    body = {"scenes": scenes, "size": "128x64", "seed": 4}
    flat = {**body, "scenes": [scenes[0], {**scenes[1], "transition": "continue"}, scenes[2]]}
    video, _, _ = stream_video(d.url, body)
    continued, _, _ = stream_video(d.url, flat)
    frags, _ = check_video(video, 63, 128, 64, 24, blocks_expected=3)
    marks = [e["message"] for f in frags for e in f["emsg"] if e["scheme"] == "urn:streamdiff:scene:2026"]
    assert [(m["scene"], m["transition"], m["start_frame"]) for m in marks] == [
        (0, "cut", 0), (1, "cut", 29), (2, "continue", 47)
    ]  # fmt: skip
    # the first shot's block is the same; from the cut on, another picture
    a, b = (np.stack(decode(v)["pixels"]).astype(np.int16) for v in (video, continued))
    assert np.array_equal(a[:29], b[:29]) and np.abs(a[29:] - b[29:]).mean() > 1.0
    (tmp_path / "story.json").write_text(json.dumps(body))
    out = tmp_path / "out.mp4"
    status, _, err = generate_here(
        *pub.flags, "--scenes", str(tmp_path / "story.json"), "--size", "128x64", "--seed", "4", "-o", str(out)
    )
    assert status == 0, err
    assert out.read_bytes() == video
