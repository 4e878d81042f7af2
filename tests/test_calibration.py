"""A stage's start-up figures stored and read back (workers/calibration.py): keyed by what shapes
them, read only where every rank of a group has its own, measured otherwise."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from streamdiff.config import ConfigError
from streamdiff.config.loader import load as load_config
from streamdiff.ipc import messages as m
from streamdiff.ipc.shm import RingSpec
from streamdiff.models.spec import ModelSpec
from streamdiff.workers.calibration import PER_START, SHAPES, calibrated, key
from streamdiff.workers.spec import GroupSpec, WorkerSpec


def spec(tmp_path, **kw) -> WorkerSpec:
    ring = RingSpec("sd-x", 2, 1024)
    base = WorkerSpec("vae0.0", ("vae",), "cpu", 1, (0,), ModelSpec(), "ipc://a", ring, ring)
    return replace(base, calibration_dir=str(tmp_path), **kw)


FIGURES = {
    "cost": m.StageCost(120.0, [256, 144], busy_ms=110.0),
    "batch_ms": {"2": 90.0},
    "memory": m.VAEMemory(4096.0, 8e9),
    "stages_ms": m.StageTimes([10.0, 20.0], [256, 144]),
}


def alone(verdicts: list[int]) -> list[int]:
    return verdicts


def test_the_key_is_what_shapes_the_figures(tmp_path):
    a = spec(tmp_path, group=GroupSpec("vae0", 0, 2, "tcp://127.0.0.1:1"))
    renamed = replace(
        a, name="vae3.0", control_addr="ipc://b", incarnation=2, log_level="debug", supervisor_pid=4321, cpus=(1,)
    )
    readdressed = replace(renamed, group=replace(a.group, name="vae3", init_addr="tcp://127.0.0.1:2"))
    assert key(a, "vae") == key(readdressed, "vae")
    for other in (
        replace(a, model=ModelSpec(preset="tiny-random")),
        replace(a, threads=2),
        replace(a, device="cuda:0"),
        replace(a, group=replace(a.group, rank=1)),
        replace(a, vae_cut=2),
        replace(a, max_batch=1),
    ):
        assert key(other, "vae") != key(a, "vae")
    assert key(a, "dit") != key(a, "vae")


def test_every_spec_field_is_either_a_shape_or_per_start():
    """A field added to WorkerSpec is classified here: one left out of the key by accident would
    shape no figure, one left in by accident (a pid) changes the key at every start."""
    names = {f.name for f in fields(WorkerSpec)}
    assert set(SHAPES) | set(PER_START) == names and not set(SHAPES) & set(PER_START)


def test_measured_once_then_read_back_equal(tmp_path):
    runs = []

    def measure(given):
        assert given is None
        runs.append(1)
        return FIGURES

    assert calibrated(spec(tmp_path), "vae", measure, alone) == FIGURES
    assert calibrated(spec(tmp_path, name="vae1.0"), "vae", measure, alone) == FIGURES
    assert len(runs) == 1
    assert calibrated(spec(tmp_path, threads=2), "vae", measure, alone) == FIGURES
    assert len(runs) == 2  # another key: measured
    assert calibrated(replace(spec(tmp_path), calibration_dir=""), "vae", measure, alone) == FIGURES
    assert len(runs) == 3  # no directory: measured at every start


def test_a_group_measures_when_any_rank_lacks_its_figures(tmp_path):
    """Measuring runs collectives every rank must join: a rank that has its figures still
    measures when a peer has none (the group's maximum of 'missing' says so)."""
    runs = []

    def measure(given):
        assert given is None
        runs.append(1)
        return FIGURES

    calibrated(spec(tmp_path), "vae", measure, alone)
    assert calibrated(spec(tmp_path), "vae", measure, lambda v: [1]) == FIGURES  # a peer misses its own
    assert len(runs) == 2


def test_an_unreadable_store_is_measured_again(tmp_path):
    s = spec(tmp_path)
    (tmp_path / f"vae-{key(s, 'vae')}.json").write_text("{not json")
    assert calibrated(s, "vae", lambda given: FIGURES, alone) == FIGURES
    assert calibrated(s, "vae", lambda given: {}, alone) == FIGURES  # stored whole this time


def test_given_timings_reach_the_stage_and_nothing_is_stored(tmp_path):
    """`pipeline.calibration_given`: each stage gets its own timings from the file, every start,
    whatever the store holds, and writes nothing to it."""
    path = tmp_path / "given.json"
    path.write_text('{"dit": {"block_ms": 150, "batch_ms": {"2": 90}}, "vae": {"block_ms": 300}}')
    store = tmp_path / "store"
    seen = {}

    def measure(given):
        seen["given"] = given
        return FIGURES

    s = spec(store, calibration_given=str(path))
    assert calibrated(s, "vae", measure, alone) == FIGURES
    assert seen["given"] == m.GivenTimes(300.0)
    calibrated(s, "dit", measure, alone)
    assert seen["given"] == m.GivenTimes(150.0, {"2": 90.0})
    assert not store.exists()


@pytest.mark.parametrize(
    "text,names",
    [
        ("{not json", "JSON"),
        ('{"dit": {"block_ms": 1}}', "vae"),
        ('{"dit": {"block_ms": 0}, "vae": {"block_ms": 1}}', "block_ms"),
        ('{"dit": {"block_ms": 1, "batch_ms": {"one": 2}}, "vae": {"block_ms": 1}}', "batch_ms"),
        ('{"dit": {"block_ms": 1, "speed": 2}, "vae": {"block_ms": 1}}', "speed"),
    ],
)
def test_a_bad_given_file_is_refused_at_start_naming_it(tmp_path, text, names):
    path = tmp_path / "given.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"pipeline.calibration_given: calibration file {path}.*{names}"):
        load_config(None, {"pipeline": {"calibration_given": str(path)}})
    with pytest.raises(ConfigError, match="No such file"):
        load_config(None, {"pipeline": {"calibration_given": str(tmp_path / "absent.json")}})


@pytest.fixture
def timed_start(tmp_path):
    """A worker spec of real rings, timed at start (no store): a stage built from it in this
    process. The stage sets the process's torch threads; they are set back after."""
    import os

    import torch

    from streamdiff.ipc.shm import Ring

    threads = torch.get_num_threads()
    rings = [Ring.create(f"t{os.getpid()}cal", name, 1, 1024) for name in ("latent", "frames")]
    try:
        base = spec(tmp_path, latent_ring=rings[0].spec, frame_ring=rings[1].spec)
        yield replace(base, calibration_dir="")
    finally:
        torch.set_num_threads(threads)
        for r in rings:
            r.close(unlink=True)


@pytest.mark.parametrize("decoder", ["wan", "taehv"])
def test_given_timings_on_the_cpu_leave_the_cache_a_timed_start_measures(timed_start, decoder):
    """Timings given, a whole decoder on the CPU decodes its start-up blocks at a quarter of the
    preset's latent rows and columns (they run only for the cache they leave): the cache's bytes
    per latent pixel are what a timed start measures at the preset's size."""
    from streamdiff.workers.faults import Faults
    from streamdiff.workers.vae_stage import VAEStage

    stage = VAEStage(replace(timed_start, model=ModelSpec(decoder=decoder)), Faults((), "vae0.0", 0))
    timed = stage.calibration["memory"]
    shapes = []
    decode = stage.engine.decode_blocks
    stage.engine.decode_blocks = lambda states, z, *a: shapes.append(tuple(z.shape[-2:])) or decode(states, z, *a)
    given = stage.calibrate(m.GivenTimes(260.0))
    (w, h), sf = stage.engine.preset.default_size, stage.engine.preset.vae.spatial_factor
    assert shapes == [(h // sf // 4 // 2 * 2, w // sf // 4 // 2 * 2)] * 2 and shapes[0] != (h // sf, w // sf)
    assert given["memory"] == timed and given["cost"] == m.StageCost(260.0, [w, h])


def test_given_timings_on_the_cpu_run_no_dit_block_and_hold_what_a_timed_start_measures(timed_start):
    """Timings given, a DiT worker on the CPU runs no block at start (it counts no transients, and
    a session's caches are allocated when it opens and its scene is set): what a session holds is
    what a timed start measures."""
    from streamdiff.workers.dit_stage import DiTStage
    from streamdiff.workers.faults import Faults

    stage = DiTStage(replace(timed_start, name="dit0", roles=("dit",)), Faults((), "dit0", 0))
    timed = stage.calibration["memory"]
    blocks = []
    generate = stage.engine.generate_block
    stage.engine.generate_block = lambda *a: blocks.append(a) or generate(*a)
    given = stage.calibrate(m.GivenTimes(130.0, {"2": 130.0}))
    assert blocks == [] and given["memory"] == timed
    assert given["cost"] == m.StageCost(130.0, list(stage.engine.preset.default_size), busy_ms=130.0)
