#!/usr/bin/env python3
"""The DiT's (or the VAE's) ms per block, eager and compiled, interleaved against another build (CPU).

Each round runs one child process per build and mode, alternately (the machine is shared: the
rounds spread the noise over both builds alike), and the median over rounds is printed. A child
builds the tiny preset's DiT (seeded), fills its attention window, then times `--blocks` blocks
of the sampler (4 steps and the commit pass). `--stage vae`: the tiny preset's Wan VAE decoder
(seeded), a shot's first block and one steady block, then `--blocks` steady blocks of 3 latent
frames decoded as the VAE worker decodes them (its chunked plan). `--base DIR` is another
checkout (e.g. a `git worktree` of 92242eb), run with its own code through PYTHONPATH.

  tools/bench/hotpath.py --base /work/wt/base92 --rounds 5 --threads 2
  tools/bench/hotpath.py --stage vae --rounds 5 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def vae_child(args: argparse.Namespace) -> None:
    """The VAE's ms per steady block, one build, one mode (printed as JSON)."""
    import torch

    from streamdiff.models.engines import VAEEngine
    from streamdiff.models.spec import ModelSpec

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # `compile` is only named when compiling: a build from before --compile has no such field
    spec = ModelSpec(preset="tiny", **({"compile": "on"} if args.mode == "compiled" else {}))
    eng = VAEEngine(spec)
    g = torch.Generator().manual_seed(1)
    state = eng.open_session()
    w, h = 256, 144

    def block():
        z = torch.randn(1, 16, 3, h // 8, w // 8, generator=g)
        return eng.decode_block(state, z)

    t0 = time.perf_counter()
    block()  # the shot's first block (and, compiled, its graphs)
    block()
    first_s = time.perf_counter() - t0
    times, cpu = [], []
    for _ in range(args.blocks):
        t0, c0 = time.perf_counter(), time.process_time()
        block()
        times.append(1000 * (time.perf_counter() - t0))
        cpu.append(1000 * (time.process_time() - c0))
    out = {"ms": statistics.median(times), "cpu_ms": statistics.median(cpu), "first_block_s": first_s}
    out["compile_s"] = first_s if args.mode == "compiled" else None
    if args.mode == "compiled":
        from torch._dynamo.utils import counters

        out["graphs"] = counters["stats"]["unique_graphs"]
    print(json.dumps(out))


def child(args: argparse.Namespace) -> None:
    """One build, one mode: ms per steady-state block (printed as JSON)."""
    if args.stage == "vae":
        return vae_child(args)
    import torch

    from streamdiff.models.presets import ModelSpec, get_preset
    from streamdiff.models.wan.dit import WanDiT
    from streamdiff.models.wan.sampler import denoise_block, warped_timesteps

    torch.set_num_threads(args.threads)
    p = get_preset(ModelSpec(preset="tiny"))
    torch.manual_seed(0)
    model = WanDiT(p.dit).eval()
    out = {}
    compile_s = None
    if args.mode == "compiled":
        try:
            from streamdiff.models.compiled import Compiler

            model.compile_blocks(Compiler("on", "cpu"))
        except ImportError:  # a checkout from before Compiler (--base)
            model.compile_blocks(True)
    w, h = p.default_size
    lh, lw = h // p.vae.spatial_factor, w // p.vae.spatial_factor
    s = p.sampler
    ts = warped_timesteps(s.steps, s.shift)
    g = torch.Generator().manual_seed(1)
    state = model.new_state(lh, lw, s.window_frames, s.sink_frames)
    model.set_prompt(state, torch.randn(1, p.dit.text_len, p.dit.text_dim, generator=g))
    f = s.frames_per_block

    def block():
        noise = torch.randn(1, p.dit.in_channels, f, lh, lw, generator=g)
        return denoise_block(model, state, noise, ts, [torch.randn(noise.shape, generator=g) for _ in ts[1:]])

    t0 = time.perf_counter()
    block()
    first_s = time.perf_counter() - t0
    if args.mode == "compiled":
        compile_s = first_s
    for _ in range(-(-s.window_frames // f)):  # a full window behind the timed blocks
        block()
    times, cpu = [], []
    for _ in range(args.blocks):
        t0, c0 = time.perf_counter(), time.process_time()
        block()
        times.append(1000 * (time.perf_counter() - t0))
        cpu.append(1000 * (time.process_time() - c0))
    # cpu_ms: the process's CPU time per block, less sensitive than the wall time to other
    # processes taking the cores (a shared machine), though not to their use of the caches.
    out = {"ms": statistics.median(times), "cpu_ms": statistics.median(cpu), "first_block_s": first_s}
    out["compile_s"] = compile_s
    if args.mode == "compiled":
        from torch._dynamo.utils import counters

        out["graphs"] = counters["stats"]["unique_graphs"]
    print(json.dumps(out))


def run_child(tree: Path, mode: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--mode", mode]
    cmd += ["--threads", str(args.threads), "--blocks", str(args.blocks), "--stage", args.stage]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(tree))
    if res.returncode:
        raise SystemExit(f"{tree} {mode}: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, help="another checkout to compare (eager)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--stage", choices=("dit", "vae"), default="dit", help="the stage to time")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true", help="eager only")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="eager", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    runs = [("this/eager", ROOT, "eager")]
    if not args.no_compile:
        runs.append(("this/compiled", ROOT, "compiled"))
    if args.base:
        runs.insert(0, ("base/eager", args.base.resolve(), "eager"))
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
            if ln.startswith("Model name")
        ),
        "?",
    )
    got: dict[str, list[dict]] = {name: [] for name, _, _ in runs}
    for r in range(args.rounds):
        for name, tree, mode in runs:
            got[name].append(run_child(tree, mode, args))
        print(f"round {r + 1}: " + ", ".join(f"{n} {got[n][-1]['ms']:.1f} ms" for n in got), flush=True)
    stage = "VAE" if args.stage == "vae" else "DiT"
    print(f"CPU: {cpu}, {args.threads} threads, {args.rounds} rounds x {args.blocks} blocks (tiny {stage}, 256x144)")
    summary = {"cpu": cpu, "threads": args.threads, "rounds": args.rounds, "blocks": args.blocks, "stages": {}}
    for name, rows in got.items():
        ms = [x["ms"] for x in rows]
        med = statistics.median(ms)
        spread = (max(ms) - min(ms)) / med
        extra = ""
        if rows[0].get("compile_s") is not None:
            extra = f", first block (compiling) {statistics.median(x['compile_s'] for x in rows):.1f} s"
        rounds = ", ".join(f"{x:.1f}" for x in ms)
        cpu_ms = statistics.median(x["cpu_ms"] for x in rows)
        head = f"  {name:15s} median {med:7.1f} ms/block, CPU {cpu_ms:7.1f} ms"
        print(f"{head}  (rounds {rounds}; spread {spread:.0%}){extra}")
        summary["stages"][name] = {
            "median_ms": med,
            "rounds_ms": ms,
            "cpu_ms": cpu_ms,
            "rounds_cpu_ms": [x["cpu_ms"] for x in rows],
        }
    if "base/eager" in got:
        base = summary["stages"]["base/eager"]["median_ms"]
        for name in summary["stages"]:
            if name != "base/eager":
                st = summary["stages"]
                wall, cpu = base / st[name]["median_ms"], st["base/eager"]["cpu_ms"] / st[name]["cpu_ms"]
                print(f"  base/eager / {name}: {wall:.2f}x wall, {cpu:.2f}x CPU time")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
