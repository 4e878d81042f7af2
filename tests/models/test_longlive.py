"""LongLive's re-cache on a prompt switch (`_recache_after_switch`), as its code runs it.

The reference written here from LongLive's code: on a switch at frame t, the last
n = min(window, t) clean frames pass once under the new prompt at t = 0 and their own positions,
attending to each other (LongLive's attention with a KV cache never reads its block mask) and to
what the cache keeps before them: the sinks' old keys/values under `global_sink` once the
recompute starts past frame 0, nothing otherwise. Its cache then holds the kept sinks followed by
the recomputed frames. The reference builds that cache in a fresh state through the model's plain
block forward; the test compares it with `WanDiT.recache` on a session that ran blocks first.
"""

from __future__ import annotations

import pytest
import torch

from streamdiff.models.engines import DiTEngine
from streamdiff.models.presets import ModelSpec
from streamdiff.models.wan.dit import DiTConfig, WanDiT
from streamdiff.models.wan.sampler import denoise_block

CFG = DiTConfig(dim=32, ffn_dim=64, num_heads=2, num_layers=2, text_dim=16, text_len=8)
LAT_H, LAT_W, F = 4, 6, 2  # latent size, frames per block
TS = [1000.0, 500.0]


@pytest.fixture(scope="module")
def model() -> WanDiT:
    torch.manual_seed(0)
    return WanDiT(CFG).eval()


def run(model, window, sink, blocks, seed=1):
    """A session that ran `blocks` blocks under prompt A; returns it, both prompts and every
    block's clean latents (the history, whatever the window kept)."""
    g = torch.Generator().manual_seed(seed)
    a, b = (torch.randn(1, CFG.text_len, CFG.text_dim, generator=g) for _ in range(2))
    st = model.new_state(LAT_H, LAT_W, window, sink)
    model.set_prompt(st, a)
    history = []
    for _ in range(blocks):
        noise = torch.randn(1, CFG.in_channels, F, LAT_H, LAT_W, generator=g)
        renoise = [torch.randn(noise.shape, generator=g)]
        history.append(denoise_block(model, st, noise, TS, renoise))
    return st, a, b, torch.cat(history, dim=2)


def reference(model, history, b, window, sink, kept=None):
    """LongLive's cache after the switch: a fresh cache holding `kept` (the sinks' old keys and
    values, or nothing), then one forward of the last min(window, t) frames (those behind kept
    sinks stored none) under prompt b at t = 0 from their own first position."""
    t = history.shape[2]
    ref = model.new_state(LAT_H, LAT_W, window, sink)
    model.set_prompt(ref, b)
    first = t - min(window, t)
    if kept is not None:
        tpf = ref.kv.tpf
        for layer in range(CFG.num_layers):
            ref.kv.k[layer][:, :, : sink * tpf] = kept[0][layer]
            ref.kv.v[layer][:, :, : sink * tpf] = kept[1][layer]
        ref.kv.frames, ref.kv.positions = sink, list(range(sink))
        first = t - (window - sink)
    ref.next_frame = first
    model.forward_block(history[:, :, first:], torch.zeros(1, t - first), ref, commit=True)
    return ref


def max_diff(x, y, frames, tpf):
    return max((k1[:, :, : frames * tpf] - k0[:, :, : frames * tpf]).abs().max().item() for k0, k1 in zip(x, y))


def test_global_sink_keeps_the_sinks_and_recomputes_the_rest(model):
    window, sink = 6, 2
    st, _, b, history = run(model, window, sink, blocks=5)  # t = 10 > window: 4 frames evicted
    tpf = st.kv.tpf
    assert st.kv.frames == window and st.kv.positions == [0, 1, 6, 7, 8, 9]
    sinks = ([k[:, :, : sink * tpf].clone() for k in st.kv.k], [v[:, :, : sink * tpf].clone() for v in st.kv.v])
    before = [k.clone() for k in st.kv.k]
    model.recache(st, b, global_sink=True)
    for layer in range(CFG.num_layers):  # the sinks bit for bit as written
        assert torch.equal(st.kv.k[layer][:, :, : sink * tpf], sinks[0][layer])
        assert torch.equal(st.kv.v[layer][:, :, : sink * tpf], sinks[1][layer])
    assert st.kv.frames == window and st.kv.positions == [0, 1, 6, 7, 8, 9] and st.next_frame == 10
    changed = [(k1 - k0)[:, :, sink * tpf : window * tpf].abs().max().item() for k0, k1 in zip(before, st.kv.k)]
    assert changed[-1] > 1e-3  # recomputed under b (layer 0's keys come before any prompt)
    ref = reference(model, history, b, window, sink, kept=sinks)
    assert max_diff(ref.kv.k, st.kv.k, window, tpf) <= 1e-5
    assert max_diff(ref.kv.v, st.kv.v, window, tpf) <= 1e-5


def test_without_global_sink_the_last_window_frames_become_the_cache(model):
    """No global sink: the cache is emptied and the last `window` frames recomputed, reaching
    back past the held frames to the last evicted ones; the first `sink` of them are the new sinks."""
    window, sink = 6, 2
    st, _, b, history = run(model, window, sink, blocks=5)
    model.recache(st, b, global_sink=False)
    assert st.kv.frames == window and st.kv.positions == [4, 5, 6, 7, 8, 9] and st.next_frame == 10
    assert torch.equal(st.kv.latents[:, :, :window], history[:, :, 4:])
    ref = reference(model, history, b, window, sink)
    assert max_diff(ref.kv.k, st.kv.k, window, st.kv.tpf) <= 1e-5
    assert max_diff(ref.kv.v, st.kv.v, window, st.kv.tpf) <= 1e-5
    # the next block evicts past the new sinks: positions 4, 5 stay
    g = torch.Generator().manual_seed(9)
    noise = torch.randn(1, CFG.in_channels, F, LAT_H, LAT_W, generator=g)
    denoise_block(model, st, noise, TS, [torch.randn(noise.shape, generator=g)])
    assert st.kv.positions == [4, 5, 8, 9, 10, 11]


@pytest.mark.parametrize("global_sink", [True, False])
def test_before_the_window_fills_every_frame_is_recomputed(model, global_sink):
    """t <= window: the recompute starts at frame 0, and LongLive protects the sinks only when
    it does not, so the sinks are recomputed whatever global_sink says."""
    window, sink = 6, 2
    st, _, b, history = run(model, window, sink, blocks=2)  # t = 4
    model.recache(st, b, global_sink=global_sink)
    assert st.kv.frames == 4 and st.kv.positions == [0, 1, 2, 3]
    ref = reference(model, history, b, window, sink)
    assert max_diff(ref.kv.k, st.kv.k, 4, st.kv.tpf) <= 1e-5
    assert max_diff(ref.kv.v, st.kv.v, 4, st.kv.tpf) <= 1e-5


def test_recache_is_one_bidirectional_forward_not_block_causal(model):
    """The first frames' keys after a re-cache depend on the later frames (they attend to them),
    which a block-by-block recompute would not give."""
    window, sink = 6, 0
    st, a, _, history = run(model, window, sink, blocks=2)
    k_before = [k.clone() for k in st.kv.k]
    model.recache(st, a)  # the same prompt: only the attention pattern can change the keys
    tpf = st.kv.tpf
    # layer 0's keys come before any attention, the next layer's after it
    assert torch.allclose(st.kv.k[0][:, :, : F * tpf], k_before[0][:, :, : F * tpf], atol=1e-5)
    assert (st.kv.k[1][:, :, : F * tpf] - k_before[1][:, :, : F * tpf]).abs().max().item() > 1e-4


def engine(policy: str) -> DiTEngine:
    return DiTEngine(ModelSpec(sampler={"recache": policy, "window_frames": 9, "sink_frames": 3, "global_sink": True}))


def test_every_switch_recaches_a_continue_scene_unasked():
    """Preset longlive's policy (every_switch): a `continue` scene re-caches without `recache`;
    it equals an on_request engine asked to, and differs from one not asked."""
    every, asked = engine("every_switch"), engine("on_request")

    def go(eng, ask):
        sess = eng.open_session(64, 48, 7)
        eng.set_scene(sess, "a red fox", new_shot=True)
        for _ in range(4):
            eng.generate_block(sess, eng.frames_per_block)
        eng.set_scene(sess, "a blue whale", new_shot=False, recache=ask)
        return eng.generate_block(sess, eng.frames_per_block)

    got = go(every, False)
    assert torch.equal(got, go(asked, True))
    assert (got - go(asked, False)).abs().max().item() > 1e-4


def test_never_refuses_a_scene_that_asks():
    eng = engine("never")
    sess = eng.open_session(64, 48, 7)
    eng.set_scene(sess, "a red fox", new_shot=True)
    eng.generate_block(sess, eng.frames_per_block)
    with pytest.raises(ValueError, match="recache is 'never'"):
        eng.set_scene(sess, "a blue whale", new_shot=False, recache=True)


@pytest.mark.parametrize("policy,refused", [("never", True), ("on_request", False), ("every_switch", False)])
def test_the_api_refuses_recache_only_on_a_never_server(policy, refused):
    from streamdiff.config.loader import load
    from streamdiff.server.api import APIError, parse_steer
    from streamdiff.supervisor.topology import model_card

    cfg = load(None, {"sampler": {"recache": policy}})
    steer = {"prompt": "a blue whale", "transition": "continue", "recache": True}
    if refused:
        with pytest.raises(APIError, match="sampler.recache = 'never'") as err:
            parse_steer(steer, cfg, model_card(cfg))
        assert err.value.status == 400
    else:
        assert parse_steer(steer, cfg, model_card(cfg)).recache


def test_longlive2s_cut_is_a_shot_transition_over_the_kept_history():
    """On longlive2-5b a cut after the first scene, in a request or a steer, keeps the history
    (LongLive 2.0's multi-shot): planned as a continuing scene, the VAE going on, and flagged for
    the DiT. On another model a cut starts afresh."""
    from streamdiff.config import Config, ModelConfig
    from streamdiff.plan import plan_blocks
    from streamdiff.server.api import parse_steer, parse_video_request
    from streamdiff.supervisor.topology import model_card

    cfg = Config(model=ModelConfig(preset="longlive2-5b"))
    card, plain = model_card(cfg), model_card(Config())
    steer = parse_steer({"prompt": "a blue whale", "transition": "cut"}, cfg, card)
    assert steer.transition == "cut" and steer.keeps_history
    assert not parse_steer({"prompt": "a blue whale"}, cfg, card).keeps_history
    assert not parse_steer({"prompt": "a blue whale", "transition": "cut"}, Config(), plain).keeps_history
    scenes = [{"prompt": "a fox", "num_frames": 29}, {"prompt": "a city", "num_frames": 18, "transition": "cut"}]
    for c, kept in ((cfg, True), (Config(), False)):
        req = parse_video_request({"scenes": scenes, "size": "256x160"}, c, model_card(c))
        assert [sc.keeps_history for sc in req.scenes] == [False, kept]
        blocks = plan_blocks(req.scenes, 8, 4)
        assert [b.shot_start for b in blocks] == [True, False] if kept else [True, True]
        assert blocks[1].frames_out == (32 if kept else 29)  # 4 frames a latent frame, or a new shot's 1 + 4 x 7
