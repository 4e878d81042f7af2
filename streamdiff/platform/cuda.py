"""The CUDA platform (NCCL collectives)."""

from __future__ import annotations

import logging
import os

from .accel import AcceleratorPlatform

log = logging.getLogger("streamdiff.platform")

# The caching allocator's settings: PYTORCH_ALLOC_CONF is the name it reads from torch 2.9.1 on
# (pytorch#165131); before, only the old PYTORCH_CUDA_ALLOC_CONF (pytorch#183387 reports the new
# one ignored on 2.9.1), and pyproject allows torch>=2.8. Both are set, to the same value.
ALLOC_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
ALLOC_DEFAULT = "expandable_segments:True"
_logged = False


def allocator_conf(environ=os.environ) -> str:
    """Set the allocator's settings under both names: the one the environment gives (the new
    name first), else expandable segments. Logged once a process."""
    global _logged
    given = next(((n, environ[n]) for n in ALLOC_NAMES if environ.get(n)), None)
    value = given[1] if given else ALLOC_DEFAULT
    for name in ALLOC_NAMES:
        environ.setdefault(name, value)
        if not environ[name]:
            environ[name] = value
    if not _logged:
        where = f"from {given[0]}" if given else "the default"
        log.info("the CUDA allocator: %s (%s), under %s", value, where, " and ".join(ALLOC_NAMES))
        _logged = True
    return value


class CudaPlatform(AcceleratorPlatform):
    kind = runtime_name = "cuda"

    def setup_process(
        self, threads: int, cpus: tuple[int, ...] = (), low_priority: bool = False, host_processes: int = 1
    ) -> None:
        """The caching allocator grows segments in place (`expandable_segments`): sessions of
        mixed sizes each allocate a window of large buffers, and fixed segments fragment between
        them. Read when the allocator starts, so before the first allocation; what the
        environment sets stays (`allocator_conf`)."""
        super().setup_process(threads, cpus, low_priority, host_processes)
        allocator_conf()


PLATFORM = CudaPlatform
