"""The platform's timing of a block that holds collectives, on a CPU group over gloo: the
stopwatch's own time (the stage's work) and the wait clock's time inside the collectives add
up to the block's wall time, with a neighbour's slowness on the waiting side. The same code
path records device events on CUDA/XPU (tests/device/test_platform_timing.py)."""

from __future__ import annotations

import os
import queue
import re
import time
import traceback

import torch

from streamdiff.spawn import torch_context

from ..helpers import free_port

WORK_S = {0: 0.02, 1: 0.5}  # CPU seconds of own work per block: rank 1 is the slow neighbour


def spin(cpu_s: float) -> None:
    """Own work: this much of the process's CPU time (under load it takes longer on the clock)."""
    c0 = time.process_time()
    while time.process_time() - c0 < cpu_s:
        pass


def run_delay() -> float:
    """Seconds this thread has waited on a run queue for a core (Linux schedstat; 0 elsewhere):
    on a loaded machine a block's wall time also holds this, which is neither its own work (CPU
    time) nor a wait on a neighbour."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def steal_per_cpu() -> list[float]:
    """Seconds the hypervisor has taken from each core (/proc/stat's `steal`; empty elsewhere): a
    VM's thread is not running then, yet its wall time runs on and neither its CPU time nor its
    run delay holds it. Over a block, the most any one core lost bounds what the block lost."""
    try:
        with open("/proc/stat") as f:
            rows = [r.split() for r in f if re.match(r"cpu\d+ ", r)]
        return [int(r[8]) / os.sysconf("SC_CLK_TCK") for r in rows]
    except (OSError, IndexError, ValueError):
        return []


def rank_main(rank: int, addr: str, out) -> None:
    try:
        torch.set_num_threads(1)
        from streamdiff.parallel.dit_group import SeqParallel
        from streamdiff.parallel.vae_group import ExchangeHalo, init_group
        from streamdiff.platform import for_device

        plat = for_device("cpu")
        init_group(addr, rank, 2, "cpu", timeout_s=60)
        clock = plat.stopwatch(1)
        sp = SeqParallel(rank, 2, 2, plat.wait_clock())
        halo = ExchangeHalo(rank, [(0, 4), (4, 8)], plat.wait_clock())
        res = []
        for name, timer in (("all-to-all", sp), ("halo", halo)):
            waited, delay, steal = timer.wait_s, run_delay(), steal_per_cpu()
            clock.start()
            spin(WORK_S[rank])
            if timer is sp:
                sp._exchange([torch.ones(1000) * rank] * 2, [(1000,), (1000,)])
            else:
                x = torch.full((1, 2, 1, 4, 6), float(rank))
                dest = torch.zeros(1, 2, 1, 6, 6)
                halo.complete(halo.post(x), dest)
            waited = timer.wait_s - waited
            wall, own = clock.stop(waited)
            stolen = max((b - a for a, b in zip(steal, steal_per_cpu())), default=0.0)
            res.append((name, wall, own, waited, run_delay() - delay, stolen))
        out.put((rank, res))
    except Exception:
        out.put((rank, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def test_own_and_wait_time_add_up_to_the_wall_time_over_gloo():
    ctx = torch_context()
    out = ctx.Queue()
    addr = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=rank_main, args=(r, addr, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < 2:
            try:
                rank, res = out.get(timeout=120)
            except queue.Empty:
                raise AssertionError(f"the group hung: {sorted(got)} done") from None
            assert not isinstance(res, str), res
            got[rank] = res
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank, blocks in got.items():
        for name, wall, own, waited, queued, stolen in blocks:
            # own is CPU time: on a loaded machine the block also waited for a core (`run_delay`),
            # and on a VM the host may have taken the core (`steal`, counted to the jiffy)
            slack = 0.1 * wall + 0.03
            assert own + waited + queued <= wall + slack, (rank, name, wall, own, waited, queued)
            missing = wall - (own + waited + queued + stolen + 0.01)
            assert missing <= slack, (rank, name, wall, own, waited, queued, stolen)
            assert own >= 0.8 * WORK_S[rank], (rank, name, own)
    for name, wall, own, waited, *_ in got[0]:  # the fast rank waited for its slow neighbour
        assert waited >= 0.6 * WORK_S[1] and own < 0.25 * wall, (name, wall, own, waited)
    for name, wall, own, waited, queued, _ in got[1]:  # the slow one found its neighbour there
        assert waited < 0.25 * (wall - queued) + 0.03, (name, wall, own, waited, queued)
