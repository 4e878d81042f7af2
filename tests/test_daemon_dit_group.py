"""The daemon with one DiT over two processes (Ulysses, `--dit-group-size 2`): the same video as
one DiT, on DiT devices of its own and aggregated with the VAE group on the same two processes;
a session cancelled mid-stream leaves the group in step, a dead rank fails only its stream and
the group comes back, and layouts it cannot run are refused with the reason."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from .helpers import (
    SHORT_STORY,
    Daemon,
    assert_same_as_one_dit_and_vae,
    assert_same_video,
    check_video,
    http,
    leave_mid_stream,
    refused,
    stream_video,
)


@pytest.fixture(scope="module")
def sp2():
    d = Daemon("--dit-gpus", "2", "--dit-group-size", "2", "--vae-gpus", "1")
    yield d
    assert d.stop() == 0, d.logs()
    assert d.segments() == []


@pytest.mark.timeout(300)
def test_a_dit_group_streams_the_same_video_as_one_dit(sp2):
    health = sp2.health()
    assert sorted(health["workers"]) == ["dit0", "dit1", "vae0.0"]
    got, _, _ = stream_video(sp2.url, SHORT_STORY)
    check_video(got, 48, 256, 144, 16)
    assert_same_as_one_dit_and_vae(got, SHORT_STORY)


@pytest.mark.timeout(300)
def test_an_aggregated_dit_group_shares_the_vae_groups_processes_and_streams_the_same_video(sp2):
    """agg-sp2: each process runs a DiT rank then a VAE shard, over one process group; both
    stages' collectives interleave in the same order on both ranks."""
    got, _, _ = stream_video(sp2.url, SHORT_STORY)  # the disaggregated group's video
    d = Daemon("--mode", "aggregated", "--dit-gpus", "2", "--vae-gpus", "2", "--dit-group-size", "2")
    try:
        health = d.health()
        assert sorted(health["workers"]) == ["agg0", "agg1"]
        agg, _, _ = stream_video(d.url, SHORT_STORY)
        two, _, _ = stream_video(d.url, {"prompt": "again", "num_frames": 25, "size": "128x64"})
        check_video(two, 25, 128, 64, 16)
        assert all(w["restarts"] == 0 for w in d.health()["workers"].values())
    finally:
        assert d.stop() == 0, d.logs()
    assert_same_video(agg, got)


@pytest.mark.timeout(300)
def test_a_cancelled_session_leaves_the_group_in_step(sp2):
    """Two streams share the group; one client goes away mid-stream. Its blocks still queued
    are skipped by both ranks together (they agree on every block), so the other stream and
    the next one finish with no restart."""
    before = {n: w["restarts"] for n, w in sp2.health()["workers"].items()}
    leave_mid_stream(sp2.url, {"prompt": "leaving early", "num_frames": 97, "size": "128x64"})
    data, _, _ = stream_video(sp2.url, {"prompt": "staying", "num_frames": 49, "size": "128x64"})
    check_video(data, 49, 128, 64, 16)
    assert {n: w["restarts"] for n, w in sp2.health()["workers"].items()} == before


@pytest.mark.timeout(300)
def test_a_killed_rank_fails_its_stream_fast_and_the_group_comes_back(sp2):
    rank1 = sp2.health()["workers"]["dit1"]["pid"]
    chunks, killed = [], None
    body = {"prompt": "doomed", "num_frames": 237, "size": "128x64", "stream": True}
    with http.stream("POST", sp2.url + "/v1/videos", timeout=120, json=body) as r:
        video_id = r.headers["x-video-id"]
        try:
            for chunk in r.iter_raw():
                chunks.append(chunk)
                if killed is None and sum(map(len, chunks)) > 5_000:
                    os.kill(rank1, signal.SIGKILL)
                    killed = time.monotonic()
        except httpx.RemoteProtocolError:
            pass  # a truncated transfer
    # Under half the 120 s collective timeout, under any load: the group failed on the death, not the timeout.
    assert killed is not None and time.monotonic() - killed < 60
    job = http.get(f"{sp2.url}/v1/videos/{video_id}", timeout=10).json()
    assert job["status"] == "failed" and "dit1" in job["error"]["message"]
    health = sp2.wait_healthy(timeout_s=120)  # both ranks restarted on a fresh rendezvous
    assert health["workers"]["dit1"]["pid"] != rank1
    assert health["workers"]["dit0"]["restarts"] == 1 and health["workers"]["dit1"]["restarts"] == 1
    assert health["pipeline"]["latent_slots_used"] == 0
    data, _, _ = stream_video(sp2.url, {"prompt": "after the restart", "num_frames": 25, "size": "128x64"})
    check_video(data, 25, 128, 64, 16)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--dit-gpus", "3", "--dit-group-size", "2"], "must be 1-64 and divide dit_devices (3)"),
        (["--mode", "aggregated", "--dit-gpus", "2", "--dit-group-size", "2"], "not mode aggregated"),
        (["--mode", "hybrid", "--dit-gpus", "2", "--vae-gpus", "3", "--dit-group-size", "2"], "not mode hybrid"),
        (["--dit-group-size", "2"], "a DiT group needs --dit-gpus"),
    ],
)
def test_layouts_a_dit_group_cannot_run_are_refused_by_name(flags, message):
    err = refused(*flags)
    assert "topology.dit_group_size" in err and message in err


@pytest.mark.timeout(120)
def test_more_ranks_than_the_dits_heads_fail_at_start_with_the_reason():
    """The tiny preset's DiT has 2 attention heads: a group of 3 cannot split them."""
    d = Daemon("--dit-gpus", "3", "--dit-group-size", "3", "--vae-gpus", "1", wait=False)
    try:
        code = d.proc.wait(timeout=100)
    finally:
        d.stop()
    assert code != 0
    assert "2 attention heads cannot be split over 3 devices" in d.logs()
