#!/usr/bin/env python3
"""Decode time per block of a height-sharded VAE group: k = 1, 2, ... shards, one thread each.

Each shard is a real process (gloo over loopback on CPU, nccl/xccl on accelerators), pinned to
its own core on CPU. Every timed block starts after a barrier; the block's time is the slowest
shard's. The layouts are run in interleaved rounds (k=1, k=2, ..., k=1, k=2, ...) so that drift
on a shared machine hits them alike. Prints the median (min-max) per block over all rounds, the
speedup of the medians over k = 1, and the halo bytes each shard sent per block; --front also
compares the replicated front (default) with the sharded front (all-gather for the attention).

  python tools/bench/vae_shard.py --sizes 256x144,416x240 --ks 1,2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def shard(rank, world, addr, args, out):
    import torch

    torch.set_num_threads(1)
    if args["pin"] and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    import torch.distributed as dist

    from streamdiff.models.presets import build_vae
    from streamdiff.models.spec import ModelSpec
    from streamdiff.models.wan.kernels import plan_block
    from streamdiff.parallel.vae_group import ExchangeHalo, init_group

    device = args["device"] if args["device"] == "cpu" else f"{args['device']}:{rank}"
    if world > 1:
        init_group(addr, rank, world, device, 300)
    vae, preset = build_vae(ModelSpec(preset=args["preset"], path=args.get("model")), device)
    w, h = args["size"]
    sf = preset.vae.spatial_factor
    g = torch.Generator().manual_seed(0)
    state = vae.new_state()
    times, halo = [], []
    for i in range(args["warmup"] + args["blocks"]):
        f = 1 if i == 0 else args["frames"]
        z = torch.randn(1, preset.vae.z_dim, f, h // sf, w // sf, generator=g).to(device)
        if world > 1:
            dist.barrier()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        c = preset.vae
        plan = plan_block(z.shape, world, z.device.type, c.base_dim, sf, c.temporal_factor, z.element_size())
        hx = ExchangeHalo(rank, list(plan.bands)) if world > 1 else None
        vae.decode_rows(z, state, plan, rank, hx, args["shard_front"])
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i >= args["warmup"]:
            times.append(dt)
            halo.append(hx.bytes_sent if world > 1 else 0)
    out.put((rank, times, halo))
    if world > 1:
        dist.destroy_process_group()


def run(world: int, args: dict) -> tuple[list[float], int]:
    from streamdiff.supervisor.topology import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=shard, args=(r, world, addr, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=3600) for _ in range(world)]
    for p in procs:
        p.join()
    per_block = [max(r[1][i] for r in results) for i in range(args["blocks"])]
    halo = statistics.median(max(r[2][i] for r in results) for i in range(args["blocks"]))
    return per_block, int(halo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--model", help="weights directory for real presets")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", default="256x144,416x240")
    ap.add_argument("--ks", default="1,2")
    ap.add_argument("--frames", type=int, default=3, help="latent frames per timed block")
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the layouts")
    ap.add_argument("--front", action="store_true", help="also time the sharded front (all-gather attention)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin shard r to core r")
    ap.add_argument("--json", help="append the results to this file")
    a = ap.parse_args()
    rows = []
    for size in a.sizes.split(","):
        w, h = (int(v) for v in size.split("x"))
        layouts = [
            (k, front)
            for k in (int(v) for v in a.ks.split(","))
            for front in ([False, True] if a.front and k > 1 else [False])
        ]
        times = {lay: [] for lay in layouts}
        halo = {}
        for _ in range(a.rounds):
            for k, front in layouts:
                args = {
                    "preset": a.preset,
                    "model": a.model,
                    "device": a.device,
                    "size": (w, h),
                    "frames": a.frames,
                    "blocks": a.blocks,
                    "warmup": a.warmup,
                    "shard_front": front,
                    "pin": not a.no_pin,
                }
                t, halo[(k, front)] = run(k, args)
                times[(k, front)] += t
        base = statistics.median(times[layouts[0]])
        for (k, front), t in times.items():
            med = statistics.median(t)
            r = {
                "k": k,
                "size": size,
                "frames_per_block": a.frames,
                "shard_front": front,
                "block_s": med,
                "min_s": min(t),
                "max_s": max(t),
                "samples": len(t),
                "speedup": base / med,
                "halo_bytes_per_block": halo[(k, front)],
            }
            rows.append(r)
            front_s = " sharded-front" if front else ""
            print(
                f"{size:>8} k={k}{front_s}: {1000 * med:.0f} ms/block ({1000 * min(t):.0f}-{1000 * max(t):.0f}, "
                f"n={len(t)}), {1000 * med / a.frames:.0f} ms/latent frame, speedup {r['speedup']:.2f}x, "
                f"halo {r['halo_bytes_per_block'] / 1024:.0f} KiB/block/shard",
                flush=True,
            )
    if a.json:
        p = Path(a.json)
        old = json.loads(p.read_text()) if p.exists() else []
        p.write_text(json.dumps(old + rows, indent=1))


if __name__ == "__main__":
    main()
