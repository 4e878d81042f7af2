"""The profile's DiT probe and the worker's warm-up hold no more than they need (issue: a first
start ran out of memory while it profiled). Driven in process on the tiny model, with the
device's memory a stand-in: a platform whose budget is a given number of bytes. The figures map
to a device by the same rule the probe applies there: a batch of b is tried where the free
memory covers b - 1 more sessions' caches and b blocks' transients."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from streamdiff.models.engines import DiTEngine
from streamdiff.models.spec import ModelSpec
from streamdiff.placement.profile import probes
from streamdiff.platform.cpu import CpuPlatform


class Device(CpuPlatform):
    """The CPU, with `free` bytes as its device memory (what `memory_budget` says is free)."""

    def __init__(self, free: int) -> None:
        self.free, self.freed = free, 0

    def memory_budget(self, cpu_budget: int, reserve: int = 0) -> int:
        return max(0, self.free - reserve)

    def free_cache(self) -> None:
        self.freed += 1


@pytest.fixture
def probed():
    eng = DiTEngine(ModelSpec(preset="tiny", dtype="float32"))
    refs = []  # every session it opened, weakly: which are still held
    opened = eng.open_session

    def counted(*a, **k):
        s = opened(*a, **k)
        refs.append(weakref.ref(s))
        return s

    def alive() -> int:
        gc.collect()
        return sum(r() is not None for r in refs)

    eng.open_session = counted
    sess = eng.open_session(128, 64, seed=0)
    eng.set_scene(sess, "a red ball", new_shot=True)
    eng.generate_block(sess, eng.frames_per_block)
    held = sess.nbytes
    return eng, sess, alive, held


def timed(fn):
    fn()
    return (1.0, 1.0, 0.0)


def test_a_batch_past_the_free_memory_is_recorded_as_not_fitting_and_never_built(probed):
    eng, sess, alive, held = probed
    peak = []
    run = eng.generate_blocks
    eng.generate_blocks = lambda g, f, *a: (peak.append(alive()), run(g, f, *a))[1]
    transient = 1000
    device = Device(free=(2 - 1) * held + 2 * transient)  # a pair fits, four do not
    batch_ms, unfit = probes._batches(eng, device, sess, 128, 64, (2, 4), transient, timed)
    assert list(batch_ms) == ["2"] and unfit == [4]
    assert max(peak) == 2  # the pair, and never a spare session
    assert alive() == 1 and device.freed == 1  # the pair's other session freed after it


def test_an_out_of_memory_error_in_a_batch_means_it_does_not_fit_and_the_probe_goes_on(probed):
    eng, sess, alive, held = probed
    run = eng.generate_blocks

    def short(group, frames, *a):
        if len(group) == 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return run(group, frames, *a)

    eng.generate_blocks = short
    batch_ms, unfit = probes._batches(eng, Device(free=2**40), sess, 128, 64, (2, 4, 3), 0, timed)
    assert sorted(batch_ms) == ["2", "3"] and unfit == [4]
    assert alive() == 1  # every batch's sessions freed, the failed one's too


def test_warm_opens_no_session_of_its_own(probed):
    """The worker's warm-up runs on calibration's sessions (DiTStage.calibrate passes them)."""
    eng, sess, alive, _ = probed
    other = eng.open_session(128, 64, seed=1)

    def refused(*a, **k):
        raise AssertionError("warm opened a session")

    eng.open_session = refused
    eng.warm([sess, other])
    assert sess.shot_blocks > 0 and other.shot_blocks > 0
