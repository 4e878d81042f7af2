"""One DiT over a group of devices: Ulysses sequence parallelism (runs in the DiT workers of a
DiT group).

Every rank holds the whole latent block and the sampler's state (the same seeds: the same
noise), and computes the tokens of its band of patch rows in every frame: patch embedding,
modulation, cross-attention, FFN and head are per token and need nothing from other ranks.
Self-attention needs every token, so around it two all-to-alls swap what a rank holds:

- before: this rank's tokens x all heads of q, k, v  ->  all tokens x this rank's heads;
- after: all tokens x this rank's heads of the output  ->  this rank's tokens x all heads.

So each rank attends with its own heads over the whole sequence, and its KV cache holds only
its heads (the cache, the largest per-session memory, is split g ways). The head's output
(a few channels per token) is all-gathered once per forward, so every rank returns the same
whole block. Bands are contiguous patch rows (`rows.split_rows`: sizes differ by at most
one row) and heads are split the same way, so neither the height nor the head count has to
divide by g. Equal to one device within float rounding (tests/parallel/test_dit_group.py).

The collectives are `all_to_all_single` with split sizes (gloo on the CPU, NCCL, oneCCL), which
allows uneven pieces; an all-gather of uneven pieces is the same call with this rank's piece
sent to everyone. Each collective runs inside the platform's wait clock (streamdiff/platform): on the
CPU gloo blocks and a host clock times it; on CUDA/XPU events around it on the stream, read at the
block's end. Every rank runs the same forwards in the same order (the DiT stage agrees on each
block before running it, workers/dit_stage.py), so the collectives always match.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
import torch.distributed as dist

from ..models.wan.rows import split_rows
from ..platform.base import WaitClock


@dataclass(frozen=True)
class Grid:
    """One forward's token grid: `frames` x `height` x `width` patches, split by rows."""

    frames: int
    height: int
    width: int
    bands: tuple[tuple[int, int], ...]  # patch rows of each rank


class SeqParallel:
    def __init__(self, rank: int, world: int, heads: int, clock: WaitClock | None = None) -> None:
        if heads < world:
            raise ValueError(f"a DiT of {heads} attention heads cannot be split over {world} devices")
        self.rank, self.world = rank, world
        self.heads = split_rows(heads, world)  # heads of each rank
        self.clock = clock or WaitClock()  # the platform's (`Platform.wait_clock`)
        self.bytes_sent = 0

    @property
    def wait_s(self) -> float:
        """Time inside collectives so far (communication and waiting for peers); read it at a
        block's end (on an accelerator it waits for the device)."""
        return self.clock.wait_s

    @property
    def local_heads(self) -> int:
        h0, h1 = self.heads[self.rank]
        return h1 - h0

    def grid(self, frames: int, height: int, width: int) -> Grid:
        if height < self.world:
            raise ValueError(f"{height} rows of patches cannot be split over a DiT group of {self.world}")
        return Grid(frames, height, width, tuple(split_rows(height, self.world)))

    def rows(self, grid: Grid) -> tuple[int, int]:
        return grid.bands[self.rank]

    def _exchange(self, send: list[torch.Tensor], shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """Piece i of `send` to rank i; returns the piece from each rank j, of shape shapes[j].
        One `all_to_all_single` over flat buffers with split sizes: gloo's list form wants
        equal pieces, and these differ by a row or a head."""
        flat = torch.cat([t.reshape(-1) for t in send])
        sizes = [prod(s) for s in shapes]
        into = torch.empty(sum(sizes), dtype=flat.dtype, device=flat.device)
        with self.clock.span():
            dist.all_to_all_single(into, flat, sizes, [t.numel() for t in send])
        self.bytes_sent += sum(t.numel() * t.element_size() for i, t in enumerate(send) if i != self.rank)
        return [part.view(s) for part, s in zip(into.split(sizes), shapes, strict=True)]

    def to_heads(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        """(S, n_local, K, heads, d), this rank's tokens, all heads -> (S, L, K, local heads, d),
        every token in sequence order (frame, row, column), this rank's heads."""
        s, _, k, _, d = x.shape
        r0, r1 = self.rows(grid)
        x = x.view(s, grid.frames, r1 - r0, grid.width, k, -1, d)
        send = [x[..., h0:h1, :] for h0, h1 in self.heads]
        shapes = [(s, grid.frames, b1 - b0, grid.width, k, self.local_heads, d) for b0, b1 in grid.bands]
        return torch.cat(self._exchange(send, shapes), dim=2).view(s, -1, k, self.local_heads, d)

    def to_tokens(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        """(S, L, local heads, d) -> (S, n_local, heads, d): the inverse of `to_heads`."""
        s, _, _, d = x.shape
        r0, r1 = self.rows(grid)
        x = x.reshape(s, grid.frames, grid.height, grid.width, self.local_heads, d)
        send = [x[:, :, b0:b1] for b0, b1 in grid.bands]
        shapes = [(s, grid.frames, r1 - r0, grid.width, h1 - h0, d) for h0, h1 in self.heads]
        return torch.cat(self._exchange(send, shapes), dim=4).view(s, -1, self.heads[-1][1], d)

    def gather(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        """(S, n_local, C), this rank's tokens -> (S, L, C), every token, on every rank."""
        s, _, c = x.shape
        shapes = [(s, grid.frames, b1 - b0, grid.width, c) for b0, b1 in grid.bands]
        return torch.cat(self._exchange([x] * self.world, shapes), dim=2).view(s, -1, c)


def shared_prompts(sp: SeqParallel, shape: tuple[int, ...], device: str):
    """A DiT group's prompt embeddings (`DiTEngine.share_prompt`): rank 0's text encoder
    encodes, one broadcast gives every rank the same tensor, so a group holds one text encoder
    (umT5-XXL is 11.4 GB) and encodes each prompt once, not once per rank. Float32 on the wire:
    a bfloat16 embedding goes there and back unchanged. Every rank asks in the same order (the
    same scenes of the same blocks, and the same prompt cache), so the broadcasts match."""

    def share(emb: torch.Tensor | None) -> torch.Tensor:
        buf = emb.float().contiguous() if sp.rank == 0 else torch.empty(shape, dtype=torch.float32, device=device)
        with sp.clock.span():
            dist.broadcast(buf, src=0)
        return buf

    return share
