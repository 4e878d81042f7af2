"""Model presets and how to build or load each stage (used by the worker processes and tools).

- `tiny`: the embedded default. The real Wan 2.1 architecture (same blocks, RoPE, causal VAE
  with temporal upsampling and middle attention) at small widths, a byte-level text encoder,
  weights drawn from a fixed seed, or trained on the synthetic grammar (synthetic.py;
  tools/train/default.py) where the package ships them (`weights/tiny-vae.safetensors`,
  `weights/tiny-dit.safetensors`, written by tools/train/default.py export; none yet): they replace
  the seeded ones stage by stage, and the DiT's
  file names the depth, text length and sampler settings it was trained with (`trained_dit`).
  The whole daemon streams on a laptop CPU with the real stage balance: the DiT's share of the
  work per block is set by `dit_vae_ratio` (default 0.74, the ratio the reference implementation
  measured for the real 1.3B model on one Intel B70: 0.957 s DiT vs 1.290 s VAE per latent
  frame), which is the trained DiT's depth.
- `tiny-random`: the same architecture with the seeded weights always (frames of coloured noise),
  at any `dit_vae_ratio`, for the benchmarks built on them (issue 36).
- `wan2.1-t2v-1.3b`: the real configuration; weights from a local directory (original Wan 2.1
  release, or the diffusers layout), optionally with a Causal Forcing / Self-Forcing generator
  checkpoint for the DiT.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import msgspec
import torch

from ..card import ModelCard
from ..controls import MATRIX_GAME
from .catalog import CheckpointPreset, checkpoint_preset
from .shipped import WEIGHTS_DIR, embedded_weights, trained_header
from .spec import DECODERS, ModelSpec, known_presets, preset_card
from .wan.action import ActionConfig
from .wan.dit import DiTConfig, WanDiT
from .wan.loading import (
    CheckpointError,
    check_keys,
    dit_config_from_json,
    load_into,
    normalize_dit_state_dict,
    normalize_vae_state_dict,
    read_config,
    read_state_dict,
    read_state_dicts,
    select_weight_set,
    strip_prefixes,
    vae_config_from_json,
    vae_config_from_state_dict,
)
from .wan.lora import merge_lora_file
from .wan.quantized import refuse_quantized
from .wan.sampler import SamplerConfig
from .wan.taehv import TINY_TAEHV, TAEHVDecoder, load_taehv, published_config, random_taehv
from .wan.text import TinyTextEncoder, UMT5TextEncoder
from .wan.vae import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD, VAEConfig, WanVAEDecoder
from .wan.vae_encoder import WanVAEEncoder, encoder_state_dict

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

# Calibration of the tiny preset's DiT depth, as fractions of one VAE decode per steady-state
# block at the default 256x144 (full attention window, 4 steps + the cache refresh): each DiT
# layer costs TINY_LAYER_FRACTION, the rest of the DiT (embeddings, head, sampler)
# TINY_DIT_OVERHEAD_FRACTION. Measured with tools/bench/models.py --calibrate on this project's
# 2-core CI machine (fp32, one thread per stage).
# Both stages are compute-bound fp32 on the same core, so the fractions carry across CPUs far
# better than either time does.
TINY_LAYER_FRACTION = 0.12
TINY_DIT_OVERHEAD_FRACTION = 0.015


@dataclass(frozen=True)
class Preset:
    name: str
    dit: DiTConfig
    vae: VAEConfig
    sampler: SamplerConfig
    text_encoder: str  # "tiny" | "umt5"
    default_size: tuple[int, int]  # (width, height)
    fps: int = 16  # the frame rate the model was trained at
    embedded: bool = False  # weights are generated, not loaded
    checkpoint: CheckpointPreset | None = None  # the published checkpoint this preset runs (catalog.py)

    def card(self) -> ModelCard:
        """The model as built: its preset's card, with the geometry, block, window and dimensions
        this configuration and the weights' own config.json gave it."""
        d, s, card = self.dit, self.sampler, preset_card(self.name)
        dims = None
        if not self.embedded:  # the context: the prompt's tokens, or an image model's CLIP tokens (the card's count)
            context = {"text_dim": d.image_dim} if d.image_dim else {"text_dim": d.text_dim, "text_len": d.text_len}
            same = ("dim", "ffn_dim", "num_heads", "num_layers", "freq_dim", "in_channels", "out_channels")
            dims = msgspec.structs.replace(card.dims, **{k: getattr(d, k) for k in same}, **context)
        return msgspec.structs.replace(
            card,
            latent_channels=d.out_channels,
            spatial_factor=self.vae.spatial_factor,
            temporal_factor=self.vae.temporal_factor,
            size_multiple=self.vae.spatial_factor * d.patch_size[1],
            frames_per_block=s.frames_per_block,
            steps=len(s.steps),
            fps=self.fps,
            default_size=tuple(self.default_size),
            window_frames=s.window_frames,
            sink_frames=s.sink_frames,
            dims=dims,
        )


def tiny_layers(ratio: float) -> int:
    if not 0 < ratio <= 20:
        raise ValueError(f"dit_vae_ratio must be in (0, 20], got {ratio}")
    return max(1, round((ratio - TINY_DIT_OVERHEAD_FRACTION) / TINY_LAYER_FRACTION))


# Wan 2.1 T2V 14B (Wan-AI/Wan2.1-T2V-14B config.json): the 1.3B's blocks, wider and deeper.
WAN_14B = DiTConfig(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40)
# Wan 2.2 TI2V 5B (Wan-AI/Wan2.2-TI2V-5B config.json): the 1.3B's blocks at width 3072 (24 heads
# of 128) on the Wan 2.2 VAE's 48 latent channels. Its timestep is per frame (an image-to-video
# start frame at t = 0), which WanDiT takes as (B, frames) already.
WAN22_5B = DiTConfig(dim=3072, ffn_dim=14336, num_heads=24, num_layers=30, in_channels=48, out_channels=48)
# Its VAE (Wan2.2_VAE.pth; diffusers' AutoencoderKLWan with is_residual, patch_size 2): encoder
# width 160, decoder 256, 48 latent channels, 16x in space.
WAN22_VAE = VAEConfig(
    base_dim=160,
    decoder_base_dim=256,
    z_dim=48,
    residual=True,
    patch_size=2,
    latents_mean=WAN22_LATENTS_MEAN,
    latents_std=WAN22_LATENTS_STD,
)
# Matrix-Game 2.0's (configs/distilled_model/*/config.json): the 1.3B's blocks, 36 channels in,
# CLIP ViT-H's 1280-wide image tokens as the context; its action modules come with its preset.
MATRIX_GAME_DIT = DiTConfig(in_channels=36, out_channels=16, image_dim=1280)
# The Wan DiT configurations a local weights directory serves: DiT, VAE, default size, fps.
WAN_ARCHS = {
    "matrix-game-2": (MATRIX_GAME_DIT, VAEConfig(), (640, 352), 12),
    "wan2.1-t2v-1.3b": (DiTConfig(), VAEConfig(), (832, 480), 16),
    "wan2.1-t2v-14b": (WAN_14B, VAEConfig(), (832, 480), 16),
    "wan2.2-ti2v-5b": (WAN22_5B, WAN22_VAE, (1280, 704), 24),
}


def get_preset(spec: ModelSpec) -> Preset:
    """The preset a spec names: a DiT configuration, or a published checkpoint (catalog.py) on its
    DiT configuration with the authors' sampler settings; then the spec's own overrides."""
    cp = checkpoint_preset(spec.preset)
    arch = cp.dit if cp else spec.preset
    if arch in ("tiny", "tiny-random"):
        dit = DiTConfig(
            dim=64,
            ffn_dim=256,
            freq_dim=64,
            num_heads=2,
            num_layers=tiny_layers(spec.dit_vae_ratio),
            text_dim=64,
            text_len=32,
        )
        vae = VAEConfig(base_dim=8, num_res_blocks=0)
        sampler = SamplerConfig(frames_per_block=3, window_frames=12)
        trained = trained_dit(arch)
        if trained is not None:  # the shipped weights' own depth, text length and sampler
            if trained.config.num_layers != dit.num_layers:
                raise ValueError(
                    f"dit_vae_ratio {spec.dit_vae_ratio} asks for a {dit.num_layers}-layer DiT; the trained "
                    f"'{arch}' has {trained.config.num_layers} (dit_vae_ratio {ModelSpec().dit_vae_ratio}): "
                    "other depths are preset 'tiny-random' (seeded weights)"
                )
            dit, sampler = trained.config, replace(sampler, **trained.sampler)
        p = Preset(arch, dit, vae, sampler, "tiny", (256, 144), embedded=True)
    elif arch in WAN_ARCHS or arch == "wan2.1":
        arch = arch if arch != "wan2.1" else "wan2.1-t2v-1.3b"
        dit, vae, size, fps = WAN_ARCHS[arch]
        p = Preset(arch, dit, vae, SamplerConfig(), "none" if dit.image_dim else "umt5", size, fps=fps)
        if spec.path is None:
            raise ValueError(f"preset {spec.preset} needs a local weights directory (--model PATH)")
        root = Path(spec.path)
        if not root.is_dir():
            raise ValueError(f"model directory not found: {root}")
        # Configs written next to the weights win over the preset (other sizes of the family).
        tcfg = read_config(root / "transformer") or read_config(root)
        p = replace(
            p, dit=dit_config_from_json(tcfg, p.dit), vae=vae_config_from_json(read_config(root / "vae"), p.vae)
        )
        if p.dit.image_dim:  # the context's width is the image encoder's
            icfg = read_config(root / "image_encoder")
            p = replace(p, dit=replace(p.dit, image_dim=icfg.get("hidden_size", p.dit.image_dim)))
    else:
        raise ValueError(f"unknown model preset {spec.preset!r} (known: {', '.join(known_presets())})")
    if cp is not None:
        p = replace(p, name=cp.name, checkpoint=cp, sampler=replace(p.sampler, **cp.sampler_settings()))
        if cp.prope:
            p = replace(p, dit=replace(p.dit, prope=True))
        if cp.controls in MATRIX_GAME:
            p = replace(p, dit=replace(p.dit, action=_action_config(cp, p.dit.action)))
    if spec.default_size:
        p = replace(p, default_size=tuple(spec.default_size))
    if spec.sampler:
        unknown = set(spec.sampler) - set(SamplerConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown sampler option(s): {sorted(unknown)}")
        vals = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.sampler.items()}
        p = replace(p, sampler=replace(p.sampler, **vals))
    p.sampler.validate()
    return p


def _action_config(cp: CheckpointPreset, given: ActionConfig | None) -> ActionConfig:
    """A Matrix-Game preset's action modules: its space's keys and mouse, at the sizes of a
    `config.json` beside the weights where there is one (else the release's). A config of another
    action space is refused, naming the preset it belongs to."""
    space = MATRIX_GAME[cp.controls]
    want = (len(space.keys), space.mouse)
    if given is None:
        return ActionConfig(keyboard_dim=want[0], mouse=want[1])
    if given.keyboard_dim == -1 or given.mouse is None:  # sizes only: the keys and mouse are the preset's
        return replace(given, keyboard_dim=want[0], mouse=want[1])
    if (given.keyboard_dim, given.mouse) != want:
        got = _space_words(given.keyboard_dim, given.mouse)
        raise ValueError(f"the model's config.json has {got}: {cp.name} takes {_space_words(*want)}")
    return given


def _space_words(keys: int, mouse: bool) -> str:
    """An action space in words, with the preset it is (a file for another is named by it)."""
    words = f"a keyboard of {keys} keys{' and a mouse' if mouse else ', no mouse'}"
    for name, space in MATRIX_GAME.items():
        if (len(space.keys), space.mouse) == (keys, mouse):
            return f"{words} ({name.replace('matrix-game-', 'matrix-game-2-')}'s)"
    return words


def check_action_space(sd: dict, preset: Preset) -> None:
    """A Matrix-Game file's action space (its keyboard embedding's inputs, whether it has a mouse
    path), refused by name where it is another preset's."""
    a = preset.dit.action
    kb = sd.get(f"blocks.{a.blocks[0]}.action_model.keyboard_embed.0.weight")
    got = (int(kb.shape[1]) if kb is not None else 0, f"blocks.{a.blocks[0]}.action_model.mouse_mlp.0.weight" in sd)
    if got != (a.keyboard_dim, a.mouse):
        raise CheckpointError(
            f"DiT checkpoint: its action modules take {_space_words(*got)}; preset {preset.name} takes "
            f"{_space_words(a.keyboard_dim, a.mouse)}"
        )


@dataclass(frozen=True)
class TrainedDiT:
    """The shipped trained DiT and text encoder of an embedded preset (one file, `dit.*` and
    `text.*` tensors) and, from its metadata, the configuration and sampler settings it was
    trained with, which the preset then runs."""

    path: Path
    config: DiTConfig
    sampler: dict
    text_layers: int = 1  # TinyTextEncoder's


def trained_dit(preset: str, root: Path = WEIGHTS_DIR) -> TrainedDiT | None:
    try:
        found = trained_header(preset, root)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if found is None:
        return None
    path, head = found
    try:
        cfg = DiTConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in head["dit"].items()})
    except TypeError as exc:
        raise CheckpointError(f"{path}: not the embedded default's trained DiT ({exc!r})") from None
    return TrainedDiT(path, cfg, head["sampler"], int(head["text"].get("layers", 1)))


def load_trained_part(model: torch.nn.Module, path: Path, part: str) -> None:
    """The `part.*` tensors ("dit" or "text") of a trained DiT file into `model`, whole or refused."""
    from safetensors.torch import load_file

    try:
        sd = load_file(str(path))
    except Exception as exc:
        raise CheckpointError(f"cannot read embedded DiT weights {path}: {exc}") from exc
    prefix = f"{part}."
    load_into(model, {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}, f"{path} ({part})")


def load_embedded_vae(model: WanVAEDecoder, path: Path) -> None:
    """A trained decoder's weights and its latent statistics (`mean`, `std`, which the DiT's
    training data set) into `model`; a file that does not fit the preset is refused whole."""
    from safetensors.torch import load_file

    try:
        sd = load_file(str(path))
    except Exception as exc:
        raise CheckpointError(f"cannot read embedded VAE weights {path}: {exc}") from exc
    stats = {k: sd.pop(k, None) for k in ("mean", "std")}
    shape = tuple(model.mean.shape)
    if any(v is None or tuple(v.shape) != shape for v in stats.values()):
        raise CheckpointError(f"{path}: embedded VAE weights need 'mean' and 'std' of shape {shape}")
    load_into(model, sd, f"embedded VAE weights {path}")
    model.mean.copy_(stats["mean"])
    model.std.copy_(stats["std"])


def weight_set(spec: ModelSpec, preset: Preset) -> str:
    """The training checkpoint's set to load: the spec's, else the preset's, else the EMA."""
    return spec.weights or (preset.checkpoint.weights if preset.checkpoint else "ema")


def resolve_dtype(spec: ModelSpec, device: str) -> torch.dtype:
    if spec.dtype == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    if spec.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {spec.dtype!r} (use float32, bfloat16 or float16)")
    return DTYPES[spec.dtype]


# ----------------------------------------------------------------------------- building stages


def _dit_weights(spec: ModelSpec, preset: Preset) -> dict[str, torch.Tensor]:
    """The DiT's tensors; a safetensors file's stay in it until `load_into` copies them."""
    if spec.dit_checkpoint:
        p = Path(spec.dit_checkpoint)
        if p.suffix in (".pt", ".pth", ".bin"):
            try:
                obj = torch.load(str(p), map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:
                raise CheckpointError(f"cannot read checkpoint {p}: {exc}") from exc
            return select_weight_set(obj, str(p), weight_set(spec, preset), explicit=spec.weights is not None)
        return read_state_dict(p, stored=True)
    root = Path(spec.path)
    if (root / "transformer").is_dir():
        return read_state_dict(root / "transformer", stored=True)
    files = sorted(root.glob("diffusion_pytorch_model*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no DiT weights (transformer/ or diffusion_pytorch_model*.safetensors)")
    return read_state_dicts(files, stored=True)


def _vae_weights(spec: ModelSpec) -> dict[str, torch.Tensor]:
    root = Path(spec.path)
    if (root / "vae").is_dir():
        return read_state_dict(root / "vae")
    # the releases' own files: Wan2.1_VAE.pth, and Wan 2.2 TI2V 5B's Wan2.2_VAE.pth
    files = sorted(root.glob("Wan2.[0-9]_VAE*.pth")) + sorted(root.glob("*VAE*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no VAE weights (vae/, Wan2.1_VAE.pth or Wan2.2_VAE.pth)")
    return read_state_dict(files[0])


def _release_vae_config(raw: dict[str, torch.Tensor], base: VAEConfig) -> VAEConfig:
    """A release's VAE file carries no config: its widths off its weights, the decoder's keys and
    the encoder's first conv (which the decoder's normalised keys leave out)."""
    enc = {k: v for k, v in strip_prefixes(raw).items() if k == "encoder.conv1.weight"}
    return vae_config_from_state_dict({**normalize_vae_state_dict(raw, base), **enc}, base)


def build_dit(spec: ModelSpec, device: str = "cpu") -> tuple[WanDiT, Preset]:
    preset = get_preset(spec)
    dtype = resolve_dtype(spec, device)
    if preset.embedded:
        if spec.lora:
            raise ValueError(f"a LoRA needs a loaded model; preset {preset.name!r} generates its weights")
        torch.manual_seed(spec.seed)
        model = WanDiT(preset.dit)
        trained = trained_dit(preset.name)
        if trained is not None:
            load_trained_part(model, trained.path, "dit")
        model.cast(dtype).to(device)
    else:
        # Straight to the device in the served dtype: the parameters are made there once, each
        # filled from its file (`load_into`), with no float32 copy of the model on the host.
        sd = _dit_weights(spec, preset)
        refuse_quantized(sd, spec.dit_checkpoint or spec.path)
        sd = normalize_dit_state_dict(sd)
        if preset.dit.action is not None:
            check_action_space(sd, preset)
        if spec.lora:
            lora = preset.checkpoint.lora if preset.checkpoint else None
            alpha = spec.lora_alpha or (lora.alpha if lora else None)
            sd = merge_lora_file(sd, spec.lora, alpha, spec.lora_rank or (lora.rank if lora else None))
        with torch.device("meta"):
            model = WanDiT(preset.dit).cast(dtype)
        check_keys(model, sd, "DiT checkpoint")  # before any memory is taken
        model.to_empty(device=device)
        load_into(model, sd, "DiT checkpoint")
    return model.eval().requires_grad_(False), preset


def describe_load(spec: ModelSpec, preset: Preset) -> dict:
    """What the DiT was built from, as the log, /health and /v1/models say it: the preset, its
    DiT configuration, the checkpoint file and weight set, the LoRA, the sampler's settings."""
    cp, lora = preset.checkpoint, None
    if spec.lora:
        own = cp.lora if cp else None
        lora = {
            "file": spec.lora,
            "alpha": spec.lora_alpha or (own.alpha if own else None),
            "rank": spec.lora_rank or (own.rank if own else None),
        }
    return {
        "preset": preset.name,
        "dit": cp.dit if cp else preset.name,
        "source": cp.source if cp else None,
        "weights_dir": spec.path,
        "checkpoint": spec.dit_checkpoint,
        "weights": weight_set(spec, preset) if spec.dit_checkpoint else None,
        "lora": lora,
        "embedded": preset.embedded,
        # The embedded default's shipped trained DiT (its file), None where its weights are seeded.
        "trained": _trained_name(preset),
        "decoder": describe_decoder(spec, preset),
        "compile": spec.compile,
        "sampler": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(preset.sampler).items()},
    }


def _trained_name(preset: Preset) -> str | None:
    trained = trained_dit(preset.name) if preset.embedded else None
    return trained.path.name if trained else None


def describe_decoder(spec: ModelSpec, preset: Preset) -> dict:
    """Which latent decoder serves, and from what (/health, /v1/models, the log)."""
    if spec.decoder == "taehv":
        return {"name": "taehv", "weights": spec.decoder_weights, "embedded": spec.decoder_weights is None}
    vae = embedded_weights(preset.name, "vae") if preset.embedded else None
    # the embedded default's shipped trained decoder (its file), None where its weights are seeded
    return {"name": "wan", "weights": spec.path, "embedded": preset.embedded, "trained": vae.name if vae else None}


def build_taehv(spec: ModelSpec, preset: Preset, device: str = "cpu") -> TAEHVDecoder:
    """TAEHV from `decoder_weights` (the published file's widths), or, for the embedded default
    only, at its small widths with weights drawn from the default's seed."""
    if spec.decoder_weights:
        model = load_taehv(spec.decoder_weights, published_config(preset.dit.out_channels))
    elif preset.embedded:
        model = random_taehv(TINY_TAEHV, seed=spec.seed + 3)
    else:
        name = "taew2_2" if preset.dit.out_channels == 48 else "taew2_1"
        raise ValueError(
            f"--decoder taehv with preset {preset.name!r} needs its weights: --decoder-weights FILE "
            f"({name}.pth or {name}.safetensors from madebyollin/taehv)"
        )
    return model.to(device=device, dtype=resolve_dtype(spec, device)).eval().requires_grad_(False)


def build_vae(spec: ModelSpec, device: str = "cpu") -> tuple[WanVAEDecoder | TAEHVDecoder, Preset]:
    """The latent decoder `spec.decoder` names: the Wan 2.1 VAE or TAEHV (same latents, same
    frame counts: `preset.vae` holds the factors both share)."""
    preset = get_preset(spec)
    if spec.decoder not in DECODERS:
        raise ValueError(f"unknown decoder {spec.decoder!r} (use {' or '.join(DECODERS)})")
    if spec.decoder == "taehv":
        return build_taehv(spec, preset, device), preset
    dtype = resolve_dtype(spec, device)
    if preset.embedded:
        torch.manual_seed(spec.seed + 1)
        model = WanVAEDecoder(preset.vae)
        trained = embedded_weights(preset.name, "vae")
        if trained is not None:
            load_embedded_vae(model, trained)
    else:
        raw = _vae_weights(spec)
        sd = normalize_vae_state_dict(raw, preset.vae)
        if not (Path(spec.path) / "vae" / "config.json").exists():  # original release: no config
            preset = replace(preset, vae=_release_vae_config(raw, preset.vae))
        with torch.device("meta"):
            model = WanVAEDecoder(preset.vae)
        model.to_empty(device="cpu")
        model.mean.copy_(torch.tensor(preset.vae.latents_mean).view(1, -1, 1, 1, 1))
        model.std.copy_(torch.tensor(preset.vae.latents_std).view(1, -1, 1, 1, 1))
        load_into(model, sd, "VAE checkpoint")
    model = model.to(device=device, dtype=dtype)
    model.mean, model.std = model.mean.float(), model.std.float()
    return model.eval().requires_grad_(False), preset


def build_image_encoder(spec: ModelSpec, device: str = "cpu"):
    """Matrix-Game's CLIP image encoder (wan/clip.py): `image_encoder/` beside the VAE, in
    transformers' layout (Wan-AI's I2V diffusers releases ship the same ViT-H/14 there)."""
    from .wan.clip import ClipImageEncoder

    root = Path(spec.path) / "image_encoder"
    if not root.is_dir():
        raise CheckpointError(f"{spec.path}: no image_encoder/ (the CLIP ViT-H/14 vision model, transformers' layout)")
    return ClipImageEncoder(root, device, resolve_dtype(spec, device))


def build_vae_encoder(spec: ModelSpec, device: str = "cpu") -> WanVAEEncoder:
    """The VAE's encoder half, for image-to-video: the release's `encoder.*`/`conv1.*` (or
    diffusers' `encoder.*`/`quant_conv.*`); the embedded default's from its own seed."""
    preset = get_preset(spec)
    dtype = resolve_dtype(spec, device)
    if preset.embedded:
        torch.manual_seed(spec.seed + 3)
        model = WanVAEEncoder(preset.vae)
    else:
        raw = _vae_weights(spec)
        cfg = preset.vae
        if not (Path(spec.path) / "vae" / "config.json").exists():  # original release: no config
            cfg = _release_vae_config(raw, cfg)
        with torch.device("meta"):
            model = WanVAEEncoder(cfg)
        model.to_empty(device="cpu")
        model.mean.copy_(torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1))
        model.std.copy_(torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1))
        load_into(model, encoder_state_dict(raw, cfg), "VAE checkpoint (encoder)")
    model = model.to(device=device, dtype=dtype)
    model.mean, model.std = model.mean.float(), model.std.float()
    return model.eval().requires_grad_(False)


def build_text_encoder(spec: ModelSpec, device: str = "cpu"):
    """The preset's text encoder; None for a model without text (Matrix-Game's image context)."""
    preset = get_preset(spec)
    if preset.text_encoder == "none":
        return None
    if preset.text_encoder == "tiny":
        trained = trained_dit(preset.name)
        layers = trained.text_layers if trained is not None else 1
        text = TinyTextEncoder(preset.dit.text_dim, preset.dit.text_len, seed=spec.seed + 2, layers=layers)
        if trained is not None:
            load_trained_part(text, trained.path, "text")
        return text.to(device)
    return UMT5TextEncoder(spec.path, preset.dit.text_len, device, resolve_dtype(spec, device))
