"""The platform's timing on an accelerator (marker `device`): the same stopwatch and wait clock
calls as on the CPU (tests/parallel/test_collective_timing.py) record device events, read once
at the block's end, so queued work is timed where it runs and not where it was enqueued."""

from __future__ import annotations

import pytest
import torch

from streamdiff.platform import for_device
from streamdiff.platform.accel import EventStopwatch, EventWaitClock

from ..conftest import accelerator

pytestmark = pytest.mark.device


def test_the_stopwatch_and_wait_clock_use_device_events():
    dev = accelerator()
    if dev == "cpu":
        pytest.skip("device events: the CPU's clocks are tests/parallel/test_collective_timing.py's")
    plat = for_device(f"{dev}:0")
    plat.select()
    clock, waits = plat.stopwatch(1), plat.wait_clock()
    assert isinstance(clock, EventStopwatch) and isinstance(waits, EventWaitClock)
    a = torch.randn(4096, 4096, device=f"{dev}:0")
    (a @ a).tanh_()  # warm: the BLAS handle, its workspace and the kernels load outside the timing
    plat.sync()
    clock.start()
    for _ in range(8):  # own work
        a = (a @ a).tanh_()
    with waits.span():  # what a collective's span brackets: work queued on the stream
        for _ in range(8):
            a = (a @ a).tanh_()
    assert len(waits.pending) == 1  # nothing read inside the block
    waited = waits.wait_s  # read at the block's end
    wall, own = clock.stop(waited)
    assert waited > 0 and own > 0
    assert own + waited <= wall * 1.05 + 1e-3
    # the two halves did the same work: the device time splits about evenly
    assert 0.5 < own / waited < 2.0, (own, waited)
