"""Shared-memory rings for latents and frames (supervisor creates; workers attach).

A ring is one POSIX shared-memory file, `/dev/shm/sd-<instance>-<pid>-<ring>`, cut into fixed
slots big enough for the largest block the daemon accepts:

    offset 0                slot_bytes            2*slot_bytes
    | slot 0                | slot 1               | ...            | slot n-1 |
      latent ring: float32 (C, f, h, w) of one block, written by a DiT worker
      frame ring:  uint8 (frames, H, W, 3) of one block; each VAE shard writes its row strip

There are no flags in the memory itself: the supervisor owns every slot's state (free, being
written, ready, being read) and hands slots out in control messages, so a slot is never
written and read at once and a crashed worker cannot leave a half-set flag behind. A full
ring is backpressure: the supervisor stops asking for blocks until a slot frees.

Segment names carry the daemon's instance name and pid; `sweep_stale` removes the segments of
instances whose process is gone (a SIGKILLed daemon cannot clean up after itself). We map the
files directly instead of `multiprocessing.shared_memory`, whose resource tracker would unlink
segments when any attached worker exits.

The supervisor reserves every page of its rings when it creates them (`create_rings`:
`posix_fallocate`), so a `/dev/shm` too small for them (a container's default is 64 MiB) is
refused at start with one error naming the directory, the bytes and the fix. Mapped lazily, a
ring would be backed page by page as its slots are first written, and the first write past the
filesystem's size would kill that worker with SIGBUS, a few blocks into the first large stream.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
from dataclasses import dataclass

import numpy as np

SHM_DIR = os.environ.get("STREAMDIFF_SHM_DIR", "/dev/shm")
PREFIX = "sd-"


def segment_name(instance: str, ring: str, pid: int | None = None) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,40}", instance):
        raise ValueError(f"instance name {instance!r}: use 1-40 letters, digits, '.', '_' or '-'")
    return f"{PREFIX}{instance}-{pid or os.getpid()}-{ring}"


class Segment:
    """A shared-memory file mapped into this process."""

    def __init__(self, name: str, size: int = 0, create: bool = False, shm_dir: str = SHM_DIR) -> None:
        self.name, self.path = name, os.path.join(shm_dir, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                try:
                    os.ftruncate(fd, size)
                    os.posix_fallocate(fd, 0, size)  # every page now: no SIGBUS at a first write later
                except OSError as exc:
                    os.unlink(self.path)
                    if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                        raise SharedMemoryFull(shm_dir, {name: size}) from None
                    raise
            self.size = os.fstat(fd).st_size
            self.buf = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.owner = create

    def close(self) -> None:
        if self.buf is not None:
            try:
                self.buf.close()
            except BufferError:  # views still exported; the mapping goes with the process
                pass
            self.buf = None

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def free_bytes(shm_dir: str = SHM_DIR) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


class SharedMemoryFull(OSError):
    """The shared-memory directory cannot hold what the daemon must reserve there."""

    def __init__(self, shm_dir: str, need: dict[str, int]) -> None:
        self.shm_dir, self.need, self.free = shm_dir, dict(need), free_bytes(shm_dir)
        parts = ", ".join(f"{name} {n / 2**20:.1f} MiB" for name, n in need.items())
        super().__init__(
            errno.ENOSPC,
            f"{shm_dir} has {self.free / 2**20:.1f} MiB free ({self.free} bytes), and the shared-memory rings need "
            f"{sum(need.values()) / 2**20:.1f} MiB ({sum(need.values())} bytes: {parts}); give it more "
            "(docker run --shm-size=1g, or a memory-backed emptyDir at /dev/shm in Kubernetes)",
        )


def _page_aligned(n: int) -> int:
    return (n + 4095) // 4096 * 4096


def create_rings(instance: str, rings: dict[str, tuple[int, int]]) -> dict[str, Ring]:
    """Create and reserve the rings `{name: (slots, slot_bytes)}`, or none of them: when the
    directory cannot hold them all, SharedMemoryFull names it, the bytes each needs and the fix."""
    need = {name: slots * _page_aligned(slot_bytes) for name, (slots, slot_bytes) in rings.items()}
    if sum(need.values()) > free_bytes():
        raise SharedMemoryFull(SHM_DIR, need)
    made: dict[str, Ring] = {}
    try:
        for name, (slots, slot_bytes) in rings.items():
            made[name] = Ring.create(instance, name, slots, slot_bytes)
    except SharedMemoryFull:  # another tenant of the directory took the space since the check
        for ring in made.values():
            ring.close(unlink=True)
        raise SharedMemoryFull(SHM_DIR, need) from None
    return made


@dataclass(frozen=True)
class RingSpec:
    """What a worker needs to attach a ring: plain data, crosses process boundaries."""

    name: str
    slots: int
    slot_bytes: int


class Ring:
    def __init__(self, spec: RingSpec, create: bool = False) -> None:
        self.spec = spec
        self.segment = Segment(spec.name, spec.slots * spec.slot_bytes, create=create)

    @classmethod
    def create(cls, instance: str, ring: str, slots: int, slot_bytes: int) -> Ring:
        slot_bytes = _page_aligned(slot_bytes)
        return cls(RingSpec(segment_name(instance, ring), slots, slot_bytes), create=True)

    def array(self, slot: int, shape, dtype) -> np.ndarray:
        """A numpy view of `slot` (no copy)."""
        if not 0 <= slot < self.spec.slots:
            raise IndexError(f"ring {self.spec.name}: slot {slot} out of range")
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        if count * dtype.itemsize > self.spec.slot_bytes:
            raise ValueError(
                f"ring {self.spec.name}: {tuple(shape)} {dtype} does not fit a slot of {self.spec.slot_bytes} bytes"
            )
        return np.frombuffer(self.segment.buf, dtype, count, slot * self.spec.slot_bytes).reshape(shape)

    def close(self, unlink: bool = False) -> None:
        self.segment.close()
        if unlink:
            self.segment.unlink()


class SlotPool:
    """The supervisor's book of which slots are free (FIFO, so slots are reused round-robin)."""

    def __init__(self, slots: int) -> None:
        self.free = list(range(slots))
        self.total = slots

    def take(self) -> int | None:
        return self.free.pop(0) if self.free else None

    def give(self, slot: int) -> None:
        if slot in self.free or not 0 <= slot < self.total:
            raise ValueError(f"slot {slot} freed twice or out of range")
        self.free.append(slot)

    @property
    def used(self) -> int:
        return self.total - len(self.free)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(instance: str, shm_dir: str = SHM_DIR) -> list[str]:
    """Remove segments left by dead processes of this instance; returns their names."""
    removed = []
    pat = re.compile(rf"^{re.escape(PREFIX + instance)}-(\d+)-")
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        m = pat.match(name)
        if m and not _alive(int(m[1])):
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed
