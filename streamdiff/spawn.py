"""How the daemon starts the processes that run torch: its workers and the profile's children."""

from __future__ import annotations

import multiprocessing as mp
import os


def spawn_context():
    """multiprocessing's spawn context, whose children's OpenMP threads sleep while they wait
    (OMP_WAIT_POLICY is read when a child loads torch; one set in the environment stays). On
    the CPU a worker shares cores with the supervisor's encoder, or with the other stage
    (--share-cores), and a spinning thread holds a core they need: on the 2-vCPU EPYC,
    disagg-1+1 sharing both cores on two threads a worker ran 22.9 frames/s spinning and 48.5
    sleeping, and agg-1x2t's encoder took 14 ms a block beside it instead of 87
    (docs/benchmarks.md)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return mp.get_context("spawn")
