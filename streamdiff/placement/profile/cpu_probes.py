"""The CPU's own probes: the stages at one and two threads in interleaved cycles (and the VAE
cuts side by side), and the hybrid probe (a DiT at low priority beside a VAE shard)."""

from __future__ import annotations

import os
import time
import traceback

from ...spawn import torch_context, watched
from .harness import cpus_of, median, pin, result, run_children
from .probes import vae_child

ALONE_BLOCKS = 3  # the hybrid probe's DiT: blocks timed alone just before the shards start
# On a CPU of 2+ cores: cycles, each timing the one-thread DiT and VAE side by side, then the
# two-thread DiT, then the two-thread VAE, each for LEVEL_WINDOW_S (`levels`); every other
# cycle also the VAE cuts.
LEVEL_CYCLES = 4
LEVEL_WINDOW_S = 1.2
PROBE_BLOCKS = 2  # the VAE blocks a window must hold for a cut to be run side by side in it


def dit_beside_child(spec, device, cpus, size, stop, out) -> None:
    """The hybrid probe's DiT: below the shard on its core in priority (as a hybrid DiT runs),
    generating blocks until `stop` is set; its own time per block there."""
    try:
        from ...platform import for_device
        from ...platform.cpu import yield_cpu

        pin(device, cpus, 1)
        yield_cpu()
        from ...models.engines import DiTEngine

        eng = DiTEngine(spec, device, probe=True)
        fpb = eng.frames_per_block
        w, h = size
        sess = eng.open_session(w, h, seed=0)
        eng.set_scene(sess, "profile", new_shot=True)
        for _ in range(-(-sess.state.kv.window // fpb)):  # a full window, as in a stream
            eng.generate_block(sess, fpb)
        # Its time alone on the core, seconds before the shards start: the reference the probe's
        # share is taken against, at this minute's speed (the machine's drifts between rounds).
        clock = for_device(device).stopwatch(1)
        clock.start()
        for _ in range(ALONE_BLOCKS):
            eng.generate_block(sess, fpb)
        alone_ms = 1000 * clock.stop()[0] / ALONE_BLOCKS
        out.put(("ok", {"ready": True}))
        clock.start()
        blocks = 0
        while not stop.is_set():
            eng.generate_block(sess, fpb)
            blocks += 1
        wall, own = clock.stop()
        res = {"own_ms": 1000 * own / max(1, blocks), "wall_ms": 1000 * wall / max(1, blocks), "alone_ms": alone_ms}
        out.put(("ok", res))
    except Exception:
        out.put(("error", traceback.format_exc()))


def hybrid_probe(spec, sizes, ws, timeout_s: float) -> dict:
    """A 2-way VAE group decoding with a 1:3 split while a DiT runs beside shard 0 at low
    priority, as the hybrid layout runs: the DiT's own time per block there (sharing a core
    costs it more than its own work alone: the two switch at every halo exchange), its time per
    block at the rate it ran while the group decoded (`wall_ms`, from its CPU time over the
    group's steady blocks: `window`) and the group's time per block."""
    from ...supervisor.topology import free_port

    ctx = torch_context()
    res = {}
    for size in sizes:
        out, stop = ctx.Queue(), ctx.Event()
        dit = ctx.Process(
            target=watched,
            args=(os.getpid(), dit_beside_child, spec, "cpu", cpus_of(0, 1), size, stop, out),
            daemon=True,
        )
        dit.start()
        try:
            status, value = result(out, timeout_s)
            if status != "ok":
                raise RuntimeError(f"profiling failed:\n{value}")
            addr = f"tcp://127.0.0.1:{free_port()}"
            targets = [
                (vae_child, (spec, "cpu", cpus_of(r, 1), 1, r, 2, addr, [size], [(1.0, 3.0)], (), ws, dit.pid))
                for r in range(2)
            ]
            shards = [s["sizes"] for s in sorted(run_children(targets, timeout_s), key=lambda s: s["rank"])]
            stop.set()
            status, value = result(out, timeout_s)
            if status != "ok":
                raise RuntimeError(f"profiling failed:\n{value}")
        finally:
            stop.set()
            dit.join(timeout=30)
            if dit.is_alive():
                dit.kill()
        key = f"{size[0]}x{size[1]}"
        group = [s[key]["1:3"] for s in shards]
        # The DiT's time per block at the rate it ran while the group decoded its steady
        # blocks: its CPU time there over its own CPU time per block.
        seen = group[0].pop("watched")
        value["window"] = seen
        value["wall_ms"] = value["own_ms"] * seen["wall_ms"] / max(seen["cpu_ms"], 1e-3)
        res[key] = {"dit": value, "group": group}
    return res


def level_child(role, spec, sizes, working_set, cmds, out) -> None:
    """One stage's engine with a steady session per size; on each command (threads, cores, cut)
    it times steady blocks for LEVEL_WINDOW_S per size (after one untimed block: a new thread
    count is cold) and answers their median. With a cut c > 0, one thread, as a stage-cut
    layout runs its sides: the DiT its block and the decoder's first c stages, the VAE the
    stages from c on, from a steady block's activation, and the frames out."""
    try:
        pin("cpu", (), 1)
        import torch

        from ...models.engines import VAEEngine
        from ...models.wan.vae import decode_stages, decode_stages_sessions, decoder_stages, to_uint8_frames

        if role == "dit":
            from ...models.engines import DiTEngine

            eng = DiTEngine(spec, "cpu", probe=True)
            fpb, sessions, vae, vae_states = eng.frames_per_block, {}, None, {}
            for w, h in sizes:
                sess = sessions[(w, h)] = eng.open_session(w, h, seed=0)
                eng.set_scene(sess, "profile", new_shot=True)
                for _ in range(-(-sess.state.kv.window // fpb) + 1):  # a full window behind
                    eng.generate_block(sess, fpb)

            def block(size, cut):
                latent = eng.generate_block(sessions[size], fpb)
                if cut:  # as the DiT worker runs a cut (workers/dit_stage.py `_cut_stages`)
                    decode_stages_sessions(vae, latent, [vae_states[size]], 0, cut, fpb).float().cpu()
        else:
            eng = VAEEngine(spec, "cpu", working_set)  # decoded in the chunks the workers use
            p = eng.preset
            fpb, sf = p.sampler.frames_per_block, p.vae.spatial_factor
            g = torch.Generator().manual_seed(0)
            states = {size: eng.open_session() for size in sizes}
            shapes = {(w, h): (p.dit.out_channels, fpb, h // sf, w // sf) for w, h in sizes}
            plans = {size: eng.plan(shape, 1, 1) for size, shape in shapes.items()}
            acts: dict = {}  # (size, cut) -> a steady block's input to stage `cut`, and its own state
            n_stages = len(decoder_stages(eng.model)) if eng.decoder == "wan" else 0  # TAEHV: never cut

            def block(size, cut):
                if cut:  # as the VAE worker runs a cut (workers/vae_stage.py `_decode_rest`)
                    x, st = acts[(size, cut)]
                    y = decode_stages_sessions(eng.model, x, [st], cut, n_stages, fpb)
                    to_uint8_frames(y[0:1])
                    return
                z = torch.randn(1, *shapes[size], generator=g)
                eng.decode_blocks([states[size]], z, plans[size], 0, None, False)

            for size in sizes:
                block(size, 0)  # a shot's first block
        out.put(("ready", role))
        while (cmd := cmds.get()) is not None:
            threads, cpus, cut, tag = cmd
            if cpus:
                os.sched_setaffinity(0, cpus)
            torch.set_num_threads(threads)
            for size in sizes if cut else ():
                if role == "dit" and vae is None:
                    vae = VAEEngine(spec, "cpu", working_set).model
                if role == "dit" and size not in vae_states:
                    vae_states[size] = vae.new_state()
                if role == "vae" and (size, cut) not in acts:
                    # A steady block's input to stage `cut` (the shot's first block decoded first),
                    # and a state whose caches for the stages from `cut` on are steady.
                    st = eng.open_session()
                    for _ in range(2):  # both halves of a block see its frame count, then count it
                        x = decode_stages(eng.model, torch.randn(1, *shapes[size], generator=g), st, 0, cut, 0)
                        decode_stages(eng.model, x, st, cut, n_stages, fpb)
                    acts[(size, cut)] = (x, st)
            res = {}
            for size in sizes:
                block(size, cut)
                times, t_end = [], time.perf_counter() + LEVEL_WINDOW_S
                while time.perf_counter() < t_end:
                    t0 = time.perf_counter()
                    block(size, cut)
                    times.append(1000 * (time.perf_counter() - t0))
                res["{}x{}".format(*size)] = median(times)
            out.put(("ok", (role, tag, res)))
    except Exception:
        out.put(("error", traceback.format_exc()))


def level_windows(cycles: int, cuts=()) -> list[dict[str, tuple]]:
    """The interleaved cycles' windows in order, each {role: (threads, cores, cut, tag)} for the
    stages timed side by side in it: per cycle the one-thread DiT and VAE together (as
    disagg-1+1's workers are pinned; every other cycle once more per cut in `cuts`), then each
    stage alone on two threads (as agg-1x2t's worker is)."""
    out: list[dict[str, tuple]] = []
    for cycle in range(cycles):
        for cut in (0, *cuts) if cycle % 2 == 0 else (0,):
            out.append({"dit": (1, cpus_of(0, 1), cut, f"1/{cut}"), "vae": (1, cpus_of(1, 1), cut, f"1/{cut}")})
        out += [{role: (2, cpus_of(0, 2), 0, "2/0")} for role in ("dit", "vae")]
    return out


def levels(
    spec, sizes: list[tuple[int, int]], working_set: int, timeout_s: float, cuts=(), cycles: int = LEVEL_CYCLES
) -> dict:
    """Each stage's steady block at one and two threads, from the same minute.

    The thread rounds of `_measure_once` run one after the other, a minute or so apart, and this
    VM's speed drifts over such spans, which once chose the layout measured slowest
    (docs/placement.md#placement-placement). Here the one-thread DiT and VAE (side by side, as
    disagg-1+1 runs them) and each stage on two threads take turns for `cycles` cycles
    (`level_windows`), so a drift slows all four alike; the medians set each figure's level
    (`rescale`).

    Every other cycle also runs each of `cuts` side by side as a stage-cut layout runs it: the
    DiT with the decoder's first c stages, the VAE with the rest (`cuts` in the result: each
    side's block). The stages' own times misjudge a cut's two sides (the simulator's
    `Costs.cut_factors`). Small cuts
    move less than this VM's noise, so the two largest-signal cuts are run, not all."""
    ctx = torch_context()
    out = ctx.Queue()
    cmds = {r: ctx.Queue() for r in ("dit", "vae")}
    procs = [
        ctx.Process(
            target=watched, args=(os.getpid(), level_child, r, spec, sizes, working_set, cmds[r], out), daemon=True
        )
        for r in cmds
    ]
    for pr in procs:
        pr.start()
    got: dict[tuple[str, str], list[dict]] = {}

    def answers(n: int) -> None:
        for _ in range(n):
            status, value = result(out, timeout_s)
            if status == "error":
                raise RuntimeError(f"profiling failed:\n{value}")
            if status == "ok":
                role, tag, res = value
                got.setdefault((role, tag), []).append(res)

    try:
        answers(2)  # both ready
        for window in level_windows(cycles, cuts):
            for role, cmd in window.items():
                cmds[role].put(cmd)
            answers(len(window))
    finally:
        for q in cmds.values():
            q.put(None)
        for pr in procs:
            pr.join(timeout=30)
            if pr.is_alive():
                pr.kill()

    def level(role: str, tag: str, key: str) -> float:
        return median([r[key] for r in got[(role, tag)]])

    keys = ["{}x{}".format(*size) for size in sizes]
    return {
        key: {
            **{role: {str(t): level(role, f"{t}/0", key) for t in (1, 2)} for role in ("dit", "vae")},
            **({"cuts": {str(c): {r: level(r, f"1/{c}", key) for r in ("dit", "vae")} for c in cuts}} if cuts else {}),
        }
        for key in keys
    }


def _scaled(x, f: float):
    """Every time in a profile entry times f (band rows stay as they are)."""
    if isinstance(x, dict):
        return {k: v if k == "rows" else _scaled(v, f) for k, v in x.items()}
    if isinstance(x, list):
        return [_scaled(v, f) for v in x]
    return x * f if isinstance(x, float | int) and not isinstance(x, bool) else x


def rescale(res: dict, levels: dict) -> None:
    """Each thread round's DiT and VAE figures scaled so that their steady block is the level
    measured in the interleaved cycles: the rounds give each figure's shape (first block,
    batches, stages, the host beside), the cycles its level. The factors are kept beside."""
    for key, lv in levels.items():
        factors = {}
        for role in ("dit", "vae"):  # (the cut probes' blocks are at the level already)
            for t, level in lv[role].items():
                entry = res[key][role][t]
                f = level / entry["block_ms"]
                res[key][role][t] = _scaled(entry, f)
                factors[f"{role}{t}"] = round(f, 3)
        res[key]["levels"] = {**lv, "factors": factors}
