"""What the supervisor tells a worker process at spawn (plain data; no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from ..ipc.shm import RingSpec
from ..models.spec import ModelSpec
from ..platform.cpu_lending import LendSpec
from .faults import Fault


@dataclass(frozen=True)
class GroupSpec:
    """A VAE group (`world` shards split each latent by height) or a DiT group (one DiT over
    `world` devices); this worker is `rank`."""

    name: str
    rank: int = 0
    world: int = 1
    init_addr: str = ""  # tcp://127.0.0.1:PORT for torch.distributed's rendezvous (world > 1)
    shard_front: bool = False  # shard the low-resolution front too (all-gather for attention)
    timeout_s: float = 120.0


@dataclass(frozen=True)
class WorkerSpec:
    name: str  # "dit0", "vae0.1", "agg0": its ZeroMQ identity and log prefix
    roles: tuple[str, ...]  # ("dit",), ("vae",) or both (aggregated mode)
    device: str  # "cpu", "cuda:1", "xpu:0"
    threads: int
    cpus: tuple[int, ...]  # CPU affinity (empty: no pinning)
    model: ModelSpec
    control_addr: str  # the supervisor's ROUTER socket
    latent_ring: RingSpec
    frame_ring: RingSpec
    group: GroupSpec | None = None  # this worker's process group: its VAE group's, or its DiT group's
    dit_group: bool = False  # the DiT stage runs sequence-parallel over `group` (parallel/dit_group.py)
    heartbeat_interval_s: float = 1.0
    log_level: str = "info"
    vae_working_set_bytes: int = 48 * 2**20  # CPU decode: activations per call (see models/wan/kernels.py)
    cpu_memory_budget_bytes: int = 8 * 2**30  # cpu: what one worker's sessions may hold (caches)
    max_batch: int = 4  # blocks of different sessions in one DiT forward or VAE call, at most this many
    incarnation: int = 0  # 0 for the first start, +1 at each restart
    host_processes: int = 1  # the worker processes of this host, which start (and compile) together
    low_priority: bool = False  # hybrid DiT: yields its device's CPU to the VAE shard beside it
    lend: LendSpec | None = None  # shared cores: borrows waiting workers' cores (platform/cpu_lending.py)
    vae_cut: int = 0  # the DiT runs the VAE decoder's first vae_cut stages, the VAE the rest (topology.vae_cut)
    supervisor_pid: int = 0  # set at spawn: the worker exits when this process is gone
    calibration_dir: str = ""  # reuse the start-up figures stored here (workers/calibration.py); empty: measure
    calibration_given: str = ""  # report these timings instead of measuring them (pipeline.calibration_given)
    faults: tuple[Fault, ...] = ()  # deliberate faults (tests and drills only; see workers/faults.py)
