"""Every endpoint of the HTTP API and its errors, against the real daemon."""

from __future__ import annotations

import time

import httpx
import pytest

from ..helpers import Daemon, decode, ffprobe, fragments, http, stream_video


@pytest.fixture
def d(plain_daemon):
    return plain_daemon  # the run's shared plain daemon, idle (tests/conftest.py)


def wait_done(d: Daemon, video_id: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = http.get(f"{d.url}/v1/videos/{video_id}", timeout=10).json()
        if v["status"] in ("completed", "failed"):
            return v
        time.sleep(0.1)
    raise TimeoutError(video_id)


def test_create_retrieve_download(d):
    r = http.post(d.url + "/v1/videos", json={"prompt": "a quiet harbour", "num_frames": 25, "size": "128x64"})
    assert r.status_code == 200 and r.headers.get("openai-poll-after-ms")
    v = r.json()
    assert v["object"] == "video" and v["status"] in ("queued", "in_progress") and v["id"].startswith("video_")
    assert v["size"] == "128x64" and v["model"] == "tiny" and v["seconds"] == "1.5625" and v["num_frames"] == 25
    done = wait_done(d, v["id"])
    assert done["status"] == "completed" and done["progress"] == 100 and done["completed_at"] >= done["created_at"]
    assert done["expires_at"] > done["completed_at"]
    body = http.get(f"{d.url}/v1/videos/{v['id']}/content", timeout=30)
    assert body.status_code == 200 and body.headers["content-type"] == "video/mp4"
    assert body.headers["accept-ranges"] == "bytes"
    assert decode(body.content)["frames"] == 25


def test_content_streams_from_the_start_while_running(d):
    v = http.post(d.url + "/v1/videos", json={"prompt": "rain", "num_frames": 81, "size": "128x64"}).json()
    with http.stream("GET", f"{d.url}/v1/videos/{v['id']}/content", timeout=120) as r:
        assert r.status_code == 200
        chunks, status = [], None
        for chunk in r.iter_raw():
            if not chunks:
                status = http.get(f"{d.url}/v1/videos/{v['id']}", timeout=10).json()["status"]
            chunks.append(chunk)
        data = b"".join(chunks)
    assert data[4:8] == b"ftyp"
    assert status == "in_progress"
    assert decode(data)["frames"] == 81
    # The same bytes as the finished file.
    assert http.get(f"{d.url}/v1/videos/{v['id']}/content", timeout=30).content == data


def test_byte_ranges_of_a_finished_video(d):
    v = http.post(d.url + "/v1/videos", json={"prompt": "dunes", "num_frames": 9, "size": "128x64"}).json()
    wait_done(d, v["id"])
    url = f"{d.url}/v1/videos/{v['id']}/content"
    full = http.get(url).content
    part = http.get(url, headers={"Range": "bytes=10-99"})
    assert part.status_code == 206 and part.content == full[10:100]
    assert part.headers["content-range"] == f"bytes 10-99/{len(full)}"
    assert http.get(url, headers={"Range": "bytes=-16"}).content == full[-16:]
    assert http.get(url, headers={"Range": "bytes=100-"}).content == full[100:]
    bad = http.get(url, headers={"Range": f"bytes={len(full)}-"})
    assert bad.status_code == 416 and bad.headers["content-range"] == f"bytes */{len(full)}"
    assert http.get(url, headers={"Range": "bytes=-0"}).status_code == 416
    assert http.get(url, headers={"Range": f"bytes=5-{10 * len(full)}"}).content == full[5:]


def test_range_headers_per_rfc_9110(d):
    v = http.post(d.url + "/v1/videos", json={"prompt": "reeds", "num_frames": 9, "size": "128x64"}).json()
    wait_done(d, v["id"])
    url = f"{d.url}/v1/videos/{v['id']}/content"
    whole = http.get(url)
    full, etag, modified = whole.content, whole.headers["etag"], whole.headers["last-modified"]
    # Malformed, reversed and multi-range headers are ignored: the whole video, 200.
    for header in ("bytes=abc", "bytes=9-2", "bytes=0-1,5-6", "items=0-9", "bytes="):
        r = http.get(url, headers={"Range": header})
        assert r.status_code == 200 and r.content == full and "content-range" not in r.headers, header
    # If-Range: the range only when the validator still names this video.
    for validator, status in ((etag, 206), (modified, 206), ('"video_other"', 200), ("W/" + etag, 200)):
        r = http.get(url, headers={"Range": "bytes=0-9", "If-Range": validator})
        assert r.status_code == status and r.content == (full[:10] if status == 206 else full), validator


def test_integer_fields_are_exact(d):
    body = {"prompt": "a lighthouse", "num_frames": 5, "size": "128x64"}
    top = http.post(d.url + "/v1/videos", json={**body, "seed": 2**63 - 1}).json()
    assert top["seed"] == 2**63 - 1
    videos = []
    for seed in (2**53 + 1, 2**53 + 2):
        data, _, _ = stream_video(d.url, {**body, "seed": seed})
        videos.append(decode(data)["pixels"])
    assert any((a != b).any() for a, b in zip(*videos))
    for seed, param in ((2**63, "seed"), (1.5, "seed"), ("12x", "seed"), (-1, "seed")):
        r = http.post(d.url + "/v1/videos", json={**body, "seed": seed})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, seed
    assert http.post(d.url + "/v1/videos", json={**body, "seed": 5.0}).json()["seed"] == 5
    form = http.post(d.url + "/v1/videos", data={**body, "num_frames": "5", "seed": str(2**63 - 1)}).json()
    assert form["seed"] == 2**63 - 1


def test_unknown_ids_are_404(d):
    for method, path in (
        ("GET", "/v1/videos/video_nope"),
        ("GET", "/v1/videos/video_nope/content"),
        ("DELETE", "/v1/videos/video_nope"),
        ("GET", "/v1/models/sora-2"),
    ):
        r = http.request(method, d.url + path)
        assert r.status_code == 404, path
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = http.get(d.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = http.put(d.url + "/v1/videos")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_delete_cancels_a_running_job_and_frees_its_work(d):
    v = http.post(d.url + "/v1/videos", json={"prompt": "forever", "seconds": 60, "size": "128x64"}).json()
    deadline = time.monotonic() + 60
    while http.get(f"{d.url}/v1/videos/{v['id']}").json()["frames_done"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    r = http.delete(f"{d.url}/v1/videos/{v['id']}")
    assert r.json() == {"id": v["id"], "object": "video.deleted", "deleted": True}
    assert http.get(f"{d.url}/v1/videos/{v['id']}").status_code == 404
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        p = d.health()["pipeline"]
        if p["tracked"] == 0 and p["latent_slots_used"] == 0 and p["frame_slots_used"] == 0:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(d.health()["pipeline"])


def test_delete_of_a_finished_job_removes_it(d):
    v = http.post(d.url + "/v1/videos", json={"prompt": "done", "num_frames": 5, "size": "128x64"}).json()
    wait_done(d, v["id"])
    assert http.delete(f"{d.url}/v1/videos/{v['id']}").json()["deleted"] is True
    assert http.get(f"{d.url}/v1/videos/{v['id']}/content").status_code == 404
    assert http.delete(f"{d.url}/v1/videos/{v['id']}").status_code == 404


def test_list_pagination_and_order(d):
    ids = [
        http.post(d.url + "/v1/videos", json={"prompt": f"p{i}", "num_frames": 1, "size": "64x64"}).json()["id"]
        for i in range(5)
    ]
    for i in ids:
        wait_done(d, i)
    listed = http.get(d.url + "/v1/videos", params={"limit": 100, "order": "asc"}).json()
    assert listed["object"] == "list"
    order = [v["id"] for v in listed["data"] if v["id"] in ids]
    assert order == ids
    page1 = http.get(d.url + "/v1/videos", params={"limit": 2, "order": "desc"}).json()
    assert len(page1["data"]) == 2 and page1["has_more"] is True and page1["data"][0]["id"] == ids[-1]
    page2 = http.get(d.url + "/v1/videos", params={"limit": 2, "order": "desc", "after": page1["last_id"]}).json()
    assert [v["id"] for v in page2["data"]] == ids[-4:-2][::-1]
    for params, param in (
        ({"limit": 0}, "limit"),
        ({"limit": "x"}, "limit"),
        ({"order": "up"}, "order"),
        ({"after": "video_nope"}, "after"),
    ):
        r = http.get(d.url + "/v1/videos", params=params)
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_models_and_health(d):
    models = http.get(d.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert http.get(d.url + "/v1/models/tiny").json()["fps"] == 16
    h = http.get(d.url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    assert set(h.json()["workers"]) == {"dit0", "vae0.0"}


def test_openai_style_multipart_and_size_field(d):
    r = http.post(d.url + "/videos", data={"prompt": "form", "seconds": "0.5", "size": "64x64", "fps": "8"})
    assert r.status_code == 200, r.text
    v = wait_done(d, r.json()["id"])
    assert v["num_frames"] == 4 and v["fps"] == 8
    r = http.post(
        d.url + "/v1/videos",
        files={"input_reference": ("a.png", b"png", "image/png")},
        data={"prompt": "with an image"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference"


def test_failed_stream_is_a_truncated_transfer_and_a_failed_job(d):
    """Cancel a streaming job with DELETE: its stream must end without the final chunk."""
    with http.stream(
        "POST",
        d.url + "/v1/videos",
        timeout=60,
        json={"prompt": "interrupted", "seconds": 30, "size": "128x64", "stream": True},
    ) as r:
        vid = r.headers["x-video-id"]
        got = b""
        with pytest.raises(httpx.RemoteProtocolError):
            for chunk in r.iter_raw():
                got += chunk
                if len([f for f in fragments(got) if "end" in f]) == 1:
                    http.delete(f"{d.url}/v1/videos/{vid}")


def test_truncated_download_decodes_up_to_its_last_whole_fragment(d):
    data, _, _ = stream_video(d.url, {"prompt": "a long road", "num_frames": 81, "size": "128x64", "seed": 3})
    frags = fragments(data)
    assert len(frags) == 7
    cut = (frags[3]["end"] + frags[4]["end"]) // 2  # a client killed in the middle of the fifth fragment
    partial = decode(data[:cut], strict=False)
    assert partial["frames"] >= sum(f["samples"] for f in frags[:4])
    probe = ffprobe(data[:cut])
    if probe is not None:
        assert probe["frames"] >= sum(f["samples"] for f in frags[:4])
    full = decode(data)
    assert all((a == b).all() for a, b in zip(partial["pixels"], full["pixels"]))


def test_metrics(d):
    stream_video(d.url, {"prompt": "metrics", "num_frames": 25, "size": "128x64"})
    text = http.get(d.url + "/metrics").text
    assert "# TYPE streamdiff_stage_block_seconds histogram" in text
    for stage in ("dit", "vae", "encode"):
        assert f'streamdiff_stage_block_seconds_count{{stage="{stage}"}}' in text
    for name in (
        "streamdiff_time_to_first_fragment_seconds_count",
        "streamdiff_fragments_total",
        "streamdiff_frames_total",
        "streamdiff_stalls_total",
        "streamdiff_sessions_active",
        "streamdiff_sessions_queued",
        "streamdiff_decode_queue_depth",
        'streamdiff_worker_up{worker="dit0"} 1',
    ):
        assert name in text, name
    frames = float(next(ln.split()[1] for ln in text.splitlines() if ln.startswith("streamdiff_frames_total")))
    assert frames >= 25
    # Parsed by Prometheus' own parser: types right, every sample a number.
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["streamdiff_frames"].type == "counter" and fams["streamdiff_sessions_active"].type == "gauge"
    assert fams["streamdiff_stage_block_seconds"].type == "histogram"


def test_counters_are_exact_past_a_million():
    """1,234,567 frames print as that number (our hand-written exposition printed 1.23457e+06)."""
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from streamdiff.metrics import Metrics

    m = Metrics()
    m.frames.inc(1_234_567)
    m.requests.labels('2xx"\\n').inc()  # a label value that needs escaping
    m.watch(SimpleNamespace(scheduler=None, pool=None), SimpleNamespace(jobs={}))
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    assert fams["streamdiff_frames"].samples[0].value == 1_234_567
    assert fams["streamdiff_http_requests"].samples[0].labels == {"status": '2xx"\\n'}


def test_client_example(d, tmp_path):
    import subprocess
    import sys

    from ..helpers import ROOT

    out = tmp_path / "c.mp4"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "client.py"),
            "--url",
            d.url,
            "--size",
            "128x64",
            "--scene",
            "a fox in snow|1",
            "--scene",
            "the fox at a lake|1|continue",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "scene 2 at frame 16: the fox at a lake" in r.stdout and "done: 32 frames" in r.stdout
    assert decode(out.read_bytes())["frames"] == 32


def test_finished_videos_are_kept_within_the_byte_budget(tmp_path):
    cfg = tmp_path / "c.toml"
    # the seeded weights' noise, over 50 kB a video (the trained default's compress to 26 kB)
    cfg.write_text(
        '[model]\npreset = "tiny-random"\n[limits]\nkeep_completed_bytes = 150000\nkeep_completed_min_s = 0.2\n'
    )
    daemon = Daemon("--config", str(cfg))
    try:
        ids = []
        for i in range(3):
            v = http.post(
                daemon.url + "/v1/videos", json={"prompt": f"v{i}", "num_frames": 33, "size": "128x64", "seed": i}
            ).json()
            wait_done(daemon, v["id"])
            ids.append(v["id"])
        sizes = [
            len(http.get(f"{daemon.url}/v1/videos/{i}/content").content)
            if http.get(f"{daemon.url}/v1/videos/{i}/content").status_code == 200
            else None
            for i in ids
        ]
        assert sizes[0] is None  # the oldest expired first
        assert sizes[-1] is not None
        gone = http.get(f"{daemon.url}/v1/videos/{ids[0]}/content")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "expired"
        assert http.get(f"{daemon.url}/v1/videos/{ids[0]}").json()["status"] == "completed"
    finally:
        daemon.stop()
