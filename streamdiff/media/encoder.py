"""H.264 encoding of a session's blocks into CMAF fragments (runs in the supervisor process).

Two encoders behind one interface, chosen by config:

- `PyAVEncoder`: libx264 in-process through PyAV (ultrafast, zero-latency: every frame's packet
  comes out as the frame goes in, no B-frames), the default and the fallback.
- `FFmpegEncoder`: an FFmpeg child process, for the hardware encoders (`h264_nvenc` on NVIDIA,
  `h264_vaapi` on Intel, `h264_qsv`); raw RGB in on stdin, FLV out on stdout (each packet a
  sized tag), read by a thread.

`open_encoder` probes the requested hardware encoder once with a one-frame trial and falls back
to libx264 with a log line when the device or the encoder is missing.

A fragment starts with an IDR frame when asked (a block start, every `keyframe_every_blocks`
blocks), forced through x264's `forced-idr` / FFmpeg's `-force_key_frames`.
"""

from __future__ import annotations

import logging
import queue
import shutil
import subprocess
import threading
from fractions import Fraction

import numpy as np

from .cmaf import (
    Sample,
    avcc_parameter_sets,
    emsg,
    filter_avcc,
    init_segment,
    media_fragment,
    parameter_sets,
    to_avcc_sample,
)

log = logging.getLogger(__name__)

HW_ENCODERS = ("h264_nvenc", "h264_vaapi", "h264_qsv")


class EncoderError(RuntimeError):
    pass


class PyAVEncoder:
    name = "libx264"

    def __init__(
        self, width: int, height: int, fps: int, crf: int = 23, profile: str = "baseline", threads: int = 1
    ) -> None:
        import av

        self._av = av
        c = av.CodecContext.create("libx264", "w")
        c.width, c.height, c.pix_fmt = width, height, "yuv420p"
        c.time_base, c.framerate = Fraction(1, fps), Fraction(fps, 1)
        c.flags |= av.codec.context.Flags.global_header  # SPS/PPS in extradata, for avcC
        c.thread_count = threads
        # preset, tune, profile, crf and forced-idr are options of FFmpeg's libx264 wrapper;
        # x264's own settings go through x264-params (PyAV drops option names FFmpeg does not
        # know without a word). IDR frames come only where a fragment asks for one: no scene-cut
        # detection, no periodic keyframe (x264's default keyint of 250 would put one inside a
        # block of a long GOP), no B-frames (every frame's packet leaves as the frame goes in).
        c.options = {
            "preset": "ultrafast",
            "tune": "zerolatency",
            "profile": profile,
            "crf": str(crf),
            "forced-idr": "1",
            "x264-params": "scenecut=0:keyint=infinite:bframes=0",
        }
        c.open()
        self._ctx = c
        self._pts = 0
        self.sps, self.pps = parameter_sets(bytes(c.extradata))

    def encode(self, frames: np.ndarray, idr_first: bool) -> list[Sample]:
        av = self._av
        out: list[Sample] = []
        for i, rgb in enumerate(frames):
            f = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24").reformat(format="yuv420p")
            f.pts = self._pts
            self._pts += 1
            if i == 0 and idr_first:
                f.pict_type = av.video.frame.PictureType.I
            for p in self._ctx.encode(f):
                data, idr = to_avcc_sample(bytes(p))
                out.append(Sample(data, idr))
        if len(out) != len(frames):  # zero-latency x264 never holds frames back
            raise EncoderError(f"libx264 returned {len(out)} packets for {len(frames)} frames")
        return out

    def close(self) -> None:
        self._ctx = None


class FFmpegEncoder:
    """Hardware (or any FFmpeg) H.264 encoder in a child process.

    The child writes FLV to stdout: every packet is a tag with an explicit size, in AVCC form,
    and the first video tag carries the avcC record, so a packet is complete as soon as its tag
    is (a raw Annex B stream only shows where a frame ends when the next one begins).
    """

    def __init__(
        self,
        codec: str,
        width: int,
        height: int,
        fps: int,
        keyframe_times: list[float],
        bitrate_kbps: int = 0,
        device: str | None = None,
        ffmpeg: str = "ffmpeg",
        timeout_s: float = 30.0,
    ) -> None:
        self.name = codec
        self.width, self.height, self.timeout_s = width, height, timeout_s
        cmd = [ffmpeg, "-hide_banner", "-loglevel", "error", "-nostdin"]
        if codec == "h264_vaapi":
            cmd += ["-vaapi_device", device or "/dev/dri/renderD128"]
        cmd += ["-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{width}x{height}", "-r", str(fps), "-i", "pipe:0"]
        if codec == "h264_vaapi":
            cmd += ["-vf", "format=nv12,hwupload"]
        else:
            cmd += ["-pix_fmt", "yuv420p"]
        cmd += ["-c:v", codec, "-bf", "0", "-g", "100000"]
        if codec == "h264_nvenc":
            cmd += ["-preset", "p1", "-tune", "ull", "-zerolatency", "1", "-delay", "0", "-forced-idr", "1"]
        elif codec == "libx264":
            cmd += ["-preset", "ultrafast", "-tune", "zerolatency", "-forced-idr", "1"]
            cmd += ["-x264-params", "scenecut=0:keyint=infinite:bframes=0"]
        elif codec == "h264_qsv":
            cmd += ["-preset", "veryfast", "-async_depth", "1", "-forced_idr", "1"]
        if bitrate_kbps:
            cmd += ["-b:v", f"{bitrate_kbps}k"]
        if keyframe_times:
            cmd += ["-force_key_frames", ",".join(f"{t:.6f}" for t in keyframe_times)]
        cmd += ["-flush_packets", "1", "-f", "flv", "pipe:1"]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._packets: queue.Queue[tuple[bytes, bool] | None] = queue.Queue()
        self.sps = self.pps = None
        self._reader = threading.Thread(target=self._read, name=f"{codec}-reader", daemon=True)
        self._reader.start()

    def _read_exact(self, n: int) -> bytes | None:
        data = self._proc.stdout.read(n)
        return data if data is not None and len(data) == n else None

    def _read(self) -> None:
        """FLV: 9-byte header + u32, then tags: type u8, size u24, timestamp u24+u8, stream u24,
        data, previous-tag-size u32. Video data: frame type/codec u8, AVC packet type u8
        (0 = avcC, 1 = NAL units), composition time s24, payload."""
        if self._read_exact(13) is None:
            self._packets.put(None)
            return
        while True:
            head = self._read_exact(11)
            if head is None:
                break
            size = int.from_bytes(head[1:4], "big")
            data = self._read_exact(size + 4)
            if data is None:
                break
            if head[0] != 9 or size < 5:  # not video (script data)
                continue
            keyframe, kind, payload = (data[0] >> 4) == 1, data[1], data[5:size]
            if kind == 0:
                self.sps, self.pps = avcc_parameter_sets(payload)
            elif kind == 1:
                self._packets.put((payload, keyframe))
        self._packets.put(None)

    def encode(self, frames: np.ndarray, idr_first: bool) -> list[Sample]:
        # The keyframe positions were given to FFmpeg up front (-force_key_frames): idr_first is
        # already decided by the session's plan.
        try:
            self._proc.stdin.write(np.ascontiguousarray(frames).tobytes())
            self._proc.stdin.flush()
        except BrokenPipeError as exc:
            raise EncoderError(f"{self.name}: {self._stderr()}") from exc
        out: list[Sample] = []
        while len(out) < len(frames):
            try:
                packet = self._packets.get(timeout=self.timeout_s)
            except queue.Empty:
                raise EncoderError(
                    f"{self.name} held frames back for {self.timeout_s}s (needs a zero-latency mode)"
                ) from None
            if packet is None:
                raise EncoderError(f"{self.name} exited: {self._stderr()}")
            data, _ = packet
            out.append(Sample(*filter_avcc(data)))
        return out

    def _stderr(self) -> str:
        try:
            self._proc.wait(timeout=2)
            return self._proc.stderr.read().decode(errors="replace").strip()[-500:]
        except Exception:
            return "(no diagnostics)"

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._reader.join(timeout=5)


_HW_PROBE: dict[str, bool] = {}


def hardware_available(codec: str, device: str | None = None, ffmpeg: str = "ffmpeg") -> bool:
    """One-frame trial encode (cached per process): the encoder must exist and the device work."""
    key = f"{codec}:{device}"
    if key not in _HW_PROBE:
        if shutil.which(ffmpeg) is None:
            _HW_PROBE[key] = False
        else:
            try:
                enc = FFmpegEncoder(codec, 256, 144, 16, [0.0], device=device, ffmpeg=ffmpeg, timeout_s=10)
                enc.encode(np.zeros((1, 144, 256, 3), np.uint8), True)
                enc.close()
                _HW_PROBE[key] = True
            except Exception as exc:  # missing encoder, no device, driver error
                log.info("encoder %s unavailable: %s", codec, str(exc).splitlines()[-1] if str(exc) else exc)
                _HW_PROBE[key] = False
    return _HW_PROBE[key]


def open_encoder(
    kind: str,
    width: int,
    height: int,
    fps: int,
    keyframe_frames: list[int],
    crf: int = 23,
    bitrate_kbps: int = 0,
    device: str | None = None,
):
    """kind: 'libx264' (in-process), 'auto' (first working hardware encoder, else libx264),
    'ffmpeg-libx264' (the child-process path with a software codec), or a hardware codec name."""
    codec = kind
    if kind == "auto":
        codec = next((c for c in HW_ENCODERS if hardware_available(c, device)), "libx264")
    elif kind in HW_ENCODERS and not hardware_available(kind, device):
        log.warning("hardware encoder %s not available here; falling back to libx264", kind)
        codec = "libx264"
    if codec == "libx264":
        return PyAVEncoder(width, height, fps, crf=crf)
    child_codec = "libx264" if codec == "ffmpeg-libx264" else codec
    return FFmpegEncoder(child_codec, width, height, fps, [f / fps for f in keyframe_frames], bitrate_kbps, device)


class FragmentWriter:
    """One session's CMAF stream: the init segment, then one fragment per block."""

    def __init__(self, encoder, width: int, height: int, fps: int) -> None:
        self.encoder, self.width, self.height = encoder, width, height
        self.timescale = 1000 * fps  # every frame lasts exactly 1000 ticks
        self.sequence = 0
        self.decode_time = 0
        self.frames = 0
        self._init_sent = False

    def init_segment(self) -> bytes:
        """The init segment, once; empty until the encoder knows its SPS/PPS (child-process
        encoders learn them from the first frame), in which case it leads the first fragment."""
        if self._init_sent or self.encoder.sps is None:
            return b""
        self._init_sent = True
        return init_segment(self.width, self.height, self.timescale, self.encoder.sps, self.encoder.pps)

    def fragment(self, frames: np.ndarray, idr_first: bool, events: list[tuple] = ()) -> bytes:
        """events: (frame offset in this block, value, message[, scheme]) -> emsg boxes before the
        moof (the scene scheme where none is named: plan.scene_marker; controls.control_marker)."""
        samples = self.encoder.encode(frames, idr_first)
        self.sequence += 1
        prefix = b"".join(
            emsg(self.timescale, self.decode_time + 1000 * off, 0, self.sequence * 100 + k, value, msg, *scheme)
            for k, (off, value, msg, *scheme) in enumerate(events)
        )
        out = self.init_segment() + media_fragment(self.sequence, self.decode_time, 1000, samples, prefix)
        self.decode_time += 1000 * len(samples)
        self.frames += len(samples)
        return out

    def close(self) -> None:
        self.encoder.close()


__all__ = ["EncoderError", "FFmpegEncoder", "FragmentWriter", "PyAVEncoder", "open_encoder"]
