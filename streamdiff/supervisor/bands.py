"""Band weights of a VAE group: how many latent rows each shard decodes.

Shard i would take `full_ms[i]` of its own work to decode the whole height (its measured time
per row times the rows); its device also carries `other_ms[i]` of other work per block (the
DiT beside it in a hybrid layout, 0 elsewhere). A block takes as long as the busiest device,
so the rows go where they even out the devices' load: f_i * full_ms[i] + other_ms[i] = T for
every shard that gets rows, sum f_i = 1. That one rule gives equal bands on equal shards,
bands in proportion to speed on unequal ones, and a small band beside a DiT.
"""

from __future__ import annotations

import logging

log = logging.getLogger("streamdiff.placement")

MIN_SHARE = 0.02  # a shard keeps at least this share: its band stays at least a row, and measured


def solve(full_ms: list[float], other_ms: list[float] | None = None) -> list[float]:
    """Each shard's share of the rows (sums to 1), evening out the devices' load per block."""
    n = len(full_ms)
    other = list(other_ms or [0.0] * n)
    if n == 0 or len(other) != n or min(full_ms) <= 0:
        raise ValueError(f"band weights need one positive time per shard, got {full_ms} and {other}")
    active = set(range(n))
    while True:
        inv = sum(1 / full_ms[i] for i in active)
        t = (1 + sum(other[i] / full_ms[i] for i in active)) / inv
        shares = {i: (t - other[i]) / full_ms[i] for i in active}
        starved = {i for i, f in shares.items() if f < MIN_SHARE}
        if not starved or len(starved) == len(active):
            break
        active -= starved  # their devices are full without rows: they keep the minimum
    out = [max(MIN_SHARE, shares.get(i, MIN_SHARE)) for i in range(n)]
    total = sum(out)
    return [f / total for f in out]


def block_ms(full_ms: list[float], other_ms: list[float], shares: list[float]) -> float:
    """The busiest device's time per block under these shares (the proportional model)."""
    return max(f * a + o for f, a, o in zip(shares, full_ms, other_ms, strict=True))


ALPHA = 0.3  # EWMA weight of a new measurement
GAIN = 0.05  # new weights (or a new cut, cut.py) replace the current only if they predict a block this much faster


def ewma(d: dict, key, value: float) -> None:
    """d[key] follows value: a running average weighing the newest by ALPHA."""
    d[key] = value if key not in d else (1 - ALPHA) * d[key] + ALPHA * value


class Balance:
    """The band weights of every VAE group, kept from measurements (supervisor process).

    Each shard's own time per latent pixel of its band (FramesDone.busy_ms over its rows) and
    each DiT's own time per block are followed as running averages; a group's weights are
    `solve`d from them, with the work of other processes on a shard's device (a hybrid DiT) as
    that device's other load. Explicit weights (topology.vae_band_weights) stay as given.
    Weights change only for a clear gain, so equal shards keep equal bands through timing noise;
    running shots move to new weights at their next block (the shards re-cut the cached rows,
    parallel/vae_group.move_bands)."""

    def __init__(
        self,
        groups: list[list[str]],
        devices: dict[str, int],
        dit_workers: list[str],
        fixed: tuple[float, ...] = (),
        rebalance: bool = True,
    ) -> None:
        self.groups, self.fixed, self.rebalance = groups, tuple(fixed), rebalance
        self.beside = {  # shard -> the DiT workers in other processes on its device
            w: [d for d in dit_workers if d != w and w in devices and devices.get(d) == devices[w]]
            for g in groups
            for w in g
        }
        self.px_ms: dict[str, float] = {}  # shard -> own ms per latent pixel of its band
        self.dit_px_ms: dict[str, float] = {}  # DiT worker -> own ms per latent pixel of a block
        self.current: dict[int, tuple[float, ...]] = {}
        self.changes = 0

    def seed(self, group: int, block_ms: float, latent_hw: tuple[int, int]) -> None:
        """A group's start-up timing (equal bands, whole group): each shard's share of it."""
        for w in self.groups[group]:
            self.px_ms.setdefault(w, block_ms * len(self.groups[group]) / (latent_hw[0] * latent_hw[1]))

    def seed_dit(self, worker: str, block_ms: float, latent_hw: tuple[int, int]) -> None:
        self.dit_px_ms.setdefault(worker, block_ms / (latent_hw[0] * latent_hw[1]))

    def observe(self, shard: str, busy_ms: float, rows: int, latent_w: int) -> None:
        if busy_ms > 0 and rows > 0:
            ewma(self.px_ms, shard, busy_ms / (rows * latent_w))

    def observe_dit(self, worker: str, busy_ms: float, latent_hw: tuple[int, int]) -> None:
        if busy_ms > 0:
            ewma(self.dit_px_ms, worker, busy_ms / (latent_hw[0] * latent_hw[1]))

    def times(self, group: int, latent_hw: tuple[int, int]) -> tuple[list[float], list[float]] | None:
        """(full_ms, other_ms) per shard at this latent size, or None before any timing."""
        shards = self.groups[group]
        if any(w not in self.px_ms for w in shards):
            return None
        px = latent_hw[0] * latent_hw[1]
        full = [self.px_ms[w] * px for w in shards]
        other = [sum(self.dit_px_ms.get(d, 0.0) * px for d in self.beside[w]) for w in shards]
        return full, other

    def weights(self, group: int, latent_hw: tuple[int, int]) -> tuple[float, ...]:
        """The weights this group decodes its next batch under (empty: equal bands)."""
        if len(self.groups[group]) == 1:
            return ()
        if self.fixed:
            return self.fixed
        times = self.times(group, latent_hw)
        current = self.current.get(group)
        if times is None or (current is not None and not self.rebalance):
            return current or ()
        full, other = times
        best = tuple(round(f, 4) for f in solve(full, other))
        equal = [1 / len(full)] * len(full)
        now = block_ms(full, other, list(current) if current else equal)
        if (then := block_ms(full, other, list(best))) < (1 - GAIN) * now:
            self.current[group] = best
            self.changes += 1
            log.info(
                "VAE group %d: band weights %s (shards %s ms per whole block, other work %s ms; "
                "predicted %.0f ms per block against %.0f)",
                group,
                list(best),
                [round(a) for a in full],
                [round(o) for o in other],
                then,
                now,
            )
        return self.current.get(group, ())
