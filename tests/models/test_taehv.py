"""TAEHV (models/wan/taehv.py): the published key layout loads strictly, block-by-block decoding
equals whole-shot decoding, frame counts are the Wan VAE's, batched sessions equal each alone,
and a plain transcription of the authors' whole-clip decode gives the same frames."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from streamdiff.models.engines import VAEEngine
from streamdiff.models.spec import ModelSpec
from streamdiff.models.wan.loading import CheckpointError
from streamdiff.models.wan.taehv import (
    TAEW2_2,
    TINY_TAEHV,
    TAEHVConfig,
    TAEHVDecoder,
    load_taehv,
    published_config,
    random_taehv,
)
from streamdiff.models.wan.vae import VAEConfig

SMALL = TAEHVConfig(widths=(16, 8, 8, 8), encoder_width=8)  # the published structure, narrow

# Facts of the published taew2_1 file (its safetensors header, as third-party loaders record it):
# 64 decoder tensors, the first TGrow (stride 1 for Wan 2.1) 256 -> 256, the RGB conv 64 -> 3.
PUBLISHED_SHAPES = {
    "decoder.1.weight": (256, 16, 3, 3),
    "decoder.3.conv.0.weight": (256, 512, 3, 3),
    "decoder.7.conv.weight": (256, 256, 1, 1),
    "decoder.8.weight": (128, 256, 3, 3),
    "decoder.13.conv.weight": (256, 128, 1, 1),
    "decoder.14.weight": (64, 128, 3, 3),
    "decoder.19.conv.weight": (128, 64, 1, 1),
    "decoder.20.weight": (64, 64, 3, 3),
    "decoder.22.weight": (3, 64, 3, 3),
    "encoder.2.conv.weight": (64, 128, 1, 1),
    "encoder.12.conv.weight": (64, 64, 1, 1),
    "encoder.17.weight": (16, 64, 3, 3),
}


def save(sd: dict, path, fmt: str) -> None:
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    else:
        torch.save(sd, str(path))


def test_published_layout_shapes():
    sd = random_taehv(TAEHVConfig()).state_dict()
    dec = [k for k in sd if k.startswith("decoder.")]
    assert len(dec) == 64 and len(sd) == 128
    assert not any(k.startswith("decoder.8.bias") for k in sd)  # the stage convs carry no bias
    for k, shape in PUBLISHED_SHAPES.items():
        assert tuple(sd[k].shape) == shape, k


@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_small_random_file_in_the_published_layout_loads(tmp_path, fmt):
    ref = random_taehv(SMALL, seed=5)
    path = tmp_path / f"taew2_1.{fmt}"
    save(ref.state_dict(), path, fmt)
    got = load_taehv(str(path), SMALL)
    for k, v in ref.state_dict().items():
        assert torch.equal(got.state_dict()[k], v), k
    z = torch.randn(1, 16, 3, 4, 6)
    assert torch.equal(got.decode(z, got.new_state()), ref.decode(z, ref.new_state()))


def test_the_engine_loads_a_published_width_file(tmp_path):
    """--decoder-weights FILE: the published widths, in half precision as a file may hold them."""
    ref = random_taehv(TAEHVConfig(), seed=3)
    path = tmp_path / "taew2_1.safetensors"
    save({k: v.half() for k, v in ref.state_dict().items()}, path, "safetensors")
    eng = VAEEngine(ModelSpec(decoder="taehv", decoder_weights=str(path)), "cpu")
    assert eng.model.cfg == TAEHVConfig()
    assert torch.equal(eng.model.decoder[22].weight, ref.decoder[22].weight.half().float())
    frames = eng.decode_block(eng.open_session(), torch.randn(1, 16, 1, 2, 3))
    assert tuple(frames.shape) == (1, 16, 24, 3)


def test_misnamed_and_misshapen_keys_are_refused_by_name(tmp_path):
    sd = random_taehv(SMALL).state_dict()
    sd["decoder.99.weight"] = sd.pop("decoder.22.weight")  # misnamed: one missing, one unexpected
    sd["decoder.14.weight"] = torch.zeros(8, 8, 5, 5)  # misshapen
    path = tmp_path / "bad.pth"
    torch.save(sd, str(path))
    with pytest.raises(CheckpointError) as exc:
        load_taehv(str(path), SMALL)
    msg = str(exc.value)
    assert "1 missing: decoder.22.weight" in msg
    assert "1 unexpected: decoder.99.weight" in msg
    assert "decoder.14.weight: checkpoint (8, 8, 5, 5)" in msg


def test_the_wan_2_2_file_is_refused(tmp_path):
    """48-channel latents (taew2_2): not a Wan 2.1 decoder."""
    sd = random_taehv(TAEHVConfig(latent_channels=48, encoder_width=8, widths=(16, 8, 8, 8))).state_dict()
    torch.save(sd, str(tmp_path / "taew2_2.pth"))
    with pytest.raises(CheckpointError, match=r"decoder\.1\.weight: checkpoint \(16, 48, 3, 3\)"):
        load_taehv(str(tmp_path / "taew2_2.pth"), SMALL)


def in_range(x: torch.Tensor) -> float:
    return (x.abs() < 0.999).float().mean().item()


@pytest.mark.parametrize("blocks", [1, 2, 5])
def test_block_by_block_equals_whole(blocks):
    torch.manual_seed(0)
    m = random_taehv(SMALL, seed=1)
    z = torch.randn(1, 16, 3 * blocks, 5, 7)
    whole = m.decode(z, m.new_state())
    st = m.new_state()
    parts = [m.decode(z[:, :, 3 * i : 3 * i + 3], st) for i in range(blocks)]
    got = torch.cat(parts, dim=2)
    assert in_range(whole) > 0.5  # most values are not clamped: the comparison has something to compare
    assert got.shape == whole.shape == (1, 3, 1 + 4 * (3 * blocks - 1), 40, 56)
    assert [p.shape[2] for p in parts] == [VAEConfig().frames_out(3, i == 0) for i in range(blocks)]
    torch.testing.assert_close(got, whole, rtol=0, atol=1e-5)
    st2 = m.new_state()  # frames, not blocks: chunks of any size
    odd = torch.cat([m.decode(z[:, :, i : i + 2], st2) for i in range(0, z.shape[2], 2)], dim=2)
    torch.testing.assert_close(odd, whole, rtol=0, atol=1e-5)


def test_after_a_cut_a_shot_decodes_as_if_alone():
    m = random_taehv(SMALL, seed=2)
    shot_a, shot_b = torch.randn(1, 16, 6, 4, 4), torch.randn(1, 16, 9, 4, 4)
    st = m.new_state()
    for i in range(2):
        m.decode(shot_a[:, :, 3 * i : 3 * i + 3], st)
    st = m.new_state()  # the cut: the worker opens a fresh state (DecodeBlock.reset)
    got = torch.cat([m.decode(shot_b[:, :, 3 * i : 3 * i + 3], st) for i in range(3)], dim=2)
    torch.testing.assert_close(got, m.decode(shot_b, m.new_state()), rtol=0, atol=1e-5)
    assert got.shape[2] == 1 + 4 * 8
    carried = m.new_state()  # without the reset the memory of shot A would change shot B's frames
    m.decode(shot_a, carried)
    assert (m.decode(shot_b[:, :, :3], carried)[:, :, -4:] - got[:, :, 5:9]).abs().max() > 1e-3


def test_sessions_batched_equal_each_alone():
    eng = VAEEngine(ModelSpec(decoder="taehv"), "cpu")
    z = torch.randn(2, 16, 3, 9, 16)
    states = [eng.open_session(), eng.open_session()]
    alone = [eng.open_session(), eng.open_session()]
    for _ in range(2):  # a shot's first block, then a steady one
        both = eng.decode_blocks(states, z)
        each = [eng.decode_block(alone[i], z[i : i + 1]) for i in range(2)]
        for a, b in zip(both, each, strict=True):
            assert (a.int() - b.int()).abs().max() <= 1
    assert [s.latent_frames for s in states] == [6, 6]
    with pytest.raises(ValueError, match="first block and later"):
        eng.decode_blocks([states[0], eng.open_session()], z)


def authors_decode_video(m, z: torch.Tensor) -> torch.Tensor:
    """The authors' whole-clip decode (taehv.py `decode_video`, parallel), transcribed plainly:
    NTCHW, every layer over all frames; a MemBlock's past is its input shifted one frame later
    (zeros first); a TGrow's output reshaped to stride x the frames; clamp to [0, 1]; the first
    t_upscale - 1 frames dropped."""
    from streamdiff.models.wan.taehv import MemBlock, TGrow

    n, t = z.shape[0], z.shape[2]
    x = z.permute(0, 2, 1, 3, 4).reshape(n * t, *z.shape[1:2], *z.shape[3:])
    for b in m.decoder:
        if isinstance(b, MemBlock):
            frames = x.reshape(n, -1, *x.shape[1:])
            past = F.pad(frames, (0, 0, 0, 0, 0, 0, 1, 0))[:, : frames.shape[1]].reshape(x.shape)
            x = b(x, past)
        elif isinstance(b, TGrow):
            c = x.shape[1]
            x = b.conv(x).reshape(-1, c, *x.shape[2:])
        else:
            x = b(x)
    if m.cfg.patch_size > 1:  # postprocess_output_frames
        x = F.pixel_shuffle(x, m.cfg.patch_size)
    x = x.reshape(n, -1, *x.shape[1:]).clamp(0, 1)
    return x[:, 3:]  # (N, T, 3, H, W)


def test_matches_the_authors_whole_clip_decode():
    m = random_taehv(SMALL, seed=4)
    z = torch.randn(2, 16, 7, 4, 5)
    st = m.new_state()
    ours = torch.cat([m.decode(z[:, :, :3], st), m.decode(z[:, :, 3:], st)], dim=2)  # (N, 3, T, H, W), [-1, 1]
    ref = authors_decode_video(m, z).permute(0, 2, 1, 3, 4) * 2 - 1
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_the_embedded_default_is_seeded():
    a, b = VAEEngine(ModelSpec(decoder="taehv"), "cpu"), VAEEngine(ModelSpec(decoder="taehv"), "cpu")
    assert a.model.cfg == TINY_TAEHV
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True))
    c = VAEEngine(ModelSpec(decoder="taehv", seed=7), "cpu")
    assert not torch.equal(a.model.decoder[1].weight, c.model.decoder[1].weight)


def test_a_real_preset_needs_the_weights():
    from streamdiff.models.presets import build_taehv, get_preset

    with pytest.raises(ValueError, match="--decoder-weights"):
        p = get_preset(ModelSpec())
        build_taehv(ModelSpec(preset="tiny", decoder="taehv"), p.__class__(**{**p.__dict__, "embedded": False}))


def test_no_height_sharding():
    eng = VAEEngine(ModelSpec(decoder="taehv"), "cpu")
    with pytest.raises(ValueError, match="never height-sharded"):
        eng.plan((16, 3, 18, 32), world=2)


# taew2_2 (the authors' TAEHV with patch_size 2 and 48 latent channels): its first and last convs.
TAEW2_2_SHAPES = {
    "decoder.1.weight": (256, 48, 3, 3),
    "decoder.22.weight": (12, 64, 3, 3),
    "encoder.0.weight": (64, 12, 3, 3),
    "encoder.17.weight": (48, 64, 3, 3),
}
SMALL_2_2 = replace(TAEW2_2, widths=(16, 8, 8, 8), encoder_width=8)


def test_taew2_2_has_the_published_layout_and_factors():
    with torch.device("meta"):
        sd = TAEHVDecoder(TAEW2_2).state_dict()
    assert {k: tuple(sd[k].shape) for k in TAEW2_2_SHAPES} == TAEW2_2_SHAPES
    assert (TAEW2_2.spatial_factor, TAEW2_2.temporal_factor) == (16, 4)
    assert published_config(48) == TAEW2_2 and published_config(16) == TAEHVConfig()
    with pytest.raises(ValueError, match="no published TAEHV decodes 32-channel"):
        published_config(32)


def test_taew2_2_streamed_in_blocks_matches_the_authors_whole_clip_decode():
    m = random_taehv(SMALL_2_2, seed=5)
    z = torch.randn(2, 48, 7, 3, 4)
    st = m.new_state()
    ours = torch.cat([m.decode(z[:, :, :1], st), m.decode(z[:, :, 1:4], st), m.decode(z[:, :, 4:], st)], dim=2)
    assert ours.shape == (2, 3, 1 + 4 * 6, 48, 64)  # 16x in space, the Wan VAE's frame count
    ref = authors_decode_video(m, z).permute(0, 2, 1, 3, 4) * 2 - 1
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_a_taew2_1_file_is_refused_for_wan_2_2_latents(tmp_path):
    torch.save(random_taehv(SMALL).state_dict(), str(tmp_path / "taew2_1.pth"))
    with pytest.raises(CheckpointError, match=r"decoder\.1\.weight: checkpoint \(16, 16, 3, 3\)"):
        load_taehv(str(tmp_path / "taew2_1.pth"), SMALL_2_2)
