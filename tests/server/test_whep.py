"""The WHEP track's pacing (server/whep.py), driven directly: it paces from the time its start
block was here, so a viewer whose handshake took a second is not a second behind for the rest of
the stream. (Chromium over WHEP end to end: test_player_browser.py.)"""

from __future__ import annotations

import asyncio

import numpy as np

from streamdiff.media.encoder import FragmentWriter, PyAVEncoder
from streamdiff.server import whep

from .test_jobs import PLACEMENT, REQ, Job, SessionHandle, block, settle
from .test_jobs import Engine as FakeEngine

FPS, FRAMES = 16, 12


async def job_of(blocks: int) -> Job:
    """A running job holding `blocks` real CMAF fragments of FRAMES frames (64x64)."""
    job = Job(REQ, live_consumer=False)
    job.follow_session(SessionHandle(job.id, FakeEngine()))
    job.handle.on_start(PLACEMENT)
    writer = FragmentWriter(PyAVEncoder(64, 64, FPS), 64, 64, FPS)
    for i in range(blocks):
        frames = np.full((FRAMES, 64, 64, 3), 40 * i, dtype=np.uint8)
        job.handle.on_data(writer.fragment(frames, True), block(i))
    await settle()
    return job


def test_frames_are_paced_from_the_start_blocks_arrival(monkeypatch):
    """A start block that came 1 s before the first send (the handshake's time): its 12 frames
    (0.75 s) and the next block's first are all due: the first leaves at once, the rest catch up
    at CATCH_UP x the frame rate (not at once: a burst reads as jitter to the receiver). A start
    block that comes "later" (its arrival moved 10 s on): every frame waits for its time, 1/FPS
    apart."""
    asyncio.run(_paced(monkeypatch))


async def _paced(monkeypatch):
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(s):  # records the track's waits instead of waiting (and yields, as sleep(0))
        if s:
            waits.append(s)
        await real_sleep(0)

    late, early = await job_of(2), await job_of(1)
    monkeypatch.setattr(whep.asyncio, "sleep", sleep)
    track = whep.make_track(late, FPS)  # from the newest block: block 1
    late.fragment_times[1] -= 1.0
    packets = [await track.recv() for _ in range(FRAMES)]
    assert [p.pts for p in packets] == [round(k * whep.RTP_CLOCK / FPS) for k in range(FRAMES)]
    late.handle.on_data(late.chunks[late.fragment_chunks[1]], block(2))
    await settle()
    await track.recv()  # due 0.25 s before now
    assert len(waits) == FRAMES and all(0 < w <= 1 / (whep.CATCH_UP * FPS) for w in waits)
    waits.clear()

    track = whep.make_track(early, FPS)
    early.fragment_times[0] += 10.0
    for _ in range(4):
        await track.recv()
    assert len(waits) == 4 and waits[0] > 9.0 and all(b > a for a, b in zip(waits, waits[1:]))
