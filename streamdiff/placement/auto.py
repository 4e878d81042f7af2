"""Where the daemon's workers go: the layout given, or, when none is (`streamdiffd` with no
layout flags), the planner's best for the objective on every device visible, from a profile
cached in the state directory or measured now (once per device kind, model and size)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..config import Config, ConfigError
from ..config.layout import explicit_layout, planned
from ..models.spec import preset_card
from ..platform.devices import device_count, device_memory
from ..supervisor.topology import model_card
from .cost import DoesNotFit, ModelCost, model_cost
from .costs import cut_exchange
from .layout import Layout
from .planner import plan
from .profile.measure import measure
from .profile.schema import Profile, cache_path, load_cached, model_key


@dataclass
class Placement:
    layout: str
    flags: list[str]
    planned: bool
    objective: str | None = None
    predicted: dict | None = None  # the simulator's figures for the chosen layout
    profile: str | None = None  # the profile it planned from
    runners_up: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def state_dir(cfg: Config) -> Path:
    if cfg.server.state_dir:
        return Path(cfg.server.state_dir).expanduser()
    if os.environ.get("STATE_DIRECTORY"):  # systemd's StateDirectory=
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "streamdiff"


def profile_for(cfg: Config, size: tuple[int, int], devices: int, log, rounds: int = 1) -> tuple[Profile, Path]:
    """The profile given (`topology.profile`), else the cached one for this device kind, model
    and size, else a new one (then cached)."""
    if cfg.topology.profile:
        path = Path(cfg.topology.profile).expanduser()
        return given_profile(path, cfg, size, devices), path
    path = cache_path(str(state_dir(cfg)), cfg, size)
    prof = load_cached(path, cfg, size, devices)
    if prof is not None:
        return prof, path
    log(f"no fresh profile at {path}: measuring the stages on this machine (once)")
    prof = measure(cfg, [size], rounds=rounds, log=log)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(prof.to_json())
        tmp.replace(path)
    except OSError as exc:
        log(f"cannot cache the profile at {path}: {exc}")
    return prof, path


def given_profile(path: Path, cfg: Config, size: tuple[int, int], devices: int) -> Profile:
    """A profile measured elsewhere, refused by name unless it is of this model on this device
    kind, at this size, over at least these devices (its age and device name are its owner's
    business: it was chosen)."""
    try:
        prof = Profile.from_json(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"topology.profile (--profile): cannot read {path}: {exc}") from None
    want = {"device kind": cfg.topology.device, "model": cfg.model.preset, "model files": model_key(cfg)}
    have = {"device kind": prof.device, "model": prof.preset, "model files": prof.model}
    wrong = [f"{k} {have[k]!r}, not {want[k]!r}" for k in want if have[k] != want[k]]
    if f"{size[0]}x{size[1]}" not in prof.sizes:
        wrong.append(f"no figures at {size[0]}x{size[1]} (it has {', '.join(prof.sizes)})")
    if prof.devices < devices:
        wrong.append(f"measured on {prof.devices} devices, {devices} to plan over")
    if wrong:
        raise ConfigError(f"topology.profile (--profile): {path} does not fit: " + "; ".join(wrong))
    return prof


def dtype_bytes(cfg: Config, device: str | None = None) -> int:
    """Bytes per weight as the workers will load them on `device` (default the configured one;
    presets.resolve_dtype)."""
    d = cfg.model.dtype
    if d == "auto":
        return 4 if (device or cfg.topology.device) == "cpu" else 2
    return 4 if d in ("float32", "fp32") else 2


def check_memory(cfg: Config, size: tuple[int, int], memory_bytes: int) -> ModelCost | None:
    """Refuse, before any worker loads weights, a model whose DiT worker (weights, text encoder,
    one block's activations and one session's caches) cannot fit one device; None where the
    model has no priced configuration (tiny) or the device's memory is not known (the CPU)."""
    if memory_bytes <= 0 or preset_card(cfg.model.preset).dims is None:
        return None
    cost = model_cost(cfg.model.preset, size, dtype_bytes(cfg))
    try:
        cost.check(memory_bytes)
    except DoesNotFit as exc:
        raise ConfigError(str(exc)) from None
    return cost


def place(cfg: Config, log=print) -> tuple[Config, Placement]:
    """cfg with its layout resolved, and what was placed and why."""
    t = cfg.topology
    check_memory(cfg, model_card(cfg).default_size, device_memory(t.device))
    if not planned(t):
        resolved = dataclasses.replace(cfg, topology=explicit_layout(t))
        lay = Layout.of(resolved.topology)
        need = lay.devices // lay.threads  # devices, not cores
        if t.device != "cpu" and need > (have := device_count(t.device)):
            # on the CPU the workers share the cores; an accelerator index past the last one
            # would only fail later, inside a worker, as an invalid device ordinal
            raise ConfigError(
                f"{' '.join(lay.flags())} needs {need} {t.device} devices, {have} visible "
                "(one device runs both stages with --mode aggregated)"
            )
        return resolved, Placement(lay.name, lay.flags(), planned=False)
    card = model_card(cfg)
    size = card.default_size
    n = t.devices or device_count(t.device)
    prof, path = profile_for(cfg, size, n, log)
    p = plan(cfg, prof, n, t.objective, card, size)
    best, pred = p.best
    chosen = best.configure(
        t,
        vae_cut_adapt=best.vae_cut > 0,  # from there the cut follows the blocks' measured times,
        vae_cut_exchange=cut_exchange(prof, best, size, t.vae_cut_exchange),  # priced as the planner did
    )
    runners_up = p.as_dict(top=4)["ranked"][1:]
    placement = Placement(best.name, best.flags(), True, t.objective, pred.as_dict(), str(path), runners_up)
    return dataclasses.replace(cfg, topology=chosen), placement
