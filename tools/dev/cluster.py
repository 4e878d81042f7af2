#!/usr/bin/env python3
"""N streamdiffd nodes behind HAProxy on one machine, for development, demos and the tests.

    tools/dev/cluster.py --nodes 3 --port 8000 -- --vae-gpus 1
    tools/dev/cluster.py --nodes 2 --port 0 --store-dir /tmp/videos      # --port 0: a free port

Each node gets its node id (node1, node2, ...), its own ports (HTTP and HAProxy agent), its own
shared-memory instance and its share of the machine: on the CPU an equal share of the cores
(its workers pin inside it), with --gpus-per-node its own CUDA/XPU devices. Prints one JSON line
per node `{"node", "port", "pid"}` once all are healthy, then `{"lb_port"}` once HAProxy routes
to them, and stops everything on SIGTERM or SIGINT. Needs Debian's `haproxy`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from streamdiff.cluster import Node, render_haproxy  # noqa: E402
from streamdiff.ipc.shm import sweep_stale  # noqa: E402
from streamdiff.supervisor.topology import free_port, lost_its_port  # noqa: E402


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def cpu_shares(n: int) -> list[list[int]]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < n:
        return [cpus] * n  # fewer cores than nodes: they share them all
    per = len(cpus) // n
    return [cpus[i * per : (i + 1) * per] for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--port", type=int, default=8000, help="the balancer's port (0: a free one)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--store-dir", help="a directory every node keeps finished videos in")
    ap.add_argument("--gpus-per-node", type=int, default=0, help="give each node its own accelerators")
    ap.add_argument("--check-interval-ms", type=int, default=1000)
    ap.add_argument("--timeout-s", type=float, default=300, help="for the nodes to become healthy")
    ap.add_argument("daemon_args", nargs="*", help="streamdiffd flags for every node (after --)")
    a = ap.parse_args()
    if a.nodes < 1:
        ap.error("--nodes must be at least 1")

    work = Path(tempfile.mkdtemp(prefix="streamdiff-cluster-"))
    procs: list[subprocess.Popen] = []
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    shares = cpu_shares(a.nodes)

    def launch(i: int) -> tuple[Node, subprocess.Popen]:
        node = Node(f"node{i + 1}", a.host, free_port(), free_port())
        cmd = [sys.executable, "-m", "streamdiff.cli", "--node-id", node.name, "--host", a.host]
        cmd += ["--port", str(node.port), "--agent-port", str(node.agent_port)]
        cmd += ["--instance", f"cl{os.getpid()}{node.name}"]
        if a.store_dir:
            cmd += ["--store-dir", a.store_dir]
        env = dict(os.environ)
        if a.gpus_per_node:
            devs = ",".join(str(i * a.gpus_per_node + k) for k in range(a.gpus_per_node))
            env["CUDA_VISIBLE_DEVICES"] = env["ZE_AFFINITY_MASK"] = devs
        share = shares[i]
        with open(work / f"{node.name}.log", "w") as log:  # the child keeps its own descriptor
            return node, subprocess.Popen(
                cmd + a.daemon_args,
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=(lambda s=share: os.sched_setaffinity(0, s)) if not a.gpus_per_node else None,
            )

    try:
        nodes: list[Node] = []
        for i in range(a.nodes):
            node, proc = launch(i)
            nodes.append(node)
            procs.append(proc)
        deadline = time.monotonic() + a.timeout_s
        pending = set(range(a.nodes))
        # A node whose free port another process took before it listened starts again on others,
        # up to twice.
        restarts = dict.fromkeys(range(a.nodes), 2)
        while pending and not stopping:
            for i in list(pending):
                if procs[i].poll() is not None:
                    tail = (work / f"{nodes[i].name}.log").read_text()[-3000:]
                    if lost_its_port(tail) and restarts[i]:
                        restarts[i] -= 1
                        nodes[i], procs[i] = launch(i)
                        continue
                    print(f"cluster: {nodes[i].name} exited with {procs[i].returncode}:\n{tail}", file=sys.stderr)
                    return 1
                if healthy(f"http://{a.host}:{nodes[i].port}"):
                    pending.discard(i)
            if time.monotonic() > deadline:
                print(f"cluster: nodes not healthy after {a.timeout_s:.0f}s; logs in {work}", file=sys.stderr)
                return 1
            time.sleep(0.2)
        for n, p in zip(nodes, procs):
            print(json.dumps({"node": n.name, "port": n.port, "pid": p.pid, "agent_port": n.agent_port}), flush=True)

        lb_port = a.port or free_port()
        cfg, node_map = render_haproxy(
            nodes, f"{a.host}:{lb_port}", str(work / "nodes.map"), a.check_interval_ms, log="stderr format raw local0"
        )
        (work / "nodes.map").write_text(node_map)
        (work / "haproxy.cfg").write_text(cfg)
        lb = subprocess.Popen(
            ["haproxy", "-db", "-f", str(work / "haproxy.cfg")],
            stdout=open(work / "haproxy.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(lb)
        while not stopping and not healthy(f"http://{a.host}:{lb_port}"):
            if lb.poll() is not None:
                print(f"cluster: haproxy exited:\n{(work / 'haproxy.log').read_text()[-3000:]}", file=sys.stderr)
                return 1
            time.sleep(0.1)
        print(json.dumps({"lb_port": lb_port, "config": str(work / "haproxy.cfg")}), flush=True)
        exited: set[str] = set()
        while not stopping:
            for n, p in zip(nodes, procs):
                if p.poll() is not None and n.name not in exited:
                    exited.add(n.name)
                    print(json.dumps({"node": n.name, "exited": p.returncode}), flush=True)
            time.sleep(0.2)
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        # A node that was killed (as the failover tests do) could not remove its rings: do it.
        for i in range(a.nodes):
            sweep_stale(f"cl{os.getpid()}node{i + 1}")


if __name__ == "__main__":
    sys.exit(main())
