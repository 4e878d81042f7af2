"""What a profile holds, where it is cached, and when a cached one is still good."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...models.shipped import fingerprint
from ...models.spec import preset_card
from ...platform.devices import device_name

VERSION = 1
FRESH_S = 30 * 86400  # a cached profile older than this is measured again


@dataclass
class Profile:
    """Measured costs, in ms, per frame size "WxH"."""

    device: str  # cpu | cuda | xpu
    device_name: str
    devices: int
    preset: str
    model: dict  # what else identifies the model (dtype, tiny's dit_vae_ratio, the weights' path)
    sizes: dict = field(default_factory=dict)
    created: float = 0.0
    version: int = VERSION
    memory_bytes: int = 0  # one device's memory (accelerators; 0: not known), what a model must fit (cost.py)
    # the simulator's W1 error on this machine per layout name, relative, as
    # tools/bench/placement.py measured it against the pipeline (the planner allows its default
    # for the others, planner.py)
    plan_errors: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"not a version-{VERSION} streamdiff profile")
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        missing = {"device", "devices", "preset", "sizes"} - set(fields)
        if missing:
            raise ValueError(f"a profile without {', '.join(sorted(missing))}")
        errs = fields.get("plan_errors", {})
        if not isinstance(errs, dict):
            raise ValueError("plan_errors: not an object of layout names")
        for k, v in errs.items():
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise ValueError(f"plan_errors[{str(k)[:40]!r}]: {str(v)[:40]}, not a relative error from 0 to below 1")
        fields.setdefault("device_name", "")
        fields.setdefault("model", {})
        return cls(**fields)

    def size(self, width: int, height: int) -> dict:
        key = f"{width}x{height}"
        if key not in self.sizes:
            raise KeyError(f"the profile has no figures at {key} (it has {', '.join(self.sizes) or 'none'})")
        return self.sizes[key]


def model_key(cfg) -> dict:
    m = cfg.model
    key = {"dtype": m.dtype, "path": m.path, "dit_checkpoint": m.dit_checkpoint}
    if m.lora:
        key["lora"] = m.lora
    if preset_card(m.preset).embedded:  # its depth follows the ratio
        key["dit_vae_ratio"] = m.dit_vae_ratio
    shipped = fingerprint(m.preset)
    if shipped:  # the embedded default's trained weights (and sampler): a profile of others is stale
        key["shipped"] = shipped
    if m.decoder != "wan":  # the decoder measured (profiles of the Wan VAE keep their old key)
        key["decoder"], key["decoder_weights"] = m.decoder, m.decoder_weights
    return key


def cache_path(state_dir: str, cfg, size: tuple[int, int]) -> Path:
    t = cfg.topology
    dec = "" if cfg.model.decoder == "wan" else f"-{cfg.model.decoder}"
    name = f"profile-{t.device}-{cfg.model.preset}{dec}-{size[0]}x{size[1]}.json"
    return Path(state_dir) / name


def load_cached(path: Path, cfg, size: tuple[int, int], devices: int, now: float | None = None) -> Profile | None:
    """The cached profile if it is fresh and measured for this device, model and size, on at
    least `devices` devices."""
    try:
        prof = Profile.from_json(path.read_text())
    except (OSError, ValueError):
        return None
    now = time.time() if now is None else now
    ok = (
        prof.device == cfg.topology.device
        and prof.preset == cfg.model.preset
        and prof.model == model_key(cfg)
        and prof.device_name == device_name(cfg.topology.device)
        and prof.devices >= devices
        and f"{size[0]}x{size[1]}" in prof.sizes
        and now - prof.created < FRESH_S
    )
    return prof if ok else None


def offered_cuts(stages_ms: list[float]) -> tuple[int, ...]:
    """The VAE cuts worth planning from the decoder's stage times: up to half the VAE (past that
    the DiT's device does more of the decoding than the VAE's)."""
    return tuple(c for c in range(1, len(stages_ms)) if sum(stages_ms[:c]) <= 0.5 * sum(stages_ms))
