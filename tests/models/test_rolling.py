"""Rolling Forcing's sampler against a plain transcription of the authors' loop.

`Authors` below transcribes TencentARC/RollingForcing `pipeline/rolling_forcing_inference.py`
(`inference_rolling_forcing`: the window schedule, the noisy cache, the re-noising draws, the
clean pass on the window's first block every step) and the KV path of
`wan/modules/causal_model.py` (`CausalWanSelfAttention.forward` with a cache: which slot each
forward writes, the anchor stored without RoPE and re-positioned per forward, the working cache,
eviction with the first block kept, the clean pass' own 21-frame window), on our model's weights
and layer pieces (projections, norms, cross-attention, FFN, head). Their frame size is
hard-coded (1560 tokens, a 24-frame cache, a 21-frame attention cap, 3-frame blocks); the
transcription writes those in frames of this test's size. Their scheduler (FlowMatchScheduler,
shift 5, `extra_one_step`) and warp are transcribed too, in float64: their float32 table rounds
the warped steps by up to 1e-4 (952.38104 for 952.38095), which alone moves the outputs by 3e-5;
the comparison is of the loop. The noise is theirs in order and shape: the whole video's noise
up front, then `randn_like` of the whole window per re-noised block.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from streamdiff.models.wan import rolling
from streamdiff.models.wan.dit import DiTConfig, WanDiT, sinusoidal_embedding
from streamdiff.models.wan.sampler import SamplerConfig

from .conftest import perturb_

CFG = DiTConfig(dim=48, ffn_dim=64, num_heads=2, num_layers=2, text_dim=32, text_len=12)
LAT_H, LAT_W = 4, 6
TPF = (LAT_H // 2) * (LAT_W // 2)  # tokens per latent frame (their 1560)
STEPS = (1000, 800, 600, 400, 200)
SAMPLER = SamplerConfig(frames_per_block=3, steps=STEPS, shift=5.0, window_frames=21, sink_frames=3, kind="rolling")
C = CFG.in_channels


def make_model() -> WanDiT:
    torch.manual_seed(0)
    model = WanDiT(CFG).eval()
    perturb_(model, 0.1, 3)
    return model


def prompt_kv(model: WanDiT, seed: int) -> list:
    ctx = torch.randn(1, CFG.text_len, CFG.text_dim, generator=torch.Generator().manual_seed(seed))
    st = model.new_state(LAT_H, LAT_W, 4)
    model.set_prompt(st, ctx)
    return st.cross


# ----------------------------------------------------------------------------- the authors' code


class Scheduler:
    """FlowMatchScheduler(shift=5, sigma_min=0, extra_one_step=True).set_timesteps(1000)."""

    def __init__(self, shift: float) -> None:
        sigmas = torch.linspace(1.0, 0.0, 1001, dtype=torch.float64)[:-1]
        self.sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
        self.timesteps = self.sigmas * 1000

    def sigma(self, t: torch.Tensor) -> torch.Tensor:
        return self.sigmas[torch.argmin((self.timesteps.unsqueeze(0) - t.unsqueeze(1)).abs(), dim=1)]

    def add_noise(self, x0, noise, t):
        s = self.sigma(t).reshape(-1, 1, 1, 1)
        return ((1 - s) * x0 + s * noise).type_as(noise)  # float64 sigma: as ours, rounded once


def rope_freqs(cfg: DiTConfig) -> torch.Tensor:
    def params(n, dim, theta=10000):
        f = torch.outer(torch.arange(n), 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float64).div(dim)))
        return torch.polar(torch.ones_like(f), f)

    d = cfg.head_dim
    return torch.cat([params(1024, d - 4 * (d // 6)), params(1024, 2 * (d // 6)), params(1024, 2 * (d // 6))], dim=1)


def causal_rope_apply(x, grid, freqs, start_frame=0):
    n, c = x.size(2), x.size(3) // 2
    freqs = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    f, h, w = grid
    seq_len = f * h * w
    x_i = torch.view_as_complex(x[0, :seq_len].to(torch.float64).reshape(seq_len, n, -1, 2))
    freqs_i = torch.cat(
        [
            freqs[0][start_frame : start_frame + f].view(f, 1, 1, -1).expand(f, h, w, -1),
            freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
            freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
        ],
        dim=-1,
    ).reshape(seq_len, 1, -1)
    return torch.view_as_real(x_i * freqs_i).flatten(2).unsqueeze(0).type_as(x)


def attention(q, k, v):  # flash attention, not causal; (B, L, n, d)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


class Authors:
    frame_length = TPF
    block_length = 3 * TPF
    max_attention_size = 21 * TPF
    kv_cache_size = 24 * TPF

    def __init__(self, model: WanDiT, cross: list) -> None:
        self.model, self.cross, self.freqs = model, cross, rope_freqs(model.cfg)
        d = model.cfg
        self.kv_cache = [
            {
                "k": torch.zeros(1, self.kv_cache_size, d.num_heads, d.head_dim),
                "v": torch.zeros(1, self.kv_cache_size, d.num_heads, d.head_dim),
                "global_end_index": torch.tensor([0]),
                "local_end_index": torch.tensor([0]),
            }
            for _ in range(d.num_layers)
        ]

    def self_attn(self, blk, x, grid, kv_cache, current_start, updating_cache):
        sa = blk.self_attn
        b, s, n, d = *x.shape[:2], sa.heads, self.model.cfg.head_dim
        cache_start = current_start
        q = sa.norm_q(sa.q(x)).view(b, s, n, d)
        k = sa.norm_k(sa.k(x)).view(b, s, n, d)
        v = sa.v(x).view(b, s, n, d)
        frame_seqlen = grid[1] * grid[2]
        current_start_frame = current_start // frame_seqlen
        roped_query = causal_rope_apply(q, grid, self.freqs, start_frame=current_start_frame).type_as(v)
        roped_key = causal_rope_apply(k, grid, self.freqs, start_frame=current_start_frame).type_as(v)
        grid_one_block = (3, grid[1], grid[2])
        cache_end = cache_start + self.block_length
        num_new_tokens = cache_end - kv_cache["global_end_index"].item()
        sink_tokens = 1 * self.block_length
        if num_new_tokens > 0 and num_new_tokens + kv_cache["local_end_index"].item() > self.kv_cache_size:
            num_evicted = num_new_tokens + kv_cache["local_end_index"].item() - self.kv_cache_size
            num_rolled = kv_cache["local_end_index"].item() - num_evicted - sink_tokens
            for key in ("k", "v"):
                kv_cache[key][:, sink_tokens : sink_tokens + num_rolled] = kv_cache[key][
                    :, sink_tokens + num_evicted : sink_tokens + num_evicted + num_rolled
                ].clone()
            local_end_index = (
                kv_cache["local_end_index"].item() + cache_end - kv_cache["global_end_index"].item() - num_evicted
            )
            local_start_index = local_end_index - self.block_length
            kv_cache["k"][:, local_start_index:local_end_index] = roped_key[:, : self.block_length]
            kv_cache["v"][:, local_start_index:local_end_index] = v[:, : self.block_length]
        else:
            local_end_index = kv_cache["local_end_index"].item() + cache_end - kv_cache["global_end_index"].item()
            local_start_index = local_end_index - self.block_length
            if local_start_index == 0:  # the first block is stored without RoPE
                kv_cache["k"][:, local_start_index:local_end_index] = k[:, : self.block_length]
            else:
                kv_cache["k"][:, local_start_index:local_end_index] = roped_key[:, : self.block_length]
            kv_cache["v"][:, local_start_index:local_end_index] = v[:, : self.block_length]
        if num_new_tokens > 0:
            kv_cache["global_end_index"].fill_(cache_end)
            kv_cache["local_end_index"].fill_(local_end_index)
        if local_start_index == 0:
            x = attention(roped_query, roped_key, v)
        elif updating_cache:
            extract_end = local_end_index
            extract_start = max(0, local_end_index - self.max_attention_size)
            wk = kv_cache["k"][:, extract_start:extract_end].clone()
            wv = kv_cache["v"][:, extract_start:extract_end]
            if extract_start == 0:
                wk[:, : self.block_length] = causal_rope_apply(
                    wk[:, : self.block_length], grid_one_block, self.freqs, start_frame=0
                ).type_as(v)
            x = attention(roped_query, wk, wv)
        else:
            query_length = roped_query.shape[1]
            working_max = self.max_attention_size - query_length - self.block_length
            extract_end = local_start_index
            extract_start = max(self.block_length, local_start_index - working_max)
            wk = kv_cache["k"][:, extract_start:extract_end]
            wv = kv_cache["v"][:, extract_start:extract_end]
            working_frames = wk.shape[1] // self.frame_length
            rope_start_frame = current_start_frame - working_frames - 3
            anchor_k = causal_rope_apply(
                kv_cache["k"][:, : self.block_length], grid_one_block, self.freqs, start_frame=rope_start_frame
            ).type_as(v)
            anchor_v = kv_cache["v"][:, : self.block_length]
            x = attention(roped_query, torch.cat([anchor_k, wk, roped_key], 1), torch.cat([anchor_v, wv, v], 1))
        return sa.o(x.flatten(2))

    def forward(self, x, t, current_start, updating_cache=False):
        """WanDiffusionWrapper.forward -> (flow_pred, x0); x: (B, F, C, H, W), t: (B, F)."""
        m, cfg = self.model, self.model.cfg
        tokens = m.patch_embedding(x.permute(0, 2, 1, 3, 4))
        grid = tuple(tokens.shape[2:])
        tokens = tokens.flatten(2).transpose(1, 2)
        e = m.time_embedding(sinusoidal_embedding(t.flatten(), cfg.freq_dim).float())
        e0 = m.time_projection(e).unflatten(1, (6, cfg.dim)).unflatten(0, t.shape)
        nf, fs = e0.shape[1], tokens.shape[1] // e0.shape[1]
        for i, blk in enumerate(m.blocks):
            e6 = (blk.modulation.unsqueeze(1) + e0).chunk(6, dim=2)
            y = self.self_attn(
                blk,
                (blk.norm1(tokens).unflatten(1, (nf, fs)) * (1 + e6[1]) + e6[0]).flatten(1, 2),
                grid,
                self.kv_cache[i],
                current_start,
                updating_cache,
            )
            tokens = tokens + (y.unflatten(1, (nf, fs)) * e6[2]).flatten(1, 2)
            tokens = tokens + blk.cross_attn(blk.norm3(tokens), [self.cross[i]])
            y = blk.ffn((blk.norm2(tokens).unflatten(1, (nf, fs)) * (1 + e6[4]) + e6[3]).flatten(1, 2))
            tokens = tokens + (y.unflatten(1, (nf, fs)) * e6[5]).flatten(1, 2)
        eh = (m.head.modulation.unsqueeze(1) + e.unflatten(0, t.shape).unsqueeze(2)).chunk(2, dim=2)
        out = m.head.head(m.head.norm(tokens).unflatten(1, (nf, fs)) * (1 + eh[1]) + eh[0])
        # unpatchify
        f, h, w = grid
        pt, ph, pw = cfg.patch_size
        u = out.reshape(f, h, w, pt, ph, pw, cfg.out_channels)
        u = torch.einsum("fhwpqrc->cfphqwr", u).reshape(cfg.out_channels, f * pt, h * ph, w * pw)
        flow = u.unsqueeze(0).permute(0, 2, 1, 3, 4)
        sched = self.scheduler
        sigma = sched.sigmas.double()[
            torch.argmin((sched.timesteps.double().unsqueeze(0) - t.flatten().double().unsqueeze(1)).abs(), dim=1)
        ]
        x0 = (x.flatten(0, 1).double() - sigma.reshape(-1, 1, 1, 1) * flow.flatten(0, 1).double()).to(x.dtype)
        return flow, x0.unflatten(0, flow.shape[:2])

    def inference_rolling_forcing(self, noise: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        self.scheduler = sched = Scheduler(5.0)
        timesteps = torch.cat((sched.timesteps, torch.tensor([0], dtype=torch.float64)))
        step_list = timesteps[1000 - torch.tensor(STEPS, dtype=torch.long)]
        fpb = 3
        batch_size, num_frames = noise.shape[:2]
        num_blocks = num_frames // fpb
        output = torch.zeros_like(noise)
        n_steps = len(step_list)
        window_num = num_blocks + n_steps - 1
        starts = [max(0, w - n_steps + 1) for w in range(window_num)]
        ends = [min(num_blocks - 1, w) for w in range(window_num)]
        noisy_cache = torch.zeros_like(noise)
        shared_timestep = torch.ones([batch_size, n_steps * fpb], dtype=torch.float32)
        for index, current_timestep in enumerate(reversed(step_list)):
            shared_timestep[:, index * fpb : (index + 1) * fpb] *= current_timestep
        for w in range(window_num):
            start_block, end_block = starts[w], ends[w]
            current_start_frame = start_block * fpb
            current_end_frame = (end_block + 1) * fpb
            current_num_frames = current_end_frame - current_start_frame
            if current_num_frames == n_steps * fpb or current_start_frame == 0:
                noisy_input = torch.cat(
                    [
                        noisy_cache[:, current_start_frame : current_end_frame - fpb],
                        noise[:, current_end_frame - fpb : current_end_frame],
                    ],
                    dim=1,
                )
            else:
                noisy_input = noisy_cache[:, current_start_frame:current_end_frame]
            if current_num_frames == n_steps * fpb:
                current_timestep = shared_timestep
            elif current_start_frame == 0:
                current_timestep = shared_timestep[:, -current_num_frames:]
            elif current_end_frame == num_frames:
                current_timestep = shared_timestep[:, :current_num_frames]
            else:
                raise ValueError("not a first, full or last window")
            _, denoised_pred = self.forward(noisy_input, current_timestep, current_start_frame * self.frame_length)
            output[:, current_start_frame:current_end_frame] = denoised_pred
            for block_idx in range(start_block, end_block + 1):
                lo, hi = (block_idx - start_block) * fpb, (block_idx - start_block + 1) * fpb
                block_time_step = current_timestep[:, lo:hi].mean().item()
                idx = torch.nonzero(torch.abs(step_list - block_time_step) < 1e-4, as_tuple=True)[0]
                if idx == n_steps - 1:
                    continue
                next_timestep = step_list[idx + 1]
                eps = torch.randn(denoised_pred.flatten(0, 1).shape, generator=g)  # randn_like
                noisy_cache[:, block_idx * fpb : (block_idx + 1) * fpb] = sched.add_noise(
                    denoised_pred.flatten(0, 1),
                    eps,
                    next_timestep * torch.ones([batch_size * current_num_frames], dtype=torch.long),
                ).unflatten(0, denoised_pred.shape[:2])[:, lo:hi]
            context_timestep = torch.ones_like(current_timestep) * 0.0
            self.forward(
                denoised_pred[:, :fpb], context_timestep[:, :fpb], current_start_frame * self.frame_length, True
            )
        return output


# ----------------------------------------------------------------------------- tests


def run_ours(model, cross, noise, g, n_blocks, last=None):
    """Our sampler block by block; noise (1, F, C, h, w) as the authors' up-front draw."""
    st = rolling.RollingState(model, LAT_H, LAT_W, SAMPLER)
    st.store.cross = cross
    sched = rolling.Schedule.of(SAMPLER)

    def noise_of(i):
        return noise[:, 3 * i : 3 * i + 3].transpose(1, 2)

    out = [
        rolling.next_block(model, st, sched, last, noise_of, lambda s: torch.randn(s, generator=g))
        for _ in range(n_blocks)
    ]
    return torch.cat(out, dim=2).transpose(1, 2), st  # (1, F, C, h, w)


def test_rolling_equals_the_authors_loop():
    """10 blocks: the window fills (5 steps before block 0 is out), slides (the anchor moves up to
    sit before the recent frames; the authors' cache evicts past its first block) and drains;
    every block equals the authors' within float error."""
    model, n = make_model(), 10
    cross = prompt_kv(model, 1)
    noise = torch.randn(1, 3 * n, C, LAT_H, LAT_W, generator=torch.Generator().manual_seed(5))
    ref = Authors(model, cross).inference_rolling_forcing(noise, torch.Generator().manual_seed(9))
    ours, st = run_ours(model, cross, noise, torch.Generator().manual_seed(9), n, last=n - 1)
    assert not st.flight and st.finished == n
    assert ref.abs().max() > 0.5  # a real signal, not zeros on both sides
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_open_ended_matches_a_long_shot_until_its_drain():
    """A live video's window never drains: its blocks equal a bounded shot's wherever the
    bounded one has not begun draining (blocks 0..N-5), and it keeps going past N."""
    model, n = make_model(), 6
    cross = prompt_kv(model, 1)
    noise = torch.randn(1, 3 * (n + 5), C, LAT_H, LAT_W, generator=torch.Generator().manual_seed(5))
    bounded, _ = run_ours(model, cross, noise, torch.Generator().manual_seed(9), n, last=n - 1)
    # The renoising draws differ once the bounded window shrinks; the first n-4 blocks share them.
    live, st = run_ours(model, cross, noise, torch.Generator().manual_seed(9), n + 1, last=None)
    k = 3 * (n - 4)
    torch.testing.assert_close(live[:, :k], bounded[:, :k], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(live[:, k : 3 * n], bounded[:, k:], atol=1e-3)  # the drain differs
    assert len(st.flight) == len(STEPS) - 1 and st.finished == n + 1


# ----------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def engine():
    from streamdiff.models.engines import DiTEngine
    from streamdiff.models.presets import ModelSpec

    rolling_settings = {"kind": "rolling", "steps": list(STEPS), "window_frames": 21, "sink_frames": 3}
    return DiTEngine(ModelSpec(preset="tiny-random", sampler=rolling_settings))


def shot(engine, sess, prompt, blocks, seed=None, cut=True, live=False):
    """A scene of `blocks` blocks, as the DiT worker runs it (shot_left as GenerateBlock gives it)."""
    engine.set_scene(sess, prompt, new_shot=cut, seed=seed, shot_left=0 if live else blocks)
    return [engine.generate_block(sess, 3, 0 if live else blocks - i) for i in range(blocks)]


def test_engine_one_finished_block_per_call_in_the_authors_noise_order(engine):
    """The engine draws the shot's noise up front, then the re-noising in the authors' order, from
    the session's generator: its blocks equal the sampler fed those draws directly."""
    sess = engine.open_session(64, 48, seed=4)
    blocks = shot(engine, sess, "a red fox", 6)
    assert [b.shape for b in blocks] == [(1, C, 3, 6, 8)] * 6
    assert not sess.rolling.flight and sess.rolling.finished == 6

    g = torch.Generator().manual_seed(4)
    noise = torch.randn(1, 18, C, 6, 8, generator=g)
    st = rolling.RollingState(engine.model, 6, 8, engine.preset.sampler)
    engine.model.set_prompt(st.store, engine.encode_prompt("a red fox"))
    want = [
        rolling.next_block(
            engine.model,
            st,
            engine.sampler.window,
            5,
            lambda i: noise[:, 3 * i : 3 * i + 3].transpose(1, 2),
            lambda s: torch.randn(s, generator=g),
        )
        for _ in range(6)
    ]
    assert all(torch.equal(a, b) for a, b in zip(blocks, want, strict=True))


def test_engine_cut_restarts_the_window(engine):
    """A cut discards the blocks in flight: the new shot equals a fresh session's."""
    sess = engine.open_session(64, 48, seed=4)
    shot(engine, sess, "a red fox", 2, live=True)  # open-ended: blocks 2..5 are in flight
    assert len(sess.rolling.flight) == len(STEPS) - 1
    after = shot(engine, sess, "a city at night", 3, seed=7)
    fresh = shot(engine, engine.open_session(64, 48, seed=99), "a city at night", 3, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(after, fresh, strict=True))


def test_engine_prompt_switch_keeps_the_window(engine):
    """A continue scene: the blocks in flight go on under the new prompt (not restarted)."""
    sess = engine.open_session(64, 48, seed=4)
    first = shot(engine, sess, "a red fox", 2, live=True)
    levels = [b.level for b in sess.rolling.flight]
    engine.set_scene(sess, "a city at night", new_shot=False)
    assert [b.level for b in sess.rolling.flight] == levels
    switched = engine.generate_block(sess, 3)
    same = engine.open_session(64, 48, seed=4)
    shot(engine, same, "a red fox", 2, live=True)
    kept = engine.generate_block(same, 3)
    assert torch.equal(first[0], shot(engine, engine.open_session(64, 48, seed=4), "a red fox", 1, live=True)[0])
    assert not torch.allclose(switched, kept, atol=1e-4)


def test_engine_refuses_a_partial_block(engine):
    sess = engine.open_session(64, 48, seed=4)
    engine.set_scene(sess, "a red fox", new_shot=True)
    with pytest.raises(ValueError, match="whole blocks of 3 latent frames, not 2"):
        engine.generate_block(sess, 2, 1)


def test_engine_shortened_shot_drains(engine):
    """A replan that ends the shot sooner (a stop, a steer) drops the blocks in flight past the
    new end; the last call leaves nothing in flight."""
    sess = engine.open_session(64, 48, seed=4)
    engine.set_scene(sess, "a red fox", new_shot=True)
    engine.generate_block(sess, 3, 8)
    assert [b.index for b in sess.rolling.flight] == [1, 2, 3, 4]
    engine.generate_block(sess, 3, 2)  # block 1, and block 2 is the shot's last now
    assert [b.index for b in sess.rolling.flight] == [2]
    engine.generate_block(sess, 3, 1)
    assert not sess.rolling.flight and sess.rolling.finished == 3


def test_shot_left_counts_to_the_next_cut():
    """What the supervisor tells the DiT of each block: the blocks of its shot from it on (a
    continue scene stays in the shot, a cut starts another)."""
    from streamdiff.plan import Scene, plan_blocks, shot_left

    blocks = plan_blocks([Scene("a", 33), Scene("b", 12, "continue"), Scene("c", 21, "cut")], 3)
    assert [shot_left(blocks, b.index) for b in blocks] == [4, 3, 2, 1, 2, 1]


def test_engine_recache(engine):
    """A re-cache recomputes the finished history and the anchor under the prompt: under the
    same prompt (history not yet evicted) it changes nothing; under a new one it differs from a
    plain switch."""

    def after(prompt, recache):
        sess = engine.open_session(64, 48, seed=4)
        shot(engine, sess, "a red fox", 3, live=True)
        engine.set_scene(sess, prompt, new_shot=False, recache=recache)
        return [engine.generate_block(sess, 3) for _ in range(2)]

    plain = after("a red fox", False)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(after("a red fox", True), plain, strict=True))
    switched, recached = after("a city at night", False), after("a city at night", True)
    assert not torch.allclose(switched[1], recached[1], atol=1e-4)
