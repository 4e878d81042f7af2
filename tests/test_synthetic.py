"""The synthetic grammar and its checker (streamdiff/synthetic.py): the checker reads back what
the generator drew — raw, and through H.264 (libx264 via PyAV, then decoded by FFmpeg) — and
tools/dev/check_video.py judges an MP4 against its prompt."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from streamdiff.synthetic import COLOURS, DIRECTIONS, SHAPES, Caption, check, clip, held_out_prompts

ROOT = Path(__file__).resolve().parents[1]


def test_the_grammar_round_trips_and_refuses_what_it_does_not_know():
    c = Caption("red", "ball", "left", "blue")
    assert c.prompt == "a red ball moving left on a blue background" and Caption.parse(c.prompt) == c
    for bad in (
        "a red ball moving left",
        "a pink ball moving left on a blue background",
        "a red cube moving up on a red background",
    ):
        with pytest.raises(ValueError):
            Caption.parse(bad)
    rng = random.Random(1)
    assert all(x.colour != x.background for x in (Caption.random(rng) for _ in range(200)))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("direction", sorted(DIRECTIONS))
def test_ground_truth_moves_the_right_way_and_stays_in_frame(shape, direction):
    c = clip(
        Caption("yellow", shape, direction, "black"), frames=48, rng=random.Random(hash((shape, direction)) % 1000)
    )
    dx, dy = DIRECTIONS[direction]
    move = c.centroids[-1] - c.centroids[0]
    assert np.sign(move[0]) == dx and np.sign(move[1]) == dy and np.abs(move).max() >= 40
    assert (c.boxes[:, :2] >= 0).all() and (c.boxes[:, 2] <= 256).all() and (c.boxes[:, 3] <= 144).all()
    drawn = (c.frames != np.array(COLOURS["black"], dtype=np.uint8)).any(-1)
    for i in (0, 47):
        ys, xs = np.nonzero(drawn[i])
        assert abs(xs.mean() + 0.5 - c.centroids[i][0]) < 0.01 and abs(ys.mean() + 0.5 - c.centroids[i][1]) < 0.01


def test_the_checker_reads_every_combination_back():
    rng = random.Random(7)
    for colour in COLOURS:
        for background in COLOURS:
            if colour == background:
                continue
            cap = Caption(colour, rng.choice(SHAPES), rng.choice(sorted(DIRECTIONS)), background)
            v = check(clip(cap, frames=24, rng=rng).frames)
            assert (v.colour, v.direction, v.background) == (colour, cap.direction, background), cap


def test_the_checker_reads_clips_through_h264_and_tools_check_video_judges_an_mp4(tmp_path):
    import av

    rng = random.Random(3)
    for k in range(12):
        cap = Caption.random(rng)
        c = clip(cap, frames=32, rng=rng)
        path = tmp_path / f"c{k}.mp4"
        with av.open(str(path), "w") as out:
            s = out.add_stream("libx264", rate=16)
            s.width, s.height, s.pix_fmt = 256, 144, "yuv420p"
            for f in c.frames:
                for pkt in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                    out.mux(pkt)
            for pkt in s.encode():
                out.mux(pkt)
        with av.open(str(path)) as mp4:
            frames = np.stack([f.to_ndarray(format="rgb24") for f in mp4.decode(mp4.streams.video[0])])
        v = check(frames)
        assert (v.colour, v.direction, v.background) == (cap.colour, cap.direction, cap.background), cap
    # The tool as a user runs it, on the last clip: its prompt passes, another colour's fails.
    tool = [sys.executable, str(ROOT / "tools/dev/check_video.py"), str(path)]
    ok = subprocess.run([*tool, cap.prompt], capture_output=True, text=True)
    assert ok.returncode == 0, (cap, ok.stdout, ok.stderr)
    assert json.loads(ok.stdout)["colour"] == cap.colour
    wrong = Caption(
        next(n for n in COLOURS if n not in (cap.colour, cap.background)), cap.shape, cap.direction, cap.background
    )
    assert subprocess.run([*tool, wrong.prompt], capture_output=True).returncode == 1


def test_noise_is_no_object():
    """The untrained default's frames (coloured noise) show no object, so the checker credits
    them with neither a colour nor a direction."""
    frames = np.random.default_rng(0).integers(0, 256, (24, 144, 256, 3), dtype=np.uint8)
    v = check(frames)
    assert (v.colour, v.direction) == (None, None) and v.object_pixels > 0.25


def test_tools_check_video_asks_a_running_daemon_for_the_held_out_prompts(plain_daemon):
    """`--url`: one streamed video per held-out prompt, each judged, then the shares right; the
    exit status is whether they clear the bars (here none: the default may be seeded)."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools/dev/check_video.py"), "--url", plain_daemon.url, "--held-out", "2"]
        + ["--seconds", "1", "--need-colour", "0", "--need-direction", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    held = held_out_prompts()
    assert [row["prompt"] for row in lines[:2]] == [held[0].prompt, held[1].prompt]
    assert all({"colour_ok", "direction_ok", "background"} <= set(row) for row in lines[:2])
    assert lines[2]["prompts"] == 2 and 0 <= lines[2]["colour"] <= 1 and lines[2]["size"] == "256x144"
    bad = subprocess.run(
        [sys.executable, str(ROOT / "tools/dev/check_video.py"), "--url", plain_daemon.url, "--held-out", "49"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--held-out must be 1-48" in bad.stderr


def test_a_clip_at_spread_zero_is_a_function_of_its_prompt():
    """At spread 0 every draw of a caption is the same clip: 28 px, 1.5 px a frame, from the middle
    of the edge it moves away from; at the default spread 1 draws differ."""
    cap = Caption("red", "ball", "down", "blue")
    a, b = (clip(cap, frames=33, rng=random.Random(s), spread=0.0) for s in (1, 2))
    assert (a.frames == b.frames).all()
    x0, y0, x1, y1 = a.boxes[0]
    assert (x1 - x0, y0) == (28, 0) and abs((x0 + x1) / 2 - 128) <= 1
    assert abs(a.centroids[-1][1] - a.centroids[0][1] - 1.5 * 32) <= 1
    left = clip(Caption("red", "ball", "left", "blue"), frames=33, rng=random.Random(1), spread=0.0)
    assert left.boxes[0][2] == 256 and abs((left.boxes[0][1] + left.boxes[0][3]) / 2 - 72) <= 1
    c, d = (clip(cap, frames=33, rng=random.Random(s)) for s in (1, 2))
    assert not (c.frames == d.frames).all()
