"""Where a worker lets the CPU platform's shared cores (platform/cpu_lending.py) in: the points
in its models at which it changes its thread count."""

from __future__ import annotations

from ..platform.cpu_lending import Lender


def install_lender(lender: Lender, module) -> int:
    """Adjust before every DiT block and every module of the VAE decoder in `module`, and
    before each CPU conv2d of the decoder (its `checkpoint`, models/wan/kernels.py); returns how
    many modules. The DiT's waits fall at the end of each VAE block, where the decoder's
    full-resolution norms and convolutions run, in spells shorter than one of those convolutions
    on one core (docs/placement.md#the-layouts)."""
    from ..models.wan import vae, vae_blocks
    from ..models.wan.dit import DiTBlock

    for sub in module.modules():
        if isinstance(sub, vae.WanVAEDecoder):
            sub.checkpoint = lender.adjust
    return lender.install(
        sub
        for sub in module.modules()
        if isinstance(sub, DiTBlock) or type(sub).__module__ in (vae.__name__, vae_blocks.__name__)
    )
