"""The daemon with its workers lending each other their cores (`--share-cores`): each worker
runs on its own core as in disagg-1+1, and while one waits the other runs on both (its thread
count and affinity widen before each DiT block or VAE convolution; platform/cpu_lending.py). Their
OpenMP threads sleep while they wait instead of spinning on a core the other needs. The video
equals one DiT and one VAE on cores of their own."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from .helpers import SHORT_STORY, Daemon, assert_same_as_one_dit_and_vae, check_video, http, stream_video


@pytest.mark.timeout(300)
def test_workers_lend_their_cores_while_they_wait_and_stream_the_same_video():
    d = Daemon("--dit-gpus", "1", "--vae-gpus", "1", "--share-cores")
    try:
        workers = d.health()["workers"]
        assert sorted(workers) == ["dit0", "vae0.0"]
        wait = f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'PASSIVE')}".encode()
        every = sorted(os.sched_getaffinity(0))
        for i, name in enumerate(["dit0", "vae0.0"]):  # at rest, each on its own core
            pid = workers[name]["pid"]
            assert os.sched_getaffinity(pid) == {every[i % len(every)]}
            assert wait in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert workers[name]["borrowed_s"] == 0.0
        got, _, _ = stream_video(d.url, SHORT_STORY)
        check_video(got, 48, 256, 144, 16)
        # The VAE decodes the last blocks after the DiT's last: on both cores (the heartbeat
        # brings the figure within a second).
        deadline = time.monotonic() + 10
        while (borrowed := d.health()["workers"]["vae0.0"]["borrowed_s"]) == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert borrowed > 0 or len(every) == 1
        assert 'streamdiff_worker_borrowed_seconds{worker="vae0.0"}' in http.get(d.url + "/metrics").text
    finally:
        assert d.stop() == 0, d.logs()
    assert d.segments() == []
    assert_same_as_one_dit_and_vae(got, SHORT_STORY)
