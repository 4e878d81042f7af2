"""The placement stack with TAEHV: only whole-frame decoders (VAE groups of one, no hybrid, no
cut) are planned, several DiT workers may feed one decoder, and `streamdiffd plan` ranks TAEHV
layouts of hardware we do not have from a published profile (docs/results/profile-b70-taehv.json)."""

from __future__ import annotations

import json

from .helpers import ROOT
from .test_placement import run_cli, synthetic


def taehv_profile(dit_ms: float, vae_ms: float, **kw):
    prof = synthetic(dit_ms, vae_ms, **kw)
    prof.model = {**prof.model, "decoder": "taehv", "decoder_weights": None}
    return prof


def test_with_taehv_only_groups_of_one_are_planned_and_dits_may_share_a_decoder():
    from streamdiff.config import Config
    from streamdiff.config.loader import override
    from streamdiff.models.spec import preset_card
    from streamdiff.placement.planner import plan

    card = preset_card("tiny")
    # DiT-bound (TAEHV a seventh of the DiT), with figures a Wan profile would use to shard and cut
    prof = taehv_profile(300.0, 40.0, group=25.0, devices=4, stages=[10.0, 10.0, 10.0, 10.0])
    wan = synthetic(300.0, 40.0, group=25.0, devices=4, stages=[10.0, 10.0, 10.0, 10.0])
    names = [lay.name for lay, _ in plan(Config(), wan, 4, "throughput", card, (256, 144)).ranked]
    assert any("/cut" in n for n in names) and any(n.startswith("hybrid") for n in names)  # the Wan VAE's
    for obj in ("throughput", "streams"):
        ranked = plan(Config(), prof, 4, obj, card, (256, 144)).ranked
        assert all(lay.group_size == 1 and lay.mode != "hybrid" and lay.vae_cut == 0 for lay, _ in ranked)
        assert "disagg-3+1" in [lay.name for lay, _ in ranked]
    streams = {lay.name: p.goodput for lay, p in plan(Config(), prof, 4, "streams", card, (256, 144)).ranked}
    assert streams["disagg-3+1"] > streams["disagg-1+3/k1"]  # three DiTs feeding one TAEHV serve more
    # the configured decoder counts too, where the profile does not say
    cfg = override(Config(), model={"decoder": "taehv"})
    assert all(lay.group_size == 1 for lay, _ in plan(cfg, wan, 4, "throughput", card, (256, 144)).ranked)


def test_taehv_makes_vae_gpus_replicas():
    from streamdiff.config import Config
    from streamdiff.config.loader import override

    cfg = override(Config(), model={"decoder": "taehv"}, topology={"vae_devices": 3, "dit_devices": 1})
    assert cfg.topology.vae_group_size == 1


def test_streamdiffd_plan_ranks_four_b70s_with_taehv():
    path = ROOT / "docs" / "results" / "profile-b70-taehv.json"
    r = run_cli("plan", "--devices", "4", "--profile", str(path), "--objective", "throughput", "--json")
    assert r.returncode == 0, r.stderr
    ranked = json.loads(r.stdout)["throughput"]["ranked"]
    assert all(
        "--vae-group-size" not in x["flags"] or x["flags"][x["flags"].index("--vae-group-size") + 1] == "1"
        for x in ranked
    )
    assert ranked[0]["layout"].startswith("disagg")
    b70 = run_cli(
        "plan", "--devices", "4", "--profile", "docs/results/profile-b70.json", "--objective", "throughput", "--json"
    )
    wan_best = json.loads(b70.stdout)["throughput"]["ranked"][0]
    assert ranked[0]["w1_fps"] > wan_best["w1_fps"]  # the decoder no longer holds the stream back
