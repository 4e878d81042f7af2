"""LongLive 2.0's multi-shot transition (`DiTEngine.set_scene(transition=True)`, the sampler's
`shot_offset`, `KVCache.pin`) against a transcription of the authors' loop.

Transcribed from NVlabs/LongLive@7860ad9 (../shared/notes/wan22.md, "Multi-shot"):
- pipeline/causal_diffusion_inference.py: per chunk, the cross-attention cache is reset and the
  chunk's own prompt used (its dataset gives a new shot's first chunk the caption after "The
  scene transitions. ", the chunks after it the caption alone, utils/dataset.py l.262); a chunk
  whose prompt starts with that prefix is a shot boundary: the RoPE temporal offset becomes
  shot_index x multi_shot_rope_offset (l.545-551); a fresh UniPC solver per chunk, then the clean
  pass at t = 0; after it a boundary chunk is pinned (`_pin_current_chunk`, l.1017-1033).
- wan_5b/modules/causal_model.py (CausalWanSelfAttention, the KV-cache branch, l.458-760, and
  `_apply_cache_updates`, l.1371-1483): a buffer of `local_attn_size` frames per layer with
  global and local end indices; a chunk past its end rolls the tokens after the effective sink
  left over the evicted ones; the effective sink is the global sink (the first sink_size
  frames, multi_shot_sink), grown by the pinned chunk once that abuts it; a pinned chunk that
  floats further on follows the roll. The attention reads the buffer up to the local end (the
  window equals the buffer, so the authors' prepend cases never arise: asserted).
The test's DiT is the project's (its attention calls the transcribed cache through the same
interface as `KVCache`); the solver is diffusers' UniPC as the authors configure theirs.
"""

from __future__ import annotations

import pytest
import torch

from streamdiff.models.engines import DiTEngine
from streamdiff.models.spec import ModelSpec
from streamdiff.models.wan.kv_cache import DiTState
from streamdiff.models.wan.sampler import SHOT_PREFIX

from .test_unipc import UNIPC, diffusers_unipc

F, WINDOW, SINK, OFFSET = 2, 8, 2, 8  # LongLive 2.0's 8 / 32 / 8 / 8, at a quarter of the frames
SAMPLER = {**UNIPC, "frames_per_block": F, "window_frames": WINDOW, "sink_frames": SINK, "recache": "never",
           "shot_offset": OFFSET}  # fmt: skip


class LongLiveKV:
    """The authors' per-layer KV cache (token indices), for one session: `write` is the attention's
    cache branch and `_apply_cache_updates` for one layer; `pin` is `_pin_current_chunk`. The
    loop sets `current_start` (tokens: the chunk's absolute first frame) before each forward."""

    def __init__(self, layers, heads, head_dim, tpf, window, sink):
        self.tpf, self.frames, self.current_start = tpf, 0, 0
        shape = (1, heads, window * tpf, head_dim)
        self.k = [torch.zeros(shape) for _ in range(layers)]
        self.v = [torch.zeros(shape) for _ in range(layers)]
        self.sink_tokens = self.global_sink_tokens = sink * tpf  # multi_shot_sink: global = sink_size
        self.max_attention = window * tpf
        self.global_end, self.local_end = [0] * layers, [0] * layers
        self.pinned_start, self.pinned_len = [-1] * layers, [0] * layers

    def buffers(self, prope=False):
        return self.k, self.v

    def make_room(self, frames):  # the authors roll inside the attention (`write`)
        pass

    def keep_latents(self, x, first_position):
        pass

    def write(self, layer, k, v, prope=False):
        n_new = k.shape[2]
        current_end = self.current_start + n_new
        ps, pl = self.pinned_start[layer], self.pinned_len[layer]
        has_pinned = ps >= 0 and pl > 0
        if has_pinned and ps == self.global_sink_tokens:
            eff = self.global_sink_tokens + pl
        elif has_pinned:
            eff = self.global_sink_tokens
        else:
            eff = max(self.global_sink_tokens, self.sink_tokens)
        ge, le = self.global_end[layer], self.local_end[layer]
        ck, cv = self.k[layer], self.v[layer]
        size = ck.shape[2]
        if current_end > ge and n_new + le > size:  # roll_and_insert
            ev = n_new + le - size
            rolled = le - ev - eff
            local_end = le + current_end - ge - ev
            ck[:, :, eff : eff + rolled] = ck[:, :, eff + ev : eff + ev + rolled].clone()
            cv[:, :, eff : eff + rolled] = cv[:, :, eff + ev : eff + ev + rolled].clone()
            if has_pinned and ps >= eff:  # a floating pinned chunk follows the roll
                self.pinned_start[layer] -= ev
        else:  # direct_insert
            local_end = le + current_end - ge
        ck[:, :, local_end - n_new : local_end] = k
        cv[:, :, local_end - n_new : local_end] = v
        self.global_end[layer], self.local_end[layer] = current_end, local_end
        assert max(0, local_end - self.max_attention) == 0  # the window is the buffer: no prepend
        return local_end

    def pin(self, chunk_frames):
        chunk_tokens = chunk_frames * self.tpf
        for layer in range(len(self.k)):
            self.pinned_start[layer] = self.local_end[layer] - chunk_tokens
            self.pinned_len[layer] = min(self.sink_tokens, chunk_tokens)


def authors_loop(eng, prompts, seed, w, h):
    """LongLive 2.0's `_inference_inner` over one prompt per chunk, on the project's DiT; returns
    each chunk's latents and the cache."""
    model, cfg = eng.model, eng.model.cfg
    lh, lw = eng.latent_size(w, h)
    tpf = cfg.tokens_per_frame(lh, lw)
    kv = LongLiveKV(cfg.num_layers, cfg.num_heads, cfg.head_dim, tpf, WINDOW, SINK)
    state, gen = DiTState(kv), torch.Generator().manual_seed(seed)
    shot_index, out = 0, []
    for chunk, prompt in enumerate(prompts):
        model.set_prompt(state, eng.encode_prompt(prompt))  # the chunk's own prompt
        boundary = chunk > 0 and prompt.startswith(SHOT_PREFIX)
        if boundary:
            shot_index += 1
        first = chunk * F

        def forward(x, t, commit, start=first * tpf, rope_start=first + shot_index * OFFSET):
            # the chunk's tokens from its absolute start; RoPE at its frame + the shot's offset
            kv.current_start, state.next_frame = start, rope_start
            return model.forward_block(x, torch.full((1, F), t), state, commit)

        noise = torch.randn((1, F, cfg.out_channels, lh, lw), generator=gen).permute(0, 2, 1, 3, 4)
        sched, x = diffusers_unipc(4, 5.0), noise
        for i, t in enumerate(sched.timesteps):
            x = sched.step(forward(x, 1000 * float(sched.sigmas[i]), False), t, x).prev_sample
        forward(x, 0.0, True)
        if boundary:
            kv.pin(F)
        out.append(x)
    return out, kv


def ours(eng, prompts, seed, w, h, batch_with=None):
    """Our engine over the same scenes: a cut (transition) where a prompt carries the prefix, the
    same prompt continuing otherwise. Returns each block and the session."""
    sess = eng.open_session(w, h, seed=seed)
    other = eng.open_session(w, h, seed=seed + 100) if batch_with else None
    if other is not None:
        eng.set_scene(other, batch_with, new_shot=True)
    out = []
    for chunk, prompt in enumerate(prompts):
        if chunk == 0:
            eng.set_scene(sess, prompt, new_shot=True)
        elif prompt.startswith(SHOT_PREFIX):
            eng.set_scene(sess, prompt.removeprefix(SHOT_PREFIX), new_shot=False, transition=True)
        if other is None:
            out.append(eng.generate_block(sess, F))
        else:
            out.append(eng.generate_blocks([sess, other], F)[0])
    return out, sess


PROMPTS = ["a red fox"] * 2 + [SHOT_PREFIX + "a city street"] + ["a city street"] * 3
PROMPTS += [SHOT_PREFIX + "a blue whale"] + ["a blue whale"] * 2


@pytest.fixture(scope="module")
def engine():
    return DiTEngine(ModelSpec(preset="tiny-random", sampler=SAMPLER))


def test_two_shots_equal_the_authors_loop_block_by_block(engine):
    """Nine blocks, two transitions (blocks 2 and 6): every block equals the authors' loop, and
    so does what the cache holds: the global sink, the pinned shot sink (floating at first,
    then abutting the global sink and kept past the oldest frames, then given up at the next
    transition and evicted), at the offset positions."""
    w, h = 128, 64
    want, ref_kv = authors_loop(engine, PROMPTS, 5, w, h)
    got, sess = ours(engine, PROMPTS, 5, w, h)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, i=i: f"block {i}: {m}")
    kv, tpf = sess.state.kv, ref_kv.tpf
    # the same frames held: keys and values, in the authors' buffer order
    for layer in range(engine.model.cfg.num_layers):
        mine = torch.cat([k for k, _ in kv.read(layer, 0, kv.frames)], dim=2)
        torch.testing.assert_close(mine, ref_kv.k[layer][:, :, : kv.frames * tpf], rtol=1e-4, atol=1e-4)
    # blocks: 0 (global sink), 6 (pinned: the second shot's first block), then 7 and 8; the
    # first shot sink (block 2) went at block 7
    assert kv.positions == [0, 1, 12, 13, 14, 15, 16, 17]
    assert kv.pinned == (2, 2) and ref_kv.pinned_start[0] == SINK * tpf
    assert sess.state.rope_offset == 2 * OFFSET and sess.prompt == "a blue whale"


def test_the_shot_sink_outlives_older_frames(engine):
    """After the first transition (block 2) and two more blocks, the cache holds the global sink,
    the pinned block 2 and the newest: block 3, the oldest unpinned, went first."""
    w, h = 128, 64
    _, sess = ours(engine, PROMPTS[:6], 5, w, h)
    assert sess.state.kv.positions == [0, 1, 4, 5, 8, 9, 10, 11]  # blocks 0, 2, 4, 5
    assert sess.state.kv.pinned == (2, 2)
    _, ref_kv = authors_loop(engine, PROMPTS[:6], 5, w, h)
    assert ref_kv.pinned_start[0] == SINK * ref_kv.tpf  # abutting the global sink: protected


def test_a_transition_batched_with_another_session_equals_it_alone(engine):
    alone, _ = ours(engine, PROMPTS, 7, 128, 64)
    batched, _ = ours(engine, PROMPTS, 7, 128, 64, batch_with="a green field")
    for a, b in zip(alone, batched, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_transition_is_refused_where_it_does_not_belong(engine):
    sess = engine.open_session(128, 64, seed=1)
    engine.set_scene(sess, "a red fox", new_shot=True)
    with pytest.raises(ValueError, match="it is no cut"):
        engine.set_scene(sess, "a city", new_shot=True, transition=True)
    plain = DiTEngine(ModelSpec(preset="tiny-random", sampler=UNIPC))
    s2 = plain.open_session(128, 64, seed=1)
    plain.set_scene(s2, "a red fox", new_shot=True)
    with pytest.raises(ValueError, match="shot_offset"):
        plain.set_scene(s2, "a city", new_shot=False, transition=True)
    from streamdiff.models.wan.sampler import SamplerConfig

    for bad in ({"kind": "rolling"}, {"sink_frames": 0}, {"recache": "on_request"}):
        with pytest.raises(ValueError, match="shot_offset needs"):
            SamplerConfig(**{**SAMPLER, "steps": tuple(SAMPLER["steps"]), **bad}).validate()
