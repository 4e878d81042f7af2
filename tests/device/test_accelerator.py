"""Accelerator checks (marker `device`): the model core and the daemon on CUDA or XPU."""

from __future__ import annotations

import os

import pytest
import torch

from streamdiff.models.engines import DiTEngine, VAEEngine
from streamdiff.models.spec import ModelSpec

from ..conftest import accelerator
from ..helpers import Daemon, stream_video

# READY on a device from cold: the workers compile the DiT's blocks and the VAE's norms, and
# load and calibrate, before they answer (the CPU's 120 s would cut a first compile short).
# tools/device/check.py sets it to its own daemons' limit; each test may take that and a stream
# (setup.cfg's 300 s would cut it short first).
COLD_S = float(os.environ.get("STREAMDIFF_DEVICE_COLD_S", "600"))
pytestmark = [pytest.mark.device, pytest.mark.timeout(COLD_S + 120)]


@pytest.fixture
def exact_float32():
    """float32 as the CPU computes it: no TF32 in cuBLAS's matmuls or cuDNN's convolutions
    (cuDNN's is on by default, and TF32's 10-bit mantissa differs from float32 by ~1e-3)."""
    if not torch.cuda.is_available():
        yield
        return
    kept = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = kept


def test_tiny_stages_match_the_cpu_in_float32(exact_float32):
    """The same weights on the same inputs: the DiT's forward and the VAE's streamed decode.
    Inputs are drawn on the CPU and copied: a session's noise is drawn on its device, and CPU
    (mt19937) and CUDA (Philox) generators give different numbers for one seed."""
    dev = accelerator()
    spec = ModelSpec(dtype="float32")
    g = torch.Generator().manual_seed(1)
    dit_cpu = DiTEngine(spec, "cpu").model
    cfg = dit_cpu.cfg
    x = torch.randn(1, cfg.in_channels, 3, 8, 16, generator=g)
    ctx = torch.randn(1, 12, cfg.text_dim, generator=g)
    t = torch.tensor([875.0])
    latents = [torch.randn(1, cfg.in_channels, f, 8, 16, generator=g) for f in (1, 3, 3)]
    outs = {}
    for device in ("cpu", dev):
        dit = dit_cpu if device == "cpu" else DiTEngine(spec, device).model
        vae = VAEEngine(spec, device)
        with torch.no_grad():
            y = dit.forward_full(x.to(device), t.to(device), ctx.to(device)).float().cpu()
            state = vae.open_session()
            frames = [vae.model.decode(z.to(device), state).float().cpu() for z in latents]
        outs[device] = (y, frames)
    assert (outs["cpu"][0] - outs[dev][0]).abs().max() < 1e-3
    for a, b in zip(outs["cpu"][1], outs[dev][1]):
        assert (a - b).abs().max() < 1e-3


def device_count(dev: str) -> int:
    if dev == "cpu":  # a worker per core
        return os.cpu_count() or 1
    return torch.cuda.device_count() if dev == "cuda" else torch.xpu.device_count()


def test_sharded_group_over_nccl_or_xccl():
    dev = accelerator()
    n = device_count(dev)
    if n < 2:
        pytest.skip("needs two devices for a VAE group")
    # a VAE group of two in every case: on exactly two devices, aggregated over both (each runs a
    # DiT and a shard); on more, a DiT device of its own and two VAE devices
    layout = (
        ["--mode", "aggregated", "--dit-gpus", "2", "--vae-gpus", "2"]
        if n == 2
        else ["--dit-gpus", "1", "--vae-gpus", "2"]
    )
    d = Daemon("--device", dev, *layout, timeout_s=COLD_S)
    try:
        data, _, _ = stream_video(d.url, {"prompt": "on the accelerator", "num_frames": 33})
        assert data[4:8] == b"ftyp"
    finally:
        d.stop()


def test_daemon_streams_on_the_accelerator():
    dev = accelerator()
    n = device_count(dev)
    one = [] if n >= 2 else ["--mode", "aggregated"]  # one device runs both stages
    d = Daemon("--device", dev, "--dit-gpus", "1", "--vae-gpus", "1", *one, timeout_s=COLD_S)
    try:
        data, _, _ = stream_video(d.url, {"prompt": "on the accelerator", "num_frames": 33})
        from ..helpers import check_video

        check_video(data, 33, 256, 144, 16)
    finally:
        d.stop()
