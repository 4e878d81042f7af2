"""Training the embedded default on the synthetic grammar (tools/train/default.py; issues 13, 36)."""

from __future__ import annotations

from pathlib import Path

import torch


def resume(
    path: Path, modules: dict[str, torch.nn.Module], opt: torch.optim.Optimizer, log, meta: dict | None = None
) -> int:
    """Load a run's checkpoint into `modules` (by name) and `opt`; the step it reached, 0 if none.
    `meta`, when given, receives what the run saved beside the weights (its schedule's phase)."""
    if not path.exists():
        return 0
    state = torch.load(path, weights_only=True)
    for name, m in modules.items():
        m.load_state_dict(state[name])
    opt.load_state_dict(state["opt"])
    if meta is not None:
        meta.update(state.get("meta", {}))
    log(f"{path.stem}: resumed at step {state['step']}")
    return state["step"]


def save(
    path: Path, modules: dict[str, torch.nn.Module], opt: torch.optim.Optimizer, step: int, meta: dict | None = None
) -> None:
    """Write the checkpoint whole or not at all (a run killed mid-write resumes from the last)."""
    tmp = path.with_suffix(".tmp")
    state = {**{n: m.state_dict() for n, m in modules.items()}, "opt": opt.state_dict(), "step": step}
    torch.save({**state, "meta": meta or {}}, tmp)
    tmp.replace(path)
