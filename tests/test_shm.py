"""The rings reserve their pages when they are made, or are refused whole, naming the directory,
the bytes and the fix (ipc/shm.py)."""

from __future__ import annotations

import errno
import os

import pytest

from streamdiff.ipc import shm


@pytest.fixture
def instance(request):
    name = f"tshm{os.getpid()}"
    yield name
    shm.sweep_stale(name)
    for n in os.listdir(shm.SHM_DIR):
        if n.startswith(f"sd-{name}-"):
            os.unlink(os.path.join(shm.SHM_DIR, n))


def made(instance: str) -> list[str]:
    return [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"sd-{instance}-")]


def test_every_page_of_a_ring_is_reserved_when_it_is_made(instance):
    rings = shm.create_rings(instance, {"latent": (3, 10_000), "frames": (2, 1 << 20)})
    try:
        for name, ring in rings.items():
            st = os.stat(ring.segment.path)
            assert st.st_size == ring.spec.slots * ring.spec.slot_bytes and ring.spec.slot_bytes % 4096 == 0
            backed = st.st_blocks * 512
            assert backed >= st.st_size, f"{name}: sparse, {backed} of {st.st_size} bytes backed"
    finally:
        for ring in rings.values():
            ring.close(unlink=True)


def test_rings_that_do_not_fit_are_refused_whole_naming_the_directory_and_the_bytes(instance, monkeypatch):
    monkeypatch.setattr(shm, "free_bytes", lambda shm_dir=shm.SHM_DIR: 64 << 20)  # a container's default /dev/shm
    with pytest.raises(shm.SharedMemoryFull) as e:
        shm.create_rings(instance, {"latent": (8, 1_198_080), "frames": (6, 14_376_960)})
    text = str(e.value)
    need = 8 * 1_200_128 + 6 * 14_376_960
    assert shm.SHM_DIR in text and f"{need} bytes" in text and "64.0 MiB free" in text and "--shm-size" in text
    assert e.value.errno == errno.ENOSPC and made(instance) == []


def test_space_taken_between_the_check_and_the_reservation_refuses_them_all(instance, monkeypatch):
    """The directory is shared (other daemons, NCCL): when the second ring's reservation fails,
    the first is removed too, and the one error names what both need."""
    real, calls = os.posix_fallocate, []

    def second_fails(fd, offset, length):
        calls.append(length)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", second_fails)
    with pytest.raises(shm.SharedMemoryFull) as e:
        shm.create_rings(instance, {"latent": (2, 4096), "frames": (2, 8192)})
    assert e.value.need == {"latent": 2 * 4096, "frames": 2 * 8192} and made(instance) == []
