"""What the trained embedded default draws, read back by the grammar's checker (synthetic.check)
from the streamed H.264: a storyboard's cuts show each scene's background with an object on it,
a live cut changes the picture at the frame it was acknowledged for, within one block. (That a
VAE split across two or three shards decodes the picture one shard does is held on the layouts'
own daemons: `assert_draws_the_picture`, tests/test_daemon_stream.py and test_daemon_sharded.py.)
Seeded weights draw noise, which none of this can see; these tests are what the trained weights
are for (issue 36).

What the shipped weights do not draw yet is held here too, as strict xfails that fail the run
the day they pass: the object's colour (12.5% right on the 24 held-out prompts through the
daemon: a red ball on blue reads purple, its colour blended with the background's), and a
steer that continues the shot (the DiT follows the picture in its cache, not the new prompt)."""

from __future__ import annotations

import pytest

from streamdiff.synthetic import Caption, check

from .helpers import decode, fragments, http, needs_trained, shared_daemon, stream_video, wait_until
from .test_live import Reader

pytestmark = needs_trained

BLOCK = 12  # frames of a steady-state block (3 latent frames)

COLOUR_NOT_LEARNT = pytest.mark.xfail(
    strict=True,
    reason="issue 36: the shipped DiT draws the object's place, motion and background, not its colour "
    "(12.5% of colours right on the held-out prompts), and a continued steer keeps the cached picture",
)


def verdict(frames, prompt: str) -> tuple[tuple[str | None, str | None], tuple[str, str]]:
    want, got = Caption.parse(prompt), check(frames)
    return (got.colour, got.direction), (want.colour, want.direction)


STORY = {
    "scenes": [
        {"prompt": "a red ball moving right on a blue background", "seconds": 2},
        {"prompt": "a yellow square moving up on a black background", "seconds": 2, "transition": "cut"},
        {"prompt": "a white ball moving left on a green background", "seconds": 2, "transition": "cut"},
    ],
    "size": "256x144",
    "seed": 5,
}


@pytest.fixture(scope="module")
def story():
    """STORY streamed once by the run's shared plain daemon: each scene's frames."""
    url = shared_daemon().url
    data, _, headers = stream_video(url, STORY)
    job = http.get(f"{url}/v1/videos/{headers['x-video-id']}", timeout=10).json()
    frames = decode(data)["pixels"]
    starts = [s["start_frame"] for s in job["scenes"]] + [len(frames)]
    return [frames[starts[i] : starts[i + 1]] for i in range(len(STORY["scenes"]))]


def test_a_storyboards_cuts_show_each_scenes_background_with_an_object(story):
    for i, scene in enumerate(STORY["scenes"]):
        got, want = check(story[i]), Caption.parse(scene["prompt"])
        assert got.background == want.background and got.colour is not None, (i, scene["prompt"], got)


@COLOUR_NOT_LEARNT
def test_a_storyboards_scenes_show_their_colours_and_directions(story):
    for i, scene in enumerate(STORY["scenes"]):
        got, want = verdict(story[i], scene["prompt"])
        assert got == want, (i, scene["prompt"], got)


def steered(daemon, first: str, then: dict) -> tuple[list, int]:
    """A live video of `first`, steered to `then` once two fragments have arrived, stopped a
    few blocks later: (its frames, the frame the steer was acknowledged for)."""
    reader = Reader(daemon.url, {"prompt": first, "live": True, "size": "256x144", "seed": 3, "seconds": 20})
    reader.start()
    wait_until(lambda: reader.fragment_count() >= 2, 60)
    steer = http.post(f"{daemon.url}/v1/videos/{reader.video_id}/scenes", json=then, timeout=10)
    assert steer.status_code == 200, steer.text
    at = steer.json()["start_frame"]
    wait_until(lambda: sum(f["samples"] for f in fragments(bytes(reader.data)) if "end" in f) >= at + 3 * BLOCK, 60)
    assert http.post(f"{daemon.url}/v1/videos/{reader.video_id}/stop", timeout=10).status_code == 200
    reader.join(60)
    return decode(bytes(reader.data))["pixels"], at


@pytest.mark.timeout(180)
def test_a_live_cut_changes_the_background_at_its_acknowledged_frame(plain_daemon):
    first, then = "a red ball moving right on a blue background", "a yellow ball moving right on a green background"
    frames, at = steered(plain_daemon, first, {"prompt": then, "transition": "cut"})
    before, after = check(frames[max(0, at - 2 * BLOCK) : at]), check(frames[at : at + BLOCK])
    assert (before.background, after.background) == ("blue", "green"), (at, before, after)


@COLOUR_NOT_LEARNT
@pytest.mark.timeout(180)
def test_a_live_steer_changes_the_colour_at_its_acknowledged_frame(plain_daemon):
    first, then = "a red ball moving right on a blue background", "a yellow ball moving right on a blue background"
    frames, at = steered(plain_daemon, first, {"prompt": then})
    before, _ = verdict(frames[max(0, at - 2 * BLOCK) : at], first)
    after, want = verdict(frames[at + BLOCK : at + 3 * BLOCK], then)
    assert before[0] == "red" and after[0] == want[0], (at, before, after)


def test_the_daemon_says_it_serves_the_shipped_weights(plain_daemon):
    from streamdiff.supervisor.core import describe_loaded

    model = http.get(f"{plain_daemon.url}/health", timeout=10).json()["model"]
    assert (model["trained"], model["decoder"]["trained"]) == ("tiny-dit.safetensors", "tiny-vae.safetensors")
    line = describe_loaded(model)
    assert "embedded trained weights (tiny-dit.safetensors)" in line and "decoder wan (tiny-vae.safetensors)" in line
