"""End to end with `--decoder taehv`: the real daemon (tiny preset, CPU) streams exact frame
counts (ffprobe), a storyboard with a cut, over two TAEHV replicas (`--vae-gpus 2` = two VAE
groups of one); /health and /v1/models say which decoder serves; height sharding is refused."""

from __future__ import annotations

import threading

import pytest

from .helpers import Daemon, check_video, ffprobe, http, refused, stream_video
from .test_daemon_stream import STORY_FRAMES, STORYBOARD


@pytest.fixture(scope="module")
def daemon():
    d = Daemon("--decoder", "taehv", "--dit-gpus", "1", "--vae-gpus", "2")
    yield d
    assert d.stop() == 0, d.logs()
    assert d.segments() == []


def test_health_and_models_name_the_decoder(daemon):
    h = daemon.wait_healthy_all()
    assert h["model"]["decoder"] == {"name": "taehv", "weights": None, "embedded": True}
    assert {w for w in h["workers"] if w.startswith("vae")} == {"vae0.0", "vae1.0"}  # two replicas
    m = http.get(daemon.url + "/v1/models", timeout=10).json()["data"][0]
    assert m["decoder"] == "taehv" and m["loaded"]["decoder"]["name"] == "taehv"


def test_storyboard_with_a_cut_streams_exact_frames(daemon):
    data, arrivals, _ = stream_video(daemon.url, STORYBOARD)
    frags, _ = check_video(data, STORY_FRAMES, 128, 64, 16)
    probe = ffprobe(data)
    assert probe is not None and probe["frames"] == STORY_FRAMES  # ffmpeg is installed here
    assert len(arrivals) > 1 and arrivals[0][0] < arrivals[-1][0]  # progressively, not at the end


def test_two_streams_on_two_replicas(daemon):
    out = {}
    bodies = {
        "a": {"prompt": "a lighthouse in a storm", "num_frames": 45, "seed": 1},
        "b": {"prompt": "a desert at dawn", "num_frames": 33, "size": "192x112", "seed": 2},
    }
    threads = [
        threading.Thread(target=lambda k=k, b=b: out.update({k: stream_video(daemon.url, b)[0]}))
        for k, b in bodies.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check_video(out["a"], 45, 256, 144, 16)
    check_video(out["b"], 33, 192, 112, 16)


def test_height_sharding_is_refused_by_name():
    err = refused("--decoder", "taehv", "--vae-gpus", "2", "--vae-group-size", "2")
    assert "topology.vae_group_size" in err and "TAEHV" in err
    err = refused("--decoder", "taehv", "--mode", "hybrid", "--dit-gpus", "1", "--vae-gpus", "2")
    assert "TAEHV" in err
    err = refused("--decoder", "taehv", "--preset", "wan2.1-t2v-1.3b", "--model", "/tmp")
    assert "--decoder-weights" in err
