"""The planner: every layout the devices allow, each run through the simulator (sim.py) on the
profile, ranked for an objective.

- throughput: frames/s of one stream (tools/bench/layouts.py's W1), then time to first fragment;
- latency: time to first fragment of that stream, then frames/s;
- streams: concurrent streams that all play without a stall (W2's goodput), then frames/s.

Layouts use every device given: disaggregated d + v = n (VAE groups of any size dividing v;
on the CPU, with groups of one, also each VAE cut up to half the VAE's measured stage time),
aggregated (the DiT on d of the n devices, VAE groups over all n), and on the CPU hybrid (the
DiT on d cores that also hold shards, VAE groups over all n) and 2 threads per worker on n / 2
workers, and one DiT and one VAE on n / 2 cores each that lend them to each other while they
wait (disagg-1+1/shared, where the profile timed both stages on n / 2 and n threads). Hybrid
is not offered on accelerators: there two processes time-slice a device, and the simulator
models only the CPU's strict priority of a shard over the DiT beside it.
With TAEHV (`--decoder taehv`, or a profile measured with it) a decoder is never sharded or cut:
only VAE groups of one (v decoder replicas), no hybrid; disaggregated d + v with d > 1 is where
several DiT workers feed one decoder, as TAEHV's cost makes the DiT the bottleneck.
Disaggregated layouts also come with their d DiT devices in DiT groups of every size g the
profile measured (its all-to-alls timed over the real link), and where the profile measured a
group of all n devices, the aggregated layout whose DiT and VAE each span all n (agg-spN: no
device idles while the other stage runs), so a DiT group is chosen exactly where its measured
time per block, link included, makes the pipeline faster.

A prediction is only as good as the simulator (`prefer_simpler`): a layout stays in the running
until another's prediction leads it by more than either's measured error (the profile's
`plan_errors`, per layout, which tools/bench/placement.py --record measures against the
pipeline; 2% where none was). Of those left, the one with the fewest mechanisms ranks first,
then the smallest error: a 2% predicted lead of a cut over plain disagg-1+1 measured 3% behind
it on a 2-core EPYC.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..card import ModelCard
from ..config import OBJECTIVES, Config
from .layout import Layout
from .profile.schema import Profile, offered_cuts
from .sim import Prediction, simulate


def _divisors(n: int) -> list[int]:
    return [g for g in range(1, n + 1) if n % g == 0]


def candidates(
    devices: int,
    kind: str,
    threads: tuple[int, ...] = (1, 2),
    dit_groups: tuple[int, ...] = (),
    cuts: tuple[int, ...] = (),
    shared: bool = False,
) -> list[Layout]:
    """`dit_groups`: the DiT group sizes the profile measured (one thread per rank); `cuts`:
    the VAE decoder cuts to offer disaggregated layouts with VAE groups of one (on the CPU: the
    activation crosses the host's ring, which the simulator charges nothing for, cheap beside a
    core's compute but not beside a GPU's); `shared`: the profile timed both stages on half
    the cores and on all of them, so disagg-1+1 lending each other their cores is offered."""
    out: list[Layout] = []
    if kind == "cpu" and shared and devices >= 2 and devices % 2 == 0:
        out.append(Layout("disaggregated", 1, 1, 1, devices // 2, shared=True))
    for t in threads if kind == "cpu" else (1,):
        n = devices // t
        if n < 1:
            continue
        for d in range(1, n):
            v = n - d
            sp = [1] + [s for s in dit_groups if t == 1 and d % s == 0]
            out += [Layout("disaggregated", d, v, g, t, dit_group=s) for g in _divisors(v) for s in sp]
            if kind == "cpu":
                out += [Layout("disaggregated", d, v, 1, t, vae_cut=c) for c in cuts]
        for d in range(1, n + 1):
            out += [Layout("aggregated", d, n, g, t) for g in _divisors(n)]
        if t == 1 and n in dit_groups:  # the DiT and the VAE each over all n devices, in sequence
            out.append(Layout("aggregated", n, n, n, 1, dit_group=n))
        if kind == "cpu":  # the simulator models a shard's priority over the DiT on a core, not a GPU's time slicing
            for d in range(1, n):
                out += [Layout("hybrid", d, n, g, t) for g in _divisors(n) if g > 1]
    return [x for x in out if _valid(x)]


def decoder_of(cfg: Config, profile: Profile) -> str:
    """The decoder the layouts are for: the one the profile measured, else the configured one."""
    return (profile.model or {}).get("decoder") or cfg.model.decoder


def whole_decoder(layouts: list[Layout]) -> list[Layout]:
    """The layouts a decoder that is never sharded or cut (TAEHV) can run: VAE groups of one."""
    return [x for x in layouts if x.group_size == 1 and x.mode != "hybrid" and x.vae_cut == 0]


def _valid(x: Layout) -> bool:
    if x.mode == "hybrid":  # every DiT device must hold a shard of a group with other devices in it
        return x.vae > x.dit and x.group_size > 1
    return True


# A layout's error where no check of this machine recorded one: the median of the simulator's
# speed-corrected W1 errors was 3% on Zen 5 (24: 8 layouts, 3 rounds, 2026-12-01) and 1% on
# Zen 4 (18: 6 layouts, 3 rounds, 2026-12-07). At 5% Zen 4's fresh profiles planned plain
# disagg-1+1 over lent cores predicted 4.4% ahead, which measured 22% ahead (placement.md).
DEFAULT_PLAN_ERROR = 0.02


def mechanisms(x: Layout) -> int:
    """The mechanisms a layout adds to whole stages on their own devices (one process for both,
    or one each; threads count as none): a hybrid's shared cores, a VAE group's halo exchange,
    a DiT group's all-to-alls, a VAE cut's activation ring, lent cores. Each can cost what
    the simulator does not model."""
    return sum((x.mode == "hybrid", x.group_size > 1, x.dit_group > 1, x.vae_cut > 0, x.shared))


def _lead(objective: str, best: Prediction, p: Prediction) -> float:
    """How far `best` leads `p` on the objective's first figure, relative (0: not at all)."""
    if objective == "latency":
        return p.w1_ttff_s / best.w1_ttff_s - 1 if best.w1_ttff_s > 0 else 0.0
    if objective == "streams" and (p.goodput or 0) < (best.goodput or 0):
        return float("inf")  # a stream fewer is not a rounding of the simulator's
    return best.w1_fps / p.w1_fps - 1 if p.w1_fps > 0 else float("inf")


def prefer_simpler(objective: str, ranked: list[tuple[Layout, Prediction]], errors: dict[str, float]) -> list:
    """`ranked` (best first) with the layouts still in the running first: those no other
    layout's prediction leads by more than either's error (`errors` by layout name, else
    DEFAULT_PLAN_ERROR), fewest mechanisms first, then the smallest error, then in rank order;
    the rest after them in rank order."""

    def err(x: Layout) -> float:
        return errors.get(x.name, DEFAULT_PLAN_ERROR)

    def beaten(i: int) -> bool:
        x, p = ranked[i]
        return any(_lead(objective, q, p) > max(err(x), err(y)) for y, q in ranked[:i])

    left = [i for i in range(len(ranked)) if not beaten(i)]
    order = sorted(left, key=lambda i: (mechanisms(ranked[i][0]), err(ranked[i][0]), i))
    out = set(left)
    return [ranked[i] for i in order] + [lp for i, lp in enumerate(ranked) if i not in out]


def _key(objective: str, p: Prediction):
    # Rounded, so that layouts the simulator finds equal (two sums of the same block times in
    # another order differ in the last bit) are ranked by the next figure, not by rounding.
    fps, ttff = -round(p.w1_fps, 6), round(p.w1_ttff_s, 9)
    if objective == "throughput":
        return (fps, ttff)
    if objective == "latency":
        return (ttff, fps)
    return (-(p.goodput or 0), fps)


@dataclass
class Plan:
    objective: str
    devices: int
    ranked: list[tuple[Layout, Prediction]]
    errors: dict = field(default_factory=dict)  # the measured errors the ranking allowed for (prefer_simpler)

    @property
    def best(self) -> tuple[Layout, Prediction]:
        return self.ranked[0]

    def table(self, top: int = 10) -> str:
        rows = [
            "(a lead under either layout's error, as measured against the pipeline, ranks the simpler first)",
            f"{'rank':>4}  {'layout':<20} {'W1 fps':>7} {'steady':>7} {'TTFF s':>7} {'streams':>7} {'error':>6}  flags",
        ]
        for i, (lay, p) in enumerate(self.ranked[:top], 1):
            good = "-" if p.goodput is None else str(p.goodput)
            e = self.errors.get(lay.name)
            err = f"{100 * e:.0f}%" if e is not None else f"({100 * DEFAULT_PLAN_ERROR:.0f}%)"
            rows.append(
                f"{i:>4}  {lay.name:<20} {p.w1_fps:7.2f} {p.w1_steady_fps:7.2f} {p.w1_ttff_s:7.2f} {good:>7} {err:>6}  "
                + " ".join(lay.flags())
            )
        return "\n".join(rows)

    def as_dict(self, top: int = 10) -> dict:
        return {
            "objective": self.objective,
            "devices": self.devices,
            "errors": self.errors,
            "ranked": [{"layout": lay.name, "flags": lay.flags(), **p.as_dict()} for lay, p in self.ranked[:top]],
        }


def plan(
    cfg: Config,
    profile: Profile,
    devices: int,
    objective: str,
    card: ModelCard,
    size: tuple[int, int],
    w2_size: tuple[int, int] | None = None,
    threads: tuple[int, ...] = (1, 2),
) -> Plan:
    """Rank every layout of `devices` devices for `objective`. W2's goodput (at w2_size, default
    `size`) is simulated for every layout under `streams`, and for the leaders otherwise."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}: one of {', '.join(OBJECTIVES)}")
    if devices < 2:  # one device: both stages on it (a group of one: any decoder)
        only = Layout("aggregated", 1, 1)
        return Plan(objective, devices, [(only, simulate(cfg, profile, only, card, size))], profile.plan_errors)
    fig = profile.size(*size)
    have = {int(t) for t in fig["dit"]}
    sp = tuple(sorted(int(g) for g in fig.get("dit_group", {})))
    cuts = offered_cuts(fig["vae"]["1"].get("stages_ms") or [])
    threads_measured = {devices, devices // 2} <= have and {str(devices), str(devices // 2)} <= set(fig["vae"])
    shared = threads_measured and cfg.topology.pin_cpus  # lending pins each worker to its own cores
    layouts = candidates(devices, profile.device, tuple(t for t in threads if t in have), sp, cuts, shared)
    if decoder_of(cfg, profile) == "taehv":
        layouts = whole_decoder(layouts)
    if not card.dit_group:  # its DiT runs on one device (Matrix-Game's action modules)
        layouts = [x for x in layouts if x.dit_group == 1]
    w2 = w2_size or size
    preds = [(x, simulate(cfg, profile, x, card, size, w2 if objective == "streams" else None)) for x in layouts]
    preds.sort(key=lambda lp: _key(objective, lp[1]))
    if objective != "streams":
        preds = [(x, simulate(cfg, profile, x, card, size, w2)) if i < 5 else (x, p) for i, (x, p) in enumerate(preds)]
    errors = dict(profile.plan_errors)
    return Plan(objective, devices, prefer_simpler(objective, preds, errors), errors)
