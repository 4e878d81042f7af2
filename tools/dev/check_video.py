#!/usr/bin/env python3
"""Does a video show its prompt? For prompts of the synthetic grammar ("a red ball moving left
on a blue background"): the object's colour and direction of motion read from the decoded
frames (streamdiff/synthetic.py) against the prompt. Prints one JSON line per video; exit 1 if
any is wrong.

  tools/dev/check_video.py out.mp4 "a red ball moving left on a blue background"
  tools/dev/check_video.py --frames 0:48 story.mp4 "a red ball moving left on a blue background"

Or asks a running daemon for the grammar's held-out prompts (the embedded default never trained
on them, synthetic.HELD_OUT), one video each, and prints each verdict and the share right; exit 1
if a share is under its bar:

  tools/dev/check_video.py --url http://127.0.0.1:8000 --held-out 24 --size 256x144
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

import av
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from streamdiff.synthetic import HELD_OUT, Caption, check, held_out_prompts  # noqa: E402


def frames_of(path: str) -> np.ndarray:
    with av.open(path) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])


def verdict(frames: np.ndarray, want: Caption) -> dict:
    got = check(frames)
    return {
        "prompt": want.prompt,
        "colour": got.colour,
        "direction": got.direction,
        "background": got.background,
        "colour_ok": got.colour == want.colour,
        "direction_ok": got.direction == want.direction,
    }


def held_out(a: argparse.Namespace) -> int:
    """One streamed video per held-out prompt from the daemon at `a.url`, judged as it arrives."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, cap in enumerate(held_out_prompts()[: a.held_out]):
            body = {"prompt": cap.prompt, "seconds": a.seconds, "size": a.size, "seed": a.seed + i, "stream": True}
            req = urllib.request.Request(
                f"{a.url}/v1/videos", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            path = Path(tmp) / f"{i}.mp4"
            with urllib.request.urlopen(req, timeout=600) as r:
                path.write_bytes(r.read())
            rows.append(verdict(frames_of(str(path)), cap))
            print(json.dumps(rows[-1]), flush=True)
    colour = sum(r["colour_ok"] for r in rows) / len(rows)
    direction = sum(r["direction_ok"] for r in rows) / len(rows)
    print(json.dumps({"prompts": len(rows), "size": a.size, "colour": colour, "direction": direction}))
    return 0 if colour >= a.need_colour and direction >= a.need_direction else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("video", nargs="?")
    ap.add_argument("prompt", nargs="?")
    ap.add_argument("--frames", help="START:STOP, the frames to judge (a storyboard's scene)")
    ap.add_argument("--url", help="a running daemon to ask for the held-out prompts")
    ap.add_argument("--held-out", type=int, default=24, help=f"how many of the {HELD_OUT} held-out prompts")
    ap.add_argument("--size", default="256x144")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=1000, help="the first video's seed (then +1 each)")
    ap.add_argument("--need-colour", type=float, default=0.9, help="the share of colours right to pass")
    ap.add_argument("--need-direction", type=float, default=0.8, help="the share of directions right to pass")
    a = ap.parse_args()
    if a.url:
        if not 1 <= a.held_out <= HELD_OUT:
            ap.error(f"--held-out must be 1-{HELD_OUT}, got {a.held_out}")
        return held_out(a)
    if not (a.video and a.prompt):
        ap.error("give VIDEO and PROMPT, or --url")
    want = Caption.parse(a.prompt)
    frames = frames_of(a.video)
    if a.frames:
        start, stop = (int(v) if v else None for v in a.frames.split(":"))
        frames = frames[start:stop]
    row = verdict(frames, want)
    print(json.dumps({"video": a.video, **row}))
    return 0 if row["colour_ok"] and row["direction_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
