#!/usr/bin/env python3
"""Writes haproxy.cfg and nodes.map here for the hosts given (defaults: the example's three).

    python deploy/haproxy/render.py node1=10.0.0.11 node2=10.0.0.12 node3=10.0.0.13
    sudo cp deploy/haproxy/haproxy.cfg /etc/haproxy/haproxy.cfg
    sudo cp deploy/haproxy/nodes.map /etc/haproxy/streamdiff-nodes.map

Every node runs `streamdiffd --node-id NAME --host 0.0.0.0 --port 8000 --agent-port 8001`
(with API keys: it listens beyond loopback) and, for finished videos to outlive their node, the
same `--store-dir` on a shared filesystem. The routing is explained in streamdiff/cluster.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from streamdiff.cluster import Node, render_haproxy  # noqa: E402

MAP = "/etc/haproxy/streamdiff-nodes.map"


def example(args: list[str]) -> tuple[str, str]:
    pairs = [a.split("=", 1) for a in args] or [[f"node{i}", f"10.0.0.{10 + i}"] for i in (1, 2, 3)]
    nodes = [Node(name, host, 8000, 8001) for name, host in pairs]
    return render_haproxy(nodes, "*:80", MAP, log="/dev/log local0")


if __name__ == "__main__":
    cfg, node_map = example(sys.argv[1:])
    (HERE / "haproxy.cfg").write_text(cfg)
    (HERE / "nodes.map").write_text(node_map)
