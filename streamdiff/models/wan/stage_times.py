"""Each VAE decoder stage's own time (used by the VAE worker's calibration and the profiler)."""

from __future__ import annotations

import statistics

import torch

from ...platform import for_device
from .vae import decoder_stages
from .vae_blocks import Ctx


def stage_times(vae, state, next_input, device: str, runs: int = 3) -> list[float]:
    """Each decoder stage's own time on a steady block (vae.decoder_stages; the median of
    `runs`), on the stage-0 input `next_input()` gives (not timed): what a cut between stages
    moves to the DiT (topology.vae_cut). Timed by the platform's stopwatch, as a stage's own
    work is (on the CPU the process's CPU time per thread)."""
    plat = for_device(device)
    stages = decoder_stages(vae)
    times: list[list[float]] = [[] for _ in stages]
    clock = plat.stopwatch(torch.get_num_threads())
    with torch.no_grad():
        for _ in range(runs):
            x, ctx = next_input(), Ctx(state)
            frames = x.shape[2]
            for i, stage in enumerate(stages):
                plat.sync()
                clock.start()
                x = stage(x, ctx)
                times[i].append(1000 * clock.stop()[1])
            state.latent_frames += frames
    return [statistics.median(t) for t in times]
