"""Live videos over plain HTTP with a real client: a stream that runs until stopped, steered
while it plays (each steer acknowledged with the exact frame where it lands, and marked there by
an emsg), stopped at a block boundary, and refused clearly where steering makes no sense."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import aiohttp
import pytest

from .helpers import decode, fragments, http, post_video, wait_until


@pytest.fixture
def daemon(plain_daemon):
    return plain_daemon  # the run's shared plain daemon, idle (tests/conftest.py)


class Reader(threading.Thread):
    """Reads a streaming response as it comes (the player), keeping each chunk's arrival."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.data = bytearray()
        self.video_id: str | None = None
        self.status: int | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            with http.stream("POST", self.url + "/v1/videos", json={**self.body, "stream": True}, timeout=120) as r:
                self.status = r.status_code
                self.video_id = r.headers.get("X-Video-Id")
                for chunk in r.iter_raw():
                    self.data += chunk
        except Exception as exc:  # a truncated transfer
            self.error = repr(exc)

    def fragment_count(self) -> int:
        return len([f for f in fragments(bytes(self.data)) if "end" in f])


def test_a_live_stream_steered_twice_and_stopped(daemon):
    url = daemon.url
    reader = Reader(url, {"prompt": "a red ball", "live": True, "size": "128x64", "seed": 3})
    reader.start()
    wait_until(lambda: reader.fragment_count() >= 2, 60)
    vid = reader.video_id
    first = http.post(f"{url}/v1/videos/{vid}/scenes", json={"prompt": "a blue square", "recache": True}, timeout=10)
    assert first.status_code == 200, first.text
    wait_until(lambda: reader.fragment_count() >= 4, 60)
    second = http.post(f"{url}/v1/videos/{vid}/scenes", json={"prompt": "green", "transition": "cut"}, timeout=10)
    assert second.status_code == 200, second.text
    a, b = first.json(), second.json()
    assert (a["scene"], b["scene"]) == (1, 2) and 0 < a["start_frame"] < b["start_frame"]
    assert a["start_seconds"] == a["start_frame"] / 16
    wait_until(lambda: reader.fragment_count() >= 7, 60)
    stopped = http.post(f"{url}/v1/videos/{vid}/stop", timeout=10)
    assert stopped.status_code == 200, stopped.text
    frames = stopped.json()["num_frames"]
    assert b["start_frame"] < frames < 60 * 16  # the cap was a minute
    reader.join(60)
    assert reader.status == 200 and reader.error is None

    data = bytes(reader.data)
    dec = decode(data)
    assert (dec["frames"], dec["width"], dec["height"]) == (frames, 128, 64)  # every frame up to the stop
    marks = [(e["message"]["scene"], e["message"]["start_frame"]) for f in fragments(data) for e in f["emsg"]]
    assert marks == [(0, 0), (1, a["start_frame"]), (2, b["start_frame"])]
    video = http.get(f"{url}/v1/videos/{vid}", timeout=10).json()
    assert video["status"] == "completed" and video["live"] is True and video["num_frames"] == frames
    assert [(s["prompt"], s["start_frame"], s["transition"]) for s in video["scenes"]] == [
        ("a red ball", 0, "cut"),
        ("a blue square", a["start_frame"], "continue"),  # re-cached
        ("green", b["start_frame"], "cut"),
    ]


def test_a_live_stream_is_paced_to_its_player(daemon):
    """Generated at most live_lead_s (1 s) ahead of the player's clock, whatever the client's read
    speed: after 3 s of playback the stream holds about 3 + 1 s of video, not the whole cap."""
    reader = Reader(daemon.url, {"prompt": "paced", "live": True, "size": "128x64", "seconds": 30})
    reader.start()
    wait_until(lambda: reader.fragment_count() >= 1, 60)
    t0 = time.monotonic()
    time.sleep(3.0)
    frames = sum(f["samples"] for f in fragments(bytes(reader.data)) if "end" in f)
    played = time.monotonic() - t0 - 0.5  # the player starts startup_buffer_s after the first fragment
    assert frames / 16 <= played + 1.0 + 0.75 + 0.5  # + the lead, one block, and slack for the machine
    assert http.post(f"{daemon.url}/v1/videos/{reader.video_id}/stop", timeout=10).status_code == 200
    reader.join(60)
    assert reader.error is None


def test_steering_refusals(daemon):
    url = daemon.url
    missing = http.post(f"{url}/v1/videos/video_nope/scenes", json={"prompt": "x"}, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "video_id"
    done = post_video(url, {"prompt": "short", "num_frames": 9, "size": "128x64"}).json()
    wait_until(lambda: http.get(f"{url}/v1/videos/{done['id']}").json()["status"] == "completed", 60)
    late = http.post(f"{url}/v1/videos/{done['id']}/scenes", json={"prompt": "x"}, timeout=10)
    assert late.status_code == 409 and late.json()["error"]["code"] == "video_finished"
    assert http.post(f"{url}/v1/videos/{done['id']}/stop", timeout=10).status_code == 409
    reader = Reader(url, {"prompt": "steer me", "live": True, "size": "128x64", "seconds": 20})
    reader.start()
    wait_until(lambda: reader.video_id is not None and reader.fragment_count() >= 1, 60)
    steer = f"{url}/v1/videos/{reader.video_id}/scenes"
    for body, param in (
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "transition": "fade"}, "transition"),
        ({"prompt": "x", "recache": "yes", "color": 1}, "color"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "transition": "cut", "recache": True}, "recache"),
    ):
        r = http.post(steer, json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    statuses = [http.post(steer, json={"prompt": f"p{i}"}, timeout=10).status_code for i in range(3)]
    assert statuses[:2] == [200, 200] and statuses[2] == 429  # two are waiting for their first block
    http.post(f"{url}/v1/videos/{reader.video_id}/stop", timeout=10)
    reader.join(60)
    assert reader.error is None


def test_the_realtime_websocket_flow(daemon):
    """vLLM-Omni's realtime events with aiohttp's client: session.start, video.start, the init
    segment and fragments as binary messages, a prompt update acknowledged with where it lands
    (and marked there in the stream), ping/pong, session.stop, session.done."""
    asyncio.run(_websocket_flow(daemon.url))


async def _websocket_flow(url: str) -> None:
    async with aiohttp.ClientSession() as s, s.ws_connect(url.replace("http://", "ws://") + "/v1/realtime/video") as ws:
        await ws.send_json({"type": "session.start", "prompt": "a red ball", "format": "m4s", "size": "128x64"})
        start = await ws.receive_json(timeout=30)
        assert start["type"] == "video.start" and start["format"] == "m4s" and start["config"]["live"] is True
        data, binaries, events, stopping = bytearray(), 0, [], False
        while True:
            msg = await ws.receive(timeout=60)
            if msg.type == aiohttp.WSMsgType.BINARY:
                data += msg.data
                binaries += 1
                if binaries == 3:  # the init segment and two fragments in
                    await ws.send_json(
                        {"type": "session.prompt_update", "prompt": "a blue square", "transition": "cut"}
                    )
                    await ws.send_json({"type": "session.prompt_update", "prompt": ""})  # refused; the session goes on
                    await ws.send_json({"type": "session.ping"})
                # Stop once the update's fragment is in: where it lands depends on how far ahead
                # the live session ran, so a stop at a fixed count could come before it.
                landed = [e["start_frame"] for e in events if e["type"] == "session.prompt_updated"]
                if landed and not stopping and sum(f["samples"] for f in fragments(bytes(data))) > landed[0]:
                    await ws.send_json({"type": "session.stop"})
                    stopping = True
                continue
            assert msg.type == aiohttp.WSMsgType.TEXT, msg
            events.append(json.loads(msg.data))
            if events[-1]["type"] == "session.done":
                break
        assert (await ws.receive(timeout=10)).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    kinds = [e["type"] for e in events]
    assert kinds == ["session.prompt_updated", "error", "session.pong", "session.done"], events
    updated, refused, _, done = events
    assert updated["request_id"] == start["request_id"] and updated["scene"] == 1 and updated["start_frame"] > 0
    assert refused["param"] == "prompt"
    assert done["stopped"] is True and done["chunks"] == binaries - 1
    video = http.get(f"{url}/v1/videos/{start['request_id']}", timeout=10).json()
    assert video["status"] == "completed" and decode(bytes(data))["frames"] == video["num_frames"]
    marks = [e["message"]["start_frame"] for f in fragments(bytes(data)) for e in f["emsg"]]
    assert marks == [0, updated["start_frame"]]


def test_a_websocket_that_does_not_start_properly_gets_an_error(daemon):
    async def run() -> list:
        got = []
        async with aiohttp.ClientSession() as s:
            for first in ({"type": "session.prompt_update", "prompt": "x"}, {"type": "session.start", "size": "7x7"}):
                async with s.ws_connect(daemon.url.replace("http://", "ws://") + "/v1/realtime/video") as ws:
                    await ws.send_json(first)
                    got.append(await ws.receive_json(timeout=30))
                    assert (await ws.receive(timeout=10)).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        return got

    first, bad_size = asyncio.run(run())
    assert first["type"] == "error" and first["param"] == "type"
    assert bad_size["type"] == "error" and bad_size["param"] == "size"


def test_a_running_storyboard_can_be_steered_and_keeps_its_length(daemon):
    """Not only live videos: a storyboard still being made takes a steer the same way; the new
    scene replaces what was left of it, and the video keeps its length."""
    url = daemon.url
    scenes = [{"prompt": "one", "seconds": 10}, {"prompt": "two", "seconds": 10, "transition": "cut"}]
    reader = Reader(url, {"scenes": scenes, "size": "128x64", "seed": 5})
    reader.start()
    wait_until(lambda: reader.video_id is not None and reader.fragment_count() >= 1, 60)
    r = http.post(f"{url}/v1/videos/{reader.video_id}/scenes", json={"prompt": "three"}, timeout=10)
    assert r.status_code == 200, r.text
    landed = r.json()
    reader.join(120)
    assert reader.error is None
    video = http.get(f"{url}/v1/videos/{reader.video_id}", timeout=10).json()
    assert video["num_frames"] == 320 and decode(bytes(reader.data))["frames"] == 320
    assert video["scenes"][-1]["prompt"] == "three" and video["scenes"][-1]["start_frame"] == landed["start_frame"]
    assert sum(s["num_frames"] for s in video["scenes"]) == 320
