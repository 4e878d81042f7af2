"""Every feature of the embedded default on every layout the planner can choose: a storyboard
(text, a continue that re-caches its prompt, a cut), image-to-video (the picture's latent is the
shot's first block, and with a VAE cut the DiT runs the cut's stages on it too) and a steer that
lands while the storyboard plays. Each layout's daemon streams the video `streamdiffd generate`
writes for the same request (one DiT and one whole decoder), on a fixed layout, a cut, an
adapting cut (what the planner gives a planned cut), a VAE group of two, a DiT group of two,
aggregated, hybrid, two workers lending each other their cores, and with TAEHV.

The world models' controls on the layouts are tests/test_daemon_world.py's (their own preset)."""

from __future__ import annotations

import base64

import pytest

from .helpers import (
    DEFAULT_LAYOUT,
    Daemon,
    assert_same_video,
    check_video,
    generated,
    http,
    shared_daemon,
    wait_until,
)
from .test_daemon_i2v import picture
from .test_live import Reader

LAYOUTS = {
    "fixed": list(DEFAULT_LAYOUT),
    "cut": [*DEFAULT_LAYOUT, "--vae-cut", "3"],
    "adapting-cut": [*DEFAULT_LAYOUT, "--vae-cut", "1", "--vae-cut-adapt"],
    "vae-group": ["--dit-gpus", "1", "--vae-gpus", "2"],
    "dit-group": ["--dit-gpus", "2", "--dit-group-size", "2", "--vae-gpus", "1"],
    "aggregated": ["--mode", "aggregated", "--dit-gpus", "1", "--vae-gpus", "1"],
    "hybrid": ["--mode", "hybrid", "--dit-gpus", "1", "--vae-gpus", "2"],
    "shared-cores": [*DEFAULT_LAYOUT, "--share-cores"],
    "taehv": ["--decoder", "taehv", *DEFAULT_LAYOUT],
}

SIZE = "128x64"
STORY = {
    "scenes": [
        {"prompt": "a harbour at dawn", "num_frames": 17},
        {"prompt": "boats leave the harbour", "num_frames": 16, "transition": "continue", "recache": True},
        {"prompt": "a desert road", "num_frames": 16, "transition": "cut", "seed": 9},
    ],
    "size": SIZE,
    "seed": 4,
}
FRAMES = 17 + 16 + 16


def decoder_flags(layout: str) -> tuple[str, ...]:
    """What the reference is made with: the layout's decoder (its layout flags are not the
    reference's business: generate runs one DiT and one whole decoder)."""
    return ("--decoder", "taehv") if "--decoder" in LAYOUTS[layout] else ()


_REFS: dict = {}


def reference(body: dict, layout: str, image: bytes | None = None, tmp=None) -> bytes:
    key = (repr(sorted(body.items())), decoder_flags(layout), image is not None)
    if key not in _REFS:
        flags = list(decoder_flags(layout))
        if image is not None:
            path = tmp / "start.png"
            path.write_bytes(image)
            flags += ["--image", str(path)]
        _REFS[key] = generated(body, *flags)
    return _REFS[key]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request):
    if LAYOUTS[request.param] == list(DEFAULT_LAYOUT):  # the run's shared plain daemon is this one
        yield request.param, shared_daemon()
        return
    d = Daemon(*LAYOUTS[request.param])
    yield request.param, d
    health = d.health()
    assert d.stop() == 0, d.logs()
    assert d.segments() == []
    assert all(w["restarts"] == 0 for w in health["workers"].values()), health["workers"]


def stream(url: str, body: dict) -> bytes:
    with http.stream("POST", url + "/v1/videos", json={**body, "stream": True}, timeout=300) as r:
        data = r.read()
        assert r.status_code == 200, data[:500]
    return data


@pytest.mark.timeout(300)
def test_a_storyboard_with_a_recache_and_a_cut(layout):
    name, d = layout
    got = stream(d.url, STORY)
    check_video(got, FRAMES, 128, 64, 16)
    assert_same_video(got, reference(STORY, name))


@pytest.mark.timeout(300)
def test_image_to_video(layout, tmp_path):
    """The picture starts the first shot, and the storyboard goes on through a cut."""
    name, d = layout
    png = picture(96, 80)
    body = {**STORY, "input_reference": "data:image/png;base64," + base64.b64encode(png).decode()}
    got = stream(d.url, body)
    check_video(got, FRAMES, 128, 64, 16)
    assert_same_video(got, reference(STORY, name, png, tmp_path))
    assert got != reference(STORY, name)  # the picture is used


@pytest.mark.timeout(300)
def test_a_steer_lands_where_it_says(layout):
    """A storyboard steered while it plays is the storyboard of the scenes its video object
    reports (the steer's scene from the frame it was acknowledged for)."""
    name, d = layout
    body = {"scenes": [{"prompt": "one", "num_frames": 81}], "size": SIZE, "seed": 5}
    reader = Reader(d.url, body)
    reader.start()
    wait_until(lambda: reader.video_id is not None and reader.fragment_count() >= 1, 120)
    r = http.post(f"{d.url}/v1/videos/{reader.video_id}/scenes", json={"prompt": "two", "recache": True}, timeout=10)
    assert r.status_code == 200, r.text
    reader.join(300)
    assert reader.status == 200 and reader.error is None
    video = http.get(f"{d.url}/v1/videos/{reader.video_id}", timeout=10).json()
    scenes = [
        {"prompt": s["prompt"], "num_frames": s["num_frames"], "transition": s["transition"], "recache": s["recache"]}
        for s in video["scenes"]
    ]
    assert [s["prompt"] for s in scenes] == ["one", "two"]
    assert video["scenes"][1]["start_frame"] == r.json()["start_frame"]
    got = bytes(reader.data)
    check_video(got, 81, 128, 64, 16)
    assert_same_video(got, reference({"scenes": scenes, "size": SIZE, "seed": 5}, name))
