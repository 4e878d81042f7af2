"""Every process on its own device: a recording fake of the accelerator runtime (torch.cuda's
calls that the platform makes) shows each probe and stage of a 4-device plan selecting its
device before anything else, and every sync, timing event and collective naming that device.
The CPU has no runtime to call; the fake stands in for it, and nothing else is faked."""

from __future__ import annotations

import msgspec
import pytest
import torch

from streamdiff import platform
from streamdiff.platform import accel

from .test_placement import topology


class Stream:
    def __init__(self, device: torch.device) -> None:
        self.device = device


class Runtime:
    """torch.cuda as the platform calls it, recording (call, device index) in order. A call
    that names no device would use the current one: it records None."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int | None]] = []
        rt = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                pass

            def record(self, stream: Stream | None = None) -> None:
                rt.calls.append(("event", None if stream is None else stream.device.index))

            def synchronize(self) -> None:
                pass

            def elapsed_time(self, other) -> float:
                return 1.0

        self.Event = Event

    def is_available(self) -> bool:
        return True

    current: int | None = None

    def set_device(self, device) -> None:
        self.calls.append(("set_device", torch.device(device).index))
        self.current = torch.device(device).index

    def synchronize(self, device=None) -> None:
        self.calls.append(("synchronize", None if device is None else torch.device(device).index))

    def current_stream(self, device=None) -> Stream:
        return Stream(torch.device(device) if device is not None else torch.device("cuda"))

    def mem_get_info(self, device=None):
        self.calls.append(("mem_get_info", None if device is None else torch.device(device).index))
        return (self.free, 2**31)

    free, allocated, peak = 2**30, 0, 0

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache", self.current))

    def memory_allocated(self, device=None) -> int:
        self.calls.append(("memory_allocated", None if device is None else torch.device(device).index))
        return self.allocated

    def max_memory_allocated(self, device=None) -> int:
        self.calls.append(("max_memory_allocated", None if device is None else torch.device(device).index))
        return self.peak

    def reset_peak_memory_stats(self, device=None) -> None:
        self.calls.append(("reset_peak_memory_stats", None if device is None else torch.device(device).index))
        self.peak = self.allocated


@pytest.fixture
def runtime(monkeypatch):
    """A fresh process each time it is called: no platform made, no device current."""
    rt = Runtime()

    def init(self, device: str) -> None:
        platform.Platform.__init__(self, device)
        self.rt = rt

    monkeypatch.setattr(accel.AcceleratorPlatform, "__init__", init)

    def new_process() -> Runtime:
        monkeypatch.setattr(platform, "_platforms", {})
        monkeypatch.setattr(platform, "_current", None)
        rt.calls, rt.current = [], None
        return rt

    return new_process


def work(device: str) -> None:
    """What a probe or a stage asks of its device around a block and a collective."""
    plat = platform.for_device(device)
    clock, waits = plat.stopwatch(1), plat.wait_clock()
    plat.sync()
    clock.start()
    with waits.span():
        pass
    plat.sync()
    clock.stop(waits.wait_s)
    plat.memory_budget(0)


def on_one_device(calls: list, index: int) -> None:
    assert calls[0] == ("set_device", index), calls
    assert {i for _, i in calls} == {index}, calls


def test_a_profile_probe_selects_its_device_first_and_every_call_names_it(runtime, monkeypatch):
    from streamdiff.parallel import vae_group
    from streamdiff.placement.profile.harness import pin

    joined = []
    monkeypatch.setattr(vae_group.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(vae_group.dist, "init_process_group", lambda backend, **kw: joined.append(kw["device_id"]))
    for rank in range(4):  # the profile's group of 4 ranks, one per device (measure.py)
        rt = runtime()
        device = f"cuda:{rank}"
        pin(device, (), 1)
        vae_group.init_group("tcp://127.0.0.1:1", rank, 4, device, 60.0)
        work(device)
        on_one_device(rt.calls, rank)
    assert joined == [torch.device("cuda", r) for r in range(4)]


def test_each_stage_of_a_four_device_plan_runs_on_its_own_device(runtime):
    t = topology(device="cuda", dit_devices=1, vae_devices=3)
    assert sorted(w.device for w in t.workers) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    for w in t.workers:  # each worker process: its stage selects (workers/*_stage.py), then works
        rt = runtime()
        platform.select(w.device)
        work(w.device)
        on_one_device(rt.calls, torch.device(w.device).index)


def test_a_device_without_its_index_is_device_zero_for_the_runtime(runtime):
    rt = runtime()
    platform.select("cuda")
    work("cuda")
    on_one_device(rt.calls, 0)


def test_a_cuda_worker_sets_an_allocator_for_sessions_of_mixed_sizes_unless_told(monkeypatch, caplog):
    """Under both names: torch 2.8 and 2.9.0 read only PYTORCH_CUDA_ALLOC_CONF, later ones
    PYTORCH_ALLOC_CONF; what the environment gives stays and goes to the other name too."""
    import logging
    import os

    from streamdiff.platform import cuda
    from streamdiff.platform.cuda import CudaPlatform

    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cuda, "_logged", False)
    with caplog.at_level(logging.INFO, logger="streamdiff.platform"):
        CudaPlatform.setup_process(object.__new__(CudaPlatform), 2)
        CudaPlatform.setup_process(object.__new__(CudaPlatform), 2)
    assert os.environ["PYTORCH_ALLOC_CONF"] == os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    cores = min(32, len(os.sched_getaffinity(0)))
    assert os.environ["OMP_NUM_THREADS"] == "2" and os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == str(max(2, cores))
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS")
    CudaPlatform.setup_process(object.__new__(CudaPlatform), 1, host_processes=64)  # a share of the host's cores
    assert os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    said = [r.getMessage() for r in caplog.records if "allocator" in r.getMessage()]
    assert len(said) == 1 and "expandable_segments:True (the default)" in said[0]  # once a process
    for old in (True, False):
        monkeypatch.delenv("PYTORCH_ALLOC_CONF")
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF" if old else "PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync")
        CudaPlatform.setup_process(object.__new__(CudaPlatform), 2)
        assert os.environ["PYTORCH_ALLOC_CONF"] == os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"


def test_one_budget_per_device_taken_after_every_stage_with_the_largest_transient_kept(runtime):
    """An aggregated worker on cuda:2: a block's transients are the peak over what was allocated
    before it; once both stages have calibrated, the allocator's cache is given back and one
    budget is 90% of the free memory less the larger of the two stages' transients, for both."""
    from streamdiff.ipc import messages as m
    from streamdiff.workers.main import Worker
    from streamdiff.workers.spec import WorkerSpec
    from streamdiff.workers.stage_common import transient_at, transient_each

    rt = runtime()
    plat = platform.select("cuda:2")
    rt.allocated = 5 * 2**30  # the weights and the calibration sessions' caches

    def block():
        rt.peak = rt.allocated + 300 * 2**20  # its activations
        return "done"

    assert plat.peak_during(block) == ("done", 300 * 2**20)
    assert transient_each(300, 500) == 200 and transient_each(300, None) == 300
    assert transient_at(4, 300, 200) == 300 + 3 * 200
    worker = object.__new__(Worker)
    worker.spec = WorkerSpec.__new__(WorkerSpec)
    object.__setattr__(worker.spec, "cpu_memory_budget_bytes", 8 * 2**30)
    object.__setattr__(worker.spec, "max_batch", 1)
    worker.stages = {"dit": type("Stage", (), {"platform": plat})()}
    cost = m.StageCost(100.0, [256, 144])
    ready = {
        "dit": m.DiTReady(cost, {}, m.DiTMemory(1000.0, 12, 0.0, 0.0, 0, transient_bytes=3e8)),
        "vae": m.VAEReady(cost, {}, m.VAEMemory(2.0, 0.0, transient_bytes=5e8)),
    }
    rt.free = 10 * 2**30
    out = worker._one_budget(ready)
    assert out["dit"].memory.budget_bytes == out["vae"].memory.budget_bytes == int(0.9 * 10 * 2**30) - int(5e8)
    assert ("empty_cache", 2) in rt.calls
    on_one_device(rt.calls, 2)


def test_the_budget_keeps_transients_for_the_largest_batch_whose_sessions_it_still_holds(runtime):
    """Kept for four blocks' transients, the rest of the device would hold no session of a big
    model (Krea's 14B aggregated on one device): the worker keeps them for the largest batch
    whose sessions the rest holds, says so, and the supervisor batches no more there."""
    from streamdiff.ipc import messages as m
    from streamdiff.models.spec import preset_card
    from streamdiff.supervisor.scheduler.capacity import CapacityModel
    from streamdiff.workers.main import Worker
    from streamdiff.workers.spec import WorkerSpec

    runtime()
    plat = platform.select("cuda:0")
    card = preset_card("tiny")
    tokens = card.tokens_per_frame(256, 144)
    worker = object.__new__(Worker)
    worker.spec = WorkerSpec.__new__(WorkerSpec)
    object.__setattr__(worker.spec, "cpu_memory_budget_bytes", 8 * 2**30)
    object.__setattr__(worker.spec, "max_batch", 4)
    worker.stages = {"dit": type("Stage", (), {"platform": plat})()}
    one = 1000.0 * 12 * tokens  # a session's KV window, bytes
    gb = 2**30
    # 0.9 x 10 GiB free: a block alone takes 1 GiB of transients, each more session 2 GiB
    dit = m.DiTReady(m.StageCost(100.0, [256, 144]), {}, m.DiTMemory(1000.0, 12, 0.0, 0.0, 0, gb, 2 * gb), card=card)
    plat.rt.free = 10 * gb
    for per_session, batch in ((one, 4), (gb, 3), (2 * gb, 2), (5 * gb, 1)):
        scaled = msgspec.structs.replace(dit.memory, kv_bytes_per_token=per_session / (12 * tokens))
        out = worker._one_budget({"dit": msgspec.structs.replace(dit, memory=scaled)})["dit"].memory
        reserve = gb + 2 * gb * (batch - 1)
        assert (out.batch, out.budget_bytes) == (batch, int(0.9 * 10 * gb) - reserve), per_session
    capacity = CapacityModel(1.0)
    capacity.calibrate("dit0", [256, 144], 100.0, out)
    assert capacity.batch_limit("dit0") == 1 and CapacityModel(1.0).batch_limit("dit0") is None


def test_an_accelerators_decode_working_set_is_a_share_of_its_free_memory(runtime):
    """The VAE's frames per call on a device follow a quarter of its free memory at its peak
    (platform/accel.py DECODE_SHARE, PEAK_PER_ESTIMATE), never less than the CPU's."""
    from streamdiff.platform.accel import DECODE_SHARE, PEAK_PER_ESTIMATE

    rt = runtime()
    rt.free = 80 * 10**9
    plat = platform.for_device("cuda:1")
    assert plat.decode_working_set(48 * 2**20) == int(DECODE_SHARE * 80e9 / PEAK_PER_ESTIMATE)
    assert ("mem_get_info", 1) in rt.calls
    rt.free = 2**20
    assert plat.decode_working_set(48 * 2**20) == 48 * 2**20
