"""A layout of the workers over the devices, as the planner ranks and the simulator runs it: its
name and flags, and its one mapping to and from the [topology] config (`Layout.of`,
`Layout.configure`) and to the supervisor's process names (`Layout.topology`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import TopologyConfig
from ..config.layout import explicit_layout
from ..supervisor.topology import Topology, layout_processes


@dataclass(frozen=True)
class Layout:
    mode: str  # disaggregated | aggregated | hybrid
    dit: int  # DiT devices (workers)
    vae: int  # VAE devices (shards)
    group: int = 0  # shards per VAE group (0: all)
    threads: int = 1  # per worker (CPU)
    weights: tuple[float, ...] = ()
    dit_group: int = 1  # devices per DiT (Ulysses; disaggregated)
    vae_cut: int = 0  # the DiT workers also run the VAE decoder's first `vae_cut` stages (topology.vae_cut)
    shared: bool = False  # CPU: a waiting worker lends its cores to the other (topology.share_cores)

    @property
    def group_size(self) -> int:
        return self.group or self.vae

    @property
    def devices(self) -> int:
        """Devices it occupies (on the CPU a device is a core: threads count)."""
        n = self.dit + self.vae if self.mode == "disaggregated" else max(self.dit, self.vae)
        return n * self.threads

    @property
    def name(self) -> str:
        k = self.group_size
        if self.mode == "disaggregated":
            base = f"disagg-{self.dit}+{self.vae}" + (f"/k{k}" if k != self.vae else "")
            base += f"/sp{self.dit_group}" if self.dit_group > 1 else ""
            base += f"/cut{self.vae_cut}" if self.vae_cut else ""
        elif self.mode == "hybrid":
            base = f"hybrid-{self.dit}+{self.vae}" + (f"/k{k}" if k != self.vae else "")
        elif self.dit_group > 1:  # one DiT and one VAE group over the same devices, in sequence
            base = f"agg-sp{self.dit_group}"
        elif self.dit == 1 and self.vae == 1:
            base = "agg-1"
        elif self.dit == self.vae and k == 1:
            base = f"agg-{self.dit}rep"
        elif self.dit == 1 and k == self.vae:
            base = f"agg-seq-k{self.vae}"
        else:
            base = f"agg-{self.dit}+{self.vae}/k{k}"
        return base + (f"x{self.threads}t" if self.threads > 1 else "") + ("/shared" if self.shared else "")

    def flags(self) -> list[str]:
        out = ["--mode", self.mode, "--dit-gpus", str(self.dit), "--vae-gpus", str(self.vae)]
        if self.group and self.group != self.vae:
            out += ["--vae-group-size", str(self.group)]
        if self.dit_group > 1:
            out += ["--dit-group-size", str(self.dit_group)]
        if self.threads > 1:
            out += ["--threads-per-worker", str(self.threads)]
        if self.vae_cut:
            out += ["--vae-cut", str(self.vae_cut)]
        if self.shared:
            out += ["--share-cores"]
        return out

    @classmethod
    def of(cls, t: TopologyConfig) -> Layout:
        """The layout a [topology] gives (device counts and mode filled in: explicit_layout)."""
        t = explicit_layout(t)
        return cls(
            t.mode,
            t.dit_devices,
            t.vae_devices,
            t.vae_group_size,
            t.threads_per_worker,
            t.vae_band_weights,
            t.dit_group_size,
            t.vae_cut,
            shared=t.share_cores,
        )

    def configure(self, t: TopologyConfig, **more) -> TopologyConfig:
        """`t` with this layout's keys set (and `more`): what the daemon runs it as."""
        return replace(
            t,
            mode=self.mode,
            dit_devices=self.dit,
            vae_devices=self.vae,
            vae_group_size=self.group,
            dit_group_size=self.dit_group,
            threads_per_worker=self.threads,
            vae_band_weights=self.weights,
            vae_cut=self.vae_cut,
            share_cores=self.shared,
            **more,
        )

    def topology(self) -> Topology:
        """Who runs where, as the supervisor's topology names them (no worker specs)."""
        lay = layout_processes(self.mode, self.dit, self.vae, self.group_size, self.dit_group)
        dit_groups = {g[0]: g for g in lay.dit_groups if len(g) > 1}
        return Topology([], lay.dit_names, lay.group_names, {name: dev for name, _, dev in lay.procs}, dit_groups)
