"""The daemon with the VAE decoder cut between stages (`--vae-cut N`): the DiT worker runs the
decoder's first N stages on each block and the VAE worker the rest. The video equals one DiT
and one whole VAE (continue, re-cache and cut included), two sessions at once keep their own
stage caches on both sides, and cuts it cannot run are refused with the reason."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from .helpers import (
    SHORT_STORY,
    Daemon,
    assert_same_as_one_dit_and_vae,
    assert_same_video,
    check_video,
    leave_mid_stream,
    refused,
    stream_video,
)


@pytest.fixture(scope="module")
def cut4():
    d = Daemon("--dit-gpus", "1", "--vae-gpus", "1", "--vae-cut", "4")
    yield d
    assert d.stop() == 0, d.logs()
    assert d.segments() == []


@pytest.mark.timeout(300)
def test_a_cut_decoder_streams_the_same_video_as_a_whole_one(cut4):
    assert cut4.health()["pipeline"]["vae_cut"] == 4
    got, _, _ = stream_video(cut4.url, SHORT_STORY)
    check_video(got, 48, 256, 144, 16)
    assert_same_as_one_dit_and_vae(got, SHORT_STORY)


@pytest.mark.timeout(300)
def test_two_sessions_at_once_keep_their_own_stage_caches(cut4):
    """Run together (where the DiT batches their blocks, the DiT worker runs both sessions'
    first stages in one call, each with its own caches: tests/parallel/test_stage_batches.py's
    k1-cut proves that call; whether they batch is the scheduler's timing-driven choice,
    tests/test_scheduler_policy.py), each session's video equals itself alone."""
    bodies = [  # 7 blocks each: with 3, a second request that started a few blocks late met no block to share
        {"prompt": "a red fox", "num_frames": 81, "size": "128x64", "seed": 1},
        {"prompt": "a city street", "num_frames": 81, "size": "128x64", "seed": 2},
    ]
    alone = [stream_video(cut4.url, b)[0] for b in bodies]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda b: stream_video(cut4.url, b)[0], bodies))
    for a, t in zip(alone, together, strict=True):
        check_video(t, 81, 128, 64, 16)
        assert_same_video(t, a)
    assert all(w["restarts"] == 0 for w in cut4.health()["workers"].values())


@pytest.mark.timeout(300)
def test_a_session_cancelled_mid_stream_leaves_no_stage_cache_behind(cut4):
    """A client leaves mid-stream: its session's stage caches go on both workers, and the next
    stream with the same request equals the same request made before, byte for byte or frame
    by frame."""
    body = {"prompt": "a quiet lake", "num_frames": 49, "size": "128x64", "seed": 5}
    before, _, _ = stream_video(cut4.url, body)
    leave_mid_stream(cut4.url, {"prompt": "leaving early", "num_frames": 97, "size": "128x64"})
    after, _, _ = stream_video(cut4.url, body)
    assert_same_video(after, before)
    health = cut4.health()
    assert all(w["restarts"] == 0 for w in health["workers"].values())
    assert health["pipeline"]["latent_slots_used"] == 0


@pytest.mark.timeout(300)
def test_wherever_an_adapting_cut_goes_the_video_stays_the_same(tmp_path):
    """Started at cut 1 with --vae-cut-adapt, the VAE's side holds 95% of the decoder. Wherever
    the workers' start-up timings move the cut (at the first shot's start, again at the
    storyboard's `cut` scene), the video equals one DiT and a whole VAE, and a second session
    plays the same video. Whether and where it moves is a timing-driven choice: asserted at the
    policy (tests/test_placement.py, `CutBalance`); here one CI run of a loaded machine kept
    cut 1. The tiny DiT is built at a quarter of the VAE's cost (the seeded architecture,
    tiny-random: the trained default's depth is its weights'), so it usually moves."""
    cfg = tmp_path / "quarter.toml"
    cfg.write_text('[model]\npreset = "tiny-random"\ndit_vae_ratio = 0.25\n')
    d = Daemon("--config", str(cfg), "--dit-gpus", "1", "--vae-gpus", "1", "--vae-cut", "1", "--vae-cut-adapt")
    try:
        assert d.health()["pipeline"]["vae_cut"] == 1
        got, _, _ = stream_video(d.url, SHORT_STORY)
        moved = d.health()["pipeline"]["vae_cuts"]["dit0"]  # reported, whatever it is
        again, _, _ = stream_video(d.url, SHORT_STORY)
        health = d.health()
    finally:
        assert d.stop() == 0, d.logs()
    assert isinstance(moved, int) and moved >= 1, moved
    check_video(got, 48, 256, 144, 16)
    assert_same_as_one_dit_and_vae(got, SHORT_STORY, "--config", str(cfg))
    assert_same_video(again, got)
    assert all(w["restarts"] == 0 for w in health["workers"].values())


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--vae-cut", "4"], "needs an explicit layout"),
        (["--dit-gpus", "1", "--vae-gpus", "1", "--vae-cut-adapt"], "it needs topology.vae_cut"),
        (["--mode", "hybrid", "--dit-gpus", "1", "--vae-gpus", "2", "--vae-cut", "4"], "mode disaggregated"),
        (["--dit-gpus", "1", "--vae-gpus", "2", "--vae-cut", "4"], "VAE groups of one shard"),
        (["--dit-gpus", "1", "--vae-gpus", "1", "--vae-cut", "-1"], "must be 0-64"),
    ],
)
def test_cuts_the_layout_cannot_run_are_refused_by_name(flags, message):
    err = refused(*flags)
    assert "topology.vae_cut" in err and message in err


@pytest.mark.timeout(120)
def test_a_cut_past_the_decoders_stages_fails_at_start_with_the_reason():
    d = Daemon("--dit-gpus", "1", "--vae-gpus", "1", "--vae-cut", "9", wait=False)
    try:
        code = d.proc.wait(timeout=100)
    finally:
        d.stop()
    assert code != 0 and "this VAE decoder has 9 stages; a cut is 1-8, got 9" in d.logs()
    assert "Traceback" not in d.logs()
