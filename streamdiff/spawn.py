"""How the daemon starts the processes that run torch: its workers and the profile's children."""

from __future__ import annotations

import multiprocessing as mp
import os


def spawn_context():
    """multiprocessing's spawn context, whose children's OpenMP threads sleep while they wait
    (OMP_WAIT_POLICY is read when a child loads torch; one set in the environment stays). On
    the CPU a worker shares cores with the supervisor's encoder, or with the other stage
    (--share-cores), and a spinning thread holds a core they need: measured in
    docs/benchmarks.md#shared-cores-and-the-cut-priced-at-its-exchange-2026-12-01-the-epyc-later-still."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return mp.get_context("spawn")
