"""Three nodes behind HAProxy (tools/dev/cluster.py, Debian's haproxy), loopback only: ids route to
their node, new sessions spread by load, a drained node finishes its stream while new ones go
elsewhere, and a killed node is marked down, its finished videos served from the shared store
and its running ones answered with a clear error."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from ..helpers import DEFAULT_LAYOUT, ROOT, Daemon, check_video, decode, http, stream_video
from .test_faults import start_stream

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None, reason="needs Debian's haproxy")
BODY = {"prompt": "through the balancer", "num_frames": 25, "size": "128x64"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    store = tmp_path_factory.mktemp("store")
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tools" / "dev" / "cluster.py"), "--nodes", "3", "--port", "0"]
        + ["--store-dir", str(store), "--check-interval-ms", "500"]
        # Each node a fixed layout: a node with none would plan, and profile the machine first.
        + ["--", *Daemon.flags, *DEFAULT_LAYOUT],
        stdout=subprocess.PIPE,
        text=True,
    )
    nodes, lb = {}, None
    for line in proc.stdout:
        info = json.loads(line)
        if "lb_port" in info:
            lb = f"http://127.0.0.1:{info['lb_port']}"
            break
        nodes[info["node"]] = info
    assert lb is not None, "tools/dev/cluster.py did not start"
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
    yield {"lb": lb, "nodes": nodes, "store": store, "proc": proc}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    # Every node's rings are gone, the killed node's too (tools/dev/cluster.py sweeps what it left).
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"sd-cl{proc.pid}node")] == []


def direct(cluster, node: str) -> str:
    return f"http://127.0.0.1:{cluster['nodes'][node]['port']}"


def wait_done(url: str, vid: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = http.get(f"{url}/v1/videos/{vid}", timeout=10).json()
        if v.get("status") in ("completed", "failed"):
            return v
        time.sleep(0.2)
    raise TimeoutError(vid)


@pytest.mark.timeout(300)
def test_jobs_created_through_the_balancer_are_found_by_id(cluster):
    lb, made = cluster["lb"], []
    for seed in range(4):
        r = http.post(lb + "/v1/videos", json={**BODY, "seed": seed}, timeout=30)
        assert r.status_code == 200
        node = r.headers["x-streamdiff-node"]
        assert r.json()["id"].endswith("_" + node)
        made.append((r.json()["id"], node))
    for vid, node in made:
        v = wait_done(lb, vid)  # through the balancer: always the node that holds it
        assert v["status"] == "completed"
        r = http.get(f"{lb}/v1/videos/{vid}/content", timeout=30)
        assert r.status_code == 200 and r.headers["x-streamdiff-node"] == node
        assert r.content == http.get(f"{direct(cluster, node)}/v1/videos/{vid}/content").content
        part = http.get(f"{lb}/v1/videos/{vid}/content", headers={"Range": "bytes=100-199"})
        assert part.status_code == 206 and part.content == r.content[100:200]
        assert decode(r.content)["frames"] == 25
    # Another node, asked directly: a finished video from the shared store; an id it cannot
    # answer for, a clear error naming the node that holds it, never another video.
    vid, node = made[0]
    other = next(n for n in cluster["nodes"] if n != node)
    r = http.get(f"{direct(cluster, other)}/v1/videos/{vid}/content")
    assert r.status_code == 200 and r.headers["x-streamdiff-node"] == other
    assert r.content == http.get(f"{lb}/v1/videos/{vid}/content").content
    unknown = "video_" + "0" * 24 + "_" + node
    r = http.get(f"{direct(cluster, other)}/v1/videos/{unknown}")
    assert r.status_code == 421 and r.json()["error"]["code"] == "wrong_node" and node in r.json()["error"]["message"]
    assert http.get(f"{direct(cluster, node)}/v1/videos/{unknown}").status_code == 404


@pytest.mark.timeout(300)
def test_new_sessions_spread_by_load(cluster):
    outs = [{} for _ in range(3)]
    threads = []
    for i, out in enumerate(outs):
        threads.append(start_stream(cluster["lb"], {**BODY, "num_frames": 121, "seed": 10 + i}, out))
        time.sleep(0.5)
    for t in threads:
        t.join()
    nodes = [out["node"] for out in outs]
    assert all(out.get("complete") for out in outs)
    assert len(set(nodes)) == 3, nodes  # three concurrent streams, three nodes


@pytest.mark.timeout(300)
def test_a_drained_node_finishes_its_stream_while_new_ones_go_elsewhere(cluster):
    out = {}
    t = start_stream(cluster["lb"], {**BODY, "num_frames": 157, "seed": 21}, out)
    while "node" not in out:
        time.sleep(0.05)
    node = out["node"]
    r = http.post(direct(cluster, node) + "/admin/drain", timeout=10)
    assert r.status_code == 202 and r.json()["state"] == "draining"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the agent says "drain" and /health turns 503 within a check or two
        r = http.post(cluster["lb"] + "/v1/videos", json=BODY, timeout=30)
        if r.status_code == 200 and r.headers["x-streamdiff-node"] != node:
            break
        time.sleep(0.2)
    placed = [http.post(cluster["lb"] + "/v1/videos", json=BODY, timeout=30) for _ in range(4)]
    assert all(p.status_code == 200 and p.headers["x-streamdiff-node"] != node for p in placed)
    t.join()
    assert out.get("complete"), out.get("error")
    check_video(out["data"], 157, 128, 64, 16)
    cluster["drained"] = node


@pytest.mark.timeout(300)
def test_a_killed_node_is_marked_down_and_its_videos_answer(cluster):
    lb, drained = cluster["lb"], cluster["drained"]
    victim = next(n for n in cluster["nodes"] if n != drained)
    url = direct(cluster, victim)
    finished = http.post(url + "/v1/videos", json={**BODY, "seed": 31}, timeout=30).json()["id"]
    wait_done(url, finished)
    time.sleep(0.5)  # the store write runs off the loop
    content = http.get(f"{url}/v1/videos/{finished}/content").content
    running = http.post(url + "/v1/videos", json={**BODY, "num_frames": 400, "seed": 32}, timeout=30).json()["id"]
    os.kill(cluster["nodes"][victim]["pid"], signal.SIGKILL)
    t_kill = time.monotonic()
    while http.get(f"{lb}/v1/videos/{running}", timeout=10).status_code != 421:
        # Checks every 500 ms mark it down in about 1.5 s; 30 s only ends the loop if it never does.
        assert time.monotonic() - t_kill < 30, "the balancer did not mark the node down"
        time.sleep(0.1)
    marked_down = time.monotonic() - t_kill
    lost = http.get(f"{lb}/v1/videos/{running}", timeout=10).json()["error"]
    assert lost["code"] == "wrong_node" and victim in lost["message"]
    # Its finished video: from the shared store, through the balancer, ranges included.
    v = http.get(f"{lb}/v1/videos/{finished}", timeout=10)
    assert v.status_code == 200 and v.json()["status"] == "completed" and v.json()["id"] == finished
    r = http.get(f"{lb}/v1/videos/{finished}/content", timeout=10)
    assert r.status_code == 200 and r.content == content
    part = http.get(f"{lb}/v1/videos/{finished}/content", headers={"Range": "bytes=10-19"}, timeout=10)
    assert part.status_code == 206 and part.content == content[10:20]
    # New sessions: the one node left that takes them.
    data, _, headers = stream_video(lb, {**BODY, "seed": 33})
    assert headers["x-streamdiff-node"] not in (victim, drained)
    check_video(data, 25, 128, 64, 16)
    print(f"marked down {marked_down:.2f}s after kill -9 (checks every 0.5 s, fall 2)")


def agent_says(port: int) -> str:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        return s.recv(100).decode()


@pytest.mark.timeout(300)
def test_one_node_ids_agent_drain_and_store_across_a_restart(tmp_path):
    """No balancer: the node's id and header, its agent's answers, POST /admin/drain's auth,
    and a restarted node (same node id, same store) still serving its finished video."""
    from ..helpers import Daemon, free_port

    agent = free_port()
    args = ("--node-id", "alpha", "--store-dir", str(tmp_path), "--agent-port", str(agent))
    d = Daemon(*args, env={"STREAMDIFF_API_KEYS": "k1"})
    auth = {"Authorization": "Bearer k1"}
    try:
        assert agent_says(agent) == "up ready 100%\n"
        r = http.post(d.url + "/v1/videos", json=BODY, headers=auth, timeout=30)
        vid = r.json()["id"]
        assert r.headers["x-streamdiff-node"] == "alpha" and vid.endswith("_alpha")
        wait_done_auth = time.monotonic() + 120
        while http.get(f"{d.url}/v1/videos/{vid}", headers=auth).json()["status"] != "completed":
            assert time.monotonic() < wait_done_auth
            time.sleep(0.2)
        content = http.get(f"{d.url}/v1/videos/{vid}/content", headers=auth).content
        assert http.get(d.url + "/health").headers["x-streamdiff-node"] == "alpha"
        assert http.post(d.url + "/admin/drain").status_code == 401  # keys configured: a key is needed
        assert http.post(d.url + "/admin/drain", headers=auth).status_code == 202
        assert agent_says(agent) == "drain\n"
        assert http.post(d.url + "/v1/videos", json=BODY, headers=auth).status_code == 503
    finally:
        d.stop()
    time.sleep(0.5)
    d = Daemon(*args, env={"STREAMDIFF_API_KEYS": "k1"})
    try:
        v = http.get(f"{d.url}/v1/videos/{vid}", headers=auth).json()
        assert v["status"] == "completed" and v["id"] == vid
        assert http.get(f"{d.url}/v1/videos/{vid}/content", headers=auth).content == content
        assert http.delete(f"{d.url}/v1/videos/{vid}", headers=auth).status_code == 200
        assert http.get(f"{d.url}/v1/videos/{vid}", headers=auth).status_code == 404
    finally:
        d.stop()
