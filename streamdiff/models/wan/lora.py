"""LoRA adapters in PEFT's layout (LongLive's `lora.pt`) merged into DiT weights at load, in the DiT worker."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from .loading import CheckpointError, StoredTensor, _summarise, read_state_dict, strip_key

# PEFT's adapter state dict holds, per target Linear, `base_model.model.<module>.lora_A.weight`
# (r, in) and `...lora_B.weight` (out, r): `get_peft_model_state_dict` drops the adapter name.
# LongLive saves it as {"generator_lora": ..., "critic_lora": ..., "step": ...}. PEFT stores
# neither alpha nor the rank-stabilised flag: alpha comes from the caller, and only plain LoRA
# (scale alpha / r) is merged.

_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<half>[AB])(?:\.(?P<adapter>[\w-]+))?\.weight$")
# Adapter tensors that a plain merge would get wrong: refused by name rather than ignored.
_REFUSED = {
    "lora_magnitude_vector": "DoRA magnitude vector (use_dora) not supported",
    "lora_embedding_": "embedding LoRA not supported",
    ".lora_B.bias": "LoRA bias (lora_bias) not supported",
}


def read_lora(path: str | Path) -> dict[str, torch.Tensor]:
    """A PEFT adapter state dict from .safetensors, or from .pt/.pth/.bin, plain or under `generator_lora`."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"LoRA file not found: {p}")
    if p.suffix == ".safetensors":
        return read_state_dict(p)
    try:
        obj = torch.load(str(p), map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # corrupted or truncated files surface here
        raise CheckpointError(f"cannot read LoRA file {p}: {exc}") from exc
    if isinstance(obj, Mapping) and "generator_lora" in obj:
        obj = obj["generator_lora"]
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{p}: expected a LoRA state dict, found {type(obj).__name__}")
    bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{p}: entries that are not tensors: {bad[:10]} (expected PEFT's adapter state dict)")
    return dict(obj)


def merge_lora(
    base_sd: Mapping[str, torch.Tensor], lora_sd: Mapping[str, torch.Tensor], alpha: float, rank: int | None = None
) -> dict[str, torch.Tensor]:
    """A new state dict with W + (alpha / r) * B @ A for every adapted module (in float32, cast
    back to W's dtype); `base_sd` is left as it was. `base_sd` has original Wan key names; rank r
    is read from the tensors and must equal `rank` when given. Every problem is named in one
    `CheckpointError`, raised before anything is merged."""
    if not math.isfinite(alpha):
        raise ValueError(f"LoRA alpha must be a finite number, got {alpha}")
    if not lora_sd:
        raise CheckpointError("LoRA adapter is empty: no lora_A / lora_B tensors")
    halves: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    adapters, refused, foreign = set(), [], []
    for key, t in lora_sd.items():
        why = next((msg for pat, msg in _REFUSED.items() if pat in key), None)
        m = _LORA_KEY.match(strip_key(key))
        if why:
            refused.append(f"{key} ({why})")
            continue
        if m is None:
            foreign.append(key)
            continue
        adapters.add(m["adapter"])
        halves.setdefault(m["module"], {})[m["half"]] = (key, t)

    unpaired, unmatched, shapes, ranks, merged = [], [], [], [], {}
    for module, ab in halves.items():
        if len(ab) < 2:
            have, lacks = ("A", "B") if "A" in ab else ("B", "A")
            unpaired.append(f"{ab[have][0]} has no lora_{lacks}")
            continue
        (ka, a), (_, b) = ab["A"], ab["B"]
        w = base_sd.get(f"{module}.weight")
        if w is None or w.ndim != 2:
            unmatched.append(f"{ka} ({module}: no Linear of that name in the base)")
            continue
        r = a.shape[0] if a.ndim == 2 else 0
        if not (r > 0 and b.ndim == 2 and b.shape[1] == r and (b.shape[0], a.shape[1]) == tuple(w.shape)):
            shapes.append(f"{module}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}, base weight {tuple(w.shape)}")
        elif rank is not None and r != rank:
            ranks.append(f"{ka}: rank {r} in the file, {rank} given")
        else:
            merged[f"{module}.weight"] = (a, b, r)

    problems = []
    for label, items in (
        ("refused", refused),
        ("not a LoRA A/B weight", foreign),
        ("unpaired", unpaired),
        ("matching no module of the base", unmatched),
        ("with shapes that do not fit (A must be (r, in), B (out, r), base (out, in))", shapes),
        ("with the wrong rank", ranks),
    ):
        if items:
            problems.append(f"{len(items)} {label}: {_summarise(sorted(items))}")
    if len(adapters) > 1:
        problems.append(f"several adapters in one file: {sorted(map(str, adapters))}")
    if problems:
        raise CheckpointError("LoRA adapter does not fit the DiT: " + "; ".join(problems))

    out = dict(base_sd)
    for name, (a, b, r) in merged.items():
        w = base_sd[name]
        w = w.load() if isinstance(w, StoredTensor) else w  # still in its file: read for the arithmetic
        out[name] = (w.float() + (alpha / r) * (b.float() @ a.float())).to(w.dtype)
    return out


def merge_lora_file(
    base_sd: Mapping[str, torch.Tensor], path: str | Path, alpha: float | None, rank: int | None = None
) -> dict[str, torch.Tensor]:
    """`merge_lora` of the adapter at `path` (the ModelSpec's `lora`, `lora_alpha`, `lora_rank`)."""
    if alpha is None:
        raise ValueError(f"LoRA {path} given without lora_alpha (PEFT's adapter files do not store it)")
    return merge_lora(base_sd, read_lora(path), alpha, rank)
