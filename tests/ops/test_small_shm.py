"""The daemon in a mount namespace whose /dev/shm is a container's default 64 MiB: it refuses at
start, naming /dev/shm and the bytes its rings need, or, told to reserve less, serves an 832x480
stream exactly with no worker restart. Never a worker dead of SIGBUS a few blocks in."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from ..helpers import Daemon, check_video, stream_video

# Runs the daemon with a fresh 64 MiB tmpfs on /dev/shm, seen by it and its workers alone.
SMALL_SHM = ("unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"', "sh")


@pytest.fixture(scope="module")
def small_shm() -> tuple[str, ...]:
    if shutil.which("unshare") is None or subprocess.run([*SMALL_SHM, "true"], capture_output=True).returncode:
        pytest.skip("needs unshare and mount in a mount namespace (root)")
    return SMALL_SHM


@pytest.mark.timeout(120)
def test_rings_too_big_for_a_64_mib_dev_shm_are_refused_at_start_by_name(small_shm):
    # The default limits: 832x480 at most, 6 frame slots of 14.4 MB and 8 latent slots, 96 MB.
    d = Daemon(prefix=small_shm, wait=False)
    try:
        assert d.proc.wait(timeout=90) == 1
        log = d.logs()
        need = r"/dev/shm has 64\.0 MiB free \(\d+ bytes\), and the shared-memory rings need 9\d\.\d MiB"
        assert re.search(need, log), log
        assert "--shm-size" in log and "pipeline.frame_slots = 6" in log and "832x480" in log, log
    finally:
        d.stop()


@pytest.mark.timeout(300)
def test_told_to_reserve_less_it_serves_832x480_exactly_in_64_mib(small_shm, tmp_path):
    cfg = tmp_path / "c.toml"
    # 3 x 14.4 MB + 8 x 1.2 MB: 53 MB. The rings are sized by the frame size and the slots, not by
    # the model's work: a one-step sampler attending to 4 latent frames, and TAEHV, make 832x480
    # about 2 CPU-s a block here (the four steps and the Wan VAE took 4.4 and 3.2 s; the
    # default 13-frame window doubled the DiT's share by the fourth block).
    cfg.write_text("[pipeline]\nframe_slots = 3\n[sampler]\nsteps = [1000]\nwindow_frames = 4\n")
    d = Daemon("--config", str(cfg), "--decoder", "taehv", prefix=small_shm)
    try:
        before = {n: (w["pid"], w["restarts"]) for n, w in d.health()["workers"].items()}
        # Four blocks: every one of the three frame slots written, and the first again.
        data, _, _ = stream_video(d.url, {"prompt": "a wide shot", "num_frames": 45, "size": "832x480"})
        check_video(data, 45, 832, 480, 16, blocks_expected=4)
        assert {n: (w["pid"], w["restarts"]) for n, w in d.health()["workers"].items()} == before
    finally:
        assert d.stop() == 0
