"""Row bands of a VAE group or a DiT group (no torch: the supervisor and the simulator use
them too)."""

from __future__ import annotations


def split_rows(height: int, world: int, weights: tuple[float, ...] | None = None) -> list[tuple[int, int]]:
    """Contiguous bands of `height` rows for `world` shards. Equal weights (the default): sizes
    differ by at most one. Otherwise each band's size follows its weight (a shard's share of the
    group's capacity, `placement`), rounded by largest remainder with at least one row each; a
    function of its arguments alone, so every rank derives the same bands."""
    if height < world:
        raise ValueError(f"{height} latent rows cannot be split over {world} shards")
    if weights is None or len(set(weights)) <= 1:
        base, extra = divmod(height, world)
        sizes = [base + (1 if i < extra else 0) for i in range(world)]
    else:
        if len(weights) != world or min(weights) <= 0:
            raise ValueError(f"band weights {list(weights)} for {world} shards: one positive weight per shard")
        exact = [height * w / sum(weights) for w in weights]
        sizes = [max(1, int(e)) for e in exact]
        while sum(sizes) > height:  # the one-row floors took rows: from the largest band
            sizes[sizes.index(max(sizes))] -= 1
        by_remainder = sorted(range(world), key=lambda i: (sizes[i] - exact[i], i))
        for i in by_remainder[: height - sum(sizes)]:
            sizes[i] += 1
    out, r = [], 0
    for n in sizes:
        out.append((r, r + n))
        r += n
    return out
