"""What the trained embedded default draws, read back by the grammar's checker (synthetic.check)
from the streamed H.264: a storyboard's scenes show their colours and directions, a live steer
changes the object's colour at the frame it was acknowledged for, within one block. (That a VAE
split across two or three shards decodes the picture one shard does is held on the layouts'
own daemons: `assert_draws_the_picture`, tests/test_daemon_stream.py and test_daemon_sharded.py.)
Seeded weights draw noise, which none of this can see; these tests are what the trained weights
are for (issue 36)."""

from __future__ import annotations

import httpx
import pytest

from streamdiff.synthetic import Caption, check

from .helpers import decode, fragments, needs_trained, stream_video, wait_until
from .test_live import Reader

pytestmark = needs_trained

BLOCK = 12  # frames of a steady-state block (3 latent frames)


def verdict(frames, prompt: str) -> tuple[tuple[str | None, str | None], tuple[str, str]]:
    want, got = Caption.parse(prompt), check(frames)
    return (got.colour, got.direction), (want.colour, want.direction)


@pytest.fixture
def daemon(plain_daemon):
    return plain_daemon  # the run's shared plain daemon, idle (tests/conftest.py)


STORY = {
    "scenes": [
        {"prompt": "a red ball moving right on a blue background", "seconds": 2},
        {"prompt": "a yellow square moving up on a black background", "seconds": 2, "transition": "cut"},
        {"prompt": "a white ball moving left on a green background", "seconds": 2, "transition": "cut"},
    ],
    "size": "256x144",
    "seed": 5,
}


def test_a_storyboards_scenes_show_their_colours_and_directions(daemon):
    data, _, headers = stream_video(daemon.url, STORY)
    job = httpx.get(f"{daemon.url}/v1/videos/{headers['x-video-id']}", timeout=10).json()
    frames = decode(data)["pixels"]
    starts = [s["start_frame"] for s in job["scenes"]] + [len(frames)]
    for i, scene in enumerate(STORY["scenes"]):
        got, want = verdict(frames[starts[i] : starts[i + 1]], scene["prompt"])
        assert got == want, (i, scene["prompt"], got)


@pytest.mark.timeout(180)
def test_a_live_steer_changes_the_colour_at_its_acknowledged_frame(daemon):
    first, then = "a red ball moving right on a blue background", "a yellow ball moving right on a blue background"
    reader = Reader(daemon.url, {"prompt": first, "live": True, "size": "256x144", "seed": 3, "seconds": 20})
    reader.start()
    wait_until(lambda: reader.fragment_count() >= 2, 60)
    steer = httpx.post(f"{daemon.url}/v1/videos/{reader.video_id}/scenes", json={"prompt": then}, timeout=10)
    assert steer.status_code == 200, steer.text
    at = steer.json()["start_frame"]
    wait_until(lambda: sum(f["samples"] for f in fragments(bytes(reader.data)) if "end" in f) >= at + 3 * BLOCK, 60)
    assert httpx.post(f"{daemon.url}/v1/videos/{reader.video_id}/stop", timeout=10).status_code == 200
    reader.join(60)
    frames = decode(bytes(reader.data))["pixels"]
    before, _ = verdict(frames[max(0, at - 2 * BLOCK) : at], first)
    after, want = verdict(frames[at + BLOCK : at + 3 * BLOCK], then)
    assert before[0] == "red" and after[0] == want[0], (at, before, after)
