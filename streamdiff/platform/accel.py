"""What CUDA and XPU share: device events for timing, the runtime's memory query.

Work on an accelerator is queued: a host clock around it measures the enqueue. The stopwatch
and the wait clock record events on the platform's device's current stream around the block and
around each collective, and read them once, at the block's end (`stop`, `wait_s`): nothing
inside a block waits for the device. Every call into the runtime names the device (a process
whose current device is another, a profile probe that never selected its own, would otherwise
sync and time that other device's idle stream). A collective's events bracket the time the stream spent in it:
communication and waiting for peers (NCCL and oneCCL make the current stream wait for the
collective's own stream), so `own = device time - waits` means on a GPU what it means on the CPU.
"""

from __future__ import annotations

import contextlib
import time

import torch

from .base import Platform, Stopwatch, WaitClock


def _mark(runtime, device: torch.device):
    """A timing event recorded now on `device`'s current stream."""
    ev = runtime.Event(enable_timing=True)
    ev.record(runtime.current_stream(device))
    return ev


class EventStopwatch(Stopwatch):
    def __init__(self, runtime, device: torch.device) -> None:
        self.rt, self.device = runtime, device
        self.wall0, self.begin = 0.0, None

    def start(self) -> None:
        self.begin = _mark(self.rt, self.device)
        self.wall0 = time.perf_counter()

    def stop(self, waited_s: float = 0.0) -> tuple[float, float]:
        end = _mark(self.rt, self.device)
        end.synchronize()
        wall = time.perf_counter() - self.wall0
        device_s = self.begin.elapsed_time(end) / 1000
        return wall, min(wall, max(0.0, device_s - waited_s))


class EventWaitClock(WaitClock):
    def __init__(self, runtime, device: torch.device) -> None:
        super().__init__()
        self.rt, self.device = runtime, device
        self.pending: list[tuple] = []

    @contextlib.contextmanager
    def span(self):
        a = _mark(self.rt, self.device)
        try:
            yield
        finally:
            self.pending.append((a, _mark(self.rt, self.device)))

    @property
    def wait_s(self) -> float:
        if self.pending:
            self.pending[-1][1].synchronize()
            self._total += sum(a.elapsed_time(b) for a, b in self.pending) / 1000
            self.pending.clear()
        return self._total


# Of the device memory free once the VAE has loaded, what one decode call may take at its peak:
# Wan 2.2's second upsample alone is 3.7 G elements for LongLive 2.0's 8-frame block at
# 1280x704, more than an 80 GB device holds beside its sessions, in one call.
DECODE_SHARE = 0.25
# A decode call's peak bytes per latent frame over the working-set estimate the frames per call
# are sized by (kernels.plan_block): 2.2 for the Wan 2.1 decoder, 2.75 for Wan 2.2's, counted
# storage by storage (tests/models/test_vae_memory.py holds the bound).
PEAK_PER_ESTIMATE = 3.0


class AcceleratorPlatform(Platform):
    runtime_name = ""

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.rt = getattr(torch, self.runtime_name, None)

    def available(self) -> bool:
        return self.rt is not None and self.rt.is_available()

    @property
    def torch_device(self) -> torch.device:
        """The device with its index ("cuda" is "cuda:0")."""
        dev = torch.device(self.device)
        return dev if dev.index is not None else torch.device(dev.type, 0)

    def select(self) -> None:
        self.rt.set_device(self.torch_device)

    def sync(self) -> None:
        self.rt.synchronize(self.torch_device)

    def stopwatch(self, threads: int) -> Stopwatch:
        return EventStopwatch(self.rt, self.torch_device)

    def wait_clock(self) -> WaitClock:
        return EventWaitClock(self.rt, self.torch_device)

    def release_memory(self) -> None:
        self.rt.empty_cache()

    def memory_budget(self, cpu_budget: int, reserve: int = 0) -> int:
        """90% of the device memory free once every stage of the worker has loaded and
        calibrated (their calibration sessions gone, the allocator's cache given back), less
        `reserve` for the largest batch's transients (where the runtime says)."""
        if not hasattr(self.rt, "mem_get_info"):
            return cpu_budget
        self.rt.empty_cache()
        return max(0, int(0.9 * self.rt.mem_get_info(self.torch_device)[0]) - reserve)

    def decode_working_set(self, cpu_bytes: int) -> int:
        """A share of the device memory free once the decoder has loaded (DECODE_SHARE), as the
        working-set estimate counts it (PEAK_PER_ESTIMATE): the frames per call follow from it,
        so a block's activations never outgrow the device, and the calibration's measured
        transient, reserved out of the sessions' budget, is bounded by it. Where the runtime does
        not say, all the frames of a block in one call."""
        if not hasattr(self.rt, "mem_get_info"):
            return 2**40
        free = self.rt.mem_get_info(self.torch_device)[0]
        return max(cpu_bytes, int(DECODE_SHARE * free / PEAK_PER_ESTIMATE))

    def free_cache(self) -> None:
        if hasattr(self.rt, "empty_cache"):
            self.rt.empty_cache()

    @property
    def counts_transients(self) -> bool:
        return hasattr(self.rt, "max_memory_allocated")

    def peak_during(self, fn) -> tuple[object, int]:
        if not self.counts_transients:
            return fn(), 0
        dev = self.torch_device
        before = self.rt.memory_allocated(dev)
        self.rt.reset_peak_memory_stats(dev)
        out = fn()
        return out, max(0, self.rt.max_memory_allocated(dev) - before)
