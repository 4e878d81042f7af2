"""One DiT over a group of processes (Ulysses sequence parallelism over gloo) against the same
DiT on one device: streamed blocks with KV-cache eviction and sinks, a prompt re-cache, a batch
of two sessions at different positions and a multi-shot transition, for groups of 2 and 3 with
heights and head counts that do not divide by the group."""

from __future__ import annotations

import queue
import time
import traceback
from dataclasses import replace

import pytest
import torch

from streamdiff.models.wan.dit import DiTConfig, WanDiT
from streamdiff.models.wan.rows import split_rows
from streamdiff.spawn import torch_context

from ..helpers import free_port

# 5 heads of 12 channels: no group size here divides them (2 + 3 heads, or 2 + 2 + 1).
CFG = DiTConfig(dim=60, ffn_dim=96, freq_dim=32, num_heads=5, num_layers=2, text_dim=24, text_len=7)


def make_dit(camera: bool = False) -> WanDiT:
    """The DiT; `camera`: with minWM's PRoPE path, its output projection given weight."""
    torch.manual_seed(0)
    model = WanDiT(replace(CFG, prope=camera)).eval()
    if camera:
        with torch.no_grad():
            for blk in model.blocks:
                blk.self_attn.prope_o.weight.normal_(0, 0.3)
    return model


def camera_script(model: WanDiT, h: int, w: int) -> list[torch.Tensor]:
    """minWM's path: blocks of 2 frames, each with its frames' cameras, through eviction."""
    g = torch.Generator().manual_seed(h * 100 + w)
    st = model.new_state(h, w, window_frames=4)
    model.set_prompt(st, torch.randn(1, CFG.text_len, CFG.text_dim, generator=g))
    outs = []
    for _ in range(3):  # the third evicts the first
        cams = torch.randn(2, 20, generator=g)
        cams[:, :16] = torch.eye(4).flatten() + 0.1 * cams[:, :16]  # near the identity, invertible
        cams[:, 12:16] = torch.tensor([0.0, 0.0, 0.0, 1.0])  # w2c's last row
        cams[:, 16:] = cams[:, 16:].abs() + 0.3
        st.camera = cams
        x = torch.randn(1, CFG.in_channels, 2, h, w, generator=g)
        outs.append(model.forward_block(x, torch.full((1, 2), 600.0), st, commit=True))
    return outs


def script(model: WanDiT, h: int, w: int) -> list[torch.Tensor]:
    """Every output of one fixed sequence of calls: the same inputs on every rank."""
    g = torch.Generator().manual_seed(h * 100 + w)
    ctx = [torch.randn(1, CFG.text_len, CFG.text_dim, generator=g) for _ in range(2)]

    def block(frames: int = 2) -> torch.Tensor:
        return torch.randn(1, CFG.in_channels, frames, h, w, generator=g)

    outs = []
    st = model.new_state(h, w, window_frames=5, sink_frames=1)
    model.set_prompt(st, ctx[0])
    for _ in range(4):  # from the third block on, frames are evicted past the sink
        x = block()
        outs.append(model.forward_block(x, torch.full((1, 2), 750.0), st, commit=False))
        outs.append(model.forward_block(x, torch.zeros(1, 2), st, commit=True))
    model.recache(st, ctx[1])  # held frames recomputed under the new prompt
    outs.append(model.forward_block(block(), torch.full((1, 2), 500.0), st, commit=True))
    other = model.new_state(h, w, window_frames=5)
    model.set_prompt(other, ctx[1])
    model.forward_block(block(1), torch.zeros(1, 1), other, commit=True)
    x = torch.cat([block(), block()])  # two sessions, one forward, each its own cache and position
    outs.append(model.forward_sessions(x, torch.tensor([[900.0, 900.0], [300.0, 300.0]]), [st, other], commit=True))
    # LongLive 2.0's shot transition (DiTEngine.set_scene(transition=True)): each rank's band of
    # rows at positions moved on, and the block pinned as the shot sink past later evictions
    st.rope_offset, st.pin_next = st.rope_offset + 8, True
    for _ in range(3):
        outs.append(model.forward_block(block(), torch.zeros(1, 2), st, commit=True))
    assert st.kv.pinned is not None
    return outs


def rank_main(rank: int, world: int, addr: str, h: int, w: int, out, camera: bool = False) -> None:
    try:
        torch.set_num_threads(1)
        from streamdiff.parallel.dit_group import SeqParallel
        from streamdiff.parallel.vae_group import init_group

        init_group(addr, rank, world, "cpu", timeout_s=60)
        model = make_dit(camera)
        model.parallel = sp = SeqParallel(rank, world, CFG.num_heads)
        outs = (camera_script if camera else script)(model, h, w)
        st = model.new_state(h, w, window_frames=5)
        out.put((rank, [o.numpy() for o in outs], tuple(st.kv.k[0].shape), sp.bytes_sent))
    except Exception:
        out.put((rank, "error", traceback.format_exc(), 0))


def run_group(world: int, h: int, w: int, timeout_s: float = 120, camera: bool = False) -> dict:
    ctx = torch_context()
    out = ctx.Queue()
    addr = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=rank_main, args=(r, world, addr, h, w, out, camera)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world:
            try:
                rank, outs, kv_shape, sent = out.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"DiT group of {world} hung: {sorted(got)} done") from None
            assert outs != "error", kv_shape
            got[rank] = (outs, kv_shape, sent)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return got


@pytest.mark.parametrize("world,h,w", [(2, 10, 6), (3, 14, 4), (3, 6, 8)], ids=lambda v: str(v))
def test_dit_group_equals_one_device(world, h, w):
    """Patch rows 5, 7 and 3: bands of 3 + 2, 3 + 2 + 2 and 1 + 1 + 1 rows."""
    ref = script(make_dit(), h, w)
    got = run_group(world, h, w)
    heads = split_rows(CFG.num_heads, world)
    for rank, (outs, kv_shape, sent) in got.items():
        assert len(outs) == len(ref)
        for i, (a, b) in enumerate(zip(outs, ref, strict=True)):
            assert a.shape == tuple(b.shape)
            err = (torch.from_numpy(a) - b).abs().max().item()
            assert err <= 1e-5, (rank, i, err)  # every rank returns the whole block
        h0, h1 = heads[rank]
        assert kv_shape[1] == h1 - h0  # the KV cache holds this rank's heads only
        assert sent > 0


def test_a_group_larger_than_the_heads_or_the_rows_is_refused():
    from streamdiff.parallel.dit_group import SeqParallel

    with pytest.raises(ValueError, match="5 attention heads"):
        SeqParallel(0, 6, 5)
    with pytest.raises(ValueError, match="2 rows of patches"):
        SeqParallel(0, 3, 5).grid(1, 2, 4)


def prompt_rank(rank: int, world: int, addr: str, out) -> None:
    try:
        torch.set_num_threads(1)
        from streamdiff.models.engines import DiTEngine
        from streamdiff.models.spec import ModelSpec
        from streamdiff.parallel.dit_group import SeqParallel, shared_prompts
        from streamdiff.parallel.vae_group import init_group

        init_group(addr, rank, world, "cpu", timeout_s=60)
        eng = DiTEngine(ModelSpec(preset="tiny"), text=rank == 0)
        cfg = eng.model.cfg
        sp = eng.model.parallel = SeqParallel(rank, world, cfg.num_heads)
        eng.share_prompt = shared_prompts(sp, (1, cfg.text_len, cfg.text_dim), "cpu")
        embs = [eng.encode_prompt(p).numpy() for p in ("a red ball", "a blue cube", "a red ball")]
        out.put((rank, embs, eng.text is None))
    except Exception:
        out.put((rank, traceback.format_exc(), None))


def test_a_group_holds_one_text_encoder_and_every_rank_gets_its_embeddings():
    from streamdiff.models.engines import DiTEngine
    from streamdiff.models.spec import ModelSpec

    alone = DiTEngine(ModelSpec(preset="tiny"))
    ref = [alone.encode_prompt(p) for p in ("a red ball", "a blue cube", "a red ball")]
    ctx = torch_context()
    out, addr = ctx.Queue(), f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=prompt_rank, args=(r, 2, addr, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict((r, (embs, none)) for r, embs, none in (out.get(timeout=120) for _ in procs))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert all(none is not None for _, none in got.values()), got
    assert got[0][1] is False and got[1][1] is True  # rank 1 loaded no text encoder
    for embs, _ in got.values():
        for a, b in zip(embs, ref, strict=True):
            assert torch.equal(torch.from_numpy(a), b.float())


def test_a_camera_model_in_a_dit_group_equals_one_device():
    """minWM's PRoPE path in a group of 2: each rank transforms its own band of tokens by their
    frames' cameras, PRoPE's keys and values go to heads and into the ring like the RoPE path's."""
    ref = camera_script(make_dit(camera=True), 10, 6)
    for rank, (outs, _, _) in run_group(2, 10, 6, camera=True).items():
        for i, (a, b) in enumerate(zip(outs, ref, strict=True)):
            err = (torch.from_numpy(a) - b).abs().max().item()
            assert err <= 1e-5, (rank, i, err)
