"""Where a DiT worker's blocks cut the VAE decoder (topology.vae_cut with vae_cut_adapt), kept
from measurements (supervisor process).

Under a cut a block costs the DiT's side its own work plus the decoder's stages before the cut,
and the VAE's side the stages after it; the pipeline runs at the slower side's pace. The VAE
worker times each stage once at start (READY: `vae_stages_ms`), which gives each stage's share
of a decode. The workers' start-up blocks (READY), then every block, give the machine's speed:
the VAE side's time over its stages' share is what a whole decode takes now, and the DiT
side's time less its stages' share at that speed is the DiT's own. The planner picks a cut from
a profile taken minutes earlier on a machine whose speed, and the balance of the stages, drift
(one 2-vCPU VM gave DiT/VAE 0.43-0.76 in profiles minutes apart; docs/placement.md#placement-placement);
this puts the cut where the blocks being made balance.

Moved work does not cost the same on both sides: the DiT's process runs moved stages slower,
and the activation reaches the VAE's core cold (on a 2-vCPU EPYC a moved ms of the VAE's work
cost the DiT about 1.6 ms). The profile's cut probes measure that exchange (placement/costs.py
`Costs.cut_exchange`); the planner passes it as topology.vae_cut_exchange, so the balance here
prices a cut as the simulator that chose it.

A session takes its DiT worker's cut at each shot's start, where both sides' stage caches start
afresh (the workers refuse a change inside a shot). The cut moves only for a clear gain, so
two near-equal cuts do not alternate on timing noise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .bands import GAIN, ewma

log = logging.getLogger("streamdiff.placement")


class CutBalance:
    def __init__(
        self,
        start: int,
        adapt: bool,
        fits: Callable[[int, tuple[int, int], int], bool] | None = None,
        host_on_dit: bool = False,
        exchange: tuple[float, ...] = (1.0, 1.0),
    ) -> None:
        """start: the configured cut; fits(cut, latent_hw, latent_frames): whether that cut's
        activation fits a latent ring slot (None: every cut does); host_on_dit: the supervisor's
        encoding shares the DiT's cores (the CPU, supervisor/core.py `_pin_self`), so each
        block's encoding counts on the DiT's side; exchange: (DiT, VAE), per ms of a whole
        decode's stages a cut moves, what the DiT's side gains and the VAE's side loses."""
        self.start, self.adapt, self.host_on_dit = start, adapt, host_on_dit
        self.grow, self.relief = exchange
        self.host: dict[str, float] = {}  # "encode" -> ms a block the encoder takes
        self.fits = fits or (lambda cut, latent_hw, frames: True)
        self.shares: list[float] = []  # each decoder stage's share of a whole decode
        self.decode_px: dict[str, float] = {}  # VAE unit -> a whole decode's ms per latent pixel now
        self.dit_px: dict[str, float] = {}  # DiT worker -> its own ms per latent pixel (no stages)
        self.current: dict[str, int] = {}  # DiT worker -> the cut its next shots take
        self.pending: dict[str, tuple] = {}  # DiT worker -> a timing taken before the VAE's speed was known
        self.changes = 0

    def report(self, dit_workers: list[str]) -> dict:
        """What /health shows of it: each DiT worker's cut for its next shots, and what a moved
        ms of decode is taken to cost the DiT (grow) and save the VAE (relief)."""
        return {
            "vae_cuts": {w: self.current.get(w, self.start) for w in dit_workers},
            "vae_cut_exchange": [self.grow, self.relief],
        }

    def seed(self, stages_ms: list[float]) -> None:
        """The VAE worker's start-up timing of each decoder stage (READY)."""
        total = sum(stages_ms)
        if len(stages_ms) > 1 and total > 0 and not self.shares:
            self.shares = [x / total for x in stages_ms]

    def observe_vae(self, unit: str, ms: float, cut: int, latent_hw: tuple[int, int]) -> None:
        """A block's time on the VAE's side, which ran the stages from `cut` on."""
        rest = self._vae_share(cut)
        if ms > 0 and rest > 0:
            ewma(self.decode_px, unit, ms / rest / (latent_hw[0] * latent_hw[1]))

    def _vae_share(self, cut: int) -> float:
        """The VAE side's time at `cut` over a whole decode's."""
        return max(0.05, 1.0 - self.relief * sum(self.shares[:cut]))

    def observe_dit(self, worker: str, unit: str | None, ms: float, cut: int, latent_hw: tuple[int, int]) -> None:
        """A block's time on the DiT's side, stages before `cut` included (unit None: the
        worker's start-up block, before it serves any VAE unit)."""
        if ms <= 0:
            return
        if unit not in self.decode_px or not self.shares:  # kept until the VAE's speed is known
            self.pending[worker] = (ms, cut, latent_hw)
            return
        self.pending.pop(worker, None)
        px = latent_hw[0] * latent_hw[1]
        own = ms - self.grow * self.decode_px[unit] * px * sum(self.shares[:cut])
        ewma(self.dit_px, worker, max(0.0, own) / px)

    def observe_host(self, ms: float) -> None:
        """A block's encoding (on the CPU it runs on the DiT's cores)."""
        if self.host_on_dit and ms > 0:
            ewma(self.host, "encode", ms)

    def period_ms(self, worker: str, unit: str, cut: int, latent_hw: tuple[int, int]) -> float:
        """The slower side's time per block at this cut, as measured so far."""
        px = latent_hw[0] * latent_hw[1]
        decode, dit = self.decode_px[unit] * px, self.dit_px[worker] * px + self.host.get("encode", 0.0)
        return max(dit + self.grow * decode * sum(self.shares[:cut]), decode * self._vae_share(cut))

    def cut(self, worker: str, unit: str, latent_hw: tuple[int, int], latent_frames: int) -> int:
        """The cut a shot of this size starting on `worker` (and VAE `unit`) takes."""
        now = self.current.get(worker, self.start)
        if worker not in self.dit_px and worker in self.pending:
            self.observe_dit(worker, unit, *self.pending[worker])
        if not self.adapt or not self.shares or worker not in self.dit_px or unit not in self.decode_px:
            return now if self.fits(now, latent_hw, latent_frames) else self.start
        options = [c for c in range(1, len(self.shares)) if self.fits(c, latent_hw, latent_frames)]
        if not options:
            return self.start
        best = min(options, key=lambda c: self.period_ms(worker, unit, c, latent_hw))
        then, before = self.period_ms(worker, unit, best, latent_hw), self.period_ms(worker, unit, now, latent_hw)
        if best != now and (then < (1 - GAIN) * before or now not in options):
            self.current[worker] = best
            self.changes += 1
            log.info(
                "%s: the VAE cut moves from %d to %d stages (predicted %.0f ms per block against %.0f)",
                worker,
                now,
                best,
                then,
                before,
            )
            return best
        return now
