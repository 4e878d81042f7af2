#!/usr/bin/env python3
"""How long streamdiffd takes to start: from the command to /health answering 200 (every worker
built, calibrated and READY), for several flag sets started in turn, round by round (interleaved,
so a machine's drift falls on all alike). Prints each start and the median per flag set.

  tools/bench/start.py --runs "trained=--model tiny" --runs "seeded=--model tiny-random" --rounds 5
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_once(flags: list[str], timeout_s: float) -> float:
    port = free_port()
    cmd = [sys.executable, "-m", "streamdiff.cli", "--port", str(port), "--instance", f"bench{port}", *flags]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        while time.monotonic() - t0 < timeout_s:
            if proc.poll() is not None:
                raise SystemExit(f"streamdiffd {' '.join(flags)} exited with {proc.returncode}: {proc.stderr.read()!r}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(0.05)
        raise SystemExit(f"streamdiffd {' '.join(flags)} not healthy after {timeout_s} s")
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", action="append", required=True, help="NAME=FLAGS (the daemon's flags)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=120.0)
    a = ap.parse_args()
    runs = {}
    for r in a.runs:
        name, sep, flags = r.partition("=")
        if not sep or not name:
            ap.error(f"--runs wants NAME=FLAGS, got {r!r}")
        runs[name] = shlex.split(flags)
    times: dict[str, list[float]] = {n: [] for n in runs}
    for i in range(a.rounds):
        for name, flags in runs.items():
            times[name].append(start_once(flags, a.timeout_s))
            print(json.dumps({"round": i, "run": name, "ready_s": round(times[name][-1], 3)}), flush=True)
    for name, ts in times.items():
        row = {"run": name, "median_ready_s": round(statistics.median(ts), 3), "all": [round(t, 3) for t in ts]}
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
