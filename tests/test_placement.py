"""Placement: band weights from measured times (placement/bands.py)."""

from __future__ import annotations

import pytest

from streamdiff.models.wan.kernels import split_rows
from streamdiff.placement.bands import Balance, block_ms, solve


def test_equal_shards_get_equal_bands():
    assert solve([300.0, 300.0]) == pytest.approx([0.5, 0.5])
    assert split_rows(18, 2, tuple(solve([300.0, 300.0]))) == split_rows(18, 2)


def test_bands_follow_speed():
    """A shard three times as fast gets three times the rows, and both finish together."""
    shares = solve([100.0, 300.0])
    assert shares == pytest.approx([0.75, 0.25])
    assert shares[0] * 100 == pytest.approx(shares[1] * 300)


def test_a_shard_beside_a_dit_gets_the_dits_slack():
    """Hybrid: the DiT's 150 ms per block shares device 0; the devices' loads come out equal,
    and the block is faster than with equal bands (the bound: all work over both devices)."""
    full, other = [360.0, 360.0], [150.0, 0.0]
    shares = solve(full, other)
    assert shares[0] < 0.5 < shares[1]
    assert shares[0] * 360 + 150 == pytest.approx(shares[1] * 360)
    assert block_ms(full, other, shares) == pytest.approx((360 + 150) / 2)
    assert block_ms(full, other, shares) < block_ms(full, other, [0.5, 0.5])


def test_a_full_device_keeps_a_minimal_band():
    shares = solve([300.0, 300.0, 300.0], [400.0, 0.0, 0.0])
    assert shares[0] == pytest.approx(0.02, abs=0.005)
    assert shares[1] == pytest.approx(shares[2])
    assert len(split_rows(9, 3, tuple(shares))) == 3  # still a row each


def test_split_rows_by_weight_covers_every_row_once():
    for height in range(3, 40):
        for weights in ((1.0, 3.0, 2.0), (0.01, 1.0, 1.0), (5.0, 5.0, 5.0)):
            bands = split_rows(height, 3, weights)
            assert bands[0][0] == 0 and bands[-1][1] == height
            assert all(b[1] == c[0] for b, c in zip(bands, bands[1:], strict=False))
            assert all(r1 > r0 for r0, r1 in bands)
    assert split_rows(18, 2, (1.0, 3.0)) == [(0, 5), (5, 18)]
    with pytest.raises(ValueError):
        split_rows(18, 2, (1.0, 0.0))


HYBRID = dict(groups=[["vae0.0", "vae0.1"]], devices={"dit0": 0, "vae0.0": 0, "vae0.1": 1}, dit_workers=["dit0"])
DISAGG_K2 = dict(groups=[["vae0.0", "vae0.1"]], devices={"dit0": 0, "vae0.0": 1, "vae0.1": 2}, dit_workers=["dit0"])
HW = (18, 32)  # 256x144


def test_balance_sizes_a_hybrid_shard_to_the_dits_slack_then_follows_measurements():
    b = Balance(**HYBRID)
    assert b.weights(0, HW) == ()  # nothing measured: equal
    b.seed(0, 180.0, HW)  # the group's start-up block (equal bands): each shard ~360 ms whole
    b.seed_dit("dit0", 150.0, HW)
    first = b.weights(0, HW)
    assert first[0] < 0.35 and sum(first) == pytest.approx(1.0, abs=1e-3)
    # Measured: shard 0 turns out twice as slow per row as thought; its band shrinks further.
    for _ in range(20):
        b.observe("vae0.0", 2 * 360 * first[0], round(18 * first[0]), 32)
        b.observe("vae0.1", 360 * first[1], 18 - round(18 * first[0]), 32)
        b.observe_dit("dit0", 150.0, HW)
    assert b.weights(0, HW)[0] < first[0]


def test_balance_keeps_equal_bands_through_noise_and_explicit_weights_as_given():
    b = Balance(**DISAGG_K2)
    b.seed(0, 180.0, HW)
    b.seed_dit("dit0", 150.0, HW)
    for i in range(50):  # equal shards, timings 3% apart either way: no change is worth it
        b.observe("vae0.0", 180.0 * (1.03 if i % 2 else 0.97), 9, 32)
        b.observe("vae0.1", 180.0 * (0.97 if i % 2 else 1.03), 9, 32)
        assert b.weights(0, HW) in ((), (0.5, 0.5))
    assert b.changes == 0
    fixed = Balance(**HYBRID, fixed=(1.0, 3.0))
    fixed.seed(0, 180.0, HW)
    assert fixed.weights(0, HW) == (1.0, 3.0)


def topology(**topo):
    from streamdiff.config import load
    from streamdiff.ipc.shm import RingSpec
    from streamdiff.supervisor.topology import build_topology

    cfg = load(None, {"topology": topo})
    ring = RingSpec("x", 2, 64)
    return build_topology(cfg, "tcp://127.0.0.1:1", ring, ring)


def test_a_hybrid_layout_puts_a_shard_beside_the_dit_below_it_in_priority():
    t = topology(mode="hybrid", dit_devices=1, vae_devices=2)
    assert t.dit_workers == ["dit0"] and t.vae_groups == [["vae0.0", "vae0.1"]]
    assert t.devices == {"dit0": 0, "vae0.0": 0, "vae0.1": 1}
    spec = {w.name: w for w in t.workers}
    assert spec["dit0"].low_priority and not spec["vae0.0"].low_priority
    assert spec["dit0"].cpus == spec["vae0.0"].cpus != spec["vae0.1"].cpus or not spec["dit0"].cpus
    assert spec["vae0.0"].group.rank == 0 and spec["vae0.1"].group.world == 2
    # The other layouts keep one process per device.
    d = topology(dit_devices=1, vae_devices=2)
    assert d.devices == {"dit0": 0, "vae0.0": 1, "vae0.1": 2}
    a = topology(mode="aggregated", dit_devices=1, vae_devices=2)
    assert a.dit_workers == ["agg0"] and a.vae_groups == [["agg0", "agg1"]]
    assert not any(w.low_priority for w in [*d.workers, *a.workers])


def test_hybrid_and_band_weight_errors_name_the_key():
    from streamdiff.config import ConfigError

    with pytest.raises(ConfigError, match="topology.vae_devices"):
        topology(mode="hybrid", dit_devices=1, vae_devices=1)
    with pytest.raises(ConfigError, match="topology.vae_band_weights"):
        topology(vae_devices=2, vae_band_weights=[1.0])
    with pytest.raises(ConfigError, match="topology.vae_band_weights"):
        topology(vae_devices=2, vae_band_weights=[1.0, "x"])
