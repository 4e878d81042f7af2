#!/usr/bin/env python3
"""How many decisions outside streamdiff/models/ turn on a model variant, and through what:

- `internal`: a preset's name, `checkpoint_preset()` or a checkpoint preset (`cp`), a variant's
  own field (tests/test_style.py's VARIANT_FIELDS), `engine.i2v`, the torch-side
  `.preset.checkpoint` / `.preset.sampler`;
- `facts`: the old facts dict's variant keys (`facts.get("i2v")`, ...);
- `card`: a field of the model card (`card.image`, `card.text`, ...), the interface that stays;
- `plan`: a planned scene's or block's image flag (`scene.image_block`).

A decision is the test of an `if`, `elif`, conditional expression, `while`, `assert`,
comprehension filter or config `_check`, or a boolean or comparison standing alone. Run it on
any checkout, to count before and after a change:

  tools/dev/variants.py                 # this checkout
  tools/dev/variants.py ../old-checkout --by-file
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from streamdiff.models.spec import known_presets  # noqa: E402

INTERNAL = {
    "image_mode",
    "image_condition",
    "rolling_schedule",
    "rolling",
    "unipc",
    "shot_offset",
    "kv_recompute",
    "prope",
    "noise_layout",
    "canvas",
    "global_sink",
    "first_block_steps",
}
CARD = {
    "text",
    "i2v",
    "image",
    "image_block",
    "controls",
    "new_shot",
    "can_recache",
    "dit_group",
    "embedded",
    "sampler",
    "recache",
    "kv_caches",
    "action_blocks",
    "context_encoder",
    "checkpoint",
    "lora",
    "dims",
}
FACT_KEYS = {"i2v", "image_block", "text", "controls", "embedded_weights"}


def _name(node) -> str:
    return getattr(node, "id", getattr(node, "attr", ""))


def kinds(expr: ast.AST, presets: set[str]) -> set[str]:
    """What a decision's expression knows of a variant."""
    found = set()
    for n in ast.walk(expr):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in presets:
            found.add("internal")
        elif isinstance(n, ast.Name) and n.id == "cp":
            found.add("internal")
        elif isinstance(n, ast.Attribute):
            owner = _name(n.value)
            if n.attr in INTERNAL or (owner == "preset" and n.attr in ("checkpoint", "sampler")):
                found.add("internal")
            elif owner == "card" and n.attr in CARD:
                found.add("card")
            elif n.attr == "i2v":
                found.add("internal")
            elif n.attr == "image_block":
                found.add("plan")
        elif isinstance(n, ast.Call):
            if _name(n.func) == "checkpoint_preset":
                found.add("internal")
            elif _name(n.func) == "get" and _name(n.func.value) in ("facts", "f") and n.args:
                if isinstance(n.args[0], ast.Constant) and n.args[0].value in FACT_KEYS:
                    found.add("facts")
        elif isinstance(n, ast.Subscript) and _name(n.value) in ("facts", "f"):
            if isinstance(n.slice, ast.Constant) and n.slice.value in FACT_KEYS:
                found.add("facts")
    return found


def decisions(tree: ast.AST) -> list[ast.AST]:
    """Every decision's expression, each counted once (a boolean inside an `if` is the `if`'s)."""
    tests = []
    for n in ast.walk(tree):
        if isinstance(n, ast.If | ast.IfExp | ast.While | ast.Assert):
            tests.append(n.test)
        elif isinstance(n, ast.comprehension):
            tests += n.ifs
        elif isinstance(n, ast.Call) and _name(n.func) == "_check" and n.args:
            tests.append(n.args[0])
    inside = {id(x) for t in tests for x in ast.walk(t)}
    for n in ast.walk(tree):
        if isinstance(n, ast.BoolOp | ast.Compare) and id(n) not in inside:
            tests.append(n)
            inside.update(id(x) for x in ast.walk(n))
    return tests


def count(root: Path, presets: set[str]) -> tuple[Counter, Counter]:
    """(totals by kind, by (file, kind)) over root/streamdiff outside models/ and card.py."""
    package = root / "streamdiff"
    total, by_file = Counter(), Counter()
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.parts[0] == "models" or str(rel) == "card.py":
            continue
        for expr in decisions(ast.parse(path.read_text())):
            for kind in kinds(expr, presets):
                total[kind] += 1
                by_file[str(rel), kind] += 1
    return total, by_file


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[2]), help="a checkout")
    p.add_argument("--by-file", action="store_true", help="each file's counts too")
    a = p.parse_args()
    total, by_file = count(Path(a.root), set(known_presets()))
    print(" ".join(f"{k}={total[k]}" for k in ("internal", "facts", "card", "plan")))
    if a.by_file:
        for (f, kind), n in sorted(by_file.items()):
            print(f"  {kind:8} {n:3} {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
