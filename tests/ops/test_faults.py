"""Fault injection on the real daemon: dead workers, SIGTERM with streams running, many client
disconnects, a killed supervisor. After each: the daemon serves a new request correctly, and no
shared-memory segment, child process or file descriptor is left behind."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time

import httpx
import pytest

from ..helpers import Daemon, assert_same_video, check_video, http, stream_video, wait_until


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def wait_idle(d: Daemon, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            h = d.health()
        except httpx.HTTPError:
            h = None
        if h and h["status"] == "ok":
            p = h["pipeline"]
            if p["tracked"] == 0 and p["latent_slots_used"] == 0 and p["frame_slots_used"] == 0:
                return h
        time.sleep(0.1)
    raise AssertionError(f"not idle: {d.health()}")


def start_stream(url: str, body: dict, out: dict) -> threading.Thread:
    def run():
        chunks = []
        try:
            with http.stream("POST", url + "/v1/videos", json={**body, "stream": True}, timeout=300) as r:
                out["id"] = r.headers["x-video-id"]
                out["node"] = r.headers.get("x-streamdiff-node")
                for chunk in r.iter_raw():
                    chunks.append(chunk)
                    out["bytes"] = sum(map(len, chunks))
            out["complete"] = True
        except httpx.HTTPError as exc:
            out["error"] = repr(exc)
        out["data"] = b"".join(chunks)

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "layout,victim_role",
    [
        (["--dit-gpus", "2", "--vae-gpus", "1"], "dit"),
        (["--dit-gpus", "1", "--vae-gpus", "2", "--vae-group-size", "1"], "vae"),
    ],
    ids=["kill-dit", "kill-vae"],
)
def test_killed_worker_fails_its_session_only(layout, victim_role):
    d = Daemon(*layout)
    try:
        base_fds, children = fd_count(d.proc.pid), set(d.children())
        body_a = {"prompt": "doomed", "num_frames": 201, "size": "128x64", "seed": 1}
        body_b = {"prompt": "survivor", "num_frames": 121, "size": "128x64", "seed": 2}
        reference_b, _, _ = stream_video(d.url, body_b)
        a, b = {}, {}
        ta = start_stream(d.url, body_a, a)
        wait_until(lambda: a.get("bytes", 0) > 0)
        tb = start_stream(d.url, body_b, b)
        wait_until(lambda: b.get("bytes", 0) > 0)
        job_a = http.get(f"{d.url}/v1/videos/{a['id']}").json()
        job_b = http.get(f"{d.url}/v1/videos/{b['id']}").json()
        victim = job_a["workers"]["dit"] if victim_role == "dit" else job_a["workers"]["vae"][0]
        survivor = job_b["workers"]["dit"] if victim_role == "dit" else job_b["workers"]["vae"][0]
        assert victim != survivor, (job_a["workers"], job_b["workers"])
        old_pid = d.health()["workers"][victim]["pid"]
        os.kill(old_pid, signal.SIGKILL)
        ta.join(120)
        tb.join(300)
        assert "error" in a and not a.get("complete")  # truncated, not a short clip that looks finished
        failed = http.get(f"{d.url}/v1/videos/{a['id']}").json()
        assert failed["status"] == "failed" and victim in failed["error"]["message"]
        assert b.get("complete")
        assert_same_video(b["data"], reference_b)  # correct beside the failure
        h = wait_idle(d, 120)  # the worker was restarted
        assert h["workers"][victim]["restarts"] == 1 and h["workers"][victim]["pid"] != old_pid
        data, _, _ = stream_video(d.url, {"prompt": "after", "num_frames": 25, "size": "128x64"})
        check_video(data, 25, 128, 64, 16)
        assert not alive(old_pid)
        assert set(d.children()) - children == {h["workers"][victim]["pid"]}
        assert fd_count(d.proc.pid) <= base_fds + 2
    finally:
        assert d.stop() == 0
        assert d.segments() == []


@pytest.mark.timeout(300)
def test_sigterm_drains_running_streams(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[server]\ndrain_timeout_s = 60.0\n")
    d = Daemon("--config", str(cfg))
    workers = d.children()
    out = {}
    # Long enough to still run while the checks below are made (the drain ends with it, and the
    # daemon stops listening then): 321 frames are ~3 s of work at 128x64 here.
    t = start_stream(d.url, {"prompt": "finish me", "num_frames": 321, "size": "128x64"}, out)
    wait_until(lambda: out.get("bytes", 0) > 0)
    d.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert http.get(d.url + "/health", timeout=10).status_code == 503
    r = http.post(d.url + "/v1/videos", json={"prompt": "too late", "num_frames": 5}, timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "unavailable"
    t.join(120)
    assert out.get("complete"), out.get("error")
    check_video(out["data"], 321, 128, 64, 16)
    assert d.proc.wait(timeout=60) == 0
    assert d.segments() == []
    # Workers are joined before the supervisor exits; multiprocessing's resource tracker notices
    # its parent is gone a moment later.
    wait_until(lambda: not any(alive(p) for p in workers), 10)


@pytest.mark.timeout(300)
def test_drain_deadline_cuts_long_streams(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[server]\ndrain_timeout_s = 2.0\n")
    d = Daemon("--config", str(cfg))
    out = {}
    t = start_stream(d.url, {"prompt": "too long", "seconds": 120, "size": "128x64"}, out)
    wait_until(lambda: out.get("bytes", 0) > 0)
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=60) == 0
    assert time.monotonic() - t0 < 60  # the 2 s deadline cut it: the stream had 120 s to run, under any load
    t.join(30)
    assert "error" in out and d.segments() == []


@pytest.mark.timeout(600)
def test_fifty_disconnects_at_random_points_leave_nothing_behind():
    # The seeded weights' noise, so that the stop points fall across the stream: the trained
    # default's frames compress so well that a 20 s video is shorter than the later ones. The
    # latest point is some blocks in, with more in flight: later ones cost CPU and test the same.
    # Fifty: a leak of anything a session holds (a descriptor, a child, a segment) shows in fifty
    # as in a hundred, and each costs the first blocks (0.2 CPU-s), whenever its client leaves.
    d = Daemon("--model", "tiny-random")
    try:
        rng = random.Random(7)
        h0 = wait_idle(d)
        base_fds, children = fd_count(d.proc.pid), set(d.children())
        segments = d.segments()
        for i in range(50):
            stop_at = rng.choice([0, 1, 200, 5_000, 30_000, 80_000])
            with http.stream(
                "POST",
                d.url + "/v1/videos",
                timeout=60,
                json={"prompt": f"disconnect {i}", "seconds": 20, "size": "128x64", "stream": True, "seed": i},
            ) as r:
                got = 0
                for chunk in r.iter_raw():
                    got += len(chunk)
                    if got >= stop_at:
                        break
        h = wait_idle(d, 120)
        assert {n: w["pid"] for n, w in h["workers"].items()} == {n: w["pid"] for n, w in h0["workers"].items()}
        assert set(d.children()) == children and d.segments() == segments
        assert fd_count(d.proc.pid) <= base_fds + 2
        data, _, _ = stream_video(d.url, {"prompt": "still fine", "num_frames": 33, "size": "128x64"})
        check_video(data, 33, 128, 64, 16)
        metrics = http.get(d.url + "/metrics").text
        assert 'streamdiff_sessions_total{outcome="cancelled"} 50' in metrics
    finally:
        assert d.stop() == 0
        assert d.segments() == []


@pytest.mark.timeout(300)
def test_supervisor_kill_then_restart_cleans_up():
    d = Daemon()
    instance, workers = d.instance, d.children()
    assert len(d.segments()) == 2
    d.proc.kill()  # SIGKILL to the supervisor only
    d.proc.wait()
    wait_until(lambda: not any(alive(p) for p in workers), 30)  # workers die with their parent
    stale = [n for n in os.listdir("/dev/shm") if n.startswith(f"sd-{instance}-")]
    assert len(stale) == 2  # a SIGKILLed supervisor cannot clean up
    d2 = Daemon(instance=instance)  # the same instance name: sweeps what the dead one left
    try:
        assert [n for n in os.listdir("/dev/shm") if n in stale] == []
        assert len(d2.segments()) == 2
        data, _, _ = stream_video(d2.url, {"prompt": "again", "num_frames": 21, "size": "128x64"})
        check_video(data, 21, 128, 64, 16)
        logs = d2.logs()
        assert "left by a dead instance" in logs
    finally:
        assert d2.stop() == 0
    assert d2.segments() == []
    assert subprocess.run(["pgrep", "-f", f"--instance {instance}"], capture_output=True).stdout == b""


def test_a_daemon_whose_free_port_was_taken_starts_again_on_another(monkeypatch):
    """The suite's starter (streamdiff/testing.py): a port picked free and taken by another
    process before the daemon listens (an outgoing connection's ephemeral port, say) fails that
    start naming the port, and the starter starts it again on another."""
    import socket

    from streamdiff import testing

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken])
        free = testing.free_port
        monkeypatch.setattr(testing, "free_port", lambda: next(picks, None) or free())
        d = Daemon()
        try:
            assert d.port != taken and d.health()["status"] == "ok"
        finally:
            assert d.stop() == 0
