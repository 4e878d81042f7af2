"""What the two stages inside a worker share (workers/dit_stage.py, workers/vae_stage.py).

Each stage holds its engine, the rings it attached, and its sessions' state objects; one call handles
one block of one session and returns the reply message for the supervisor. A block is checked
before any work (RequestError: the request cannot be served; see errors.py); in a VAE group the
shards then agree with one all-reduce whether to run it, skip it (cancelled) or refuse it, so
they all run the block's collectives or none do. Device work is timed by the platform's stopwatch
(streamdiff/platform): `busy_ms` is a stage's own device work, on every device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..ipc import messages as m
from ..ipc.shm import Ring
from .errors import RequestError, SessionError


def decode_png(data: bytes) -> torch.Tensor:
    """GenerateBlock.image -> (H, W, 3) uint8 (the API made it: a PNG at the video's size)."""
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            return torch.from_numpy(np.asarray(img.convert("RGB")).copy())
    except Exception as exc:
        raise RequestError(f"the image does not decode: {exc}") from None


def put_activation(ring: Ring, slot: int, x: torch.Tensor) -> None:
    """A cut's activation (C, T, H, W; float32, CPU) into a ring slot, channels last (T, H, W, C):
    the order the decoder's stages make and take it in, so neither side reorders it
    (docs/placement.md#placement-placement)."""
    c, t, h, w = x.shape
    ring.array(slot, (t, h, w, c), np.float32)[...] = x.permute(1, 2, 3, 0).numpy()


def take_activations(ring: Ring, slots: list[int], shape) -> torch.Tensor:
    """`put_activation`'s tensors of one shape back, stacked: (N, C, T, H, W), channels last."""
    c, t, h, w = shape
    x = torch.stack([torch.from_numpy(ring.array(slot, (t, h, w, c), np.float32)) for slot in slots])
    return x.permute(0, 4, 1, 2, 3)


def timed_ms(plat, fn) -> float:
    """fn's wall time in ms, the device drained before and after (calibration)."""
    plat.sync()
    t0 = time.perf_counter()
    fn()
    plat.sync()
    return 1000 * (time.perf_counter() - t0)


def transient_each(alone: int, pair: int | None) -> int:
    """What each more session of a batch adds to a block's transients (the bytes it allocates
    beyond the sessions' caches: activations, the batched attention's gathered windows,
    workspaces), from a block alone and, where one ran, a pair: what the second added; with no
    pair, what one alone takes."""
    return int(alone if pair is None else max(0, pair - alone))


def transient_at(batch: int, alone: float, each: float) -> int:
    """A block's transients in a batch of `batch`."""
    return int(alone + each * (max(1, batch) - 1))


def session_bytes(ready: m.DiTReady | m.VAEReady) -> float:
    """What one session's caches hold in the stage that reported `ready`, at its calibration's
    size (the preset's): as admission prices it (CapacityModel.demand), with a full window."""
    w, h = ready.cost.size
    mem = ready.memory
    if isinstance(mem, m.DiTMemory):
        tokens = ready.card.tokens_per_frame(w, h) if ready.card is not None else 0
        return mem.kv_bytes_per_token * mem.window_frames * tokens + mem.cross_bytes
    sf = ready.spatial_factor
    return mem.cache_bytes_per_latent_pixel * (h // sf) * (w // sf)


def leave_group(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def phase(state) -> tuple:
    """A VAE state's cache shapes: sessions whose caches agree decode their blocks in one call."""
    return tuple(None if c is None else tuple(c.shape) for c in state.cache)


@dataclass(kw_only=True)
class StageSession:
    """What a stage holds of one session, in one object: a stage keeps one dict of them and
    drops a session with one pop (each stage adds its own state)."""

    next_block: int = 0  # the block index due next (`in_order`)
    vae_cut: int | None = None  # the VAE cut its shot runs (`check_cut_change`); None: no block yet


def in_order(held: StageSession, msg) -> None:
    """A session's blocks arrive in order on one socket: a gap means a message was lost, and
    running this block would build on state the lost one never made."""
    if msg.block != held.next_block:
        raise SessionError(f"block {msg.block} arrived but block {held.next_block} never did (a lost control message)")
    held.next_block += 1


def cut_of(msg: m.GenerateBlock | m.DecodeBlock, worker_cut: int) -> int:
    """The VAE decoder stages a block's DiT runs (topology.vae_cut): the supervisor's choice for
    its shot, else the worker's own cut."""
    return msg.vae_cut or worker_cut


def check_cut_change(held: StageSession, cut: int, n: int, shot_start: bool) -> None:
    """A block's cut against the stages [1, n) and its session's cut so far: a cut moves only
    where a shot starts, when the stage caches on both sides start afresh."""
    if not 0 < cut < n:
        raise RequestError(f"a VAE cut after stage {cut}: this decoder has {n} stages (1-{n - 1})")
    if not shot_start and held.vae_cut not in (None, cut):
        raise RequestError(f"the VAE cut moves from {held.vae_cut} to {cut} inside a shot")


def check_cut(vae, cut: int) -> int:
    """topology.vae_cut against this decoder: its number of stages (the cut must leave both
    sides at least one)."""
    from ..models.wan.vae import decoder_stages

    n = len(decoder_stages(vae))
    if not 0 < cut < n:
        raise ValueError(f"topology.vae_cut: this VAE decoder has {n} stages; a cut is 1-{n - 1}, got {cut}")
    return n


# A VAE group's verdict on a block, agreed by an all-reduce MAX: a cancel wins over a refusal.
RUN, REFUSE, SKIP = 0, 1, 2
