"""The official `openai` Python package against the daemon: create, poll, download."""

from __future__ import annotations

import time
import warnings

import pytest

from ..helpers import decode

openai = pytest.importorskip("openai")


@pytest.fixture
def d(plain_daemon):
    return plain_daemon  # the run's shared plain daemon, idle (tests/conftest.py)


def test_openai_client_creates_polls_and_downloads(d, tmp_path):
    client = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the SDK marks the Sora endpoints deprecated
        video = client.videos.create(prompt="a paper boat on a stream", model="tiny", seconds="2", size="128x64")
        assert video.status in ("queued", "in_progress") and video.object == "video"
        done = client.videos.create_and_poll(
            prompt="a kite in the wind", seconds="1", size="128x64", poll_interval_ms=100
        )
        for _ in range(600):
            video = client.videos.retrieve(video.id)
            if video.status in ("completed", "failed"):
                break
            time.sleep(0.1)
        assert video.status == "completed" and video.progress == 100 and video.size == "128x64"
        content = client.videos.download_content(video.id, variant="video")
        path = tmp_path / "boat.mp4"
        content.write_to_file(path)
        listed = client.videos.list(limit=10)
        assert video.id in [v.id for v in listed.data]
        deleted = client.videos.delete(video.id)
        assert deleted.deleted is True
    info = decode(path.read_bytes())
    assert (info["frames"], info["width"], info["height"]) == (32, 128, 64)
    assert done.status == "completed" and done.seconds == "1"
