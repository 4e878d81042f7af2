#!/usr/bin/env python3
"""Peak host memory and time to load a real DiT configuration, as a worker builds it.

Writes the DiT with random weights in the release layout (Wan-AI/Wan2.1-T2V-1.3B:
`diffusion_pytorch_model.safetensors` with the original key names and `config.json`, float32 as
released), then loads it through `presets.build_dit` in a fresh child process per round, in the
served dtype, and prints the child's peak resident memory (VmHWM: anonymous and mapped file
pages) against the served weights' bytes, with the time to load.

    tools/bench/load.py --dtype bfloat16                       # the 1.3B, loaded here
    tools/bench/load.py --base ../other-checkout --rounds 3    # interleaved against another tree
    tools/bench/load.py --layers 2                             # a 2-layer slice (the tests' size)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def write_release(d: Path, layers: int | None) -> int:
    """The 1.3B configuration (or `layers` of it) with random float32 weights, tensor by tensor
    so that writing holds the file once; returns its bytes."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT))
    from streamdiff.models.wan.dit import DiTConfig, WanDiT

    cfg = DiTConfig() if layers is None else DiTConfig(num_layers=layers)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in WanDiT(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}
    d.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(d / "diffusion_pytorch_model.safetensors"))
    (d / "config.json").write_text(
        json.dumps(
            {
                "dim": cfg.dim,
                "ffn_dim": cfg.ffn_dim,
                "freq_dim": cfg.freq_dim,
                "num_heads": cfg.num_heads,
                "num_layers": cfg.num_layers,
                "in_dim": cfg.in_channels,
                "out_dim": cfg.out_channels,
                "text_len": cfg.text_len,
                "model_type": "t2v",
            }
        )
    )
    return sum(t.numel() * 4 for t in sd.values())


CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from streamdiff.models.presets import build_dit
from streamdiff.models.spec import ModelSpec
t0 = time.perf_counter()
model, _ = build_dit(ModelSpec(preset="wan2.1-t2v-1.3b", path=sys.argv[2], dtype=sys.argv[3], compile="off"), "cpu")
s = time.perf_counter() - t0
status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
kb = lambda k: int(status[k].split()[0]) * 1024
print(json.dumps({"load_s": s, "peak_bytes": kb("VmHWM"), "rss_bytes": kb("VmRSS"),
                  "weights_bytes": sum(p.numel() * p.element_size() for p in model.state_dict().values())}))
"""


def load_once(tree: Path, d: Path, dtype: str) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(d), dtype], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"load in {tree} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--layers", type=int, help="a slice of the 1.3B of this many layers (default: all 30)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--base", type=Path, help="another checkout, loaded in turn with this one")
    ap.add_argument("--dir", type=Path, help="where the release is written (default: a temporary directory)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sd-load-") as tmp:
        d = a.dir or Path(tmp) / "wan-1.3b-random"
        t0 = time.perf_counter()
        file_bytes = write_release(d, a.layers)
        print(f"wrote {file_bytes / 2**30:.2f} GiB of float32 weights in {time.perf_counter() - t0:.0f} s: {d}")
        trees = {"this": ROOT, **({"base": a.base.resolve()} if a.base else {})}
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(a.rounds):
            for name, tree in trees.items():
                runs[name].append(load_once(tree, d, a.dtype))
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
        print(f"cpu: {cpu}, {os.cpu_count()} cores; dtype {a.dtype}")
        for name, rs in runs.items():
            w = rs[0]["weights_bytes"]
            peak = max(r["peak_bytes"] for r in rs)
            bound = 1.25 * w + 2**30
            loads = sorted(r["load_s"] for r in rs)
            print(
                f"{name}: weights {w / 2**30:.2f} GiB, peak host memory {peak / 2**30:.2f} GiB "
                f"({peak / w:.2f}x the weights; 1.25x + 1 GiB is {bound / 2**30:.2f} GiB: "
                f"{'within' if peak <= bound else 'over'}), load {loads[len(loads) // 2]:.1f} s median "
                f"of {len(loads)} ({loads[0]:.1f}-{loads[-1]:.1f})"
            )


if __name__ == "__main__":
    main()
