"""systemd integration: the unit file, and the notify protocol with a fake NOTIFY_SOCKET."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest

from ..helpers import ROOT, Daemon, check_video, http, wait_until
from .test_faults import start_stream


def test_unit_file_has_the_agreed_settings_and_verifies(tmp_path):
    text = (ROOT / "systemd" / "streamdiffd.service").read_text()
    for line in (
        "Type=notify",
        "WatchdogSec=",
        "KillMode=mixed",
        "Restart=on-failure",
        "EnvironmentFile=",
        "DeviceAllow=char-drm rw",
        "DeviceAllow=char-nvidia-frontend rw",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
    ):
        assert line in text, line
    assert "MemoryDenyWriteExecute=yes" not in text and "PrivateDevices=yes" not in text  # would break PyTorch/GPUs
    # A host without a render group (no Intel GPU driver) must still start the unit: no group named.
    assert not any(ln.startswith("SupplementaryGroups=") for ln in text.splitlines())
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed")
    unit = tmp_path / "streamdiffd.service"
    unit.write_text(text.replace("/opt/streamdiff/.venv/bin/streamdiffd", shutil.which("true")))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Unknown key" not in r.stderr and "Failed to parse" not in r.stderr, r.stderr


def test_readme_service_steps_need_no_render_group():
    """The install steps add the GPU groups only where they exist (`useradd --groups render`
    fails on a host without one), and the user creation runs as written on such a host: run here
    against a scratch copy of the account files that lacks the render group."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Running as a service")[1].split("```sh")[1].split("```")[0]
    assert "--groups" not in block and " -G " not in block
    add = next(ln for ln in block.splitlines() if "useradd" in ln)
    loop = next(ln for ln in block.splitlines() if ln.startswith("for g in"))
    assert 'getent group "$g"' in loop
    if shutil.which("useradd") is None or os.geteuid() != 0:
        pytest.skip("needs root and shadow's useradd")
    root = ROOT / ".pytest-accounts"
    shutil.rmtree(root, ignore_errors=True)
    (root / "etc").mkdir(parents=True)
    try:
        for f in ("passwd", "shadow", "group", "gshadow", "login.defs"):
            if os.path.exists(f"/etc/{f}"):
                lines = open(f"/etc/{f}").read().splitlines(keepends=True)
                (root / "etc" / f).write_text("".join(ln for ln in lines if not ln.startswith("render:")))
        # The README's commands, with shadow's --prefix and getent reading the scratch files.
        script = (
            add.replace("sudo useradd", f"useradd --prefix {root}")
            + "\n"
            + loop.replace('getent group "$g"', f'grep -q "^$g:" {root}/etc/group').replace(
                "sudo usermod", f"usermod --prefix {root}"
            )
            + "\ntrue\n"
        )
        r = subprocess.run(["bash", "-e", "-c", script], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        groups = (root / "etc" / "group").read_text()
        assert "streamdiff:" in (root / "etc" / "passwd").read_text()
        assert "render:" not in groups and any(
            ln.startswith("video:") and "streamdiff" in ln for ln in groups.splitlines()
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


class FakeSystemd:
    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop:
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            for field in data.split("\n"):
                self.messages.append((time.monotonic(), field))

    def times(self, field: str) -> list[float]:
        return [t for t, f in self.messages if f == field]

    def wait_for(self, field: str, timeout_s: float = 120) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            t = self.times(field)
            if t:
                return t[0]
            time.sleep(0.05)
        raise TimeoutError(f"{field} not received: {self.messages}")


@pytest.mark.timeout(300)
def test_ready_watchdog_and_stopping(tmp_path):
    fake = FakeSystemd(str(tmp_path / "notify"))
    # The killed worker's first two restarts exit at start: the back-off between them (0.5 s,
    # then 1 s) keeps the daemon without a pipeline for at least 1.5 s, which the 50 ms polls
    # below see however loaded the machine (load only lengthens it). Without them a restart that
    # reports the suite's given timings (tests/conftest.py) is READY within ~0.3 s, between two
    # polls.
    env = {
        "NOTIFY_SOCKET": str(tmp_path / "notify"),
        "WATCHDOG_USEC": "1000000",
        "STREAMDIFF_FAULTS": "vae0.0:start:exit#1,vae0.0:start:exit#2",
    }
    d = Daemon(env=env, wait=False)
    try:
        t_ready = fake.wait_for("READY=1")
        # Model loading asked for more start-up time before READY.
        extend = [t for t, f in fake.messages if f.startswith("EXTEND_TIMEOUT_USEC=")]
        assert extend and extend[0] < t_ready
        # READY means every worker is up and the port listens.
        assert http.get(d.url + "/health", timeout=5).status_code == 200
        time.sleep(2.5)
        pings = [t for t in fake.times("WATCHDOG=1") if t > t_ready]
        assert len(pings) >= 3  # every 0.5 s (half of WatchdogSec)
        # The only VAE worker dies: no pipeline serves (503), but the supervisor's loops run, so
        # the watchdog keeps being fed while it restarts the worker itself.
        os.kill(d.health()["workers"]["vae0.0"]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 5
        while http.get(d.url + "/health", timeout=5).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        unhealthy_from = time.monotonic()
        down = http.get(d.url + "/health", timeout=5)
        assert down.status_code == 503 and down.json()["pipelines_serving"] == 0
        d.wait_healthy(120)
        healthy_again = time.monotonic()
        during = [t for t in fake.times("WATCHDOG=1") if unhealthy_from < t < healthy_again]
        assert len(during) >= int((healthy_again - unhealthy_from) / 0.5) - 2
        d.proc.send_signal(signal.SIGTERM)
        fake.wait_for("STOPPING=1", 30)
        assert d.proc.wait(timeout=60) == 0
        assert d.segments() == []
    finally:
        fake.stop = True
        d.stop()


@pytest.mark.timeout(400)
def test_degraded_is_not_down(tmp_path):
    """Two pipelines (2 DiT workers, 2 one-shard VAE groups). One VAE worker dies and its first
    restart hangs before READY: it is killed at the READY deadline and started again. Meanwhile
    /health stays 200 (degraded), systemd's watchdog keeps being fed, and a stream on the other
    pipeline plays to its end."""
    cfg = tmp_path / "c.toml"
    # The deadline also bounds the first start: four workers on two cores that report the
    # suite's given timings (tests/conftest.py) and decode one block each for their caches are
    # READY in 3-4 s (twice that at twice the load). The hanging restart is killed at 15 s.
    cfg.write_text("[pipeline]\nready_timeout_s = 15.0\n")
    fake = FakeSystemd(str(tmp_path / "notify"))
    env = {
        "NOTIFY_SOCKET": str(tmp_path / "notify"),
        "WATCHDOG_USEC": "1000000",
        "STREAMDIFF_FAULTS": "vae0.0:start:hang#1",
    }
    d = Daemon("--config", str(cfg), "--dit-gpus", "2", "--vae-gpus", "2", "--vae-group-size", "1", env=env)
    try:
        fake.wait_for("READY=1")
        victim = d.health()["workers"]["vae0.0"]["pid"]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: not d.health()["workers"]["vae0.0"]["ready"])
        t_down = time.monotonic()
        out, statuses = {}, []
        t = start_stream(d.url, {"prompt": "on the other pipeline", "num_frames": 157, "size": "128x64"}, out)
        while t.is_alive():
            r = http.get(d.url + "/health", timeout=5)
            statuses.append((r.status_code, r.json()["degraded"], r.json()["pipelines_serving"]))
            time.sleep(0.2)
        t.join()
        assert out.get("complete"), out.get("error")
        check_video(out["data"], 157, 128, 64, 16)
        assert {s for s, _, _ in statuses} == {200}
        assert (200, True, 1) in statuses
        # The hung restart is killed at its READY deadline and the next one comes up.
        back = d.wait_healthy_all(120)
        assert back["workers"]["vae0.0"]["restarts"] == 2 and back["workers"]["vae0.0"]["pid"] != victim
        t_up = time.monotonic()
        fed = [x for x in fake.times("WATCHDOG=1") if t_down < x < t_up]
        assert len(fed) >= int((t_up - t_down) / 0.5) - 2
        assert "not ready" in d.logs()
    finally:
        fake.stop = True
        d.stop()
