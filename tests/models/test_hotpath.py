"""The DiT's device-resident hot path: the ring KV cache equals the copying cache it replaced,
a cut reuses the session's buffers, a block reads nothing back from the device, and compiled
blocks equal eager ones without recompiling through a stream with cuts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from streamdiff.models import compiled
from streamdiff.models.compiled import compile_stats
from streamdiff.models.engines import DiTEngine, VAEEngine
from streamdiff.models.spec import ModelSpec
from streamdiff.models.wan import rolling
from streamdiff.models.wan.dit import DiTConfig, WanDiT
from streamdiff.models.wan.kv_cache import KVCache
from streamdiff.models.wan.sampler import SamplerConfig, denoise_block, denoise_sessions

ROOT = Path(__file__).resolve().parents[2]

CFG = DiTConfig(dim=32, ffn_dim=64, num_heads=2, num_layers=2, text_dim=16, text_len=8)
LAT_H, LAT_W = 4, 6
TS = [1000.0, 500.0]


class CopyingKV(KVCache):
    """The cache as it was before the ring (92242eb): frames in shot order, every eviction shifts
    the kept frames down over the evicted ones in every layer's buffers. Transcribed here as the
    reference; its frames stay in slots 0.., so `write` and `read` address slots in shot order."""

    def make_room(self, new_frames: int) -> None:
        excess = self.frames + new_frames - self.window
        if excess <= 0:
            return
        t = self.tpf
        lo, hi = self.sink * t, self.frames * t
        for buf in (*self.k, *self.v):
            buf[:, :, lo : hi - excess * t] = buf[:, :, lo + excess * t : hi].clone()
        super().make_room(new_frames)
        self.order = list(range(self.frames))
        self._runs.clear()


@pytest.fixture(scope="module")
def model() -> WanDiT:
    torch.manual_seed(0)
    return WanDiT(CFG).eval()


def blocks(model, state, sizes, seed=1):
    g = torch.Generator().manual_seed(seed)
    model.set_prompt(state, torch.randn(1, CFG.text_len, CFG.text_dim, generator=g))
    out = []
    for f in sizes:
        noise = torch.randn(1, CFG.in_channels, f, LAT_H, LAT_W, generator=g)
        out.append(denoise_block(model, state, noise, TS, [torch.randn(noise.shape, generator=g)]))
    return out


@pytest.mark.parametrize("sink", [0, 2])
def test_ring_equals_the_copying_cache(model, sink):
    """Blocks of 3 in a window of 8 (not a multiple: a block's frames wrap around the ring's end),
    with and without sinks, a short block among them: every block's output equals the copying
    cache's within float rounding (attention reads the keys in another order), and the held
    frames read back in shot order are the copying cache's buffers."""
    sizes = [3, 3, 3, 1, 3, 3, 3, 2]
    ring = model.new_state(LAT_H, LAT_W, 8, sink)
    ref = model.new_state(LAT_H, LAT_W, 8, sink)
    ref.kv.__class__ = CopyingKV
    got, want = blocks(model, ring, sizes), blocks(model, ref, sizes)
    assert ring.kv.wrapped
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    kv, n = ring.kv, ring.kv.frames
    assert kv.positions == ref.kv.positions and n == ref.kv.frames
    for layer in range(CFG.num_layers):
        k = torch.cat([k for k, _ in kv.read(layer, 0, n)], dim=2)
        v = torch.cat([v for _, v in kv.read(layer, 0, n)], dim=2)
        torch.testing.assert_close(k, ref.kv.k[layer][:, :, : n * kv.tpf], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, ref.kv.v[layer][:, :, : n * kv.tpf], rtol=1e-5, atol=1e-5)
    if sink:
        assert kv.tail_positions == ref.kv.tail_positions and len(kv.tail_positions) == sink
        torch.testing.assert_close(kv.tail, ref.kv.tail, rtol=1e-5, atol=1e-5)


def test_batched_sessions_with_wrapped_rings_equal_each_alone(model):
    """Two sessions at different ring offsets but equal lengths: one SDPA call for both, each
    row equal to its session alone; then lengths that differ: one call each."""
    a, b = model.new_state(LAT_H, LAT_W, 8, 0), model.new_state(LAT_H, LAT_W, 8, 2)
    blocks(model, a, [3, 3, 3, 1], seed=2)
    blocks(model, b, [3, 3, 3], seed=3)
    assert a.kv.order != b.kv.order
    for frames in (3, 1):
        alone = [st for st in (a, b)]
        import copy

        solo = [copy.deepcopy(st) for st in alone]
        g = torch.Generator().manual_seed(frames)
        noise = torch.randn(2, CFG.in_channels, frames, LAT_H, LAT_W, generator=g)
        renoise = [torch.randn(noise.shape, generator=g)]
        both = denoise_sessions(model, alone, noise, [TS, TS], renoise)
        for i, st in enumerate(solo):
            one = denoise_block(model, st, noise[i : i + 1], TS, [renoise[0][i : i + 1]])
            torch.testing.assert_close(both[i : i + 1], one, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- a cut reuses the cache

BIG = DiTConfig(dim=1536, ffn_dim=1536, freq_dim=64, num_heads=12, num_layers=2, text_dim=64, text_len=32)


class LargeAllocations(TorchDispatchMode):
    """Records every tensor an op makes that is as large as one layer's keys (a new cache)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.seen = limit, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {
            a.untyped_storage().data_ptr()
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        for t in out if isinstance(out, tuple | list) else (out,):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in given:
                continue  # a view of an input (a weight's transpose), nothing new
            if t.untyped_storage().nbytes() >= self.limit:
                self.seen.append((str(func), tuple(t.shape)))
        return out


def test_a_storyboard_with_three_cuts_holds_one_cache():
    """The real 1.3B DiT's head shapes (12 heads of 128) in two layers: a session whose shots
    cut three times keeps its cache's buffers (no op makes a tensor of a layer's keys' size, and
    the buffers are the ones allocated at open), and each shot equals a fresh session's."""
    torch.manual_seed(0)
    eng = DiTEngine(ModelSpec(preset="tiny-random", dtype="float32", compile="off"))
    eng.model = WanDiT(BIG).eval()
    sess = eng.open_session(128, 64, seed=0)
    kv = sess.state.kv
    buffers = [t.data_ptr() for t in (*kv.k, *kv.v)]
    shots = [(11, 3), (12, 1), (13, 2), (14, 1)]  # (seed, blocks): a cut before each after the first; each
    # shorter than one before it, whose cached frames it must not attend
    got = []
    with LargeAllocations(kv.k[0].numel() * kv.k[0].element_size()) as big:
        for seed, n in shots:
            eng.set_scene(sess, "a shot", new_shot=True, seed=seed)
            got.append([eng.generate_block(sess, 3) for _ in range(n)])
    assert big.seen == []
    assert sess.state.kv is kv and [t.data_ptr() for t in (*kv.k, *kv.v)] == buffers
    for (seed, _), blocks_ in zip(shots, got, strict=True):
        fresh = eng.open_session(128, 64, seed=seed)
        eng.set_scene(fresh, "a shot", new_shot=True)
        for b in blocks_:
            torch.testing.assert_close(b, eng.generate_block(fresh, 3), rtol=1e-5, atol=1e-5)


def test_rolling_cut_reuses_its_caches(model):
    cfg = SamplerConfig(steps=(1000, 500), frames_per_block=1, window_frames=4, sink_frames=1)
    st = rolling.RollingState(model, LAT_H, LAT_W, cfg)
    ptrs = [t.data_ptr() for c in (st.store.kv, st.scratch.kv) for t in (*c.k, *c.v)]
    st.finished, st.entered = 3, 5
    st.new_shot()
    assert (st.finished, st.entered, st.flight, st.store.kv.frames, st.store.next_frame) == (0, 0, [], 0, 0)
    assert [t.data_ptr() for c in (st.store.kv, st.scratch.kv) for t in (*c.k, *c.v)] == ptrs


# ----------------------------------------------------------------------------- no host sync in a block


class HostTraffic(TorchDispatchMode):
    """Records every op that reads a value back to the host, or builds a tensor from host data, or
    touches a CPU tensor while the model runs elsewhere. On the `meta` device (no data at all) a
    read would fail outright; this names the op instead."""

    READS = ("aten._local_scalar_dense", "aten.item", "aten.lift_fresh", "aten.lift_fresh_copy")

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device, self.seen = device, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket if hasattr(func, "overloadpacket") else func)
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if any(name.startswith(r) for r in self.READS) or any(
            t.device.type != self.device and t.dim() > 0 for t in tensors
        ):
            self.seen.append(name)
        out = func(*args, **(kwargs or {}))
        if any(
            t.device.type != self.device for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
        ):
            self.seen.append(f"{name} -> host")
        return out


def test_a_block_never_reads_back_from_the_device():
    """The sampler's whole block (its steps, the commit pass, an eviction, and two sessions
    batched) and a rolling window step, on the meta device: no op reads a value to the host,
    builds a tensor from host data or touches a CPU tensor. The one copy out is the engine's
    (`to_host`), after the block."""
    torch.manual_seed(0)
    with torch.device("meta"):
        m = WanDiT(CFG).eval()
    dev = torch.device("meta")
    a, b = m.new_state(LAT_H, LAT_W, 5, 1), m.new_state(LAT_H, LAT_W, 5, 1)
    for st in (a, b):
        m.set_prompt(st, torch.empty(1, CFG.text_len, CFG.text_dim, device=dev))
    x = torch.empty(1, CFG.in_channels, 3, LAT_H, LAT_W, device=dev)
    denoise_block(m, a, x, TS, [x], sigmas=[1.0, 0.5])  # the first forward builds the RoPE tables (once)
    denoise_block(m, b, x, TS, [x], sigmas=[1.0, 0.5])
    cfg = SamplerConfig(steps=(1000, 500), frames_per_block=1, window_frames=4, sink_frames=1)
    r = rolling.RollingState(m, LAT_H, LAT_W, cfg)
    r.store.cross = a.cross
    sched = rolling.Schedule.of(cfg)
    one = torch.empty(1, CFG.in_channels, 1, LAT_H, LAT_W, device=dev)
    for _ in range(3):
        rolling.next_block(m, r, sched, None, lambda i: one, lambda s: torch.empty(s, device=dev))
    with HostTraffic("meta") as host:
        denoise_block(m, a, x, TS, [x], sigmas=[1.0, 0.5])  # evicts: 3 held + 3 new > 5
        denoise_sessions(m, [a, b], torch.cat([x, x]), [TS, TS], [torch.cat([x, x])], sigmas=[[1.0, 0.5]] * 2)
        rolling.next_block(m, r, sched, None, lambda i: one, lambda s: torch.empty(s, device=dev))
    assert a.next_frame > a.kv.window  # evictions happened inside the recorded blocks
    assert host.seen == []


def test_the_engine_block_builds_nothing_from_host_data():
    """On the CPU every tensor is a host tensor, but a read (`.item()`, `.tolist()` of a tensor)
    or a tensor made from a Python list still shows as an op: none in the engine's block."""
    eng = DiTEngine(ModelSpec(preset="tiny-random", dtype="float32", compile="off"))
    sess = eng.open_session(256, 144, seed=0)
    eng.set_scene(sess, "a shot", new_shot=True)
    eng.generate_block(sess, 3)
    with HostTraffic("cpu") as host:
        for _ in range(5):  # past the window: evictions
            eng.generate_block(sess, 3)
    assert host.seen == []


# ----------------------------------------------------------------------------- compiled


def test_an_eager_worker_never_imports_dynamo():
    """Without --compile, a DiT and a VAE stage start, calibrate and report what compiled (nothing)
    without importing torch._dynamo (1.5 s of a worker's start on this CPU): in a fresh process,
    as a worker is. A checkpoint's DiT is first built on meta tensors (presets.build_dit), where
    an out-of-place op runs torch's Python reference, which imports dynamo: built so here too."""
    code = (
        "import sys, torch\n"
        "from streamdiff.models.presets import get_preset\n"
        "from streamdiff.models.wan.dit import WanDiT\n"
        "from streamdiff.models.compiled import compile_stats\n"
        "from streamdiff.models.engines import DiTEngine, VAEEngine\n"
        "from streamdiff.models.spec import ModelSpec\n"
        "spec = ModelSpec(preset='tiny-random', compile='auto')\n"
        "with torch.device('meta'):\n"
        "    WanDiT(get_preset(spec).dit)\n"
        "dit, vae = DiTEngine(spec), VAEEngine(spec)\n"
        "s = dit.open_session(128, 64, seed=1)\n"
        "dit.set_scene(s, 'a red ball', new_shot=True)\n"
        "z = dit.generate_block(s, 3)\n"
        "assert compile_stats() == {'graphs': 0, 'compile_s': 0.0}\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_compiled_vae_equals_eager_and_does_not_recompile_through_cuts():
    """The VAE's norms compiled (`--compile on`): a stream of 8 blocks of 3 latent frames with two
    cuts decodes every block within 1e-5 of eager (float32, the worker's chunked plan), and after
    the first shot's first two blocks (its two phases: the first block, a steady one) no graph is
    compiled again. Sessions batched in one call compile once more for the batch (dynamo
    specialises a size of 1), then no more."""
    torch.manual_seed(0)
    eager = VAEEngine(ModelSpec(preset="tiny-random", dtype="float32", compile="off"))
    comp = VAEEngine(ModelSpec(preset="tiny-random", dtype="float32", compile="on"))
    comp.model.load_state_dict(eager.model.state_dict())
    assert comp.compiler.active and not eager.compiler.on
    g = torch.Generator().manual_seed(1)
    graphs = None
    for i in range(8):
        if i in (0, 3, 6):  # a cut: a fresh temporal cache, as the VAE stage opens one
            states = [e.open_session() for e in (eager, comp)]
        z = torch.randn(1, 16, 3, 9, 16, generator=g)
        plan = eager.plan(tuple(z.shape[1:]))  # the worker's plan: a few latent frames per call
        outs = [e.model.decode_rows(z, s, plan) for e, s in zip((eager, comp), states, strict=True)]
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
        if i == 1:
            graphs = compile_stats()["graphs"]
            assert graphs > 0
    assert compile_stats()["graphs"] == graphs
    pairs = [[e.open_session(), e.open_session()] for e in (eager, comp)]
    for n in range(2):
        zz = torch.randn(2, 16, 3, 9, 16, generator=g)
        ref, got = (e.model.decode_sessions(zz, p) for e, p in zip((eager, comp), pairs, strict=True))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        if n == 0:
            graphs = compile_stats()["graphs"]
    assert compile_stats()["graphs"] == graphs


# ----------------------------------------------------------------------------- capacity


# (sampler settings, scenes: (prompt, cut, blocks)); each shot shorter than the window
SHOTS = {
    "window": ({}, [("a red ball", True, 2), ("a blue cube", True, 3)]),
    "sinks-recache": (  # LongLive's way: sinks, and a re-cache at the continuing scene
        {"recache": "every_switch", "window_frames": 12, "sink_frames": 3, "global_sink": True},
        [("a red ball", True, 2), ("a blue cube", True, 2), ("a blue cube rolling left", False, 1)],
    ),
    "krea": ("krea", [("a red ball", True, 1), ("a blue cube", True, 1)]),  # the per-block recompute
}


@pytest.mark.parametrize("kind", list(SHOTS))
def test_a_cache_sized_to_the_longest_shot_equals_a_full_window(kind):
    """A fixed-length session's KV cache holds its longest shot when that is shorter than the
    window (`DiTEngine.cache_frames`): a storyboard of shots with a cut (and a continuing scene
    that re-caches under another prompt, where the sampler does) generates exactly what a session
    with the full window generates, in a smaller buffer."""
    from streamdiff.models.catalog import checkpoint_preset

    settings, scenes = SHOTS[kind]
    if settings == "krea":
        settings = checkpoint_preset("krea-realtime-14b").sampler_settings()
    engines = []
    for _ in range(2):
        torch.manual_seed(0)
        engines.append(DiTEngine(ModelSpec(preset="tiny-random", dtype="float32", compile="off", sampler=settings)))
    fpb, s = engines[0].frames_per_block, engines[0].preset.sampler
    shots, n = [], 0
    for _, cut, blocks in scenes:
        if cut and n:
            shots.append(n)
            n = 0
        n += blocks
    longest = max([*shots, n]) * fpb
    small = engines[1].cache_frames(longest)
    assert small == max(longest, s.sink_frames + fpb) and small < s.window_frames
    full = engines[0].open_session(128, 64, seed=3)
    fitted = engines[1].open_session(128, 64, seed=3, frames=longest)
    assert fitted.state.kv.k[0].shape[2] * s.window_frames == small * full.state.kv.k[0].shape[2]
    for prompt, cut, blocks in scenes:
        for e, sess in zip(engines, (full, fitted), strict=True):
            e.set_scene(sess, prompt, new_shot=cut, shot_left=blocks if cut else 0)
        for _ in range(blocks):
            a, b = (e.generate_block(sess, fpb) for e, sess in zip(engines, (full, fitted), strict=True))
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def served_mix(e: DiTEngine, w: int, h: int) -> list[torch.Tensor]:
    """Batches of 1 to 4, an image block, a prompt switch (a re-cache), a cut: every latent."""
    sessions = [e.open_session(w, h, seed=i) for i in range(4)]
    for s in sessions:
        e.set_scene(s, "a red ball", new_shot=True)
    outs = [e.start_image(sessions[0], torch.zeros(h, w, 3, dtype=torch.uint8))]
    for n in (1, 2, 3, 4):
        outs += e.generate_blocks(sessions[:n], 3)
    e.set_scene(sessions[1], "a blue ball", new_shot=False)  # every_switch: the switch re-caches
    e.set_scene(sessions[2], "a new shot", new_shot=True, seed=7, shot_left=3)
    return outs + e.generate_blocks(sessions, 3)


def test_after_the_warm_up_a_served_mix_compiles_nothing_and_equals_eager(monkeypatch):
    """What a worker warms before READY (`DiTEngine.warm`, compile forced on) covers what it then
    serves: batches of 1 to 4, another frame size, an image-to-video block, a LongLive-style
    re-cache at every prompt switch and a storyboard's cut compile no graph more (dynamo's
    counters), every call ran compiled, and every block equals eager within 1e-5 (float32).
    Dynamo's guards and AOT autograd's symbolic shapes decide what recompiles, so the backend is
    aot_eager: inductor's cold C++ build of these graphs costs a minute of the CPU, and its CPU
    kernels are checked on the VAE's norms below; the DiT's on a GPU by tools/device/check.py."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    spec = dict(preset="tiny-random", dtype="float32", sampler={"recache": "every_switch"})
    eager, eng = DiTEngine(ModelSpec(**spec, compile="off")), DiTEngine(ModelSpec(**spec, compile="on"))
    assert eng.card.i2v and eng.compiler.active and not eager.compiler.on
    before = compile_stats()["graphs"]  # the process's count: other tests here may have compiled
    eng.warm([eng.open_session(256, 144, seed=i) for i in range(2)])
    graphs = compile_stats()["graphs"]
    # Each half, one graph for every layer: a block of one frame and of three at a batch of one,
    # and a batch (dynamo specialises a size of 1; docs/design.md, "Compile").
    assert graphs - before == 2 * 3
    for w, h in ((256, 144), (128, 64)):
        for a, b in zip(served_mix(eager, w, h), served_mix(eng, w, h), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert compile_stats()["graphs"] == graphs
    assert eng.compiler.active and eng.compiler.fallback is None
