"""Height-sharded VAE decoding in real processes over gloo, against the unsharded decoder."""

from __future__ import annotations

import os
import queue
import time
import traceback

import pytest
import torch

from streamdiff.models.wan.kernels import CPU_DECODE_WORKING_SET_BYTES, plan_block
from streamdiff.models.wan.rows import split_rows
from streamdiff.models.wan.vae import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD, VAEConfig, WanVAEDecoder
from streamdiff.spawn import torch_context

from ..helpers import free_port

CFG = VAEConfig(base_dim=8, num_res_blocks=1)
# Wan 2.2's decoder, narrowed: 48 latent channels, residual stages, 2x2 patches (16x in space)
CFG22 = VAEConfig(
    base_dim=8,
    z_dim=48,
    num_res_blocks=1,
    residual=True,
    patch_size=2,
    latents_mean=WAN22_LATENTS_MEAN,
    latents_std=WAN22_LATENTS_STD,
)
CONFIGS = {"2.1": CFG, "2.2": CFG22}


def make_decoder(kind: str = "2.1") -> WanVAEDecoder:
    torch.manual_seed(0)
    vae = WanVAEDecoder(CONFIGS[kind]).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return vae


def plan_for(z, world, working_set_bytes=CPU_DECODE_WORKING_SET_BYTES, weights=None, kind="2.1"):
    c = CONFIGS[kind]
    width = c.decoder_dim // c.patch_size**2
    return plan_block(z.shape, world, "cpu", width, c.spatial_factor, 4, 4, working_set_bytes, 1, weights)


def join(rank, world, addr) -> list[int]:
    """This process's rank of a gloo group; returns the count of batched point-to-point calls
    (reset by each job)."""
    torch.set_num_threads(1)
    from streamdiff.parallel.vae_group import init_group

    init_group(addr, rank, world, "cpu", timeout_s=60)
    import torch.distributed as dist

    batched = [0]
    real_batch = dist.batch_isend_irecv

    def counting_batch(ops):
        batched[0] += 1
        return real_batch(ops)

    dist.batch_isend_irecv = counting_batch
    return batched


def shard_main(rank, world, addr, job, out):
    """A rank of a group of its own, for one job (a shard that dies must not take a shared group)."""
    try:
        batched = join(rank, world, addr)
    except Exception:
        out.put((rank, "error", None, traceback.format_exc()))
        return
    shard_job(rank, world, batched, out, *job)


def rank_main(rank, world, addr, jobs, out):
    """A rank of a module's group: joins once, then runs the jobs it is sent until None."""
    try:
        batched = join(rank, world, addr)
    except Exception:
        out.put((rank, "error", None, traceback.format_exc()))
        return
    while (job := jobs.get()) is not None:
        shard_job(rank, world, batched, out, *job)


def shard_job(
    rank,
    world,
    batched,
    out,
    sessions,
    shard_front,
    die_at=None,
    working_set_bytes=None,
    batch_sessions=False,
    weights=None,
    kind="2.1",
):
    """Decode every session's blocks (interleaved in the given order) and send our strips."""
    try:
        from streamdiff.parallel.vae_group import ExchangeHalo, move_bands

        batched[0] = 0
        vae = make_decoder(kind)
        states = {name: vae.new_state() for name in sessions}
        order = [
            (name, i)
            for i in range(max(len(b) for b in sessions.values()))
            for name in sessions
            if i < len(sessions[name])
        ]
        if batch_sessions:  # block i of every session in one call, each with its own cache
            names = list(sessions)
            for i in range(len(sessions[names[0]])):
                z = torch.cat([sessions[n][i] for n in names])
                plan = plan_block(
                    z.shape, world, "cpu", CFG.base_dim, 8, 4, 4, CPU_DECODE_WORKING_SET_BYTES, len(names)
                )
                halo = ExchangeHalo(rank, list(plan.bands))
                y = vae.decode_sessions(z, [states[n] for n in names], plan, rank, halo, shard_front)
                for k, n in enumerate(names):
                    out.put((rank, n, i, y[k : k + 1].numpy()))
            order = []
        for step, (name, i) in enumerate(order):
            if die_at is not None and rank == die_at[0] and step == die_at[1]:
                os._exit(9)
            z = sessions[name][i]
            w = weights[i] if isinstance(weights, list) else weights  # a list: each block's own bands
            if (
                isinstance(weights, list)
                and i > 0
                and split_rows(z.shape[-2], world, w) != split_rows(z.shape[-2], world, weights[i - 1])
            ):
                move_bands(states[name], vae.band_slots(shard_front), *moved(z.shape[-2], world, weights, i), rank)
            plan = plan_for(z, world, working_set_bytes or CPU_DECODE_WORKING_SET_BYTES, w, kind)
            strip = vae.decode_rows(z, states[name], plan, rank, ExchangeHalo(rank, list(plan.bands)), shard_front)
            out.put((rank, name, i, strip.numpy()))
        out.put((rank, "done", None, batched[0]))
    except Exception:
        out.put((rank, "error", None, traceback.format_exc()))


def moved(height, world, weights, i):
    return split_rows(height, world, weights[i - 1]), split_rows(height, world, weights[i])


def run_group(
    world,
    sessions,
    shard_front=False,
    die_at=None,
    timeout_s=120,
    working_set_bytes=None,
    batch=False,
    weights=None,
    kind="2.1",
):
    """Every rank's strips and errors for one job: a dying shard's in a group of its own, every
    other in the module's group of `world` ranks, started at its first job and kept (one gloo
    group per world size a module, not one per test), and dropped after a job that fails."""
    job = (sessions, shard_front, die_at, working_set_bytes, batch, weights, kind)
    if die_at is not None:
        ctx = torch_context()
        out = ctx.Queue()
        addr = f"tcp://127.0.0.1:{free_port()}"
        procs = [ctx.Process(target=shard_main, args=(r, world, addr, job, out)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            return collect(world, out, timeout_s, die_at)
        finally:
            stop(procs)
    pool = POOLS.get(world) or POOLS.setdefault(world, Pool(world))
    for q in pool.jobs:
        q.put(job)
    try:
        strips, errors = collect(world, pool.out, timeout_s, None)
    except BaseException:
        POOLS.pop(world).close()
        raise
    if errors:
        POOLS.pop(world).close()
    return strips, errors


class Pool:
    def __init__(self, world: int) -> None:
        ctx = torch_context()
        self.out = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world)]
        addr = f"tcp://127.0.0.1:{free_port()}"
        self.procs = [
            ctx.Process(target=rank_main, args=(r, world, addr, q, self.out)) for r, q in enumerate(self.jobs)
        ]
        for p in self.procs:
            p.start()

    def close(self) -> None:
        for q in self.jobs:
            q.put(None)
        stop(self.procs)


POOLS: dict[int, Pool] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_the_groups():
    yield
    while POOLS:
        POOLS.popitem()[1].close()


def stop(procs) -> None:
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()


def collect(world, out, timeout_s, die_at):
    strips, finished, errors = {}, set(), {}
    deadline = time.monotonic() + timeout_s
    while len(finished) + len(errors) < world - (1 if die_at else 0):
        try:
            rank, name, i, data = out.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"group of {world} hung: {len(finished)} done, {errors}") from None
        if name == "done":
            finished.add(rank)
            strips[(rank, "p2p")] = data
        elif name == "error":
            errors[rank] = data
        else:
            strips[(rank, name, i)] = torch.from_numpy(data)
    return strips, errors


def latents(n_blocks, h, w, seed, frames=(1, 3, 2, 1, 3, 2), kind="2.1"):
    g = torch.Generator().manual_seed(seed)
    c = CONFIGS[kind].z_dim
    return [torch.randn(1, c, frames[i % len(frames)], h, w, generator=g) for i in range(n_blocks)]


def assert_matches_unsharded(world, sessions, strips, weights=None, kind="2.1"):
    vae = make_decoder(kind)
    f = vae.cfg.spatial_factor
    for name, blocks in sessions.items():
        state = vae.new_state()
        for i, z in enumerate(blocks):
            bands = split_rows(z.shape[-2], world, weights[i] if isinstance(weights, list) else weights)
            ref = vae.decode(z, state)
            got = torch.cat([strips[(r, name, i)] for r in range(world)], dim=-2)
            assert got.shape == ref.shape
            assert (got - ref).abs().max().item() <= 1e-5, (name, i)
            for r, (r0, r1) in enumerate(bands):  # each strip is exactly its band of rows
                assert strips[(r, name, i)].shape[-2] == f * (r1 - r0)


@pytest.mark.parametrize("world,height", [(2, 6), (3, 6), (4, 6), (3, 7), (2, 5)], ids=lambda v: str(v))
def test_sharded_equals_unsharded_over_streamed_blocks(world, height):
    sessions = {"a": latents(5, height, 5, seed=world * 10 + height)}
    strips, errors = run_group(world, sessions)
    assert not errors, errors
    assert_matches_unsharded(world, sessions, strips)
    # The exchanges went through batched point-to-point (NCCL and oneCCL may deadlock on
    # separate isend/irecv pairs): one batch per 3x3 conv of the sharded part, on every rank.
    counts = {strips[(r, "p2p")] for r in range(world)}
    assert len(counts) == 1 and counts.pop() > 0


@pytest.mark.parametrize(
    "world,height,weights,shard_front",
    [(2, 5, None, False), (3, 7, (1.0, 3.0, 2.0), True), (4, 6, None, True)],
    ids=lambda v: str(v),
)
def test_the_wan22_decoder_sharded_equals_unsharded(world, height, weights, shard_front):
    """Wan 2.2's decoder height-sharded like 2.1's: halos at every 3x3 (its shortcuts and
    patches are row-local), the middle attention over gathered rows, any k the rows allow,
    equal or weighted bands, the front replicated or sharded, over a shot's streamed blocks."""
    sessions = {"a": latents(4, height, 3, seed=world + height, frames=(1, 3, 2, 1), kind="2.2")}
    strips, errors = run_group(world, sessions, shard_front=shard_front, weights=weights, kind="2.2")
    assert not errors, errors
    assert_matches_unsharded(world, sessions, strips, weights, kind="2.2")


def test_wan22_bands_moved_in_the_middle_of_a_shot_equal_the_unsharded_decoder():
    weights = [(1.0, 1.0, 1.0), (1.0, 3.0, 3.0), (4.0, 1.0, 1.0), (1.0, 1.0, 1.0)]
    sessions = {"a": latents(4, 8, 3, seed=77, frames=(1, 3, 2, 1), kind="2.2")}
    strips, errors = run_group(3, sessions, shard_front=True, weights=weights, kind="2.2")
    assert not errors, errors
    assert_matches_unsharded(3, sessions, strips, weights, kind="2.2")


@pytest.mark.parametrize(
    "world,height,weights,shard_front",
    [
        (2, 7, (1.0, 3.0), False),  # a hybrid's small band beside the DiT: rows 2 + 5
        (2, 9, (3.0, 1.0), True),
        (3, 10, (0.2, 0.5, 0.3), False),  # unequal shards: rows 2 + 5 + 3
        (3, 7, (1.0, 1.0, 4.0), True),
    ],
    ids=lambda v: str(v),
)
def test_weighted_bands_equal_the_unsharded_decoder(world, height, weights, shard_front):
    """Bands sized by weight (supervisor.bands) decode exactly what one decoder does, whatever
    rows each shard holds, with the front replicated or sharded."""
    bands = split_rows(height, world, weights)
    assert len({r1 - r0 for r0, r1 in bands}) > 1  # really unequal
    sessions = {"a": latents(4, height, 5, seed=height + world)}
    strips, errors = run_group(world, sessions, shard_front=shard_front, weights=weights)
    assert not errors, errors
    assert_matches_unsharded(world, sessions, strips, weights)


@pytest.mark.parametrize(
    "world,height,shard_front",
    [(2, 7, False), (3, 10, False), (2, 9, True), (3, 7, True)],
    ids=lambda v: str(v),
)
def test_bands_moved_in_the_middle_of_a_shot_equal_the_unsharded_decoder(world, height, shard_front):
    """Rebalancing: the bands change between blocks of one shot; every shard re-cuts the cached
    rows (move_bands) and the shot goes on exactly as one decoder decodes it."""
    shifts = [(1.0,) * world, (1.0, *([3.0] * (world - 1))), (4.0, *([1.0] * (world - 1))), (1.0,) * world]
    weights = [shifts[i % len(shifts)] for i in range(5)]
    sessions = {"a": latents(5, height, 5, seed=height * world)}
    strips, errors = run_group(world, sessions, shard_front=shard_front, weights=weights)
    assert not errors, errors
    assert_matches_unsharded(world, sessions, strips, weights)


def test_uneven_bands_decoded_in_chunks_agree():
    """7 latent rows over 3 shards (3, 2, 2) with a working set that fits two frames of a 2-row
    band but one of the 3-row band: sized per band, shard 0 would run twice the exchanges of
    its neighbour and gloo would abort the group; under one plan all decode 1 frame per call."""
    per_row_frame = 8 * 4 * 8 * 4 * 8 * 4 * 3  # base_dim * temporal * 8 px * (4 latent cols * 8) * bytes * 3
    budget = 2 * 2 * per_row_frame
    sessions = {"a": latents(4, 7, 4, seed=5, frames=(1, 3, 3, 2))}
    assert plan_for(sessions["a"][1], 3, budget).frames_per_call == 1
    strips, errors = run_group(3, sessions, working_set_bytes=budget)
    assert not errors, errors
    assert_matches_unsharded(3, sessions, strips)


@pytest.mark.parametrize("shard_front", [False, True], ids=["replicated-front", "sharded-front"])
def test_two_interleaved_sessions_keep_separate_sharded_caches(shard_front):
    sessions = {"a": latents(5, 7, 4, seed=1), "b": latents(5, 7, 4, seed=2)}
    strips, errors = run_group(3, sessions, shard_front=shard_front)
    assert not errors, errors
    assert_matches_unsharded(3, sessions, strips)


@pytest.mark.parametrize("shard_front", [False, True], ids=["replicated-front", "sharded-front"])
def test_a_k2_group_decodes_several_sessions_in_one_call(shard_front):
    """Three sessions' blocks decoded together by a k=2 group (7 rows: uneven bands), each with
    its own sharded temporal cache, equal to each session decoded alone and unsharded."""
    frames = (1, 3, 3, 2)
    sessions = {n: latents(4, 7, 4, seed=40 + k, frames=frames) for k, n in enumerate("abc")}
    strips, errors = run_group(2, sessions, shard_front=shard_front, batch=True)
    assert not errors, errors
    assert_matches_unsharded(2, sessions, strips)


def test_split_rows():
    assert split_rows(60, 4) == [(0, 15), (15, 30), (30, 45), (45, 60)]
    assert split_rows(7, 3) == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(ValueError, match="cannot be split"):
        split_rows(2, 3)


def test_a_dead_shard_makes_the_others_fail_fast():
    sessions = {"a": latents(6, 6, 4, seed=3)}
    t0 = time.monotonic()
    _, errors = run_group(3, sessions, die_at=(1, 2), timeout_s=60)
    elapsed = time.monotonic() - t0
    assert set(errors) == {0, 2}, errors  # both survivors raise instead of waiting
    assert elapsed < 30  # well inside the 60 s collective timeout
    for tb in errors.values():
        assert "Connection" in tb or "closed" in tb or "reset" in tb.lower() or "peer" in tb.lower(), tb
