#!/usr/bin/env python3
"""What cutting the VAE decoder between stages would give a two-core pipeline (issue 10).

Layout measured: the DiT process (core 0) also runs the decoder's first `cut` stages on each
block it generates and hands the activation to the VAE process (core 1), which runs the rest; a
host process on core 0 encodes every finished block into a fragment, as the supervisor does
(it is pinned to the DiT workers' cores). cut 0 is disagg-1+1's split (the DiT hands over
latents). The stages are `models/wan/vae.decoder_stages`; `decode_stages` runs them, and its
test shows a cut decode equals the whole one. Nothing here is the daemon: there is no
scheduler, the activation goes through a two-slot shared-memory buffer with queues for
control, and one session streams. It answers one question before the daemon grows a layout:
how much a cut takes off the period of the slower core, on this machine, measured.

Cuts run in interleaved rounds (each round in a rotated order), so a machine whose speed
drifts slows them alike. Printed: each stage's own time on one core (where a cut can go), then
per cut the steady time per block in every round, the median, and the speedup over cut 0.

  python tools/bench/vae_cut.py --cuts 0,3,4,5 --rounds 3 --json docs/results/bench_vae_cut.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

WARM_BLOCKS = 4  # DiT blocks before timing: its attention window fills


def _spec():
    from streamdiff.config.loader import load
    from streamdiff.supervisor.topology import model_spec

    return model_spec(load(None, {}))


def _pin(cpu: int) -> None:
    import torch

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {cpu})


def dit_side(cpu, cut, size, blocks, slots, free, full, go):
    """Core 0: the DiT, then stages [0, cut) of each block; the activation into a free slot."""
    _pin(cpu)
    import torch

    from streamdiff.models.engines import DiTEngine, VAEEngine
    from streamdiff.models.wan.vae import decode_stages

    spec = _spec()
    dit = DiTEngine(spec, "cpu")
    vae = VAEEngine(spec, "cpu").model
    state = vae.new_state()
    fpb = dit.frames_per_block
    sess = dit.open_session(*size, seed=0)
    dit.set_scene(sess, "a red fox runs through fresh snow", new_shot=True)
    warm = [dit.generate_block(sess, fpb) for _ in range(WARM_BLOCKS)]
    with torch.no_grad():
        for z in warm[:1]:  # the stages' first block of a shot, untimed, as the VAE side's
            decode_stages(vae, z, state, 0, cut, fpb)
    go.wait()
    for _ in range(blocks):
        z = dit.generate_block(sess, fpb)
        x = decode_stages(vae, z, state, 0, cut, fpb)
        i = free.get()
        slots[i].view(-1)[: x.numel()].copy_(x.reshape(-1))
        full.put((i, tuple(x.shape)))
    full.put(None)


def vae_side(cpu, cut, size, slots, free, full, encode, ready, out):
    """Core 1: stages [cut, end) of each block, the frames to the host."""
    _pin(cpu)
    import torch

    from streamdiff.models.engines import VAEEngine
    from streamdiff.models.wan.vae import decode_stages, decoder_stages, to_uint8_frames

    vae = VAEEngine(_spec(), "cpu").model
    n = len(decoder_stages(vae))
    state = vae.new_state()
    w, h = size
    with torch.no_grad():  # the same first block the DiT side decoded, and a cold steady one
        x = decode_stages(vae, torch.zeros(1, 16, 3, h // 8, w // 8), vae.new_state(), 0, cut, 3)
        decode_stages(vae, x, state, cut, n, 3)
    ready.set()
    done = []
    while (item := full.get()) is not None:
        i, shape = item
        count = 1
        for k in shape:
            count *= k
        x = slots[i].view(-1)[:count].view(shape).clone()
        free.put(i)
        y = decode_stages(vae, x, state, cut, n, 3)
        encode.put(to_uint8_frames(y).numpy())
        done.append(time.perf_counter())
    encode.put(None)
    out.put(done)


def host_side(cpu, size, encode):
    """Core 0 beside the DiT: a fragment per block, as the supervisor's encoder thread."""
    os.sched_setaffinity(0, {cpu})
    from streamdiff.media.encoder import FragmentWriter, PyAVEncoder

    w, h = size
    writer = FragmentWriter(PyAVEncoder(w, h, 16), w, h, 16)
    while (frames := encode.get()) is not None:
        writer.fragment(frames, idr_first=False)


def run(cores: list[int], cut: int, size: tuple[int, int], blocks: int, max_elems: int) -> float:
    """Steady ms per block (blocks done after the pipeline filled)."""
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    slots = [torch.zeros(max_elems).share_memory_() for _ in range(2)]
    free, full, encode, out = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    for i in range(len(slots)):
        free.put(i)
    go, ready = ctx.Event(), ctx.Event()
    procs = [
        ctx.Process(target=dit_side, args=(cores[0], cut, size, blocks, slots, free, full, go)),
        ctx.Process(target=vae_side, args=(cores[1], cut, size, slots, free, full, encode, ready, out)),
        ctx.Process(target=host_side, args=(cores[0], size, encode)),
    ]
    for p in procs:
        p.start()
    ready.wait()
    time.sleep(5.0)  # the DiT side's warm-up blocks
    go.set()
    done = out.get()
    for p in procs:
        p.join()
    skip = 2  # the pipeline filling
    return 1000 * (done[-1] - done[skip]) / (len(done) - 1 - skip)


def stage_costs(cpu: int, size: tuple[int, int]) -> tuple[list[float], list[list[int]]]:
    """Each stage's own time (ms) on one core for a steady block, as the profiler measures it,
    and its output shape."""
    _pin(cpu)
    import torch

    from streamdiff.models.engines import VAEEngine
    from streamdiff.models.wan.stage_times import stage_times
    from streamdiff.models.wan.vae import decode_stages, decoder_stages
    from streamdiff.models.wan.vae_shapes import stage_shapes

    eng = VAEEngine(_spec(), "cpu")
    vae, (w, h), n = eng.model, size, len(decoder_stages(eng.model))
    state, g = vae.new_state(), torch.Generator().manual_seed(0)
    decode_stages(vae, torch.randn(1, 16, 1, h // 8, w // 8, generator=g), state, 0, n, 1)  # a shot's first block
    decode_stages(vae, torch.randn(1, 16, 3, h // 8, w // 8, generator=g), state, 0, n, 3)  # steady, cold
    times = stage_times(vae, state, lambda: torch.randn(1, 16, 3, h // 8, w // 8, generator=g), "cpu")
    return times, [list(s) for s in stage_shapes(vae.cfg, 3, h // 8, w // 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cuts", default="0,3,4,5")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=14, help="blocks streamed per run")
    ap.add_argument("--size", default="256x144")
    ap.add_argument("--json")
    a = ap.parse_args()
    size = tuple(int(v) for v in a.size.split("x"))
    cuts = [int(c) for c in a.cuts.split(",")]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("tools/bench/vae_cut.py: needs 2 cores")
    costs, shapes = stage_costs(cores[1], size)
    os.sched_setaffinity(0, set(cores))  # the children pin themselves
    if max(cuts) > len(costs) or min(cuts) < 0:
        sys.exit(f"tools/bench/vae_cut.py: cuts go from 0 to {len(costs)}")
    total = sum(costs)
    print(f"VAE stages at {a.size}, one core, steady block ({total:.0f} ms):")
    run_sum = 0.0
    for i, (ms, shape) in enumerate(zip(costs, shapes, strict=True)):
        run_sum += ms
        print(
            f"  cut {i + 1} after stage {i:2d} {str(shape):24s} {ms:6.1f} ms, cumulative {100 * run_sum / total:5.1f}%"
        )
    max_elems = max([16 * 3 * (size[1] // 8) * (size[0] // 8)] + [s[0] * s[1] * s[2] * s[3] for s in shapes])
    per_cut: dict[int, list[float]] = {c: [] for c in cuts}
    for r in range(a.rounds):
        k = r % len(cuts)
        for cut in cuts[k:] + cuts[:k]:
            ms = run(cores, cut, size, a.blocks, max_elems)
            per_cut[cut].append(ms)
            print(f"round {r + 1}: cut {cut}: {ms:.0f} ms/block", flush=True)
    base = statistics.median(per_cut[cuts[0]])
    summary = {}
    for cut, v in per_cut.items():
        med = statistics.median(v)
        summary[cut] = {"ms_per_block": v, "median_ms": med, "speedup_over_first": base / med}
        print(f"cut {cut}: median {med:.0f} ms/block {[round(x) for x in v]}, x{base / med:.2f} of cut {cuts[0]}")
    if a.json:
        from streamdiff.platform.devices import cpu_model

        meta = {"cpu": cpu_model(), "nproc": os.cpu_count(), "size": a.size, "time": time.strftime("%Y-%m-%d %H:%M")}
        doc = {"meta": meta, "stages_ms": costs, "stage_shapes": shapes, "cuts": summary}
        Path(a.json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
