"""What every platform provides, and the parts they share (no torch at import)."""

from __future__ import annotations

import contextlib
import os
import time

KINDS = ("cpu", "cuda", "xpu")
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl"}  # torch.distributed's for each kind


def kind_of(device: str) -> str:
    """ "cuda:1" -> "cuda"; raises on a kind this daemon does not know."""
    kind = device.split(":", 1)[0]
    if kind not in KINDS:
        raise ValueError(f"device {device!r}: must be one of {', '.join(KINDS)}")
    return kind


class Stopwatch:
    """A block's wall time and the stage's own device work (`busy_ms`): what the stage took of
    its device, not what it spent waiting for neighbours on collectives. Each platform says how
    its own work is measured; `stop(waited_s)` takes the waits its `WaitClock` counted.
    `start` and `stop` bracket one block; nothing inside the block waits for the device."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self, waited_s: float = 0.0) -> tuple[float, float]:
        """(wall seconds, own seconds) since start."""
        raise NotImplementedError


class WaitClock:
    """Time spent inside collectives (communication and waiting for peers) by one stage: each
    collective runs inside `span()`; `wait_s` is the total so far, read at a block's end."""

    def __init__(self) -> None:
        self._total = 0.0

    @contextlib.contextmanager
    def span(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._total += time.perf_counter() - t0

    @property
    def wait_s(self) -> float:
        return self._total


class Platform:
    """One device's platform (`for_device`)."""

    kind = ""
    low_priority_runs = False  # a hybrid DiT yields its device's core to the VAE shard beside it
    idle_timing = False  # the profile sleeps before a shot's first block, as a waiting worker would
    float64 = True  # the device runs float64 kernels (the timestep embedding's precision)

    def __init__(self, device: str) -> None:
        self.device = device
        self.backend = BACKENDS[self.kind]

    def available(self) -> bool:
        """Whether this PyTorch sees a device of this kind (in-process: creates no context)."""
        return True

    def select(self) -> None:
        """Make this device the process's current one (accelerators)."""

    def setup_process(
        self, threads: int, cpus: tuple[int, ...] = (), low_priority: bool = False, host_processes: int = 1
    ) -> None:
        """Before any model is built: the math libraries' thread pools sized to the worker's
        threads (on accelerators too: host-side copies and the like, and several workers share
        the host's cores). And Inductor's compile workers, unless the environment sets them: by
        default it starts min(32, cores) in every process, so each of a host's workers would
        compile with all its cores at once; each gets its share of the cores it may run on
        (`cpus`, else its affinity), among the `host_processes` that start together."""
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ[var] = str(threads)
        cores = len(cpus) if cpus else len(os.sched_getaffinity(0))
        share = max(threads, min(32, cores) // max(1, host_processes))
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, share)))

    def sync(self) -> None:
        """Wait until the device has done everything queued so far."""

    def stopwatch(self, threads: int) -> Stopwatch:
        raise NotImplementedError

    def wait_clock(self) -> WaitClock:
        return WaitClock()

    def decode_working_set(self, cpu_bytes: int) -> int:
        """The bytes of activations a VAE decode call may work in (models/wan/kernels.py sizes
        its frames per call by it): on the CPU `cpu_bytes`, what stays in cache."""
        return cpu_bytes

    def free_cache(self) -> None:
        """Give the allocator's cached blocks back to the device (accelerators)."""

    def memory_budget(self, cpu_budget: int, reserve: int = 0) -> int:
        """What the sessions of this device's worker may hold, asked once its stages have all
        loaded and calibrated; `reserve`: the transients of its largest batch (`peak_during`).
        The CPU's is the configured budget (pipeline.cpu_memory_budget_bytes)."""
        return cpu_budget

    @property
    def counts_transients(self) -> bool:
        """Whether `peak_during` counts anything here."""
        return False

    def peak_during(self, fn) -> tuple[object, int]:
        """(fn(), the bytes its run allocated on the device beyond what was allocated before:
        a block's transients, its activations and workspaces). Nothing counted on the CPU."""
        return fn(), 0

    def release_memory(self) -> None:
        """Give back what the allocator caches (after an out-of-memory error failed a batch)."""

    def idle(self, seconds: float) -> None:
        """The profile's idle spell before a shot's first block (only where it changes the
        timing: the CPU's caches and frequency; `idle_timing`)."""
        if self.idle_timing:
            time.sleep(seconds)
