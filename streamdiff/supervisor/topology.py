"""From the [topology] config to worker specs: who runs where (supervisor process)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from ..card import ModelCard
from ..config import Config, ConfigError, injected_faults, parse_size, sampler_overrides
from ..config.layout import explicit_layout
from ..ipc.shm import RingSpec
from ..models.spec import ModelSpec, preset_card
from ..platform.cpu import available_cores, worker_cores
from ..platform.cpu_lending import LendSpec, create_ledger
from ..workers import faults as injected
from ..workers.spec import GroupSpec, WorkerSpec


@dataclass(frozen=True)
class Topology:
    workers: list[WorkerSpec]
    dit_workers: list[str]  # the DiTs the scheduler places on: a worker, or a DiT group's rank 0
    vae_groups: list[list[str]]  # each group's shards in rank order
    devices: dict[str, int] = field(default_factory=dict)  # worker -> device index (hybrid: two per device)
    dit_groups: dict[str, list[str]] = field(default_factory=dict)  # a DiT group's rank 0 -> its ranks in order
    host_lend: LendSpec | None = None  # shared cores: the supervisor's encoders' byte (platform/cpu_lending.py)

    def members(self, dit: str) -> list[str]:
        """The processes that run DiT `dit`: its group's ranks, or itself."""
        return self.dit_groups.get(dit, [dit])

    def group_of(self, vae_worker: str) -> int:
        """The VAE group a shard belongs to."""
        return next(i for i, g in enumerate(self.vae_groups) if vae_worker in g)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lost_its_port(log: str) -> bool:
    """Whether a daemon's log says it exited because a port it was given is in use (cli/daemon.py
    logs "cannot listen ..." with the OS's reason): picked by `free_port`, then taken by another
    process before the daemon listened (an outgoing connection's ephemeral port, say). Its
    starter may start it again on other ports (streamdiff/testing.py, tools/dev/cluster.py)."""
    return "cannot listen" in log and "address already in use" in log


def model_spec(cfg: Config) -> ModelSpec:
    m = cfg.model
    return ModelSpec(
        preset=m.preset,
        path=m.path or None,
        dit_checkpoint=m.dit_checkpoint or None,
        weights=m.weights or None,
        lora=m.lora or None,
        lora_alpha=m.lora_alpha or None,
        dtype=m.dtype,
        decoder=m.decoder,
        decoder_weights=m.decoder_weights or None,
        compile=m.compile,
        dit_vae_ratio=m.dit_vae_ratio,
        seed=m.seed,
        sampler=sampler_overrides(cfg),
        default_size=parse_size(cfg.model.size),
    )


def model_card(cfg: Config) -> ModelCard:
    """What the supervisor, the API and the planner know of the model before any worker starts
    (the DiT workers confirm it in READY): the preset's card, with the configured block and size."""
    return preset_card(cfg.model.preset).configured(cfg.sampler.frames_per_block, parse_size(cfg.model.size))


def _device(kind: str, index: int) -> str:
    return "cpu" if kind == "cpu" else f"{kind}:{index}"


@dataclass(frozen=True)
class Processes:
    """Who runs where, as plain names (`layout_processes`)."""

    procs: list[tuple[str, tuple[str, ...], int]]  # (name, roles, device)
    dit_names: list[str]  # one per DiT: a DiT group's rank 0
    group_names: list[list[str]]  # each VAE group's shards in rank order
    groups: list[list[int]]  # each VAE group's devices
    dit_groups: list[list[str]]  # each DiT's processes in rank order


def layout_processes(mode: str, dit_devices: int, vae_devices: int, group_size: int, dit_group: int = 1) -> Processes:
    """One process per device, except in hybrid mode, where each of the DiT's devices also runs
    a VAE shard in a process of its own. A DiT group (disaggregated) is `dit_group` consecutive
    DiT devices, one process each. The daemon and the simulator (placement/sim.py) both build
    on this."""
    group_size = group_size or vae_devices
    if mode == "disaggregated":
        dit_dev = list(range(dit_devices))
        vae_dev = list(range(dit_devices, dit_devices + vae_devices))
    else:  # aggregated and hybrid: the VAE devices start with the DiT's
        dit_dev = list(range(dit_devices))
        vae_dev = list(range(vae_devices))
    groups = [vae_dev[g : g + group_size] for g in range(0, len(vae_dev), group_size)]
    procs: list[tuple[str, tuple[str, ...], int]] = []
    if mode == "aggregated":  # the same devices run both stages, one process each
        for i in sorted(set(dit_dev) | set(vae_dev)):
            procs.append((f"agg{i}", tuple(r for r, d in (("dit", dit_dev), ("vae", vae_dev)) if i in d), i))
    else:
        procs += [(f"dit{i}", ("dit",), i) for i in dit_dev]
        procs += [(f"vae{gi}.{r}", ("vae",), i) for gi, g in enumerate(groups) for r, i in enumerate(g)]
    all_dits = [next(n for n, r, d in procs if "dit" in r and d == i) for i in dit_dev]
    dit_groups = [all_dits[i : i + dit_group] for i in range(0, len(all_dits), dit_group)]
    group_names = [[next(n for n, r, d in procs if "vae" in r and d == i) for i in g] for g in groups]
    return Processes(procs, [g[0] for g in dit_groups], group_names, groups, dit_groups)


def build_topology(
    cfg: Config, control_addr: str, latent_ring: RingSpec, frame_ring: RingSpec, runtime_dir: str = ""
) -> Topology:
    """The worker specs of cfg's layout (`layout_processes`); in hybrid mode the DiT runs below
    the VAE shard beside it in priority: on the CPU it takes the core while the shard waits at
    its halo exchanges. On shared cores the workers lend each other their cores through a ledger
    file in `runtime_dir` (platform/cpu_lending.py)."""
    t, p = explicit_layout(cfg.topology), cfg.pipeline
    spec = model_spec(cfg)
    try:
        faults = injected.parse(injected_faults())
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    lay = layout_processes(t.mode, t.dit_devices, t.vae_devices, t.vae_group_size, t.dit_group_size)
    group_specs = {}  # worker -> its VAE or DiT group
    for gi, g in enumerate(lay.group_names):
        addr = f"tcp://127.0.0.1:{free_port()}" if len(g) > 1 else ""
        for rank, name in enumerate(g):
            group_specs[name] = GroupSpec(f"vae{gi}", rank, len(g), addr, t.shard_front, p.collective_timeout_s)
    for gi, g in enumerate(lay.dit_groups):
        if len(g) > 1 and t.mode != "aggregated":  # aggregated: the VAE group's process group (config/layout.py)
            addr = f"tcp://127.0.0.1:{free_port()}"
            for rank, name in enumerate(g):
                group_specs[name] = GroupSpec(f"dit{gi}", rank, len(g), addr, False, p.collective_timeout_s)
    pin = t.pin_cpus and t.device == "cpu"
    share = pin and t.share_cores
    lend, host = {}, None
    if share and runtime_dir:
        ledger = os.path.join(runtime_dir, "cores")
        n = len(lay.procs)
        create_ledger(ledger, n + 1)
        own = tuple(t.threads_per_worker for _ in lay.procs) + (0,)
        # the last byte is the supervisor's encoder, on the DiT's cores (core.py _pin_self)
        dit0 = next(i for i, (_, roles, _) in enumerate(lay.procs) if "dit" in roles)
        groups = tuple(range(n)) + (dit0,)
        cores = tuple(available_cores())
        lend = {name: LendSpec(ledger, i, own, groups, cores) for i, (name, _, _) in enumerate(lay.procs)}
        host = LendSpec(ledger, n, own, groups, cores)
    workers = [
        WorkerSpec(
            name=name,
            roles=roles,
            device=_device(t.device, i),
            threads=t.threads_per_worker,
            host_processes=len(lay.procs),
            cpus=worker_cores(i, t.threads_per_worker, pin),  # shared cores: its own ones, and more to borrow
            model=spec,
            control_addr=control_addr,
            latent_ring=latent_ring,
            frame_ring=frame_ring,
            group=group_specs.get(name),
            dit_group="dit" in roles and t.dit_group_size > 1,
            heartbeat_interval_s=p.heartbeat_interval_s,
            log_level=cfg.server.log_level,
            vae_working_set_bytes=p.vae_cpu_working_set_bytes,
            max_batch=p.max_batch,
            cpu_memory_budget_bytes=p.cpu_memory_budget_bytes,
            faults=faults,
            low_priority=t.mode == "hybrid" and roles == ("dit",),
            lend=lend.get(name),
            vae_cut=t.vae_cut,
            calibration_dir=p.calibration_dir,
            calibration_given=p.calibration_given,
        )
        for name, roles, i in lay.procs
    ]
    dit_groups = {g[0]: g for g in lay.dit_groups if len(g) > 1}
    return Topology(workers, lay.dit_names, lay.group_names, {name: i for name, _, i in lay.procs}, dit_groups, host)


def with_new_group_addr(spec: WorkerSpec, addr: str) -> WorkerSpec:
    from dataclasses import replace

    return replace(spec, group=replace(spec.group, init_addr=addr)) if spec.group else spec
