#!/usr/bin/env python3
"""What LL-HLS (and WebRTC) viewers of one live video cost the daemon, and whether they touch
generation.

One daemon; per round, for each viewer count in turn, a live video paced at its frame rate with
that many LL-HLS viewers, each as a player runs: a blocking playlist reload for the next part
(`_HLS_msn`, `_HLS_part`), then that part, until the video ends. Prints, per count: the
supervisor's CPU seconds over the video (it serves every viewer; the workers do not see them),
as a share of one core, the daemon's stall counter (fragments later than real-time playback
needed them) and the parts the viewers fetched. The viewers run in this process at the lowest
priority, so that on a small machine they take no core the workers would have used.
`--webrtc N` adds N WebRTC viewers (aiortc, over WHEP, decoding what they receive) to every
count: the supervisor packetizes and encrypts their RTP.

    tools/bench/hls_viewers.py --viewers 0,1,10,50 --seconds 20 --rounds 2
    tools/bench/hls_viewers.py --viewers 0,50 --webrtc 1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psutil  # noqa: E402

from streamdiff.server.hls import PARTS_PER_SEGMENT  # noqa: E402
from streamdiff.testing import Daemon, cpu_model, http  # noqa: E402


def stalls(url: str) -> float:
    text = http.get(url + "/metrics", timeout=10).text
    m = re.search(r"^streamdiff_stalls_total ([\d.e+]+)$", text, re.M)
    return float(m[1]) if m else 0.0


async def viewer(url: str, vid: str, out: dict) -> None:
    """A low-latency player's requests: reload blocking on the next part, fetch it, repeat."""
    base = f"{url}/v1/videos/{vid}/hls"
    async with httpx.AsyncClient(timeout=60) as c:
        n = 0
        while True:
            msn, part = divmod(n, PARTS_PER_SEGMENT)
            r = await c.get(f"{base}/index.m3u8", params={"_HLS_msn": msn, "_HLS_part": part})
            if r.status_code != 200:
                out["errors"] += 1
                return
            if f"part/{n}.m4s" not in r.text and "#EXT-X-ENDLIST" not in r.text:
                out["errors"] += 1  # a blocking reload must list the part it waited for
                return
            p = await c.get(f"{base}/part/{n}.m4s")
            if p.status_code == 410:  # the video ended before it
                return
            if p.status_code != 200:
                out["errors"] += 1
                return
            out["parts"] += 1
            out["bytes"] += len(p.content)
            n += 1


async def webrtc_viewer(url: str, vid: str, out: dict) -> None:
    """A WHEP viewer: an aiortc peer connection that decodes every frame it receives, until the
    video's track ends (5 s without a frame)."""
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
    from aiortc.mediastreams import MediaStreamError

    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("video", direction="recvonly")
    got = asyncio.get_running_loop().create_future()
    pc.on("track", lambda track: got.done() or got.set_result(track))
    await pc.setLocalDescription(await pc.createOffer())
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(
            f"{url}/v1/videos/{vid}/whep", content=pc.localDescription.sdp, headers={"Content-Type": "application/sdp"}
        )
    if r.status_code != 201:
        out["errors"] += 1
        await pc.close()
        return
    await pc.setRemoteDescription(RTCSessionDescription(r.text, "answer"))
    try:
        track = await asyncio.wait_for(got, 30)
        while True:  # the sender's end reaches a receiving track only as silence
            await asyncio.wait_for(track.recv(), 5)
            out["webrtc_frames"] += 1
    except (MediaStreamError, TimeoutError):
        pass
    finally:
        await pc.close()


async def one_video(d: Daemon, viewers: int, seconds: float, size: str, webrtc: int = 0) -> dict:
    body = {"prompt": "a red ball moving right on a blue background", "live": True, "seconds": seconds, "size": size}
    sup = psutil.Process(d.proc.pid)
    before, s0 = sup.cpu_times(), stalls(d.url)
    vid = http.post(d.url + "/v1/videos", json=body, timeout=30).json()["id"]
    out = {"parts": 0, "bytes": 0, "errors": 0, "webrtc_frames": 0}
    tasks = [asyncio.create_task(viewer(d.url, vid, out)) for _ in range(viewers)]
    tasks += [asyncio.create_task(webrtc_viewer(d.url, vid, out)) for _ in range(webrtc)]
    t0 = time.monotonic()
    while http.get(f"{d.url}/v1/videos/{vid}", timeout=10).json()["status"] in ("queued", "in_progress"):
        await asyncio.sleep(0.5)
    wall = time.monotonic() - t0
    await asyncio.gather(*tasks)  # each reads to the video's last part
    after = sup.cpu_times()
    cpu = (after.user + after.system) - (before.user + before.system)
    return {"cpu_s": cpu, "wall_s": wall, "stalls": stalls(d.url) - s0, **out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--viewers", default="0,1,10,50", help="viewer counts, comma-separated")
    ap.add_argument("--seconds", type=float, default=20.0, help="each live video's length")
    ap.add_argument("--size", default="256x144")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--webrtc", type=int, default=0, help="WebRTC viewers beside each count's HLS viewers")
    a = ap.parse_args()
    counts = [int(x) for x in a.viewers.split(",")]
    os.nice(19)  # this process's viewers yield to the daemon's workers
    d = Daemon()
    rows: dict[int, list[dict]] = {n: [] for n in counts}
    try:
        for r in range(a.rounds):
            order = counts if r % 2 == 0 else counts[::-1]  # interleaved: drift falls on every count
            for n in order:
                rows[n].append(asyncio.run(one_video(d, n, a.seconds, a.size, a.webrtc)))
    finally:
        d.stop()
    what = f"{a.seconds:g} s live videos at {a.size}; {a.webrtc} WebRTC viewer(s) each"
    print(f"{cpu_model()}, {os.cpu_count()} CPUs; {what}")
    print("viewers  supervisor CPU s  of one core  stalls  parts fetched  errors  WebRTC frames")
    for n in counts:
        secs = [x["cpu_s"] for x in rows[n]]
        share = [x["cpu_s"] / x["wall_s"] for x in rows[n]]
        print(
            f"{n:7d}  {min(secs):6.2f}-{max(secs):<6.2f}    {min(share):5.1%}-{max(share):<5.1%}"
            f"  {sum(x['stalls'] for x in rows[n]):6.0f}  {sum(x['parts'] for x in rows[n]):13d}"
            f"  {sum(x['errors'] for x in rows[n]):6d}  {sum(x['webrtc_frames'] for x in rows[n]):13d}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
