"""Which layouts are legal: the rules over [topology]'s mode, device counts, group sizes, cut and
shared cores (and the decoder), in one place. `checks.validate` refuses a config that breaks
one; the planner (placement/) and the supervisor's topology fill a layout in the same way
(`planned`, `explicit_layout`). A rule broken is returned, not raised: the caller says it."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from . import TopologyConfig


def planned(t: TopologyConfig) -> bool:
    """The layout is the planner's to choose: mode auto and no device counts given."""
    return t.mode == "auto" and t.dit_devices == 0 and t.vae_devices == 0


def explicit_layout(t: TopologyConfig) -> TopologyConfig:
    """The layout as given, defaults filled in: auto with device counts means disaggregated
    (`--dit-gpus 1 --vae-gpus 3` works as written), and a count not given is 1."""
    return dataclasses.replace(
        t,
        mode="disaggregated" if t.mode == "auto" else t.mode,
        dit_devices=t.dit_devices or 1,
        vae_devices=t.vae_devices or 1,
    )


class Broken(NamedTuple):
    """A layout rule broken: the key to blame, what the rule wants, and the key's value."""

    key: str
    rule: str
    value: Any


def broken_rule(t: TopologyConfig, decoder: str) -> Broken | None:
    """The first layout rule that `t` (its values each in range: checks.py) breaks with
    `decoder`, or None. A planned layout is checked as given, any other with its defaults
    filled in (`explicit_layout`)."""
    return next(_broken(t, decoder), None)


def _broken(t: TopologyConfig, decoder: str):
    if not planned(t):
        t = explicit_layout(t)
    if not (t.mode != "hybrid" or t.vae_devices > t.dit_devices):
        yield Broken(
            "topology.vae_devices",
            f"hybrid: the VAE group spans the DiT's devices and more (more than dit_devices = {t.dit_devices})",
            t.vae_devices,
        )
    if t.mode == "hybrid" and t.device != "cpu":
        yield Broken(
            "topology.mode",
            "hybrid runs a DiT and a VAE shard as two processes on one device, a CPU's cores: on an accelerator "
            "each would budget the same memory (use aggregated, one process per device)",
            f"hybrid with device {t.device}",
        )
    group = t.vae_group_size or t.vae_devices or 1
    if not (group >= 1 and t.vae_devices % group == 0):
        yield Broken("topology.vae_group_size", f"must divide vae_devices ({t.vae_devices})", t.vae_group_size)
    if not (1 <= t.dit_group_size <= 64 and t.dit_devices % t.dit_group_size == 0):
        yield Broken(
            "topology.dit_group_size", f"must be 1-64 and divide dit_devices ({t.dit_devices})", t.dit_group_size
        )
    # A DiT group runs on DiT devices of its own, or (aggregated) on exactly the devices of the
    # one VAE group, whose process group it shares: the same ranks in the same processes.
    one_group = t.mode == "aggregated" and t.dit_group_size == t.dit_devices == t.vae_devices == group
    if not (t.dit_group_size == 1 or (not planned(t) and (t.mode == "disaggregated" or one_group))):
        yield Broken(
            "topology.dit_group_size",
            "a DiT group needs --dit-gpus: in mode disaggregated, or in mode aggregated over all the devices of "
            "the one VAE group (--dit-gpus G --vae-gpus G)" + ("" if planned(t) else f", not mode {t.mode}"),
            t.dit_group_size,
        )
    if not (
        not t.vae_band_weights or (len(t.vae_band_weights) == group and all(0 < w < 1e6 for w in t.vae_band_weights))
    ):
        yield Broken(
            "topology.vae_band_weights",
            f"must be empty or {group} positive numbers (one per shard of a group)",
            list(t.vae_band_weights),
        )
    if decoder == "taehv":  # TAEHV decodes whole frames on one worker: no groups, no cut, no hybrid
        if group != 1:
            yield Broken(
                "topology.vae_group_size",
                "height sharding is the Wan VAE's: TAEHV does not need it (--vae-gpus k runs k TAEHV replicas, "
                "--vae-group-size 1)",
                t.vae_group_size,
            )
        if t.mode == "hybrid":
            yield Broken("topology.mode", "hybrid shards the Wan VAE: not with TAEHV", t.mode)
        if t.vae_cut != 0:
            yield Broken("topology.vae_cut", "cuts the Wan VAE's stages: not with TAEHV", t.vae_cut)
    if not (t.vae_cut == 0 or (not planned(t) and t.mode == "disaggregated" and group == 1 and t.dit_group_size == 1)):
        yield Broken(
            "topology.vae_cut",
            "needs an explicit layout (--dit-gpus, --vae-gpus) in mode disaggregated with VAE groups of one shard "
            "(--vae-group-size 1) and no DiT group",
            t.vae_cut,
        )
    if t.share_cores and not (
        t.device == "cpu"
        and not planned(t)
        and t.mode in ("auto", "disaggregated")
        and t.dit_devices == 1
        and t.vae_devices == 1
        and t.pin_cpus
    ):
        yield Broken(
            "topology.share_cores",
            "lends a waiting worker's cores to the other: it needs device cpu, topology.pin_cpus (each worker's "
            "own cores) and the layout --dit-gpus 1 --vae-gpus 1 in mode disaggregated (with more workers, "
            "several would borrow the same cores)",
            t.share_cores,
        )
    if t.vae_cut_adapt and not t.vae_cut > 0:
        yield Broken(
            "topology.vae_cut_adapt",
            "moves a cut: it needs topology.vae_cut (--vae-cut N) to start from",
            t.vae_cut_adapt,
        )
