"""H.264 encoders and the CMAF writer, checked with FFmpeg's decoder and an independent box walker."""

from __future__ import annotations

import logging
import shutil
import struct

import numpy as np
import pytest

from streamdiff.media import encoder as enc_mod
from streamdiff.media.cmaf import codec_string, split_annexb
from streamdiff.media.encoder import FragmentWriter, PyAVEncoder, open_encoder

from ..helpers import boxes, decode, ffprobe, fragments

W, H, FPS = 128, 64, 16
BLOCKS = [9, 12, 12, 5]


def frames(n: int, start: int) -> np.ndarray:
    x = np.zeros((n, H, W, 3), np.uint8)
    for t in range(n):
        x[t, :, :, 0] = (np.arange(W)[None, :] * 2 + 5 * (start + t)) % 256
        x[t, :, :, 1] = np.arange(H)[:, None] * 3
        x[t, :, :, 2] = (start + t) * 7 % 256
    return x


def write_stream(kind: str, keyframe_every: int = 1) -> bytes:
    starts = [sum(BLOCKS[:i]) for i in range(len(BLOCKS))]
    enc = open_encoder(kind, W, H, FPS, [s for i, s in enumerate(starts) if i % keyframe_every == 0])
    fw = FragmentWriter(enc, W, H, FPS)
    out = fw.init_segment()
    for i, n in enumerate(BLOCKS):
        events = [(0, str(i), b'{"scene": %d}' % i)] if i in (0, 2) else []
        out += fw.fragment(frames(n, starts[i]), i % keyframe_every == 0, events)
    fw.close()
    return out


KINDS = ["libx264"] + (["ffmpeg-libx264"] if shutil.which("ffmpeg") else [])


@pytest.mark.parametrize("kind", KINDS)
def test_fragments_decode_with_keyframes_at_block_starts(kind):
    data = write_stream(kind)
    kinds = [k for k, _, _ in boxes(data)]
    assert kinds[:2] == ["ftyp", "moov"] and kinds.count("moof") == len(BLOCKS) and kinds.count("emsg") == 2
    ftyp = data[8 : boxes(data)[0][2]]
    assert ftyp[:4] == b"cmfc" and b"iso6" in ftyp  # CMAF brands
    frags = fragments(data)
    assert [f["samples"] for f in frags] == BLOCKS and all(f["first_sync"] for f in frags)
    assert [f["decode_time"] for f in frags] == [1000 * sum(BLOCKS[:i]) for i in range(len(BLOCKS))]
    assert [e["message"]["scene"] for f in frags for e in f["emsg"]] == [0, 2]
    assert frags[2]["emsg"][0]["time"] == sum(BLOCKS[:2]) / FPS
    dec = decode(data)
    assert dec["frames"] == sum(BLOCKS) and dec["keyframes"] == [0, 9, 21, 33]
    ref = np.concatenate([frames(n, sum(BLOCKS[:i])) for i, n in enumerate(BLOCKS)])
    psnr = [10 * np.log10(255**2 / max(1e-9, np.mean((a.astype(float) - b) ** 2))) for a, b in zip(dec["pixels"], ref)]
    assert min(psnr) > 30  # the pictures survive encoding
    probe = ffprobe(data)
    if probe is not None:
        assert probe["frames"] == sum(BLOCKS) and probe["profile"] == "Constrained Baseline"
        assert probe["decode_errors"] == ""


def test_gop_spanning_fragments():
    frags = fragments(write_stream("libx264", keyframe_every=2))
    assert [f["first_sync"] for f in frags] == [True, False, True, False]
    assert decode(write_stream("libx264", keyframe_every=2))["keyframes"] == [0, 21]


def test_avcc_init_and_codec_string():
    enc = PyAVEncoder(W, H, FPS)
    assert enc.sps[0] & 0x1F == 7 and enc.pps[0] & 0x1F == 8
    assert codec_string(enc.sps).startswith("avc1.42")  # Constrained Baseline
    data = FragmentWriter(enc, W, H, FPS).init_segment()
    i = data.index(b"avcC")
    assert data[i + 4] == 1 and data[i + 5 : i + 8] == enc.sps[1:4]
    n = struct.unpack(">H", data[i + 10 : i + 12])[0]
    assert data[i + 12 : i + 12 + n] == enc.sps


def test_annexb_split_handles_3_and_4_byte_start_codes():
    stream = b"\x00\x00\x00\x01\x67\xaa" + b"\x00\x00\x01\x68\xbb\x00" + b"\x00\x00\x00\x01\x65\xcc\xdd"
    assert split_annexb(stream) == [b"\x67\xaa", b"\x68\xbb", b"\x65\xcc\xdd"]


def test_missing_hardware_encoder_falls_back_to_libx264(caplog, monkeypatch):
    monkeypatch.setattr(enc_mod, "_HW_PROBE", {})
    with caplog.at_level(logging.WARNING, logger="streamdiff.media.encoder"):
        enc = open_encoder("h264_nvenc", W, H, FPS, [0])
    if enc_mod._HW_PROBE.get("h264_nvenc:None"):
        pytest.skip("this machine has a working NVENC")
    assert isinstance(enc, PyAVEncoder)
    assert "h264_nvenc not available here; falling back to libx264" in caplog.text
    auto = open_encoder("auto", W, H, FPS, [0])  # the first working hardware encoder, else libx264
    assert isinstance(auto, PyAVEncoder) == (not any(enc_mod._HW_PROBE.values()))
    auto.close()


def hard_cut_frames(n: int, cut: int, seed: int = 0) -> np.ndarray:
    """Smooth moving noise, then at frame `cut` an unrelated picture: a scene cut x264 would
    answer with an IDR frame of its own unless scenecut is off."""
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, 256, (2, H // 8, W // 8, 3), dtype=np.uint8)
    out = np.empty((n, H, W, 3), np.uint8)
    for t in range(n):
        src = a if t < cut else 255 - b
        out[t] = np.roll(np.kron(src, np.ones((8, 8, 1), np.uint8)), t, axis=1)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_a_hard_cut_inside_a_block_adds_no_keyframe(kind):
    blocks = [12, 12]
    enc = open_encoder(kind, W, H, FPS, [0, 12])
    fw = FragmentWriter(enc, W, H, FPS)
    out = fw.init_segment()
    for i, n in enumerate(blocks):
        out += fw.fragment(hard_cut_frames(n, cut=6, seed=i), True, [])
    fw.close()
    dec = decode(out)
    assert dec["frames"] == 24 and dec["keyframes"] == [0, 12]
    assert all(f["first_sync"] for f in fragments(out))


@pytest.mark.parametrize("kind", KINDS)
def test_a_long_gop_gets_no_periodic_keyframe(kind):
    """300 frames in 25 blocks with one keyframe at the start (keyframe_every_blocks large):
    x264's default keyint (250) would start a new GOP inside block 20."""
    enc = open_encoder(kind, W, H, FPS, [0])
    fw = FragmentWriter(enc, W, H, FPS)
    out = fw.init_segment()
    for i in range(25):
        out += fw.fragment(frames(12, 12 * i), i == 0, [])
    fw.close()
    assert decode(out)["keyframes"] == [0]
