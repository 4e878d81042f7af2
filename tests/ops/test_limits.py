"""Admission, limits, timeouts and auth."""

from __future__ import annotations

import socket
import time

import pytest

from ..helpers import Daemon, http


def daemon_with(tmp_path, text: str, **kw) -> Daemon:
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    return Daemon("--config", str(cfg), **kw)


@pytest.mark.timeout(300)
def test_admission_queue_and_429(tmp_path):
    # The count limits alone (the capacity model told to admit anything that waits < 10 min).
    d = daemon_with(
        tmp_path, "[limits]\nmax_sessions = 1\nmax_queue = 1\ntarget_utilization = 1.5\nmax_queue_wait_s = 600\n"
    )
    try:
        body = {"prompt": "long", "seconds": 60, "size": "128x64"}
        a = http.post(d.url + "/v1/videos", json=body).json()
        b = http.post(d.url + "/v1/videos", json=body).json()
        time.sleep(0.3)
        assert http.get(f"{d.url}/v1/videos/{b['id']}").json()["status"] == "queued"
        c = http.post(d.url + "/v1/videos", json=body)
        assert c.status_code == 429 and int(c.headers["retry-after"]) > 0
        assert c.json()["error"]["type"] == "rate_limit_error"
        http.delete(f"{d.url}/v1/videos/{a['id']}")
        deadline = time.monotonic() + 30
        while http.get(f"{d.url}/v1/videos/{b['id']}").json()["status"] == "queued":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        http.delete(f"{d.url}/v1/videos/{b['id']}")
    finally:
        d.stop()


@pytest.mark.timeout(300)
def test_slow_request_body_gets_408_and_a_stalled_reader_is_dropped(tmp_path):
    # The seeded weights' noise: the trained default's frames compress so well that a 60 s video
    # fits in the socket's buffers and completes before the reader's stall shows. At crf 1 each
    # frame is as big as H.264 baseline makes it: the buffers fill in about 120 frames (300 at
    # the default crf 23), and every frame costs the DiT, the VAE and the encoder CPU time.
    d = daemon_with(
        tmp_path,
        '[model]\npreset = "tiny-random"\n[server]\nrequest_read_timeout_s = 1.0\nclient_write_timeout_s = 2.0\n'
        "[encoder]\ncrf = 1\n",
    )
    try:
        host, port = "127.0.0.1", d.port
        # A client that promises a body and sends a few bytes only.
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(
                b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"pro'
            )
            reply = s.recv(4096).decode()
        assert reply.startswith("HTTP/1.1 408") and "request_timeout" in reply
        # A streaming client that stops reading: its session is cancelled once the socket is full.
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((host, port))
        body = b'{"prompt": "nobody watches", "seconds": 60, "size": "256x144", "stream": true}'
        s.sendall(
            b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        head = s.recv(1024).decode(errors="replace")
        video_id = next(ln.split(":", 1)[1].strip() for ln in head.split("\r\n") if ln.lower().startswith("x-video-id"))
        deadline = time.monotonic() + 60
        while True:
            job = http.get(f"{d.url}/v1/videos/{video_id}").json()
            if job["status"] == "failed":
                break
            assert time.monotonic() < deadline, job
            time.sleep(0.2)
        s.close()
        assert job["error"]["code"] == "cancelled" and job["frames_done"] < 960
        assert d.health()["status"] == "ok"
    finally:
        d.stop()


@pytest.mark.timeout(300)
def test_bearer_keys_from_env_and_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# operators\nfile-key-1\n\nfile-key-2\n")
    d = daemon_with(tmp_path, f"[server]\napi_keys_file = '{keys}'\n", env={"STREAMDIFF_API_KEYS": "env-key"})
    try:
        url = d.url + "/v1/models"
        for headers in (
            {},
            {"Authorization": "Bearer nope"},
            {"Authorization": "Basic env-key"},
            {"Authorization": "Bearer env-key-but-longer"},
        ):
            r = http.get(url, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
            assert r.headers["www-authenticate"] == "Bearer"
        for key in ("env-key", "file-key-1", "file-key-2"):
            assert http.get(url, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert http.post(d.url + "/v1/videos", json={"prompt": "x"}).status_code == 401
        assert http.get(d.url + "/health").status_code == 200  # always open
        assert http.get(d.url + "/metrics").status_code == 200  # open unless metrics_require_auth
        assert http.get(d.url + "/").status_code == 200
    finally:
        d.stop()
    d = daemon_with(tmp_path, "[server]\nmetrics_require_auth = true\n", env={"STREAMDIFF_API_KEYS": "k"})
    try:
        assert http.get(d.url + "/metrics").status_code == 401
        assert http.get(d.url + "/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
    finally:
        d.stop()


def test_missing_keys_file_is_a_config_error(tmp_path):
    import subprocess
    import sys

    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[server]\napi_keys_file = '{tmp_path / 'absent'}'\n")
    r = subprocess.run(
        [sys.executable, "-m", "streamdiff.cli", "--config", str(cfg)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "server.api_keys_file" in r.stderr


@pytest.mark.timeout(300)
def test_admission_from_the_capacity_model(tmp_path):
    """A target utilisation so low that one session fills its pipeline: the next request is
    predicted to start when the running one ends (its remaining length, streamed in real time):
    with that beyond max_queue_wait_s it gets 429 with the prediction as Retry-After; within it,
    it waits in the queue and starts when the first ends."""
    d = daemon_with(tmp_path, "[limits]\ntarget_utilization = 0.01\nmax_queue_wait_s = 1\n")
    try:
        body = {"prompt": "long", "seconds": 20, "size": "128x64"}
        a = http.post(d.url + "/v1/videos", json=body).json()
        b = http.post(d.url + "/v1/videos", json=body)
        assert b.status_code == 429 and 10 <= int(b.headers["retry-after"]) <= 21, b.headers
        assert "predicted to start" in b.json()["error"]["message"]
        http.delete(f"{d.url}/v1/videos/{a['id']}")
    finally:
        d.stop()
    d = daemon_with(tmp_path, "[limits]\ntarget_utilization = 0.01\nmax_queue_wait_s = 60\n")
    try:
        a = http.post(d.url + "/v1/videos", json=body).json()
        b = http.post(d.url + "/v1/videos", json=body).json()
        time.sleep(0.5)
        assert http.get(f"{d.url}/v1/videos/{b['id']}").json()["status"] == "queued"
        http.delete(f"{d.url}/v1/videos/{a['id']}")
        deadline = time.monotonic() + 30
        while http.get(f"{d.url}/v1/videos/{b['id']}").json()["status"] == "queued":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "streamdiff_block_cost_ratio_bucket" in http.get(d.url + "/metrics").text
        http.delete(f"{d.url}/v1/videos/{b['id']}")
    finally:
        d.stop()
