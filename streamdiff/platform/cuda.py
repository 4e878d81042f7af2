"""The CUDA platform (NCCL collectives)."""

from __future__ import annotations

import os

from .accel import AcceleratorPlatform


class CudaPlatform(AcceleratorPlatform):
    kind = runtime_name = "cuda"

    def setup_process(self, threads: int, cpus: tuple[int, ...] = (), low_priority: bool = False) -> None:
        """The caching allocator grows segments in place (`expandable_segments`): sessions of
        mixed sizes each allocate a window of large buffers, and fixed segments fragment between
        them. Read when the allocator starts, so before the first allocation; one the
        environment sets (PYTORCH_ALLOC_CONF, or its old name) stays."""
        super().setup_process(threads, cpus, low_priority)
        if not (os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")):
            os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"


PLATFORM = CudaPlatform
