"""Height-sharded VAE decoding in real processes over gloo, against the unsharded decoder."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback

import pytest
import torch

from streamdiff.models.wan.vae import VAEConfig, WanVAEDecoder
from streamdiff.parallel.vae_group import split_rows

from ..helpers import free_port

CFG = VAEConfig(base_dim=8, num_res_blocks=1)


def make_decoder() -> WanVAEDecoder:
    torch.manual_seed(0)
    vae = WanVAEDecoder(CFG).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return vae


def shard_main(rank, world, addr, sessions, shard_front, out, die_at=None):
    """Decode every session's blocks (interleaved in the given order) and send our strips."""
    try:
        torch.set_num_threads(1)
        from streamdiff.parallel.vae_group import ExchangeHalo, init_group

        init_group(addr, rank, world, "cpu", timeout_s=60)
        vae = make_decoder()
        states = {name: vae.new_state() for name in sessions}
        order = [
            (name, i)
            for i in range(max(len(b) for b in sessions.values()))
            for name in sessions
            if i < len(sessions[name])
        ]
        for step, (name, i) in enumerate(order):
            if die_at is not None and rank == die_at[0] and step == die_at[1]:
                os._exit(9)
            z = sessions[name][i]
            bands = split_rows(z.shape[-2], world)
            strip = vae.decode_rows(z, states[name], bands[rank], ExchangeHalo(rank, bands), shard_front)
            out.put((rank, name, i, strip.numpy()))
        out.put((rank, "done", None, None))
    except Exception:
        out.put((rank, "error", None, traceback.format_exc()))


def run_group(world, sessions, shard_front=False, die_at=None, timeout_s=120):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(target=shard_main, args=(r, world, addr, sessions, shard_front, out, die_at)) for r in range(world)
    ]
    for p in procs:
        p.start()
    strips, finished, errors = {}, set(), {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(finished) + len(errors) < world - (1 if die_at else 0):
            try:
                rank, name, i, data = out.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"group of {world} hung: {len(finished)} done, {errors}") from None
            if name == "done":
                finished.add(rank)
            elif name == "error":
                errors[rank] = data
            else:
                strips[(rank, name, i)] = torch.from_numpy(data)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return strips, errors


def latents(n_blocks, h, w, seed, frames=(1, 3, 2, 1, 3, 2)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 16, frames[i % len(frames)], h, w, generator=g) for i in range(n_blocks)]


def assert_matches_unsharded(world, sessions, strips):
    vae = make_decoder()
    for name, blocks in sessions.items():
        state = vae.new_state()
        bands = split_rows(blocks[0].shape[-2], world)
        for i, z in enumerate(blocks):
            ref = vae.decode(z, state)
            got = torch.cat([strips[(r, name, i)] for r in range(world)], dim=-2)
            assert got.shape == ref.shape
            assert (got - ref).abs().max().item() <= 1e-5, (name, i)
            for r, (r0, r1) in enumerate(bands):  # each strip is exactly its band of rows
                assert strips[(r, name, i)].shape[-2] == 8 * (r1 - r0)


@pytest.mark.parametrize("world,height", [(2, 6), (3, 6), (4, 6), (3, 7), (2, 5)], ids=lambda v: str(v))
def test_sharded_equals_unsharded_over_streamed_blocks(world, height):
    sessions = {"a": latents(5, height, 5, seed=world * 10 + height)}
    strips, errors = run_group(world, sessions)
    assert not errors, errors
    assert_matches_unsharded(world, sessions, strips)


@pytest.mark.parametrize("shard_front", [False, True], ids=["replicated-front", "sharded-front"])
def test_two_interleaved_sessions_keep_separate_sharded_caches(shard_front):
    sessions = {"a": latents(5, 7, 4, seed=1), "b": latents(5, 7, 4, seed=2)}
    strips, errors = run_group(3, sessions, shard_front=shard_front)
    assert not errors, errors
    assert_matches_unsharded(3, sessions, strips)


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
