"""A VAE worker's stage decoding the supervisor's batches (`DecodeBatch`): real rings, real
processes, a real gloo group for k=2; each session's frames equal that session decoded alone by
one unsharded decoder, and a block one shard refuses is refused by the group while the others in
its batch decode."""

from __future__ import annotations

import os
import queue
import traceback

import msgspec
import numpy as np
import pytest
import torch

from streamdiff.ipc import messages as m
from streamdiff.ipc.shm import Ring
from streamdiff.models.spec import ModelSpec
from streamdiff.spawn import torch_context
from streamdiff.workers.stage_common import put_activation

from ..helpers import free_port

H, W = 64, 128  # pixels: 8x16 latent rows x columns
SLOT_LATENT = 16 * 3 * 8 * 16 * 4
SLOT_FRAMES = 12 * H * W * 3


def batches() -> list[list[m.DecodeBlock]]:
    """Two sessions' blocks in pairs: a shot's first block each, then steady ones; the third
    pair's block of `a` claims the wrong frame count (the check refuses it)."""
    out = []
    slot = 0
    for i, frames_out in enumerate((9, 12, 12)):
        pair = []
        for name in ("a", "b"):
            bad = i == 2 and name == "a"
            msg = m.DecodeBlock(name, i, slot, slot, [16, 3, H // 8, W // 8], 13 if bad else frames_out, i == 0)
            pair.append(msg)
            slot += 1
        out.append(pair)
    return out


def latent(name: str, block: int) -> np.ndarray:
    g = torch.Generator().manual_seed(2 * block + (name == "b"))
    return torch.randn(16, 3, H // 8, W // 8, generator=g).numpy()


# Weights the supervisor sends with each batch (rebalancing): the bands of 8 rows go 2 + 6, then
# 6 + 2, then 4 + 4 in the middle of the shot; each shard moves the cached rows to follow.
SHIFTING = [(1.0, 3.0), (3.0, 1.0), (1.0, 1.0)]
SHIFTED_ROWS = [(2, 6), (6, 2), (4, 4)]


CUT = 4  # the cut variant: the slots hold the decoder's first 4 stages' output


def cut_inputs() -> dict[tuple[str, int], np.ndarray]:
    """With a cut, what the DiT worker would put in each block's slot: the first CUT stages of
    that session's decode (its own stage caches, from the shot's start)."""
    from streamdiff.models.engines import VAEEngine
    from streamdiff.models.wan.vae import decode_stages

    vae = VAEEngine(ModelSpec(), "cpu").model
    fronts = {name: vae.new_state() for name in ("a", "b")}
    return {
        (msg.session, msg.block): decode_stages(
            vae, torch.from_numpy(latent(msg.session, msg.block))[None], fronts[msg.session], 0, CUT, 3
        )[0]
        for batch in batches()
        for msg in batch
    }


def shard_main(rank, world, addr, latent_spec, frame_spec, out, weights=None, cut=0):
    try:
        from streamdiff.workers.faults import Faults
        from streamdiff.workers.spec import GroupSpec, WorkerSpec
        from streamdiff.workers.vae_stage import VAEStage

        group = GroupSpec("g", rank, world, addr, timeout_s=60) if world > 1 else None
        spec = WorkerSpec(
            f"vae0.{rank}", ("vae",), "cpu", 1, (), ModelSpec(), "", latent_spec, frame_spec, group, vae_cut=cut
        )
        stage = VAEStage(spec, Faults((), spec.name, 0))
        for name in ("a", "b"):
            stage.open(m.OpenSession(name, W, H, 0))
        data = cut_inputs() if cut else {}
        for i, batch in enumerate(batches()):
            if cut:  # each slot holds the first stages' output, as the DiT worker writes it
                batch = [msgspec.structs.replace(x, data_shape=list(data[x.session, x.block].shape)) for x in batch]
            replies, refusals = stage.run_batch(batch, closed=set(), weights=weights[i] if weights else None)
            out.put(
                (
                    rank,
                    [(r.session, r.block, r.skipped, r.batch) for r in replies],
                    [r.rows for r in replies if not r.skipped],
                    [(x.session, x.block) for x, _ in refusals],
                )
            )
        out.put((rank, "done", None, None))
    except Exception:
        out.put((rank, "error", None, traceback.format_exc()))


@pytest.mark.parametrize(
    "world,weights,cut",
    [(1, None, 0), (2, None, 0), (2, SHIFTING, 0), (1, None, CUT)],
    ids=["k1", "k2", "k2-weighted", "k1-cut"],
)
def test_a_vae_stage_decodes_the_supervisors_batches_each_equal_to_its_session_alone(world, weights, cut):
    """k1-cut: the worker runs the stages after a cut (topology.vae_cut) on both sessions'
    activations in one call, each session with its own caches."""
    instance = f"t{os.getpid()}b{world}{weights is not None}{cut}"
    data = cut_inputs() if cut else {}
    slot = max([SLOT_LATENT, *(4 * x.numel() for x in data.values())])
    latents = Ring.create(instance, "latent", 6, slot)
    frames = Ring.create(instance, "frames", 6, SLOT_FRAMES)
    try:
        for batch in batches():
            for msg in batch:
                if cut:  # as the DiT worker writes it
                    put_activation(latents, msg.latent_slot, data[msg.session, msg.block])
                else:
                    x = latent(msg.session, msg.block)
                    latents.array(msg.latent_slot, x.shape, np.float32)[...] = x
        ctx = torch_context()
        out = ctx.Queue()
        addr = f"tcp://127.0.0.1:{free_port()}"
        procs = [
            ctx.Process(target=shard_main, args=(r, world, addr, latents.spec, frames.spec, out, weights, cut))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results: dict[int, list] = {r: [] for r in range(world)}
        done = set()
        try:
            while len(done) < world:
                rank, a, rows, b = out.get(timeout=240)
                assert a != "error", b
                if a == "done":
                    done.add(rank)
                else:
                    results[rank].append((a, b))
                    i = len(results[rank]) - 1
                    want = SHIFTED_ROWS[i][rank] if weights else 8 // world
                    assert set(rows) == {want}, (rank, i, rows)
        except queue.Empty:
            raise AssertionError(f"the group hung: {results}") from None
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        for rank in range(world):
            (r0, f0), (r1, f1), (r2, f2) = results[rank]
            assert r0 == [("a", 0, False, 2), ("b", 0, False, 2)] and f0 == []
            assert r1 == [("a", 1, False, 2), ("b", 1, False, 2)] and f1 == []
            assert r2 == [("b", 2, False, 1)] and f2 == [("a", 2)]  # refused by every shard; b decodes

        from streamdiff.models.engines import VAEEngine

        ref = VAEEngine(ModelSpec(), "cpu")
        for name in ("a", "b"):
            state = ref.open_session()
            for batch in batches():
                msg = next(x for x in batch if x.session == name)
                if name == "a" and msg.block == 2:
                    continue
                want = ref.decode_block(state, torch.from_numpy(latent(name, msg.block))[None]).numpy()
                got = frames.array(msg.frame_slot, (msg.frames_out, H, W, 3), np.uint8)
                diff = np.abs(got.astype(int) - want.astype(int)).max()
                assert diff <= 1, (name, msg.block, diff)  # uint8 after rounding: batched and sharded sums differ ~1e-6
    finally:
        latents.close(unlink=True)
        frames.close(unlink=True)
