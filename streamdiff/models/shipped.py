"""The embedded default's shipped trained weights: where they lie in the package and which they
are. Torch-free, so the supervisor's planner can tell one set of weights from another (a
machine's cached profile measured other weights, another sampler) without importing torch."""

from __future__ import annotations

import hashlib
from pathlib import Path

# Trained weights of the embedded default, one file per stage (tools/train/default.py export).
WEIGHTS_DIR = Path(__file__).parent / "weights"
STAGES = ("dit", "vae")


def embedded_weights(preset: str, stage: str, root: Path = WEIGHTS_DIR) -> Path | None:
    """The shipped trained weights of `stage` ("vae", "dit") of an embedded preset, None where there are
    none: the seeded weights then. Only `tiny` loads them; `tiny-random` is the seeded one always."""
    f = root / f"{preset}-{stage}.safetensors"
    return f if preset == "tiny" and f.is_file() else None


def fingerprint(preset: str, root: Path = WEIGHTS_DIR) -> str | None:
    """The first 16 hex digits of the SHA-256 of the preset's shipped files, None where it runs
    seeded weights."""
    files = [f for f in (embedded_weights(preset, s, root) for s in STAGES) if f is not None]
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]
