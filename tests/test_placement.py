"""Placement: band weights from measured times (supervisor/bands.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamdiff.models.wan.rows import split_rows
from streamdiff.supervisor.bands import Balance, block_ms, solve

ROOT = Path(__file__).resolve().parents[1]


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
    from streamdiff.config.loader import load
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
    for device in ("cuda", "xpu"):  # two processes on one accelerator would budget its memory twice
        with pytest.raises(ConfigError, match=f"topology.mode.*one process per device.*hybrid with device {device}"):
            topology(mode="hybrid", dit_devices=1, vae_devices=2, device=device)
    with pytest.raises(ConfigError, match="topology.vae_band_weights"):
        topology(vae_devices=2, vae_band_weights=[1.0])
    with pytest.raises(ConfigError, match="topology.vae_band_weights"):
        topology(vae_devices=2, vae_band_weights=[1.0, "x"])
    for exchange in ([1.0], [1.0, 9.0]):
        with pytest.raises(ConfigError, match="topology.vae_cut_exchange"):
            topology(vae_cut_exchange=exchange)
    for bad in (
        {"device": "cuda"},
        {"mode": "aggregated"},
        {"dit_devices": 0, "vae_devices": 0},
        {"vae_devices": 2},
        {"pin_cpus": False},
    ):
        with pytest.raises(ConfigError, match="topology.share_cores"):
            topology(**{"dit_devices": 1, "vae_devices": 1, "share_cores": True, **bad})


def test_shared_cores_keep_each_worker_on_its_own_cores_with_a_ledger_to_borrow_the_rest(tmp_path):
    """Each worker starts on its own core as in disagg-1+1; the ledger (one byte per worker and
    one for the supervisor's encoders, which share the DiT's cores) lets it take the others'."""
    import os

    from streamdiff.config.loader import load
    from streamdiff.ipc.shm import RingSpec
    from streamdiff.supervisor.topology import build_topology

    every = tuple(sorted(os.sched_getaffinity(0)))
    ring = RingSpec("x", 2, 64)
    cfg = load(None, {"topology": {"dit_devices": 1, "vae_devices": 1, "share_cores": True}})
    t = build_topology(cfg, "tcp://127.0.0.1:1", ring, ring, str(tmp_path))
    own = topology(dit_devices=1, vae_devices=1)
    assert [w.cpus for w in t.workers] == [w.cpus for w in own.workers] and all(w.threads == 1 for w in t.workers)
    assert [w.lend.index for w in t.workers] == [0, 1] and t.host_lend.index == 2
    for spec in (t.workers[0].lend, t.workers[1].lend, t.host_lend):
        assert spec.path == str(tmp_path / "cores") and spec.cores == every
        assert spec.threads == (1, 1, 0) and spec.groups == (0, 1, 0)  # the encoders beside the DiT
    assert (tmp_path / "cores").read_bytes() == bytes(3)
    assert all(w.lend is None for w in own.workers)


def test_an_explicit_layout_needs_its_accelerators_visible(monkeypatch):
    """--dit-gpus 1 --vae-gpus 1 on one GPU is refused by name at start, not left to fail in a
    worker as an invalid device ordinal; on the CPU the workers share the cores."""
    from streamdiff.config import Config, ConfigError, TopologyConfig
    from streamdiff.placement import auto

    monkeypatch.setattr(auto, "device_count", lambda kind: 1)

    def placed(**kw):
        return auto.place(Config(topology=TopologyConfig(dit_devices=1, vae_devices=1, **kw)), log=lambda _: None)

    with pytest.raises(ConfigError, match="--dit-gpus 1 --vae-gpus 1 needs 2 cuda devices, 1 visible"):
        placed(device="cuda")
    cfg, p = placed(device="cuda", mode="aggregated")
    assert p.layout == "agg-1" and cfg.topology.mode == "aggregated"
    assert placed(device="cpu")[1].layout == "disagg-1+1"


# -- profile, simulator, planner ----------------------------------------------------------------


def synthetic(
    dit_ms: float, vae_ms: float, *, dit2=None, vae2=None, group=None, encode_ms=5.0, devices=2, stages=None, **kw
):
    """A profile at 256x144 whose figures are chosen: steady blocks cost `dit_ms` and `vae_ms`
    (a shot's first block the same), no batching gain; `group`: a 2-way VAE group's own time per
    shard at equal bands (wall the same: no waits)."""
    from streamdiff.config import Config
    from streamdiff.placement.profile.schema import Profile, model_key
    from streamdiff.platform.devices import cpu_model

    def stage(ms, rows=None):
        out = {"first_ms": ms, "block_ms": ms, "own_ms": ms, "batch_ms": {"2": ms, "4": ms}}
        if rows:
            out.update(wait_ms=0.0, rows=rows)
        return out

    fig = {
        "dit": {"1": stage(dit_ms), **({"2": stage(dit2)} if dit2 else {})},
        "vae": {"1": stage(vae_ms, 18), **({"2": stage(vae2, 18)} if vae2 else {})},
        "vae_group": {},
        "encode": {"first_ms": encode_ms, "block_ms": encode_ms},
    }
    if stages:  # the VAE decoder's stage times (a cut's share of the VAE)
        fig["vae"]["1"]["stages_ms"] = list(stages)
    if group:
        shard = {"first_ms": group, "block_ms": group, "own_ms": group, "wait_ms": 0.0, "rows": 9}
        fig["vae_group"]["2"] = {"equal": [shard, dict(shard)]}
    base = dict(device="cpu", device_name=cpu_model(), devices=devices, preset="tiny", model=model_key(Config()))
    return Profile(**{**base, **kw}, sizes={"256x144": fig}, created=time.time())


def predict(prof, layout):
    from streamdiff.config import Config
    from streamdiff.models.spec import preset_card
    from streamdiff.placement.sim import simulate

    return simulate(Config(), prof, layout, preset_card("tiny"), (256, 144))


def w1_steady_fps(block_s: float) -> float:
    """W1's frames after the first fragment over its blocks after the first, a whole block per
    block_s (a scene's last block too: its surplus frames are made and dropped)."""
    from streamdiff.placement.sim import storyboard
    from streamdiff.plan import plan_blocks

    blocks = plan_blocks(storyboard(), 3, 4)
    assert {b.latent_frames for b in blocks} == {3}
    return sum(b.emit for b in blocks[1:]) / (len(blocks[1:]) * block_s)


def test_the_simulator_runs_at_the_slower_stage_when_the_stages_overlap():
    """Disaggregated: a block every max(DiT, VAE); aggregated on one worker: every DiT + VAE."""
    from streamdiff.placement.layout import Layout

    prof = synthetic(100.0, 200.0)
    disagg = predict(prof, Layout("disaggregated", 1, 1))
    agg = predict(prof, Layout("aggregated", 1, 1))
    assert disagg.w1_steady_fps == pytest.approx(w1_steady_fps(0.2), rel=0.03)
    assert agg.w1_steady_fps == pytest.approx(w1_steady_fps(0.3), rel=0.03)
    # The first fragment: the first block through DiT, VAE and the encoder, in order.
    assert disagg.w1_ttff_s == pytest.approx(0.1 + 0.2 + 0.005, abs=0.01)
    # A shot's first VAE block straight after other work (the aggregated worker's own DiT block)
    # takes the profile's busy figure; the disaggregated VAE worker waited for it, idle.
    prof.sizes["256x144"]["vae"]["1"]["first_busy_ms"] = 150.0
    assert predict(prof, Layout("aggregated", 1, 1)).w1_ttff_s == pytest.approx(agg.w1_ttff_s - 0.05, abs=0.005)
    assert predict(prof, Layout("disaggregated", 1, 1)).w1_ttff_s == pytest.approx(0.1 + 0.2 + 0.005, abs=0.01)


def test_a_hybrid_layout_is_predicted_to_spend_the_dits_slack_on_decoding():
    """DiT 100 ms, VAE 200 ms, a 2-way group at 105 ms per shard: disagg-1+1 is VAE-bound at
    200 ms a block; the hybrid's two cores hold 300 ms of work (+ the group's front twice), so
    it runs near 160 ms a block."""
    from streamdiff.placement.layout import Layout

    prof = synthetic(100.0, 200.0, group=105.0)
    disagg = predict(prof, Layout("disaggregated", 1, 1)).w1_steady_fps
    hybrid = predict(prof, Layout("hybrid", 1, 2)).w1_steady_fps
    assert hybrid > 1.15 * disagg
    assert hybrid < w1_steady_fps(0.150)  # not past all the work over both cores


def test_a_measured_cost_of_sharing_a_core_slows_the_predicted_hybrid():
    """The profile's hybrid probe says the DiT turned only half of its shard's idle time into
    work: the simulator charges that, and the hybrid falls back towards disagg-1+1."""
    from streamdiff.placement.costs import Costs
    from streamdiff.placement.layout import Layout

    prof = synthetic(100.0, 200.0, group=105.0)
    free = predict(prof, Layout("hybrid", 1, 2)).w1_steady_fps
    shard0 = {"own_ms": 50.0, "block_ms": 100.0, "rows": 5}
    prof.sizes["256x144"]["hybrid"] = {"dit": {"own_ms": 110.0, "wall_ms": 400.0}, "group": [shard0, shard0]}
    assert Costs(prof, (256, 144), 1).beside == pytest.approx(100 / (400 * 0.5))
    costly = predict(prof, Layout("hybrid", 1, 2)).w1_steady_fps
    assert costly < 0.9 * free
    assert costly > 0.95 * predict(prof, Layout("disaggregated", 1, 1)).w1_steady_fps
    # The probe's DiT timed alone just before it: the share is taken against that minute's speed.
    prof.sizes["256x144"]["hybrid"]["dit"]["alone_ms"] = 160.0
    assert Costs(prof, (256, 144), 1).beside == pytest.approx(160 / (400 * 0.5))


def test_an_image_to_video_requests_encoding_is_charged_once_to_its_first_block():
    """The profile's `image_ms` (the image encoded and committed on the DiT's device) replaces the
    first block's DiT time of a request that starts from an image; later blocks are unchanged,
    so the whole video is later by the difference, once."""
    from streamdiff.config import Config
    from streamdiff.models.spec import preset_card
    from streamdiff.placement.layout import Layout
    from streamdiff.placement.sim import simulate

    prof = synthetic(100.0, 200.0)
    prof.sizes["256x144"]["dit"]["1"]["image_ms"] = 450.0
    card = preset_card("tiny").configured(frames_per_block=1)  # frame-wise, as the i2v checkpoint

    def run(image: bool):
        p = simulate(Config(), prof, Layout("disaggregated", 1, 1), card, (256, 144), image=image)
        return p.w1_ttff_s, sum(b.emit for b in plan_storyboard()) / p.w1_fps

    (ttff, end), (ttff_img, end_img) = run(False), run(True)
    assert ttff_img - ttff == pytest.approx(0.35, abs=0.01)
    assert end_img - end == pytest.approx(0.35, abs=0.05)


def test_through_a_vae_cut_an_image_block_also_costs_the_cuts_stages_on_its_latent_frame():
    """With a cut the DiT runs the cut's first stages on the image's latent too (one latent frame
    of a block of three): the image block costs `image_ms` and a third of the stages' time."""
    from streamdiff.config import Config
    from streamdiff.models.spec import preset_card
    from streamdiff.placement.layout import Layout
    from streamdiff.placement.sim import simulate

    prof = synthetic(100.0, 200.0, stages=[30.0, 30.0, 60.0, 80.0])
    prof.sizes["256x144"]["dit"]["1"].update(image_ms=450.0, cut_stages_ms=[30.0, 30.0, 60.0, 80.0])
    card = preset_card("tiny")
    assert card.frames_per_block == 3

    def ttff(cut: int, image: bool) -> float:
        lay = Layout("disaggregated", 1, 1, 1, vae_cut=cut)
        return simulate(Config(), prof, lay, card, (256, 144), image=image).w1_ttff_s

    # the first fragment waits for the image block's DiT time, then its VAE's
    plain, cut = ttff(0, True) - ttff(0, False), ttff(2, True) - ttff(2, False)
    assert plain == pytest.approx(0.35, abs=0.001)  # 450 ms against a first block's 100
    # a text block's cut moves 60 ms from the VAE to the DiT; the image block's moves 60 ms off
    # the VAE's block (charged whole) and adds a third of it, 20 ms, to the DiT's
    assert cut - plain == pytest.approx(-0.04, abs=0.001)


def plan_storyboard():
    from streamdiff.placement.sim import storyboard
    from streamdiff.plan import plan_blocks

    return plan_blocks(storyboard(), 1, 4)


def test_the_hosts_work_beside_the_dit_slows_the_aggregated_worker_not_the_disaggregated_pipeline():
    """On the CPU the supervisor encodes on the DiT workers' cores. The profile measured each
    DiT beside that work: 30 ms a block more. disagg-1+1 hides it in the DiT's slack (VAE-bound
    at 200 ms); agg-1x2t's worker runs DiT then VAE, so every block takes it on."""
    from streamdiff.placement.layout import Layout

    layouts = {"disagg-1+1": Layout("disaggregated", 1, 1), "agg-1x2t": Layout("aggregated", 1, 1, threads=2)}
    prof = synthetic(100.0, 200.0, dit2=60.0, vae2=110.0)
    before = {name: predict(prof, lay).w1_steady_fps for name, lay in layouts.items()}
    for t in ("1", "2"):
        prof.sizes["256x144"]["dit"][t]["host_block_ms"] = prof.sizes["256x144"]["dit"][t]["block_ms"] + 30.0
    after = {name: predict(prof, lay).w1_steady_fps for name, lay in layouts.items()}
    assert after["disagg-1+1"] == pytest.approx(before["disagg-1+1"], rel=0.01)
    # (5%: the worker takes the last block's DiT before the block before it decodes, so the last
    # fragment follows 110 ms after the one before; the two figures are 15% apart)
    assert before["agg-1x2t"] == pytest.approx(w1_steady_fps(0.170), rel=0.05)
    assert after["agg-1x2t"] == pytest.approx(w1_steady_fps(0.200), rel=0.05)
    # Before the first fragment the encoder has nothing to do: the first block's DiT runs
    # without it (TTFF: DiT 100 + VAE 200 + encoding 5, as without the host's 30).
    assert predict(prof, layouts["disagg-1+1"]).w1_ttff_s == pytest.approx(0.1 + 0.2 + 0.005, abs=0.01)


def test_a_vae_cut_moves_the_decoders_first_stages_to_the_dit_and_the_planner_offers_it_on_the_cpu():
    """DiT 100 ms, VAE 200 ms of which the first 3 stages take 40: disagg-1+1 is VAE-bound at
    200 ms a block, the cut at 3 runs DiT 140 beside VAE 160. Cuts past half the VAE are not
    offered, nor cuts on accelerators (the activation would cross the host)."""
    from streamdiff.config import Config
    from streamdiff.models.spec import preset_card
    from streamdiff.placement.layout import Layout
    from streamdiff.placement.planner import candidates, plan

    prof = synthetic(100.0, 200.0, stages=[10.0, 10.0, 20.0, 40.0, 60.0, 60.0])
    assert predict(prof, Layout("disaggregated", 1, 1)).w1_steady_fps == pytest.approx(w1_steady_fps(0.2), rel=0.03)
    cut = Layout("disaggregated", 1, 1, 1, vae_cut=3)
    assert cut.name == "disagg-1+1/cut3" and cut.flags()[-2:] == ["--vae-cut", "3"]
    assert predict(prof, cut).w1_steady_fps == pytest.approx(w1_steady_fps(0.16), rel=0.03)
    ranked = [lay.name for lay, _ in plan(Config(), prof, 2, "throughput", preset_card("tiny"), (256, 144)).ranked]
    assert {n for n in ranked if "/cut" in n} == {f"disagg-1+1/cut{c}" for c in (1, 2, 3, 4)}
    assert ranked.index("disagg-1+1/cut3") < ranked.index("disagg-1+1")
    assert not any(x.vae_cut for x in candidates(2, "cuda", cuts=(1, 2)))
    # The same 40 ms of stages took 70 in the DiT's process, after its block: the DiT side is
    # charged 170 while the VAE loses only its own 40, so the cut is DiT-bound at 170 ms.
    prof.sizes["256x144"]["dit"]["1"]["cut_stages_ms"] = [15.0, 20.0, 35.0, 50.0, 70.0, 70.0]
    assert predict(prof, cut).w1_steady_fps == pytest.approx(w1_steady_fps(0.17), rel=0.03)
    # Cuts run side by side in the profile's cycles: cut 3 added 105 to the DiT's block (1.5x its
    # 70 of stages) and took 30 off the VAE's (0.75x their 40); cut 5, 1.5x and 0.75x as well.
    # Every cut is charged so: cut 3's sides are 205 and 170, and the cut no longer pays.
    from streamdiff.placement.costs import Costs

    prof.sizes["256x144"]["levels"] = {
        "dit": {"1": 100.0},
        "vae": {"1": 200.0},
        "cuts": {"3": {"dit": 205.0, "vae": 170.0}, "5": {"dit": 100.0 + 1.5 * 190, "vae": 200.0 - 0.75 * 140}},
    }
    assert Costs(prof, (256, 144), 1).factors == pytest.approx((1.5, 0.75))
    # per ms of the VAE's decode moved, as the daemon's cut balance prices it: 105 + 285 added
    # to the DiT for 40 + 140 of decode moved
    assert Costs(prof, (256, 144), 1).cut_exchange() == pytest.approx((390 / 180, 0.75))
    assert Costs(prof, (256, 144), 1).vae_cut_ms(2) == pytest.approx(0.75 * 20)
    assert predict(prof, cut).w1_steady_fps == pytest.approx(w1_steady_fps(0.205), rel=0.03)
    assert Costs(prof, (256, 144), 2).factors == (1.0, 1.0)  # probes are of one-thread workers


def test_a_lead_under_either_layouts_measured_error_ranks_the_simpler_layout_first():
    """DiT 100 ms, VAE 105 ms, the first stage 3 ms of it: the cut at 1 is predicted about 2%
    faster than plain disagg-1+1, under the default error (2%), so disagg-1+1 is planned; where
    the check measured both to within 1%, the cut is. Of two layouts left in the running with
    as many mechanisms, the one measured closer is planned; a lead past both errors holds."""
    import json

    from streamdiff.config import Config
    from streamdiff.models.spec import preset_card
    from streamdiff.placement.planner import DEFAULT_PLAN_ERROR, mechanisms, plan
    from streamdiff.placement.profile.schema import Profile

    card = preset_card("tiny")

    def ranked(prof):
        p = plan(Config(), prof, 2, "throughput", card, (256, 144), threads=(1,))
        return p, [lay.name for lay, _ in p.ranked]

    close = synthetic(100.0, 105.0, stages=[3.0, 2.0, 20.0, 20.0, 30.0, 30.0])
    p, names = ranked(close)
    preds = {lay.name: pr for lay, pr in p.ranked}
    lead = preds["disagg-1+1/cut1"].w1_fps / preds["disagg-1+1"].w1_fps - 1
    assert 0.01 < lead < DEFAULT_PLAN_ERROR and p.errors == {}
    assert names[0] == "disagg-1+1" and mechanisms(p.best[0]) == 0
    assert "(2%)" in p.table()
    close.plan_errors = {"disagg-1+1": 0.0, "disagg-1+1/cut1": 0.01}
    p, names = ranked(close)
    assert names[0] == "disagg-1+1/cut1" and p.as_dict()["errors"] == close.plan_errors
    assert "    1%" in p.table()
    # VAE 200 ms: hybrid-1+2 (a group and a hybrid) 4.5% ahead of cut 3, which has one
    # mechanism: past the default error, the hybrid is planned; within 5% each, the cut
    far = synthetic(100.0, 200.0, stages=[10.0, 10.0, 20.0, 40.0, 60.0, 60.0])
    p, names = ranked(far)
    preds = {lay.name: pr for lay, pr in p.ranked}
    assert preds["hybrid-1+2"].w1_fps > preds["disagg-1+1/cut3"].w1_fps and names[0] == "hybrid-1+2"
    far.plan_errors = {"disagg-1+1/cut3": 0.05, "hybrid-1+2": 0.05}
    assert ranked(far)[1][0] == "disagg-1+1/cut3"
    # cut 3 and the hybrid measured 20% off their pipelines: cut 2 (as simple as cut 3, 10%
    # behind it, 16% behind the hybrid, and measured to within 3%) is left in the running too,
    # and planned as the one measured closest
    far.plan_errors = {"disagg-1+1/cut3": 0.2, "disagg-1+1/cut2": 0.03, "disagg-1+1/cut4": 0.05, "hybrid-1+2": 0.2}
    assert ranked(far)[1][0] == "disagg-1+1/cut2"
    # cut 2's 16% behind a hybrid measured to within 1% puts it out; cut 3 stays, the simpler
    far.plan_errors = {"disagg-1+1/cut3": 0.2, "disagg-1+1/cut2": 0.03, "hybrid-1+2": 0.01}
    assert ranked(far)[1][:2] == ["disagg-1+1/cut3", "hybrid-1+2"]
    # measured to within 1% each, the hybrid's lead holds
    far.plan_errors = {"disagg-1+1/cut3": 0.01, "hybrid-1+2": 0.01}
    assert ranked(far)[1][0] == "hybrid-1+2"
    # the errors are the profile's: kept through its file, and a bad one refuses the file by name
    assert Profile.from_json(close.to_json()).plan_errors == close.plan_errors
    for bad in ({"disagg-1+1": -0.1}, {"disagg-1+1": 1.5}, {"disagg-1+1": "5%"}, {"disagg-1+1": True}, [0.1]):
        data = json.loads(close.to_json())
        data["plan_errors"] = bad
        with pytest.raises(ValueError, match="plan_errors"):
            Profile.from_json(json.dumps(data))


def test_an_adapting_cut_moves_to_where_the_measured_sides_balance():
    """Stage shares 5/5/10/20/30/30% of a decode. The VAE measured 200 ms a whole decode and
    the DiT 110 ms a block with the first stage's 10 ms: its own 100. Cut 3 balances (140
    against 160); from cut 1 (VAE side 190) the cut moves there, and stays for a gain under 5%.
    Without adapt, before any timing, or where the cut's activation does not fit, it does not."""
    from streamdiff.supervisor.cut import CutBalance

    hw = (18, 32)
    px = 18 * 32
    stages = [10.0, 10.0, 20.0, 40.0, 60.0, 60.0]
    b = CutBalance(1, True)
    assert b.cut("dit0", "vae-group-0", hw, 3) == 1  # nothing measured yet
    b.seed(stages)
    b.observe_dit("dit0", None, 110.0, 1, hw)  # before the VAE's speed is known: kept
    b.observe_vae("vae-group-0", 190.0, 1, hw)  # stages 1-5: 95% of a 200 ms decode
    assert b.decode_px["vae-group-0"] * px == pytest.approx(200.0)
    assert b.cut("dit0", "vae-group-0", hw, 3) == 3 and b.changes == 1
    assert b.dit_px["dit0"] * px == pytest.approx(100.0)
    assert b.period_ms("dit0", "vae-group-0", 3, hw) == pytest.approx(160.0)
    assert b.period_ms("dit0", "vae-group-0", 4, hw) == pytest.approx(180.0)
    b.observe_dit("dit0", "vae-group-0", 150.0, 3, hw)  # the DiT a little slower: cut 2 by 2.5% only
    assert b.cut("dit0", "vae-group-0", hw, 3) == 3 and b.changes == 1
    assert CutBalance(1, False).cut("dit0", "vae-group-0", hw, 3) == 1
    fixed = CutBalance(1, False)
    fixed.seed(stages)
    fixed.observe_vae("vae-group-0", 190.0, 1, hw)
    fixed.observe_dit("dit0", "vae-group-0", 110.0, 1, hw)
    assert fixed.cut("dit0", "vae-group-0", hw, 3) == 1
    # On the CPU the supervisor's encoding shares the DiT's cores: 50 ms a block of it on the
    # DiT's side makes cut 3 DiT-bound (190 against 160) and cut 2 the better (170 against 180).
    for on_dit, want in ((True, 2), (False, 3)):
        host = CutBalance(1, True, host_on_dit=on_dit)
        host.seed(stages)
        host.observe_vae("vae-group-0", 190.0, 1, hw)
        host.observe_dit("dit0", "vae-group-0", 110.0, 1, hw)
        host.observe_host(50.0)
        assert host.cut("dit0", "vae-group-0", hw, 3) == want
    small = CutBalance(1, True, fits=lambda cut, latent_hw, frames: cut <= 2)
    small.seed(stages)
    small.observe_vae("vae-group-0", 190.0, 1, hw)
    small.observe_dit("dit0", "vae-group-0", 110.0, 1, hw)
    assert small.cut("dit0", "vae-group-0", hw, 3) == 2


def test_a_cut_moves_only_where_a_shot_starts():
    from streamdiff.ipc import messages as m
    from streamdiff.workers.errors import RequestError
    from streamdiff.workers.stage_common import StageSession, check_cut_change, cut_of

    msg = m.DecodeBlock("s", 1, 0, 0, [16, 3, 18, 32], 12, vae_cut=5)
    assert cut_of(msg, 4) == 5 and cut_of(m.DecodeBlock("s", 1, 0, 0, [16, 3, 18, 32], 12), 4) == 4
    at4, first = StageSession(vae_cut=4), StageSession()
    check_cut_change(at4, 5, 9, shot_start=True)
    check_cut_change(first, 5, 9, shot_start=False)  # the session's first block
    with pytest.raises(RequestError, match="moves from 4 to 5 inside a shot"):
        check_cut_change(at4, 5, 9, shot_start=False)
    with pytest.raises(RequestError, match="this decoder has 9 stages"):
        check_cut_change(first, 9, 9, shot_start=True)


def test_the_simulator_runs_an_adapting_cut_as_the_daemon_does():
    """The scheduler's own cut balance in the simulator: from cut 1 or 5, W1 runs at the
    balanced cut 3 from its start (the workers' start-up timings), as fast as cut 3 fixed."""
    from dataclasses import replace

    from streamdiff.config import Config
    from streamdiff.models.spec import preset_card
    from streamdiff.placement.layout import Layout
    from streamdiff.placement.sim import Sim, simulate, storyboard

    prof = synthetic(100.0, 200.0, stages=[10.0, 10.0, 20.0, 40.0, 60.0, 60.0])
    card = preset_card("tiny")
    cfg = Config()
    adapt = replace(cfg, topology=replace(cfg.topology, vae_cut_adapt=True))
    best = simulate(cfg, prof, Layout("disaggregated", 1, 1, vae_cut=3), card, (256, 144)).w1_fps
    for start in (1, 5):
        fixed = simulate(cfg, prof, Layout("disaggregated", 1, 1, vae_cut=start), card, (256, 144)).w1_fps
        moved = simulate(adapt, prof, Layout("disaggregated", 1, 1, vae_cut=start), card, (256, 144)).w1_fps
        assert moved == pytest.approx(best, rel=0.02) and best > 1.05 * fixed
        sim = Sim(adapt, prof, Layout("disaggregated", 1, 1, vae_cut=start), (256, 144), card)
        sim.submit("w1", storyboard(), 256, 144)
        sim.run()
        assert sim.sched.snapshot()["vae_cuts"] == {"dit0": 3}


def test_shared_cores_run_a_stage_on_both_cores_while_the_other_waits():
    """DiT and VAE on a core each, lending it while they wait: on one thread a block takes 100
    and 200 ms, on two 60 and 110. Each VAE block has the DiT's next beside it for 100 ms, in
    which it does 100 ms of its 200 on its own core; the other 100 it does on both at 200/110
    the speed, in 55: 155 ms a block, against 200 for disagg-1+1 and 170 for agg-1x2t. Without
    two-thread figures the layout is not offered."""
    from streamdiff.config import Config
    from streamdiff.config.loader import override
    from streamdiff.models.spec import preset_card
    from streamdiff.placement.costs import Costs
    from streamdiff.placement.layout import Layout
    from streamdiff.placement.planner import plan
    from streamdiff.placement.sim import Sim
    from streamdiff.plan import Scene

    shared = Layout("disaggregated", 1, 1, shared=True)
    assert shared.name == "disagg-1+1/shared" and shared.flags()[-1] == "--share-cores" and shared.devices == 2

    def ranked(prof):
        return [lay.name for lay, _ in plan(Config(), prof, 2, "throughput", preset_card("tiny"), (256, 144)).ranked]

    assert shared.name not in ranked(synthetic(100.0, 200.0))
    prof = synthetic(100.0, 200.0, dit2=60.0, vae2=110.0)
    assert Costs(prof, (256, 144), 1).lent_speedups(2) == pytest.approx((100 / 60, 200 / 110))
    assert Costs(prof, (256, 144), 1).lent_speedups(4) == (1.0, 1.0)  # not measured on four
    prof.sizes["256x144"]["dit"]["2"]["first_ms"] = 100.0  # two threads no faster on a first block after idle
    assert Costs(prof, (256, 144), 1).lent_speedups(2, first=True) == pytest.approx((1.0, 200 / 110))
    sim = Sim(Config(), prof, shared, (256, 144), preset_card("tiny"))
    sim.submit("one", [Scene("a fox", 9 + 12 * 40)], 256, 144)  # 41 blocks of 3 latent frames
    sim.run()
    # past the start and before the DiT's last block (the VAE then decodes what is left alone)
    times = [t for t, _ in sim.result.fragments["one"]][8:-8]
    assert (times[-1] - times[0]) / (len(times) - 1) == pytest.approx(0.155, rel=0.03)
    assert predict(prof, shared).w1_fps > 1.15 * predict(prof, Layout("disaggregated", 1, 1)).w1_fps
    order = ranked(prof)
    assert order[0] == shared.name and order.index("disagg-1+1") > order.index("agg-1x2t") > 0
    unpinned = override(Config(), topology={"pin_cpus": False})  # lending pins each worker to its own cores
    card = preset_card("tiny")
    assert shared.name not in [x.name for x, _ in plan(unpinned, prof, 2, "throughput", card, (256, 144)).ranked]


def test_an_adapting_cut_prices_moved_work_as_the_profile_measured_it():
    """Cuts run side by side cost the DiT 2 ms for each ms of decode they moved and saved the
    VAE only 0.5: cut 3 balances at 180 ms a side, cut 4 is DiT-bound at 260. Started at cut 5
    (DiT 380, VAE 130), a balance that took moved work at 1 to 1 would read the VAE's whole
    decode as 433 ms and go to cut 4 first; priced at the profile's exchange, which the
    simulator passes on as the planner does, it reads 200 and goes to cut 3 in one move."""
    from dataclasses import replace

    from streamdiff.config import Config
    from streamdiff.models.spec import preset_card
    from streamdiff.placement.layout import Layout
    from streamdiff.placement.sim import Sim, simulate, storyboard
    from streamdiff.supervisor.cut import CutBalance

    stages = [10.0, 10.0, 20.0, 40.0, 60.0, 60.0]
    prof = synthetic(100.0, 200.0, stages=stages)
    prof.sizes["256x144"]["levels"] = {
        "dit": {"1": 100.0},
        "vae": {"1": 200.0},
        "cuts": {"3": {"dit": 180.0, "vae": 180.0}, "5": {"dit": 380.0, "vae": 130.0}},
    }
    hw = (18, 32)
    for exchange, first in (((1.0, 1.0), 4), ((2.0, 0.5), 3)):
        b = CutBalance(5, True, exchange=exchange)
        b.seed(stages)
        b.observe_vae("vae-group-0", 130.0, 5, hw)
        b.observe_dit("dit0", "vae-group-0", 380.0, 5, hw)
        assert b.cut("dit0", "vae-group-0", hw, 3) == first
    assert b.period_ms("dit0", "vae-group-0", 3, hw) == pytest.approx(180.0)
    card = preset_card("tiny")
    cfg = Config()
    adapt = replace(cfg, topology=replace(cfg.topology, vae_cut_adapt=True))
    sim = Sim(adapt, prof, Layout("disaggregated", 1, 1, vae_cut=5), (256, 144), card)
    assert sim.cfg.topology.vae_cut_exchange == pytest.approx((2.0, 0.5))
    sim.submit("w1", storyboard(), 256, 144)
    sim.run()
    assert sim.sched.snapshot()["vae_cuts"] == {"dit0": 3} and sim.sched.cuts.changes == 1
    best = simulate(cfg, prof, Layout("disaggregated", 1, 1, vae_cut=3), card, (256, 144)).w1_fps
    moved = simulate(adapt, prof, Layout("disaggregated", 1, 1, vae_cut=5), card, (256, 144)).w1_fps
    assert moved == pytest.approx(best, rel=0.02)


def test_a_simulation_leaves_the_daemons_log_as_it_found_it(caplog):
    """The planner simulates with the daemon's loggers quieted; afterwards their INFO lines (the
    cut moving) must reach the log again, cached levels included."""
    import logging
    from dataclasses import replace

    from streamdiff.config import Config
    from streamdiff.models.spec import preset_card
    from streamdiff.placement.layout import Layout
    from streamdiff.placement.sim import simulate

    caplog.set_level(logging.INFO, logger="streamdiff")
    cfg = Config()
    adapt = replace(cfg, topology=replace(cfg.topology, vae_cut_adapt=True))
    prof = synthetic(100.0, 200.0, stages=[10.0, 10.0, 20.0, 40.0, 60.0, 60.0])
    simulate(adapt, prof, Layout("disaggregated", 1, 1, vae_cut=1), preset_card("tiny"), (256, 144))
    assert "cut moves" not in caplog.text  # the simulated daemon's own line stays out
    logging.getLogger("streamdiff.placement").info("dit0: the VAE cut moves from 1 to 3 stages")
    assert "the VAE cut moves from 1 to 3" in caplog.text


def test_the_planner_ranks_by_objective_and_follows_the_balance():
    from streamdiff.config import Config
    from streamdiff.models.spec import preset_card
    from streamdiff.placement.planner import plan

    card = preset_card("tiny")
    vae_bound = synthetic(100.0, 200.0, group=105.0, dit2=95.0, vae2=190.0)  # 2 threads barely help
    best, pred = plan(Config(), vae_bound, 2, "throughput", card, (256, 144)).best
    assert best.name == "hybrid-1+2"
    threaded = synthetic(100.0, 200.0, group=105.0, dit2=50.0, vae2=100.0)  # 2 threads scale perfectly
    assert plan(Config(), threaded, 2, "throughput", card, (256, 144)).best[0].name == "agg-1x2t"
    latency = plan(Config(), vae_bound, 2, "latency", card, (256, 144))
    ttffs = [p.w1_ttff_s for _, p in latency.ranked]
    assert ttffs == sorted(ttffs)
    with pytest.raises(ValueError, match="objective"):
        plan(Config(), vae_bound, 2, "fastest", card, (256, 144))


@pytest.mark.parametrize("group_ms,chosen", [(160.0, True), (310.0, False)])
def test_a_dit_group_is_chosen_only_where_its_measured_link_makes_it_pay(group_ms, chosen):
    """Four devices, a DiT twice the VAE: one DiT bounds one stream. A 2-way DiT group whose
    block (all-to-alls included) measured 160 ms makes the pipeline faster and is chosen, with
    the flags that run it; one whose link makes its block slower than one device is not."""
    from streamdiff.config import Config
    from streamdiff.models.spec import preset_card
    from streamdiff.placement.planner import plan

    prof = synthetic(300.0, 150.0, group=80.0, devices=4)
    fig = prof.sizes["256x144"]
    fig["dit_group"] = {"2": {**fig["dit"]["1"], "block_ms": group_ms, "first_ms": group_ms, "own_ms": 120.0}}
    fig["dit_group"]["2"]["batch_ms"] = {"2": group_ms}
    p = plan(Config(), prof, 4, "throughput", preset_card("tiny"), (256, 144), threads=(1,))
    best, pred = p.best
    names = [lay.name for lay, _ in p.ranked]
    assert "disagg-2+2/sp2" in names
    if chosen:
        assert best.name == "disagg-2+2/sp2" and best.flags()[-2:] == ["--dit-group-size", "2"]
        assert pred.w1_steady_fps == pytest.approx(w1_steady_fps(0.160), rel=0.05)
    else:
        assert best.dit_group == 1
        assert pred.w1_steady_fps == pytest.approx(w1_steady_fps(0.300), rel=0.05)


def test_two_devices_run_the_dit_and_the_vae_each_over_both_where_the_group_pays():
    """agg-sp2: the DiT over both devices (55 ms a block, all-to-alls included), then the VAE
    over both (105 ms): 160 ms a block, no device idle while the other stage runs, faster than
    any layout that leaves one device's time to a stage alone."""
    from streamdiff.config import Config
    from streamdiff.models.spec import preset_card
    from streamdiff.placement.planner import plan

    prof = synthetic(100.0, 200.0, group=105.0)
    fig = prof.sizes["256x144"]
    fig["dit_group"] = {"2": {**fig["dit"]["1"], "block_ms": 55.0, "first_ms": 55.0, "own_ms": 45.0}}
    fig["dit_group"]["2"]["batch_ms"] = {"2": 55.0}
    p = plan(Config(), prof, 2, "throughput", preset_card("tiny"), (256, 144), threads=(1,))
    best, pred = p.best
    assert best.name == "agg-sp2"
    assert best.flags() == ["--mode", "aggregated", "--dit-gpus", "2", "--vae-gpus", "2", "--dit-group-size", "2"]
    assert pred.w1_steady_fps == pytest.approx(w1_steady_fps(0.160), rel=0.05)
    del fig["dit_group"]  # not measured: not offered
    ranked = plan(Config(), prof, 2, "throughput", preset_card("tiny"), (256, 144)).ranked
    assert "agg-sp2" not in [lay.name for lay, _ in ranked]


def test_a_model_whose_dit_runs_on_one_device_is_never_planned_a_dit_group():
    """Matrix-Game's action modules run on one device (its card's `dit_group`): where a DiT
    group would win for another model, no layout of its plan splits the DiT."""
    from streamdiff.config import Config
    from streamdiff.models.spec import preset_card
    from streamdiff.placement.planner import plan

    prof = synthetic(100.0, 200.0, group=105.0)
    fig = prof.sizes["256x144"]
    fig["dit_group"] = {"2": {**fig["dit"]["1"], "block_ms": 55.0, "first_ms": 55.0, "own_ms": 45.0}}
    fig["dit_group"]["2"]["batch_ms"] = {"2": 55.0}
    card = preset_card("matrix-game-2-universal").configured(default_size=(256, 144))
    assert plan(Config(), prof, 2, "throughput", preset_card("tiny"), (256, 144)).best[0].dit_group == 2
    assert all(lay.dit_group == 1 for lay, _ in plan(Config(), prof, 2, "throughput", card, (256, 144)).ranked)


def test_the_planner_ranks_eight_b70s_from_the_published_figures():
    """docs/results/profile-b70.json (tools/dev/published_profile.py): DiT 2.9 s and VAE 3.9 s a block. One
    stream is DiT-bound once the VAE is sharded 3 ways or more, so the best layout for it gives
    the DiT one card and the VAE a wide group; no hybrid on accelerators."""
    from streamdiff.config import Config
    from streamdiff.models.spec import preset_card
    from streamdiff.placement.planner import plan
    from streamdiff.placement.profile.schema import Profile

    prof = Profile.from_json((ROOT / "docs" / "results" / "profile-b70.json").read_text())
    card = preset_card("wan2.1-t2v-1.3b")
    for n in (2, 4, 8):
        p = plan(Config(), prof, n, "throughput", card, (832, 480))
        best, pred = p.best
        assert best.mode == "disaggregated" and best.devices == n
        assert all(lay.mode != "hybrid" for lay, _ in p.ranked)
        if n > 2:  # DiT-bound
            assert pred.w1_steady_fps == pytest.approx(w1_steady_fps(2.871), rel=0.03)
    two = plan(Config(), prof, 2, "throughput", card, (832, 480)).best[1]
    assert two.w1_steady_fps == pytest.approx(w1_steady_fps(3.870), rel=0.03)  # disagg-1+1: VAE-bound


def test_a_profile_is_cached_only_for_its_machine_model_and_size(tmp_path):
    from streamdiff.config import Config
    from streamdiff.config.loader import override
    from streamdiff.placement.profile.schema import Profile, cache_path, load_cached

    prof = synthetic(100.0, 200.0)
    cfg = Config()
    path = cache_path(str(tmp_path), cfg, (256, 144))
    path.write_text(prof.to_json())
    assert Profile.from_json(path.read_text()).sizes == prof.sizes
    assert load_cached(path, cfg, (256, 144), 2) is not None
    assert load_cached(path, cfg, (320, 176), 2) is None  # another size
    assert load_cached(path, cfg, (256, 144), 4) is None  # measured on fewer devices
    assert load_cached(path, cfg, (256, 144), 2, now=time.time() + 60 * 86400) is None  # stale
    other = override(cfg, model={"dit_vae_ratio": 0.5})
    assert load_cached(path, other, (256, 144), 2) is None  # another model
    path.write_text("{}")
    assert load_cached(path, cfg, (256, 144), 2) is None


def test_a_cached_profile_of_other_shipped_weights_is_stale(tmp_path, monkeypatch):
    """The embedded default's trained weights set its sampler (a canvas, a longer window), so a
    profile measured under other weights (the seeded ones, an older training) is not reused."""
    from streamdiff.config import Config
    from streamdiff.models import shipped
    from streamdiff.placement.profile import schema

    weights = tmp_path / "weights"
    weights.mkdir()
    monkeypatch.setattr(schema, "fingerprint", lambda preset: shipped.fingerprint(preset, weights))
    cfg, path = Config(), tmp_path / "profile.json"
    assert "shipped" not in schema.model_key(cfg)  # seeded: no files
    (weights / "tiny-dit.safetensors").write_bytes(b"dit one")
    (weights / "tiny-vae.safetensors").write_bytes(b"vae")
    path.write_text(synthetic(100.0, 200.0).to_json())  # measured (synthetic() keys it) under these
    assert schema.load_cached(path, cfg, (256, 144), 2) is not None
    (weights / "tiny-dit.safetensors").write_bytes(b"dit two")
    assert schema.load_cached(path, cfg, (256, 144), 2) is None
    assert shipped.fingerprint("tiny-random", weights) is None  # the seeded preset never loads them


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamdiff.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_streamdiffd_plan_ranks_layouts_for_hardware_we_do_not_have():
    r = run_cli(
        "plan", "--devices", "4", "--profile", "docs/results/profile-b70.json", "--objective", "throughput", "--json"
    )
    assert r.returncode == 0, r.stderr
    ranked = json.loads(r.stdout)["throughput"]["ranked"]
    assert ranked[0]["layout"] == "disagg-1+3" and ranked[0]["flags"][:2] == ["--mode", "disaggregated"]
    assert ranked[0]["w1_fps"] >= ranked[-1]["w1_fps"]
    bad = run_cli("plan", "--profile", "/no/such/profile.json")
    assert bad.returncode == 2 and "cannot read the profile" in bad.stderr and "Traceback" not in bad.stderr
    bad = run_cli("plan", "--profile", "docs/results/profile-b70.json", "--size", "100x10")
    assert bad.returncode == 2 and "multiples of 16" in bad.stderr


def test_streamdiffd_profile_measures_this_machine(tmp_path):
    """A real profile at a small size, one round of one level cycle (which runs the cuts; the
    cycles' order is the test above's): every figure the simulator reads, positive."""
    out = tmp_path / "p.json"
    bad = run_cli("profile", "--cycles", "0")
    assert bad.returncode == 2 and "--cycles: 0 must be at least 1" in bad.stderr, bad.stderr
    r = run_cli("profile", "--sizes", "64x32", "--rounds", "1", "--cycles", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    from streamdiff.placement.profile.schema import Profile

    prof = Profile.from_json(out.read_text())
    fig = prof.sizes["64x32"]
    assert fig["dit"]["1"]["block_ms"] > 0 and fig["vae"]["1"]["block_ms"] > 0 and fig["encode"]["block_ms"] > 0
    assert set(fig["dit"]["1"]["batch_ms"]) == {"2", "4"}
    assert len(fig["vae"]["1"]["stages_ms"]) == 9 and all(x > 0 for x in fig["vae"]["1"]["stages_ms"])
    assert all(d["host_block_ms"] > 0 for d in fig["dit"].values())  # beside the host's encoding
    assert all(d["image_ms"] > 0 for d in fig["dit"].values())  # the embedded default does image-to-video
    # and each decoder stage in the DiT's process, after its block: what a cut adds there
    assert all(len(d["cut_stages_ms"]) == 9 and all(x > 0 for x in d["cut_stages_ms"]) for d in fig["dit"].values())
    if prof.devices >= 2:
        assert set(fig["dit"]) == {"1", "2"}
        shards = fig["vae_group"]["2"]["equal"]
        assert [x["rows"] for x in shards] == [2, 2] and all(x["own_ms"] > 0 for x in shards)
        assert [x["rows"] for x in fig["vae_group"]["2"]["1:3"]] == [1, 3]
        sp = fig["dit_group"]["2"]  # one DiT over two ranks: rank 0's block, its all-to-alls inside it
        assert sp["block_ms"] > 0 and 0 < sp["collective_ms"] < sp["block_ms"] and set(sp["batch_ms"]) == {"2"}
        assert "DiT group of 2" in r.stdout
        probe = fig["hybrid"]  # a DiT below shard 0 on its core while the group decodes
        assert probe["dit"]["own_ms"] > 0 and probe["dit"]["wall_ms"] >= probe["dit"]["own_ms"] * 0.9
        assert probe["dit"]["alone_ms"] > 0
        # its CPU time over the group's steady blocks only: it ran at most all of that time. Below
        # the shard in priority it may run none of it where other processes load the cores (the
        # suite's three on two: once 0.0), and then its time per block beside the group is endless.
        seen = probe["dit"]["window"]
        assert 0 <= seen["cpu_ms"] <= seen["wall_ms"] * 1.05 and "watched" not in probe["group"][0]
        assert [x["rows"] for x in probe["group"]] == [1, 3]
        lv = fig["levels"]  # the interleaved cycles set each thread round's level
        for role in ("dit", "vae"):
            for t in ("1", "2"):
                assert fig[role][t]["block_ms"] == pytest.approx(lv[role][t]) and lv["factors"][role + t] > 0
        # two cuts run side by side as a stage-cut layout runs them: about half, and the most
        # offered (up to half the VAE's stage time)
        from streamdiff.placement.profile.schema import offered_cuts

        offered = offered_cuts(fig["vae"]["1"]["stages_ms"])
        assert set(lv["cuts"]) == {str(offered[-1]), str(offered[(len(offered) - 1) // 2])}
        assert all(x["dit"] > 0 and x["vae"] > 0 for x in lv["cuts"].values())
        assert fig["vae"]["1"]["first_busy_ms"] > 0 and fig["vae"]["1"]["first_ms"] > 0
    assert "DiT/VAE" in r.stdout
    # the first start says what it measures, how far it is and how long is left, probe by probe
    steps = re.findall(r"profile: \[(\d+)/(\d+)\] ", r.stderr)
    assert [int(a) for a, _ in steps] == list(range(1, len(steps) + 1)) and {int(b) for _, b in steps} == {len(steps)}
    assert len(steps) >= 2 and "s left)" in r.stderr.splitlines()[-1] + r.stderr


def test_a_profile_measured_elsewhere_plans_the_daemon_and_a_wrong_one_is_refused_by_name(tmp_path):
    """--profile FILE: the planner starts from it (nothing is measured here); one of another
    model, device kind or size is refused naming what does not fit."""
    from streamdiff.config import Config, ConfigError
    from streamdiff.config.loader import override
    from streamdiff.placement.auto import place

    good = tmp_path / "elsewhere.json"
    good.write_text(synthetic(100.0, 200.0, group=105.0, dit2=95.0, vae2=190.0).to_json())
    said = []
    cfg = override(Config(), topology={"profile": str(good), "devices": 2}, server={"state_dir": str(tmp_path / "s")})
    _, placed = place(cfg, said.append)
    assert placed.planned and placed.profile == str(good) and placed.layout == "hybrid-1+2"
    assert not any("measuring" in line for line in said) and not (tmp_path / "s").exists()
    other = synthetic(100.0, 200.0)
    other.preset, other.device = "wan2.1-t2v-1.3b", "cuda"
    bad = tmp_path / "other.json"
    bad.write_text(other.to_json())
    with pytest.raises(ConfigError, match=r"device kind 'cuda', not 'cpu'; model 'wan2.1-t2v-1.3b', not 'tiny'"):
        place(override(cfg, topology={"profile": str(bad)}), said.append)
    with pytest.raises(ConfigError, match=r"no figures at 128x64"):
        place(override(cfg, model={"size": "128x64"}), said.append)


def test_a_profiles_thread_rounds_take_their_level_from_the_interleaved_cycles():
    """Rounds measured a minute apart on a drifting machine: the 2-thread VAE came out 2.35x the
    1-thread one. The cycles' levels replace each round's, every time in it scaled alike."""
    from streamdiff.placement.profile.cpu_probes import rescale

    res = {
        "256x144": {
            "dit": {
                "1": {"first_ms": 300.0, "block_ms": 200.0, "batch_ms": {"2": 180.0}, "cut_stages_ms": [10.0, 20.0]},
                "2": {"first_ms": 150.0, "block_ms": 100.0, "batch_ms": {"2": 90.0}},
            },
            "vae": {
                "1": {"block_ms": 340.0, "own_ms": 340.0, "rows": 18, "stages_ms": [34.0, 306.0]},
                "2": {"block_ms": 144.0, "own_ms": 144.0, "rows": 18, "stages_ms": [14.4, 129.6]},
            },
        }
    }
    levels = {"256x144": {"dit": {"1": 150.0, "2": 110.0}, "vae": {"1": 255.0, "2": 170.0}}}
    rescale(res, levels)
    fig = res["256x144"]
    d1, d2 = fig["dit"]["1"], fig["dit"]["2"]
    assert d1 == {"first_ms": 225.0, "block_ms": 150.0, "batch_ms": {"2": 135.0}, "cut_stages_ms": [7.5, 15.0]}
    assert d2["block_ms"] == pytest.approx(110.0) and d2["batch_ms"]["2"] == pytest.approx(99.0)
    assert fig["vae"]["1"]["stages_ms"] == pytest.approx([25.5, 229.5]) and fig["vae"]["1"]["rows"] == 18
    assert fig["vae"]["2"]["block_ms"] == pytest.approx(170.0) and fig["vae"]["2"]["rows"] == 18
    assert fig["levels"]["factors"] == {"dit1": 0.75, "dit2": 1.1, "vae1": 0.75, "vae2": 1.181}


def test_the_level_cycles_alternate_the_cuts_and_time_each_thread_count_in_every_cycle():
    """The interleaved cycles' windows (`levels` runs them in this order): in each cycle the
    one-thread DiT and VAE side by side, on a core each, then each stage alone on two; the cuts
    side by side in every other cycle, from the first."""
    from streamdiff.placement.profile.cpu_probes import level_windows
    from streamdiff.platform.cpu import worker_cores

    one_d, one_v, two = worker_cores(0, 1), worker_cores(1, 1), worker_cores(0, 2)
    windows = level_windows(3, cuts=(2, 5))
    assert [{r: c[3] for r, c in w.items()} for w in windows] == [
        *({"dit": f"1/{c}", "vae": f"1/{c}"} for c in (0, 2, 5)), {"dit": "2/0"}, {"vae": "2/0"},
        {"dit": "1/0", "vae": "1/0"}, {"dit": "2/0"}, {"vae": "2/0"},
        *({"dit": f"1/{c}", "vae": f"1/{c}"} for c in (0, 2, 5)), {"dit": "2/0"}, {"vae": "2/0"},
    ]  # fmt: skip
    for w in windows:
        if len(w) == 2:  # side by side: one thread each, on its own core, the same cut
            assert w["dit"][:2] == (1, one_d) and w["vae"][:2] == (1, one_v) and w["dit"][2] == w["vae"][2]
        else:
            assert [c[:3] for c in w.values()] == [(2, two, 0)]
    assert level_windows(1) == [{"dit": (1, one_d, 0, "1/0"), "vae": (1, one_v, 0, "1/0")}, *windows[3:5]]


def test_a_daemon_with_no_layout_flags_plans_from_its_cached_profile_and_streams(tmp_path):
    """The cached profile makes the hybrid the best for throughput on 2 devices: the daemon
    picks it, says so in /health, and streams the same video as one VAE decoding alone."""
    from .helpers import Daemon, assert_same_as_one_dit_and_vae, stream_video

    prof = synthetic(100.0, 200.0, group=105.0, dit2=95.0, vae2=190.0)
    from streamdiff.config import Config
    from streamdiff.placement.profile.schema import cache_path

    cache_path(str(tmp_path), Config(), (256, 144)).write_text(prof.to_json())
    body = {"prompt": "a lighthouse", "num_frames": 33, "seed": 3}
    d = Daemon("--devices", "2", "--objective", "throughput", env={"STATE_DIRECTORY": str(tmp_path)})
    try:
        health = d.health()
        placed = health["placement"]
        assert placed["planned"] and placed["layout"] == "hybrid-1+2" and placed["objective"] == "throughput"
        assert placed["predicted"]["w1_fps"] > placed["runners_up"][0]["w1_fps"]
        assert sorted(health["workers"]) == ["dit0", "vae0.0", "vae0.1"]
        got, _, _ = stream_video(d.url, body)
        weights = d.health()["pipeline"]["vae_band_weights"]["0"]
        assert weights[0] < weights[1]  # the shard beside the DiT decodes the smaller band
    finally:
        assert d.stop() == 0, d.logs()
    assert_same_as_one_dit_and_vae(got, body)


def test_a_daemon_that_plans_a_vae_cut_runs_it(tmp_path):
    """A cached profile whose VAE is the slower stage and whose 2-way group pays little: the
    best layout is disagg-1+1 with the decoder's first 3 stages (40 of 200 ms) on the DiT. The
    daemon starts it as planned and streams the same video as a whole decoder."""
    from .helpers import Daemon, assert_same_as_one_dit_and_vae, stream_video

    prof = synthetic(100.0, 200.0, group=170.0, dit2=95.0, vae2=190.0, stages=[10.0, 10.0, 20.0, 40.0, 60.0, 60.0])
    # its cut probes: a moved ms of decode cost the DiT 1.25 ms and saved the VAE 0.9
    prof.sizes["256x144"]["levels"] = {
        "dit": {"1": 100.0},
        "vae": {"1": 200.0},
        "cuts": {"3": {"dit": 150.0, "vae": 164.0}, "5": {"dit": 100 + 1.25 * 140, "vae": 200 - 0.9 * 140}},
    }
    from streamdiff.config import Config
    from streamdiff.placement.profile.schema import cache_path

    cache_path(str(tmp_path), Config(), (256, 144)).write_text(prof.to_json())
    body = {"prompt": "a lighthouse", "num_frames": 33, "seed": 3}
    d = Daemon("--devices", "2", env={"STATE_DIRECTORY": str(tmp_path)})
    try:
        placed = d.health()["placement"]
        assert placed["layout"] == "disagg-1+1/cut3" and placed["flags"][-2:] == ["--vae-cut", "3"]
        health = d.health()
        assert sorted(health["workers"]) == ["dit0", "vae0.0"] and health["pipeline"]["vae_cut"] == 3
        # the running balance prices a cut as the planner did
        assert health["pipeline"]["vae_cut_exchange"] == pytest.approx([1.25, 0.9])
        got, _, _ = stream_video(d.url, body)
    finally:
        assert d.stop() == 0, d.logs()
    assert_same_as_one_dit_and_vae(got, body)
