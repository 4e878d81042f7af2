#!/usr/bin/env python3
"""How long a world model's control takes to reach the wire: from `POST .../controls` to the
arrival of the first fragment it shaped, at steady state, against the floor of one block plus
its decode and encode.

One daemon serving a model that takes controls (the flags after `--`); a live video read as a
player reads it; after a few fragments, `--controls` held-key changes, each at a random point of
a block (so that landing behind a block already started is sampled as a player meets it). A
control's answer names its block; its latency is that fragment's arrival less the POST's start.
Prints p50/p95, the floor (the mean DiT, VAE and encode time of a block, from /metrics), the
live lead the scheduler keeps (`limits.live_lead_s`), the CPU and the stage balance.

    tools/bench/control_latency.py --controls 30 -- --preset minwm-action2v --model DIR \\
        --dit-checkpoint DIR/model.pt --mode aggregated --dit-gpus 1 --vae-gpus 1
    tools/bench/control_latency.py --image start.png -- --preset matrix-game-2-universal ...

The keys held cycle through the model's own (one, two, none); a model that starts from a picture
(Matrix-Game) needs `--image`.
"""

from __future__ import annotations

import argparse
import base64
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from streamdiff.testing import Daemon, FragmentArrivals, cpu_model, http, stage_means  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--controls", type=int, default=30)
    p.add_argument("--size", default="128x64")
    p.add_argument("--warm", type=int, default=5, help="fragments before the first control")
    p.add_argument("--image", help="the start picture, for a model that needs one (PNG, JPEG or WebP)")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the daemon's flags")
    a = p.parse_args()
    flags = a.flags[1:] if a.flags[:1] == ["--"] else a.flags
    d = Daemon(*flags, "--size", a.size)
    try:
        model = http.get(d.url + "/v1/models", timeout=10).json()["data"][0]
        if not model.get("controls"):
            raise SystemExit(f"model {model['id']} takes no controls")
        fps, fpb = model["fps"], model["frames_per_block"]
        body = {"prompt": "a forest path", "live": True, "size": a.size, "seed": 1}
        if a.image:
            body["input_reference"] = "data:image/png;base64," + base64.b64encode(Path(a.image).read_bytes()).decode()
        player = FragmentArrivals("POST", d.url + "/v1/videos", {**body, "stream": True})
        player.start()
        while len(player.arrivals) < a.warm:
            time.sleep(0.02)
        vid = player.headers["X-Video-Id"]
        block_s = fpb * 4 / fps
        k = model["controls"]["keys"]
        keys = [[k[0]], [k[-1]], k[:2], []]
        lat, blocks_behind = [], []
        for i in range(a.controls):
            time.sleep(random.uniform(0, block_s))
            t = time.monotonic()
            r = http.post(f"{d.url}/v1/videos/{vid}/controls", json={"seq": i + 1, "keyboard": keys[i % 4]})
            r.raise_for_status()
            block = r.json()["block"]
            blocks_behind.append(block - len(player.arrivals))
            while len(player.arrivals) <= block:
                time.sleep(0.005)
            lat.append(player.arrivals[block] - t)
        means = stage_means(d.url)
        http.post(f"{d.url}/v1/videos/{vid}/stop", timeout=10)
        player.join(60)
    finally:
        d.stop()
    lat.sort()
    p50, p95 = statistics.median(lat), lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))]
    floor = means["dit"] + means["vae"] + means["encode"]
    print(f"cpu: {cpu_model()} ({platform.machine()}), daemon flags: {' '.join(flags)} --size {a.size}")
    print(f"block: {fpb} latent frames = {block_s:.2f} s of video at {fps} fps")
    dit, vae, enc = (means[k] * 1000 for k in ("dit", "vae", "encode"))
    print(f"stage balance: DiT {dit:.0f} ms, VAE {vae:.0f} ms, encode {enc:.0f} ms a block (DiT/VAE {dit / vae:.2f})")
    print(f"controls: {len(lat)}; landed {statistics.mean(blocks_behind):.1f} blocks past the last fragment received")
    print(f"control to wire: p50 {p50:.2f} s, p95 {p95:.2f} s; floor (one block + its decode + encode) {floor:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
