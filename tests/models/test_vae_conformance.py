"""Our streaming VAE decoder against diffusers' AutoencoderKLWan.decode."""

from __future__ import annotations

import pytest
import torch

from streamdiff.models.wan.vae import (
    decode_stages,
    decode_stages_sessions,
    decoder_stages,
    to_uint8_frames,
    uint8_frames,
)
from streamdiff.models.wan.vae_blocks import Ctx
from streamdiff.models.wan.vae_shapes import stage_shapes


def reference_decode(ref, ours, z):
    with torch.no_grad():
        return ref.decode(z * ours.std + ours.mean).sample  # diffusers decodes de-normalised latents


@pytest.mark.parametrize("shape", [(4, 6, 10), (3, 8, 8), (2, 5, 3)], ids=["4x6x10", "3x8x8", "2x5x3"])
def test_decode_matches_diffusers(vae_pair, shape):
    ref, ours = vae_pair
    z = torch.randn(1, 16, *shape, generator=torch.Generator().manual_seed(7))
    expected = reference_decode(ref, ours, z)
    got = ours.decode(z, ours.new_state())
    assert got.shape == expected.shape == (1, 3, 1 + 4 * (shape[0] - 1), 8 * shape[1], 8 * shape[2])
    assert (got - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("split", [[1] * 7, [3, 3, 1], [1, 3, 2, 1], [2, 5]], ids=str)
def test_block_by_block_equals_whole(vae_pair, split):
    _, ours = vae_pair
    z = torch.randn(1, 16, sum(split), 4, 6, generator=torch.Generator().manual_seed(8))
    whole = ours.decode(z, ours.new_state())
    state, parts, start = ours.new_state(), [], 0
    for n in split:
        out = ours.decode(z[:, :, start : start + n], state)
        assert out.shape[2] == ours.cfg.frames_out(n, first_block=start == 0)
        parts.append(out)
        start += n
    assert (torch.cat(parts, dim=2) - whole).abs().max().item() <= 1e-5
    assert whole.shape[2] == 1 + 4 * (sum(split) - 1)


def test_minwm_blocks_decoded_as_they_come_equal_the_authors_decode_at_the_end(vae_pair):
    """minWM decodes its whole video once at the end (`decode_to_pixel(use_cache=False)`, the Wan
    VAE that diffusers' equals); the daemon decodes each block of 4 latent frames as it comes,
    with the session's causal cache: the same frames."""
    ref, ours = vae_pair
    z = torch.randn(1, 16, 20, 4, 6, generator=torch.Generator().manual_seed(9))  # their 20 latent frames
    state = ours.new_state()
    blocks = torch.cat([ours.decode(z[:, :, i : i + 4], state) for i in range(0, 20, 4)], dim=2)
    assert (blocks - reference_decode(ref, ours, z)).abs().max().item() <= 1e-5


def test_sessions_are_independent(vae_pair):
    _, ours = vae_pair
    g = torch.Generator().manual_seed(9)
    za, zb = torch.randn(1, 16, 4, 4, 6, generator=g), torch.randn(1, 16, 4, 4, 6, generator=g)
    alone_a, alone_b = ours.decode(za, ours.new_state()), ours.decode(zb, ours.new_state())
    sa, sb, pa, pb = ours.new_state(), ours.new_state(), [], []
    for i in range(4):
        pa.append(ours.decode(za[:, :, i : i + 1], sa))
        pb.append(ours.decode(zb[:, :, i : i + 1], sb))
    assert (torch.cat(pa, 2) - alone_a).abs().max() <= 1e-5
    assert (torch.cat(pb, 2) - alone_b).abs().max() <= 1e-5


def test_uint8_frames_layout(vae_pair):
    """Frames leave the decoder as the ring holds them: uint8, channels interleaved, contiguous
    (laid out where they were decoded, then one copy for the batch), not a permuted view whose
    interleaving is left to the host."""
    _, ours = vae_pair
    g = torch.Generator().manual_seed(4)
    x = torch.cat([ours.decode(torch.randn(1, 16, 2, 4, 6, generator=g), ours.new_state()) for _ in range(2)])
    frames = uint8_frames(x)
    assert frames.dtype == torch.uint8 and frames.shape == (2, 5, 32, 48, 3) and frames.is_contiguous()
    assert frames.stride() == (5 * 32 * 48 * 3, 32 * 48 * 3, 48 * 3, 3, 1)
    expected = ((x[1, :, 3].permute(1, 2, 0) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    assert torch.equal(frames[1, 3], expected)
    assert torch.equal(to_uint8_frames(x[1:]), frames[1]) and to_uint8_frames(x[1:]).is_contiguous()


def test_a_decode_cut_between_stages_equals_the_whole(vae_pair):
    """Stages [0, c) then [c, end), each with a state of its own (as two processes would run
    them), block by block from a shot's start, equal the whole decode at every cut."""
    _, ours = vae_pair
    z = torch.randn(1, 16, 7, 4, 6, generator=torch.Generator().manual_seed(10))
    whole = ours.decode(z, ours.new_state())
    n = len(decoder_stages(ours))
    for cut in range(n + 1):
        front, back, out = ours.new_state(), ours.new_state(), []
        for start, frames in ((0, 1), (1, 3), (4, 3)):
            x = decode_stages(ours, z[:, :, start : start + frames], front, 0, cut, frames)
            out.append(decode_stages(ours, x, back, cut, n, frames))
        # fp32 exactness as everywhere (1e-5): oneDNN picks its kernels by the CPU and the
        # input's layout, and on an AVX2 EPYC a cut differed from the whole by 5.4e-6
        assert (torch.cat(out, dim=2) - whole).abs().max().item() <= 1e-5, cut
        assert front.latent_frames == back.latent_frames == 7


def test_two_sessions_cut_in_one_call_each_equal_their_own_decode(vae_pair):
    """Both sides of a cut batch sessions (as the DiT and VAE workers do): two sessions' blocks
    through stages [0, c) and then [c, end) in one call each, each with its own caches, equal
    each session decoded whole alone, block after block from a shot's start."""
    _, ours = vae_pair
    g = torch.Generator().manual_seed(11)
    z = [torch.randn(1, 16, 7, 4, 6, generator=g) for _ in range(2)]
    whole = [ours.decode(x, ours.new_state()) for x in z]
    n, cut = len(decoder_stages(ours)), 4
    fronts, backs, out = [ours.new_state() for _ in z], [ours.new_state() for _ in z], []
    for start, frames in ((0, 1), (1, 3), (4, 3)):
        x = torch.cat([x[:, :, start : start + frames] for x in z])
        x = decode_stages_sessions(ours, x, fronts, 0, cut, frames)
        out.append(decode_stages_sessions(ours, x, backs, cut, n, frames))
    for i in range(2):
        assert (torch.cat([o[i : i + 1] for o in out], dim=2) - whole[i]).abs().max().item() <= 1e-5
        assert fronts[i].latent_frames == backs[i].latent_frames == 7
    with pytest.raises(ValueError, match="first block and later"):
        decode_stages_sessions(ours, torch.cat(z)[:, :, :1], [ours.new_state(), fronts[0]], 0, cut, 1)


def test_stage_shapes_are_what_the_stages_output(vae_pair):
    """The supervisor sizes a cut's ring from `stage_shapes` before any model exists."""
    _, ours = vae_pair
    state, x = ours.new_state(), torch.randn(1, 16, 1, 4, 6)
    decode_stages(ours, x, state, 0, len(decoder_stages(ours)), 1)  # a shot's first block
    x, ctx, got = torch.randn(1, 16, 3, 4, 6), Ctx(state), []
    for stage in decoder_stages(ours):
        x = stage(x, ctx)
        got.append(tuple(x.shape[1:]))
    assert got == stage_shapes(ours.cfg, 3, 4, 6)


@pytest.mark.parametrize(
    "layout", [torch.contiguous_format, torch.channels_last_3d], ids=["row-major", "channels-last"]
)
def test_the_middle_attention_gives_sdpa_a_unit_stride_last_dimension(monkeypatch, layout):
    """The fused kernels (flash, memory-efficient, cuDNN) need it; without it SDPA runs its math
    path, which holds every frame's (h*w)^2 scores. In the accelerators' row-major layout
    (`kernels.layout`) the transposed view's last stride is h*w; in the CPU's channels-last, 1."""
    import streamdiff.models.wan.vae_blocks as vae

    block, sdpa, seen = vae.AttentionBlock(32).eval(), torch.nn.functional.scaled_dot_product_attention, []
    monkeypatch.setattr(
        vae, "conv2d", lambda x, w, b, padding=(0, 0), checkpoint=None: vae.F.conv2d(x, w, b, padding=padding)
    )

    def checked(q, k, v, *args, **kwargs):
        seen.append([t.stride(-1) for t in (q, k, v)])
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(vae.F, "scaled_dot_product_attention", checked)
    x = torch.randn(1, 32, 2, 4, 6).contiguous(memory_format=layout)
    with torch.no_grad():
        block(x, vae.Ctx(state=None))
    assert seen == [[1, 1, 1]], seen
