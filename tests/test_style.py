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
    """server/ submits requests and follows sessions through supervisor/handle.py and the
    Supervisor's entry points; it never imports or reaches into the scheduler."""
    import ast

    for path in (ROOT / "streamdiff" / "server").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.endswith(("scheduler", "workers", "capacity")), (path.name, node.module)
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("scheduler", "pool"), (path.name, node.lineno)


# The house's layers, low to high: a module imports only from its own package or a lower layer
# (function-level imports included). card, the model's description, is below them all. placement
# sits above the supervisor: it drives the supervisor's own scheduler in simulation and plans the
# topologies the supervisor runs; the CLI calls `place()` before it builds the Supervisor. train
# (the embedded default's training) and the CLI are the top.
LAYERS = [
    {"card"},
    {"spawn", "plan", "controls", "ipc", "metrics", "sdnotify", "synthetic", "cluster", "media"},
    {"platform"},
    {"models"},
    {"config"},
    {"flags"},
    {"parallel"},
    {"workers"},
    {"supervisor"},
    {"placement"},
    {"server"},
    {"train", "cli", "testing"},
]


def _imports() -> dict[str, set[str]]:
    """streamdiff's modules -> the streamdiff modules (and names) each imports, anywhere in it."""
    import ast

    src = ROOT / "streamdiff"
    out: dict[str, set[str]] = {}
    modules = {".".join(p.relative_to(src.parent).with_suffix("").parts) for p in src.rglob("*.py")}
    for path in src.rglob("*.py"):
        parts = list(path.relative_to(src.parent).with_suffix("").parts)
        package = parts[:-1]
        name = ".".join(parts[:-1] if path.name == "__init__.py" else parts)
        seen: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                if target.startswith("streamdiff"):
                    names = {f"{target}.{a.name}" for a in node.names}
                    seen.update(names)
                    # `from . import events`: the submodule, not what the package's __init__ holds
                    if node.module or not names <= modules:
                        seen.add(target)
            elif isinstance(node, ast.Import):
                seen.update(a.name for a in node.names if a.name.startswith("streamdiff"))
        out[name] = seen
    return out


def test_no_import_runs_up_the_layers():
    rank = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
    top = [p.stem for p in (ROOT / "streamdiff").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()]
    assert {t for t in top if t != "__init__"} <= set(rank), "a new package: give it a layer"
    up = []
    for mod, targets in _imports().items():
        mine = mod.split(".")[1] if "." in mod else None
        for t in targets:
            theirs = t.split(".")[1] if t.count(".") else None
            if mine and theirs in rank and theirs != mine and rank[theirs] >= rank[mine]:
                up.append(f"{mod} -> {t}")
    assert not up, "imports that run up (or across) the layers:\n" + "\n".join(sorted(up))


def test_every_import_of_streamdiff_names_a_module_that_exists():
    """A relative import one level off (`from .platform` inside cli/) is caught here, not when
    a subcommand first runs it."""
    graph = _imports()
    missing = []
    for mod, targets in graph.items():
        for t in targets:
            parent = t.rsplit(".", 1)[0]
            if t not in graph and parent not in graph:  # neither a module nor a name in one
                missing.append(f"{mod} -> {t}")
    assert not missing, missing


def test_no_import_circles():
    """No module reaches itself through its imports (Tarjan's strongly connected components)."""
    graph = _imports()
    graph = {m: {t for t in ts if t in graph and t != m} for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, circles


def _device_kind_branches(tree) -> list[tuple[int, str]]:
    """Where code branches on an accelerator's kind: a comparison with "cuda" or "xpu" (alone
    or in a tuple, list or set), a `.startswith("cuda")`-like test, `torch.cuda` / `torch.xpu`,
    `getattr(torch, ...)` (a runtime picked by name) or `.is_available()`."""
    import ast

    kinds = {"cuda", "xpu"}

    def names_kind(node) -> bool:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value.split(":")[0] in kinds
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return any(names_kind(e) for e in node.elts)
        return False

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(names_kind(x) for x in (node.left, *node.comparators)):
            found.append((node.lineno, "compares with an accelerator kind"))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
            if node.attr in kinds:
                found.append((node.lineno, f"torch.{node.attr}"))
        elif isinstance(node, ast.Call):
            f = node.func
            if (
                isinstance(f, ast.Name)
                and f.id == "getattr"
                and node.args
                and getattr(node.args[0], "id", "") == "torch"
            ):
                found.append((node.lineno, "getattr(torch, ...)"))
            elif isinstance(f, ast.Attribute) and f.attr == "is_available":
                found.append((node.lineno, ".is_available()"))
            elif isinstance(f, ast.Attribute) and f.attr in ("startswith", "endswith"):
                if any(names_kind(a) for a in node.args):
                    found.append((node.lineno, f".{f.attr}(an accelerator kind)"))
    return found


def test_only_the_platform_branches_on_the_device_kind():
    """The rule: outside streamdiff/platform/ no code asks which accelerator it runs on (see
    `_device_kind_branches`). models/ is exempt: it keeps its dtype and device plumbing
    (`x.device.type != "cpu"` picks the CPU kernels; the model tests compare devices), and
    tests/ and tools/ are not the daemon. What stays allowed elsewhere, honestly: tests against
    "cpu" (CPU-only policy, e.g. the planner's thread counts or pinning, which is a choice of
    layout, not of runtime), and the kinds named as plain data (argparse choices, error-text
    keywords)."""
    import ast

    root = ROOT / "streamdiff"
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("platform", "models"):
            continue
        bad += [(str(rel), line, what) for line, what in _device_kind_branches(ast.parse(path.read_text()))]
    assert not bad, bad


def test_the_rule_sees_a_device_branch():
    import ast

    code = (
        'if d.type == "cuda":\n    torch.cuda.synchronize()\n'
        'elif d in ("xpu", "cpu"): pass\ngetattr(torch, k).is_available()'
    )
    assert sorted(_device_kind_branches(ast.parse(code))) == [
        (1, "compares with an accelerator kind"),
        (2, "torch.cuda"),
        (3, "compares with an accelerator kind"),
        (4, ".is_available()"),
        (4, "getattr(torch, ...)"),
    ]


# A model variant's knowledge lives in models/ (its family, its presets, its engine). Outside it
# the code reads the model's card (streamdiff/card.py: what it takes, what a cut keeps, its
# geometry and cache), never a preset's name or one of these fields of its internals.
VARIANT_FIELDS = {
    "image_mode",  # the card's `image`
    "image_condition",
    "rolling_schedule",  # the card's `sampler`
    "rolling",
    "unipc",
    "shot_offset",  # the card's `new_shot`
    "kv_recompute",
    "prope",  # the card's `controls` and `kv_caches`
    "noise_layout",
    "canvas",
    "global_sink",
    "first_block_steps",
}
# Every place outside models/ that still knows a variant, and why.
VARIANT_EXCEPTIONS = {
    ("config/__init__.py", ".first_block_steps"): "the operator's [sampler] override, passed to SamplerConfig unread",
    ("train/dit.py", ".canvas"): "train/ trains the embedded default, whose sampler it sets (the family's own loop)",
    ("train/evaluate.py", ".canvas"): "the same: the embedded default's evaluation runs its trained sampler",
}


def _variant_knowledge(tree, presets: set[str]) -> list[tuple[int, str]]:
    """Where code knows a model variant: a preset's name, `checkpoint_preset(...)`, a field of
    VARIANT_FIELDS, or the torch-side preset's `.preset.checkpoint` / `.preset.sampler`."""
    import ast

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in presets:
            found.append((node.lineno, f"preset name {node.value!r}"))
        elif isinstance(node, ast.Attribute):
            if node.attr in VARIANT_FIELDS:
                found.append((node.lineno, f".{node.attr}"))
            elif node.attr in ("checkpoint", "sampler") and getattr(node.value, "attr", "") == "preset":
                found.append((node.lineno, f".preset.{node.attr}"))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", "")) == "checkpoint_preset"
        ):
            found.append((node.lineno, "checkpoint_preset()"))
    return found


def _variant_files(root):
    """streamdiff's modules outside models/ (and the card, which is the model's description)."""
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] != "models" and str(rel) != "card.py":
            yield str(rel), path


def test_only_models_knows_a_variant():
    """Outside models/: no preset's name and no variant field (see `_variant_knowledge`), but
    for VARIANT_EXCEPTIONS, each with its reason; an exception no longer needed is dropped."""
    import ast

    from streamdiff.models.spec import known_presets

    root = ROOT / "streamdiff"
    seen = {}
    for rel, path in _variant_files(root):
        for line, what in _variant_knowledge(ast.parse(path.read_text()), set(known_presets())):
            seen.setdefault((rel, what), line)
    new = {f"{rel}:{line} {what}" for (rel, what), line in seen.items() if (rel, what) not in VARIANT_EXCEPTIONS}
    assert not new, "a variant known outside models/ (read the card instead):\n" + "\n".join(sorted(new))
    assert set(VARIANT_EXCEPTIONS) <= set(seen), f"stale exceptions: {set(VARIANT_EXCEPTIONS) - set(seen)}"


def test_the_rule_sees_variant_knowledge():
    import ast

    code = (
        'if engine.image_mode != "block" or cfg.model.preset == "longlive2-5b":\n    pass\n'
        "cp = checkpoint_preset(name)\nx = self.engine.preset.sampler.shot_offset"
    )
    assert sorted(_variant_knowledge(ast.parse(code), {"longlive2-5b"})) == [
        (1, ".image_mode"),
        (1, "preset name 'longlive2-5b'"),
        (3, "checkpoint_preset()"),
        (4, ".preset.sampler"),
        (4, ".shot_offset"),
    ]


def test_no_class_name_twice():
    """A class name means one thing in the package (`Block` was a plan's block and a DiT layer)."""
    import ast
    from collections import defaultdict

    where = defaultdict(list)
    for path in sorted((ROOT / "streamdiff").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(str(path.relative_to(ROOT)))
    assert not {k: v for k, v in where.items() if len(v) > 1}


def test_the_supervisor_process_imports_no_torch():
    """What `streamdiffd` runs before (and beside) its workers imports no torch: the CLI, the
    server, the supervisor, placement (`place()`: layout, memory check, device facts; on an
    accelerator those come from a child) and a VAE cut's ring sizing (the decoder's shape comes
    from a child). Torch is imported only in spawned children (workers, the profile's probes)."""
    code = """
import sys
import streamdiff.cli, streamdiff.server.app, streamdiff.supervisor.core, streamdiff.placement.auto
import streamdiff.cli.placement, streamdiff.cli.daemon, streamdiff.placement.planner, streamdiff.placement.sim
from streamdiff.config import Config
from streamdiff.config.loader import override
from streamdiff.placement.auto import place
from streamdiff.supervisor.core import Supervisor
assert "torch" not in sys.modules, "torch at import"
layout = {"mode": "disaggregated", "dit_devices": 1, "vae_devices": 1, "vae_cut": 2}
cfg, _ = place(override(Config(), topology=layout), log=lambda *a: None)
assert "torch" not in sys.modules, "torch in place()"
Supervisor(cfg)._ring_sizes()
assert "torch" not in sys.modules, "torch in a VAE cut's ring sizing"
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
