"""A daemon's workers time their blocks at start (the production path), keep the figures in a
calibration directory for the next start, and report given timings where told to (the rest of
the suite's daemons: tests/conftest.py)."""

from __future__ import annotations

import re
from pathlib import Path

from .conftest import GIVEN_CALIBRATION
from .helpers import Daemon


def ready_figures(logs: str) -> dict[str, str]:
    """Each worker's READY line: what it reported at start."""
    return dict(re.findall(r"worker (\w+(?:\.\d+)?) ready \(pid \d+\): (.*)", logs))


def test_timed_at_start_stored_and_read_back_by_the_next_start(tmp_path):
    store = tmp_path / "calibration"
    flags = ("--calibration-given", "", "--calibration-dir", str(store))  # not the suite's given timings
    d = Daemon(*flags)
    try:
        first = ready_figures(d.logs())
        assert set(first) == {"dit0", "vae0.0"} and "calibration read" not in d.logs()
    finally:
        d.stop()
    assert sorted(p.name.split("-")[0] for p in store.iterdir()) == ["dit", "vae"]
    given = f"dit {GIVEN_CALIBRATION['dit']['block_ms']:.0f} ms per block"
    assert not first["dit0"].startswith(given)  # timed here, not the given figure
    d = Daemon(*flags)
    try:
        logs = d.logs()
        assert "dit calibration read from" in logs and "vae calibration read from" in logs
        assert ready_figures(logs) == first  # the same figures, untimed
    finally:
        d.stop()


def test_the_suites_daemons_report_the_given_timings(plain_daemon):
    dit, vae = GIVEN_CALIBRATION["dit"], GIVEN_CALIBRATION["vae"]
    logs = Path(plain_daemon.log.name).read_text(errors="replace")  # whole: it has served many tests since
    assert ready_figures(logs) == {
        "dit0": f"dit {dit['block_ms']:.0f} ms per block, {dit['batch_ms']['2']:.0f} each in a pair",
        "vae0.0": f"vae {vae['block_ms']:.0f} ms per block, {vae['batch_ms']['2']:.0f} each in a pair",
    }
