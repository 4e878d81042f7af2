"""Nothing outlives the daemon: a daemon killed with SIGKILL while it profiles leaves no probe
and no fork server behind (the probes watch the daemon's pid: spawn.exit_with)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from streamdiff.spawn import alive

ROOT = Path(__file__).resolve().parents[1]


def probe_that_waits(path: str, out) -> None:
    """A profile probe that takes its time: says its pid and its parent's (the fork server)."""
    Path(path).write_text(f"{os.getpid()} {os.getppid()}")
    time.sleep(120)
    out.put(("ok", {}))


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [d for c in map(int, out) for d in (c, *descendants(c))]


def gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_a_daemon_killed_while_it_profiles_leaves_no_probe_and_no_fork_server(tmp_path):
    said = tmp_path / "probe"
    code = textwrap.dedent(f"""
        from streamdiff.placement.profile.harness import run_children
        from tests.test_orphans import probe_that_waits
        run_children([(probe_that_waits, ({str(said)!r},)), (probe_that_waits, ({str(said) + "2"!r},))], 600)
    """)
    daemon = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not (said.exists() and Path(str(said) + "2").exists()) and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(x) for p in (said, Path(str(said) + "2")) for x in p.read_text().split()]
        probes, server = pids[0::2], pids[1]
        assert all(alive(p) for p in probes) and alive(server)
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(10)
        assert gone_within(probes, 5), "a probe outlived the daemon"
        assert gone_within([server], 10), "the fork server outlived the daemon"
    finally:
        daemon.kill()


def test_a_sigterm_while_it_profiles_stops_the_daemon_within_its_drain_timeout(tmp_path):
    """systemd's stop at a first start: the profile's probes are killed and the daemon exits in
    well under server.drain_timeout_s, leaving no process and no profile behind."""
    (tmp_path / "c.toml").write_text(f'[server]\nstate_dir = "{tmp_path / "state"}"\ndrain_timeout_s = 10\n')
    from streamdiff.supervisor.topology import free_port

    cmd = [sys.executable, "-m", "streamdiff.cli", "--config", str(tmp_path / "c.toml"), "--port", str(free_port())]
    daemon = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in daemon.stderr:
            seen.append(line)
            if "profile: [1/" in line:
                break
        assert any("profile: [1/" in x for x in seen), "".join(seen)
        time.sleep(1.0)  # its probes are at work
        children = descendants(daemon.pid)  # the fork server and the probes it forked
        assert len(children) >= 2, children
        t0 = time.monotonic()
        daemon.send_signal(signal.SIGTERM)
        rest = daemon.communicate(timeout=30)[1]
        took = time.monotonic() - t0
        assert daemon.returncode == 0 and took < 10, (took, rest)
        assert "stopped while profiling" in rest
        assert gone_within(children, 10), "a process of the profile outlived the daemon"
        assert not list((tmp_path / "state").glob("profile-*.json"))
    finally:
        daemon.kill()
