"""From TOML and overrides to a validated Config: the only way to one (`load`, `override`).
Each key's value is coerced to its declared type, and unknown sections and keys are refused by
name; `checks.validate` then refuses bad values and broken layout rules."""

from __future__ import annotations

import dataclasses
import tomllib
import types
from pathlib import Path
from typing import Any, get_type_hints

from . import Config, ConfigError
from .checks import validate


def to_dict(cfg: Config) -> dict:
    return {f.name: dataclasses.asdict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def merge(base: dict, over: dict) -> dict:
    out = {k: dict(v) for k, v in base.items()}
    for section, values in over.items():
        if section not in out:
            raise ConfigError(f"unknown section [{section}]")
        out[section].update(values)
    return out


def _coerce(key: str, tp, value):
    origin = getattr(tp, "__origin__", None)
    if isinstance(tp, types.UnionType) and type(None) in tp.__args__:  # `bool | None`: unset keeps a default
        (inner,) = (a for a in tp.__args__ if a is not type(None))
        return None if value is None else _coerce(key, inner, value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if origin is dict:  # a table of strings ([outputs] destinations)
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise ConfigError(f'{key}: expected a table of strings (name = "url"), got {value!r}')
        return dict(value)
    if origin is tuple and tp.__args__[0] is str:
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
        return tuple(value)
    if origin is tuple:
        kinds, what = (int | float, "numbers") if tp.__args__[0] is float else (int, "integers")
        if not isinstance(value, list | tuple) or not all(
            isinstance(v, kinds) and not isinstance(v, bool) for v in value
        ):
            raise ConfigError(f"{key}: expected a list of {what}, got {value!r}")
        return tuple(float(v) for v in value) if kinds is not int else tuple(value)
    return value


def build(data: dict) -> Config:
    sections = {}
    for f in dataclasses.fields(Config):
        cls = f.default_factory
        hints = get_type_hints(cls)
        values = dict(data.get(f.name, {}))
        if not isinstance(values, dict):
            raise ConfigError(f"[{f.name}] must be a table")
        unknown = set(values) - set(hints)
        if unknown:
            raise ConfigError(f"unknown key(s) in [{f.name}]: {', '.join(sorted(unknown))}")
        sections[f.name] = cls(**{k: _coerce(f"{f.name}.{k}", hints[k], v) for k, v in values.items()})
    unknown = set(data) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        raise ConfigError(f"unknown section(s): {', '.join(sorted(unknown))}")
    cfg = Config(**sections)
    if cfg.model.decoder == "taehv" and cfg.topology.vae_group_size == 0:
        # TAEHV is never height-sharded: --vae-gpus k means k decoder replicas, groups of one
        cfg = dataclasses.replace(cfg, topology=dataclasses.replace(cfg.topology, vae_group_size=1))
    validate(cfg)
    return cfg


def load(path: str | Path | None, overrides: dict[str, dict] | None = None) -> Config:
    data: dict = {}
    if path:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: invalid TOML: {exc}") from None
    base = to_dict(Config())
    merged = merge(base, data) if data else base
    if overrides:
        merged = merge(merged, overrides)
    return build(merged)


def override(cfg: Config, **sections: dict[str, Any]) -> Config:
    """A copy with some keys of some sections changed, validated: override(cfg, server={"port": 1})."""
    return build(merge(to_dict(cfg), sections))
