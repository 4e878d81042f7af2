"""systemd integration: the unit file, and the notify protocol with a fake NOTIFY_SOCKET."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest

from ..helpers import ROOT, Daemon


def test_unit_file_has_the_agreed_settings_and_verifies(tmp_path):
    text = (ROOT / "systemd" / "streamdiffd.service").read_text()
    for line in (
        "Type=notify",
        "WatchdogSec=",
        "KillMode=mixed",
        "Restart=on-failure",
        "EnvironmentFile=",
        "SupplementaryGroups=render video",
        "DeviceAllow=char-drm rw",
        "DeviceAllow=char-nvidia-frontend rw",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
    ):
        assert line in text, line
    assert "MemoryDenyWriteExecute=yes" not in text and "PrivateDevices=yes" not in text  # would break PyTorch/GPUs
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed")
    unit = tmp_path / "streamdiffd.service"
    unit.write_text(text.replace("/opt/streamdiff/.venv/bin/streamdiffd", shutil.which("true")))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Unknown key" not in r.stderr and "Failed to parse" not in r.stderr, r.stderr


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
    d = Daemon(env={"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "1000000"}, wait=False)
    try:
        t_ready = fake.wait_for("READY=1")
        # READY means every worker is up and the port listens.
        assert httpx.get(d.url + "/health", timeout=5).status_code == 200
        time.sleep(2.5)
        pings = [t for t in fake.times("WATCHDOG=1") if t > t_ready]
        assert len(pings) >= 3  # every 0.5 s (half of WatchdogSec) while healthy
        # A dead worker: no WATCHDOG=1 while /health says 503; pings resume once it is back.
        os.kill(d.health()["workers"]["vae0.0"]["pid"], signal.SIGKILL)
        t_kill = time.monotonic()
        deadline = time.monotonic() + 5
        while httpx.get(d.url + "/health", timeout=5).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        unhealthy_from = time.monotonic()
        d.wait_healthy(120)
        healthy_again = time.monotonic()
        during = [t for t in fake.times("WATCHDOG=1") if unhealthy_from + 0.6 < t < healthy_again - 0.6]
        assert during == [], (during, t_kill, unhealthy_from, healthy_again)
        time.sleep(1.5)
        assert [t for t in fake.times("WATCHDOG=1") if t > healthy_again]
        d.proc.send_signal(signal.SIGTERM)
        fake.wait_for("STOPPING=1", 30)
        assert d.proc.wait(timeout=60) == 0
        assert d.segments() == []
    finally:
        fake.stop = True
        d.stop()
