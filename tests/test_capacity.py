"""The admission arithmetic (supervisor/scheduler/capacity.py), driven directly: shares from measured
block costs, sizes estimated by pixels, memory budgets, and the predicted start of a session
that does not fit now."""

from __future__ import annotations

import msgspec
import pytest

from streamdiff.ipc.messages import DiTMemory, VAEMemory
from streamdiff.supervisor.scheduler.capacity import TRIALS, CapacityModel, Demand

DIT_MEM = DiTMemory(kv_bytes_per_token=1000, window_frames=12, cross_bytes=5000, budget_bytes=10**9)
VAE_MEM = VAEMemory(cache_bytes_per_latent_pixel=2000.0, budget_bytes=10**9)


def model(target=0.9, dit_ms=200.0, vae_ms=300.0) -> CapacityModel:
    c = CapacityModel(target)
    c.calibrate("dit0", [256, 144], dit_ms, DIT_MEM)
    c.calibrate("vae-group-0", [256, 144], vae_ms, VAE_MEM)
    return c


def demand(c: CapacityModel, size=(256, 144), block_s=0.75) -> Demand:
    return c.demand({"dit": "dit0", "vae": "vae-group-0"}, size, block_s, (size[1] // 8, size[0] // 8), 144, 1)


def test_shares_and_memory_of_a_session():
    c = model()
    d = demand(c)
    assert d.share == pytest.approx({"dit0": 0.2 / 0.75, "vae-group-0": 0.3 / 0.75})
    assert d.memory["dit0"] == 1000 * 12 * 144 + 5000
    assert d.memory["vae-group-0"] == 2000.0 * 18 * 32
    # A size never measured: the nearest measured one, scaled by pixels (4x the pixels, 4x the cost).
    assert c.block_ms("vae-group-0", (512, 288)) == pytest.approx(1200.0)
    # Measured blocks move the estimate (an exponential average) and report what was predicted.
    assert c.observe("vae-group-0", (256, 144), 400.0) == pytest.approx(300.0)
    assert c.block_ms("vae-group-0", (256, 144)) == pytest.approx(0.7 * 300 + 0.3 * 400)


def test_a_short_videos_kv_cache_is_priced_at_its_held_frames():
    """A video whose shots hold fewer latent frames than the window is charged for the cache the
    DiT allocates for it (`plan.cache_frames`): its frames, never fewer than the sinks and a
    block; a live one (0) the whole window."""
    c = model()
    c.memory["dit0"] = msgspec.structs.replace(DIT_MEM, least_frames=6)
    at = {"dit": "dit0", "vae": "vae-group-0"}, (256, 144), 0.75, (18, 32), 144, 1
    assert c.demand(*at).memory["dit0"] == 1000 * 12 * 144 + 5000
    assert c.demand(*at, held_frames=9).memory["dit0"] == 1000 * 9 * 144 + 5000
    assert c.demand(*at, held_frames=3).memory["dit0"] == 1000 * 6 * 144 + 5000  # sinks and a block
    assert c.demand(*at, held_frames=30).memory["dit0"] == 1000 * 12 * 144 + 5000


def test_admission_stops_at_the_target_and_an_idle_unit_takes_anything():
    c = model()  # VAE share 0.4 per session: two fit under 0.9, a third does not
    one, two, three = demand(c), demand(c), demand(c)
    assert c.fits(one, []) and c.fits(two, [one]) and not c.fits(three, [one, two])
    heavy = demand(c, block_s=0.1)  # 3x real time: cannot stream live even alone
    assert c.fits(heavy, []) and not c.fits(heavy, [one])


def test_memory_budget_limits_admission_too():
    c = model()
    c.worker_budget("vae-group-0", 2000.0 * 18 * 32 * 1.5)
    small = demand(c, block_s=10.0)  # nearly no time share: only memory can refuse it
    assert c.fits(small, []) and not c.fits(small, [small])


def test_the_stages_of_one_process_share_its_budget():
    """An aggregated worker runs the DiT and the VAE shard on one device: both caches count
    against its one budget. Each stage measuring its own, the same free memory was counted twice
    and two sessions were admitted where one fits."""
    c = CapacityModel(0.9)
    c.calibrate("agg0", [256, 144], 200.0, DIT_MEM, ["agg0"])
    c.calibrate("vae-group-0", [256, 144], 300.0, VAE_MEM, ["agg0"])
    at = {"dit": "agg0", "vae": "vae-group-0"}, (256, 144), 10.0, (18, 32), 144, 1
    one = c.demand(*at)
    both = one.memory["agg0"] + one.memory["vae-group-0"]
    c.worker_budget("agg0", 1.5 * both)
    assert c.held([one]) == {"agg0": both}
    assert c.fits(one, []) and not c.fits(one, [one])
    c.worker_budget("agg0", 2.0 * both)
    assert c.fits(one, [one])
    # A VAE group's sessions hold their share in every shard's process.
    c.calibrate("vae-group-1", [256, 144], 300.0, VAE_MEM, ["vae1.0", "vae1.1"])
    d = c.demand({"dit": "agg0", "vae": "vae-group-1"}, (256, 144), 10.0, (18, 32), 144, 2)
    assert set(c.held([d])) == {"agg0", "vae1.0", "vae1.1"}


def test_an_out_of_memory_lowers_the_workers_budget_once_per_batch():
    c = model()
    c.worker_budget("dit0", 1e9)
    assert c.out_of_memory("dit0", {"a": 3e8, "b": 3e8}) == pytest.approx(0.9 * 6e8)
    assert c.out_of_memory("dit0", {"b": 3e8}) is None  # the batch's second report
    assert c.out_of_memory("dit0", {"c": 1e8}) == pytest.approx(0.9 * 1e8)  # a new one: lower still
    assert c.out_of_memory("nobody", {"a": 1.0}) is None
    c.worker_budget("dit0", 5e8)  # a restarted worker says its budget afresh
    assert c.budget["dit0"] == 5e8


def test_predicted_start_replays_the_running_sessions_ends():
    c = model()
    d = demand(c)
    assert c.predicted_start(d, [(5.0, d)], []) == 0.0  # fits now
    assert c.predicted_start(d, [(12.0, d), (7.0, d)], []) == 7.0  # when the first ends
    # A session queued ahead takes the first free place; this one waits for the next end.
    assert c.predicted_start(d, [(12.0, d), (7.0, d)], [(20.0, d)]) == 12.0


def test_a_batch_factor_timed_at_another_size_is_a_prior_on_trial():
    """A pair timed at READY at the default size: believed there when clearly dearer; at another
    size (small matrices gain most from batching) only a prior until real pairs measured it."""
    cap = CapacityModel(0.9)
    cap.calibrate("dit0", [256, 144], 100.0, None)
    cap.calibrate_batch("dit0", [256, 144], 2, 1.3)
    assert not cap.on_trial("dit0", (256, 144), 2)
    assert cap.batch_factor("dit0", (128, 64), 2) == 1.3 and cap.on_trial("dit0", (128, 64), 2)
    alone = cap.block_ms("dit0", (128, 64))
    for _ in range(TRIALS * 2):  # three pairs, two blocks each
        cap.observe("dit0", (128, 64), 0.8 * alone, batch=2)
    assert not cap.on_trial("dit0", (128, 64), 2)
    assert cap.batch_factor("dit0", (128, 64), 2) < 0.95
    assert cap.batch_factor("dit0", (256, 144), 2) == 1.3  # each size keeps its own
