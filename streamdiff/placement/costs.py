"""Service times from a profile (profile/), as the simulator (sim.py) charges them: a DiT
batch, a VAE group's batch and each shard's band, the encoder, a VAE cut, and the speed a stage
gets from cores lent to it."""

from __future__ import annotations

from dataclasses import dataclass

from .layout import Layout
from .profile.schema import Profile

SPATIAL = 8


def _clamp(factor: float) -> float:
    """A measured cost factor kept to what a noisy probe can be trusted for."""
    return min(4.0, max(0.25, factor))


@dataclass
class Costs:
    """Service times of one frame size, in seconds, from a profile."""

    profile: Profile
    size: tuple[int, int]
    threads: int
    dit_group: int = 1
    cut: int = 0  # the layout's; a block may carry its own (an adapting cut, supervisor/cut.py)

    def __post_init__(self) -> None:
        fig = self.profile.size(*self.size)
        t = str(self.threads) if str(self.threads) in fig["dit"] else "1"
        self.dit, self.vae1, self.enc = fig["dit"][t], fig["vae"][t], fig["encode"]
        if self.dit_group > 1:  # one DiT over g devices: its rank 0's times, all-to-alls included
            self.dit = fig["dit_group"][str(self.dit_group)]
        # On the CPU the supervisor (the encoder threads) shares the DiT workers' cores: what
        # encoding a block takes from the DiT, measured beside it (0 where not measured).
        self.host_ms = max(0.0, self.dit.get("host_block_ms", self.dit["block_ms"]) - self.dit["block_ms"])
        # an image-to-video request's first block: the image encoded and committed (profile/probes.py `_image_ms`;
        # where not measured, a first block's time)
        self.image_ms = self.dit.get("image_ms", self.dit["first_ms"])
        self.fig = fig
        self.factors = self.cut_factors()
        self.cut_ms = self.dit_cut_ms(self.cut)
        self.groups = fig.get("vae_group", {})
        self.rows = self.size[1] // SPATIAL
        self.beside = self._beside(fig.get("hybrid"))
        self._fit()

    def _stages_off_vae(self, cut: int) -> float:
        """A cut's first stages' share of the VAE's measured time."""
        return self.vae1["block_ms"] * cut_fraction(self.fig, cut)

    def _stages_on_dit(self, cut: int) -> float:
        """The stages as the profile timed them in the DiT's process after its block (profiles
        from before that: the time they leave the VAE)."""
        beside_dit = self.dit.get("cut_stages_ms")
        return sum(beside_dit[:cut]) if beside_dit and cut else self._stages_off_vae(cut)

    def _cut_probes(self) -> tuple[float, float, float, float] | None:
        """Over the cuts the profile ran side by side (profile/cpu_probes.py `levels`): what they added to
        the DiT's block, took off the VAE's, and the stage times they moved as timed on the DiT
        and as a share of the VAE's decode; None where none was (probes are of one-thread
        workers)."""
        probes = self.fig.get("levels", {}).get("cuts", {}) if self.threads == 1 else {}
        on = sum(self._stages_on_dit(int(c)) for c in probes)
        off = sum(self._stages_off_vae(int(c)) for c in probes)
        if not probes or on <= 0 or off <= 0:
            return None
        grew = sum(p["dit"] for p in probes.values()) - len(probes) * self.dit["block_ms"]
        fell = len(probes) * self.vae1["block_ms"] - sum(p["vae"] for p in probes.values())
        return grew, fell, on, off

    def cut_factors(self) -> tuple[float, float]:
        """(DiT, VAE): what the cut probes added to the DiT's block against the stages' times
        there, and took off the VAE's against their share of its decode; (1, 1) unmeasured."""
        p = self._cut_probes()
        return (1.0, 1.0) if p is None else (_clamp(p[0] / p[2]), _clamp(p[1] / p[3]))

    def cut_exchange(self) -> tuple[float, float]:
        """(DiT, VAE): the same per ms of the VAE's decode that a cut moves, as the daemon's cut
        balance prices a cut (supervisor/cut.py, topology.vae_cut_exchange)."""
        p = self._cut_probes()
        return (1.0, 1.0) if p is None else (_clamp(p[0] / p[3]), _clamp(p[1] / p[3]))

    def vae_cut_ms(self, cut: int) -> float:
        """What a cut takes off the VAE."""
        return self.factors[1] * self._stages_off_vae(cut)

    def dit_cut_ms(self, cut: int) -> float:
        """What a cut adds to the DiT's block."""
        return self.factors[0] * self._stages_on_dit(cut)

    def lent_speedups(self, cores: int, first: bool = False) -> tuple[float, float]:
        """(DiT, VAE): each stage's speed on `cores` threads (its own and those lent to it while
        the other waits) against its speed on its own, from the profile's thread rounds; 1 where
        the profile has no figure at that count. `first`: a shot's first block, timed after
        idle (docs/placement.md#placement-placement)."""
        key = "first_ms" if first else "block_ms"

        def up(role: str, own: dict) -> float:
            alone = self.fig[role].get(str(cores))
            return max(1.0, own[key] / alone[key]) if alone and alone.get(key, 0) > 0 and own.get(key) else 1.0

        return up("dit", self.dit), up("vae", self.vae1)

    def _beside(self, probe: dict | None) -> float:
        """How much of the time a decoding shard leaves free on its core a low-priority DiT turns
        into work (the profile's hybrid probe): the two switch at every halo exchange, and the
        DiT's caches go cold. 1 when not measured. The DiT's time alone is the probe's own, taken
        seconds before it (profiles from before it was recorded: the DiT's measurement)."""
        if not probe:
            return 1.0
        shard0 = probe["group"][0]
        free = 1.0 - shard0["own_ms"] / shard0["block_ms"]
        if free <= 0 or probe["dit"]["wall_ms"] <= 0:
            return 1.0
        alone = probe["dit"].get("alone_ms", self.dit["block_ms"])
        return min(1.0, max(0.05, alone / (probe["dit"]["wall_ms"] * free)))

    def _fit(self) -> None:
        """own(rows) = front + rows * per_row, least squares over the profile's bands."""
        pts = [(self.rows, self.vae1["own_ms"])]
        for splits in self.groups.values():
            for shards in splits.values():
                pts += [(x["rows"], x["own_ms"]) for x in shards]
        n = len(pts)
        mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
        var = sum((p[0] - mx) ** 2 for p in pts)
        b = sum((p[0] - mx) * (p[1] - my) for p in pts) / var if var > 0 else my / max(mx, 1)
        b = max(b, 1e-3)
        self.per_row_ms, self.front_ms = b, max(0.0, my - b * mx)

    @staticmethod
    def _batch(fig: dict, n: int, block_ms: float) -> float:
        """Per-block ms in a batch of n (the nearest batch size measured)."""
        if n <= 1 or not fig.get("batch_ms"):
            return block_ms
        sizes = sorted(int(k) for k in fig["batch_ms"])
        near = min(sizes, key=lambda k: (abs(k - n), k))
        return fig["batch_ms"][str(near)]

    def dit_s(self, n: int, shot_starts: int, cuts: list[int] | None = None, host: bool = True) -> float:
        """A batch of n blocks (every block is whole: plan.py); `cuts`: each block's VAE cut
        (default: the layout's); `host`: the encoder is at work beside it (not before the first
        fragment)."""
        d = self.dit
        per = self._batch(d, n, d["block_ms"])
        # A shot's first block: its prompt, its own steps, an empty cache (cheaper on the CPU).
        first = shot_starts * (d["first_ms"] - d["block_ms"]) * per / d["block_ms"]
        stages = sum(self.dit_cut_ms(c) for c in cuts) if cuts is not None else self.cut_ms * n
        return (per * n + first + stages + (self.host_ms * n if host else 0.0)) / 1000

    def dit_own_ms(self) -> float:
        return self.dit["own_ms"]

    def _overhead_ms(self, k: int) -> float:
        g = self.groups.get(str(k), {}).get("equal")
        if g:
            return max(0.0, g[0]["block_ms"] - max(x["own_ms"] for x in g))
        two = self.groups.get("2", {}).get("equal")  # not measured at this k: as at 2
        return max(0.0, two[0]["block_ms"] - max(x["own_ms"] for x in two)) if two else 0.0

    def vae(
        self,
        k: int,
        rows: list[int],
        n: int,
        first: bool,
        cut: int | None = None,
        busy: bool = False,
    ) -> tuple[float, list[float]]:
        """(seconds for the group's batch, each shard's own seconds); `cut`: the batch's VAE cut
        (default: the layout's); `busy`: the process ran other work
        until now (a shot's first block after idle is slower on two threads, profile/cpu_probes.py)."""
        v = self.vae1
        scale = self._batch(v, n, v["block_ms"]) / v["block_ms"] * n
        if first:
            scale *= ((v.get("first_busy_ms") if busy else None) or v["first_ms"]) / v["block_ms"]
        if k == 1:
            own = (v["block_ms"] - self.vae_cut_ms(self.cut if cut is None else cut)) * scale / 1000
            return own, [own]
        own = [(self.front_ms + r * self.per_row_ms) * scale / 1000 for r in rows]
        return max(own) + self._overhead_ms(k) * scale / 1000, own

    def encode_s(self, first: bool) -> float:
        return self.enc["first_ms" if first else "block_ms"] / 1000


def cut_fraction(fig: dict, cut: int) -> float:
    """The share of the VAE's time in its decoder's first `cut` stages (the profile's per-stage
    times; 0 without a cut)."""
    if not cut:
        return 0.0
    stages = fig["vae"]["1"].get("stages_ms")
    if not stages or cut >= len(stages):
        raise ValueError(f"the profile has no VAE stage times for a cut of {cut}")
    return sum(stages[:cut]) / sum(stages)


def cut_exchange(profile: Profile, layout: Layout, size: tuple[int, int], default: tuple[float, ...]) -> tuple:
    """The exchange the daemon's cut balance prices a layout's cut at (topology.vae_cut_exchange):
    the profile's, for a layout with a cut; `default` for one without."""
    if not layout.vae_cut:
        return default
    return Costs(profile, size, layout.threads, layout.dit_group, layout.vae_cut).cut_exchange()
