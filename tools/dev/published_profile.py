#!/usr/bin/env python3
"""A planner profile (streamdiff/placement/profile/) from published per-latent-frame figures,
for hardware this project cannot run: `streamdiffd plan --devices N --profile OUT` then ranks
the layouts of N such devices.

    tools/dev/published_profile.py --out docs/results/profile-b70.json      # the Arc Pro B70 figures in the notes
    tools/dev/published_profile.py --decoder taehv --decoder-ratio 0.1 --out docs/results/profile-b70-taehv.json

The defaults are the figures measured on one Intel Arc Pro B70 at 832x480 by the implementation
behind the seed article (../shared/notes/wan-reference.md): DiT 0.957 s and VAE 1.290 s per
latent frame, the VAE sharded over 2 cards 1.4-1.5x faster (1.45 here). What they leave open is
filled as follows, and the profile says so in its `assumptions`:

- a block is 3 latent frames (this daemon's chunk-wise sampler), so DiT 2.871 s, VAE 3.870 s;
- a shot's first block decodes 9 frames instead of 12: its VAE time is 9/12 of a block's;
  the DiT's first block costs a steady one (no figure for it);
- a k-way VAE group: each shard's own time is front + rows x per-row cost, the two fitted to the
  1x and 2-way figures (so k > 2 extrapolates Amdahl-like), no exchange overhead beyond that;
- no batching gain (no figure): batch factors 1;
- the encoder: libx264 at that size, measured on this machine's CPU when the tool runs;
- with --decoder taehv: TAEHV's block is the VAE's times --decoder-ratio (TAEHV over the Wan VAE per
  block, measured on one device with tools/bench/decoders.py: no published B70 figure exists), it
  is never sharded (no VAE groups) and its first block is 9/12 of a steady one, as the VAE's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from streamdiff.placement.profile.probes import encode_ms  # noqa: E402
from streamdiff.placement.profile.schema import Profile  # noqa: E402
from streamdiff.platform.devices import cpu_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="Intel Arc Pro B70 (published figures)")
    ap.add_argument("--device", default="xpu")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--preset", default="wan2.1-t2v-1.3b")
    ap.add_argument("--size", default="832x480")
    ap.add_argument("--dit-s", type=float, default=0.957, help="DiT seconds per latent frame")
    ap.add_argument("--vae-s", type=float, default=1.290, help="VAE seconds per latent frame")
    ap.add_argument("--shard2", type=float, default=1.45, help="speedup of a 2-way VAE group")
    ap.add_argument("--frames-per-block", type=int, default=3)
    ap.add_argument("--decoder", choices=("wan", "taehv"), default="wan")
    ap.add_argument("--decoder-ratio", type=float, help="taehv: its block time over the Wan VAE's (measured)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    w, h = (int(x) for x in a.size.split("x"))
    dit = 1000 * a.dit_s * a.frames_per_block
    vae = 1000 * a.vae_s * a.frames_per_block
    model = {"published": True}
    if a.decoder == "taehv":
        if not a.decoder_ratio or not 0 < a.decoder_ratio <= 1:
            ap.error(f"--decoder taehv needs --decoder-ratio in (0, 1] (measured), got {a.decoder_ratio}")
        vae *= a.decoder_ratio
        model = {**model, "decoder": "taehv", "decoder_weights": None, "decoder_ratio": a.decoder_ratio}
    rows = h // 8
    half = vae / a.shard2
    enc = encode_ms(w, h, 16)
    shard = {"first_ms": 0.75 * half, "block_ms": half, "own_ms": half, "wait_ms": 0.0, "rows": rows // 2}
    size = {
        "dit": {"1": {"first_ms": dit, "block_ms": dit, "own_ms": dit, "batch_ms": {"2": dit, "4": dit}}},
        "vae": {
            "1": {
                "first_ms": 0.75 * vae,
                "block_ms": vae,
                "own_ms": vae,
                "wait_ms": 0.0,
                "rows": rows,
                "batch_ms": {"2": vae},
            }
        },
        "vae_group": {"2": {"equal": [shard, dict(shard)]}} if a.decoder == "wan" else {},
        "encode": enc,
        "assumptions": __doc__.split("filled as follows")[1].strip() + f" Encoder measured on {cpu_model()}.",
    }
    prof = Profile(a.device, a.name, a.devices, a.preset, model, {a.size: size}, time.time())
    Path(a.out).write_text(prof.to_json())
    print(
        f"wrote {a.out}: DiT {dit:.0f} ms, {a.decoder} decoder {vae:.0f} ms per block"
        + (f", 2-way group {half:.0f} ms" if a.decoder == "wan" else "")
        + ", "
        f"encoder {enc['block_ms']:.0f} ms"
    )


if __name__ == "__main__":
    main()
