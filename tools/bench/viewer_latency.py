#!/usr/bin/env python3
"""From a fragment being ready to its first frame in Chromium: WebRTC (WHEP) against Media
Source Extensions (the chunked HTTP stream), both watching one live video in one page.

One daemon (its flags after `--`), one live video paced at its frame rate. Three viewers join it
as it is created:
- a raw reader of `GET .../content` here, on loopback: each fragment's arrival is its ready time
  (the server writes a fragment to every reader the moment it has it);
- in headless Chromium, MSE: `fetch` of the same stream appended to a SourceBuffer, each frame's
  presentation time from `requestVideoFrameCallback` (its `mediaTime` names the frame);
- in the same page, WebRTC: WHEP, `getStats()` polled every 2 ms, the time `framesDecoded`
  counts each frame (`X-Start-Frame` names the first).
Per block after `--skip` (the first blocks are made ahead of real time, within the live lead, and
wait in both players), the latency of its first frame on each path: decoded (WebRTC) or presented
(MSE) less ready. Prints p50/p95/max per path, the CPU and the
stage balance.

    tools/bench/viewer_latency.py --seconds 20 --size 256x144
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from streamdiff.testing import (  # noqa: E402
    CHROMIUM,
    Daemon,
    FragmentArrivals,
    cpu_model,
    http,
    launch_chromium,
    stage_means,
)

# In the player page's origin (its codecFromInit and findBox): both viewers, their timings in
# wall-clock milliseconds (performance.timeOrigin + the page's clock), into window.lat.
HARNESS = """
async ({ vid }) => {
  const lat = window.lat = { mse: [], rtc: [], rtcStart: null, done: false, error: null };
  const wall = (t) => performance.timeOrigin + t;
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  const watch = (el) => { el.muted = true; el.playsInline = true; document.body.appendChild(el); return el; };

  async function mse() {
    const video = watch(document.createElement("video"));
    const onFrame = (now, md) => { lat.mse.push([md.mediaTime, wall(md.presentationTime)]);
                                   video.requestVideoFrameCallback(onFrame); };
    video.requestVideoFrameCallback(onFrame);
    const reader = (await fetch(`/v1/videos/${vid}/content`)).body.getReader();
    let buf = new Uint8Array(0), sb = null;
    const queue = [], pump = () => { if (sb && !sb.updating && queue.length) sb.appendBuffer(queue.shift()); };
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      if (sb) { queue.push(value); pump(); continue; }
      const joined = new Uint8Array(buf.length + value.length); joined.set(buf); joined.set(value, buf.length);
      buf = joined;
      const moov = findBox(buf, "moov", 0, buf.length);
      if (moov < 0) continue;
      const end = moov + new DataView(buf.buffer).getUint32(moov);
      if (buf.length < end) continue;
      const ms = new MediaSource();
      video.src = URL.createObjectURL(ms);
      await new Promise((r) => ms.addEventListener("sourceopen", r, { once: true }));
      sb = ms.addSourceBuffer(`video/mp4; codecs="${codecFromInit(buf.subarray(0, end))}"`);
      sb.addEventListener("updateend", pump);
      queue.push(buf); pump();
      video.play().catch((e) => { lat.error = "play: " + e.message; });
    }
  }

  async function rtc() {
    const pc = new RTCPeerConnection();
    pc.addTransceiver("video", { direction: "recvonly" });
    const video = watch(document.createElement("video"));
    pc.ontrack = (e) => { video.srcObject = new MediaStream([e.track]); video.play().catch(() => {}); };
    await pc.setLocalDescription(await pc.createOffer());
    await new Promise((r) => { if (pc.iceGatheringState === "complete") r();
      pc.onicegatheringstatechange = () => { if (pc.iceGatheringState === "complete") r(); }; });
    const whep = await fetch(`/v1/videos/${vid}/whep`, { method: "POST",
      headers: { "Content-Type": "application/sdp" }, body: pc.localDescription.sdp });
    if (whep.status !== 201) throw new Error(`WHEP: HTTP ${whep.status}`);
    lat.rtcStart = Number(whep.headers.get("X-Start-Frame"));
    await pc.setRemoteDescription({ type: "answer", sdp: await whep.text() });
    let last = 0, idle = 0;
    while (idle < 3000) {  // until no frame for 6 s: the video has ended
      await sleep(2);
      for (const s of (await pc.getStats()).values())
        if (s.type === "inbound-rtp" && s.kind === "video" && (s.framesDecoded || 0) > last) {
          last = s.framesDecoded; idle = -1; lat.rtc.push([last, wall(performance.now())]);
        }
      idle++;
    }
    pc.close();
  }

  Promise.all([mse(), rtc()]).catch((e) => { lat.error = e.message; }).finally(() => { lat.done = true; });
}
"""


def block_latencies(ready: FragmentArrivals, lat: dict, fps: int, skip: int) -> dict[str, list]:
    """Per block from `skip` on: its first frame's time on each path less the block's ready time
    (None where the path showed none of its frames): MSE's presented, WebRTC's decoded. (A WebRTC
    frame's presentation names it only by an RTP timestamp from a random origin, and the first
    frames presented are not always the first decoded: no frame index to hold it to.)"""
    starts = [sum(ready.frames[:i]) for i in range(len(ready.frames))]
    shown: dict[int, float] = {}
    for media_time, t in lat["mse"]:  # the first presentation of each frame
        shown.setdefault(round(media_time * fps), t / 1000)
    start = lat["rtcStart"]
    decoded = {start + n - 1: t / 1000 for n, t in lat["rtc"]}  # frame k decoded when the count reached it
    out: dict[str, list] = {"mse": [], "webrtc": []}
    for b in range(skip, len(starts)):
        f0, f1 = starts[b], starts[b] + ready.frames[b]
        for path, times in (("mse", shown), ("webrtc", decoded)):
            # the renderer may skip a frame; a frame decoded between two polls gets the later one
            k = min((k for k in times if f0 <= k < f1), default=None)
            out[path].append(None if k is None else times[k] - (k - f0) / fps - ready.arrivals[b])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="the live video's length")
    p.add_argument("--size", default="256x144")
    p.add_argument(
        "--skip", type=int, default=5, help="blocks left out: the start's, made ahead of real time (the live lead)"
    )
    p.add_argument("--json", help="write each block's ready time and latencies here")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the daemon's flags")
    a = p.parse_args()
    if CHROMIUM is None:
        raise SystemExit("chromium is not installed")
    from playwright.sync_api import sync_playwright

    flags = a.flags[1:] if a.flags[:1] == ["--"] else a.flags
    d = Daemon(*flags, "--size", a.size)
    try:
        model = http.get(d.url + "/v1/models", timeout=10).json()["data"][0]
        fps = model["fps"]
        with sync_playwright() as pw:
            browser = launch_chromium(pw)
            page = browser.new_page()
            page.goto(d.url + "/")
            page.wait_for_function("typeof codecFromInit === 'function'")
            body = {"prompt": "a red ball moving right on a blue background", "live": True, "seconds": a.seconds,
                    "size": a.size, "seed": 1, "stream": False}  # fmt: skip
            vid = http.post(d.url + "/v1/videos", json=body, timeout=30).json()["id"]
            ready = FragmentArrivals("GET", f"{d.url}/v1/videos/{vid}/content", clock=time.time)
            ready.start()
            page.evaluate(HARNESS, {"vid": vid})
            page.wait_for_function("window.lat.done", timeout=int((a.seconds + 120) * 1000), polling=500)
            lat = page.evaluate("window.lat")
            browser.close()
        ready.join(30)
        means = stage_means(d.url)
    finally:
        d.stop()
    if lat["error"]:
        raise SystemExit(f"in the page: {lat['error']}")
    got = block_latencies(ready, lat, fps, a.skip)
    dit, vae, enc = (means[k] * 1000 for k in ("dit", "vae", "encode"))
    print(f"cpu: {cpu_model()}, {os.cpu_count()} CPUs; {a.seconds:g} s live video at {a.size}, {fps} fps")
    print(f"stage balance: DiT {dit:.0f} ms, VAE {vae:.0f} ms, encode {enc:.0f} ms a block (DiT/VAE {dit / vae:.2f})")
    print(f"blocks: {len(ready.frames)} ({a.skip} left out); WebRTC joined at frame {lat['rtcStart']}")
    if a.json:
        t0 = ready.arrivals[0]
        rows = [{"block": a.skip + i, "ready_s": ready.arrivals[a.skip + i] - t0, "mse_s": m, "webrtc_s": w}
                for i, (m, w) in enumerate(zip(got["mse"], got["webrtc"], strict=True))]  # fmt: skip
        facts = {"cpu": cpu_model(), "size": a.size, "fps": fps, "stage_ms": {"dit": dit, "vae": vae, "encode": enc}}
        Path(a.json).write_text(json.dumps({**facts, "blocks": rows}, indent=1))
    for path, xs in got.items():
        xs = [x for x in xs if x is not None]
        if not xs:
            print(f"{path:>6}: no frame seen")
            continue
        xs.sort()
        p95 = xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]
        what = "presented" if path == "mse" else "decoded"
        print(
            f"{path:>6}: ready to first frame {what} p50 {1000 * statistics.median(xs):.0f} ms, "
            f"p95 {1000 * p95:.0f} ms, max {1000 * xs[-1]:.0f} ms over {len(xs)} blocks"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
