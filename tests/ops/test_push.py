"""Pushing a video to an operator's ingest (server/push.py): ffmpeg listening as an RTMP or SRT
server receives exactly the frames of a fixed-length video, repackaged without re-encoding; a push to a
dead destination is reported on the video and never stops it; a request names only configured
outputs, and the operator's configuration is checked at start."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from streamdiff.config import ConfigError
from streamdiff.config.loader import load

from ..helpers import Daemon, ffprobe, free_port, http

needs_ffmpeg = pytest.mark.skipif(
    shutil.which("ffmpeg") is None, reason="ffmpeg is not installed (.ci/run installs it)"
)


@pytest.mark.parametrize(
    "destinations,names",
    [
        ({"studio": "http://example.com/live"}, "outputs.destinations.studio"),
        ({"studio": "rtmp://"}, "outputs.destinations.studio"),
        ({"Studio One": "rtmp://127.0.0.1/live/x"}, "outputs.destinations"),
    ],
)
def test_the_operators_destinations_are_checked_at_start(destinations, names):
    with pytest.raises(ConfigError, match=names):
        load(None, {"outputs": {"destinations": destinations}})
    with pytest.raises(ConfigError, match="outputs.destinations: expected a table of strings"):
        load(None, {"outputs": {"destinations": {"studio": 5}}})


@pytest.fixture(scope="module")
def pushing(tmp_path_factory):
    d = tmp_path_factory.mktemp("push")
    live, srt, dead = free_port(), free_port(), free_port()  # nothing ever listens on `dead`
    cfg = d / "c.toml"
    cfg.write_text(
        "[outputs]\nretry_max_s = 1.0\n"
        f'destinations = {{ studio = "rtmp://127.0.0.1:{live}/live/test", relay = "srt://127.0.0.1:{srt}", '
        f'dead = "rtmp://127.0.0.1:{dead}/live/x" }}\n'
    )
    daemon = Daemon("--config", str(cfg))
    yield daemon, {"studio": live, "relay": srt}, d
    assert daemon.stop() == 0, daemon.logs()


def wait_done(url: str, vid: str) -> dict:
    deadline = time.monotonic() + 120  # a hang shows here, not a speed
    while (v := http.get(f"{url}/v1/videos/{vid}", timeout=10).json())["status"] in ("queued", "in_progress") or any(
        o["state"] in ("starting", "pushing", "retrying") for o in v.get("outputs", [])
    ):
        assert time.monotonic() < deadline, v
        time.sleep(0.3)
    return v


@needs_ffmpeg
@pytest.mark.timeout(300)
@pytest.mark.parametrize("output", ["studio", "relay"])
def test_an_ingest_receives_the_exact_frames(pushing, output):
    """RTMP (FLV) to `studio`, SRT (MPEG-TS) to `relay`: an ffmpeg listening as the ingest."""
    daemon, ports, d = pushing
    port = ports[output]
    if output == "studio":
        src, fmt = ["-listen", "1", "-i", f"rtmp://127.0.0.1:{port}/live/test"], "flv"
    else:
        src, fmt = ["-i", f"srt://127.0.0.1:{port}?mode=listener"], "mpegts"
    received = d / f"received.{fmt}"
    listener = subprocess.Popen(
        ["ffmpeg", "-hide_banner", "-loglevel", "error", "-y", *src, "-c", "copy", "-f", fmt, str(received)],
        stderr=subprocess.PIPE,
    )
    try:
        time.sleep(1.0)  # ffmpeg binds before it accepts; a push before that is retried anyway
        body = {"prompt": "a red ball moving right", "num_frames": 45, "size": "128x64", "outputs": [output]}
        vid = http.post(daemon.url + "/v1/videos", json=body, timeout=30).json()["id"]
        video = wait_done(daemon.url, vid)
        listener.wait(timeout=60)  # the publisher's end ends the listener's input
    finally:
        listener.kill()
    assert video["status"] == "completed" and video["outputs"][0]["state"] == "done", video
    probe = ffprobe(received.read_bytes())
    assert probe is not None and (probe["frames"], probe["width"], probe["height"], probe["codec"]) == (
        45,
        128,
        64,
        "h264",
    )


@needs_ffmpeg
def test_a_dead_ingest_is_reported_and_the_video_goes_on(pushing):
    daemon, _, _ = pushing
    body = {"prompt": "nobody listens", "num_frames": 33, "size": "128x64", "outputs": ["dead"]}
    vid = http.post(daemon.url + "/v1/videos", json=body, timeout=30).json()["id"]
    video = wait_done(daemon.url, vid)
    assert video["status"] == "completed", video
    out = video["outputs"][0]
    assert out["name"] == "dead" and out["state"] == "failed" and out["attempts"] >= 1
    assert "ffmpeg exited" in out["error"], out
    data = http.get(f"{daemon.url}/v1/videos/{vid}/content", timeout=30).content
    assert ffprobe(data)["frames"] == 33
    assert daemon.health()["status"] == "ok"


def test_a_request_names_only_configured_outputs(pushing):
    daemon, _, _ = pushing
    for outputs, param in ((["nowhere"], "outputs[0]"), (["studio", "studio"], "outputs"), ("studio", "outputs")):
        r = http.post(daemon.url + "/v1/videos", json={"prompt": "x", "outputs": outputs}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = http.post(daemon.url + "/v1/videos", json={"prompt": "x", "outputs": ["rtmp://evil/x"]}, timeout=10)
    assert "dead, relay, studio" in r.json()["error"]["message"]
