"""Accelerator checks (marker `device`): the model core and the daemon on CUDA or XPU."""

from __future__ import annotations

import pytest
import torch

from streamdiff.models.engines import DiTEngine, VAEEngine
from streamdiff.models.spec import ModelSpec

from ..conftest import accelerator
from ..helpers import Daemon, stream_video

pytestmark = pytest.mark.device


def test_tiny_stages_match_the_cpu_in_float32():
    dev = accelerator()
    spec = ModelSpec(dtype="float32")
    outs = {}
    for device in ("cpu", dev):
        dit, vae = DiTEngine(spec, device), VAEEngine(spec, device)
        sess = dit.open_session(128, 64, seed=1)
        dit.set_scene(sess, "a fox", cut=True)
        latents = [dit.generate_block(sess, 3) for _ in range(3)]
        state = vae.open_session()
        outs[device] = (latents, [vae.model.decode(z.to(device), state).float().cpu() for z in latents])
    for a, b in zip(outs["cpu"][0], outs[dev][0]):
        assert (a - b).abs().max() < 1e-3
    for a, b in zip(outs["cpu"][1], outs[dev][1]):
        assert (a - b).abs().max() < 1e-3


def test_sharded_group_over_nccl_or_xccl():
    dev = accelerator()
    n = torch.cuda.device_count() if dev == "cuda" else torch.xpu.device_count()
    if n < 2:
        pytest.skip("needs two devices for a VAE group")
    d = Daemon("--device", dev, "--dit-gpus", "1", "--vae-gpus", str(min(n - 1, 2)) if n > 2 else "1")
    try:
        data, _, _ = stream_video(d.url, {"prompt": "on the accelerator", "num_frames": 33})
        assert data[4:8] == b"ftyp"
    finally:
        d.stop()


def test_daemon_streams_on_the_accelerator():
    dev = accelerator()
    n = torch.cuda.device_count() if dev == "cuda" else torch.xpu.device_count()
    one = [] if n >= 2 else ["--mode", "aggregated"]  # one device runs both stages
    d = Daemon("--device", dev, "--dit-gpus", "1", "--vae-gpus", "1", *one)
    try:
        data, _, _ = stream_video(d.url, {"prompt": "on the accelerator", "num_frames": 33})
        from ..helpers import check_video

        check_video(data, 33, 256, 144, 16)
    finally:
        d.stop()
