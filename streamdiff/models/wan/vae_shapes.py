"""The shapes of the Wan VAE decoder's stages, without torch: the supervisor sizes its latent
ring for a VAE cut with them before any model is built, and checks a cut against a slot."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecoderShape:
    """What fixes the decoder's stage shapes (models/wan/vae.py VAEConfig's fields)."""

    decoder_dim: int
    dim_mult: tuple[int, ...]
    num_res_blocks: int
    temporal_downsample: tuple[bool, ...]
    residual: bool = False
    patch_size: int = 1


def stage_shapes(cfg, latent_frames: int, h: int, w: int) -> list[tuple[int, int, int, int]]:
    """The output shape (C, T, H, W) of each of `decoder_stages` on a steady block of
    `latent_frames` latent frames of h x w (a shot's first block has fewer frames): what a cut
    after that stage hands over, which the supervisor sizes its ring with before any model is
    built. Mirrors `Decoder3d`'s construction. `cfg`: a VAEConfig or a DecoderShape."""
    dims = [cfg.decoder_dim * u for u in (cfg.dim_mult[-1], *cfg.dim_mult[::-1])]
    temporal_up = cfg.temporal_downsample[::-1]
    t = latent_frames
    out = [(dims[0], t, h, w)]
    for i, cout in enumerate(dims[1:]):
        up = i != len(cfg.dim_mult) - 1
        if up:
            t2, h2, w2 = t * (2 if temporal_up[i] else 1), 2 * h, 2 * w
        if cfg.residual:  # one stage: its blocks, its upsampler and the shortcut around them
            t, h, w = (t2, h2, w2) if up else (t, h, w)
            out.append((cout, t, h, w))
            continue
        out += [(cout, t, h, w)] * (cfg.num_res_blocks + 1)
        if up:
            t, h, w = t2, h2, w2
            out.append((cout // 2, t, h, w))
    p = cfg.patch_size
    return [*out, (3, t, h * p, w * p)]


def _shape_of(spec) -> DecoderShape:
    from ..presets import get_preset

    try:
        v = get_preset(spec).vae
    except Exception as exc:  # the parent gets one picklable error naming it
        raise ValueError(str(exc)) from None
    return DecoderShape(
        v.decoder_dim, tuple(v.dim_mult), v.num_res_blocks, tuple(v.temporal_downsample), v.residual, v.patch_size
    )


def decoder_shape(spec) -> DecoderShape:
    """The preset's decoder shape (the config written next to the weights, else the release's),
    read in a spawned child: the presets import torch, which the supervisor never does."""
    from ...spawn import in_child

    return in_child(_shape_of, spec)
