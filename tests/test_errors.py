"""What a worker does with an error (workers/errors.py): the session's, the batch's or its own."""

from __future__ import annotations

import pytest
import torch

from streamdiff.workers.errors import MEMORY, REQUEST, SESSION, WORKER, RequestError, SessionError, classify
from streamdiff.workers.faults import DeviceFault


@pytest.mark.parametrize(
    "exc, alone, sharded",
    [
        (RequestError("too big"), REQUEST, REQUEST),
        (SessionError("a gap"), SESSION, SESSION),
        # an accelerator's out-of-memory poisons nothing: the batch fails, the worker stays; in a
        # group the peers may wait in a collective, so the group restarts
        (torch.OutOfMemoryError("CUDA out of memory"), MEMORY, WORKER),
        (DeviceFault("CUDA error: an illegal memory access"), WORKER, WORKER),
        (MemoryError(), WORKER, WORKER),  # the host's: nothing to give back
        (ValueError("bad shape"), REQUEST, WORKER),
        (ValueError("NCCL error"), WORKER, WORKER),
        (RuntimeError("not foreseen"), WORKER, WORKER),
    ],
)
def test_each_error_goes_where_it_belongs(exc, alone, sharded):
    assert classify(exc, sharded=False) == alone
    assert classify(exc, sharded=True) == sharded
