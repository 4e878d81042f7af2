"""CMAF / fragmented MP4 writer for one H.264 track (runs in the supervisor process).

We write the boxes ourselves because PyAV's mp4 muxer emits fragment N only when fragment N+1
starts (one GOP late): a stream must hand out each block's fragment the moment its frames are
encoded. Layout (ISO/IEC 14496-12, CMAF brand `cmfc`):

    init:      ftyp | moov( mvhd, trak( tkhd, mdia( mdhd, hdlr, minf( vmhd, dinf, stbl( stsd(avc1(avcC)),
                                                  stts, stsc, stsz, stco )))), mvex( trex ))
    fragment:  [emsg]* | moof( mfhd(seq), traf( tfhd(default-base-is-moof, duration), tfdt(v1), trun )) | mdat

`trun` carries the data offset from the start of `moof`, a size and flags per sample; `tfdt`
is the sum of all earlier durations, so fragments play back to back as one timeline.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

SYNC_SAMPLE = 0x02000000  # sample_depends_on=2 (I-frame), not a non-sync sample
NON_SYNC_SAMPLE = 0x01010000  # depends on others, is_non_sync_sample=1
SCENE_SCHEME = "urn:streamdiff:scene:2026"
MATRIX = (0x00010000, 0, 0, 0, 0x00010000, 0, 0, 0, 0x40000000)


def box(kind: bytes, *parts: bytes) -> bytes:
    body = b"".join(parts)
    return struct.pack(">I", 8 + len(body)) + kind + body


def full_box(kind: bytes, version: int, flags: int, *parts: bytes) -> bytes:
    return box(kind, struct.pack(">I", (version << 24) | flags), *parts)


# ----------------------------------------------------------------------------- H.264 bitstream


def split_annexb(data: bytes) -> list[bytes]:
    """NAL units of an Annex B byte stream (3- or 4-byte start codes).

    Trailing zero bytes are dropped: they belong to the next 4-byte start code (or are
    trailing_zero_8bits), and H.264 forbids a NAL unit whose last byte is 0x00.
    """
    starts, i = [], data.find(b"\x00\x00\x01")
    while i >= 0:
        starts.append(i + 3)
        i = data.find(b"\x00\x00\x01", i + 3)
    nals = []
    for k, s in enumerate(starts):
        nal = data[s : starts[k + 1] - 3 if k + 1 < len(starts) else len(data)].rstrip(b"\x00")
        if nal:
            nals.append(nal)
    return nals


def nal_type(nal: bytes) -> int:
    return nal[0] & 0x1F


def to_avcc_sample(annexb: bytes) -> tuple[bytes, bool]:
    """Annex B access unit -> (length-prefixed sample without SPS/PPS/AUD, is_idr)."""
    out, idr = [], False
    for nal in split_annexb(annexb):
        t = nal_type(nal)
        if t in (7, 8, 9):  # SPS, PPS live in avcC; access unit delimiters are not needed
            continue
        idr |= t == 5
        out.append(struct.pack(">I", len(nal)) + nal)
    return b"".join(out), idr


def filter_avcc(data: bytes) -> tuple[bytes, bool]:
    """AVCC sample -> (the same without SPS/PPS/AUD NAL units, is_idr)."""
    out, idr, i = [], False, 0
    while i + 4 <= len(data):
        n = struct.unpack(">I", data[i : i + 4])[0]
        nal = data[i + 4 : i + 4 + n]
        i += 4 + n
        t = nal_type(nal) if nal else 0
        if t in (7, 8, 9) or not nal:
            continue
        idr |= t == 5
        out.append(struct.pack(">I", len(nal)) + nal)
    return b"".join(out), idr


def avcc_parameter_sets(record: bytes) -> tuple[bytes, bytes]:
    """SPS and PPS from an AVCDecoderConfigurationRecord (avcC body)."""
    i = 6
    n = struct.unpack(">H", record[i : i + 2])[0]
    sps = record[i + 2 : i + 2 + n]
    i += 2 + n + 1
    n = struct.unpack(">H", record[i : i + 2])[0]
    return sps, record[i + 2 : i + 2 + n]


def parameter_sets(annexb: bytes) -> tuple[bytes, bytes]:
    sps = pps = None
    for nal in split_annexb(annexb):
        if nal_type(nal) == 7 and sps is None:
            sps = nal
        elif nal_type(nal) == 8 and pps is None:
            pps = nal
    if sps is None or pps is None:
        raise ValueError("the encoder produced no SPS/PPS")
    return sps, pps


def codec_string(sps: bytes) -> str:
    """RFC 6381 codec string for MSE, e.g. avc1.42c01e."""
    return "avc1." + sps[1:4].hex()


# ----------------------------------------------------------------------------- boxes


def _avcc(sps: bytes, pps: bytes) -> bytes:
    body = bytes([1, sps[1], sps[2], sps[3], 0xFF, 0xE1]) + struct.pack(">H", len(sps)) + sps
    body += bytes([1]) + struct.pack(">H", len(pps)) + pps
    if sps[1] in (100, 110, 122, 144):  # High profiles carry chroma format and bit depths
        body += bytes([0xFC | 1, 0xF8, 0xF8, 0])
    return box(b"avcC", body)


def init_segment(width: int, height: int, timescale: int, sps: bytes, pps: bytes) -> bytes:
    ftyp = box(b"ftyp", b"cmfc", struct.pack(">I", 0), b"cmfc", b"iso6", b"mp41")
    mvhd = full_box(
        b"mvhd",
        0,
        0,
        struct.pack(">IIII", 0, 0, timescale, 0),
        struct.pack(">IH", 0x00010000, 0x0100),
        bytes(10),
        struct.pack(">9I", *MATRIX),
        bytes(24),
        struct.pack(">I", 2),
    )
    tkhd = full_box(
        b"tkhd",
        0,
        3,
        struct.pack(">IIIII", 0, 0, 1, 0, 0),
        bytes(8),
        struct.pack(">hhhH", 0, 0, 0, 0),
        struct.pack(">9I", *MATRIX),
        struct.pack(">II", width << 16, height << 16),
    )
    mdhd = full_box(b"mdhd", 0, 0, struct.pack(">IIII", 0, 0, timescale, 0), struct.pack(">HH", 0x55C4, 0))
    hdlr = full_box(b"hdlr", 0, 0, struct.pack(">I", 0), b"vide", bytes(12), b"streamdiff video\x00")
    name = b"streamdiff H.264"
    avc1 = box(
        b"avc1",
        bytes(6),
        struct.pack(">H", 1),
        bytes(16),
        struct.pack(">HH", width, height),
        struct.pack(">II", 0x00480000, 0x00480000),
        struct.pack(">I", 0),
        struct.pack(">H", 1),
        bytes([len(name)]) + name + bytes(31 - len(name)),
        struct.pack(">Hh", 0x0018, -1),
        _avcc(sps, pps),
    )
    stbl = box(
        b"stbl",
        full_box(b"stsd", 0, 0, struct.pack(">I", 1), avc1),
        full_box(b"stts", 0, 0, struct.pack(">I", 0)),
        full_box(b"stsc", 0, 0, struct.pack(">I", 0)),
        full_box(b"stsz", 0, 0, struct.pack(">II", 0, 0)),
        full_box(b"stco", 0, 0, struct.pack(">I", 0)),
    )
    dinf = box(b"dinf", full_box(b"dref", 0, 0, struct.pack(">I", 1), full_box(b"url ", 0, 1)))
    minf = box(b"minf", full_box(b"vmhd", 0, 1, bytes(8)), dinf, stbl)
    trak = box(b"trak", tkhd, box(b"mdia", mdhd, hdlr, minf))
    mvex = box(b"mvex", full_box(b"trex", 0, 0, struct.pack(">IIIII", 1, 1, 0, 0, 0)))
    return ftyp + box(b"moov", mvhd, trak, mvex)


def emsg(
    timescale: int,
    presentation_time: int,
    duration: int,
    event_id: int,
    value: str,
    message: bytes,
    scheme: str = SCENE_SCHEME,
) -> bytes:
    """A version-1 event message box (timed metadata, e.g. the start of a scene)."""
    return full_box(
        b"emsg",
        1,
        0,
        struct.pack(">IQII", timescale, presentation_time, duration, event_id),
        scheme.encode() + b"\x00",
        value.encode() + b"\x00",
        message,
    )


@dataclass
class Sample:
    data: bytes  # AVCC (length-prefixed NAL units)
    keyframe: bool


def media_fragment(
    sequence: int, decode_time: int, sample_duration: int, samples: Iterable[Sample], prefix: bytes = b""
) -> bytes:
    """prefix (emsg boxes) + moof + mdat for consecutive samples of equal duration."""
    samples = list(samples)
    if not samples:
        raise ValueError("a fragment needs at least one sample")
    entries = b"".join(struct.pack(">II", len(s.data), SYNC_SAMPLE if s.keyframe else NON_SYNC_SAMPLE) for s in samples)

    def moof(data_offset: int) -> bytes:
        tfhd = full_box(b"tfhd", 0, 0x020008, struct.pack(">II", 1, sample_duration))
        tfdt = full_box(b"tfdt", 1, 0, struct.pack(">Q", decode_time))
        trun = full_box(b"trun", 0, 0x000601, struct.pack(">Ii", len(samples), data_offset), entries)
        return box(b"moof", full_box(b"mfhd", 0, 0, struct.pack(">I", sequence)), box(b"traf", tfhd, tfdt, trun))

    size = len(moof(0))
    mdat = box(b"mdat", *(s.data for s in samples))
    return prefix + moof(size + 8) + mdat


# ----------------------------------------------------------------------------- reading back


def _boxes(data: bytes, start: int = 0, end: int | None = None):
    """(type, start of the box, end of the box) of the boxes laid end to end in data[start:end]."""
    end = len(data) if end is None else end
    while start + 8 <= end:
        size, kind = struct.unpack(">I4s", data[start : start + 8])
        yield kind, start, start + size
        start += size


def init_parameter_sets(init: bytes) -> tuple[bytes, bytes]:
    """SPS and PPS of an init segment this module wrote (its avcC)."""
    i = init.index(b"avcC")
    size = struct.unpack(">I", init[i - 4 : i])[0]
    return avcc_parameter_sets(init[i + 4 : i - 4 + size])


def fragment_samples(fragment: bytes) -> list[Sample]:
    """The samples of a media fragment this module wrote (`media_fragment`, emsg boxes first),
    in decode order: the WebRTC egress hands the encoder's own access units on without decoding."""
    out = []
    for kind, start, _ in _boxes(fragment):
        if kind != b"moof":
            continue
        trun = fragment.index(b"trun", start) - 4
        count, offset = struct.unpack(">Ii", fragment[trun + 12 : trun + 20])
        pos, data = trun + 20, start + offset
        for _ in range(count):
            size, flags = struct.unpack(">II", fragment[pos : pos + 8])
            out.append(Sample(fragment[data : data + size], flags == SYNC_SAMPLE))
            pos, data = pos + 8, data + size
    return out


def annexb_access_unit(sample: Sample, sps: bytes, pps: bytes) -> bytes:
    """An AVCC sample as an Annex B access unit, with SPS and PPS in front of a keyframe (what
    RTP's H.264 payload needs: a receiver joins at any keyframe)."""
    nals, i, d = ([sps, pps] if sample.keyframe else []), 0, sample.data
    while i + 4 <= len(d):
        n = struct.unpack(">I", d[i : i + 4])[0]
        nals.append(d[i + 4 : i + 4 + n])
        i += 4 + n
    return b"".join(b"\x00\x00\x00\x01" + nal for nal in nals)
