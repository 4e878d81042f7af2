"""A round of probes on the devices of one kind, and several rounds merged."""

from __future__ import annotations

import time

from ...platform.devices import device_count, device_memory, device_name
from ...spawn import torch_context
from .cpu_probes import LEVEL_CYCLES, LEVEL_WINDOW_S, PROBE_BLOCKS, hybrid_probe, levels, rescale
from .harness import GROUP_SIZES_MAX, cpus_of, heads_of, median, run_children
from .probes import dit_child, encode_ms, host_child, vae_child
from .schema import Profile, model_key, offered_cuts


def merge(rounds: list):
    """Figures measured in several rounds -> their medians (band rows and the like as measured)."""
    first = rounds[0]
    if isinstance(first, dict):
        return {k: merge([r[k] for r in rounds]) for k in first}
    if isinstance(first, list):
        return [merge([r[i] for r in rounds]) for i in range(len(first))]
    if isinstance(first, float):
        return median(rounds)
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
        + max(0, min(n, GROUP_SIZES_MAX, heads_of(spec)) - 1)  # DiT groups
        + sharded * max(0, min(n, GROUP_SIZES_MAX) - 1)  # VAE groups
        + (kind == "cpu" and n >= 2 and sharded)  # the hybrid
        + 1  # the encoder
    )


def measure(
    cfg,
    sizes: list[tuple[int, int]],
    rounds: int = 1,
    log=print,
    timeout_s: float = 900.0,
    cycles: int = LEVEL_CYCLES,
) -> Profile:
    """Measure every figure the planner and the simulator use on the devices of
    `cfg.topology.device`; with several rounds, each figure is the median of its rounds (the
    rounds interleave, so a machine whose speed drifts is sampled across the drift). `cycles`:
    the CPU levels' interleaved cycles a round (`cpu_probes.levels`)."""
    kind = cfg.topology.device
    n = device_count(kind)
    if n < 1:
        raise RuntimeError(f"no {kind} device visible")
    prof = Profile(kind, device_name(kind), n, cfg.model.preset, model_key(cfg), created=time.time())
    prof.memory_bytes = device_memory(kind)
    from ...supervisor.topology import model_spec

    progress = Progress(rounds * _probe_count(model_spec(cfg), kind, n), log)
    results = []
    for r in range(rounds):
        results.append(_measure_once(cfg, kind, n, sizes, timeout_s, progress, cycles))
        log(f"profile: round {r + 1} of {rounds} done after {time.perf_counter() - progress.t0:.0f}s")
    prof.sizes = merge(results)
    return prof


def _measure_once(
    cfg, kind: str, n: int, sizes: list[tuple[int, int]], timeout_s: float, progress: Progress, cycles: int
) -> dict:
    from ...supervisor.topology import free_port, model_card, model_spec

    spec, card = model_spec(cfg), model_card(cfg)
    ws = cfg.pipeline.vae_cpu_working_set_bytes
    dev = (lambda i: "cpu") if kind == "cpu" else (lambda i: f"{kind}:{i}")
    threads = _threads(kind, n)
    at = ", ".join(f"{w}x{h}" for w, h in sizes)
    res: dict[str, dict] = {f"{w}x{h}": {"dit": {}, "vae": {}, "vae_group": {}, "dit_group": {}} for w, h in sizes}
    for t in threads:
        cpus = cpus_of(0, t) if kind == "cpu" else ()
        # One thread each on a CPU with two cores: the VAE at the same time as the DiT, on the
        # next core, as disagg-1+1 runs them. Measured minutes apart, a machine whose speed
        # drifts skewed their ratio, which is what a cut or a hybrid band is chosen by.
        together = kind == "cpu" and t == 1 and n >= 2
        both = "side by side" if together else "one after the other"
        progress.step(f"the DiT's and the VAE's blocks on {t} thread{'s' if t > 1 else ''}, {both}, at {at}")
        vae_cpus = cpus_of(1, 1) if together else cpus
        vae_target = (vae_child, (spec, dev(0), vae_cpus, t, 0, 1, "", sizes, [None], (2,), ws, 0))
        if kind == "cpu":  # the DiT beside the host's work per block, on the same cores
            jobs = torch_context().Queue()
            targets = [
                (dit_child, (spec, dev(0), cpus, t, sizes, (2, 4), 0, 1, "", jobs)),
                (host_child, (cpus, sizes, 16, jobs)),
                *([vae_target] if together else []),
            ]
        else:
            targets = [(dit_child, (spec, dev(0), cpus, t, sizes, (2, 4), 0, 1, "", None))]
        done = {x["stage"]: x for x in run_children(targets, timeout_s) if "stage" in x}
        dit = done["dit"]
        vae = done["vae"] if "vae" in done else run_children([vae_target], timeout_s)[0]
        for key in res:
            res[key]["dit"][str(t)] = dit["sizes"][key]
            res[key]["vae"][str(t)] = vae["sizes"][key]["equal"]
    if len(threads) > 1:
        # Cuts are run side by side where a window holds a few of the VAE's blocks: one block
        # is noise, and the real VAE on a CPU would add minutes for it (35 s a frame-wise block
        # at 416x240 on two cores).
        offered = sorted({c for key in res for c in offered_cuts(res[key]["vae"]["1"].get("stages_ms") or [])})
        quick = max(res[key]["vae"]["1"]["block_ms"] for key in res) * PROBE_BLOCKS <= 1000 * LEVEL_WINDOW_S
        probes = sorted({offered[-1], offered[(len(offered) - 1) // 2]}) if offered and quick else []
        progress.step("the levels: 1- and 2-thread stages in interleaved cycles" + (" and cuts" if probes else ""))
        rescale(res, levels(spec, sizes, ws, timeout_s, tuple(probes), cycles))
    for g in range(2, min(n, GROUP_SIZES_MAX, heads_of(spec)) + 1):
        progress.step(f"a DiT group of {g} ranks over the real collective")
        addr = f"tcp://127.0.0.1:{free_port()}"
        targets = [
            (dit_child, (spec, dev(r), cpus_of(r, 1) if kind == "cpu" else (), 1, sizes, (2,), r, g, addr, None))
            for r in range(g)
        ]
        rank0 = next(x for x in run_children(targets, timeout_s) if x["rank"] == 0)
        for key in res:
            res[key]["dit_group"][str(g)] = rank0["sizes"][key]
    whole = spec.decoder != "wan"  # TAEHV is never sharded: no VAE groups, no hybrid
    for k in range(2, 1 if whole else min(n, GROUP_SIZES_MAX) + 1):
        addr = f"tcp://127.0.0.1:{free_port()}"
        splits = [None, (1.0, 3.0)] if k == 2 else [None]
        progress.step(f"a VAE group of {k} shards over the real collective")
        targets = [
            (vae_child, (spec, dev(r), cpus_of(r, 1) if kind == "cpu" else (), 1, r, k, addr, sizes, splits, (), ws, 0))
            for r in range(k)
        ]
        shards = [s["sizes"] for s in sorted(run_children(targets, timeout_s), key=lambda s: s["rank"])]
        for key in res:
            res[key]["vae_group"][str(k)] = {split: [s[key][split] for s in shards] for split in shards[0][key]}
    if kind == "cpu" and n >= 2 and not whole:
        progress.step("the hybrid: a DiT below a VAE shard on its core")
        for key, probe in hybrid_probe(spec, sizes, ws, timeout_s).items():
            res[key]["hybrid"] = probe
    progress.step("libx264's time per block")
    for w, h in sizes:
        fpb, tf = card.frames_per_block, card.temporal_factor
        res[f"{w}x{h}"]["encode"] = encode_ms(w, h, 16, 1 + tf * (fpb - 1), tf * fpb)
    return res
