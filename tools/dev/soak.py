#!/usr/bin/env python3
"""Soak test: N clients for M minutes against streamdiffd, then a leak check.

Each client loops over a mix of what users do: streaming requests read to the end, storyboards,
jobs polled and downloaded (with a byte range), streams abandoned half-way (disconnects), and
malformed requests (which must get a 4xx). Every well-formed request's video is checked (frame
count and a keyframe at every fragment start, from the boxes). At the end the daemon must be idle
and hold no more file descriptors, child processes or shared-memory segments than at the start.

  tools/dev/soak.py --clients 3 --minutes 10            # starts its own daemon on the embedded model
  tools/dev/soak.py --url http://127.0.0.1:8000 --minutes 1
  tools/dev/soak.py --sizes random -- --vae-gpus 3      # every request at a random size the limits allow
  tools/dev/soak.py --live --minutes 10                 # one live video, steered every 20 s, then stopped

A soak passes with no failure, no leak and no worker restart. A live soak also samples the memory
of the supervisor and of every worker each 10 s (it must stay flat: the KV window and sinks bound
what a session holds, whatever its length) and measures each steer's latency: from the request to
the moment the new scene's first frame is due on the screen of a player that started 0.5 s after
the first fragment (a late fragment stalls it), or arrives, whichever is later.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]


def check_mp4(data: bytes, frames: int) -> str | None:
    """None if the bytes are an init segment plus fragments holding `frames` samples, each
    fragment starting with a sync sample; else what is wrong."""
    pos, samples, moofs = 0, 0, 0
    seen_moov = False
    while pos + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[pos : pos + 8])
        if size < 8 or pos + size > len(data):
            return f"truncated box at {pos}"
        if kind == b"moov":
            seen_moov = True
        if kind == b"moof":
            box = data[pos : pos + size]
            i = box.index(b"trun")
            flags = struct.unpack(">I", box[i + 4 : i + 8])[0] & 0xFFFFFF
            n = struct.unpack(">I", box[i + 8 : i + 12])[0]
            first = i + 16 + (4 if flags & 0x4 else 0) + (4 if flags & 0x100 else 0) + (4 if flags & 0x200 else 0)
            if flags & 0x400 and struct.unpack(">I", box[first : first + 4])[0] & 0x00010000:
                return f"fragment {moofs + 1} does not start with a keyframe"
            samples += n
            moofs += 1
        pos += size
    if not seen_moov:
        return "no init segment"
    if samples != frames:
        return f"{samples} frames, expected {frames}"
    return None


class Soak:
    def __init__(self, url: str, seed: int, sizes: str = "fixed", max_size: tuple[int, int] = (832, 480)) -> None:
        self.url = url
        self.rng = random.Random(seed)
        self.sizes, self.max_size = sizes, max_size
        self.counts: Counter = Counter()
        self.failures: list[str] = []
        self.first_byte: list[float] = []

    def fail(self, what: str) -> None:
        self.counts["failures"] += 1
        self.failures.append(what)
        print(f"FAILURE: {what}", flush=True)

    async def stream(self, s: aiohttp.ClientSession, body: dict, frames: int, abandon: bool = False) -> None:
        t0 = time.monotonic()
        data = bytearray()
        async with s.post(self.url + "/v1/videos", json={**body, "stream": True}) as r:
            if r.status == 429:
                self.counts["busy_429"] += 1
                return
            if r.status != 200:
                return self.fail(f"stream: HTTP {r.status} {await r.text()}")
            stop_at = self.rng.randint(1, 60_000) if abandon else None
            async for chunk in r.content.iter_any():
                if not data:
                    self.first_byte.append(time.monotonic() - t0)
                data += chunk
                if stop_at is not None and len(data) >= stop_at:
                    self.counts["disconnects"] += 1
                    return  # leaving the context closes the connection mid-stream
        problem = check_mp4(bytes(data), frames)
        if problem:
            self.fail(f"stream {body}: {problem}")
        else:
            self.counts["streams_ok"] += 1

    async def job(self, s: aiohttp.ClientSession, body: dict, frames: int) -> None:
        async with s.post(self.url + "/v1/videos", json=body) as r:
            if r.status == 429:
                self.counts["busy_429"] += 1
                return
            if r.status != 200:
                return self.fail(f"job: HTTP {r.status} {await r.text()}")
            vid = (await r.json())["id"]
        deadline = time.monotonic() + 300
        while True:
            async with s.get(f"{self.url}/v1/videos/{vid}") as r:
                v = await r.json()
            if v["status"] in ("completed", "failed"):
                break
            if time.monotonic() > deadline:
                return self.fail(f"job {vid} did not finish")
            await asyncio.sleep(0.2)
        if v["status"] != "completed":
            return self.fail(f"job {vid} failed: {v['error']}")
        async with s.get(f"{self.url}/v1/videos/{vid}/content") as r:
            data = await r.read()
        async with s.get(f"{self.url}/v1/videos/{vid}/content", headers={"Range": "bytes=0-99"}) as r:
            head = await r.read()
            if r.status != 206 or head != data[:100]:
                return self.fail(f"range request on {vid}: HTTP {r.status}")
        problem = check_mp4(data, frames)
        if problem:
            return self.fail(f"job {vid}: {problem}")
        async with s.delete(f"{self.url}/v1/videos/{vid}") as r:
            if r.status != 200:
                return self.fail(f"delete {vid}: HTTP {r.status}")
        self.counts["jobs_ok"] += 1

    async def invalid(self, s: aiohttp.ClientSession) -> None:
        body = self.rng.choice(
            [
                {"prompt": ""},
                {"prompt": "x", "size": "13x13"},
                {"prompt": "x", "fps": -1},
                {"scenes": "nope"},
                {"prompt": "x", "unknown": 1},
            ]
        )
        async with s.post(self.url + "/v1/videos", json=body) as r:
            if r.status != 400 or "error" not in await r.json():
                return self.fail(f"invalid request {body} got HTTP {r.status}")
        self.counts["rejected_ok"] += 1

    def size(self) -> str:
        """128x64, or (--sizes random) any width and height the limits allow, multiples of 16."""
        if self.sizes == "fixed":
            return "128x64"
        (max_w, max_h), lo = self.max_size, 64  # limits.min_size's default
        w, h = 16 * self.rng.randint(lo // 16, max_w // 16), 16 * self.rng.randint(lo // 16, max_h // 16)
        self.counts["sizes_large" if w * h > 256 * 144 * 2 else "sizes_small"] += 1
        return f"{w}x{h}"

    async def client(self, s: aiohttp.ClientSession, deadline: float) -> None:
        while time.monotonic() < deadline:
            action = self.rng.choices(["stream", "story", "job", "abandon", "invalid"], [4, 2, 2, 2, 1])[0]
            n = self.rng.choice([9, 21, 33, 48])
            size = self.size()
            self.counts["requests"] += 1
            try:
                if action == "stream":
                    await self.stream(s, {"prompt": "soak", "num_frames": n, "size": size}, n)
                elif action == "story":
                    scenes = [
                        {"prompt": "a", "num_frames": n},
                        {"prompt": "b", "num_frames": 12, "transition": "continue"},
                        {"prompt": "c", "num_frames": 7, "transition": "cut"},
                    ]
                    await self.stream(s, {"scenes": scenes, "size": size}, n + 19)
                elif action == "job":
                    await self.job(s, {"prompt": "soak job", "num_frames": n, "size": size}, n)
                elif action == "abandon":
                    await self.stream(s, {"prompt": "abandoned", "seconds": 30, "size": size}, 0, abandon=True)
                else:
                    await self.invalid(s)
            except (TimeoutError, aiohttp.ClientError) as exc:
                self.fail(f"{action}: {type(exc).__name__}: {exc}")


def rss_kib(pid: int) -> int:
    return next(
        int(ln.split()[1]) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("VmRSS")
    )


def fragment_times(data: bytes, start: int, arrived: float, seen: list) -> int:
    """Record (arrival, frames, [emsg scene starts]) for each fragment complete in data[start:];
    returns where the next one starts."""
    pos, marks = start, []
    while pos + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[pos : pos + 8])
        if size < 8 or pos + size > len(data):
            break
        if kind == b"emsg":
            body = data[pos + 12 : pos + size]
            rest = body[20:].split(b"\0", 2)
            marks.append(json.loads(rest[2])["start_frame"])
        elif kind == b"moof":
            box = data[pos : pos + size]
            i = box.index(b"trun")
            seen.append((arrived, struct.unpack(">I", box[i + 8 : i + 12])[0], marks))
            marks = []
        elif kind == b"mdat":
            start = pos + size
        pos += size
    return start


async def live_soak(url: str, minutes: float, steer_every: float, pid: int | None, fps: int = 16) -> dict:
    """One live video for `minutes`, steered every `steer_every` seconds (continue, cut, continue
    with re-cache, in turn), then stopped; memory sampled every 10 s."""
    kinds = [{"transition": "continue"}, {"transition": "cut"}, {"transition": "continue", "recache": True}]
    seen: list = []  # (arrival, frames, [scene start frames]) per fragment
    steers: list = []  # (request time, answer)
    memory: list = []  # (t, {process: rss KiB})
    data, failures = bytearray(), []
    t0 = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        body = {"prompt": "a live soak", "live": True, "stream": True, "seconds": 60 * minutes + 60}
        async with s.post(url + "/v1/videos", json=body) as r:
            if r.status != 200:
                return {"failures": [f"HTTP {r.status}: {await r.text()}"]}
            vid = r.headers["X-Video-Id"]

            async def control():
                n = 0
                while time.monotonic() - t0 < 60 * minutes:
                    await asyncio.sleep(min(steer_every, 10.0))
                    t = time.monotonic() - t0
                    if pid is not None:
                        kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
                        memory.append((t, {"supervisor": rss_kib(pid), **{k: rss_kib(int(k)) for k in kids}}))
                    if t >= (n + 1) * steer_every and t < 60 * minutes:
                        req = {"prompt": f"scene {n + 1}", **kinds[n % 3]}
                        async with s.post(f"{url}/v1/videos/{vid}/scenes", json=req) as sr:
                            answer = await sr.json()
                        if sr.status != 200:
                            failures.append(f"steer {n + 1}: HTTP {sr.status} {answer}")
                        else:
                            steers.append((t, answer))
                        n += 1
                async with s.post(f"{url}/v1/videos/{vid}/stop") as sr:
                    if sr.status != 200:
                        failures.append(f"stop: HTTP {sr.status}")

            ctl = asyncio.create_task(control())
            pos = 0
            async for chunk in r.content.iter_any():
                data += chunk
                pos = fragment_times(bytes(data), pos, time.monotonic() - t0, seen)
            await ctl
        async with s.get(f"{url}/v1/videos/{vid}") as r:
            video = await r.json()
    problem = check_mp4(bytes(data), video["num_frames"])
    if problem or video["status"] != "completed":
        failures.append(f"video {video['status']}: {problem}")
    # The player: starts 0.5 s after the first fragment; a fragment due before it arrives stalls it.
    first, stall, frame, shown = seen[0][0], 0.0, 0, {}
    for arrived, n, marks in seen:
        due = first + 0.5 + stall + frame / fps
        if arrived > due:
            stall += arrived - due
            due = arrived
        for m in marks:
            shown[m] = due + (m - frame) / fps
        frame += n
    latency = []
    for t, answer in steers:
        if answer["start_frame"] not in shown:
            failures.append(f"no emsg at frame {answer['start_frame']}")
        else:
            latency.append(shown[answer["start_frame"]] - t)
    latency.sort()
    pct = lambda q: latency[min(len(latency) - 1, round(q * (len(latency) - 1)))] if latency else None  # noqa: E731
    return {
        "video_s": video["num_frames"] / fps,
        "fragments": len(seen),
        "stalls_s": round(stall, 2),
        "steers": len(steers),
        "steer_latency_s": [round(x, 3) for x in latency],
        "steer_latency_p50_s": pct(0.5),
        "steer_latency_p95_s": pct(0.95),
        "memory_kib": memory,
        "video_bytes": len(data),
        "failures": failures,
    }


def process_facts(pid: int, instance: str) -> dict:
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    rss = next(
        int(ln.split()[1]) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("VmRSS")
    )
    segments = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"sd-{instance}-"))
    return {"fds": fds, "children": sorted(children), "rss_kib": rss, "segments": segments}


async def wait_idle(url: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + "/health") as r:
                    h = await r.json()
            except aiohttp.ClientConnectionError:  # still starting
                await asyncio.sleep(0.3)
                continue
            p = h["pipeline"]
            if h["status"] == "ok" and p["tracked"] == 0 and p["latent_slots_used"] == 0 and p["frame_slots_used"] == 0:
                return h
            await asyncio.sleep(0.2)
    raise TimeoutError("daemon not idle")


async def run(a: argparse.Namespace) -> int:
    proc, instance, url = None, f"soak{os.getpid()}", a.url
    if url is None:
        port = a.port
        url = f"http://127.0.0.1:{port}"
        log = open(a.log, "w")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "streamdiff.cli",
                "--port",
                str(port),
                "--instance",
                instance,
                "--log-level",
                "warning",
                *a.daemon_args,
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        health = await wait_idle(url, 300)
        before = process_facts(proc.pid, instance) if proc else None
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/v1/models") as r:
                model = (await r.json())["data"][0]
        if a.live:
            result = await live_soak(url, a.minutes, a.steer_every, proc.pid if proc else None)
            health = await wait_idle(url)
            result["worker_restarts"] = {n: w["restarts"] for n, w in health["workers"].items() if w["restarts"]}
            print(json.dumps({k: v for k, v in result.items() if k != "memory_kib"}, indent=1), flush=True)
            for t, mem in result["memory_kib"][:: max(1, len(result["memory_kib"]) // 12)]:
                print(f"{t:6.0f}s rss KiB {mem}", flush=True)
            if a.json:
                Path(a.json).write_text(json.dumps(result, indent=1))
            ok = not result["failures"] and not result["worker_restarts"]
            print("SOAK PASSED" if ok else "SOAK FAILED", flush=True)
            return 0 if ok else 1
        soak = Soak(url, a.seed, a.sizes, tuple(int(v) for v in model["max_size"].split("x")))
        deadline = time.monotonic() + 60 * a.minutes
        t0 = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=600, sock_read=300)
        async with aiohttp.ClientSession(timeout=timeout) as s:

            async def report():
                while time.monotonic() < deadline:
                    await asyncio.sleep(30)
                    facts = process_facts(proc.pid, instance) if proc else {}
                    print(
                        f"{time.monotonic() - t0:6.0f}s {dict(soak.counts)} rss={facts.get('rss_kib')}KiB "
                        f"fds={facts.get('fds')}",
                        flush=True,
                    )

            reporter = asyncio.create_task(report())
            await asyncio.gather(*(soak.client(s, deadline) for _ in range(a.clients)))
            reporter.cancel()
        health = await wait_idle(url)
        after = process_facts(proc.pid, instance) if proc else None
        leaks = []
        if proc:
            if after["fds"] > before["fds"] + 2:
                leaks.append(f"file descriptors {before['fds']} -> {after['fds']}")
            if after["children"] != before["children"]:
                leaks.append(f"child processes {before['children']} -> {after['children']}")
            if after["segments"] != before["segments"]:
                leaks.append(f"segments {before['segments']} -> {after['segments']}")
        restarts = {n: w["restarts"] for n, w in health["workers"].items() if w["restarts"]}
        result = {
            "clients": a.clients,
            "minutes": a.minutes,
            "wall_s": time.monotonic() - t0,
            "counts": dict(soak.counts),
            "failures": soak.failures,
            "leaks": leaks,
            "worker_restarts": restarts,
            "first_byte_p50_s": sorted(soak.first_byte)[len(soak.first_byte) // 2] if soak.first_byte else None,
            "first_byte_max_s": max(soak.first_byte) if soak.first_byte else None,
            "before": before,
            "after": after,
        }
        print(json.dumps({k: v for k, v in result.items() if k not in ("before", "after")}, indent=1), flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=1))
        ok = not soak.failures and not leaks and not restarts
        print("SOAK PASSED" if ok else "SOAK FAILED", flush=True)
        return 0 if ok else 1
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=120)
            left = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"sd-{instance}-"))
            print(f"daemon exited with {code}; segments left: {left}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="target a running daemon (no leak check of its process)")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--port", type=int, default=18600)
    ap.add_argument("--log", default="/tmp/streamdiff-soak.log")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--sizes", choices=("fixed", "random"), default="fixed", help="128x64, or random within the limits")
    ap.add_argument("--live", action="store_true", help="one live video for --minutes, steered, then stopped")
    ap.add_argument("--steer-every", type=float, default=20.0, help="live: seconds between steers")
    ap.add_argument("daemon_args", nargs="*", help="extra streamdiffd flags (after --)")
    return asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
