#!/usr/bin/env python3
"""Writes the Kubernetes manifests in this folder (a test keeps them equal to this output).

    python deploy/k8s/render.py --replicas 3 --namespace video --accelerator nvidia
    kubectl apply -n video -f deploy/k8s/

- `streamdiff.yaml`: a headless Service (stable DNS per pod, published before readiness so the
  balancer can still route a draining pod's jobs to it) and a StatefulSet (stable node ids: the
  pod name is the node id), each pod with its accelerators, /dev/shm large enough for the rings,
  readiness on /health, liveness on /livez (draining or degraded is alive), and a preStop drain
  that lets running streams finish inside terminationGracePeriodSeconds.
- `volumes.yaml`: the shared store (ReadWriteMany) where finished videos outlive their pod, and
  the weights (ReadOnlyMany).
- `haproxy.yaml`: the balancer (a ConfigMap rendered by streamdiff.cluster, a Deployment, a
  Service) that routes ids to their pod and new sessions by the pods' agents.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from streamdiff.cluster import Node, render_haproxy  # noqa: E402

ACCELERATORS = {
    "nvidia": ("nvidia.com/gpu", ["--device", "cuda"]),
    "intel": ("gpu.intel.com/xe", ["--device", "xpu", "--encoder", "h264_vaapi"]),
}
DRAIN_TIMEOUT_S = 120  # [server] drain_timeout_s of the pods
HTTP, AGENT = 8000, 8001


def manifests(replicas: int, namespace: str, accelerator: str, gpus: int, image: str) -> dict[str, list[dict]]:
    resource, device_args = ACCELERATORS[accelerator]
    labels = {"app.kubernetes.io/name": "streamdiff"}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "streamdiff", "labels": labels},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels,
            "ports": [{"name": "http", "port": HTTP}, {"name": "agent", "port": AGENT}],
        },
    }
    # preStop: ask for the drain (idempotent; it answers how many sessions still run) until none
    # runs or the drain timeout passes; SIGTERM follows and finds nothing left to wait for.
    pre_stop = (
        "import json, os, time, urllib.request as u\n"
        "key = os.environ['STREAMDIFF_API_KEYS'].split(',')[0]\n"
        f"req = u.Request('http://127.0.0.1:{HTTP}/admin/drain', method='POST', "
        "headers={'Authorization': 'Bearer ' + key})\n"
        f"end = time.time() + {DRAIN_TIMEOUT_S}\n"
        "while json.load(u.urlopen(req, timeout=10))['running'] and time.time() < end:\n"
        "    time.sleep(1)\n"
    )
    container = {
        "name": "streamdiffd",
        "image": image,
        "args": [
            "streamdiffd",
            "--host",
            "0.0.0.0",
            "--port",
            str(HTTP),
            "--agent-port",
            str(AGENT),
            "--node-id",
            "$(POD_NAME)",
            "--store-dir",
            "/var/lib/streamdiff/videos",
            *device_args,
            "--dit-gpus",
            "1",
            "--vae-gpus",
            str(gpus - 1),
            "--model",
            "/models/Wan2.1-T2V-1.3B",
        ],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {
                "name": "STREAMDIFF_API_KEYS",
                "valueFrom": {"secretKeyRef": {"name": "streamdiff-api-keys", "key": "keys"}},
            },
        ],
        "ports": [{"name": "http", "containerPort": HTTP}, {"name": "agent", "containerPort": AGENT}],
        "resources": {"limits": {resource: gpus}, "requests": {"cpu": "4", "memory": "32Gi"}},
        # Loading the real model takes minutes: the startup probe covers it, then liveness starts.
        "startupProbe": {"httpGet": {"path": "/livez", "port": HTTP}, "periodSeconds": 10, "failureThreshold": 90},
        "readinessProbe": {"httpGet": {"path": "/health", "port": HTTP}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/livez", "port": HTTP}, "periodSeconds": 10, "failureThreshold": 3},
        "lifecycle": {"preStop": {"exec": {"command": ["python3", "-c", pre_stop]}}},
        "volumeMounts": [
            {"name": "shm", "mountPath": "/dev/shm"},
            {"name": "videos", "mountPath": "/var/lib/streamdiff/videos"},
            {"name": "models", "mountPath": "/models", "readOnly": True},
        ],
    }
    stateful = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "streamdiff", "labels": labels},
        "spec": {
            "serviceName": "streamdiff",
            "replicas": replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    # preStop drain (up to DRAIN_TIMEOUT_S) + SIGTERM's own drain and stop, with room.
                    "terminationGracePeriodSeconds": DRAIN_TIMEOUT_S + 60,
                    "containers": [container],
                    "volumes": [
                        # The rings live in /dev/shm; a container's default is 64 MiB.
                        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
                        {"name": "videos", "persistentVolumeClaim": {"claimName": "streamdiff-videos"}},
                        {"name": "models", "persistentVolumeClaim": {"claimName": "streamdiff-models"}},
                    ],
                },
            },
        },
    }
    pvcs = [
        {  # finished videos, shared by every pod
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "streamdiff-videos", "labels": labels},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "200Gi"}}},
        },
        {  # the weights (Wan 2.1 release or diffusers layout), filled once, read by every pod
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "streamdiff-models", "labels": labels},
            "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "50Gi"}}},
        },
    ]
    nodes = [
        Node(f"streamdiff-{i}", f"streamdiff-{i}.streamdiff.{namespace}.svc.cluster.local", HTTP, AGENT)
        for i in range(replicas)
    ]
    cfg, node_map = render_haproxy(
        nodes, "*:8080", "/usr/local/etc/haproxy/nodes.map", dns=True, log="stdout format raw local0"
    )
    lb_labels = {"app.kubernetes.io/name": "streamdiff-lb"}
    haproxy = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "streamdiff-haproxy", "labels": lb_labels},
            "data": {"haproxy.cfg": cfg, "nodes.map": node_map},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "streamdiff-lb", "labels": lb_labels},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": lb_labels},
                "template": {
                    "metadata": {"labels": lb_labels},
                    "spec": {
                        "containers": [
                            {
                                "name": "haproxy",
                                "image": "haproxy:2.6",
                                "ports": [{"name": "http", "containerPort": 8080}],
                                "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 5},
                                "volumeMounts": [{"name": "config", "mountPath": "/usr/local/etc/haproxy"}],
                            }
                        ],
                        "volumes": [{"name": "config", "configMap": {"name": "streamdiff-haproxy"}}],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "streamdiff-lb", "labels": lb_labels},
            "spec": {"selector": lb_labels, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
        },
    ]
    return {"streamdiff.yaml": [service, stateful], "volumes.yaml": pvcs, "haproxy.yaml": haproxy}


def dump(docs: list[dict]) -> str:
    head = "# Generated by deploy/k8s/render.py; edit that, not this.\n"
    return head + "---\n".join(yaml.safe_dump(d, sort_keys=False, width=120) for d in docs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--accelerator", choices=sorted(ACCELERATORS), default="nvidia")
    ap.add_argument("--gpus", type=int, default=4, help="per pod: 1 for the DiT, the rest one VAE group")
    ap.add_argument("--image", default="streamdiff:latest")
    ap.add_argument("--out", default=str(HERE))
    a = ap.parse_args()
    for name, docs in manifests(a.replicas, a.namespace, a.accelerator, a.gpus, a.image).items():
        (Path(a.out) / name).write_text(dump(docs))


if __name__ == "__main__":
    main()
