"""Hostile clients against one daemon, each class while another client's stream plays: every
hostile request gets its 4xx or `error` event, the log has no traceback, no worker restarts,
/health stays ok, and the other stream is what it streams alone: its bytes, or, where its
blocks batched with a hostile client's live video, every frame (helpers.assert_same_video). The daemon
serves a world model (minWM, tiny random weights in its checkpoint's layout), so that the
controls a script carries are the real ones. (WHEP's offers in finer detail, in process:
tests/server/test_whep_offers.py.)"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path

import aiohttp
import pytest

from streamdiff.controls import MAX_SCRIPT_ENTRIES

from ..helpers import assert_same_video, http, wait_until
from ..test_daemon_world import SIZE, serve, stream
from ..test_live import Reader

WITNESS = {"prompt": "a forest path", "num_frames": 13 + 16 * 5, "size": SIZE, "seed": 3}
CAMERA = {"camera": {"w2c": [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]}}
# The largest control script there is: MAX_SCRIPT_ENTRIES per-frame cameras, about 250 KB.
MAX_SCRIPT = {"mode": "script", "per": "frame", "script": [CAMERA] * MAX_SCRIPT_ENTRIES}
BOMBS = {
    "deep": "[" * 5000 + "]" * 5000,
    "digits": '{"seed": ' + "7" * 5000 + "}",
    "entries": "[" + ",".join(["[]"] * 70_000) + "]",  # 140,001 entries in 210 KB
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    for d, _ in serve("minwm-action2v", tmp_path_factory.mktemp("hostile")):
        yield d, stream(d.url, WITNESS)


def restarts(d) -> int:
    return sum(w["restarts"] for w in d.health()["workers"].values())


def metric(d, name: str) -> float:
    text = http.get(d.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def through(world, attack) -> None:
    """`attack()` while the witness streams; then everything this file's docstring promises."""
    d, reference = world
    log = Path(d.log.name)
    start, before = len(log.read_text(errors="replace")), restarts(d)
    reader = Reader(d.url, WITNESS)
    reader.start()
    wait_until(lambda: reader.fragment_count() >= 1, 120)
    attack()
    reader.join(300)
    assert reader.status == 200 and reader.error is None, reader.error
    assert_same_video(bytes(reader.data), reference)  # batched with the live one: every frame as alone
    assert "Traceback" not in log.read_text(errors="replace")[start:]
    assert restarts(d) == before and d.health()["status"] == "ok"


def refused(r, status: int, code: str | None = None) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and (code is None or err["code"] == code), err


def live(d) -> str:
    r = http.post(d.url + "/v1/videos", json={"prompt": "a road", "live": True, "size": SIZE, "seed": 1}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def test_json_bombs_on_every_body_reader(world):
    d, _ = world

    def attack():
        vid = live(d)
        json_ = {"Content-Type": "application/json"}
        for name, bomb in BOMBS.items():
            code = {"deep": "json_too_deep", "digits": "json_number_too_long", "entries": "json_too_many_entries"}[name]
            refused(http.post(d.url + "/v1/videos", content=bomb, headers=json_, timeout=30), 400, code)
            refused(http.post(f"{d.url}/v1/videos/{vid}/controls", content=bomb, headers=json_, timeout=30), 400, code)
            form = {"prompt": (None, "x"), "controls": (None, bomb)}
            refused(http.post(d.url + "/v1/videos", files=form, timeout=30), 400, code)
        http.post(f"{d.url}/v1/videos/{vid}/stop", timeout=10)

    through(world, attack)


def test_five_largest_control_scripts_in_a_row_stall_nothing(world):
    d, _ = world
    stalls = metric(d, "streamdiff_stalls_total")

    def attack():
        vid = live(d)
        for seq in range(1, 6):
            r = http.post(f"{d.url}/v1/videos/{vid}/controls", json={"seq": seq, **MAX_SCRIPT}, timeout=60)
            assert r.status_code == 200, r.text
        http.post(f"{d.url}/v1/videos/{vid}/stop", timeout=10)

    through(world, attack)
    text = http.get(d.url + "/metrics", timeout=10).text
    buckets = [(float(le), float(n)) for le, n in
               re.findall(r'^streamdiff_event_loop_lag_seconds_bucket{le="([^"+]+)"} (\S+)$', text, re.M)]  # fmt: skip
    total = metric(d, "streamdiff_event_loop_lag_seconds_count")
    p99 = next(le for le, n in buckets if n >= 0.99 * total)
    print(f"loop lag over the daemon's life: p99 <= {p99 * 1000:g} ms, max "
          f"{metric(d, 'streamdiff_event_loop_lag_max_seconds') * 1000:.1f} ms; stalls "
          f"{metric(d, 'streamdiff_stalls_total') - stalls:g}")  # fmt: skip
    assert metric(d, "streamdiff_stalls_total") == stalls


def test_hls_and_list_numbers_take_ascii_digits_only(world):
    d, _ = world

    def attack():
        vid = live(d)
        base = f"{d.url}/v1/videos/{vid}/hls"
        for url in (f"{base}/index.m3u8?_HLS_msn=²", f"{base}/index.m3u8?_HLS_msn=1&_HLS_part=①",
                    f"{base}/part/①.m4s", f"{base}/seg/².m4s", f"{d.url}/v1/videos?limit=٥"):  # fmt: skip
            refused(http.get(url, timeout=30), 400)
        http.post(f"{d.url}/v1/videos/{vid}/stop", timeout=10)

    through(world, attack)


def test_hostile_whep_offers(world):
    d, _ = world
    from ..server.test_whep_offers import client_offer, mutations, only_profile

    async def offer():
        client, sdp = await client_offer()
        await client.close()
        return sdp

    sdp = asyncio.run(offer())

    def attack():
        vid = live(d)
        url, ctype = f"{d.url}/v1/videos/{vid}/whep", {"Content-Type": "application/sdp"}
        for body in mutations(sdp).values():
            refused(http.post(url, content=body, headers=ctype, timeout=30), 400, "invalid_sdp")
        refused(
            http.post(url, content=only_profile(sdp, "640c1f"), headers=ctype, timeout=30), 406, "unsupported_codec"
        )
        bogus = {"Content-Type": "application/sdp; charset=bogus"}
        refused(http.post(url, content=sdp, headers=bogus, timeout=30), 400, "invalid_charset")
        refused(http.post(url, content=sdp.encode() + b"\xff", headers=ctype, timeout=30), 400, "invalid_charset")
        refused(http.post(url, content=sdp + "a=x:" + "y" * (2 << 20), headers=ctype, timeout=30), 413)
        http.post(f"{d.url}/v1/videos/{vid}/stop", timeout=10)

    through(world, attack)


def test_bad_websocket_messages_mid_session_get_errors_and_the_session_goes_on(world):
    d, _ = world
    result: dict = {}

    async def session():
        async with aiohttp.ClientSession() as s, s.ws_connect(d.url.replace("http", "ws") + "/v1/realtime/video") as ws:
            await ws.send_json({"type": "session.start", "prompt": "a path", "size": SIZE, "seed": 2, "seconds": 6})
            events, fragments = [], 0
            for bomb in [
                *BOMBS.values(),
                "{",
                "[]",
                json.dumps({"type": "session.control", "seq": 1, **MAX_SCRIPT}, separators=(",", ":")),
            ]:
                await ws.send_str(bomb)
            await ws.send_bytes(b"\x00")
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.BINARY:
                    fragments += 1
                elif msg.type == aiohttp.WSMsgType.TEXT:
                    events.append(json.loads(msg.data))
                    if events[-1]["type"] == "session.done":
                        break
            result.update(events=events, fragments=fragments)

    def attack():
        t = threading.Thread(target=lambda: asyncio.run(session()))
        t.start()
        t.join(300)

    through(world, attack)
    events = result["events"]
    codes = [e.get("code") for e in events if e["type"] == "error"]
    assert codes == ["json_too_deep", "json_number_too_long", "json_too_many_entries", "invalid_json",
                     "invalid_body", "invalid_body"], events  # fmt: skip
    assert any(e["type"] == "session.control.ack" for e in events), events
    assert events[-1]["type"] == "session.done" and result["fragments"] > 2, events
