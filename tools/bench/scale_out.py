#!/usr/bin/env python3
"""Scale-out figures with tools/dev/cluster.py on this machine's cores (all of them in every layout).

- Time to first fragment through HAProxy against straight to a node (interleaved, one stream at
  a time, so the balancer's own cost is what differs).
- Total frames/s of N nodes (each an equal share of the cores) against 1 node (all of them):
  `--streams` concurrent streams, repeated `--rounds` times, layouts interleaved.

    tools/bench/scale_out.py --nodes 2 --streams 4 --rounds 3 --json docs/results/bench_cluster.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


class Cluster:
    def __init__(self, nodes: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tools" / "dev" / "cluster.py"), "--nodes", str(nodes), "--port", "0"],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.nodes = {}
        for line in self.proc.stdout:
            info = json.loads(line)
            if "lb_port" in info:
                self.lb = f"http://127.0.0.1:{info['lb_port']}"
                break
            self.nodes[info["node"]] = f"http://127.0.0.1:{info['port']}"
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=120)


def stream(url: str, body: dict) -> tuple[float, int, float]:
    """(time to first fragment, bytes, wall) of one streaming request."""
    t0 = time.monotonic()
    first, n = None, 0
    with httpx.stream("POST", url + "/v1/videos", json={**body, "stream": True}, timeout=600) as r:
        r.raise_for_status()
        for chunk in r.iter_raw():
            first = first or time.monotonic() - t0
            n += len(chunk)
    return first, n, time.monotonic() - t0


def throughput(url: str, body: dict, streams: int) -> float:
    results = []
    threads = [threading.Thread(target=lambda: results.append(stream(url, body))) for _ in range(streams)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == streams, "a stream failed"
    return streams * body["num_frames"] / (time.monotonic() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--frames", type=int, default=121)
    ap.add_argument("--size", default="256x144")
    ap.add_argument("--json")
    a = ap.parse_args()
    body = {"prompt": "a bench across nodes", "num_frames": a.frames, "size": a.size}
    out = {
        "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"),
        "cores": len(__import__("os").sched_getaffinity(0)),
        "machine": platform.machine(),
        "body": body,
    }
    # 1. Time to first fragment, direct against through the balancer (same cluster, interleaved).
    c = Cluster(a.nodes)
    try:
        direct_url = next(iter(c.nodes.values()))
        stream(c.lb, {**body, "num_frames": 9})  # warm-up
        ttff = {"direct": [], "balancer": []}
        for _ in range(5):
            ttff["direct"].append(stream(direct_url, {**body, "num_frames": 25})[0])
            ttff["balancer"].append(stream(c.lb, {**body, "num_frames": 25})[0])
        out["ttff_s"] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in ttff.items()}
        print("time to first fragment:", json.dumps(out["ttff_s"]), flush=True)
    finally:
        c.stop()
    # 2. Frames/s of N nodes against 1 node, the same cores in all, interleaved rounds.
    fps = {"1 node": [], f"{a.nodes} nodes": []}
    for _ in range(a.rounds):
        for n, key in ((1, "1 node"), (a.nodes, f"{a.nodes} nodes")):
            c = Cluster(n)
            try:
                stream(c.lb, {**body, "num_frames": 9})
                fps[key].append(throughput(c.lb, body, a.streams))
                print(key, f"{fps[key][-1]:.1f} frames/s", flush=True)
            finally:
                c.stop()
    out["frames_per_s"] = {k: {"median": statistics.median(v), "runs": v} for k, v in fps.items()}
    out["ratio"] = out["frames_per_s"][f"{a.nodes} nodes"]["median"] / out["frames_per_s"]["1 node"]["median"]
    print(json.dumps(out, indent=1), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
