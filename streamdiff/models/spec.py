"""What a worker needs to build its model stage: plain data, no torch (the supervisor imports it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .catalog import CHECKPOINT_PRESETS, checkpoint_preset


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


# What the supervisor needs to know about each preset before any worker has started (it sizes
# the shared-memory rings with these; workers confirm them in their READY message).
PRESET_FACTS = {
    "tiny": {
        "latent_channels": 16,
        "spatial_factor": 8,
        "temporal_factor": 4,
        "frames_per_block": 3,
        "fps": 16,
        "default_size": (256, 144),
    },
    "wan2.1-t2v-1.3b": {
        "latent_channels": 16,
        "spatial_factor": 8,
        "temporal_factor": 4,
        "frames_per_block": 3,
        "fps": 16,
        "default_size": (832, 480),
    },
    "wan2.1-t2v-14b": {
        "latent_channels": 16,
        "spatial_factor": 8,
        "temporal_factor": 4,
        "frames_per_block": 3,
        "fps": 16,
        "default_size": (832, 480),
    },
    # Wan 2.2 TI2V 5B: the Wan 2.2 VAE's 48 channels at 16x16 (the DiT's 2x2 patches make 32x32
    # pixels a token: 880 a frame at 1280x704), 24 fps
    "wan2.2-ti2v-5b": {
        "latent_channels": 48,
        "spatial_factor": 16,
        "temporal_factor": 4,
        "frames_per_block": 3,
        "fps": 24,
        "default_size": (1280, 704),
    },
}


# Matrix-Game 2.0's DiT (its configs/distilled_model/*/config.json): the 1.3B's blocks on 36
# channels in (16 of noise, a 4-channel mask, 16 of the start image's latents), CLIP's image
# tokens as the context, no text; 352x640. Its mp4s are written at 12 fps (utils/visualize.py).
PRESET_FACTS["matrix-game-2"] = {
    "latent_channels": 16,
    "spatial_factor": 8,
    "temporal_factor": 4,
    "frames_per_block": 3,
    "fps": 12,
    "default_size": (640, 352),
}


# The seeded default's architecture under its own name: `tiny` loads trained weights shipped in the
# package where they exist (shipped.embedded_weights); `tiny-random` never does, for the
# benchmarks built on the seeded weights (issue 36).
PRESET_FACTS["tiny-random"] = dict(PRESET_FACTS["tiny"])
EMBEDDED_PRESETS = ("tiny", "tiny-random")  # weights built in the worker, no model.path


# The real DiT configurations' dimensions (presets.py's DiTConfig, equal by test), for pricing a
# model before any worker builds it (placement/cost.py).
_WAN = {"freq_dim": 256, "text_dim": 4096, "text_len": 512, "in_channels": 16, "out_channels": 16}
DIT_DIMS = {
    "wan2.1-t2v-1.3b": {"dim": 1536, "ffn_dim": 8960, "num_heads": 12, "num_layers": 30, **_WAN},
    # text_len: CLIP's 257 image tokens; text_dim: their width (through img_emb)
    "matrix-game-2": {
        "dim": 1536,
        "ffn_dim": 8960,
        "num_heads": 12,
        "num_layers": 30,
        **_WAN,
        "in_channels": 36,
        "text_len": 257,
        "text_dim": 1280,
    },
    "wan2.1-t2v-14b": {"dim": 5120, "ffn_dim": 13824, "num_heads": 40, "num_layers": 40, **_WAN},
    "wan2.2-ti2v-5b": {
        "dim": 3072,
        "ffn_dim": 14336,
        "num_heads": 24,
        "num_layers": 30,
        **_WAN,
        "in_channels": 48,
        "out_channels": 48,
    },
}


def preset_facts(name: str) -> dict:
    """PRESET_FACTS of a DiT configuration, or of a checkpoint preset (its DiT's, with its block)."""
    # i2v: whether the model conditions on an image (presets.image_to_video; the embedded default does);
    # controls: the control space of a world model (controls.SPACES), absent for the others
    if name in PRESET_FACTS:
        return {**PRESET_FACTS[name], "i2v": name == "tiny"}
    cp = checkpoint_preset(name)
    if cp is None:
        raise KeyError(name)
    facts = {**PRESET_FACTS[cp.dit], "frames_per_block": cp.frames_per_block, "i2v": cp.i2v}
    if not cp.image_block:  # the image is no block of its own
        facts["image_block"] = False
    if cp.image == "condition":  # Matrix-Game: the image conditions every block, and there is no prompt
        facts["text"] = False
    return {**facts, "controls": cp.controls} if cp.controls else facts


DECODERS = ("wan", "taehv")  # the latent decoders a daemon can serve with (--decoder)


def known_presets() -> list[str]:
    return [*PRESET_FACTS, *CHECKPOINT_PRESETS]
