#!/usr/bin/env python3
"""Benchmark streamdiffd layouts with real streams.

For each layout it starts a daemon (or targets one with --url), then runs
  W1: one 3-scene storyboard stream, and
  W2: N concurrent streams for N = 1, 2, ... until one stalls (goodput),
and reports time to first fragment, fragment interval p50/p99, output frames/s per stream and in
total, stalls against real-time playback at the video's fps (a player that starts with the first
fragment and rebuffers when the next is late), goodput (the most concurrent streams that all play
without a stall), and each stage's busy fraction (compute time the workers report / wall time).

The default comparison, at 2 workers (2 cores, one thread each):
  disagg-1+1   DiT on worker 0, VAE on worker 1, overlapped
  agg-1x2t     one worker running DiT then VAE with 2 threads
  agg-seq-k2   DiT on worker 0, then the VAE sharded over workers 0 and 1 (in sequence)
  agg-2rep     two replicas, each running DiT then VAE on one core
Also: hybrid-1+2 (a VAE shard beside the DiT on its core), agg-sp2 (the DiT sequence-parallel
over both workers, then the VAE sharded over both), auto (the daemon's own plan).

  tools/bench/layouts.py          # the default comparison, writes docs/results/bench.json, docs/results/bench.png
  tools/bench/layouts.py --layouts disagg-1+1 --w1-only
  tools/bench/layouts.py --url http://127.0.0.1:8000 --w1-only     # an already running daemon
  tools/bench/layouts.py --layouts disagg-1+1,agg-1x2t,hybrid-1+2 --repeats 8   # W1 interleaved, 8 rounds
  tools/bench/layouts.py --repeats 5 \\
      --layouts "base=@/work/wt/base92 --dit-gpus 1 --vae-gpus 1,this=--dit-gpus 1 --vae-gpus 1"
      # two builds interleaved (@DIR: the checkout at DIR)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from streamdiff.placement.profile.probes import cpu_seconds

ROOT = Path(__file__).resolve().parents[2]

LAYOUTS = {
    "disagg-1+1": ["--dit-gpus", "1", "--vae-gpus", "1"],
    "disagg-1+2": ["--dit-gpus", "1", "--vae-gpus", "2"],
    "agg-1x2t": ["--mode", "aggregated", "--dit-gpus", "1", "--vae-gpus", "1", "--threads-per-worker", "2"],
    "agg-seq-k2": ["--mode", "aggregated", "--dit-gpus", "1", "--vae-gpus", "2"],
    "agg-2rep": ["--mode", "aggregated", "--dit-gpus", "2", "--vae-gpus", "2", "--vae-group-size", "1"],
    "hybrid-1+2": ["--mode", "hybrid", "--dit-gpus", "1", "--vae-gpus", "2"],
    "agg-sp2": ["--mode", "aggregated", "--dit-gpus", "2", "--vae-gpus", "2", "--dit-group-size", "2"],
    # both workers on both cores: the stage with work takes the core the other leaves idle
    "shared-1+1": ["--dit-gpus", "1", "--vae-gpus", "1", "--share-cores"],
    "cut4-1+1": ["--dit-gpus", "1", "--vae-gpus", "1", "--vae-cut", "4"],  # fixed: no adapting
    "auto": [],  # no layout flags: the daemon plans from its cached profile (placement/auto.py)
}
DEFAULT_LAYOUTS = ["disagg-1+1", "agg-1x2t", "agg-seq-k2", "agg-2rep"]


@dataclass
class StreamResult:
    request_s: float  # when the request was sent, relative to the workload start
    ttff_s: float = 0.0
    queued_s: float = 0.0  # of the TTFF, the wait for admission (the daemon's video object)
    fragment_s: list[float] = field(default_factory=list)  # arrival times relative to the request
    fragment_frames: list[int] = field(default_factory=list)
    frames: int = 0
    wall_s: float = 0.0
    stalls: int = 0
    stall_s: float = 0.0
    ok: bool = False
    error: str = ""
    status: int = 0
    retry_after_s: float | None = None

    def playback(self, fps: int, startup_s: float = 0.0) -> None:
        """A player that starts `startup_s` after the first fragment and rebuffers when one is late."""
        self.stalls, self.stall_s = 0, 0.0
        if not self.fragment_s:
            return
        start, shown = self.fragment_s[0] + startup_s, 0
        for t, n in zip(self.fragment_s, self.fragment_frames):
            due = start + self.stall_s + shown / fps
            if t > due + 1e-3:
                self.stalls += 1
                self.stall_s += t - due
            shown += n

    @property
    def steady_fps(self) -> float:
        """Frames per second after the first fragment (the pipeline's steady throughput)."""
        if len(self.fragment_s) < 2:
            return 0.0
        return sum(self.fragment_frames[1:]) / (self.fragment_s[-1] - self.fragment_s[0])


def parse_fragments(buf: bytearray, pos: int, out: StreamResult, t: float) -> int:
    """Consume complete top-level boxes from buf[pos:]; record each moof's sample count."""
    while pos + 8 <= len(buf):
        size, kind = struct.unpack(">I4s", buf[pos : pos + 8])
        if size < 8 or pos + size > len(buf):
            break
        if kind == b"moof":
            moof = bytes(buf[pos : pos + size])
            i = moof.find(b"trun")
            out.fragment_frames.append(struct.unpack(">I", moof[i + 8 : i + 12])[0])
        elif kind == b"mdat":
            out.fragment_s.append(t)  # a fragment is usable once its mdat is complete
        pos += size
    return pos


async def stream(
    session: aiohttp.ClientSession, url: str, body: dict, t0: float, fps: int, startup_s: float = 0.0, delay_s=0.0
) -> StreamResult:
    await asyncio.sleep(delay_s)
    r = StreamResult(request_s=time.monotonic() - t0)
    start = time.monotonic()
    buf, pos = bytearray(), 0
    try:
        async with session.post(url + "/v1/videos", json={**body, "stream": True}) as resp:
            r.status = resp.status
            if resp.headers.get("Retry-After"):
                r.retry_after_s = float(resp.headers["Retry-After"])
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return r
            video_id = resp.headers.get("X-Video-Id")
            async for chunk in resp.content.iter_any():
                now = time.monotonic() - start
                buf += chunk
                pos = parse_fragments(buf, pos, r, now)
        r.ok = True
        if video_id:
            async with session.get(f"{url}/v1/videos/{video_id}") as v:
                r.queued_s = (await v.json()).get("queued_s", 0.0) if v.status == 200 else 0.0
    except Exception as exc:  # a truncated stream (failed session) lands here
        r.error = f"{type(exc).__name__}: {exc}"
    r.wall_s = time.monotonic() - start
    r.frames = sum(r.fragment_frames[: len(r.fragment_s)])
    r.ttff_s = r.fragment_s[0] if r.fragment_s else float("nan")
    r.playback(fps, startup_s)
    return r


async def scrape(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    out = {}
    for m in re.finditer(r'^streamdiff_stage_busy_seconds\{stage="(\w+)"\} ([0-9.e+-]+)$', text, re.M):
        out[m[1]] = float(m[2])
    for m in re.finditer(r'^streamdiff_stage_block_seconds_(sum|count)\{stage="(\w+)"\} ([0-9.e+-]+)$', text, re.M):
        out[f"{m[2]}_{m[1]}"] = float(m[3])
    for name in ("scheduler_seconds", "fragments"):  # the scheduler's own time, per block made
        m = re.search(rf"^streamdiff_{name}_total ([0-9.e+-]+)$", text, re.M)
        if m:
            out[name] = float(m[1])
    return out


async def workload(url: str, bodies: list[dict], fps: int) -> tuple[list[StreamResult], dict, float]:
    timeout = aiohttp.ClientTimeout(total=3600, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        before = await scrape(s, url)
        t0 = time.monotonic()
        results = await asyncio.gather(*(stream(s, url, b, t0, fps) for b in bodies))
        wall = time.monotonic() - t0
        after = await scrape(s, url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return list(results), delta, wall


async def offered(url: str, a: argparse.Namespace) -> dict:
    """W2 as users meet it: N streams offered at once (a few hundred ms apart), each played by a
    player that starts `startup_buffer_s` after its first fragment. The daemon admits what it can
    serve; the rest wait or get 429 with Retry-After."""
    bodies = [
        {"prompt": f"offered {i}", "seconds": a.offered_seconds, "size": a.w2_size or a.size, "seed": i}
        for i in range(a.offered)
    ]
    timeout = aiohttp.ClientTimeout(total=3600, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        t0 = time.monotonic()
        res = await asyncio.gather(
            *(stream(s, url, b, t0, a.fps, a.startup_buffer_s, i * a.stagger_s) for i, b in enumerate(bodies))
        )
    played = [r for r in res if r.ok]
    ttffs = [r.ttff_s for r in played]
    admitted = [r.ttff_s - r.queued_s for r in played]  # from admission to the first fragment
    out = {
        "offered": a.offered,
        "seconds": a.offered_seconds,
        "startup_buffer_s": a.startup_buffer_s,
        "served": len(played),
        "served_without_stall": sum(1 for r in played if r.stalls == 0),
        "refused_429": [r.retry_after_s for r in res if r.status == 429],
        "ttff_s": ttffs,
        "ttff_p95_s": pct(ttffs, 0.95),
        "queued_s": [r.queued_s for r in played],
        "ttff_after_admission_s": admitted,
        "ttff_after_admission_p95_s": pct(admitted, 0.95),
        "stalls": [r.stalls for r in played],
        "streams_detail": [asdict(r) for r in res],
    }
    print(
        f"offered {a.offered} x {a.offered_seconds:g}s: served {out['served']} "
        f"({out['served_without_stall']} without a stall), 429 with Retry-After {out['refused_429']}, "
        f"TTFF {[round(t, 2) for t in ttffs]} (p95 {out['ttff_p95_s']:.2f}s; after admission "
        f"{[round(t, 2) for t in admitted]}, p95 {out['ttff_after_admission_p95_s']:.2f}s), stalls {out['stalls']}",
        flush=True,
    )
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))]


def summarise(results: list[StreamResult], delta: dict, wall: float, workers: dict) -> dict:
    ok = [r for r in results if r.ok]
    intervals = [b - a for r in ok for a, b in zip(r.fragment_s, r.fragment_s[1:])]
    frames = sum(r.frames for r in ok)
    busy = {}
    for stage in ("dit", "vae", "encode"):
        n = max(1, workers.get(stage, 1))
        busy[stage] = delta.get(stage, 0.0) / (wall * n)
    block_ms = {
        s: 1000 * delta[f"{s}_sum"] / delta[f"{s}_count"] for s in ("dit", "vae", "encode") if delta.get(f"{s}_count")
    }
    return {
        "streams": len(results),
        "ok": len(ok),
        "errors": [r.error for r in results if not r.ok],
        "ttff_s": statistics.median([r.ttff_s for r in ok]) if ok else None,
        "ttff_max_s": max((r.ttff_s for r in ok), default=None),
        "fragment_interval_p50_s": pct(intervals, 0.5),
        "fragment_interval_p99_s": pct(intervals, 0.99),
        "fps_per_stream": [r.frames / r.wall_s for r in ok],
        "steady_fps_per_stream": [r.steady_fps for r in ok],
        "fps_total": frames / wall,
        "stalls": sum(r.stalls for r in ok),
        "stall_s": sum(r.stall_s for r in ok),
        "wall_s": wall,
        "frames": frames,
        "busy_fraction": busy,
        "block_ms": block_ms,
        "scheduler_ms_per_block": 1000 * delta.get("scheduler_seconds", 0.0) / max(1.0, delta.get("fragments", 0.0)),
        "streams_detail": [asdict(r) for r in results],
    }


def storyboard(size: str, seconds: float, seed: int) -> dict:
    return {
        "scenes": [
            {"prompt": "a red fox runs through fresh snow", "seconds": seconds},
            {"prompt": "the fox stops at a frozen lake", "seconds": seconds, "transition": "continue"},
            {"prompt": "a city street at night in the rain", "seconds": seconds, "transition": "cut"},
        ],
        "size": size,
        "seed": seed,
    }


class Daemon:
    def __init__(self, args: list[str], port: int, log: Path) -> None:
        """A streamdiffd child; `args` may start with `@DIR`: run the checkout at DIR (another
        build, through PYTHONPATH) instead of this one."""
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        tree = ROOT
        if args and args[0].startswith("@"):
            tree, args = Path(args[0][1:]).resolve(), args[1:]
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "streamdiff.cli",
                "--port",
                str(port),
                "--instance",
                f"bench{port}",
                "--log-level",
                "warning",
                *args,
            ],
            cwd=tree,
            env={**os.environ, "PYTHONPATH": str(tree)},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    async def ready(self, timeout_s: float = 300) -> dict:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited ({self.proc.returncode}); see {self.log.name}")
                try:
                    async with s.get(self.url + "/health") as r:
                        if r.status == 200:
                            return await r.json()
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.3)
        raise TimeoutError("daemon not ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


async def bench_layout(name: str, args: list[str], a: argparse.Namespace, port: int) -> dict:
    log = Path(a.out_dir) / f"bench-{name}.log"
    daemon = None
    url = a.url
    if url is None:
        daemon = Daemon(args, port, log)
        health = await daemon.ready()
        url = daemon.url
    else:
        async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
            health = await r.json()
    workers = _workers(health, args)
    try:
        await workload(url, [WARM_UP | {"size": a.size}], a.fps)
        out = {"layout": name, "args": args, "workers": workers}
        if health.get("placement"):  # what the daemon runs: its plan and predictions where it planned
            out["placement"] = health["placement"]
        if a.offered:
            out["offered"] = await offered(url, a)
            return out
        out["w1"] = await w1_run(name, url, daemon, workers, a)
        if not a.w1_only:
            out["w2"] = []
            good = 0
            for n in range(1, a.max_streams + 1):
                bodies = [
                    {"prompt": f"stream {i}", "seconds": a.w2_seconds, "size": a.w2_size or a.size, "seed": i}
                    for i in range(n)
                ]
                res, delta, wall = await workload(url, bodies, a.fps)
                s = summarise(res, delta, wall, workers)
                s["n"] = n
                out["w2"].append(s)
                print(
                    f"{name:>11} W2 n={n}: total {s['fps_total']:.1f} frames/s, per stream "
                    f"{', '.join(f'{v:.1f}' for v in s['fps_per_stream'])}, stalls {s['stalls']} "
                    f"({s['stall_s']:.2f}s), TTFF max {s['ttff_max_s']:.2f}s",
                    flush=True,
                )
                if s["stalls"] == 0 and s["ok"] == n:
                    good = n
                else:
                    break
            out["goodput"] = good
            print(f"{name:>11} goodput: {good} stream(s) without a stall", flush=True)
        return out
    finally:
        if daemon is not None:
            daemon.stop()


def layouts_of(a: argparse.Namespace) -> dict[str, list[str]]:
    """--layouts -> each layout's streamdiffd flags: a known name, or NAME=FLAGS of your own."""
    out = {}
    for entry in a.layouts.split(","):
        name, _, flags = entry.partition("=")
        if not flags and name not in LAYOUTS:
            raise ValueError(f"unknown layout {name!r}: one of {', '.join(LAYOUTS)}, or NAME=FLAGS")
        out[name] = (flags.split() if flags else LAYOUTS[name]) + a.daemon_args.split()
    return out


WARM_UP = {"prompt": "warm up", "num_frames": 9}  # a fresh daemon's first request pays for lazy set-up


def _workers(health: dict, args: list[str]) -> dict:
    """DiT workers and VAE groups (for busy fractions), from /health or, aggregated, the flags."""
    workers = {
        "dit": sum(1 for n in health["workers"] if n.startswith("dit")),
        "vae": sum(1 for n in health["workers"] if n.startswith("vae") and n.endswith(".0")),
    }
    if any(n.startswith("agg") for n in health["workers"]):
        flags = dict(zip(args[::2], args[1::2]))
        vae = int(flags.get("--vae-gpus", 1))
        workers = {"dit": int(flags.get("--dit-gpus", 1)), "vae": vae // int(flags.get("--vae-group-size", vae))}
    return workers


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by a process and every descendant alive now (the daemon and its
    workers), from /proc (psutil would walk the same files; it is not a dependency, and this is
    one walk per run)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
            children.setdefault(ppid, []).append(int(d.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += cpu_seconds(p)
        except OSError:
            continue
        todo += children.get(p, [])
    return total


async def w1_run(name: str, url: str, daemon: Daemon | None, workers: dict, a: argparse.Namespace) -> dict:
    """One W1 storyboard; with a daemon of ours, also the supervisor's CPU (its loop and the
    encoder threads) per block, and the whole daemon's: every core-second its processes used,
    and the frames/s that work would give spread evenly over the cores it may use ("balanced":
    no core ever idle, the pipeline never filling). The balanced figure of a one-thread-per-core
    layout bounds what moving its work between the cores (a cut, a band) can reach."""
    pid = daemon.proc.pid if daemon else None
    host0, tree0 = (cpu_seconds(pid), tree_cpu_seconds(pid)) if pid else (None, None)
    res, delta, wall = await workload(url, [storyboard(a.size, a.scene_seconds, 1)], a.fps)
    w1 = summarise(res, delta, wall, workers)
    if pid:
        blocks = max(1.0, delta.get("fragments", 0.0))
        w1["host_ms_per_block"] = 1000 * (cpu_seconds(pid) - host0) / blocks
        cpu_s = tree_cpu_seconds(pid) - tree0
        w1["cpu_ms_per_block"] = 1000 * cpu_s / blocks
        # the cores the daemon was started with (its supervisor pins itself to the DiT's)
        w1["balanced_fps"] = w1["frames"] * len(os.sched_getaffinity(0)) / max(cpu_s, 1e-9)
    async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
        cuts = (await r.json()).get("pipeline", {}).get("vae_cuts") or {}
    if cuts:  # a VAE cut: where each DiT cuts the decoder for its next shots (an adapting one moves)
        w1["vae_cuts"] = cuts
    print(
        f"{name:>11} W1: {w1['fps_total']:.1f} frames/s, steady {w1['steady_fps_per_stream'][0]:.1f}, "
        f"TTFF {w1['ttff_s']:.2f}s, interval p50 {w1['fragment_interval_p50_s']:.3f}s "
        f"p99 {w1['fragment_interval_p99_s']:.3f}s, stalls {w1['stalls']}, blocks {w1['block_ms']}, "
        f"scheduler {w1['scheduler_ms_per_block']:.2f} ms/block, "
        f"host {w1.get('host_ms_per_block', 0):.0f} ms/block, "
        + (f"daemon CPU {w1['cpu_ms_per_block']:.0f} ms/block (balanced {w1['balanced_fps']:.1f}), " if pid else "")
        + f"busy {', '.join(f'{k} {v:.0%}' for k, v in w1['busy_fraction'].items())}"
        + (f", VAE cut {w1['vae_cuts']}" if cuts else ""),
        flush=True,
    )
    return w1


async def repeated(layouts: dict[str, list[str]], a: argparse.Namespace) -> list[dict]:
    """W1 on every layout `a.repeats` times: all the daemons up at once (an idle one waits on its
    sockets), the runs taken in turn, each round in a rotated order, so every layout meets the
    same minutes of a machine whose speed drifts. Each layout's "w1" is its median run; "rounds"
    has its frames/s per round and its ratio to the best other layout of the same round."""
    names = list(layouts)
    daemons: dict[str, tuple[Daemon, dict]] = {}
    placements: dict[str, dict | None] = {}
    try:
        for i, (name, args) in enumerate(layouts.items()):  # in turn: an "auto" daemon may profile first
            d = Daemon(args, 18500 + i, Path(a.out_dir) / f"bench-{name}.log")
            health = await d.ready()
            daemons[name], placements[name] = (d, _workers(health, args)), health.get("placement")
            await workload(d.url, [WARM_UP | {"size": a.size}], a.fps)
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(a.repeats):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                d, workers = daemons[name]
                runs[name].append(await w1_run(name, d.url, d, workers, a))
            fps = {n: runs[n][-1]["fps_total"] for n in names}
            print(f"round {r + 1}: " + ", ".join(f"{n} {v:.1f}" for n, v in fps.items()), flush=True)
    finally:
        for d, _ in daemons.values():
            d.stop()
    out = []
    for name in names:
        fps = [x["fps_total"] for x in runs[name]]
        ratios = []  # one layout alone: its rounds only
        if len(names) > 1:
            best_other = [max(runs[n][r]["fps_total"] for n in names if n != name) for r in range(a.repeats)]
            ratios = [f / b for f, b in zip(fps, best_other, strict=True)]
        median_run = sorted(runs[name], key=lambda x: x["fps_total"])[len(fps) // 2]
        balanced = [x["balanced_fps"] for x in runs[name]]
        out.append(
            {
                "layout": name,
                "args": layouts[name],
                "workers": daemons[name][1],
                "w1": median_run,
                "rounds": {"fps": fps, "vs_best_other": ratios, "balanced_fps": balanced},
                **({"placement": placements[name]} if placements[name] else {}),
            }
        )
        print(
            f"{name:>11}: median {statistics.median(fps):.1f} frames/s over {len(fps)} runs "
            f"({min(fps):.1f}-{max(fps):.1f}), balanced median {statistics.median(balanced):.1f}"
            + (
                f"; against the best other layout of each round: median {statistics.median(ratios):.2f}"
                if ratios
                else ""
            ),
            flush=True,
        )
    return out


def plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        return
    names = [r["layout"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].bar(names, [r["w1"]["fps_total"] for r in results], color="#3a7")
    axes[0].set_title("W1 storyboard: output frames/s")
    axes[1].bar(names, [r["w1"]["ttff_s"] for r in results], color="#37a")
    axes[1].set_title("W1 time to first fragment (s)")
    if all("goodput" in r for r in results):
        axes[2].bar(names, [r["goodput"] for r in results], color="#a73")
        axes[2].set_title("goodput: streams without a stall")
    else:
        for r in results:
            d = r["w1"]["streams_detail"][0]
            axes[2].plot(
                d["fragment_s"],
                [sum(d["fragment_frames"][: i + 1]) for i in range(len(d["fragment_s"]))],
                label=r["layout"],
            )
        axes[2].set_title("W1 frames received over time")
        axes[2].legend(fontsize=7)
    for ax in axes[: 2 + ("goodput" in results[0])]:
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--layouts",
        default=",".join(DEFAULT_LAYOUTS),
        help=f"comma list of {', '.join(LAYOUTS)}, or NAME=FLAGS (your own streamdiffd flags; "
        "a first flag @DIR runs the checkout at DIR)",
    )
    ap.add_argument("--url", help="benchmark a running daemon instead of starting one per layout")
    ap.add_argument("--size", default="256x144")
    ap.add_argument("--fps", type=int, default=16)
    ap.add_argument("--scene-seconds", type=float, default=4.0, help="W1: seconds per scene (3 scenes)")
    ap.add_argument("--w2-seconds", type=float, default=6.0, help="W2: seconds per stream")
    ap.add_argument("--w2-size", help="W2: frame size (default: --size)")
    ap.add_argument("--max-streams", type=int, default=4)
    ap.add_argument("--w1-only", action="store_true")
    ap.add_argument(
        "--repeats", type=int, default=0, help="W1 only: every layout N times, interleaved, all daemons up at once"
    )
    ap.add_argument("--offered", type=int, default=0, help="only W2 as offered load: N streams at once")
    ap.add_argument("--daemon-args", default="", help="extra streamdiffd flags for every layout (one string)")
    ap.add_argument("--offered-seconds", type=float, default=12.0)
    ap.add_argument("--startup-buffer-s", type=float, default=0.5, help="the player starts this long after")
    ap.add_argument("--stagger-s", type=float, default=0.3, help="between the offered requests")
    ap.add_argument("--out-dir", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--json", default=None, help="results file (default OUT_DIR/bench.json)")
    ap.add_argument("--plot", default=None, help="plot file (default OUT_DIR/bench.png)")
    a = ap.parse_args()
    Path(a.out_dir).mkdir(parents=True, exist_ok=True)
    try:
        layouts = {"target": []} if a.url else layouts_of(a)
    except ValueError as exc:
        ap.error(str(exc))
    if a.repeats and (a.url or a.offered):
        ap.error("--repeats starts its own daemons and runs W1 only")
    if a.repeats:
        results = asyncio.run(repeated(layouts, a))
    else:
        results = [
            asyncio.run(bench_layout(name, args, a, 18500 + i)) for i, (name, args) in enumerate(layouts.items())
        ]
    meta = {
        "machine": {"nproc": os.cpu_count(), "cpu": _cpu_model()},
        "size": a.size,
        "w2_size": a.w2_size or a.size,
        "fps": a.fps,
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if len(results) > 1 and results[0]["layout"].startswith("disagg") and not a.offered:
        aggs = [r for r in results if r["layout"].startswith("agg")]
        if aggs:
            best = max(aggs, key=lambda r: r["w1"]["fps_total"])
            d = results[0]
            meta["comparison"] = {
                "disaggregated": d["layout"],
                "best_aggregated_w1": best["layout"],
                "w1_fps_ratio": d["w1"]["fps_total"] / best["w1"]["fps_total"],
                "ttff_s": {d["layout"]: d["w1"]["ttff_s"], best["layout"]: best["w1"]["ttff_s"]},
                "goodput": {r["layout"]: r.get("goodput") for r in results},
            }
            c = meta["comparison"]
            print(
                f"disaggregated {d['layout']} vs best aggregated {best['layout']}: W1 frames/s ratio "
                f"{c['w1_fps_ratio']:.2f}, TTFF {d['w1']['ttff_s']:.2f}s vs {best['w1']['ttff_s']:.2f}s, "
                f"goodput {c['goodput']}",
                flush=True,
            )
    out = Path(a.json or Path(a.out_dir) / "bench.json")
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {out}", flush=True)
    if not a.offered:
        plot(results, Path(a.plot or Path(a.out_dir) / "bench.png"))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
