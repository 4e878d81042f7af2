"""The embedded default's shipped trained weights: where they lie in the package and which they
are. Torch-free, so the supervisor's planner can tell one set of weights from another (a
machine's cached profile measured other weights, another sampler) without importing torch."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

# Trained weights of the embedded default, one file per stage (tools/train/default.py export).
WEIGHTS_DIR = Path(__file__).parent / "weights"
STAGES = ("dit", "vae")


def embedded_weights(preset: str, stage: str, root: Path = WEIGHTS_DIR) -> Path | None:
    """The shipped trained weights of `stage` ("vae", "dit") of an embedded preset, None where there are
    none: the seeded weights then. Only `tiny` loads them; `tiny-random` is the seeded one always."""
    f = root / f"{preset}-{stage}.safetensors"
    return f if preset == "tiny" and f.is_file() else None


def trained_header(preset: str, root: Path = WEIGHTS_DIR) -> tuple[Path, dict] | None:
    """The shipped trained DiT's file and what its header says it was trained with: `dit` (its
    DiTConfig's fields), `sampler` (the SamplerConfig fields it changed), `text` (the text
    encoder's layers). None where the preset runs seeded weights; ValueError for a file that is not one."""
    f = embedded_weights(preset, "dit", root)
    return None if f is None else (f, _read_header(f, f.stat().st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _read_header(path: Path, mtime_ns: int) -> dict:
    """The file's header only (the tensors load in the workers), read once per file version and
    without torch (safetensors' numpy reader: the header is the same)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
        return {
            "dit": json.loads(meta["dit"]),
            "sampler": json.loads(meta.get("sampler", "{}")),
            "text": json.loads(meta.get("text", "{}")),
        }
    except Exception as exc:
        raise ValueError(f"{path}: not the embedded default's trained DiT ({exc!r})") from exc


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
