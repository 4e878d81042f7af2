"""From the [topology] config to worker specs: who runs where (supervisor process)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from ..config import Config, ConfigError, injected_faults, sampler_overrides
from ..ipc.shm import RingSpec
from ..models.spec import ModelSpec
from ..workers import faults as injected
from ..workers.spec import GroupSpec, WorkerSpec


@dataclass(frozen=True)
class Topology:
    workers: list[WorkerSpec]
    dit_workers: list[str]  # names of the workers with the DiT stage
    vae_groups: list[list[str]]  # each group's shards in rank order


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_spec(cfg: Config) -> ModelSpec:
    m = cfg.model
    return ModelSpec(
        preset=m.preset,
        path=m.path or None,
        dit_checkpoint=m.dit_checkpoint or None,
        use_ema=m.use_ema,
        dtype=m.dtype,
        dit_vae_ratio=m.dit_vae_ratio,
        seed=m.seed,
        sampler=sampler_overrides(cfg),
    )


def _device(kind: str, index: int) -> str:
    return "cpu" if kind == "cpu" else f"{kind}:{index}"


def _cpus(index: int, threads: int, pin: bool) -> tuple[int, ...]:
    if not pin or not hasattr(os, "sched_getaffinity"):
        return ()
    avail = sorted(os.sched_getaffinity(0))
    return tuple(avail[(index * threads + k) % len(avail)] for k in range(threads))


def build_topology(cfg: Config, control_addr: str, latent_ring: RingSpec, frame_ring: RingSpec) -> Topology:
    t, p = cfg.topology, cfg.pipeline
    spec = model_spec(cfg)
    try:
        faults = injected.parse(injected_faults())
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    group_size = t.vae_group_size or t.vae_devices
    roles: dict[int, set[str]] = {}
    if t.mode == "disaggregated":
        dit_dev = list(range(t.dit_devices))
        vae_dev = list(range(t.dit_devices, t.dit_devices + t.vae_devices))
        prefix = {i: "dit" for i in dit_dev} | {i: "vae" for i in vae_dev}
    else:  # aggregated: the same devices run both stages, one process each
        dit_dev = list(range(t.dit_devices))
        vae_dev = list(range(t.vae_devices))
        prefix = {i: "agg" for i in range(max(t.dit_devices, t.vae_devices))}
    for i in dit_dev:
        roles.setdefault(i, set()).add("dit")
    for i in vae_dev:
        roles.setdefault(i, set()).add("vae")
    groups = [vae_dev[g : g + group_size] for g in range(0, len(vae_dev), group_size)]
    names = {}
    for i in sorted(roles):
        gi = next((k for k, g in enumerate(groups) if i in g), None)
        if prefix[i] == "vae":
            names[i] = f"vae{gi}.{groups[gi].index(i)}"
        else:
            names[i] = f"{prefix[i]}{i}"
    group_specs = {}
    for gi, g in enumerate(groups):
        addr = f"tcp://127.0.0.1:{free_port()}" if len(g) > 1 else ""
        for rank, i in enumerate(g):
            group_specs[i] = GroupSpec(f"vae{gi}", rank, len(g), addr, t.shard_front, p.collective_timeout_s)
    workers = [
        WorkerSpec(
            name=names[i],
            roles=tuple(r for r in ("dit", "vae") if r in roles[i]),
            device=_device(t.device, i),
            threads=t.threads_per_worker,
            cpus=_cpus(i, t.threads_per_worker, t.pin_cpus and t.device == "cpu"),
            model=spec,
            control_addr=control_addr,
            latent_ring=latent_ring,
            frame_ring=frame_ring,
            group=group_specs.get(i),
            heartbeat_interval_s=p.heartbeat_interval_s,
            log_level=cfg.server.log_level,
            vae_working_set_bytes=p.vae_cpu_working_set_bytes,
            max_batch=p.max_batch,
            cpu_memory_budget_bytes=p.cpu_memory_budget_bytes,
            faults=faults,
        )
        for i in sorted(roles)
    ]
    return Topology(workers, [names[i] for i in dit_dev], [[names[i] for i in g] for g in groups])


def with_new_group_addr(spec: WorkerSpec, addr: str) -> WorkerSpec:
    from dataclasses import replace

    return replace(spec, group=replace(spec.group, init_addr=addr)) if spec.group else spec
