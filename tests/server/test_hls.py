"""LL-HLS (server/hls.py): the playlist's grammar and arithmetic as pure functions, then a live
video on the real daemon watched over HLS: the hint, a blocking reload, bounded waits and errors,
and the finished video's playlist read by ffprobe with the exact frame count, its parts and
segments byte for byte the video's MP4."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time

import pytest

from streamdiff.server.hls import LISTED_SEGMENTS, PARTS_PER_SEGMENT, Parts, playlist

from ..helpers import http


def validate(text: str) -> dict:
    """The playlist checked against RFC 8216bis's rules that a player relies on; returns what it
    lists: parts [(index, duration)], segments [(index, duration)], the hint, its targets."""
    lines = text.splitlines()
    assert lines[0] == "#EXTM3U" and "#EXT-X-VERSION:9" in lines
    tag = {ln.split(":", 1)[0]: ln.split(":", 1)[1] if ":" in ln else "" for ln in lines if ln.startswith("#")}
    target = int(tag["#EXT-X-TARGETDURATION"])
    part_target = float(re.search(r"PART-TARGET=([\d.]+)", tag["#EXT-X-PART-INF"])[1])
    hold = float(re.search(r"PART-HOLD-BACK=([\d.]+)", tag["#EXT-X-SERVER-CONTROL"])[1])
    assert hold >= 2 * part_target - 1e-6 and "CAN-BLOCK-RELOAD=YES" in tag["#EXT-X-SERVER-CONTROL"]
    assert tag["#EXT-X-MEDIA-SEQUENCE"] == "0" and tag["#EXT-X-MAP"] == 'URI="init.mp4"'
    parts, segments, pending, dur = [], [], [], None
    for ln in lines:
        if ln.startswith("#EXT-X-PART:"):
            m = re.fullmatch(r'#EXT-X-PART:DURATION=([\d.]+),URI="part/(\d+)\.m4s",INDEPENDENT=YES', ln)
            assert m, ln
            parts.append((int(m[2]), float(m[1])))
            pending.append(float(m[1]))
            assert float(m[1]) <= part_target + 1e-6
        elif ln.startswith("#EXTINF:"):
            dur = float(ln[8:].rstrip(","))
        elif ln and not ln.startswith("#"):
            k = int(re.fullmatch(r"seg/(\d+)\.m4s", ln)[1])
            assert k == len(segments), "segments in order from 0"
            assert round(dur) <= target
            if pending:  # a listed segment's duration is its parts'
                assert math.isclose(dur, sum(pending), abs_tol=1e-4) and len(pending) <= PARTS_PER_SEGMENT
            segments.append((k, dur))
            pending, dur = [], None
    idx = [i for i, _ in parts]
    assert idx == list(range(idx[0], idx[0] + len(idx))) if idx else True, "parts continuous"
    hint = re.search(r'#EXT-X-PRELOAD-HINT:TYPE=PART,URI="part/(\d+)\.m4s"', text)
    live = tag["#EXT-X-PLAYLIST-TYPE"] == "EVENT"
    assert live == ("#EXT-X-ENDLIST" not in tag) == (hint is not None) == ("#EXT-X-START" in tag)
    if live and idx:
        assert int(hint[1]) == idx[-1] + 1
    return {"parts": parts, "segments": segments, "hint": int(hint[1]) if hint else None, "live": live}


BLOCK = 12 / 16  # a steady block of the tiny default: 12 frames at 16 fps
FIRST = 9 / 16  # a shot's first: 1 + 4 * 2 frames


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 11, 13])
def test_a_live_playlist_lists_its_last_segments_parts_and_hints_the_next(n):
    durations = [FIRST] + [BLOCK] * (n - 1) if n else []
    got = validate(playlist(Parts(durations, BLOCK, live=True)))
    full = n // PARTS_PER_SEGMENT
    assert [k for k, _ in got["segments"]] == list(range(full))
    first_listed = max(0, (full - LISTED_SEGMENTS + 1) * PARTS_PER_SEGMENT)
    assert [i for i, _ in got["parts"]] == list(range(first_listed, n)) and got["hint"] == n


@pytest.mark.parametrize("n", [1, 4, 6])
def test_a_finished_playlist_is_vod_with_every_segment(n):
    durations = [FIRST] + [BLOCK] * (n - 2) + [2 / 16] if n > 1 else [FIRST]  # a short last block
    text = playlist(Parts(durations, BLOCK, live=False))
    got = validate(text)
    assert not got["live"] and got["parts"] == [] and text.endswith("#EXT-X-ENDLIST\n")
    assert len(got["segments"]) == -(-n // PARTS_PER_SEGMENT)
    assert math.isclose(sum(d for _, d in got["segments"]), sum(durations), abs_tol=1e-3)


# ----------------------------------------------------------------------------- on the daemon


def hls(url: str, vid: str, path: str, **params):
    return http.get(f"{url}/v1/videos/{vid}/hls/{path}", params=params, timeout=60)


def test_a_live_video_over_ll_hls_then_its_vod_playlist(plain_daemon):
    url = plain_daemon.url
    body = {"prompt": "a red ball moving right", "live": True, "seconds": 5, "size": "128x64", "seed": 4}
    vid = http.post(url + "/v1/videos", json=body, timeout=30).json()["id"]
    init = hls(url, vid, "init.mp4")  # waits for the video's first bytes
    assert init.status_code == 200 and init.content[4:8] == b"ftyp"
    assert init.headers["Cache-Control"] == "public, max-age=86400, immutable"
    first = hls(url, vid, "index.m3u8")
    assert first.status_code == 200 and first.headers["Content-Type"].startswith("application/vnd.apple.mpegurl")
    live = validate(first.text)
    assert live["live"], "a 5 s live video paced at 16 fps is still being made"
    nxt = live["hint"]
    # a blocking reload for the hinted part answers once it exists, and lists it
    msn, part = divmod(nxt, PARTS_PER_SEGMENT)
    blocked = hls(url, vid, "index.m3u8", _HLS_msn=msn, _HLS_part=part)
    assert blocked.status_code == 200 and "max-age=" in blocked.headers["Cache-Control"]
    after = validate(blocked.text)
    assert nxt in [i for i, _ in after["parts"]] or not after["live"]
    # the next hinted part, asked for before it exists, is served when made
    hinted = hls(url, vid, f"part/{after['hint']}.m4s") if after["live"] else None
    assert hinted is None or (hinted.status_code == 200 and hinted.content[4:8] in (b"emsg", b"moof"))
    # a part not hinted, far ahead: not made (at once); a reload far past the edge: refused
    for r, status in ((hls(url, vid, "part/500.m4s"), 404), (hls(url, vid, "index.m3u8", _HLS_msn=999), 400)):
        assert r.status_code == status and r.json()["error"]["param"] in ("part", "_HLS_msn")
    assert hls(url, vid, "index.m3u8", _HLS_part=1).status_code == 400  # _HLS_part alone
    assert hls(url, vid, "part/x1.m4s").status_code == 400
    deadline = time.monotonic() + 120  # the cap ends it (a hang shows here, not a speed)
    while http.get(f"{url}/v1/videos/{vid}", timeout=10).json()["status"] != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.3)
    vod = hls(url, vid, "index.m3u8")
    done = validate(vod.text)
    assert not done["live"] and vod.headers["Cache-Control"] == "public, max-age=3600"
    # byte for byte: the init segment and every part are the video's MP4; a segment is its parts
    content = http.get(f"{url}/v1/videos/{vid}/content", timeout=30).content
    n = sum(1 for _ in re.finditer(rb"moof", content))
    parts = [hls(url, vid, f"part/{i}.m4s").content for i in range(n)]
    assert init.content + b"".join(parts) == content
    for k, _ in done["segments"]:
        assert hls(url, vid, f"seg/{k}.m4s").content == b"".join(
            parts[k * PARTS_PER_SEGMENT : (k + 1) * PARTS_PER_SEGMENT]
        )
    assert hls(url, vid, f"part/{n}.m4s").status_code == 410  # the video ended before it
    assert hls(url, vid, f"seg/{len(done['segments'])}.m4s").status_code == 404
    if shutil.which("ffprobe"):  # ffmpeg's HLS reader: segments after the init segment
        probe = subprocess.run(
            ["ffprobe", "-v", "error", "-count_frames", "-select_streams", "v:0", "-show_entries",
             "stream=nb_read_frames,width,height", "-of", "json", f"{url}/v1/videos/{vid}/hls/index.m3u8"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert probe.returncode == 0, probe.stderr
        stream = json.loads(probe.stdout)["streams"][0]
        assert (stream["width"], stream["height"], stream["nb_read_frames"]) == (128, 64, "80")  # 5 s at 16 fps
