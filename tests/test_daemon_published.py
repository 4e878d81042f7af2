"""End to end, every published preset: streamdiffd serving a tiny model written in that
checkpoint's real layout (tests/published.py) streams to `curl -N` while it is generated, with
exactly the frames asked for (ffprobe), one fragment per block; frame-wise and few-step presets
at 256x144. /v1/models and /health say what was loaded."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess

import msgspec
import pytest

from streamdiff.controls import CONTROL_SCHEME, SPACES
from streamdiff.models.catalog import CHECKPOINT_PRESETS
from streamdiff.models.spec import preset_card

from .helpers import Daemon, http
from .published import Bases, write_published
from .test_daemon_i2v import picture
from .test_daemon_stream import check_video

pytest.importorskip("diffusers")
pytest.importorskip("peft")
if shutil.which("curl") is None:
    pytest.skip("curl is not installed", allow_module_level=True)

# Frame-wise presets at the 256x144; chunk-wise ones at a smaller size, to keep CI short.
SIZE = {name: "256x144" if p.frames_per_block == 1 else "128x64" for name, p in CHECKPOINT_PRESETS.items()}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return Bases(tmp_path_factory.mktemp("published-daemon"))


def curl_stream(url: str, body: dict, out) -> bytes:
    """The README's client: `curl -N -X POST .../v1/videos -d ... -o out.mp4`."""
    r = subprocess.run(
        ["curl", "-sSN", "--fail-with-body", "-X", "POST", url + "/v1/videos", "-H", "Content-Type: application/json",
         "-d", json.dumps({**body, "stream": True}), "-o", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, (r.returncode, r.stderr, out.read_bytes()[:500] if out.exists() else b"")
    return out.read_bytes()


@pytest.mark.parametrize("preset", list(CHECKPOINT_PRESETS))
def test_every_preset_streams_exact_frames_to_curl(preset, bases, tmp_path):
    pub = write_published(preset, tmp_path, bases)
    cp, size = CHECKPOINT_PRESETS[preset], SIZE[preset]
    w, h = map(int, size.split("x"))
    d = Daemon(*pub.flags, "--mode", "aggregated", "--dit-gpus", "1", "--vae-gpus", "1", "--size", size)
    try:
        model = http.get(d.url + "/v1/models", timeout=10).json()["data"][0]
        loaded, card = model["loaded"], model["card"]
        # the card the worker reports is the preset's, but for the tiny widths its weights were built at
        want = {k: v for k, v in msgspec.to_builtins(preset_card(preset)).items() if k != "dims"}
        assert {k: v for k, v in card.items() if k not in ("dims", "default_size")} == {
            k: v for k, v in want.items() if k != "default_size"
        }
        assert loaded["preset"] == preset and loaded["checkpoint"] == str(pub.files["checkpoint"])
        assert loaded["weights"] == cp.weights and loaded["sampler"]["steps"] == list(cp.steps)
        assert d.health()["model"] == loaded
        assert loaded["compile"] == {
            "mode": "auto",
            "on": False,
            "why": "auto: eager on the CPU",
            "graphs": 0,
            "compile_s": 0.0,
        }
        # a cut storyboard: two shots, the second scene's frames off the first's block grid
        fps = preset_card(preset).fps
        body = {
            "scenes": [
                {"prompt": "a red fox runs through snow", "num_frames": 29},
                {"prompt": "a city at night", "num_frames": 18, "transition": "cut", "seed": 5},
            ],
            "size": size,
            "fps": fps,
            "seed": 3,
        }
        fpb = cp.frames_per_block
        if cp.image == "condition":  # Matrix-Game: one shot from a picture, driven by a control script
            refused = http.post(d.url + "/v1/videos", json={**body, "scenes": body["scenes"][:1]}, timeout=10)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "input_reference"
            space = SPACES[cp.controls]
            step = {"keyboard": [space.keys[1]], **({"mouse": [0.05, -0.05]} if space.mouse else {})}
            url = "data:image/png;base64," + base64.b64encode(picture(96, 80)).decode()
            body = {"prompt": "a path", "num_frames": 29, "size": size, "fps": fps, "seed": 3, "input_reference": url,
                    "controls": [{"seq": 1, "mode": "script", "per": "block", "script": [{}, step, {}]}]}  # fmt: skip
            data = curl_stream(d.url, body, tmp_path / "out.mp4")
            frags, _ = check_video(data, 29, w, h, fps, blocks_expected=-(-8 // fpb))  # 1 + 7 latent frames
            assert all(any(e["scheme"] == CONTROL_SCHEME for e in f["emsg"]) for f in frags)
            return
        if cp.shot_offset:  # LongLive 2.0: the cut is a shot transition over the kept history, the
            # VAE going on (test_daemon_wan22.py): 1 + 7 latent frames, then 18 frames in 5
            blocks = -(-8 // fpb) + -(-5 // fpb)
        else:  # whole blocks: 29 frames are 1 + 7 latent frames, 18 are 1 + 5, each shot rounded up
            blocks = -(-8 // fpb) + -(-6 // fpb)
        data = curl_stream(d.url, body, tmp_path / "out.mp4")
        check_video(data, 29 + 18, w, h, fps, blocks_expected=blocks)  # ffprobe's count too
    finally:
        assert d.stop() == 0, d.logs()
