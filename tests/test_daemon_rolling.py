"""End to end: streamdiffd serving the `rolling-forcing` preset (Rolling Forcing's sampler) on a
tiny Wan release plus a generator checkpoint, streams every frame asked for, one fragment per
finished block, for a fixed-length video (the window fills, slides and drains) and a storyboard
with a prompt switch and a cut (the window goes on under the new prompt, then restarts), and a
live video steered and stopped."""

from __future__ import annotations

import json

import pytest
import torch

from .helpers import Daemon, check_video, decode, ffprobe, http, stream_video, wait_until, write_tokenizer
from .test_live import Reader

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from .models.conftest import SMALL_DIT, perturb_  # noqa: E402
from .models.test_loading import T5_TINY  # noqa: E402


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A diffusers-layout Wan release of tiny dimensions and Rolling Forcing's file layout:
    the generator under `generator_ema` with the `model.` prefix of the authors' wrapper."""
    from streamdiff.models.presets import ModelSpec, build_dit

    root = tmp_path_factory.mktemp("rolling")
    torch.manual_seed(0)
    dit = diffusers.WanTransformer3DModel(**SMALL_DIT).eval()
    perturb_(dit, 0.1, 1)
    vae = diffusers.AutoencoderKLWan(base_dim=8, num_res_blocks=2).eval()
    perturb_(vae, 0.05, 2)
    t5 = transformers.UMT5EncoderModel(transformers.UMT5Config(**T5_TINY)).eval()
    d = root / "wan"
    dit.save_pretrained(str(d / "transformer"))
    vae.save_pretrained(str(d / "vae"))
    t5.save_pretrained(str(d / "text_encoder"))
    write_tokenizer(d / "tokenizer")
    (d / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    ours, _ = build_dit(ModelSpec(preset="wan2.1-t2v-1.3b", path=str(d)))
    perturb_(ours, 0.02, 5)  # the distilled generator differs from the base
    torch.save({"generator_ema": {f"model.{k}": v for k, v in ours.state_dict().items()}}, root / "rolling.pt")
    return d, root / "rolling.pt"


@pytest.fixture(scope="module")
def daemon(release):
    wan, ckpt = release
    d = Daemon("--preset", "rolling-forcing", "--model", str(wan), "--dit-checkpoint", str(ckpt), "--size", "64x64")
    yield d
    assert d.stop() == 0, d.logs()


def test_fixed_length_video_streams_every_frame(daemon):
    # 69 frames: 18 latent frames, 6 blocks of 3 (one more than the window of 5 blocks).
    body = {"prompt": "a lighthouse in a storm", "num_frames": 69, "size": "64x64", "fps": 16, "seed": 3}
    data, _, _ = stream_video(daemon.url, body)
    check_video(data, 69, 64, 64, 16, blocks_expected=6)
    probe = ffprobe(data)
    assert probe is None or probe["frames"] == 69


def test_storyboard_with_a_switch_and_a_cut(daemon):
    story = {
        "scenes": [
            {"prompt": "a red fox runs through snow", "num_frames": 33},  # 9 latent frames: 3 blocks
            {"prompt": "the fox reaches a lake", "num_frames": 12, "transition": "continue"},  # 1 block
            {"prompt": "a city street at night", "num_frames": 21, "transition": "cut", "seed": 9},  # 2 blocks
        ],
        "size": "64x64",
        "fps": 16,
        "seed": 42,
    }
    data, _, _ = stream_video(daemon.url, story)
    check_video(data, 33 + 12 + 21, 64, 64, 16, blocks_expected=6)


def test_live_video_steered_and_stopped(daemon):
    """Open-ended: blocks keep entering the window until the stop; a re-cached prompt switch and
    a cut on the way; every frame up to the stop arrives."""
    url = daemon.url
    reader = Reader(url, {"prompt": "a red ball", "live": True, "size": "64x64", "seed": 3, "seconds": 30})
    reader.start()
    wait_until(lambda: reader.fragment_count() >= 2, 120)
    vid = reader.video_id
    first = http.post(f"{url}/v1/videos/{vid}/scenes", json={"prompt": "a blue square", "recache": True}, timeout=10)
    assert first.status_code == 200, first.text
    wait_until(lambda: reader.fragment_count() >= 4, 120)
    second = http.post(f"{url}/v1/videos/{vid}/scenes", json={"prompt": "green", "transition": "cut"}, timeout=10)
    assert second.status_code == 200, second.text
    wait_until(lambda: reader.fragment_count() >= 7, 120)
    stopped = http.post(f"{url}/v1/videos/{vid}/stop", timeout=10)
    assert stopped.status_code == 200, stopped.text
    frames = stopped.json()["num_frames"]
    reader.join(120)
    assert reader.status == 200 and reader.error is None
    assert second.json()["start_frame"] < frames < 30 * 16
    data = bytes(reader.data)
    dec = decode(data)
    assert (dec["frames"], dec["width"], dec["height"]) == (frames, 64, 64)
    probe = ffprobe(data)
    assert probe is None or probe["frames"] == frames
