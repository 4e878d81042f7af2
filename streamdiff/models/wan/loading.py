"""Checkpoint reading and key mapping for Wan 2.1 models (runs in the worker processes).

Our modules use the original Wan 2.1 key names. Accepted inputs:

- original Wan 2.1: `diffusion_pytorch_model.safetensors` (+ `config.json`) for the DiT,
  `Wan2.1_VAE.pth` for the VAE (its encoder and quant conv are skipped: we only decode);
- diffusers: `WanTransformer3DModel` / `AutoencoderKLWan` directories (`config.json` and
  `diffusion_pytorch_model*.safetensors`, sharded or not), or their state dicts;
- Causal Forcing / Self-Forcing / LongLive: a `torch.save` dict with `generator` and `generator_ema`
  (one of them chosen: `select_weight_set`), keys prefixed `model.`, with the segments training
  wrappers add anywhere in a key (`_fsdp_wrapped_module.`, `_checkpoint_wrapped_module.`,
  `_orig_mod.`), original names inside.

Every mismatch (missing key, unexpected key, wrong shape) is collected and raised once as a
`CheckpointError` that names them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from .action import ActionConfig
from .dit import DiTConfig
from .vae import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD, VAEConfig


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model, with every offending key named."""


# ----------------------------------------------------------------------------- reading files


def read_state_dicts(files, stored: bool = False) -> dict[str, torch.Tensor]:
    """The union of several files' tensors (a sharded checkpoint)."""
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(read_state_dict(f, stored))
    return out


def read_state_dict(path: str | Path, stored: bool = False) -> dict[str, torch.Tensor]:
    """Read a .safetensors, .pth/.pt/.bin file, or a directory of (sharded) safetensors.

    `stored`: a safetensors file's tensors stay in the file (`StoredTensor`, read as `load_into`
    copies each into its parameter), so that a model loads holding its weights once."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            files = sorted(p.glob("*.bin")) + sorted(p.glob("*.pth")) + sorted(p.glob("*.pt"))
        if not files:
            raise CheckpointError(f"no weight files (*.safetensors, *.bin, *.pth, *.pt) in {p}")
        return read_state_dicts(files, stored)
    if not p.exists():
        raise CheckpointError(f"checkpoint not found: {p}")
    try:
        if p.suffix == ".safetensors":
            if stored:
                return stored_tensors(p)
            from safetensors.torch import load_file

            return load_file(str(p))
        obj = torch.load(str(p), map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # corrupted or truncated files surface here
        raise CheckpointError(f"cannot read checkpoint {p}: {exc}") from exc
    return select_weight_set(obj, str(p), explicit=False)


# safetensors' own dtype names (the format's header).
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,  # read so that a quantized file is refused by name (refuse_quantized)
    "F8_E5M2": torch.float8_e5m2,
}


class StoredTensor:
    """A tensor still in its safetensors file: its shape and dtype from the file's header, its
    bytes read when it is copied into a parameter (`copy_into`).

    Written here rather than with safetensors' own reader because that one maps the file: a
    whole model read through it holds every page of the file in the process beside the
    parameters (a float32 release is twice the bfloat16 model), where reading each tensor into
    its parameter (or through one buffer when it is cast or goes to a device) holds the model
    once. The format is a length, a JSON header and raw little-endian bytes (safetensors' spec)."""

    __slots__ = ("path", "start", "nbytes", "dtype", "shape")

    def __init__(self, path: Path, start: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.path, self.start, self.nbytes, self.dtype, self.shape = path, start, nbytes, dtype, torch.Size(shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def _read(self, f, into: torch.Tensor) -> None:
        f.seek(self.start)
        buf = memoryview(into.view(-1).view(torch.uint8).numpy())
        if f.readinto(buf) != self.nbytes:
            raise CheckpointError(f"{self.path}: truncated (a tensor's bytes end past the file)")

    def load(self) -> torch.Tensor:
        """A CPU tensor of it (the LoRA merge's arithmetic)."""
        out = torch.empty(self.shape, dtype=self.dtype)
        with open(self.path, "rb") as f:
            self._read(f, out)
        return out

    def copy_into(self, dest: torch.Tensor, f, staging: list) -> None:
        """Into `dest` (any dtype, any device): straight into its memory when it is a contiguous
        CPU tensor of the file's dtype, else through `staging` (one buffer, grown as needed)."""
        if dest.device.type == "cpu" and dest.dtype == self.dtype and dest.is_contiguous():
            self._read(f, dest)
            return
        if not staging or staging[0].numel() < self.nbytes:
            staging[:] = [torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=dest.device.type == "cuda")]
        raw = staging[0][: self.nbytes]
        self._read(f, raw)
        dest.copy_(raw.view(self.dtype).view(self.shape))


def stored_tensors(p: Path) -> dict[str, StoredTensor]:
    """A safetensors file's tensors, left in the file (`StoredTensor`)."""
    try:
        with open(p, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= 100 * 2**20:
                raise ValueError(f"header length {n}")
            header = json.loads(f.read(n))
        size, base, out = p.stat().st_size, 8 + n, {}
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            lo, hi = entry["data_offsets"]
            dtype = _ST_DTYPES[entry["dtype"]]
            shape = tuple(entry["shape"])
            if not (0 <= lo <= hi and base + hi <= size and hi - lo == math.prod(shape) * dtype.itemsize):
                raise ValueError(f"tensor {key}: bytes {lo}-{hi} do not fit its shape, or end past the file")
            out[key] = StoredTensor(p, base + lo, hi - lo, dtype, shape)
        return out
    except (OSError, ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"cannot read checkpoint {p}: not a whole safetensors file ({exc})") from exc


# The weight sets of a training checkpoint (Self-Forcing, Causal Forcing, LongLive, ...).
WEIGHT_SET_KEYS = {"ema": "generator_ema", "generator": "generator"}


def select_weight_set(obj, origin: str = "checkpoint", weights: str = "ema", explicit: bool = True) -> dict:
    """The chosen set of a training checkpoint holding {'generator', 'generator_ema', ...}.

    A file that holds weight sets but not the chosen one is refused, naming the sets it has,
    where the set was chosen (a preset or --weights); otherwise the other set is taken. A file
    without sets ({'state_dict'}, {'model'}, or a plain state dict) is the weights themselves."""
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{origin}: expected a state dict, found {type(obj).__name__}")
    if weights not in WEIGHT_SET_KEYS:
        raise CheckpointError(f"unknown weight set {weights!r} (use ema or generator)")
    sets = [k for k in ("generator_ema", "generator") if isinstance(obj.get(k), Mapping)]
    if sets:
        key = WEIGHT_SET_KEYS[weights]
        if key not in sets:
            if explicit:
                held = ", ".join(k for k in obj if isinstance(obj[k], Mapping))
                raise CheckpointError(f"{origin} has no {key!r} weight set (--weights {weights}); it holds: {held}")
            key = sets[0]
        return unwrap_state_dict(obj[key], origin)
    if explicit and weights == "ema":
        raise CheckpointError(f"{origin} holds no weight sets (generator, generator_ema): --weights ema needs one")
    return unwrap_state_dict(obj, origin)


def unwrap_state_dict(obj, origin: str = "checkpoint") -> dict[str, torch.Tensor]:
    """{'state_dict'}, {'model'} or {'module'} containers unwrapped; plain state dicts pass through."""
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{origin}: expected a state dict, found {type(obj).__name__}")
    for key in ("state_dict", "model", "module"):
        if key in obj and isinstance(obj[key], Mapping):
            return unwrap_state_dict(obj[key], origin)
    bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{origin}: entries that are not tensors: {bad[:10]}")
    return dict(obj)


def read_config(directory: Path) -> dict:
    f = directory / "config.json"
    if not f.exists():
        return {}
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{f}: invalid JSON: {exc}") from exc


# ----------------------------------------------------------------------------- DiT keys


# Module names that training wrappers insert anywhere in a key: FSDP1 units
# (`model.blocks.0._fsdp_wrapped_module.self_attn.q.weight` in a Self-Forcing EMA), activation
# checkpointing, torch.compile. They name no weight of their own: drop the segment wherever it is.
_WRAPPER_SEGMENTS = re.compile(r"(?:^|(?<=\.))(?:_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")

# Leading prefixes of whole-model containers: the generator wrapper's `.model`, DDP's `module.`,
# LDM-style `diffusion_model.`, a PEFT model's `base_model.model.` (LoRA adapter files).
_PREFIXES = (
    "base_model.model.",
    "model.diffusion_model.",
    "diffusion_model.",
    "model.",
    "module.",
)

_DIT_DIFFUSERS = [
    (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"^condition_embedder\.time_proj\.", "time_projection.1."),
    (r"^scale_shift_table$", "head.modulation"),
    (r"^proj_out\.", "head.head."),
    (r"^blocks\.(\d+)\.scale_shift_table$", r"blocks.\1.modulation"),
    (r"^blocks\.(\d+)\.attn1\.", r"blocks.\1.self_attn."),
    (r"^blocks\.(\d+)\.attn2\.", r"blocks.\1.cross_attn."),
    (r"\.to_q\.", ".q."),
    (r"\.to_k\.", ".k."),
    (r"\.to_v\.", ".v."),
    (r"\.to_out\.0\.", ".o."),
    (r"^blocks\.(\d+)\.norm2\.", r"blocks.\1.norm3."),  # diffusers' norm2 is the cross-attn norm
    (r"^blocks\.(\d+)\.ffn\.net\.0\.proj\.", r"blocks.\1.ffn.0."),
    (r"^blocks\.(\d+)\.ffn\.net\.2\.", r"blocks.\1.ffn.2."),
]


def strip_key(key: str) -> str:
    """Training-wrapper segments removed wherever they are, then container prefixes in front."""
    key = _WRAPPER_SEGMENTS.sub("", key)
    changed = True
    while changed:
        changed = False
        for p in _PREFIXES:
            if key.startswith(p):
                key, changed = key[len(p) :], True
    return key


def strip_prefixes(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`strip_key` applied to every key."""
    return {strip_key(k): v for k, v in sd.items()}


def is_diffusers_dit(keys) -> bool:
    return any(k.startswith("condition_embedder.") or ".attn1." in k for k in keys)


def dit_key_from_diffusers(key: str) -> str:
    for pat, rep in _DIT_DIFFUSERS:
        key = re.sub(pat, rep, key)
    return key


def normalize_dit_state_dict(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Any accepted DiT layout -> original Wan 2.1 key names."""
    sd = strip_prefixes(sd)
    if is_diffusers_dit(sd):
        sd = {dit_key_from_diffusers(k): v for k, v in sd.items()}
    return sd


def dit_config_from_json(cfg: dict, base: DiTConfig | None = None) -> DiTConfig:
    """Read either an original Wan `config.json` or a diffusers transformer `config.json`."""
    base = base or DiTConfig()
    if "num_attention_heads" in cfg:  # diffusers
        heads = cfg["num_attention_heads"]
        return replace(
            base,
            dim=heads * cfg.get("attention_head_dim", 128),
            ffn_dim=cfg["ffn_dim"],
            freq_dim=cfg.get("freq_dim", 256),
            num_heads=heads,
            num_layers=cfg["num_layers"],
            in_channels=cfg.get("in_channels", 16),
            out_channels=cfg.get("out_channels", 16),
            text_dim=cfg.get("text_dim", 4096),
            text_len=base.text_len,
            patch_size=tuple(cfg.get("patch_size", (1, 2, 2))),
            eps=cfg.get("eps", 1e-6),
            rope_max_positions=cfg.get("rope_max_seq_len", 1024),
        )
    if "dim" in cfg:  # original Wan 2.1 (Matrix-Game's too: its action modules' sizes)
        a = cfg.get("action_config") or {}
        action = base.action
        if a:
            action = ActionConfig(  # the keys and the mouse, where not said (-1, None), are the preset's
                keyboard_dim=a.get("keyboard_dim_in", -1) if a.get("enable_keyboard", True) else 0,
                mouse=a.get("enable_mouse"),
                blocks=tuple(a.get("blocks", range(15))),
                hidden_size=a.get("hidden_size", 128),
                heads=a.get("heads_num", 16),
                keyboard_hidden_dim=a.get("keyboard_hidden_dim", 1024),
                mouse_hidden_dim=a.get("mouse_hidden_dim", 1024),
                windows_size=a.get("windows_size", 3),
                time_compression=a.get("vae_time_compression_ratio", 4),
                rope_dims=tuple(a.get("rope_dim_list", (8, 28, 28))),
                rope_theta=float(a.get("rope_theta", 256)),
            )
        return replace(
            base,
            dim=cfg["dim"],
            ffn_dim=cfg["ffn_dim"],
            freq_dim=cfg.get("freq_dim", 256),
            num_heads=cfg["num_heads"],
            num_layers=cfg["num_layers"],
            in_channels=cfg.get("in_dim", 16),
            out_channels=cfg.get("out_dim", 16),
            text_dim=cfg.get("text_dim", base.text_dim),
            text_len=cfg.get("text_len", base.text_len),
            patch_size=tuple(cfg.get("patch_size", (1, 2, 2))),
            eps=cfg.get("eps", 1e-6),
            action=action,
        )
    return base


# ----------------------------------------------------------------------------- VAE keys


_RES_DIFFUSERS = {
    "norm1": "residual.0",
    "conv1": "residual.2",
    "norm2": "residual.3",
    "conv2": "residual.6",
    "conv_shortcut": "shortcut",
}


def vae_key_from_diffusers(key: str, cfg: VAEConfig) -> str | None:
    """diffusers AutoencoderKLWan key -> original key; None for encoder-side keys we skip."""
    if key.startswith(("encoder.", "quant_conv.")):
        return None
    per_stage = cfg.num_res_blocks + 2  # resnets + one upsampler
    k = key.replace("post_quant_conv.", "conv2.", 1)
    k = k.replace("decoder.conv_in.", "decoder.conv1.", 1)
    k = k.replace("decoder.norm_out.", "decoder.head.0.", 1).replace("decoder.conv_out.", "decoder.head.2.", 1)
    k = k.replace("decoder.mid_block.attentions.0.", "decoder.middle.1.", 1)
    m = re.match(r"^decoder\.mid_block\.resnets\.(\d)\.(\w+)\.(.*)$", k)
    if m:
        k = f"decoder.middle.{2 * int(m[1])}.{_RES_DIFFUSERS[m[2]]}.{m[3]}"
    m = re.match(r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(\w+)\.(.*)$", k)
    if m and cfg.residual:  # Wan 2.2: one module per stage, its blocks then its upsampler
        k = f"decoder.upsamples.{m[1]}.upsamples.{m[2]}.{_RES_DIFFUSERS[m[3]]}.{m[4]}"
    elif m:
        k = f"decoder.upsamples.{int(m[1]) * per_stage + int(m[2])}.{_RES_DIFFUSERS[m[3]]}.{m[4]}"
    m = re.match(r"^decoder\.up_blocks\.(\d+)\.upsampler\.(.*)$", k)  # Wan 2.2's
    if m:
        k = f"decoder.upsamples.{m[1]}.upsamples.{cfg.num_res_blocks + 1}.{m[2]}"
    m = re.match(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.*)$", k)
    if m:
        k = f"decoder.upsamples.{int(m[1]) * per_stage + cfg.num_res_blocks + 1}.{m[2]}"
    return k


def normalize_vae_state_dict(sd: Mapping[str, torch.Tensor], cfg: VAEConfig) -> dict[str, torch.Tensor]:
    """Any accepted VAE layout -> original keys of the decoder half (`conv2.*`, `decoder.*`)."""
    sd = strip_prefixes(sd)
    diffusers = any(k.startswith(("post_quant_conv.", "decoder.up_blocks.", "decoder.conv_in.")) for k in sd)
    out = {}
    for k, v in sd.items():
        if diffusers:
            k = vae_key_from_diffusers(k, cfg)
        elif k.startswith(("encoder.", "conv1.")):
            k = None  # original encoder half and quant conv: not used for decoding
        if k is not None:
            out[k] = v
    return out


def vae_config_from_json(cfg: dict, base: VAEConfig | None = None) -> VAEConfig:
    base = base or VAEConfig()
    if not cfg:
        return base
    return VAEConfig(
        base_dim=cfg.get("base_dim", base.base_dim),
        z_dim=cfg.get("z_dim", base.z_dim),
        dim_mult=tuple(cfg.get("dim_mult", base.dim_mult)),
        num_res_blocks=cfg.get("num_res_blocks", base.num_res_blocks),
        temporal_downsample=tuple(cfg.get("temperal_downsample", base.temporal_downsample)),
        latents_mean=tuple(cfg.get("latents_mean", base.latents_mean)),
        latents_std=tuple(cfg.get("latents_std", base.latents_std)),
        decoder_base_dim=cfg.get("decoder_base_dim") or base.decoder_base_dim,
        residual=cfg.get("is_residual", base.residual),
        patch_size=cfg.get("patch_size") or base.patch_size,
    )


def vae_config_from_state_dict(sd: Mapping[str, torch.Tensor], base: VAEConfig) -> VAEConfig:
    """The original `Wan2.1_VAE.pth` ships without a config: read the widths off the weights
    (base width from the head norm, latent channels from `conv2`, blocks per stage from the
    first up stage), keeping the channel multipliers and temporal layout of `base`."""
    try:
        base_dim = sd["decoder.head.0.gamma"].shape[0]
        z_dim = sd["conv2.weight"].shape[0]
    except KeyError as exc:
        raise CheckpointError(f"VAE checkpoint lacks {exc.args[0]}: not a Wan 2.1 VAE decoder") from exc
    if "decoder.upsamples.0.upsamples.0.residual.0.gamma" in sd:  # Wan 2.2's stages
        blocks = sum(f"decoder.upsamples.0.upsamples.{j}.residual.0.gamma" in sd for j in range(64))
        rgb = sd["decoder.head.2.weight"].shape[0]
        enc = sd.get("encoder.conv1.weight")
        return replace(
            base,
            base_dim=base.base_dim if enc is None else enc.shape[0],
            decoder_base_dim=base_dim,
            z_dim=z_dim,
            num_res_blocks=blocks - 1,
            residual=True,
            patch_size=round((rgb // 3) ** 0.5),
            # the release's file has no config: its latents' statistics are Wan2_2_VAE's
            **(
                {}
                if len(base.latents_mean) == z_dim
                else {"latents_mean": WAN22_LATENTS_MEAN, "latents_std": WAN22_LATENTS_STD}
            ),
        )
    first_up = next((i for i in range(64) if f"decoder.upsamples.{i}.resample.1.weight" in sd), None)
    res_blocks = base.num_res_blocks if first_up is None else first_up - 1
    return replace(base, base_dim=base_dim, z_dim=z_dim, num_res_blocks=res_blocks)


# ----------------------------------------------------------------------------- applying


def _summarise(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def check_keys(model: nn.Module, sd: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise one `CheckpointError` naming every missing key, unexpected key and shape mismatch of
    `sd` against `model`; reads shapes only, so it runs on meta tensors (a 14B model unbuilt)."""
    own = model.state_dict()
    missing = sorted(k for k in own if k not in sd)
    unexpected = sorted(k for k in sd if k not in own)
    shapes = sorted(
        f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)
    )
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing: {_summarise(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: {_summarise(unexpected)}")
    if shapes:
        problems.append(f"{len(shapes)} with wrong shape: {_summarise(shapes)}")
    if problems:
        raise CheckpointError(f"{what} does not match the model config: " + "; ".join(problems))


def load_into(model: nn.Module, sd: Mapping[str, torch.Tensor], what: str) -> None:
    """Strictly copy `sd` (tensors, or `StoredTensor`s still in their file) into `model`, cast to
    each parameter's dtype on its device, or raise one `CheckpointError` naming every missing
    key, unexpected key and shape mismatch, or the tensors holding NaN or Inf.

    The NaN scan runs on the parameters, on their device, and is read once at the end: no host
    copy of a tensor in float32, no sync per tensor."""
    check_keys(model, sd, what)
    own = model.state_dict()
    finite, staging, files = [], [], {}
    try:
        with torch.no_grad(), _loading_threads():
            for k, t in own.items():
                src = sd[k]
                if isinstance(src, StoredTensor):
                    f = files.get(src.path) or files.setdefault(src.path, open(src.path, "rb"))  # noqa: SIM115
                    src.copy_into(t, f, staging)
                else:
                    t.copy_(src)
                finite.append(
                    torch.isfinite(t).all()
                    if t.is_floating_point()
                    else torch.ones((), dtype=torch.bool, device=t.device)
                )
    finally:
        for f in files.values():
            f.close()
    if finite:
        ok = torch.stack([x.to(finite[0].device) for x in finite]).tolist()
        bad = [k for k, good in zip(own, ok) if not good]
        if bad:
            raise CheckpointError(f"{what}: tensor {_summarise(bad)} holds NaN or Inf values")


@contextlib.contextmanager
def _loading_threads():
    """Every core this process may use while it copies and casts weights (a worker runs with
    the threads of its stage, often one), then the worker's own count again."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, len(os.sched_getaffinity(0))))
    try:
        yield
    finally:
        torch.set_num_threads(before)
