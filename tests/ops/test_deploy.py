"""deploy/: the HAProxy configuration and the Kubernetes manifests are what their renderers
write (no hand-edited drift), HAProxy accepts both configurations, and every manifest is a
valid Kubernetes resource (kubernetes-validate, schemas offline) with the settings a streaming
node needs."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess

import pytest
import yaml

from ..helpers import ROOT


def load(path: str):
    spec = importlib.util.spec_from_file_location(path.replace("/", "_"), ROOT / path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def haproxy_accepts(cfg: str, node_map: str, map_path: str, tmp_path) -> None:
    if shutil.which("haproxy") is None:
        pytest.skip("needs Debian's haproxy")
    (tmp_path / "nodes.map").write_text(node_map)
    (tmp_path / "haproxy.cfg").write_text(cfg.replace(map_path, str(tmp_path / "nodes.map")))
    r = subprocess.run(["haproxy", "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_haproxy_example_is_rendered_and_valid(tmp_path):
    render = load("deploy/haproxy/render.py")
    cfg, node_map = render.example([])
    assert (ROOT / "deploy/haproxy/haproxy.cfg").read_text() == cfg
    assert (ROOT / "deploy/haproxy/nodes.map").read_text() == node_map
    haproxy_accepts(cfg, node_map, render.MAP, tmp_path)


def test_kubernetes_manifests_are_rendered_valid_and_drain_safely(tmp_path):
    kv = pytest.importorskip("kubernetes_validate")
    render = load("deploy/k8s/render.py")
    for accelerator in ("nvidia", "intel"):
        files = render.manifests(3, "default", accelerator, 4, "streamdiff:latest")
        if accelerator == "nvidia":  # what is committed is the default rendering
            assert sorted(p.name for p in (ROOT / "deploy/k8s").glob("*.yaml")) == sorted(files)
            for name, docs in files.items():
                assert (ROOT / "deploy/k8s" / name).read_text() == render.dump(docs)
        docs = [d for ds in files.values() for d in ds]
        for d in docs:
            kv.validate(d, kv.latest_version(), strict=True)
        kinds = {(d["kind"], d["metadata"]["name"]): d for d in docs}
        sts = kinds[("StatefulSet", "streamdiff")]["spec"]
        pod = sts["template"]["spec"]
        c = pod["containers"][0]
        assert kinds[("Service", "streamdiff")]["spec"]["clusterIP"] == "None" and sts["serviceName"] == "streamdiff"
        assert "$(POD_NAME)" in c["args"] and c["args"][c["args"].index("--node-id") + 1] == "$(POD_NAME)"
        resource = {"nvidia": "nvidia.com/gpu", "intel": "gpu.intel.com/xe"}[accelerator]
        assert c["resources"]["limits"][resource] == 4
        assert c["readinessProbe"]["httpGet"]["path"] == "/health" and c["livenessProbe"]["httpGet"]["path"] == "/livez"
        assert "/admin/drain" in c["lifecycle"]["preStop"]["exec"]["command"][-1]
        assert pod["terminationGracePeriodSeconds"] > render.DRAIN_TIMEOUT_S
        assert any(v["name"] == "shm" and v["emptyDir"]["medium"] == "Memory" for v in pod["volumes"])
        cm = kinds[("ConfigMap", "streamdiff-haproxy")]["data"]
        assert "streamdiff-2.streamdiff.default.svc.cluster.local:8000" in cm["haproxy.cfg"]
        haproxy_accepts(cm["haproxy.cfg"], cm["nodes.map"], "/usr/local/etc/haproxy/nodes.map", tmp_path)
    # The preStop script is real Python.
    compile(
        yaml.safe_load((ROOT / "deploy/k8s/streamdiff.yaml").read_text().split("---\n")[1])["spec"]["template"]["spec"][
            "containers"
        ][0]["lifecycle"]["preStop"]["exec"]["command"][-1],
        "preStop",
        "exec",
    )
