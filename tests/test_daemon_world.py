"""A world model driven live: minWM (a tiny random model in its checkpoint's real layout,
tests/published.py) served by streamdiffd and steered by camera controls over HTTP and the
WebSocket. A control lands at exactly the block its answer names: every frame before that
block's first frame is the uncontrolled video's, bit for bit, and the frames from it on differ;
each fragment's emsg names the newest control that shaped it. A control script given with the
request streams exact frames, one fragment per block, and `streamdiffd generate --controls`
writes the same video. Hostile controls get 4xx or are coalesced, and the video goes on."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil

import aiohttp
import numpy as np
import pytest

from streamdiff.controls import CONTROL_SCHEME, MAX_SCRIPT_ENTRIES

from .helpers import Daemon, check_video, decode, fragments, generate_here, http, wait_until
from .published import Bases, write_published
from .server.test_player_browser import CHROMIUM, open_player
from .test_daemon_i2v import picture
from .test_live import Reader

pytest.importorskip("diffusers")

SIZE, W, H = "128x64", 128, 64
FPB = 4  # minWM's latent frames a block: 13 frames the first block, 16 each after


def serve(preset: str, root):
    """A daemon serving `preset`'s tiny model in its checkpoint's layout, for a module's tests."""
    pub = write_published(preset, root, Bases(root))
    d = Daemon(*pub.flags, "--mode", "aggregated", "--dit-gpus", "1", "--vae-gpus", "1", "--size", SIZE)
    try:
        yield d, pub
    finally:
        d.stop()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    yield from serve("minwm-action2v", tmp_path_factory.mktemp("world"))


def stream(url: str, body: dict) -> bytes:
    with http.stream("POST", url + "/v1/videos", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        return r.read()


def control_events(data: bytes) -> list[dict | None]:
    """Per fragment, its control emsg's message (None where it has none)."""
    out = []
    for f in fragments(data):
        ev = [e["message"] for e in f["emsg"] if e["scheme"] == CONTROL_SCHEME]
        out.append(ev[0] if ev else None)
    return out


def test_a_control_lands_at_exactly_its_acknowledged_block(world):
    d, _ = world
    body = {"prompt": "a forest path", "num_frames": 13 + 16 * 9, "size": SIZE, "seed": 7}
    reader = Reader(d.url, body)
    reader.start()
    wait_until(lambda: reader.fragment_count() >= 2, 120)
    r = http.post(f"{d.url}/v1/videos/{reader.video_id}/controls", json={"seq": 5, "keyboard": ["w", "l"]}, timeout=10)
    assert r.status_code == 200, r.text
    ack = r.json()
    reader.join(300)
    assert reader.error is None and reader.status == 200
    block, start = ack["block"], ack["start_frame"]
    assert ack["seq"] == 5 and 2 <= block < 10 and start == 13 + 16 * (block - 1)
    assert ack["start_seconds"] == start / 16
    controlled = bytes(reader.data)
    plain = stream(d.url, body)
    check_video(controlled, body["num_frames"], W, H, 16, blocks_expected=10)
    a, b = decode(controlled)["pixels"], decode(plain)["pixels"]
    assert all(np.array_equal(x, y) for x, y in zip(a[:start], b[:start], strict=True))
    assert not np.array_equal(a[start], b[start])
    assert sum(not np.array_equal(x, y) for x, y in zip(a[start:], b[start:], strict=True)) > 0.9 * len(a[start:])
    events = control_events(controlled)
    assert events[:block] == [None] * block
    assert events[block:] == [{"seq": 5, "block": i, "start_frame": 13 + 16 * (i - 1)} for i in range(block, 10)]
    assert control_events(plain) == [None] * 10


def test_a_prompt_steer_beside_the_camera(world):
    """minWM keeps its text: a `continue` steer swaps the prompt while the camera keeps moving,
    and both are marked where they land."""
    d, _ = world
    reader = Reader(d.url, {"prompt": "a forest path", "live": True, "size": SIZE, "seed": 6})
    reader.start()
    wait_until(lambda: reader.fragment_count() >= 2, 120)
    vid = reader.video_id
    held = http.post(f"{d.url}/v1/videos/{vid}/controls", json={"seq": 1, "keyboard": ["w"]}, timeout=10).json()
    steer = http.post(f"{d.url}/v1/videos/{vid}/scenes", json={"prompt": "a snowy path"}, timeout=10)
    assert steer.status_code == 200, steer.text
    recache = http.post(f"{d.url}/v1/videos/{vid}/scenes", json={"prompt": "x", "recache": True}, timeout=10)
    assert recache.status_code == 400 and recache.json()["error"]["param"] == "recache"
    wait_until(lambda: reader.fragment_count() >= steer.json()["start_frame"] // 16 + 3, 120)
    http.post(f"{d.url}/v1/videos/{vid}/stop", timeout=10)
    reader.join(120)
    frags = fragments(bytes(reader.data))
    scenes = [e["message"]["start_frame"] for f in frags for e in f["emsg"] if e["scheme"] != CONTROL_SCHEME]
    assert scenes == [0, steer.json()["start_frame"]]
    seqs = [e and e["seq"] for e in control_events(bytes(reader.data))]
    assert seqs[held["block"] :] == [1] * (len(seqs) - held["block"])


@pytest.fixture(scope="module")
def matrix_game(tmp_path_factory):
    yield from serve("matrix-game-2-universal", tmp_path_factory.mktemp("matrix-game"))


def test_matrix_game_from_a_picture_and_a_script_is_what_generate_writes(matrix_game, tmp_path):
    d, pub = matrix_game
    (tmp_path / "start.png").write_bytes(picture(96, 80))
    url = "data:image/png;base64," + base64.b64encode(picture(96, 80)).decode()
    steps = [{"keyboard": ["forward"], "mouse": [0.05, 0.0]}] * 4 + [{"keyboard": ["right"]}] * 3
    script = [{"seq": 1, "mode": "script", "per": "frame", "script": steps}]
    body = {"prompt": "a road", "num_frames": 33, "size": SIZE, "seed": 9, "input_reference": url, "controls": script}
    video = stream(d.url, body)
    check_video(video, 33, W, H, 12, blocks_expected=3)
    (tmp_path / "controls.json").write_text(json.dumps(script))
    out = tmp_path / "out.mp4"
    status, _, err = generate_here(
        *pub.flags, "--prompt", "a road", "--num-frames", "33", "--size", SIZE, "--seed", "9",
        "--image", str(tmp_path / "start.png"), "--controls", str(tmp_path / "controls.json"), "-o", str(out),
    )  # fmt: skip
    assert status == 0, err
    assert out.read_bytes() == video


def test_a_matrix_game_action_lands_at_exactly_its_acknowledged_block(matrix_game):
    """Matrix-Game from a picture: a held key and a mouse turn sent while it streams land at the
    block the answer names; the frames before it are the video without them, bit for bit."""
    d, _ = matrix_game
    url = "data:image/png;base64," + base64.b64encode(picture(96, 80)).decode()
    body = {"prompt": "a road", "num_frames": 9 + 12 * 7, "size": SIZE, "seed": 4, "input_reference": url}
    reader = Reader(d.url, body)
    reader.start()
    wait_until(lambda: reader.fragment_count() >= 2, 120)
    control = {"seq": 3, "keyboard": ["forward", "left"], "mouse": [0.1, -0.1]}
    r = http.post(f"{d.url}/v1/videos/{reader.video_id}/controls", json=control, timeout=10)
    assert r.status_code == 200, r.text
    ack = r.json()
    bad = http.post(f"{d.url}/v1/videos/{reader.video_id}/controls", json={"seq": 4, "keyboard": ["w"]}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "keyboard"  # minWM's key, not this space's
    reader.join(300)
    assert reader.error is None and reader.status == 200
    block, start = ack["block"], ack["start_frame"]
    assert 2 <= block < 8 and start == 9 + 12 * (block - 1)  # 3 latent frames a block: 9 frames, then 12
    controlled, plain = bytes(reader.data), stream(d.url, body)
    check_video(controlled, body["num_frames"], W, H, 12, blocks_expected=8)
    a, b = decode(controlled)["pixels"], decode(plain)["pixels"]
    assert all(np.array_equal(x, y) for x, y in zip(a[:start], b[:start], strict=True))
    assert sum(not np.array_equal(x, y) for x, y in zip(a[start:], b[start:], strict=True)) > 0.9 * len(a[start:])
    assert [e and e["seq"] for e in control_events(controlled)] == [None] * block + [3] * (8 - block)


SCRIPT = {
    "seq": 1,
    "mode": "script",
    "per": "frame",
    "script": [{"keyboard": ["w"]}] * 6
    + [{"keyboard": ["a", "j"], "mouse": [1.5, -2.0]}] * 5
    + [{"camera": {"w2c": [[1, 0, 0, 0.3], [0, 1, 0, 0], [0, 0, 1, -0.2], [0, 0, 0, 1]], "K": [0.5, 0.6, 0.5, 0.5]}}],
}
LATER = {"seq": 2, "block": 3, "mode": "script", "per": "block", "script": [{"keyboard": ["i", "d"]}]}


def test_a_control_script_streams_exact_frames_and_generate_writes_the_same(world, tmp_path):
    d, pub = world
    body = {"prompt": "a forest path", "num_frames": 13 + 16 * 4 + 5, "size": SIZE, "seed": 11,
            "controls": [SCRIPT, LATER]}  # fmt: skip
    video = stream(d.url, body)
    check_video(video, body["num_frames"], W, H, 16, blocks_expected=6)
    events = control_events(video)
    assert [e and e["seq"] for e in events] == [1, 1, 1, 2, 2, 2]
    assert stream(d.url, {k: v for k, v in body.items() if k != "controls"}) != video  # the script shaped it

    script = tmp_path / "controls.json"
    script.write_text(json.dumps({"controls": body["controls"]}))
    out = tmp_path / "out.mp4"
    status, _, err = generate_here(
        *pub.flags, "--prompt", body["prompt"], "--num-frames", str(body["num_frames"]), "--size", SIZE,
        "--seed", "11", "--controls", str(script), "-o", str(out),
    )  # fmt: skip
    assert status == 0, err
    assert out.read_bytes() == video


# Hostile controls, each with the field its refusal names and its status.
BAD_CONTROLS = [
    ({"keyboard": ["w"]}, "seq", 400),
    ({"seq": "1", "keyboard": ["w"]}, "seq", 400),
    ({"seq": 1, "keyboard": "w"}, "keyboard", 400),
    ({"seq": 1, "keyboard": ["jump"]}, "keyboard", 400),
    ({"seq": 1, "mouse": [0.5]}, "mouse", 400),
    ({"seq": 1, "mouse": [0.5, 45]}, "mouse", 400),
    ({"seq": 1, "mode": "script", "script": [{"mouse": [True, 1]}]}, "script[0].mouse[0]", 400),
    ({"seq": 1, "mode": "script", "script": []}, "script", 400),
    ({"seq": 1, "mode": "script", "script": [{}] * (MAX_SCRIPT_ENTRIES + 1)}, "script", 400),
    ({"seq": 1, "mode": "script", "per": "block", "script": [{"camera": {"w2c": np.eye(4).tolist()}}]},
     "script[0]", 400),
    ({"seq": 1, "mode": "script", "script": [{"camera": {"w2c": (2 * np.eye(4)).tolist()}}]},
     "script[0].camera", 400),
    ({"seq": 1, "keyboard": ["w"], "extra": 1}, "extra", 400),
    ({"seq": 1, "block": 10_000}, "block", 409),
]  # fmt: skip


def test_every_bad_control_is_refused_naming_its_field_and_the_video_goes_on(world):
    """One live video takes every hostile control in turn: each is refused naming its field, and
    a good control after them is taken by the same session."""
    d, _ = world
    reader = Reader(d.url, {"prompt": "a path", "live": True, "size": SIZE, "seed": 1})
    reader.start()
    try:
        wait_until(lambda: reader.video_id is not None, 60)
        for control, param, status in BAD_CONTROLS:
            r = http.post(f"{d.url}/v1/videos/{reader.video_id}/controls", json=control, timeout=10)
            assert (r.status_code, r.json()["error"]["param"]) == (status, param), (control, r.text)
        ok = http.post(f"{d.url}/v1/videos/{reader.video_id}/controls", json={"seq": 9, "keyboard": ["s"]}, timeout=10)
        assert ok.status_code == 200, ok.text  # the session goes on
    finally:
        http.post(f"{d.url}/v1/videos/{reader.video_id}/stop", timeout=10)
        reader.join(120)
    assert reader.error is None and reader.fragment_count() >= 1


def test_nan_a_flood_and_the_websocket(world):
    """NaN (which Python's JSON reads) is refused; 1,000 controls a second are coalesced, with
    no stall; the WebSocket's session.control is answered with where it lands."""
    d, _ = world

    async def run():
        async with aiohttp.ClientSession() as s, s.ws_connect(d.url.replace("http", "ws") + "/v1/realtime/video") as ws:
            await ws.send_json({"type": "session.start", "prompt": "a path", "size": SIZE, "seed": 2})
            start = json.loads((await ws.receive()).data)
            vid = start["request_id"]
            arrivals = []

            async def read():
                async for msg in ws:
                    if msg.type == aiohttp.WSMsgType.BINARY:
                        arrivals.append(asyncio.get_running_loop().time())
                    elif msg.type == aiohttp.WSMsgType.TEXT:
                        replies.append(json.loads(msg.data))

            replies: list[dict] = []
            reader = asyncio.create_task(read())
            while len(arrivals) < 3:
                await asyncio.sleep(0.05)
            raw = '{"seq": 1, "mouse": [NaN, 0]}'
            async with s.post(f"{d.url}/v1/videos/{vid}/controls", data=raw,
                              headers={"Content-Type": "application/json"}) as r:  # fmt: skip
                assert r.status == 400 and (await r.json())["error"]["param"] == "mouse[0]"
            t0 = asyncio.get_running_loop().time()
            statuses, lanes = [], asyncio.Semaphore(16)

            async def press(i: int) -> None:  # held-key changes, 16 in flight: they may arrive out of order
                keys = [["w"], ["a"], [], ["d", "i"]][i % 4]
                async with (
                    lanes,
                    s.post(f"{d.url}/v1/videos/{vid}/controls", json={"seq": 10 + i, "keyboard": keys}) as r,
                ):
                    statuses.append(r.status)

            n = len(arrivals)
            await asyncio.gather(*(press(i) for i in range(1000)))
            flood_s = asyncio.get_running_loop().time() - t0
            during = len(arrivals) - n
            await ws.send_json({"type": "session.control", "seq": 5000, "keyboard": ["s"]})
            await ws.send_json({"type": "session.control", "seq": 4000, "keyboard": ["s"]})
            while len(replies) < 2:
                await asyncio.sleep(0.05)
            n = len(arrivals)

            async def more() -> None:
                while len(arrivals) < n + 3:
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(more(), 60)  # the video goes on after the flood
            async with s.get(d.url + "/health") as h:
                health = await h.json()
            async with s.get(f"{d.url}/v1/videos/{vid}") as v:
                video = await v.json()
            await ws.send_json({"type": "session.stop"})
            await asyncio.wait_for(reader, 120)
            return statuses, flood_s, during, replies, health, video

    statuses, flood_s, during, replies, health, video = asyncio.run(run())
    # coalesced (200) or, arriving after a later seq, refused (409): nothing else
    assert set(statuses) <= {200, 409} and statuses.count(200) > 500, sorted(set(statuses))
    print(f"flood: 1000 controls in {flood_s:.2f} s, {during} fragments meanwhile")
    ack, late = replies[0], replies[1]
    assert ack["type"] == "session.control.ack" and ack["seq"] == 5000 and ack["block"] >= 3
    assert late["type"] == "error" and late["code"] == "seq_not_increasing" and late["param"] == "seq"
    assert health["status"] == "ok", health
    assert video["status"] != "failed", video


def tap_w_while_it_plays(page) -> None:
    """Start the page's video; once it plays, hold W and let go: both controls answered."""
    page.click("#start")
    page.wait_for_function("window.player.firstAdvanceAt !== null", timeout=120_000)
    page.keyboard.down("w")
    page.wait_for_timeout(300)
    page.keyboard.up("w")
    page.wait_for_function("window.player.controls.filter((c) => c.ack).length === 2", timeout=30_000)


@pytest.mark.timeout(300)
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_key_presses_in_the_player_page_drive_the_video_while_it_plays(world, tmp_path):
    """Chromium on the player page: the world model's controls show, a key held and released
    while the video plays is sent, acknowledged with its block, and reaches the screen."""
    from playwright.sync_api import sync_playwright

    d, _ = world
    with sync_playwright() as p:
        browser, page, console = open_player(p, d.url)
        assert page.is_visible("#controls") and page.is_checked("#live")
        page.fill("#prompt", "a forest path")
        page.fill("#size", SIZE)
        tap_w_while_it_plays(page)
        page.wait_for_function("window.player.controls[0].shownMs !== null", timeout=60_000)
        sent = page.evaluate("window.player.controls.map(({li, ...c}) => c)")
        acks = page.inner_text("#acks")
        page.click("#stop")
        page.wait_for_function("window.player.state === 'complete'", timeout=60_000)
        errors = page.evaluate("window.player.mediaErrors")
        page.screenshot(path=str(tmp_path / "world.png"))
        browser.close()
    assert [c["keys"] for c in sent] == [["w"], []] and [c["seq"] for c in sent] == [1, 2]
    assert sent[0]["ack"]["block"] >= 1 and sent[1]["ack"]["block"] >= sent[0]["ack"]["block"]
    assert sent[0]["shownMs"] > 0 and "on screen after" in acks
    assert errors == [], (errors, console)


@pytest.mark.timeout(300)
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_the_player_page_starts_matrix_game_from_a_picture_and_drives_it(matrix_game, tmp_path):
    """Chromium on a Matrix-Game daemon: the page asks for the start picture, sends it, and W
    becomes Matrix-Game's `forward` (the release's key names), acknowledged while the video plays."""
    from playwright.sync_api import sync_playwright

    d, _ = matrix_game
    (tmp_path / "start.png").write_bytes(picture(96, 80))
    with sync_playwright() as p:
        browser, page, console = open_player(p, d.url)
        assert page.is_visible("#controls") and page.is_visible("#image-row")
        keys = page.inner_text("#keymap")
        page.set_input_files("#image", str(tmp_path / "start.png"))
        page.fill("#size", SIZE)
        page.wait_for_timeout(300)  # the file read into a data URL
        tap_w_while_it_plays(page)
        sent = page.evaluate("window.player.controls.map(({li, ...c}) => c)")
        page.click("#stop")
        page.wait_for_function("window.player.state === 'complete'", timeout=60_000)
        errors = page.evaluate("window.player.mediaErrors")
        browser.close()
    assert "forward" in keys and "mouse" in keys
    assert [c["keys"] for c in sent] == [["forward"], []] and all(c["mouse"] == [0, 0] for c in sent)
    assert sent[0]["ack"]["block"] >= 1 and errors == [], (errors, console)


def test_a_model_without_controls_refuses_them(plain_daemon):
    url = plain_daemon.url
    r = http.post(url + "/v1/videos", json={"prompt": "x", "num_frames": 9, "size": "128x64",
                                             "controls": [{"seq": 1, "keyboard": ["w"]}]}, timeout=10)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "controls_unsupported"
    assert r.json()["error"]["param"] == "controls[0]"


if shutil.which("ffprobe") is None:  # check_video's third opinion
    pytestmark = pytest.mark.skip("ffprobe is not installed")
