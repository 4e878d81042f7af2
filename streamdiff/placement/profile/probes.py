"""The probes that run on any device: a DiT (alone, in batches, beside the host's encoder on
the CPU, or as a rank of a DiT group), a VAE shard (alone or in a group), the host's encoder."""

from __future__ import annotations

import os
import time
import traceback
from functools import partial
from pathlib import Path

from ...config import PipelineConfig
from ...platform import for_device
from .harness import FIRST_BLOCKS, FIRST_IDLE_S, STEADY_BLOCKS, leave, measured_batches, median, pin

# A group probe's collective timeout: the workers' (pipeline.collective_timeout_s), which covers
# a rank that compiles cold while its peers wait in the first collective.
GROUP_TIMEOUT_S = PipelineConfig().collective_timeout_s


def dit_child(spec, device, cpus, threads, sizes, batches, rank, world, addr, host, out) -> None:
    """`host`: a queue to the host probe (`host_child`), which encodes a block each time the
    DiT starts one, on the DiT's cores (on the CPU the supervisor shares the DiT workers' cores,
    supervisor/core.py `_pin_self`): the DiT's time per block beside the encoder."""
    try:
        pin(device, cpus, threads)
        from ...models.engines import DiTEngine
        from ...parallel.dit_group import SeqParallel
        from ...parallel.vae_group import init_group

        plat = for_device(device)
        eng = DiTEngine(spec, device, probe=True)
        if world > 1:  # after the load, as a worker joins: a slow load is no peer's wait
            init_group(addr, rank, world, device, GROUP_TIMEOUT_S)
        heads = eng.model.cfg.num_heads
        sp = eng.model.parallel = SeqParallel(rank, world, heads, plat.wait_clock()) if world > 1 else None
        fpb = eng.frames_per_block
        clock = plat.stopwatch(threads)
        vae = None
        if host is not None and spec.decoder == "wan":  # one DiT on the CPU, where a cut's stages run (vae_cut)
            from ...models.engines import VAEEngine

            vae = VAEEngine(spec, device).model
        res = {}
        for w, h in sizes:

            def timed(fn):
                plat.sync()
                waited = sp.wait_s if sp else 0.0
                clock.start()
                fn()
                plat.sync()
                waited = (sp.wait_s if sp else 0.0) - waited
                wall, own = clock.stop(waited)
                return 1000 * wall, 1000 * own, 1000 * waited

            def shot_start(s):
                plat.idle(FIRST_IDLE_S)
                return timed(lambda: (eng.set_scene(s, "profile", new_shot=True), eng.generate_block(s, fpb)))[0]

            # One session held through the probe, the others one at a time (a batch's beside
            # it): what it holds at once is what the figures need, never a spare window.
            sess = eng.open_session(w, h, seed=0)
            eng.set_scene(sess, "warm up", new_shot=True)
            _, alone_t = plat.peak_during(lambda s=sess: eng.generate_block(s, fpb))  # cold: untimed
            shot_start(sess)
            # Blocks alone and beside the host alternate, so a machine whose speed drifts
            # within seconds slows both alike.
            steady, beside = [], []
            for i in range(STEADY_BLOCKS * (2 if host is not None else 1)):
                by_host = host is not None and i % 2 == 1
                if by_host:
                    host.put((w, h))
                (beside if by_host else steady).append(timed(lambda s=sess: eng.generate_block(s, fpb)))
            beside = [x[0] for x in beside]
            firsts = [shot_start(eng.open_session(w, h, seed=i)) for i in range(1, FIRST_BLOCKS + 1)]
            image_ms = _image_ms(eng, w, h, timed) if eng.card.i2v else None
            cut_stages = _cut_stages(vae, eng, sess, fpb, device) if vae is not None else None
            batch_ms, unfit = _batches(eng, plat, sess, w, h, batches, alone_t, timed)
            res[f"{w}x{h}"] = {
                "first_ms": median(firsts),
                "block_ms": median([x[0] for x in steady]),
                "own_ms": median([x[1] for x in steady]),
                "batch_ms": batch_ms,
            }
            if unfit:
                res[f"{w}x{h}"]["unfit_batches"] = unfit
            if beside:
                res[f"{w}x{h}"]["host_block_ms"] = median(beside)
            if image_ms is not None:
                res[f"{w}x{h}"]["image_ms"] = image_ms
            if cut_stages:
                res[f"{w}x{h}"]["cut_stages_ms"] = cut_stages
            if sp:
                res[f"{w}x{h}"]["collective_ms"] = median([x[2] for x in steady])
        out.put(("ok", {"stage": "dit", "rank": rank, "sizes": res}))
    except Exception:
        out.put(("error", traceback.format_exc()))
    finally:
        if host is not None:
            host.put(None)
        leave(world)


def _batches(eng, plat, sess, w: int, h: int, batches, alone_t: int, timed) -> tuple[dict[str, float], list[int]]:
    """Per-block ms in a batch of each size, `sess` and fresh sessions beside it, each batch's
    freed before the next; and the sizes that do not fit the device (`try_batch`: its other
    sessions' caches and its transients, `alone_t` a block's, times the batch)."""
    fpb = eng.frames_per_block

    def run(b: int) -> float:
        group = [sess]
        for i in range(b - 1):
            s = eng.open_session(w, h, seed=10 + i)
            group.append(s)
            eng.set_scene(s, "profile", new_shot=True)
            eng.generate_block(s, fpb)
        eng.generate_blocks(group, fpb)  # cold: a new batch shape
        return median([timed(lambda: eng.generate_blocks(group, fpb))[0] / b for _ in range(2)])

    return measured_batches(plat, batches, lambda b: (b - 1) * sess.nbytes + b * alone_t, run)


def _image_ms(eng, w: int, h: int, timed) -> float:
    """An image-to-video shot's start on the DiT's device, once a request, its conditioning's way
    (`DiTEngine.start_image`): the image encoded into the shot's first latent frame (and committed
    to the cache where it is a block of its own), or, for Matrix-Game, its CLIP tokens and first
    conditioning latent."""
    import torch

    img = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    runs = []
    for i in range(FIRST_BLOCKS):
        s = eng.open_session(w, h, seed=20 + i)
        eng.set_scene(s, "profile", new_shot=True)
        runs.append(timed(lambda s=s: eng.start_image(s, img))[0])
    return median(runs)


def _cut_stages(vae, eng, sess, fpb: int, device: str) -> list[float]:
    """Each decoder stage's time in the DiT's process, on the block its DiT has just made, so
    with its caches as the DiT leaves them: what a cut (the first c stages) adds to a DiT
    block, in this process, not in a VAE process that does nothing else."""
    import torch

    from ...models.wan.stage_times import stage_times
    from ...models.wan.vae import decode_stages, decoder_stages

    state = vae.new_state()
    with torch.no_grad():  # the stages' first block of a shot (cold, and a frame fewer): untimed
        decode_stages(vae, eng.generate_block(sess, fpb), state, 0, len(decoder_stages(vae)), fpb)
    return stage_times(vae, state, lambda: eng.generate_block(sess, fpb), device)


def host_child(cpus, sizes, fps, jobs, out) -> None:
    """The host probe: the supervisor's work per block (encoding a block of frames into a
    fragment) each time a (width, height) arrives on `jobs`, on the cores it is given."""
    try:
        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)
        import numpy as np

        from ...media.encoder import FragmentWriter, PyAVEncoder

        rng = np.random.default_rng(0)
        frames = {(w, h): rng.integers(0, 256, (12, h, w, 3), dtype=np.uint8) for w, h in sizes}
        writers = {(w, h): FragmentWriter(PyAVEncoder(w, h, fps), w, h, fps) for w, h in sizes}
        blocks = 0
        while (job := jobs.get()) is not None:
            writers[job].fragment(frames[job], idr_first=False)
            blocks += 1
        out.put(("ok", {"host_blocks": blocks}))
    except Exception:
        out.put(("error", traceback.format_exc()))


def cpu_seconds(pid: int) -> float:
    """CPU seconds a process has used so far, every thread of it, those that have exited too
    (/proc/PID/stat's utime + stime, in clock ticks: 10 ms here)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def vae_child(spec, device, cpus, threads, rank, world, addr, sizes, splits, batches, working_set, watch, out) -> None:
    """`watch`: a process beside rank 0 (the hybrid probe's DiT), whose CPU time rank 0 reads at
    the start and end of its steady blocks: what that process ran while the group decoded, and
    not while the shards started (which a timing over the shards' whole life would take in)."""
    try:
        pin(device, cpus, threads)
        import torch

        from ...models.engines import VAEEngine
        from ...models.wan.stage_times import stage_times
        from ...parallel.vae_group import ExchangeHalo, agreed_working_set, init_group

        plat = for_device(device)
        eng = VAEEngine(spec, device, working_set)
        if world > 1:  # after the load, as a worker joins; one decode plan for all the ranks
            init_group(addr, rank, world, device, GROUP_TIMEOUT_S)
            eng.working_set_bytes = agreed_working_set(eng.working_set_bytes, device)
        p = eng.preset
        fpb, sf = p.sampler.frames_per_block, p.vae.spatial_factor
        clock = plat.stopwatch(threads)
        g = torch.Generator().manual_seed(0)
        res = {}
        for w, h in sizes:
            per_split = {}
            for weights in splits:

                def decode(states, weights=weights, w=w, h=h):
                    z = torch.randn(len(states), p.dit.out_channels, fpb, h // sf, w // sf, generator=g)
                    plan = eng.plan(tuple(z.shape[1:]), world, len(states), weights)
                    halo = ExchangeHalo(rank, list(plan.bands), plat.wait_clock()) if world > 1 else None
                    plat.sync()
                    clock.start()
                    eng.decode_blocks(states, z, plan, rank, halo, False)
                    plat.sync()
                    wait = halo.wait_s if halo else 0.0
                    wall, own = clock.stop(wait)
                    r0, r1 = plan.bands[rank]
                    return 1000 * wall, 1000 * own, 1000 * wait, r1 - r0

                decode([eng.open_session()])  # cold
                state = eng.open_session()
                decode([state])  # its first block
                if watch and rank == 0:
                    t0, c0 = time.perf_counter(), cpu_seconds(watch)
                steady = [decode([state]) for _ in range(STEADY_BLOCKS)]
                watched = (
                    {"wall_ms": 1000 * (time.perf_counter() - t0), "cpu_ms": 1000 * (cpu_seconds(watch) - c0)}
                    if watch and rank == 0
                    else None
                )
                firsts, busy_firsts = [], []  # after idle (a worker that waited), and straight after work
                for _ in range(FIRST_BLOCKS):
                    busy_firsts.append(decode([eng.open_session()])[0])
                    plat.idle(FIRST_IDLE_S)
                    firsts.append(decode([eng.open_session()])[0])
                entry = {
                    "first_ms": median(firsts),
                    "first_busy_ms": median(busy_firsts),
                    "block_ms": median([x[0] for x in steady]),
                    "own_ms": median([x[1] for x in steady]),
                    "wait_ms": median([x[2] for x in steady]),
                    "rows": steady[0][3],
                }
                if watched:
                    entry["watched"] = watched
                if world == 1 and weights is None and eng.decoder == "wan":  # TAEHV is never cut
                    z = (1, p.dit.out_channels, fpb, h // sf, w // sf)
                    entry["stages_ms"] = stage_times(eng.model, state, partial(torch.randn, z, generator=g), device)
                if weights is None and batches:
                    # a batch only where its caches and transients fit (the pair's gate at the
                    # worker's, VAEStage.calibrate); a group probes no batch
                    _, alone_t = plat.peak_during(lambda s=state: decode([s]))

                    def run(b: int, decode=decode) -> float:
                        states = [eng.open_session() for _ in range(b)]
                        decode(states)  # each a shot's first block
                        decode(states)  # cold: a new shape
                        return median([decode(states)[0] / b for _ in range(2)])

                    need = lambda b, s=state, t=alone_t: b * (s.nbytes + t)  # noqa: E731
                    entry["batch_ms"], unfit = measured_batches(plat, batches, need, run)
                    if unfit:
                        entry["unfit_batches"] = unfit
                per_split["equal" if weights is None else ":".join(f"{x:g}" for x in weights)] = entry
            res[f"{w}x{h}"] = per_split
        out.put(("ok", {"stage": "vae", "rank": rank, "sizes": res}))
    except Exception:
        out.put(("error", traceback.format_exc()))
    finally:
        leave(world)


def encode_ms(
    width: int, height: int, fps: int, first_frames: int = 9, block_frames: int = 12, blocks: int = 1 + STEADY_BLOCKS
) -> dict:
    """libx264's time for a shot's first block (its frames: 1 + temporal factor x (frames per
    block - 1), an IDR) and for a steady block."""
    import numpy as np

    from ...media.encoder import PyAVEncoder

    enc = PyAVEncoder(width, height, fps)
    rng = np.random.default_rng(0)
    times = []
    for i in range(blocks):
        frames = rng.integers(0, 256, (first_frames if i == 0 else block_frames, height, width, 3), dtype=np.uint8)
        t0 = time.perf_counter()
        enc.encode(frames, idr_first=i == 0)
        times.append(1000 * (time.perf_counter() - t0))
    enc.close()
    return {"first_ms": times[0], "block_ms": median(times[1:])}
