"""Accelerator tests carry the `device` marker and skip cleanly when no CUDA or XPU device is present."""

from __future__ import annotations

import pytest


def accelerator() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return None


def pytest_collection_modifyitems(config, items):
    if accelerator() is not None:
        return
    skip = pytest.mark.skip(reason="no CUDA or XPU accelerator on this machine")
    for item in items:
        if "device" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def plain_daemon():
    """The run's shared plain daemon (tests/helpers.py `shared_daemon`), idle."""
    from .helpers import shared_daemon

    return shared_daemon()


@pytest.fixture(scope="session", autouse=True)
def _stop_the_shared_daemon():
    """Stops the shared daemon, if a test started it, once every test has run: it exits 0 and
    leaves no shared memory."""
    yield
    from .helpers import stop_shared_daemon

    stop_shared_daemon()
