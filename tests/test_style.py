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


def test_the_api_reaches_the_engine_only_through_its_boundary():
    """server/ submits requests and follows sessions through supervisor/engine.py and the
    Supervisor's entry points; it never imports or reaches into the scheduler."""
    import ast

    for path in (ROOT / "streamdiff" / "server").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.endswith(("scheduler", "workers", "capacity")), (path.name, node.module)
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("scheduler", "pool"), (path.name, node.lineno)
