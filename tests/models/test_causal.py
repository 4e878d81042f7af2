"""Block-causal generation with the KV cache against recomputation by diffusers' transformer.

The reference recomputes every block from scratch: the clean latents of all earlier blocks
(at t = 0) and the current noisy block, in one diffusers forward with a block-causal attention
mask (and the attention window, where one is set). Cross-attention per token uses the prompt
that was active when that frame was generated, which is what `continue` means.
"""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from streamdiff.models.wan.sampler import denoise_block, warped_timesteps

from .conftest import TEXT_LEN

LAT_H, LAT_W = 4, 6
TOKENS_PER_FRAME = (LAT_H // 2) * (LAT_W // 2)


class MaskedSelfAttention(WanAttnProcessor):
    """diffusers' processor with a fixed boolean attention mask over tokens."""

    mask: torch.Tensor | None = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        return super().__call__(attn, hidden_states, encoder_hidden_states, self.mask, rotary_emb)


class PerFramePromptCrossAttention(WanAttnProcessor):
    """Context = [prompt 0 | prompt 1 | ...] concatenated; each token uses its frame's prompt."""

    frame_prompt: torch.Tensor | None = None  # (frames,) prompt index per frame

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        ctxs = encoder_hidden_states.split(TEXT_LEN, dim=1)
        outs = torch.stack([super(PerFramePromptCrossAttention, self).__call__(attn, hidden_states, c) for c in ctxs])
        which = self.frame_prompt.repeat_interleave(TOKENS_PER_FRAME)
        return outs[which, :, torch.arange(hidden_states.shape[1])].transpose(0, 1)


def allowed_frames(num_frames: int, blocks: list[tuple[int, int]], window: int | None, sink: int) -> torch.Tensor:
    """(F, F) bool: query frame i may attend key frame j (block-causal, optional window + sinks)."""
    allow = torch.zeros(num_frames, num_frames, dtype=torch.bool)
    for s, e in blocks:
        keys = torch.zeros(num_frames, dtype=torch.bool)
        keys[:e] = True
        if window is not None and e > window:
            keys[sink : e - (window - sink)] = False
        allow[s:e] = keys
    return allow


class Reference:
    """Recompute-everything generation with diffusers' transformer."""

    def __init__(self, ref, window=None, sink=0):
        ref = copy.deepcopy(ref)  # the processors below must not leak into the shared fixture
        self.ref, self.window, self.sink = ref, window, sink
        self.self_proc, self.cross_proc = MaskedSelfAttention(), PerFramePromptCrossAttention()
        for blk in ref.blocks:
            blk.attn1.set_processor(self.self_proc)
            blk.attn2.set_processor(self.cross_proc)
        self.clean: list[torch.Tensor] = []  # clean latents per block
        self.prompt_of_block: list[int] = []

    def flow(self, x_block, t, prompts):
        frames = torch.cat(self.clean + [x_block], dim=2)
        f_total, f_block = frames.shape[2], x_block.shape[2]
        bounds, s = [], 0
        for blk in self.clean + [x_block]:
            bounds.append((s, s + blk.shape[2]))
            s += blk.shape[2]
        allow = allowed_frames(f_total, bounds, self.window, self.sink)
        self.self_proc.mask = allow.repeat_interleave(TOKENS_PER_FRAME, 0).repeat_interleave(TOKENS_PER_FRAME, 1)
        per_block = self.prompt_of_block + [self.current_prompt]
        self.cross_proc.frame_prompt = torch.tensor(
            [p for blk, p in zip(self.clean + [x_block], per_block, strict=False) for _ in range(blk.shape[2])]
        )
        tt = torch.cat([torch.zeros(f_total - f_block), torch.full((f_block,), t)])
        with torch.no_grad():
            out = self.ref(frames, tt.repeat_interleave(TOKENS_PER_FRAME)[None], torch.cat(prompts, 1)).sample
        return out[:, :, -f_block:]

    def denoise(self, noise, timesteps, renoise, prompts, prompt_index):
        self.current_prompt = prompt_index
        x = noise
        for i, t in enumerate(timesteps):
            x0 = x - t / 1000.0 * self.flow(x, t, prompts)
            if i + 1 < len(timesteps):
                s = timesteps[i + 1] / 1000.0
                x = (1 - s) * x0 + s * renoise[i]
        self.clean.append(x0)
        self.prompt_of_block.append(prompt_index)
        return x0


def noises(seed, block_frames, steps):
    g = torch.Generator().manual_seed(seed)
    out = []
    for f in block_frames:
        shape = (1, 16, f, LAT_H, LAT_W)
        out.append((torch.randn(shape, generator=g), [torch.randn(shape, generator=g) for _ in range(steps - 1)]))
    return out


def prompts(n, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, TEXT_LEN, 32, generator=g) for _ in range(n)]


TS = warped_timesteps([1000, 750, 500, 250], 5.0)


@pytest.mark.parametrize("block_frames", [[3, 3, 3], [1, 1, 1, 1], [1, 3, 2]], ids=str)
def test_kv_cache_equals_block_causal_recompute(dit_pair, block_frames):
    ref, ours = dit_pair
    (ctx,) = prompts(1)
    state = ours.new_state(LAT_H, LAT_W, window_frames=sum(block_frames))
    ours.set_prompt(state, ctx)
    reference = Reference(ref)
    for noise, renoise in noises(1, block_frames, len(TS)):
        got = denoise_block(ours, state, noise, TS, renoise)
        expected = reference.denoise(noise, TS, renoise, [ctx], 0)
        assert (got - expected).abs().max().item() <= 1e-4
    assert state.kv.frames == sum(block_frames)


@pytest.mark.parametrize("window,sink", [(4, 0), (5, 1), (6, 3)])
def test_windowed_cache_equals_windowed_recompute(dit_pair, window, sink):
    ref, ours = dit_pair
    (ctx,) = prompts(1)
    block_frames = [1, 2, 2, 2, 1, 2]
    state = ours.new_state(LAT_H, LAT_W, window_frames=window, sink_frames=sink)
    ours.set_prompt(state, ctx)
    reference = Reference(ref, window=window, sink=sink)
    for noise, renoise in noises(2, block_frames, len(TS)):
        got = denoise_block(ours, state, noise, TS, renoise)
        expected = reference.denoise(noise, TS, renoise, [ctx], 0)
        assert (got - expected).abs().max().item() <= 1e-4
    assert state.kv.frames <= window


def test_continue_swaps_prompt_and_keeps_history(dit_pair):
    """`continue`: frames before the switch stay conditioned on prompt A (their cached K/V),
    the new block on prompt B; equals a recompute with per-frame prompts."""
    ref, ours = dit_pair
    a, b = prompts(2)
    state = ours.new_state(LAT_H, LAT_W, window_frames=9)
    ours.set_prompt(state, a)
    reference = Reference(ref)
    plan, current = [(a, 0), (a, 0), (b, 1), (b, 1)], 0
    for (noise, renoise), (ctx, idx) in zip(noises(3, [2, 2, 2, 2], len(TS)), plan, strict=False):
        if idx != current:  # the `continue` transition
            frames_before = state.kv.frames
            ours.set_prompt(state, ctx)
            assert state.kv.frames == frames_before
            current = idx
        got = denoise_block(ours, state, noise, TS, renoise)
        expected = reference.denoise(noise, TS, renoise, [a, b], idx)
        assert (got - expected).abs().max().item() <= 1e-4


def test_continue_differs_from_cut(dit_pair):
    _, ours = dit_pair
    a, b = prompts(2)
    (n1, r1), (n2, r2) = noises(4, [2, 2], len(TS))
    cont = ours.new_state(LAT_H, LAT_W, window_frames=6)
    ours.set_prompt(cont, a)
    denoise_block(ours, cont, n1, TS, r1)
    ours.set_prompt(cont, b)
    after_continue = denoise_block(ours, cont, n2, TS, r2)
    fresh = ours.new_state(LAT_H, LAT_W, window_frames=6)  # `cut`: no history
    ours.set_prompt(fresh, b)
    after_cut = denoise_block(ours, fresh, n2, TS, r2)
    assert (after_continue - after_cut).abs().max().item() > 1e-3


def test_frame_positions_run_past_the_rope_table():
    """The frame axis is computed at any position: below Wan's 1024-entry table it equals the
    table, and a live shot's frames go on past it with the same formula."""
    from streamdiff.models.wan.dit import DiTConfig, Rope

    cfg = DiTConfig(dim=96, num_heads=1)
    rope = Rope(cfg, torch.device("cpu"))
    pairs = cfg.rope_split()[0]
    inv = 1.0 / torch.pow(cfg.rope_theta, torch.arange(0, 2 * pairs, 2, dtype=torch.float64) / (2 * pairs))
    for start in (0, 1019, 5000):
        cos, sin = rope.tables(start, 4, 2, 3)
        ang = torch.outer(torch.arange(start, start + 4, dtype=torch.float64), inv)
        frame_cos = cos.view(4, 2, 3, -1)[:, 0, 0, :pairs]
        assert torch.equal(frame_cos, torch.cos(ang).float())
        assert torch.equal(sin.view(4, 2, 3, -1)[:, 1, 2, :pairs], torch.sin(ang).float())
