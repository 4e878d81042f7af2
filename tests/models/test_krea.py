"""Krea Realtime's per-block KV recompute against a transcription of its server loop, and the
14B DiT configuration built on the meta device (parameter count, checkpoint keys and shapes)."""

from __future__ import annotations

import pytest
import torch

from streamdiff.models.catalog import checkpoint_preset
from streamdiff.models.engines import DiTEngine
from streamdiff.models.presets import WAN_14B, ModelSpec
from streamdiff.models.wan.dit import WanDiT, count_params
from streamdiff.models.wan.loading import CheckpointError, check_keys, normalize_dit_state_dict

W, H = 64, 32  # latent 4x8: 8 tokens a frame
K = 3  # Krea's kv_cache_num_frames
KREA = checkpoint_preset("krea-realtime-14b")


@pytest.fixture(scope="module")
def engine():
    # The tiny DiT in float32 with every sampler setting of the Krea preset.
    return DiTEngine(ModelSpec(preset="tiny-random", sampler=KREA.sampler_settings()))


def krea_sigma(t: float, shift: float) -> float:
    """Krea's FlowMatchScheduler(shift, sigma_min=0, extra_one_step=True), 1000 training steps:
    add_noise and the x0 conversion take the sigma of the nearest schedule timestep."""
    sigmas = torch.linspace(1.0, 0.0, 1001, dtype=torch.float64)[:-1]
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    return float(sigmas[torch.argmin((sigmas * 1000 - t).abs())])


def krea_loop(engine: DiTEngine, prompts: list[str], seed: int) -> list[torch.Tensor]:
    """release_server.py's GenerationSession.generate_block_internal, transcribed, with
    keep_first_frame=True and kv_cache_num_frames=K: a fresh KV cache each block, refilled from
    the clean context frames at positions 0.. and t=0 under the prompt its cross-attention cache
    still holds (the previous block's), then the block denoised at position min(start, K) under
    its own prompt. Noise is drawn as our engine draws it (the seeding is not under test)."""
    model, fpb, shift = engine.model, engine.frames_per_block, KREA.shift
    # The server's schedule: linspace(1000, 0, 5) through Self-Forcing's warp, whose table of
    # shifted timesteps ends in an appended 0 (step k reads entry 1000 - k).
    sig = torch.linspace(1.0, 0.0, 1001, dtype=torch.float64)[:-1]
    table = torch.cat([1000 * shift * sig / (1 + (shift - 1) * sig), torch.zeros(1, dtype=torch.float64)])
    steps = [float(table[1000 - int(k)]) for k in KREA.steps]
    gen = torch.Generator().manual_seed(seed)
    hw = (H // 8, W // 8)
    all_latents: list[torch.Tensor] = []
    out = []
    for idx, prompt in enumerate(prompts):
        current_start_frame = idx * fpb
        state = model.new_state(*hw, window_frames=4 * K + fpb)  # never evicts: Krea's cache is fresh
        if idx == 0:
            start = 0
        else:
            start = min(current_start_frame, K)
            lat = torch.cat(all_latents, dim=2)
            if K == 1:
                ctx = lat[:, :, :1]
            else:  # keep_first_frame: the first frame and the newest K-1
                ctx = torch.cat((lat[:, :, :1], lat[:, :, 1:][:, :, -(K - 1) :]), dim=2)
            model.set_prompt(state, engine.encode_prompt(prompts[idx - 1]))
            # Block-causal mask in chunks of fpb from frame 0; K == fpb: one bidirectional chunk.
            for i in range(0, ctx.shape[2], fpb):
                c = ctx[:, :, i : i + fpb]
                model.forward_block(c, torch.zeros(1, c.shape[2]), state, commit=True)
            assert state.next_frame == start
        model.set_prompt(state, engine.encode_prompt(prompt))
        # (frames, C, h, w) draws, as the engine makes them (Self-Forcing's order and layout)
        noisy = torch.randn((1, fpb, 16, *hw), generator=gen).permute(0, 2, 1, 3, 4)
        renoise = [torch.randn((fpb, 16, *hw), generator=gen)[None].permute(0, 2, 1, 3, 4) for _ in steps[1:]]
        for i, t in enumerate(steps):
            flow = model.forward_block(noisy, torch.full((1, fpb), t), state, commit=False)
            denoised = noisy - krea_sigma(t, shift) * flow
            if i + 1 < len(steps):
                s = krea_sigma(steps[i + 1], shift)
                noisy = (1 - s) * denoised + s * renoise[i]
        all_latents.append(denoised)
        out.append(denoised)
    return out


def ours(engine: DiTEngine, prompts: list[str], seed: int) -> list[torch.Tensor]:
    sess = engine.open_session(W, H, seed)
    out = []
    for i, p in enumerate(prompts):
        engine.set_scene(sess, p, new_shot=i == 0)
        out.append(engine.generate_block(sess, engine.frames_per_block))
    return out


def test_preset_window_is_krea_context_plus_block():
    # attn_size = kv_cache_num_frames + num_frame_per_block; the first frame kept as a sink.
    assert (KREA.window, KREA.sink, KREA.frames_per_block, KREA.kv_recompute) == (K + 3, 1, 3, True)


def test_per_block_recompute_equals_krea_loop(engine):
    prompts = ["a red fox"] * 3 + ["a city at night"] * 3  # a switch at block 3
    ref, got = krea_loop(engine, prompts, seed=7), ours(engine, prompts, seed=7)
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=f"block {i}")


def test_prompt_switch_reaches_the_context_through_the_recompute(engine):
    """After the first block under a new prompt, the held context's keys are recomputed under it:
    they equal a fresh pass of the same latents under the new prompt, not the old."""
    sess = engine.open_session(W, H, 3)
    engine.set_scene(sess, "a red fox", new_shot=True)
    for _ in range(3):
        engine.generate_block(sess, 3)
    engine.set_scene(sess, "a city at night", new_shot=False)
    engine.generate_block(sess, 3)
    kv = sess.state.kv
    assert kv.frames == K and sess.state.next_frame == K
    ctx = kv.latents[:, :, :K].clone()

    def keys_under(prompt):
        st = engine.model.new_state(H // 8, W // 8, window_frames=2 * K)
        engine.model.set_prompt(st, engine.encode_prompt(prompt))
        engine.model.forward_block(ctx, torch.zeros(1, K), st, commit=True)
        return st.kv.k[-1][:, :, : K * kv.tpf]

    held = kv.k[-1][:, :, : K * kv.tpf]
    torch.testing.assert_close(held, keys_under("a city at night"), rtol=1e-5, atol=1e-5)
    assert (held - keys_under("a red fox")).abs().max() > 1e-3


def test_batched_sessions_recompute_each_alone(engine):
    a_alone = ours(engine, ["a red fox"] * 3, seed=1)
    b_alone = ours(engine, ["a blue whale"] * 3, seed=2)
    sa, sb = engine.open_session(W, H, 1), engine.open_session(W, H, 2)
    engine.set_scene(sa, "a red fox", new_shot=True)
    engine.set_scene(sb, "a blue whale", new_shot=True)
    for i in range(3):
        a, b = engine.generate_blocks([sa, sb], 3)
        torch.testing.assert_close(a, a_alone[i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b, b_alone[i], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the 14B on meta


def test_wan_14b_dims_match_the_release():
    # Wan-Video/Wan2.1 wan/configs/wan_t2v_14B.py and shared_config.py.
    c = WAN_14B
    assert (c.dim, c.ffn_dim, c.freq_dim, c.num_heads, c.num_layers) == (5120, 13824, 256, 40, 40)
    assert (c.text_len, c.eps, c.patch_size, c.head_dim) == (512, 1e-6, (1, 2, 2), 128)


@pytest.fixture(scope="module")
def meta_14b():
    with torch.device("meta"):
        return WanDiT(WAN_14B)


def test_14b_parameter_count(meta_14b):
    n = count_params(meta_14b)
    # Per block: 4 self + 4 cross projections (d*d + d), the FFN (2*d*f + f + d), the affine norm3
    # (2d) and the modulation (6d), the q/k RMSNorm weights (4d); plus embeddings and head.
    d, f, layers = 5120, 13824, 40
    block = 8 * (d * d + d) + 2 * d * f + f + d + 2 * d + 6 * d + 4 * d
    rest = (16 * 4 * d + d) + (4096 * d + d + d * d + d) + (256 * d + d + d * d + d) + (d * 6 * d + 6 * d)
    rest += (d * 64 + 64) + 2 * d
    assert n == layers * block + rest
    assert 14.0e9 < n < 14.4e9  # "14B": 14.29e9 counted this way


def test_krea_14b_checkpoint_keys_and_shapes(meta_14b):
    """Krea ships the DiT flat, `model.`-prefixed (krea-realtime-video-14b.safetensors); the key
    and shape check of the loader passes it on meta tensors, and names a missing key."""
    own = meta_14b.state_dict()
    sd = {f"model.{k}": torch.empty(v.shape, device="meta", dtype=torch.bfloat16) for k, v in own.items()}
    check_keys(meta_14b, normalize_dit_state_dict(sd), "Krea 14B")
    del sd["model.blocks.39.ffn.2.weight"]
    with pytest.raises(CheckpointError, match=r"blocks\.39\.ffn\.2\.weight"):
        check_keys(meta_14b, normalize_dit_state_dict(sd), "Krea 14B")
    sd["model.blocks.39.ffn.2.weight"] = torch.empty(5120, 8960, device="meta")
    with pytest.raises(CheckpointError, match="wrong shape"):
        check_keys(meta_14b, normalize_dit_state_dict(sd), "Krea 14B")
