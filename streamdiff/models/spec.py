"""What a worker needs to build its model stage: plain data, no torch (the supervisor imports it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from ..card import DiTDims, ModelCard
from .catalog import CHECKPOINT_PRESETS, checkpoint_preset
from .shipped import trained_header


@dataclass(frozen=True)
class ModelSpec:
    """What a worker needs to build its stage. Plain data: it crosses process boundaries."""

    preset: str = "tiny"  # a DiT configuration (tiny, tiny-random, wan2.1-t2v-1.3b, ...) or a checkpoint preset
    path: str | None = None  # local weights directory (real presets)
    dit_checkpoint: str | None = None  # Causal Forcing / Self-Forcing .pt, overrides the DiT weights
    weights: str | None = None  # "ema" | "generator": the training checkpoint's set (None: the preset's, else ema)
    dtype: str = "auto"  # auto: float32 on the CPU, bfloat16 on accelerators
    compile: str = "auto"  # torch.compile the DiT's blocks and the VAE's norms: auto (accelerators only) | on | off
    dit_vae_ratio: float = 0.74  # tiny only: DiT cost per block relative to the VAE's
    seed: int = 1234  # tiny only: weight seed
    sampler: dict = field(default_factory=dict)  # overrides of SamplerConfig fields
    default_size: tuple[int, int] | None = None  # (width, height) instead of the preset's (model.size)
    lora: str | None = None  # PEFT LoRA adapter file (LongLive's lora.pt) merged into the DiT at load
    lora_alpha: float | None = None  # its alpha (not stored in the file); required with `lora`
    lora_rank: int | None = None  # expected rank, checked against the file when given
    decoder: str = "wan"  # "wan" (the Wan 2.1 VAE) | "taehv" (the tiny real-time decoder, models/wan/taehv.py)
    decoder_weights: str | None = None  # TAEHV's file (taew2_1.pth / .safetensors); tiny: seeded if None


# Each DiT configuration's card (card.py): what the supervisor, the API and the planner know of
# a model before any worker has started (the rings are sized by it; the DiT worker confirms it in
# READY). A checkpoint preset's card is its DiT configuration's with the authors' settings.
_WAN21 = dict(latent_channels=16, spatial_factor=8, temporal_factor=4, size_multiple=16, frames_per_block=3)
_WAN_DIMS = DiTDims(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30)
ARCH_CARDS = {
    c.name: c
    for c in (
        # The embedded default: its depth follows dit_vae_ratio, so it is priced by its profile.
        # `tiny` loads trained weights shipped in the package where they exist
        # (shipped.embedded_weights); `tiny-random` never does, for the benchmarks built on the
        # seeded weights (issue 36). Both take an image: the seeded encoder makes no meaningful
        # picture, but the whole image-to-video path runs end to end on a laptop.
        *(
            ModelCard(
                name=n,
                arch=n,
                embedded=True,
                image="block",
                context_encoder="tiny",
                **_WAN21,
                default_size=(256, 144),
                window_frames=12,
            )
            for n in ("tiny", "tiny-random")
        ),
        ModelCard(name="wan2.1-t2v-1.3b", arch="wan2.1-t2v-1.3b", **_WAN21, dims=_WAN_DIMS),
        ModelCard(
            name="wan2.1-t2v-14b",
            arch="wan2.1-t2v-14b",
            **_WAN21,
            dims=DiTDims(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40),
        ),
        # Wan 2.2 TI2V 5B: the Wan 2.2 VAE's 48 channels at 16x16 (the DiT's 2x2 patches make 32x32
        # pixels a token: 880 a frame at 1280x704), 24 fps
        ModelCard(
            name="wan2.2-ti2v-5b",
            arch="wan2.2-ti2v-5b",
            **{**_WAN21, "latent_channels": 48, "spatial_factor": 16, "size_multiple": 32},
            fps=24,
            default_size=(1280, 704),
            dims=DiTDims(dim=3072, ffn_dim=14336, num_heads=24, num_layers=30, in_channels=48, out_channels=48),
        ),
        # Matrix-Game 2.0's DiT (its configs/distilled_model/*/config.json): the 1.3B's blocks on 36
        # channels in (16 of noise, a 4-channel mask, 16 of the start image's latents), CLIP's 257
        # image tokens (1280 wide, through img_emb) as the context, no text; 352x640. Its mp4s are
        # written at 12 fps (utils/visualize.py).
        ModelCard(
            name="matrix-game-2",
            arch="matrix-game-2",
            **_WAN21,
            text=False,
            context_encoder="clip",  # CLIP ViT-H's image tokens
            dit_group=False,  # its action modules run on one device
            action_blocks=15,
            fps=12,
            default_size=(640, 352),
            dims=msgspec.structs.replace(_WAN_DIMS, in_channels=36, text_len=257, text_dim=1280),
        ),
    )
}


DEFAULT_PRESET = "tiny"  # what a daemon with no model configured serves
DIRECTORY_PRESET = "wan2.1-t2v-1.3b"  # what a weights directory given alone (--model PATH) runs


def preset_card(name: str) -> ModelCard:
    """The card of a DiT configuration, or of a checkpoint preset: its DiT configuration's, with
    what the authors' settings make of it. KeyError for a name that is neither."""
    if name in ARCH_CARDS:
        return _as_trained(ARCH_CARDS[name])
    cp = checkpoint_preset(name)
    if cp is None:
        raise KeyError(name)
    return msgspec.structs.replace(
        ARCH_CARDS[cp.dit],
        name=cp.name,
        image=cp.image if cp.i2v else None,
        controls=cp.controls,
        new_shot="history" if cp.shot_offset else "fresh",
        recache=cp.recache,
        can_recache=not cp.prope,  # minWM: the held frames' cameras are not kept
        sampler=cp.sampler,
        steps=len(cp.steps),
        checkpoint=cp.checkpoint,
        lora=cp.lora,
        frames_per_block=cp.frames_per_block,
        window_frames=cp.window_frames,
        sink_frames=cp.sink,
        kv_caches=2 if cp.prope else 1,  # minWM's PRoPE: a second attention and cache
    )


def _as_trained(card: ModelCard) -> ModelCard:
    """An embedded preset's card with the sampler settings its shipped weights were trained with
    (their file's header: `get_preset` runs them)."""
    found = trained_header(card.name) if card.embedded else None
    if found is None:
        return card
    sampler = found[1]["sampler"]
    kept = {k: sampler[k] for k in ("frames_per_block", "window_frames", "sink_frames") if k in sampler}
    return msgspec.structs.replace(card, **kept, **({"steps": len(sampler["steps"])} if "steps" in sampler else {}))


DECODERS = ("wan", "taehv")  # the latent decoders a daemon can serve with (--decoder)


def known_presets() -> list[str]:
    return [*ARCH_CARDS, *CHECKPOINT_PRESETS]
