"""What the tests and the tools share: run the real daemon as a subprocess, stream from it, and
inspect MP4 bytes independently of streamdiff's own muxer (a separate box walker, PyAV's
decoder, ffprobe).

tests/ (through tests/helpers.py) and tools/ (tools/device/check.py) import it; nothing in the
daemon does. It needs the test extras (`pip install -e .[test]`: httpx, tokenizers,
transformers), and ffprobe where installed.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from .supervisor.topology import free_port, lost_its_port

ROOT = Path(__file__).resolve().parents[1]

# The client every test and tool request goes through: `http.get(...)` as `http.get(...)`,
# without what each top-level httpx call builds and throws away: a TLS context that loads the CA
# bundle, about 40 ms of CPU, for a plain-HTTP request to localhost (80 s of the suite's CPU
# over its thousands of requests). No connection is kept alive, as with httpx.get: a test that
# counts the daemon's connections or descriptors sees only the request in flight. httpx's
# clients are safe to share between threads.
http = httpx.Client(timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0))


# Flags that choose a layout: a Daemon given none of them runs one DiT and one VAE worker.
LAYOUT_FLAGS = {"--dit-gpus", "--vae-gpus", "--mode", "--devices", "--objective"}
DEFAULT_LAYOUT = ("--dit-gpus", "1", "--vae-gpus", "1")  # the tests' layout where none is given: not planned


# Starts of a Daemon whose free port was taken before it could listen (`Daemon.__init__`).
PORT_TRIES = 3


class Daemon:
    """streamdiffd in a subprocess on a free port with a unique instance name. `flags`: what
    every daemon of this process is started with as well (the test suite's calibration store,
    tests/conftest.py)."""

    flags: tuple[str, ...] = ()

    def __init__(
        self,
        *args: str,
        env: dict | None = None,
        wait: bool = True,
        timeout_s: float = 120,
        instance: str | None = None,
        prefix: tuple[str, ...] = (),
    ) -> None:
        """`prefix`: a command that runs the daemon (e.g. in a namespace of its own); it must exec
        it, so that the process started is the daemon's. A start whose port another process took
        between `free_port` and the daemon's bind (an outgoing connection's ephemeral port, say)
        is started again on another, up to PORT_TRIES times."""
        self.instance = instance or "t" + secrets.token_hex(4)
        if not LAYOUT_FLAGS & set(args):
            args = (*DEFAULT_LAYOUT, *args)
        for tries_left in range(PORT_TRIES - 1, -1, -1):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.log = tempfile.NamedTemporaryFile(prefix="streamdiffd-", suffix=".log", delete=False)
            cmd = [*prefix, sys.executable, "-m", "streamdiff.cli", "--port", str(self.port)]
            cmd += ["--instance", self.instance, *self.flags, *args]
            self.proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdout=self.log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
            if not wait:
                return
            try:
                self.wait_healthy(timeout_s)
                return
            except RuntimeError:
                if not tries_left or not lost_its_port(self.logs()):
                    raise

    def wait_healthy(self, timeout_s: float = 120) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"streamdiffd exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                r = http.get(self.url + "/health", timeout=2)
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"streamdiffd not healthy after {timeout_s}s:\n{self.logs()}")

    def wait_healthy_all(self, timeout_s: float = 120) -> dict:
        """Healthy and not degraded: every worker ready."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            h = self.wait_healthy(max(1.0, deadline - time.monotonic()))
            if not h["degraded"] and all(w["ready"] for w in h["workers"].values()):
                return h
            time.sleep(0.2)
        raise TimeoutError(f"streamdiffd not fully ready after {timeout_s}s:\n{self.logs()}")

    def health(self) -> dict:
        return http.get(self.url + "/health", timeout=5).json()

    def wait_idle(self, timeout_s: float = 60) -> dict:
        """The pipeline with nothing tracked and every ring slot free (a stream a test left or
        cancelled has ended): a shared daemon is handed over in this state."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            p = self.health()["pipeline"]
            if p["tracked"] == 0 and p["latent_slots_used"] == 0 and p["frame_slots_used"] == 0:
                return p
            time.sleep(0.1)
        raise AssertionError(f"pipeline not idle: {self.health()['pipeline']}")

    def logs(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-6000:]

    def children(self) -> list[int]:
        """Every process under the supervisor: its workers, their fork server, the resource tracker."""
        found, todo = [], [self.proc.pid]
        while todo:
            out = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True, text=True).stdout
            found += [int(p) for p in out.split()]
            todo += [int(p) for p in out.split()]
        return found

    def segments(self) -> list[str]:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"sd-{self.instance}-"))

    def stop(self, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def wait_until(pred, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise TimeoutError


def post_video(url: str, body: dict, **kw) -> httpx.Response:
    return http.post(url + "/v1/videos", json=body, timeout=kw.pop("timeout", 120), **kw)


def stream_video(url: str, body: dict, timeout: float = 300) -> tuple[bytes, list[tuple[float, int]], dict]:
    """POST with stream=true; returns (bytes, [(arrival time, cumulative bytes)], headers)."""
    chunks, arrivals = [], []
    t0 = time.monotonic()
    with http.stream("POST", url + "/v1/videos", json={**body, "stream": True}, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        headers = dict(r.headers)
        total = 0
        for chunk in r.iter_raw():
            chunks.append(chunk)
            total += len(chunk)
            arrivals.append((time.monotonic() - t0, total))
    return b"".join(chunks), arrivals, headers


# The real Wan 2.1 T2V 1.3B transformer as diffusers configures it (WanTransformer3DModel's
# keyword arguments): the tests' and the device check's references, other sizes by override.
WAN21_1_3B_DIFFUSERS = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=30,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)

TOKENIZER_WORDS = "a red fox runs through snow blue whale city at night".split()


def write_tokenizer(path: Path, words: list[str] = TOKENIZER_WORDS) -> None:
    """A word-level tokenizer in the Hugging Face layout, standing in for umT5's (the tests'
    checkpoints and tools/device/check.py's random release); `words` its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(str(path))


# ----------------------------------------------------------------------------- MP4 inspection


def boxes(data: bytes, start: int = 0, end: int | None = None) -> list[tuple[str, int, int]]:
    """(type, offset, size) of the boxes in data[start:end]."""
    end = len(data) if end is None else end
    out = []
    while start + 8 <= end:
        size, kind = struct.unpack(">I4s", data[start : start + 8])
        if size < 8:
            break
        out.append((kind.decode("latin-1"), start, size))
        start += size
    return out


def fragments(data: bytes) -> list[dict]:
    """Per moof: sequence number, decode time, sample count, first sample's sync flag, the
    emsg boxes in front of it, and the byte offset where the fragment ends."""
    out, pending_emsg = [], []
    for kind, off, size in boxes(data):
        if kind == "emsg":
            body = data[off + 12 : off + size]
            timescale, pts, _dur, _id = struct.unpack(">IQII", body[:20])
            rest = body[20:]
            scheme, rest = rest.split(b"\0", 1)
            value, message = rest.split(b"\0", 1)
            pending_emsg.append(
                {
                    "scheme": scheme.decode(),
                    "value": value.decode(),
                    "time": pts / timescale,
                    "message": json.loads(message),
                }
            )
        elif kind == "moof":
            info = {"offset": off, "emsg": pending_emsg}
            pending_emsg = []
            for k2, o2, s2 in boxes(data, off + 8, off + size):
                if k2 == "mfhd":
                    info["sequence"] = struct.unpack(">I", data[o2 + 12 : o2 + 16])[0]
                if k2 == "traf":
                    for k3, o3, _s3 in boxes(data, o2 + 8, o2 + s2):
                        if k3 == "tfdt":
                            info["decode_time"] = struct.unpack(">Q", data[o3 + 12 : o3 + 20])[0]
                        if k3 == "trun":
                            flags = struct.unpack(">I", data[o3 + 8 : o3 + 12])[0] & 0xFFFFFF
                            info["samples"] = struct.unpack(">I", data[o3 + 12 : o3 + 16])[0]
                            p = o3 + 20 + (4 if flags & 0x4 else 0)
                            per = 4 * sum(bool(flags & b) for b in (0x100, 0x200, 0x400, 0x800))
                            first_flags_at = p + 4 * sum(bool(flags & b) for b in (0x100, 0x200))
                            info["first_sync"] = bool(flags & 0x400) and not (
                                struct.unpack(">I", data[first_flags_at : first_flags_at + 4])[0] & 0x00010000
                            )
                            info["entry_bytes"] = per
            out.append(info)
        elif kind == "mdat" and out:
            out[-1]["end"] = off + size
    return out


class FragmentArrivals(threading.Thread):
    """A stream read as it comes, as a tool's player: each fragment's arrival on `clock` once its
    last byte is here, and its frame count; the response's `headers` once it starts. Only the
    bytes after the last whole fragment are parsed again as more come."""

    def __init__(self, method: str, url: str, json: dict | None = None, clock=time.monotonic) -> None:
        super().__init__(daemon=True)
        self.method, self.url, self.json, self.clock = method, url, json, clock
        self.arrivals: list[float] = []
        self.frames: list[int] = []
        self.headers: httpx.Headers = httpx.Headers()

    def run(self) -> None:
        data, done = bytearray(), 0  # done: the end of the last whole fragment
        with http.stream(self.method, self.url, json=self.json, timeout=600) as r:
            self.headers = r.headers
            for chunk in r.iter_raw():
                data += chunk
                now = self.clock()
                rest = bytes(data[done:])
                whole = [f for f in fragments(rest) if "end" in f and f["end"] <= len(rest)]
                for f in whole:
                    self.arrivals.append(now)
                    self.frames.append(f["samples"])
                if whole:
                    done += whole[-1]["end"]


def decode(data: bytes, strict: bool = True) -> dict:
    """Decode with PyAV (FFmpeg): frame count, size, rate, keyframe indices, the frames.
    strict=False: stop quietly at the first error, as a player does with a truncated file."""
    import av

    with av.open(io.BytesIO(data)) as c:
        s = c.streams.video[0]
        frames, keys, pts, error = [], [], [], None
        try:
            for i, f in enumerate(c.decode(s)):
                frames.append(f.to_ndarray(format="rgb24"))
                pts.append(f.pts)
                if f.key_frame:
                    keys.append(i)
        except av.error.FFmpegError as exc:
            if strict:
                raise
            error = str(exc)
        return {
            "frames": len(frames),
            "width": s.codec_context.width,
            "height": s.codec_context.height,
            "fps": float(s.average_rate or s.guessed_rate),
            "keyframes": keys,
            "pixels": frames,
            "pts": pts,
            "error": error,
        }


def ffprobe(data: bytes) -> dict | None:
    """Frame count and stream facts from ffprobe, when it is installed."""
    exe = shutil.which("ffprobe")
    if exe is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        f.write(data)
        f.flush()
        r = subprocess.run(
            [
                exe,
                "-v",
                "error",
                "-count_frames",
                "-select_streams",
                "v:0",
                "-show_entries",
                "stream=nb_read_frames,width,height,r_frame_rate,codec_name,profile",
                "-of",
                "json",
                f.name,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        s = json.loads(r.stdout)["streams"][0]
        errs = (
            subprocess.run(
                [shutil.which("ffmpeg") or "ffmpeg", "-v", "error", "-i", f.name, "-f", "null", "-"],
                capture_output=True,
                text=True,
                timeout=60,
            ).stderr
            if shutil.which("ffmpeg")
            else ""
        )
        return {
            "frames": int(s["nb_read_frames"]),
            "width": s["width"],
            "height": s["height"],
            "fps": s["r_frame_rate"],
            "codec": s["codec_name"],
            "profile": s.get("profile"),
            "decode_errors": errs.strip(),
        }


def check_video(data: bytes, frames: int, width: int, height: int, fps: int, blocks_expected: int | None = None):
    """A streamed MP4 checked three ways (the box walker, PyAV, ffprobe where installed): fragments
    numbered in order, each starting on a keyframe, evenly timed; `frames` frames of width x height
    at `fps`. Returns (fragments, decoded)."""
    frags = fragments(data)
    assert data[4:8] == b"ftyp"
    assert all(f["first_sync"] for f in frags), "every fragment must start with a keyframe"
    assert [f["sequence"] for f in frags] == list(range(1, len(frags) + 1))
    counts = [f["samples"] for f in frags]
    per_frame = frags[1]["decode_time"] // counts[0] if len(frags) > 1 else 0
    assert [f["decode_time"] for f in frags] == [per_frame * sum(counts[:i]) for i in range(len(frags))]
    if blocks_expected is not None:
        assert len(frags) == blocks_expected
    dec = decode(data)
    assert (dec["frames"], dec["width"], dec["height"]) == (frames, width, height)
    assert abs(dec["fps"] - fps) < 1e-6
    steps = {b - a for a, b in zip(dec["pts"], dec["pts"][1:])}
    assert len(steps) <= 1, f"presentation times are not evenly spaced: {sorted(steps)}"
    starts = [sum(counts[:i]) for i in range(len(counts))]
    assert dec["keyframes"] == starts  # keyframes exactly at fragment starts
    probe = ffprobe(data)
    if probe is not None:
        assert (probe["frames"], probe["width"], probe["height"]) == (frames, width, height)
        assert probe["fps"] == f"{fps}/1" and probe["codec"] == "h264"
        assert probe["decode_errors"] == ""
    return frags, dec


# Headless Chromium (Debian's package, driven by Playwright): the player page's tests and the
# viewer-latency benchmark launch it alike.
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--autoplay-policy=no-user-gesture-required",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def launch_chromium(playwright):
    """A headless Chromium from a `sync_playwright()` context."""
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)


def cpu_model() -> str:
    """This machine's CPU, as the benchmark pages name it."""
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or platform.machine()


def stage_means(url: str) -> dict[str, float]:
    """A daemon's mean DiT, VAE and encode seconds a block so far (its /metrics): the stage balance
    a benchmark records with its figure."""
    import re

    text = http.get(url + "/metrics", timeout=10).text
    out = {}
    for stage in ("dit", "vae", "encode"):
        s = re.search(rf'^streamdiff_stage_block_seconds_sum{{stage="{stage}"}} ([\d.e+-]+)$', text, re.M)
        n = re.search(rf'^streamdiff_stage_block_seconds_count{{stage="{stage}"}} ([\d.e+-]+)$', text, re.M)
        out[stage] = float(s[1]) / float(n[1]) if s and n and float(n[1]) else 0.0
    return out
