"""Height-sharded VAE decoding across a group of processes (runs in the VAE shard workers).

Each shard owns a horizontal band of latent rows (`models/wan/rows.split_rows`) and so a band of every output
frame (8x the rows). The decoder (models/wan/vae.py) asks its `Halo` for one neighbour row
above and below at every 3x3 convolution; `ExchangeHalo` answers with point-to-point sends
and receives to the two neighbours (zero rows at the global top and bottom), posted all at once
in one batched call before the conv's input buffer is filled and waited on after, so no
ordering between ranks can deadlock — whatever k is (the reference implementation hung at 3
ranks). Every rank decodes a block under the same `DecodePlan` (models/wan/kernels.py), so
neighbours always run the same exchanges with the same shapes. The halo rows of
cached frames are stored with the cache, so only the new frames' rows travel.

The middle attention is global over each frame. By default the low-resolution front (conv1,
middle, first up stage) is replicated on every shard and the rows are cut before the first
upsampler: no gather, 11 fewer exchanges, about 4% of the FLOPs computed k times. With
`shard_front` the latent rows are split from the start and the attention all-gathers whole
frames. tools/bench/vae_shard.py measures both.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ..models.wan.kernels import empty, layout
from ..models.wan.vae_blocks import Halo
from ..platform import for_device
from ..platform.base import WaitClock


def init_group(
    init_addr: str, rank: int, world: int, device: str, timeout_s: float, backend: str | None = None
) -> None:
    """Join the group's process group; `backend` overrides the device's default (gloo, nccl, xccl).
    Joined already (an aggregated worker's DiT and VAE stages share one group): nothing to do."""
    if dist.is_initialized():
        return
    plat = for_device(device)
    backend = backend or plat.backend
    # NCCL binds its communicator to this device now (it needs the index: "cuda" is cuda:0).
    kw = {"device_id": plat.torch_device} if backend == "nccl" else {}
    dist.init_process_group(
        backend,
        init_method=init_addr,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
        **kw,
    )


def group_max(values: list[int], device: str) -> list[int]:
    """The largest of every rank's values, element-wise, on every rank: one decision per item
    for the whole group, in one all-reduce."""
    t = torch.tensor(values, dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def agreed_working_set(working_set_bytes: int, device: str) -> int:
    """The smallest of the ranks' decode working sets (MiB-rounded, for the all-reduce's int32):
    every rank's decode plan is a function of the block's shape and this, so all run the same
    number of halo exchanges (models/wan/kernels.py)."""
    return -group_max([-(working_set_bytes >> 20)], device)[0] << 20


class ExchangeHalo(Halo):
    def __init__(self, rank: int, bands: list[tuple[int, int]], clock: WaitClock | None = None) -> None:
        self.rank, self.world, self.bands = rank, len(bands), bands
        self.bytes_sent = 0  # halo traffic of this shard, for the benchmark
        self.clock = clock or WaitClock()  # the platform's (`Platform.wait_clock`)

    @property
    def wait_s(self) -> float:
        """Time spent waiting for neighbours (a shard's busy time is the rest); read it at a
        block's end (on an accelerator it waits for the device)."""
        return self.clock.wait_s

    def _scale(self, x: torch.Tensor) -> int:
        r0, r1 = self.bands[self.rank]
        return x.shape[-2] // (r1 - r0)

    rows = 1

    def post(self, x: torch.Tensor):
        """Send our first row up and our last row down; receive theirs. Non-blocking.

        One batched call (`batch_isend_irecv`) for all four transfers: NCCL and oneCCL may
        deadlock on separate isend/irecv pairs between the same ranks (nccl#479, nccl#783,
        torch-ccl#72); batched, they are one group operation there, and a loop over the ops
        on gloo."""
        up, down = self.rank - 1, self.rank + 1
        ops, recv_up, recv_down = [], None, None
        if up >= 0:
            send_up = x[..., :1, :].contiguous()
            recv_up = torch.empty_like(send_up)
            ops += [dist.P2POp(dist.isend, send_up, up), dist.P2POp(dist.irecv, recv_up, up)]
            self.bytes_sent += send_up.numel() * send_up.element_size()
        if down < self.world:
            send_down = x[..., -1:, :].contiguous()
            recv_down = torch.empty_like(send_down)
            ops += [dist.P2POp(dist.isend, send_down, down), dist.P2POp(dist.irecv, recv_down, down)]
            self.bytes_sent += send_down.numel() * send_down.element_size()
        return (dist.batch_isend_irecv(ops) if ops else []), recv_up, recv_down

    def complete(self, pending, dest: torch.Tensor) -> None:
        works, recv_up, recv_down = pending
        with self.clock.span():  # on an accelerator: the stream's wait for the transfers
            for w in works:
                w.wait()
        dest[..., :1, :] = recv_up if recv_up is not None else 0  # zero rows at the global edges
        dest[..., -1:, :] = recv_down if recv_down is not None else 0

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Whole frames from every shard's band (bands may differ by a row: pad, gather, trim)."""
        s = self._scale(x)
        sizes = [(r1 - r0) * s for r0, r1 in self.bands]
        pad = max(sizes)
        buf = empty((*x.shape[:-2], pad, x.shape[-1]), x).contiguous()
        buf.zero_()
        buf[..., : x.shape[-2], :] = x
        parts = [torch.empty_like(buf) for _ in range(self.world)]
        with self.clock.span():
            dist.all_gather(parts, buf)
        self.bytes_sent += buf.numel() * buf.element_size() * (self.world - 1)
        full = torch.cat([p[..., :n, :] for p, n in zip(parts, sizes)], dim=-2)
        return full.contiguous(memory_format=layout(full))

    def local(self, x: torch.Tensor) -> torch.Tensor:
        r0, r1 = self.bands[self.rank]
        s = x.shape[-2] // self.bands[-1][1]
        return x[..., r0 * s : r1 * s, :]


def move_bands(
    state, slots: list[int | None], old: list[tuple[int, int]], new: list[tuple[int, int]], rank: int
) -> None:
    """Re-cut a session's temporal cache from bands `old` to bands `new` in the middle of a shot
    (the supervisor's band weights changed): every band-local slot is all-gathered whole from
    its interior rows (halo rows stripped) and this rank keeps its new band with fresh halo
    rows, zeros at the global edges, as a decode under `new` from the shot's start would have
    stored them. One all-gather per slot, in slot order, on every rank."""
    world = len(old)
    r0, r1 = old[rank]
    n0, n1 = new[rank]
    for i, halo in enumerate(slots):
        t = state.cache[i]
        if t is None or halo is None:
            continue
        inner = t[..., halo : t.shape[-2] - halo, :] if halo else t
        scale = inner.shape[-2] // (r1 - r0)
        sizes = [(b1 - b0) * scale for b0, b1 in old]
        buf = torch.zeros((*inner.shape[:-2], max(sizes), inner.shape[-1]), dtype=t.dtype, device=t.device)
        buf[..., : inner.shape[-2], :] = inner
        parts = [torch.empty_like(buf) for _ in range(world)]
        dist.all_gather(parts, buf)
        full = torch.cat([p[..., :n, :] for p, n in zip(parts, sizes, strict=True)], dim=-2)
        lo, hi = n0 * scale - halo, n1 * scale + halo
        out = empty((*t.shape[:-2], hi - lo, t.shape[-1]), t)
        out.zero_()
        a, b = max(lo, 0), min(hi, full.shape[-2])
        out[..., a - lo : b - lo, :] = full[..., a:b, :]
        state.cache[i] = out
