"""The two stages inside a worker: DiT (latent blocks) and VAE shard (row strips of frames).

Each holds its engine, the rings it attached, and its sessions' state objects; one call handles
one block of one session and returns the reply message for the supervisor.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ..ipc import messages as m
from ..ipc.shm import Ring
from ..parallel.vae_group import ExchangeHalo, split_rows
from .spec import WorkerSpec

log = logging.getLogger("streamdiff.worker")


def _select_device(device: str) -> None:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    elif dev.type == "xpu":
        torch.xpu.set_device(dev)


def _sync(device: str) -> None:
    t = torch.device(device).type
    if t == "cuda":
        torch.cuda.synchronize()
    elif t == "xpu":
        torch.xpu.synchronize()


class DiTStage:
    def __init__(self, spec: WorkerSpec) -> None:
        from ..models.engines import DiTEngine

        torch.set_num_threads(spec.threads)
        _select_device(spec.device)
        self.device = spec.device
        self.engine = DiTEngine(spec.model, spec.device)
        self.ring = Ring(spec.latent_ring)
        self.sessions: dict = {}

    def info(self) -> dict:
        p = self.engine.preset
        return {
            "model": p.name,
            "frames_per_block": p.sampler.frames_per_block,
            "fps": p.fps,
            "spatial_factor": p.vae.spatial_factor,
            "temporal_factor": p.vae.temporal_factor,
            "size_multiple": p.vae.spatial_factor * p.dit.patch_size[1],
            "latent_channels": p.dit.in_channels,
            "default_size": list(p.default_size),
            "max_shot_latent_frames": p.dit.rope_max_positions,
            "embedded_weights": p.embedded,
        }

    def open(self, msg: m.OpenSession) -> None:
        self.sessions[msg.session] = self.engine.open_session(msg.width, msg.height, msg.seed)

    def close(self, session: str) -> None:
        self.sessions.pop(session, None)

    def generate(self, msg: m.GenerateBlock, cancelled: bool) -> m.LatentDone:
        sess = self.sessions.get(msg.session)
        if cancelled or sess is None:
            return m.LatentDone(msg.session, msg.block, msg.slot, [], 0.0, skipped=True)
        t0 = time.perf_counter()
        if msg.prompt is not None:
            self.engine.set_scene(sess, msg.prompt, cut=msg.cut, seed=msg.seed)
        latent = self.engine.generate_block(sess, msg.frames)[0]  # (C, f, h, w) float32, CPU
        self.ring.array(msg.slot, latent.shape, np.float32)[...] = latent.numpy()
        ms = 1000 * (time.perf_counter() - t0)
        return m.LatentDone(msg.session, msg.block, msg.slot, list(latent.shape), ms)

    def shutdown(self) -> None:
        self.ring.close()


class VAEStage:
    def __init__(self, spec: WorkerSpec) -> None:
        from ..models.engines import VAEEngine

        torch.set_num_threads(spec.threads)
        _select_device(spec.device)
        self.device = spec.device
        self.engine = VAEEngine(spec.model, spec.device)
        self.latents = Ring(spec.latent_ring)
        self.frames = Ring(spec.frame_ring)
        g = spec.group
        self.rank, self.world = (g.rank, g.world) if g else (0, 1)
        self.shard_front = bool(g and g.shard_front)
        if self.world > 1:
            from ..parallel.vae_group import init_group

            init_group(g.init_addr, g.rank, g.world, spec.device, g.timeout_s)
        self.sessions: dict = {}

    def info(self) -> dict:
        p = self.engine.preset
        return {
            "vae_rank": self.rank,
            "vae_world": self.world,
            "spatial_factor": p.vae.spatial_factor,
            "temporal_factor": p.vae.temporal_factor,
        }

    def open(self, msg: m.OpenSession) -> None:
        self.sessions[msg.session] = self.engine.open_session()

    def close(self, session: str) -> None:
        self.sessions.pop(session, None)

    def decode(self, msg: m.DecodeBlock, cancelled: bool) -> m.FramesDone:
        state = self.sessions.get(msg.session)
        cancelled = cancelled or state is None
        if self.world > 1:
            from ..parallel.vae_group import group_any

            cancelled = group_any(cancelled, self.device)
        if cancelled:
            return m.FramesDone(msg.session, msg.block, self.rank, msg.frame_slot, 0.0, skipped=True)
        t0 = time.perf_counter()
        if msg.reset:  # a new shot: the temporal cache starts afresh
            state = self.sessions[msg.session] = self.engine.open_session()
        latent = torch.from_numpy(self.latents.array(msg.latent_slot, msg.shape, np.float32))[None]
        c, f, h, w = msg.shape
        sf = self.engine.preset.vae.spatial_factor
        bands = split_rows(h, self.world)
        halo = ExchangeHalo(self.rank, bands) if self.world > 1 else None
        strip = self.engine.decode_block(state, latent, bands[self.rank], halo, self.shard_front)
        y0, y1 = bands[self.rank][0] * sf, bands[self.rank][1] * sf
        _sync(self.device)
        if strip.shape[0] != msg.frames_out:
            raise RuntimeError(f"decoded {strip.shape[0]} frames, expected {msg.frames_out}")
        out = self.frames.array(msg.frame_slot, (msg.frames_out, h * sf, w * sf, 3), np.uint8)
        out[:, y0:y1] = strip.numpy()  # this shard's row strip, in place: no gather copy
        ms = 1000 * (time.perf_counter() - t0)
        return m.FramesDone(msg.session, msg.block, self.rank, msg.frame_slot, ms)

    def shutdown(self) -> None:
        self.latents.close()
        self.frames.close()
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
