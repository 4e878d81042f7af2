"""The job store's retention and byte reads, driven directly (no daemon): what a reader of a
finished or running video can count on."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from streamdiff.plan import Block, Scene
from streamdiff.server.jobs import Job, JobExpired, JobStore
from streamdiff.supervisor.handle import SessionHandle

REQ = SimpleNamespace(scenes=[Scene("p", 9)], frames=9, fps=16, model="tiny", prompt="p", width=64, height=64, seed=1)
PLACEMENT = {"dit": "dit0", "vae": ["vae0.0"]}


class Engine:
    """Stands for the engine behind a SessionHandle: records acknowledgements."""

    def __init__(self) -> None:
        self.acks = 0

    def ack(self, session_id: str, blocks: int) -> None:
        self.acks += blocks

    def cancel(self, session_id: str, reason: str) -> bool:
        return True


def block(i: int) -> Block:
    return Block(i, 0, 1, 4, 4, 4 * i, i == 0, i == 0)


async def settle() -> None:
    for _ in range(5):  # the job's reader task takes the events queued on the handle
        await asyncio.sleep(0)


async def job_with(nbytes: int, chunks: int = 4) -> Job:
    job = Job(REQ, live_consumer=False)
    job.follow_session(SessionHandle(job.id, Engine()))
    job.handle.on_start(PLACEMENT)
    for i in range(chunks):
        job.handle.on_data(bytes([i]) * (nbytes // chunks), block(i))
    await settle()
    return job


async def finish(job: Job, ago_s: float = 0.0) -> None:
    job.handle.on_end("done", None)
    await settle()
    job.t_finished -= ago_s


def test_a_job_that_just_finished_is_not_expired_by_running_jobs_bytes():
    asyncio.run(_just_finished())


async def _just_finished():
    store = JobStore(max_jobs=100, keep_bytes=1000, keep_s=3600, min_keep_s=5)
    running = await job_with(5000)
    done = await job_with(400)
    assert done.handle._engine.acks == 4  # a buffered job takes every fragment at once
    store.add(running)
    store.add(done)
    await finish(done)  # prunes: 5400 bytes against 1000, but it finished this very tick
    assert (
        not done.expired
        and done.read(0, 400) == bytes([0]) * 100 + bytes([1]) * 100 + bytes([2]) * 100 + bytes([3]) * 100
    )
    done.t_finished -= 10  # the grace has passed: now it goes, the running job stays
    store.prune()
    assert done.expired and not running.expired


def test_a_job_with_a_reader_is_never_expired_and_a_reader_of_an_expired_job_is_cut():
    async def main():
        store = JobStore(max_jobs=100, keep_bytes=10, keep_s=0.0, min_keep_s=1.0)
        job = await job_with(400)
        store.add(job)
        await finish(job, ago_s=100)
        reader = job.follow()
        assert (await anext(reader))[0] == bytes([0]) * 100
        store.prune()  # over every budget, but a reader is attached
        assert not job.expired
        got = [c async for c, _ in reader]
        assert len(got) == 3 and job.readers == 0
        store.prune()
        assert job.expired
        with pytest.raises(JobExpired):
            async for _ in job.follow():
                pass

    asyncio.run(main())


def test_a_follower_sees_expiry_as_an_error_never_as_a_clean_end():
    async def main():
        job = await job_with(400)
        reader = job.follow()
        await anext(reader)
        job.expire()  # dropped under the reader
        with pytest.raises(JobExpired):
            await anext(reader)

    asyncio.run(main())


def test_read_spans_chunks_without_joining_the_video():
    job = asyncio.run(job_with(400))
    full = b"".join(job.chunks)
    for start, stop in ((0, 400), (10, 99), (99, 101), (100, 200), (350, 400), (0, 1), (399, 400)):
        assert job.read(start, stop) == full[start:stop]


def test_age_budget_and_max_jobs():
    asyncio.run(_age_budget())


async def _age_budget():
    store = JobStore(max_jobs=10, keep_bytes=10**9, keep_s=60, min_keep_s=1)
    jobs = [await job_with(40) for _ in range(3)]
    for j in jobs:
        store.add(j)
        await finish(j, ago_s=30)
    jobs[0].t_finished = time.monotonic() - 61
    store.prune()
    assert jobs[0].expired and not jobs[1].expired and not jobs[2].expired
    store.max_jobs = 2
    store.prune()  # the oldest finished job is forgotten
    assert list(store.jobs) == [jobs[1].id, jobs[2].id]
