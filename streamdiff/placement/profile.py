"""The profiler: what each stage costs on these devices (`streamdiffd profile`, and at start when
the planner has no fresh profile for this device kind, model and size).

Every figure is measured by the engines the workers run, in processes pinned as the workers
are (a CPU "device" is a core per thread), one measurement at a time so none competes:

- DiT: a shot's first block (prompt encoding, the first block's steps) and steady blocks, alone
  and per block in batches of 2 and 4 sessions; on the CPU also beside the host's work per
  block (the supervisor encodes on the DiT workers' cores);
- VAE: the same, whole height (k = 1), and each decoder stage's own time (what a cut between
  stages moves to the DiT, topology.vae_cut);
- VAE groups of k = 2 .. min(devices, 4) shards over the real collective (gloo, nccl, xccl): the
  group's time per block, each shard's own work and its waits for neighbours, with equal bands
  and, for k = 2, with a 1:3 split, so a shard's cost is known as front + rows x per-row cost;
- on the CPU, the DiT and VAE at 2 threads (the aggregated layouts give a worker two cores);
- on the CPU, the hybrid probe: a DiT at low priority beside shard 0 of a decoding 2-way group,
  its own time per block there (sharing a core costs more than its work alone);
- DiT groups of g = 2 .. min(devices, 4, heads) ranks (Ulysses, parallel/dit_group.py) over the
  real collective: rank 0's time per block, alone and in batches of 2, its own work and its time
  inside the all-to-alls (the link's cost, and what the planner weighs against 1/g of the work);
- the encoder (libx264) per block.

The result is plain JSON (`Profile.to_json`); `docs/profile-cpu.json` is this project's CPU.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
import traceback
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from ..spawn import spawn_context

VERSION = 1
FRESH_S = 30 * 86400  # a cached profile older than this is measured again
STEADY_BLOCKS = 6  # steady blocks timed per measurement (after a shot's first): the DiT's window fills
GROUP_SIZES_MAX = 4
ALONE_BLOCKS = 3  # the hybrid probe's DiT: blocks timed alone just before the shards start
# A shot's first block is timed on this many fresh sessions after the steady blocks, as a worker
# meets one, and their median kept: timed just after the cold block, the VAE's first blocks took
# 216-236 ms on the EPYC, and 174-179 after steady ones, as the daemon's (174-175).
FIRST_BLOCKS = 3
# ... each after this long idle, as a worker meets a new request: on two threads a first block
# took 119-128 ms after 0.3 s idle and 102-105 straight after other blocks (one thread: no
# difference), and the daemon's two-thread workers sharing both cores took 111-125.
FIRST_IDLE_S = 0.3
# On a CPU of 2+ cores: cycles, each timing the one-thread DiT and VAE side by side, then the
# two-thread DiT, then the two-thread VAE, each for LEVEL_WINDOW_S (`_levels`); every other
# cycle also the VAE cuts.
LEVEL_CYCLES = 4
LEVEL_WINDOW_S = 1.2
PROBE_BLOCKS = 2  # the VAE blocks a window must hold for a cut to be run side by side in it


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_count(kind: str) -> int:
    """Devices this daemon may use: cores it may run on (CPU), or visible accelerators."""
    if kind == "cpu":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    import torch

    mod = getattr(torch, kind)
    return mod.device_count() if mod.is_available() else 0


def device_memory(kind: str) -> int:
    """One accelerator's total memory in bytes; 0 on the CPU or where the runtime does not say."""
    if kind == "cpu":
        return 0
    import torch

    mod = getattr(torch, kind, None)
    if mod is None or not mod.is_available() or not hasattr(mod, "get_device_properties"):
        return 0
    return int(mod.get_device_properties(0).total_memory)


def device_name(kind: str) -> str:
    if kind == "cpu":
        return cpu_model()
    import torch

    return getattr(torch, kind).get_device_name(0)


@dataclass
class Profile:
    """Measured costs, in ms, per frame size "WxH"."""

    device: str  # cpu | cuda | xpu
    device_name: str
    devices: int
    preset: str
    model: dict  # what else identifies the model (dtype, tiny's dit_vae_ratio, the weights' path)
    sizes: dict = field(default_factory=dict)
    created: float = 0.0
    version: int = VERSION
    memory_bytes: int = 0  # one device's memory (accelerators; 0: not known), what a model must fit (cost.py)

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"not a version-{VERSION} streamdiff profile")
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        missing = {"device", "devices", "preset", "sizes"} - set(fields)
        if missing:
            raise ValueError(f"a profile without {', '.join(sorted(missing))}")
        fields.setdefault("device_name", "")
        fields.setdefault("model", {})
        return cls(**fields)

    def size(self, width: int, height: int) -> dict:
        key = f"{width}x{height}"
        if key not in self.sizes:
            raise KeyError(f"the profile has no figures at {key} (it has {', '.join(self.sizes) or 'none'})")
        return self.sizes[key]


def model_key(cfg) -> dict:
    m = cfg.model
    key = {"dtype": m.dtype, "path": m.path, "dit_checkpoint": m.dit_checkpoint}
    if m.lora:
        key["lora"] = m.lora
    if m.preset in ("tiny", "tiny-random"):
        key["dit_vae_ratio"] = m.dit_vae_ratio
    if m.decoder != "wan":  # the decoder measured (profiles of the Wan VAE keep their old key)
        key["decoder"], key["decoder_weights"] = m.decoder, m.decoder_weights
    return key


def cache_path(state_dir: str, cfg, size: tuple[int, int]) -> Path:
    t = cfg.topology
    dec = "" if cfg.model.decoder == "wan" else f"-{cfg.model.decoder}"
    name = f"profile-{t.device}-{cfg.model.preset}{dec}-{size[0]}x{size[1]}.json"
    return Path(state_dir) / name


def load_cached(path: Path, cfg, size: tuple[int, int], devices: int, now: float | None = None) -> Profile | None:
    """The cached profile if it is fresh and measured for this device, model and size, on at
    least `devices` devices."""
    try:
        prof = Profile.from_json(path.read_text())
    except (OSError, ValueError):
        return None
    now = time.time() if now is None else now
    ok = (
        prof.device == cfg.topology.device
        and prof.preset == cfg.model.preset
        and prof.model == model_key(cfg)
        and prof.device_name == device_name(cfg.topology.device)
        and prof.devices >= devices
        and f"{size[0]}x{size[1]}" in prof.sizes
        and now - prof.created < FRESH_S
    )
    return prof if ok else None


# ----------------------------------------------------------------------------- measuring


def _pin(device: str, cpus: tuple[int, ...], threads: int) -> None:
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    import torch

    torch.set_num_threads(threads)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _dit_child(spec, device, cpus, threads, sizes, batches, rank, world, addr, host, out) -> None:
    """`host`: a queue to the host probe (`_host_child`), which encodes a block each time the
    DiT starts one, on the DiT's cores (on the CPU the supervisor shares the DiT workers' cores,
    supervisor/core.py `_pin_self`): the DiT's time per block beside the encoder."""
    try:
        _pin(device, cpus, threads)
        from ..models.engines import DiTEngine
        from ..parallel.dit_group import SeqParallel
        from ..parallel.vae_group import init_group
        from ..workers.stages import Stopwatch, _sync

        if world > 1:
            init_group(addr, rank, world, device, 120.0)
        eng = DiTEngine(spec, device, probe=True)
        sp = eng.model.parallel = SeqParallel(rank, world, eng.model.cfg.num_heads) if world > 1 else None
        fpb = eng.frames_per_block
        clock = Stopwatch(device, threads)
        vae = None
        if host is not None and spec.decoder == "wan":  # one DiT on the CPU, where a cut's stages run (vae_cut)
            from ..models.engines import VAEEngine

            vae = VAEEngine(spec, device).model
        res = {}
        for w, h in sizes:

            def timed(fn):
                _sync(device)
                waited = sp.wait_s if sp else 0.0
                clock.start()
                fn()
                _sync(device)
                waited = (sp.wait_s if sp else 0.0) - waited
                wall, own = clock.stop(waited)
                return 1000 * wall, 1000 * own, 1000 * waited

            warm = eng.open_session(w, h, seed=99)  # the first forward at a size is cold
            eng.set_scene(warm, "warm up", cut=True)
            eng.generate_block(warm, fpb)

            def shot_start(s):
                time.sleep(FIRST_IDLE_S)
                return timed(lambda: (eng.set_scene(s, "profile", cut=True), eng.generate_block(s, fpb)))[0]

            sess = eng.open_session(w, h, seed=0)
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
            image_ms = _image_ms(eng, w, h, timed) if eng.i2v else None
            cut_stages = _cut_stages(vae, eng, sess, fpb, device) if vae is not None else None
            batch_ms = {}
            for b in batches:
                group = [eng.open_session(w, h, seed=10 + i) for i in range(b)]
                for s in group:
                    eng.set_scene(s, "profile", cut=True)
                    eng.generate_block(s, fpb)
                eng.generate_blocks(group, fpb)  # cold: a new batch shape
                runs = [timed(lambda g=group: eng.generate_blocks(g, fpb))[0] / b for _ in range(2)]
                batch_ms[str(b)] = _median(runs)
            res[f"{w}x{h}"] = {
                "first_ms": _median(firsts),
                "block_ms": _median([x[0] for x in steady]),
                "own_ms": _median([x[1] for x in steady]),
                "batch_ms": batch_ms,
            }
            if beside:
                res[f"{w}x{h}"]["host_block_ms"] = _median(beside)
            if image_ms is not None:
                res[f"{w}x{h}"]["image_ms"] = image_ms
            if cut_stages:
                res[f"{w}x{h}"]["cut_stages_ms"] = cut_stages
            if sp:
                res[f"{w}x{h}"]["collective_ms"] = _median([x[2] for x in steady])
        out.put(("ok", {"stage": "dit", "rank": rank, "sizes": res}))
    except Exception:
        out.put(("error", traceback.format_exc()))
    finally:
        if host is not None:
            host.put(None)
        _leave(world)


def _image_ms(eng, w: int, h: int, timed) -> float:
    """An image-to-video shot's first block on the DiT's device: the image encoded into the shot's
    first latent frame and committed to the cache (`DiTEngine.start_from_image`): once a request."""
    import torch

    img = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    runs = []
    for i in range(FIRST_BLOCKS):
        s = eng.open_session(w, h, seed=20 + i)
        eng.set_scene(s, "profile", cut=True)
        runs.append(timed(lambda s=s: eng.start_from_image(s, img))[0])
    return _median(runs)


def _cut_stages(vae, eng, sess, fpb: int, device: str) -> list[float]:
    """Each decoder stage's time in the DiT's process, on the block its DiT has just made, so
    with its caches as the DiT leaves them: what a cut (the first c stages) adds to a DiT
    block, in this process, not in a VAE process that does nothing else."""
    import torch

    from ..models.wan.vae import decode_stages, decoder_stages

    state = vae.new_state()
    with torch.no_grad():  # the stages' first block of a shot (cold, and a frame fewer): untimed
        decode_stages(vae, eng.generate_block(sess, fpb), state, 0, len(decoder_stages(vae)), fpb)
    return stage_times(vae, state, lambda: eng.generate_block(sess, fpb), device)


def _host_child(cpus, sizes, fps, jobs, out) -> None:
    """The host probe: the supervisor's work per block (encoding a block of frames into a
    fragment) each time a (width, height) arrives on `jobs`, on the cores it is given."""
    try:
        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)
        import numpy as np

        from ..media.encoder import FragmentWriter, PyAVEncoder

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


def _leave(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _dit_beside_child(spec, device, cpus, size, stop, out) -> None:
    """The hybrid probe's DiT: below the shard on its core in priority (as a hybrid DiT runs),
    generating blocks until `stop` is set; its own time per block there."""
    try:
        from ..workers.main import _yield_cpu

        _pin(device, cpus, 1)
        _yield_cpu()
        from ..models.engines import DiTEngine
        from ..workers.stages import Stopwatch

        eng = DiTEngine(spec, device, probe=True)
        fpb = eng.frames_per_block
        w, h = size
        sess = eng.open_session(w, h, seed=0)
        eng.set_scene(sess, "profile", cut=True)
        for _ in range(-(-sess.state.kv.window // fpb)):  # a full window, as in a stream
            eng.generate_block(sess, fpb)
        # Its time alone on the core, seconds before the shards start: the reference the probe's
        # share is taken against, at this minute's speed (the machine's drifts between rounds).
        clock = Stopwatch(device, 1)
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


def _hybrid_probe(spec, sizes, ws, timeout_s: float) -> dict:
    """A 2-way VAE group decoding with a 1:3 split while a DiT runs beside shard 0 at low
    priority, as the hybrid layout runs: the DiT's own time per block there (sharing a core
    costs it more than its own work alone: the two switch at every halo exchange), its time per
    block at the rate it ran while the group decoded (`wall_ms`, from its CPU time over the
    group's steady blocks: `window`) and the group's time per block."""
    from ..supervisor.topology import free_port

    ctx = spawn_context()
    res = {}
    for size in sizes:
        out, stop = ctx.Queue(), ctx.Event()
        dit = ctx.Process(target=_dit_beside_child, args=(spec, "cpu", _cpus(0, 1), size, stop, out), daemon=True)
        dit.start()
        try:
            status, value = out.get(timeout=timeout_s)
            if status != "ok":
                raise RuntimeError(f"profiling failed:\n{value}")
            addr = f"tcp://127.0.0.1:{free_port()}"
            targets = [
                (_vae_child, (spec, "cpu", _cpus(r, 1), 1, r, 2, addr, [size], [(1.0, 3.0)], (), ws, dit.pid))
                for r in range(2)
            ]
            shards = [s["sizes"] for s in sorted(_run(targets, timeout_s), key=lambda s: s["rank"])]
            stop.set()
            status, value = out.get(timeout=timeout_s)
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


def cpu_seconds(pid: int) -> float:
    """CPU seconds a process has used so far, every thread of it, those that have exited too
    (/proc/PID/stat's utime + stime, in clock ticks: 10 ms here)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _vae_child(spec, device, cpus, threads, rank, world, addr, sizes, splits, batches, working_set, watch, out) -> None:
    """`watch`: a process beside rank 0 (the hybrid probe's DiT), whose CPU time rank 0 reads at
    the start and end of its steady blocks: what that process ran while the group decoded, and
    not while the shards started (which a timing over the shards' whole life would take in)."""
    try:
        _pin(device, cpus, threads)
        import torch

        from ..models.engines import VAEEngine
        from ..parallel.vae_group import ExchangeHalo, init_group
        from ..workers.stages import Stopwatch, _sync

        if world > 1:
            init_group(addr, rank, world, device, 120.0)
        eng = VAEEngine(spec, device, working_set)
        p = eng.preset
        fpb, sf = p.sampler.frames_per_block, p.vae.spatial_factor
        clock = Stopwatch(device, threads)
        g = torch.Generator().manual_seed(0)
        res = {}
        for w, h in sizes:
            per_split = {}
            for weights in splits:

                def decode(states, weights=weights, w=w, h=h):
                    z = torch.randn(len(states), p.dit.in_channels, fpb, h // sf, w // sf, generator=g)
                    plan = eng.plan(tuple(z.shape[1:]), world, len(states), weights)
                    halo = ExchangeHalo(rank, list(plan.bands)) if world > 1 else None
                    _sync(device)
                    clock.start()
                    eng.decode_blocks(states, z, plan, rank, halo, False)
                    _sync(device)
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
                    time.sleep(FIRST_IDLE_S)
                    firsts.append(decode([eng.open_session()])[0])
                entry = {
                    "first_ms": _median(firsts),
                    "first_busy_ms": _median(busy_firsts),
                    "block_ms": _median([x[0] for x in steady]),
                    "own_ms": _median([x[1] for x in steady]),
                    "wait_ms": _median([x[2] for x in steady]),
                    "rows": steady[0][3],
                }
                if watched:
                    entry["watched"] = watched
                if world == 1 and weights is None and eng.decoder == "wan":  # TAEHV is never cut
                    z = (1, p.dit.in_channels, fpb, h // sf, w // sf)
                    entry["stages_ms"] = stage_times(eng.model, state, partial(torch.randn, z, generator=g), device)
                if weights is None and batches:
                    entry["batch_ms"] = {}
                    for b in batches:
                        states = [eng.open_session() for _ in range(b)]
                        decode(states)  # each a shot's first block
                        decode(states)  # cold: a new shape
                        entry["batch_ms"][str(b)] = _median([decode(states)[0] / b for _ in range(2)])
                per_split["equal" if weights is None else ":".join(f"{x:g}" for x in weights)] = entry
            res[f"{w}x{h}"] = per_split
        out.put(("ok", {"stage": "vae", "rank": rank, "sizes": res}))
    except Exception:
        out.put(("error", traceback.format_exc()))
    finally:
        _leave(world)


def stage_times(vae, state, next_input, device: str, runs: int = 3) -> list[float]:
    """Each decoder stage's own time on a steady block (vae.decoder_stages; the median of
    `runs`), on the stage-0 input `next_input()` gives (not timed): what a cut between stages
    moves to the DiT (topology.vae_cut). On the CPU the process's CPU time per thread, as
    `Stopwatch` counts a stage's own work."""
    import torch

    from ..models.wan.vae import Ctx, decoder_stages
    from ..workers.stages import _sync

    stages = decoder_stages(vae)
    times: list[list[float]] = [[] for _ in stages]
    cpu = torch.device(device).type == "cpu"
    threads = torch.get_num_threads() if cpu else 1
    with torch.no_grad():
        for _ in range(runs):
            x, ctx = next_input(), Ctx(state)
            frames = x.shape[2]
            for i, stage in enumerate(stages):
                _sync(device)
                t0 = time.process_time() if cpu else time.perf_counter()
                x = stage(x, ctx)
                _sync(device)
                times[i].append(1000 * ((time.process_time() if cpu else time.perf_counter()) - t0) / threads)
            state.latent_frames += frames
    return [_median(t) for t in times]


def _level_child(role, spec, sizes, working_set, cmds, out) -> None:
    """One stage's engine with a steady session per size; on each command (threads, cores, cut)
    it times steady blocks for LEVEL_WINDOW_S per size (after one untimed block: a new thread
    count is cold) and answers their median. With a cut c > 0, one thread, as a stage-cut
    layout runs its sides: the DiT its block and the decoder's first c stages, the VAE the
    stages from c on, from a steady block's activation, and the frames out."""
    try:
        _pin("cpu", (), 1)
        import torch

        from ..models.engines import VAEEngine
        from ..models.wan.vae import decode_stages, decode_stages_sessions, decoder_stages, to_uint8_frames

        if role == "dit":
            from ..models.engines import DiTEngine

            eng = DiTEngine(spec, "cpu", probe=True)
            fpb, sessions, vae, vae_states = eng.frames_per_block, {}, None, {}
            for w, h in sizes:
                sess = sessions[(w, h)] = eng.open_session(w, h, seed=0)
                eng.set_scene(sess, "profile", cut=True)
                for _ in range(-(-sess.state.kv.window // fpb) + 1):  # a full window behind
                    eng.generate_block(sess, fpb)

            def block(size, cut):
                latent = eng.generate_block(sessions[size], fpb)
                if cut:  # as the DiT worker runs a cut (workers/stages.py `_cut_stages`)
                    decode_stages_sessions(vae, latent, [vae_states[size]], 0, cut, fpb).float().cpu()
        else:
            eng = VAEEngine(spec, "cpu", working_set)  # decoded in the chunks the workers use
            p = eng.preset
            fpb, sf = p.sampler.frames_per_block, p.vae.spatial_factor
            g = torch.Generator().manual_seed(0)
            states = {size: eng.open_session() for size in sizes}
            shapes = {(w, h): (p.dit.in_channels, fpb, h // sf, w // sf) for w, h in sizes}
            plans = {size: eng.plan(shape, 1, 1) for size, shape in shapes.items()}
            acts: dict = {}  # (size, cut) -> a steady block's input to stage `cut`, and its own state
            n_stages = len(decoder_stages(eng.model)) if eng.decoder == "wan" else 0  # TAEHV: never cut

            def block(size, cut):
                if cut:  # as the VAE worker runs a cut (workers/stages.py `_decode_rest`)
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
                res["{}x{}".format(*size)] = _median(times)
            out.put(("ok", (role, tag, res)))
    except Exception:
        out.put(("error", traceback.format_exc()))


def offered_cuts(stages_ms: list[float]) -> tuple[int, ...]:
    """The VAE cuts worth planning from the decoder's stage times: up to half the VAE (past that
    the DiT's device does more of the decoding than the VAE's)."""
    return tuple(c for c in range(1, len(stages_ms)) if sum(stages_ms[:c]) <= 0.5 * sum(stages_ms))


def _levels(spec, sizes: list[tuple[int, int]], working_set: int, timeout_s: float, cuts=()) -> dict:
    """Each stage's steady block at one and two threads, from the same minute.

    The thread rounds of `_measure_once` run one after the other, a minute or so apart, and this
    VM's speed drifts over such spans: one profile had the VAE 2.35 times as fast on two threads
    as on one, and planned agg-1x2t, the layout measured slowest. Here the one-thread DiT and VAE
    (side by side, as disagg-1+1 runs them) and each stage on two threads take turns for
    LEVEL_CYCLES cycles, so a drift slows all four alike; the medians set each figure's level
    (`_rescale`).

    Every other cycle also runs each of `cuts` side by side as a stage-cut layout runs it: the
    DiT with the decoder's first c stages, the VAE with the rest (`cuts` in the result: each
    side's block). The stages' own times misjudge a cut's two sides: on the 2-vCPU EPYC, over
    cuts 1-7, the DiT's side grew by 1.31 times the stages' time in its process and the VAE's
    fell by 0.80 times their share of a decode (the simulator's `Costs.cut_factors`). Small cuts
    move less than this VM's noise, so the two largest-signal cuts are run, not all."""
    ctx = spawn_context()
    out = ctx.Queue()
    cmds = {r: ctx.Queue() for r in ("dit", "vae")}
    procs = [
        ctx.Process(target=_level_child, args=(r, spec, sizes, working_set, cmds[r], out), daemon=True) for r in cmds
    ]
    for pr in procs:
        pr.start()
    got: dict[tuple[str, str], list[dict]] = {}

    def answers(n: int) -> None:
        for _ in range(n):
            status, value = out.get(timeout=timeout_s)
            if status == "error":
                raise RuntimeError(f"profiling failed:\n{value}")
            if status == "ok":
                role, tag, res = value
                got.setdefault((role, tag), []).append(res)

    try:
        answers(2)  # both ready
        for cycle in range(LEVEL_CYCLES):
            for cut in (0, *cuts) if cycle % 2 == 0 else (0,):
                cmds["dit"].put((1, _cpus(0, 1), cut, f"1/{cut}"))  # as disagg-1+1's workers are pinned
                cmds["vae"].put((1, _cpus(1, 1), cut, f"1/{cut}"))
                answers(2)
            for role in ("dit", "vae"):  # as agg-1x2t's worker is
                cmds[role].put((2, _cpus(0, 2), 0, "2/0"))
                answers(1)
    finally:
        for q in cmds.values():
            q.put(None)
        for pr in procs:
            pr.join(timeout=30)
            if pr.is_alive():
                pr.kill()

    def level(role: str, tag: str, key: str) -> float:
        return _median([r[key] for r in got[(role, tag)]])

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


def _rescale(res: dict, levels: dict) -> None:
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


def _run(targets: list[tuple], timeout_s: float) -> list:
    """Start one process per (fn, args), wait for each one's result; raise on any error."""
    ctx = spawn_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(*args, out), daemon=True) for fn, args in targets]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in procs:
            status, value = out.get(timeout=timeout_s)
            if status != "ok":
                raise RuntimeError(f"profiling failed:\n{value}")
            results.append(value)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results


def _cpus(device: int, threads: int) -> tuple[int, ...]:
    """The cores a worker on this device index is pinned to (as the daemon pins them)."""
    from ..supervisor.topology import _cpus as worker_cpus

    return worker_cpus(device, threads, True)


def _heads(spec) -> int:
    from ..models.presets import get_preset

    return get_preset(spec).dit.num_heads


def _encode_ms(
    width: int, height: int, fps: int, first_frames: int = 9, block_frames: int = 12, blocks: int = 1 + STEADY_BLOCKS
) -> dict:
    """libx264's time for a shot's first block (its frames: 1 + temporal factor x (frames per
    block - 1), an IDR) and for a steady block."""
    import numpy as np

    from ..media.encoder import PyAVEncoder

    enc = PyAVEncoder(width, height, fps)
    rng = np.random.default_rng(0)
    times = []
    for i in range(blocks):
        frames = rng.integers(0, 256, (first_frames if i == 0 else block_frames, height, width, 3), dtype=np.uint8)
        t0 = time.perf_counter()
        enc.encode(frames, idr_first=i == 0)
        times.append(1000 * (time.perf_counter() - t0))
    enc.close()
    return {"first_ms": times[0], "block_ms": _median(times[1:])}


def merge(rounds: list):
    """Figures measured in several rounds -> their medians (band rows and the like as measured)."""
    first = rounds[0]
    if isinstance(first, dict):
        return {k: merge([r[k] for r in rounds]) for k in first}
    if isinstance(first, list):
        return [merge([r[i] for r in rounds]) for i in range(len(first))]
    if isinstance(first, float):
        return _median(rounds)
    return first


class Progress:
    """What the profile measures now, how far it is, and about how long is left (a first start
    with no cached profile otherwise says nothing between "measuring" and "done")."""

    def __init__(self, total: int, log) -> None:
        self.total, self.done, self.log, self.t0 = total, 0, log, time.perf_counter()

    def step(self, what: str) -> None:
        elapsed = time.perf_counter() - self.t0
        left = f", about {elapsed / self.done * (self.total - self.done):.0f}s left" if self.done else ""
        self.log(f"profile: [{self.done + 1}/{self.total}] {what} ({elapsed:.0f}s in{left})")
        self.done += 1


def _threads(kind: str, n: int) -> list[int]:
    """Thread counts a worker is measured at: on a CPU of 2+ cores, also 2 (the aggregated and
    shared layouts run a stage on both)."""
    return [1, 2] if kind == "cpu" and n >= 2 else [1]


def _probe_count(spec, kind: str, n: int) -> int:
    """The probes of one round, as `_measure_once` runs them."""
    threads, sharded = _threads(kind, n), spec.decoder == "wan"  # TAEHV: no VAE groups, no hybrid
    return (
        len(threads)
        + (len(threads) > 1)  # the levels
        + max(0, min(n, GROUP_SIZES_MAX, _heads(spec)) - 1)  # DiT groups
        + sharded * max(0, min(n, GROUP_SIZES_MAX) - 1)  # VAE groups
        + (kind == "cpu" and n >= 2 and sharded)  # the hybrid
        + 1  # the encoder
    )


def measure(cfg, sizes: list[tuple[int, int]], rounds: int = 1, log=print, timeout_s: float = 900.0) -> Profile:
    """Measure every figure the planner and the simulator use on the devices of
    `cfg.topology.device`; with several rounds, each figure is the median of its rounds (the
    rounds interleave, so a machine whose speed drifts is sampled across the drift)."""
    kind = cfg.topology.device
    n = device_count(kind)
    if n < 1:
        raise RuntimeError(f"no {kind} device visible")
    prof = Profile(kind, device_name(kind), n, cfg.model.preset, model_key(cfg), created=time.time())
    prof.memory_bytes = device_memory(kind)
    from ..supervisor.topology import model_spec

    progress = Progress(rounds * _probe_count(model_spec(cfg), kind, n), log)
    results = []
    for r in range(rounds):
        results.append(_measure_once(cfg, kind, n, sizes, timeout_s, progress))
        log(f"profile: round {r + 1} of {rounds} done after {time.perf_counter() - progress.t0:.0f}s")
    prof.sizes = merge(results)
    return prof


def _measure_once(cfg, kind: str, n: int, sizes: list[tuple[int, int]], timeout_s: float, progress: Progress) -> dict:
    from ..supervisor.topology import free_port, model_facts, model_spec

    spec, facts = model_spec(cfg), model_facts(cfg)
    ws = cfg.pipeline.vae_cpu_working_set_bytes
    dev = (lambda i: "cpu") if kind == "cpu" else (lambda i: f"{kind}:{i}")
    threads = _threads(kind, n)
    at = ", ".join(f"{w}x{h}" for w, h in sizes)
    res: dict[str, dict] = {f"{w}x{h}": {"dit": {}, "vae": {}, "vae_group": {}, "dit_group": {}} for w, h in sizes}
    for t in threads:
        cpus = _cpus(0, t) if kind == "cpu" else ()
        # One thread each on a CPU with two cores: the VAE at the same time as the DiT, on the
        # next core, as disagg-1+1 runs them. Measured minutes apart, a machine whose speed
        # drifts skewed their ratio, which is what a cut or a hybrid band is chosen by.
        together = kind == "cpu" and t == 1 and n >= 2
        both = "side by side" if together else "one after the other"
        progress.step(f"the DiT's and the VAE's blocks on {t} thread{'s' if t > 1 else ''}, {both}, at {at}")
        vae_cpus = _cpus(1, 1) if together else cpus
        vae_child = (_vae_child, (spec, dev(0), vae_cpus, t, 0, 1, "", sizes, [None], (2,), ws, 0))
        if kind == "cpu":  # the DiT beside the host's work per block, on the same cores
            jobs = spawn_context().Queue()
            targets = [
                (_dit_child, (spec, dev(0), cpus, t, sizes, (2, 4), 0, 1, "", jobs)),
                (_host_child, (cpus, sizes, 16, jobs)),
                *([vae_child] if together else []),
            ]
        else:
            targets = [(_dit_child, (spec, dev(0), cpus, t, sizes, (2, 4), 0, 1, "", None))]
        done = {x["stage"]: x for x in _run(targets, timeout_s) if "stage" in x}
        dit = done["dit"]
        vae = done["vae"] if "vae" in done else _run([vae_child], timeout_s)[0]
        for key in res:
            res[key]["dit"][str(t)] = dit["sizes"][key]
            res[key]["vae"][str(t)] = vae["sizes"][key]["equal"]
    if len(threads) > 1:
        # Cuts are run side by side where a window holds a few of the VAE's blocks: one block
        # is noise, and the real VAE on a CPU (10 s a block) would add minutes for it.
        offered = sorted({c for key in res for c in offered_cuts(res[key]["vae"]["1"].get("stages_ms") or [])})
        quick = max(res[key]["vae"]["1"]["block_ms"] for key in res) * PROBE_BLOCKS <= 1000 * LEVEL_WINDOW_S
        probes = sorted({offered[-1], offered[(len(offered) - 1) // 2]}) if offered and quick else []
        progress.step("the levels: 1- and 2-thread stages in interleaved cycles" + (" and cuts" if probes else ""))
        _rescale(res, _levels(spec, sizes, ws, timeout_s, tuple(probes)))
    for g in range(2, min(n, GROUP_SIZES_MAX, _heads(spec)) + 1):
        progress.step(f"a DiT group of {g} ranks over the real collective")
        addr = f"tcp://127.0.0.1:{free_port()}"
        targets = [
            (_dit_child, (spec, dev(r), _cpus(r, 1) if kind == "cpu" else (), 1, sizes, (2,), r, g, addr, None))
            for r in range(g)
        ]
        rank0 = next(x for x in _run(targets, timeout_s) if x["rank"] == 0)
        for key in res:
            res[key]["dit_group"][str(g)] = rank0["sizes"][key]
    whole = spec.decoder != "wan"  # TAEHV is never sharded: no VAE groups, no hybrid
    for k in range(2, 1 if whole else min(n, GROUP_SIZES_MAX) + 1):
        addr = f"tcp://127.0.0.1:{free_port()}"
        splits = [None, (1.0, 3.0)] if k == 2 else [None]
        progress.step(f"a VAE group of {k} shards over the real collective")
        targets = [
            (_vae_child, (spec, dev(r), _cpus(r, 1) if kind == "cpu" else (), 1, r, k, addr, sizes, splits, (), ws, 0))
            for r in range(k)
        ]
        shards = [s["sizes"] for s in sorted(_run(targets, timeout_s), key=lambda s: s["rank"])]
        for key in res:
            res[key]["vae_group"][str(k)] = {split: [s[key][split] for s in shards] for split in shards[0][key]}
    if kind == "cpu" and n >= 2 and not whole:
        progress.step("the hybrid: a DiT below a VAE shard on its core")
        for key, probe in _hybrid_probe(spec, sizes, ws, timeout_s).items():
            res[key]["hybrid"] = probe
    progress.step("libx264's time per block")
    for w, h in sizes:
        fpb, tf = facts["frames_per_block"], facts["temporal_factor"]
        res[f"{w}x{h}"]["encode"] = _encode_ms(w, h, 16, 1 + tf * (fpb - 1), tf * fpb)
    return res
