"""The tools under tools/ import the daemon's modules lazily, inside their main(), so a name the
package moved fails only when someone runs the benchmark (tools/bench/placement.py imported
`load` from streamdiff.config for a week after it moved to config.loader). Every name a tool
imports from streamdiff must be where the tool looks for it."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = sorted(p for p in (ROOT / "tools").rglob("*.py") if "__pycache__" not in p.parts)


def streamdiff_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every `from streamdiff... import name` in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("streamdiff"):
            out += [(node.lineno, node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, "") for a in node.names if a.name.startswith("streamdiff")]
    return out


def test_the_tools_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in TOOLS}
    assert {"tools/bench/placement.py", "tools/bench/layouts.py", "tools/dev/published_profile.py"} <= names


@pytest.mark.parametrize("path", TOOLS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_name_a_tool_imports_from_the_package_is_there(path):
    wrong = []
    for line, module, name in streamdiff_imports(path):
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            wrong.append(f"line {line}: {module}: {exc}")
            continue
        if name and not hasattr(mod, name):
            try:  # a submodule: `from streamdiff.x import y`
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                wrong.append(f"line {line}: {module} has no {name}")
    assert not wrong, "\n".join(wrong)
