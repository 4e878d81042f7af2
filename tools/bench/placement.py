#!/usr/bin/env python3
"""The simulator against the pipeline, and the planner's pick against the fixed layouts.

Each round measures a fresh profile of this machine (streamdiffd profile), predicts every
layout's W1 from it with the simulator, then measures every layout with tools/bench/layouts.py, the
planner's own pick ("auto": streamdiffd with no layout flags, planning from that round's
profile) included. Rounds interleave, so a machine whose speed drifts is sampled across the
drift; the prediction of a round is compared with the measurement of the same round.

    tools/bench/placement.py --rounds 3 --json docs/results/bench_placement.json

A layout's error is the median of its speed-corrected frames/s errors over the rounds, the
planner's pick ("auto") counted under its layout's name in place of a fixed run of the same name
(planned, a cut adapts); `--record` writes them into this machine's cached profile (the daemon's
state directory), where a lead under either layout's error ranks the simpler first (planner.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LAYOUTS = "disagg-1+1,agg-1x2t,agg-seq-k2,agg-2rep,hybrid-1+2,agg-sp2,shared-1+1,auto"


def bench_module():
    """tools/bench/layouts.py, loaded from beside this script: its layout table is the one measured."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("layouts", Path(__file__).resolve().with_name("layouts.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["layouts"] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def layout_for(name: str, flags: list[str]):
    from streamdiff.config.loader import load
    from streamdiff.flags import overrides_from_args, parse_args
    from streamdiff.placement.layout import Layout

    return Layout.of(load(None, overrides_from_args(parse_args(flags))).topology)


def table(summary: dict) -> str:
    def pcts(xs):
        return ", ".join(f"{100 * v:+.0f}%" for v in xs)

    out = [
        "| layout | measured frames/s | predicted | error | TTFF error | speed-corrected error "
        "| corrected TTFF error |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        out.append(
            f"| {name} | {', '.join(f'{v:.1f}' for v in s['measured_fps'])} | "
            f"{', '.join(f'{v:.1f}' for v in s['predicted_fps'])} | {pcts(s['fps_error'])} | "
            f"{pcts(s['ttff_error'])} | {pcts(s['corrected_fps_error'])} | {pcts(s['corrected_ttff_error'])} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default=LAYOUTS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", default="256x144")
    ap.add_argument("--json", default=str(ROOT / "docs" / "results" / "bench_placement.json"))
    ap.add_argument("--record", action="store_true", help="write the measured error into the cached profile")
    a = ap.parse_args()
    from streamdiff.config.loader import load
    from streamdiff.placement.auto import state_dir
    from streamdiff.placement.planner import plan
    from streamdiff.placement.profile.measure import measure
    from streamdiff.placement.profile.schema import Profile, cache_path
    from streamdiff.placement.sim import simulate
    from streamdiff.platform.devices import cpu_model
    from streamdiff.supervisor.topology import model_card

    bench = bench_module()
    names = a.layouts.split(",")
    w, h = (int(x) for x in a.size.split("x"))
    cfg = load(None, {})
    card = model_card(cfg)
    rounds = []
    for r in range(a.rounds):
        state = tempfile.mkdtemp(prefix="sd-state-")
        t0 = time.time()
        prof = measure(cfg, [(w, h)], rounds=1, log=lambda s: print(s, file=sys.stderr))
        Path(cache_path(state, cfg, (w, h))).write_text(prof.to_json())
        chosen = plan(cfg, prof, 2, "throughput", card, (w, h)).best[0]
        print(f"round {r + 1}: profile in {time.time() - t0:.0f}s; the planner picks {chosen.name}", flush=True)
        row = {"profile": json.loads(prof.to_json()), "planned": chosen.name, "layouts": {}}
        for name in names:
            lay = chosen if name == "auto" else layout_for(name, bench.LAYOUTS[name])
            pred = simulate(cfg, prof, lay, card, (w, h))
            out = Path(state) / f"bench-{name}.json"
            env = {**os.environ, "STATE_DIRECTORY": state}
            subprocess.run(
                [
                    sys.executable,
                    str(Path(__file__).resolve().with_name("layouts.py")),
                    "--layouts",
                    name,
                    "--w1-only",
                    "--size",
                    a.size,
                    "--out-dir",
                    state,
                    "--json",
                    str(out),
                    "--plot",
                    str(Path(state) / "x.png"),
                ],
                check=True,
                env=env,
                stdout=subprocess.DEVNULL,
            )
            w1 = json.loads(out.read_text())["results"][0]["w1"]
            got = {"fps": w1["fps_total"], "ttff_s": w1["ttff_s"], "block_ms": w1["block_ms"]}
            # The machine's speed during this run against the profile's: the VAE's measured time
            # per block over the simulator's (the VAE never yields its core, so its wall time
            # tracks the machine); the corrected prediction scales every stage by it.
            speed = got["block_ms"]["vae"] / pred.vae_ms_per_block
            corrected = {"w1_fps": pred.w1_fps / speed, "w1_ttff_s": pred.w1_ttff_s * speed}
            row["layouts"][name] = {
                "layout": lay.name,
                "predicted": pred.as_dict(),
                "measured": got,
                "speed": speed,
                "corrected": corrected,
            }
            print(
                f"  {name:>11} ({lay.name}): measured {got['fps']:.1f} frames/s, TTFF {got['ttff_s']:.2f}s; "
                f"predicted {pred.w1_fps:.1f} ({100 * (pred.w1_fps / got['fps'] - 1):+.0f}%), "
                f"TTFF {pred.w1_ttff_s:.2f}s ({100 * (pred.w1_ttff_s / got['ttff_s'] - 1):+.0f}%); "
                f"machine speed x{1 / speed:.2f} of the profile's: corrected {corrected['w1_fps']:.1f} "
                f"({100 * (corrected['w1_fps'] / got['fps'] - 1):+.0f}%), TTFF {corrected['w1_ttff_s']:.2f}s "
                f"({100 * (corrected['w1_ttff_s'] / got['ttff_s'] - 1):+.0f}%)",
                flush=True,
            )
        base = max(row["layouts"][n]["measured"]["fps"] for n in ("disagg-1+1", "agg-1x2t") if n in row["layouts"])
        if "auto" in row["layouts"]:
            row["auto_ratio"] = row["layouts"]["auto"]["measured"]["fps"] / base
            print(f"  auto / best of disagg-1+1 and agg-1x2t: {row['auto_ratio']:.2f}", flush=True)
        rounds.append(row)
        Path(a.json).write_text(json.dumps({"rounds": rounds}, indent=1))  # kept as it goes
    summary = {}
    for name in names:
        rows = [x["layouts"][name] for x in rounds]
        summary[name] = {
            "measured_fps": [x["measured"]["fps"] for x in rows],
            "predicted_fps": [x["predicted"]["w1_fps"] for x in rows],
            "fps_error": [x["predicted"]["w1_fps"] / x["measured"]["fps"] - 1 for x in rows],
            "ttff_error": [x["predicted"]["w1_ttff_s"] / x["measured"]["ttff_s"] - 1 for x in rows],
            "speed": [x["speed"] for x in rows],
            "corrected_fps_error": [x["corrected"]["w1_fps"] / x["measured"]["fps"] - 1 for x in rows],
            "corrected_ttff_error": [x["corrected"]["w1_ttff_s"] / x["measured"]["ttff_s"] - 1 for x in rows],
        }
        for k in ("fps_error", "ttff_error", "corrected_fps_error", "corrected_ttff_error"):
            summary[name][k + "_median"] = statistics.median(summary[name][k])
    print(table(summary))
    fixed: dict[str, list[float]] = {}
    planned: dict[str, list[float]] = {}
    for row in rounds:
        for name, x in row["layouts"].items():
            e = x["corrected"]["w1_fps"] / x["measured"]["fps"] - 1
            (planned if name == "auto" else fixed).setdefault(x["layout"], []).append(e)
    plan_errors = {k: min(abs(statistics.median(v)), 0.99) for k, v in {**fixed, **planned}.items()}
    for k, v in sorted(plan_errors.items()):
        print(f"the simulator's error on {k}{' (planned)' if k in planned else ''}: {100 * v:.0f}%")
    meta = {"cpu": cpu_model(), "nproc": os.cpu_count(), "size": a.size, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = {"meta": meta, "plan_errors": plan_errors, "summary": summary, "rounds": rounds}
    Path(a.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.json}")
    if a.record:
        cached = cache_path(str(state_dir(cfg)), cfg, (w, h))
        try:
            prof = Profile.from_json(cached.read_text())
        except (OSError, ValueError) as exc:
            sys.exit(f"--record: no profile of this machine at {cached} ({exc}): run streamdiffd profile")
        prof.plan_errors = plan_errors
        cached.write_text(prof.to_json())
        print(f"recorded it in {cached}")


if __name__ == "__main__":
    main()
