#!/usr/bin/env python3
"""Per-block decode time of the latent decoders: TAEHV against the Wan 2.1 VAE, on the same latents.

One steady block each (after the shot's first block, untimed), fp32, as the VAE worker decodes it
(`VAEEngine.decode_blocks`, in the CPU working set's chunks). Prints one line per decoder and,
with --json, writes the figures.

  python tools/bench/decoders.py                         # the embedded default at 256x144
  python tools/bench/decoders.py --real --size 832x480   # the real Wan VAE config vs published-width TAEHV

Without --real: the tiny preset's Wan VAE and its TAEHV (TINY_TAEHV, random seeded weights), and
TAEHV at the published widths, all on the embedded default's latent shape. With --real: the real
Wan 2.1 VAE configuration (73 M parameters) and TAEHV at the published widths, random weights
(decode time does not depend on the values).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from streamdiff.models.engines import VAEEngine  # noqa: E402
from streamdiff.models.presets import get_preset  # noqa: E402
from streamdiff.models.spec import ModelSpec  # noqa: E402
from streamdiff.models.wan.taehv import TAEHVConfig, random_taehv  # noqa: E402
from streamdiff.models.wan.vae import VAEConfig, WanVAEDecoder  # noqa: E402
from streamdiff.platform.devices import cpu_model  # noqa: E402


def engine(decoder: str, real: bool, published_taehv: bool, device: str) -> VAEEngine:
    """A VAEEngine of the tiny preset, its model swapped for the one to time."""
    eng = VAEEngine(ModelSpec(decoder=decoder), device)
    if decoder == "wan" and real:
        torch.manual_seed(0)
        eng.model = WanVAEDecoder(VAEConfig()).to(device).eval().requires_grad_(False)
        eng.preset = replace(eng.preset, vae=VAEConfig())
    if decoder == "taehv" and published_taehv:
        eng.model = random_taehv(TAEHVConfig(), seed=0).to(device).eval().requires_grad_(False)
    return eng


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elif device.startswith("xpu"):
        torch.xpu.synchronize()


def time_block(eng: VAEEngine, z: torch.Tensor, blocks: int, device: str) -> dict:
    state = eng.open_session()
    eng.decode_blocks([state], z)  # the shot's first block (9 frames of 12), untimed: cold
    times = []
    for _ in range(blocks):
        sync(device)
        t0 = time.perf_counter()
        frames = eng.decode_blocks([state], z)[0]
        sync(device)
        times.append(time.perf_counter() - t0)
    return {"block_ms": 1000 * statistics.median(times), "frames": frames.shape[0], "runs": blocks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256x144")
    ap.add_argument("--frames-per-block", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=1, help="steady blocks timed (median)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--real", action="store_true", help="the real Wan VAE config and TAEHV's published widths only")
    ap.add_argument("--only", choices=("wan", "taehv"), help="time one decoder")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    w, h = (int(x) for x in a.size.split("x"))
    sf = get_preset(ModelSpec()).vae.spatial_factor
    z = torch.randn(1, 16, a.frames_per_block, h // sf, w // sf, generator=torch.Generator().manual_seed(0))
    runs = [("wan", False)] if a.real else [("wan", False), ("taehv", False)]
    runs += [("taehv", True)]
    out = {"cpu": cpu_model(), "size": a.size, "frames_per_block": a.frames_per_block, "threads": a.threads}
    for decoder, published in runs:
        if a.only and decoder != a.only:
            continue
        name = {"wan": "wan-real" if a.real else "wan-tiny"}.get(
            decoder, "taehv-published" if published else "taehv-tiny"
        )
        eng = engine(decoder, a.real, published, a.device)
        params = sum(p.numel() for n, p in eng.model.named_parameters() if not n.startswith("encoder."))
        res = {**time_block(eng, z, a.blocks, a.device), "params": params}
        out[name] = res
        print(
            f"{name:16s} {a.size} {a.frames_per_block} latent frames: {res['block_ms']:9.1f} ms/block "
            f"({res['frames']} frames, {params / 1e6:.2f} M decoder parameters)",
            flush=True,
        )
    if "wan-real" in out or "wan-tiny" in out:
        base = out.get("wan-real") or out["wan-tiny"]
        for k in ("taehv-tiny", "taehv-published"):
            if k in out:
                out[f"{k}_over_wan"] = out[k]["block_ms"] / base["block_ms"]
                print(f"{k} / Wan VAE: {out[k]['block_ms'] / base['block_ms']:.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
