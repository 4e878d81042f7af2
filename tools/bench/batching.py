#!/usr/bin/env python3
"""Per-sample cost of cross-session batching: one DiT block and one VAE decode for B sessions
at once (B = 1, 2, 4), against B = 1, interleaved over rounds, steady state (sessions past the
first block, the DiT window filling as it would in a stream).

    tools/bench/batching.py --size 256x144 --rounds 5 --json docs/results/bench_batching.json
    tools/bench/batching.py --preset wan2.1-t2v-1.3b --random-weights --device cuda --size 832x480
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from streamdiff.models.engines import DiTEngine, VAEEngine  # noqa: E402
from streamdiff.models.spec import ModelSpec  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elif device.startswith("xpu"):
        torch.xpu.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--model", help="weights directory (real presets)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", default="256x144")
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    w, h = (int(v) for v in a.size.split("x"))
    spec = ModelSpec(preset=a.preset, path=a.model)
    dit, vae = DiTEngine(spec, a.device), VAEEngine(spec, a.device)
    fpb = dit.frames_per_block
    sizes = [int(b) for b in a.batches.split(",")]
    most = max(sizes)
    sessions = []
    for i in range(most):
        s = dit.open_session(w, h, seed=i)
        dit.set_scene(s, f"session {i}", new_shot=True)
        dit.generate_block(s, fpb)  # past the first block: steady-state step list
        sessions.append(s)
    states = [vae.open_session() for _ in range(most)]
    lh, lw = sessions[0].latent_hw
    z0 = torch.randn(most, 16, 1, lh, lw)
    vae.decode_blocks(states, z0)  # past the shot's first latent frame
    dit_ms = {b: [] for b in sizes}
    vae_ms = {b: [] for b in sizes}
    for _ in range(a.rounds):
        for b in sizes:
            sync(a.device)
            t0 = time.perf_counter()
            dit.generate_blocks(sessions[:b], fpb)
            sync(a.device)
            dit_ms[b].append(1000 * (time.perf_counter() - t0) / b)
            z = torch.randn(b, 16, fpb, lh, lw)
            sync(a.device)
            t0 = time.perf_counter()
            vae.decode_blocks(states[:b], z)
            sync(a.device)
            vae_ms[b].append(1000 * (time.perf_counter() - t0) / b)
    out = {
        "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"),
        "device": a.device,
        "threads": a.threads,
        "preset": a.preset,
        "size": a.size,
        "frames_per_block": fpb,
        "rounds": a.rounds,
        "per_sample_ms": {
            stage: {str(b): {"median": statistics.median(v), "min": min(v), "max": max(v)} for b, v in table.items()}
            for stage, table in (("dit", dit_ms), ("vae", vae_ms))
        },
    }
    for stage in ("dit", "vae"):
        t = out["per_sample_ms"][stage]
        print(stage, "  ".join(f"B={b}: {t[str(b)]['median']:.0f} ms/sample" for b in sizes), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
