#!/usr/bin/env python3
"""A small streamdiff client (standard library only): stream a prompt or a storyboard to an
MP4 file while it is generated, printing each fragment and scene as it arrives.

  python examples/client.py "a red fox running through snow" --seconds 4 -o fox.mp4
  python examples/client.py --scene "a fox in snow|3" --scene "the fox at a lake|3|continue" \\
      --scene "a city at night|3|cut" -o story.mp4
"""

from __future__ import annotations

import argparse
import base64
import json
import struct
import sys
import time
import urllib.error
import urllib.request


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt", nargs="?")
    ap.add_argument("--scene", action="append", default=[], help="PROMPT|SECONDS[|cut|continue]")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--size", help="WIDTHxHEIGHT (default: the model's)")
    ap.add_argument("--fps", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", help="bearer key, if the server requires one")
    ap.add_argument("-o", "--out", default="out.mp4")
    ap.add_argument("--image", help="image-to-video: the first frame (PNG, JPEG or WebP), sent as input_reference")
    a = ap.parse_args()
    if bool(a.prompt) == bool(a.scene):
        ap.error("give a prompt or --scene options")
    body: dict = {"stream": True}
    if a.prompt:
        body.update(prompt=a.prompt, seconds=a.seconds)
    else:
        body["scenes"] = []
        for spec in a.scene:
            parts = spec.split("|")
            scene = {"prompt": parts[0], "seconds": float(parts[1]) if len(parts) > 1 else a.seconds}
            if len(parts) > 2:
                scene["transition"] = parts[2]
            body["scenes"].append(scene)
    for key in ("size", "fps", "seed"):
        if getattr(a, key) is not None:
            body[key] = getattr(a, key)
    if a.image:  # a data URL in the JSON body (the server also takes a multipart file)
        kind = {"jpg": "jpeg"}.get(a.image.rsplit(".", 1)[-1].lower(), a.image.rsplit(".", 1)[-1].lower())
        with open(a.image, "rb") as f:
            body["input_reference"] = f"data:image/{kind};base64," + base64.b64encode(f.read()).decode()
    headers = {"Content-Type": "application/json"}
    if a.api_key:
        headers["Authorization"] = f"Bearer {a.api_key}"
    req = urllib.request.Request(a.url + "/v1/videos", json.dumps(body).encode(), headers, method="POST")
    t0 = time.monotonic()
    try:
        resp = urllib.request.urlopen(req, timeout=600)
    except urllib.error.HTTPError as exc:
        print(f"error {exc.code}: {json.loads(exc.read())['error']['message']}", file=sys.stderr)
        return 1
    print(f"video {resp.headers['X-Video-Id']} -> {a.out}")
    buf, frames, fragments = b"", 0, 0
    with open(a.out, "wb") as f:
        while chunk := resp.read1(1 << 16):
            f.write(chunk)
            buf += chunk
            while len(buf) >= 8:  # walk complete top-level boxes
                size, kind = struct.unpack(">I4s", buf[:8])
                if len(buf) < size:
                    break
                box, buf = buf[:size], buf[size:]
                if kind == b"emsg":
                    msg = json.loads(box[box.index(b"\0", 32) + 1 :].split(b"\0", 1)[1])
                    print(f"  scene {msg['scene'] + 1} at frame {msg['start_frame']}: {msg['prompt']}")
                elif kind == b"moof":
                    i = box.index(b"trun")
                    frames += struct.unpack(">I", box[i + 8 : i + 12])[0]
                    fragments += 1
                    print(f"  {time.monotonic() - t0:6.2f}s fragment {fragments}: {frames} frames")
    print(f"done: {frames} frames in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
