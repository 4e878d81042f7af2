"""The daemon with its workers sharing the CPU's cores (`--share-cores`): every worker may run
on every core, so the stage with work takes the core the other leaves idle, and their OpenMP
threads sleep while they wait instead of spinning on a core the other needs. The video equals
one DiT and one VAE on cores of their own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .helpers import SHORT_STORY, Daemon, assert_same_as_one_dit_and_vae, stream_video
from .test_daemon_stream import check_video


@pytest.mark.timeout(300)
def test_workers_on_shared_cores_stream_the_same_video_and_sleep_while_they_wait():
    d = Daemon("--dit-gpus", "1", "--vae-gpus", "1", "--threads-per-worker", "2", "--share-cores")
    try:
        workers = d.health()["workers"]
        assert sorted(workers) == ["dit0", "vae0.0"]
        wait = f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'PASSIVE')}".encode()
        for w in workers.values():
            assert os.sched_getaffinity(w["pid"]) == os.sched_getaffinity(0)
            assert wait in Path(f"/proc/{w['pid']}/environ").read_bytes().split(b"\0")
        got, _, _ = stream_video(d.url, SHORT_STORY)
        check_video(got, 48, 256, 144, 16)
    finally:
        assert d.stop() == 0, d.logs()
    assert d.segments() == []
    assert_same_as_one_dit_and_vae(got, SHORT_STORY)
