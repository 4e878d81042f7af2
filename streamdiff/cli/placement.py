"""`streamdiffd profile` and `streamdiffd plan`: the profiler and the planner from the shell.

streamdiffd profile                        # measure this machine; cached where the daemon looks
streamdiffd profile --sizes 256x144,128x64 --rounds 3 --out docs/results/profile-cpu.json
streamdiffd plan --devices 8 --profile docs/results/profile-b70.json --objective streams
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..config import OBJECTIVES, ConfigError
from ..config.loader import load
from ..flags import add_model_args, overrides_from_args
from ..placement.profile.cpu_probes import LEVEL_CYCLES


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 256x144") from None
    if w < 16 or h < 16 or w % 16 or h % 16:
        raise argparse.ArgumentTypeError(f"{text!r}: width and height must be multiples of 16, at least 16")
    return w, h


def _sizes(text: str) -> list[tuple[int, int]]:
    return [_size(x) for x in text.split(",") if x]


def _config(a: argparse.Namespace, only: tuple[str, ...] | None = None):
    """The config the daemon would run with these model flags (the rest of its flags unset)."""
    return load(a.config, overrides_from_args(a, only))


def profile_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="streamdiffd profile", description="Measure the stages on this machine.")
    add_model_args(p)
    p.add_argument("--sizes", type=_sizes, help="frame sizes, comma-separated (default: the model's size)")
    p.add_argument("--rounds", type=int, default=3, help="measurement rounds; each figure is their median")
    p.add_argument(
        "--cycles",
        type=int,
        default=LEVEL_CYCLES,
        help=f"on a CPU, the interleaved cycles that level the one- and two-thread stages in each round "
        f"(default {LEVEL_CYCLES}; fewer: a quicker profile, more exposed to the machine's drift)",
    )
    p.add_argument("--out", help="write the profile here (default: the state directory, where the daemon looks)")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds: {a.rounds} must be at least 1")
    if a.cycles < 1:
        p.error(f"--cycles: {a.cycles} must be at least 1")
    from ..placement.auto import state_dir
    from ..placement.profile.measure import measure
    from ..placement.profile.schema import cache_path
    from ..supervisor.topology import model_card

    cfg = _config(a)
    default = model_card(cfg).default_size
    sizes = a.sizes or [default]
    prof = measure(cfg, sizes, rounds=a.rounds, cycles=a.cycles, log=lambda s: print(s, file=sys.stderr))
    out = Path(a.out) if a.out else cache_path(str(state_dir(cfg)), cfg, sizes[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(prof.to_json())
    print(summary(prof))
    print(f"wrote {out}")
    return 0


def summary(prof) -> str:
    lines = [f"{prof.device_name} ({prof.device}, {prof.devices} devices), model {prof.preset}"]
    for size, fig in prof.sizes.items():
        for t, d in fig["dit"].items():
            v = fig["vae"][t]
            lines.append(
                f"  {size} {t} thread(s): DiT {d['block_ms']:.0f} ms/block (first {d['first_ms']:.0f}), "
                f"VAE {v['block_ms']:.0f} ms/block, DiT/VAE {d['block_ms'] / v['block_ms']:.2f}"
            )
        for k, splits in fig.get("vae_group", {}).items():
            eq = splits["equal"]
            base = fig["vae"]["1"]["block_ms"]
            lines.append(
                f"  {size} VAE group of {k}: {eq[0]['block_ms']:.0f} ms/block ({base / eq[0]['block_ms']:.2f}x), "
                f"shards' own work {[round(x['own_ms']) for x in eq]} ms, waits {[round(x['wait_ms']) for x in eq]} ms"
            )
        for g, d in fig.get("dit_group", {}).items():
            base = fig["dit"]["1"]["block_ms"]
            lines.append(
                f"  {size} DiT group of {g}: {d['block_ms']:.0f} ms/block ({base / d['block_ms']:.2f}x), "
                f"own work {d['own_ms']:.0f} ms, in all-to-alls {d['collective_ms']:.0f} ms"
            )
        lines.append(f"  {size} encoder: {fig['encode']['block_ms']:.0f} ms/block")
    return "\n".join(lines)


def plan_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="streamdiffd plan", description="Rank the layouts of N devices from a profile.")
    p.add_argument("--config", help="TOML config file (the device it names)")
    p.add_argument("--device", choices=("cpu", "cuda", "xpu"))
    p.add_argument("--model", metavar="PRESET|PATH", help="as for streamdiffd")
    p.add_argument("--decoder", choices=("wan", "taehv"), help="the latent decoder to plan for")
    p.add_argument("--decoder-weights", metavar="FILE", help="TAEHV's weights (as for streamdiffd)")
    p.add_argument("--profile", help="a profile (streamdiffd profile); default: this machine's cached one")
    p.add_argument("--devices", type=int, help="devices to plan for (default: the profile's)")
    p.add_argument("--objective", choices=(*OBJECTIVES, "all"), default="all")
    p.add_argument("--size", type=_size, help="frame size (default: the model's, or the profile's first)")
    p.add_argument("--w2-size", type=_size, help="frame size of the concurrent streams (default: --size)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--preset",
        help="plan for this model (a DiT configuration or checkpoint preset), its DiT priced from the "
        "profile's by FLOPs per block (e.g. krea-realtime-14b from a 1.3B profile)",
    )
    p.add_argument("--memory-gib", type=float, help="one device's memory (default: the profile's, where it says)")
    a = p.parse_args(argv)
    from ..models.spec import known_presets, preset_card
    from ..placement.auto import dtype_bytes, state_dir
    from ..placement.cost import GIB, DoesNotFit, model_cost, priced_profile
    from ..placement.planner import plan
    from ..placement.profile.schema import Profile, cache_path
    from ..supervisor.topology import model_card

    # --preset is the model to plan for, which needs no weights: not the daemon's --preset
    model_flags = ("config", "device", "model", "decoder", "decoder_weights")
    cfg = _config(a, model_flags)
    card = model_card(cfg)
    path = Path(a.profile) if a.profile else cache_path(str(state_dir(cfg)), cfg, card.default_size)
    try:
        prof = Profile.from_json(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"streamdiffd plan: cannot read the profile {path}: {exc}", file=sys.stderr)
        return 2
    priced = None
    if a.preset and a.preset != prof.preset:  # another model, priced from the profile's
        if a.preset not in known_presets():
            p.error(f"--preset: unknown model {a.preset!r} (known: {', '.join(known_presets())})")
        priceable = [n for n in known_presets() if preset_card(n).dims is not None]
        for name in (a.preset, prof.preset):
            if preset_card(name).dims is None:
                p.error(f"--preset: {name!r} has no DiT dimensions to price by (known: {', '.join(priceable)})")
        try:
            prof, priced = priced_profile(prof, a.preset), prof.preset
        except ValueError as exc:
            p.error(f"--preset: {exc}")
        card = preset_card(a.preset)
    elif prof.preset != cfg.model.preset:  # plan for the profile's model (its card; no weights needed)
        card = preset_card(prof.preset).configured(card.frames_per_block)
    size = a.size or (card.default_size if "x".join(map(str, card.default_size)) in prof.sizes else None)
    size = size or _size(next(iter(prof.sizes)))
    if f"{size[0]}x{size[1]}" not in prof.sizes:
        print(f"streamdiffd plan: the profile has no figures at {size[0]}x{size[1]}", file=sys.stderr)
        return 2
    devices = a.devices or prof.devices
    if devices < 1:
        p.error(f"--devices: {devices} must be at least 1")
    memory = int(a.memory_gib * GIB) if a.memory_gib else prof.memory_bytes
    if preset_card(prof.preset).dims is not None:
        cost = model_cost(prof.preset, size, dtype_bytes(cfg, prof.device))
        if priced:
            base = model_cost(priced, size)
            print(
                f"{prof.preset}: DiT priced from {priced}'s at {cost.block_flops / base.block_flops:.2f}x "
                f"its FLOPs per block ({cost.block_flops / 1e12:.1f} TFLOP)",
                file=sys.stderr,
            )
        if memory:
            try:
                cost.check(memory)
            except DoesNotFit as exc:
                print(f"streamdiffd plan: {exc}", file=sys.stderr)
                return 2
    out = {}
    for obj in OBJECTIVES if a.objective == "all" else (a.objective,):
        ranked = plan(cfg, prof, devices, obj, card, size, a.w2_size)
        out[obj] = ranked
        if not a.json:
            print(f"\n{obj} ({devices} devices, {size[0]}x{size[1]}, {prof.device_name}):")
            print(ranked.table(a.top))
    if a.json:
        print(json.dumps({k: v.as_dict(a.top) for k, v in out.items()}, indent=1))
    return 0


def main(argv: list[str]) -> int:
    try:
        return {"profile": profile_main, "plan": plan_main}[argv[0]](argv[1:])
    except ConfigError as exc:
        print(f"streamdiffd {argv[0]}: configuration error: {exc}", file=sys.stderr)
        return 2
