"""The tree passes ruff's lint and format checks (STYLE.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .helpers import ROOT


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff(args):
    pytest.importorskip("ruff")
    r = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
