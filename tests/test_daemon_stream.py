"""End to end: the real daemon (tiny preset, CPU), a real HTTP client, decoded by FFmpeg.

The same storyboard test runs on four layouts: disaggregated and aggregated, with a VAE group
of one shard and of two.
"""

from __future__ import annotations

import threading
import time

import pytest

from .helpers import (
    DEFAULT_LAYOUT,
    PICTURE,
    Daemon,
    assert_draws_the_picture,
    assert_same_video,
    check_video,
    fragments,
    http,
    needs_trained,
    shared_daemon,
    stream_video,
)
from .server.test_validation import BAD_REQUESTS

STORYBOARD = {
    "scenes": [
        {"prompt": "a red fox runs through snow", "seconds": 2},
        {"prompt": "the fox reaches a frozen lake", "num_frames": 30, "transition": "continue"},
        {"prompt": "a city street at night", "seconds": 1.5, "transition": "cut", "seed": 9},
    ],
    "size": "128x64",  # each layout draws the default 256x144 in the picture test below
    "fps": 16,
    "seed": 42,
}
STORY_FRAMES = 32 + 30 + 24

LAYOUTS = {
    "disagg-k1": ["--dit-gpus", "1", "--vae-gpus", "1"],
    "disagg-k2": ["--dit-gpus", "1", "--vae-gpus", "2"],
    "agg-k1": ["--mode", "aggregated", "--dit-gpus", "1", "--vae-gpus", "1"],
    "agg-k2": ["--mode", "aggregated", "--dit-gpus", "1", "--vae-gpus", "2"],
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_daemon(request):
    if LAYOUTS[request.param] == list(DEFAULT_LAYOUT):  # the run's shared plain daemon is this one
        yield shared_daemon()
        return
    d = Daemon(*LAYOUTS[request.param])
    yield d
    assert d.stop() == 0, d.logs()
    assert d.segments() == []


def test_storyboard_streams_progressively(layout_daemon):
    d = layout_daemon
    status_at_first_fragment = {}

    def watch(headers_seen):
        # While the stream is running, the job is in progress.
        while "id" not in headers_seen:
            time.sleep(0.01)
        status_at_first_fragment.update(http.get(f"{d.url}/v1/videos/{headers_seen['id']}", timeout=10).json())

    seen: dict = {}
    chunks = []
    with http.stream("POST", d.url + "/v1/videos", json={**STORYBOARD, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "video/mp4"
        watcher = None
        for chunk in r.iter_raw():
            chunks.append(chunk)
            data = b"".join(chunks)
            if watcher is None and fragments(data) and "end" in fragments(data)[0]:
                seen["id"] = r.headers["x-video-id"]
                watcher = threading.Thread(target=watch, args=(seen,))
                watcher.start()
                watcher.join()
    data = b"".join(chunks)
    frags, dec = check_video(data, STORY_FRAMES, 128, 64, 16)
    # The first fragment came while the job was still generating (what the job said then, not a
    # clock: how soon it came depends on the machine's load).
    assert status_at_first_fragment["status"] == "in_progress"
    assert status_at_first_fragment["progress"] < 100
    # Scene boundaries travel as emsg boxes in front of the fragment where each scene starts.
    events = [(i, e["message"]["scene"], e["message"]["start_frame"]) for i, f in enumerate(frags) for e in f["emsg"]]
    starts = [sum(f["samples"] for f in frags[:i]) for i in range(len(frags))]
    assert [(s, sf) for _, s, sf in events] == [(0, 0), (1, 32), (2, 62)]
    assert [starts[i] for i, _, _ in events] == [0, 32, 62]
    job = http.get(f"{d.url}/v1/videos/{r.headers['x-video-id']}", timeout=10).json()
    assert job["status"] == "completed" and job["progress"] == 100 and job["num_frames"] == STORY_FRAMES
    assert [s["start_frame"] for s in job["scenes"]] == [0, 32, 62]


def test_same_seed_same_video_across_requests(layout_daemon):
    body = {"prompt": "waves on a beach", "num_frames": 21, "size": "128x64", "seed": 7}
    a, _, _ = stream_video(layout_daemon.url, body)
    b, _, _ = stream_video(layout_daemon.url, body)
    assert a == b
    check_video(a, 21, 128, 64, 16)


@needs_trained
def test_the_trained_defaults_picture_as_one_dit_and_vae_draw_it(layout_daemon):
    """Two VAE shards (and the aggregated layouts) show the picture with no seam."""
    got, _, _ = stream_video(layout_daemon.url, PICTURE)
    check_video(got, 33, 256, 144, 16)
    assert_draws_the_picture(got)


@pytest.fixture
def daemon(plain_daemon):
    return plain_daemon  # the run's shared plain daemon, idle (tests/conftest.py)


def test_two_concurrent_streams_complete(daemon):
    results = {}

    def run(name, body):
        results[name] = stream_video(daemon.url, body)[0]

    bodies = {
        "a": {"prompt": "a lighthouse in a storm", "num_frames": 45, "seed": 1},
        "b": {"prompt": "a desert at dawn", "num_frames": 33, "size": "192x112", "seed": 2},
    }
    threads = [threading.Thread(target=run, args=item) for item in bodies.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    check_video(results["a"], 45, 256, 144, 16)
    check_video(results["b"], 33, 192, 112, 16)
    # Each equals the same request made alone: sessions interleaved without interfering.
    assert stream_video(daemon.url, bodies["b"])[0] == results["b"]


def test_concurrent_streams_of_one_size_equal_themselves_alone(daemon):
    """Three streams of one size at once, which the DiT may run in shared forwards (whether it
    does is the scheduler's timing-driven choice, asserted at the policy:
    tests/test_scheduler_policy.py::test_three_concurrent_streams_of_one_size_share_dit_forwards):
    each has its exact frames and equals the same request alone, and the metrics count every
    block the DiT ran, by the size of its batch."""
    before = dit_batch_counts(daemon)
    bodies = [{"prompt": f"scene {i}", "num_frames": 81, "size": "128x64", "seed": 50 + i} for i in range(3)]
    results = {}
    threads = [
        threading.Thread(target=lambda i=i, b=b: results.__setitem__(i, stream_video(daemon.url, b)[0]))
        for i, b in enumerate(bodies)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i, body in enumerate(bodies):
        check_video(results[i], 81, 128, 64, 16)
        assert_same_video(results[i], stream_video(daemon.url, body)[0])
    after = dit_batch_counts(daemon)
    assert sum(after.values()) - sum(before.values()) == 6 * 7  # six streams of 7 blocks (21 latent frames)


def dit_batch_counts(d: Daemon) -> dict[int, float]:
    """Blocks the DiT computed, by the size of the batch they were in (from /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = http.get(d.url + "/metrics").text
    fam = next(f for f in text_string_to_metric_families(text) if f.name == "streamdiff_dit_batched_blocks")
    return {int(s.labels["batch"]): s.value for s in fam.samples if s.name.endswith("_total")}


def test_client_disconnect_frees_the_session(daemon):
    body = {"prompt": "an endless train", "seconds": 60, "stream": True}
    with http.stream("POST", daemon.url + "/v1/videos", json=body, timeout=60) as r:
        video_id = r.headers["x-video-id"]
        data = b""
        for chunk in r.iter_raw():
            data += chunk
            if len([f for f in fragments(data) if "end" in f]) >= 2:
                break  # leave after two fragments: the context manager closes the connection
    # The session is cancelled at the next block boundary and every slot comes back.
    p = daemon.wait_idle(30)
    assert p["running"] == 0 and p["queued"] == 0
    job = http.get(f"{daemon.url}/v1/videos/{video_id}", timeout=10).json()
    assert job["status"] == "failed" and job["error"]["code"] == "cancelled"
    assert job["frames_done"] < 960
    data, _, _ = stream_video(daemon.url, {"prompt": "after the disconnect", "num_frames": 12})
    check_video(data, 12, 256, 144, 16)


@pytest.mark.parametrize("body,status,param", BAD_REQUESTS, ids=[str(i) for i in range(len(BAD_REQUESTS))])
def test_invalid_requests_get_openai_errors(daemon, body, status, param):
    r = http.post(daemon.url + "/v1/videos", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"


def test_malformed_bodies_get_400_while_a_stream_runs(daemon):
    result = {}
    t = threading.Thread(
        target=lambda: result.update(
            data=stream_video(daemon.url, {"prompt": "a calm river", "num_frames": 81, "seed": 5})[0]
        )
    )
    t.start()
    time.sleep(0.5)
    cases = [
        (b"{not json", {"Content-Type": "application/json"}, 400),
        (b"[1, 2, 3]", {"Content-Type": "application/json"}, 400),
        (b'"just a string"', {"Content-Type": "application/json"}, 400),
        (b"\xff\xfe\x00", {"Content-Type": "application/json"}, 400),
        (b"<xml/>", {"Content-Type": "application/xml"}, 415),
        (b"x" * 400_000, {"Content-Type": "application/json"}, 413),
    ]
    for body, headers, status in cases:
        r = http.post(daemon.url + "/v1/videos", content=body, headers=headers, timeout=30)
        assert r.status_code == status, (body[:20], r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    for body, status, _ in BAD_REQUESTS[:6]:
        assert http.post(daemon.url + "/v1/videos", json=body, timeout=30).status_code == status
    t.join(timeout=300)
    check_video(result["data"], 81, 256, 144, 16)
    assert daemon.health()["status"] == "ok"
