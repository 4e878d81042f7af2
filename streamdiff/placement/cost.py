"""A model's cost from its DiT configuration (supervisor and `streamdiffd plan`; plain arithmetic, no torch).

What the planner needs of a model it has no profile of: the bytes a DiT worker holds (weights,
each session's KV and prompt caches, the peak of one block's activations) and the work of one
block in FLOPs, so that a profile of one configuration prices another (the 1.3B's prices the
14B: same blocks, wider and deeper). The dimensions are those of `presets.py`'s `DiTConfig`s
(the model card's `dims`, checked equal in the tests), its steps, window and block the card's too.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from ..card import DiTDims, ModelCard
from ..models.spec import preset_card

GIB = 2**30
# umT5-XXL's encoder (the text encoder a real preset's DiT worker holds on its device): vocabulary
# 256384 x 4096, 24 layers of attention (4 x 4096 x 4096) and gated FFN (3 x 4096 x 10240), their
# norms, and each layer's relative-position table (32 buckets x 64 heads).
UMT5_XXL_ENCODER_PARAMS = 256384 * 4096 + 24 * (4 * 4096 * 4096 + 3 * 4096 * 10240 + 2 * 4096 + 32 * 64) + 4096


# CLIP ViT-H/14's vision tower (Matrix-Game's image encoder): 32 layers of width 1280 (attention
# and an MLP of 5120), its patch embedding and positions.
CLIP_VIT_H_PARAMS = 32 * (4 * 1280 * 1280 + 2 * 1280 * 5120 + 9 * 1280) + 3 * 14 * 14 * 1280 + 258 * 1280
# The parameters of the encoder a DiT worker holds for its context (ModelCard.context_encoder).
CONTEXT_ENCODER_PARAMS = {"umt5": UMT5_XXL_ENCODER_PARAMS, "clip": CLIP_VIT_H_PARAMS}


def action_params(dim: int, keys: int = 4) -> int:
    """One Matrix-Game action module at the release's sizes (models/wan/action.py)."""
    mouse = (24 + dim) * 1024 + 1024 + 1024 * 1024 + 1024 + 2048 + 1024 * 3072 + 1024 * dim
    keyboard = keys * 128 + 128 + 128 * 128 + 128 + dim * 1024 + 1536 * 2048 + 1024 * dim
    return mouse + keyboard


class DoesNotFit(ValueError):
    """The model cannot run on one device of this memory: the message names it and the numbers."""


@dataclass(frozen=True)
class ModelCost:
    name: str  # the preset priced
    dit: str  # its DiT configuration
    params: int  # DiT parameters
    text_params: int  # the text encoder's, held beside the DiT
    weight_bytes: int  # DiT + text encoder at the dtype
    session_bytes: int  # one session's KV window and prompt cache
    activation_bytes: int  # the peak of one block's forward
    block_flops: float  # one steady block: every pass of the sampler

    def needs(self, sessions: int = 1) -> int:
        return self.weight_bytes + self.activation_bytes + sessions * self.session_bytes

    def check(self, memory_bytes: int, sessions: int = 1) -> None:
        """Raise DoesNotFit naming the model and the numbers when `sessions` do not fit."""
        if self.needs(sessions) > memory_bytes:
            raise DoesNotFit(
                f"{self.name} ({self.dit}) needs {(self.weight_bytes + self.activation_bytes) / GIB:.1f} GiB for "
                f"weights + activations + {self.session_bytes / GIB:.2f} GiB per session; the device has "
                f"{memory_bytes / GIB:.1f} GiB"
            )


def dit_params(d: DiTDims) -> int:
    """Parameters of a Wan 2.1 DiT of dimensions `d` (the module tree of models/wan/dit.py)."""
    dim, ffn, layers, text_dim, freq = d.dim, d.ffn_dim, d.num_layers, d.text_dim, d.freq_dim
    out = d.out_channels * 4  # patch 1x2x2
    block = 8 * (dim * dim + dim) + 4 * dim + 2 * dim * ffn + ffn + dim + 2 * dim + 6 * dim
    embed = (d.in_channels * 4 * dim + dim) + (text_dim * dim + dim + dim * dim + dim)
    embed += (freq * dim + dim + dim * dim + dim) + (6 * dim * dim + 6 * dim)
    head = dim * out + out + 2 * dim
    return layers * block + embed + head


def block_flops(d: DiTDims, tpf: int, frames: int, window: int, passes: int, paths: int = 1) -> float:
    """Multiply-adds x 2 of one block: per pass, every token of the block through each layer's
    projections (self q/k/v/o, cross q/o: the prompt's k/v are cached) and FFN, and attention
    over the window's tokens (self) and the prompt's (cross). `paths` 2: PRoPE's second
    self-attention and its output projection (its 4x4 transforms are a few per cent of one)."""
    dim, ffn, layers, text_len = d.dim, d.ffn_dim, d.num_layers, d.text_len
    n = tpf * frames
    linear = 2 * n * ((5 + paths) * dim * dim + 2 * dim * ffn)
    attn = 4 * n * dim * (paths * window * tpf + text_len)
    return float(passes * layers * (linear + attn))


def model_cost(preset: str | ModelCard, size: tuple[int, int], dtype_bytes: int = 2) -> ModelCost:
    """The cost of `preset` (a name, or a card) at frame size `size` with weights and caches of `dtype_bytes`."""
    card = preset_card(preset) if isinstance(preset, str) else preset
    d = card.dims
    if d is None:
        raise ValueError(f"no DiT dimensions for {card.name!r}: its depth is configured, it is priced by its profile")
    passes, window, frames = card.steps + 1, card.window_frames, card.frames_per_block  # the steps + the clean pass
    tpf = card.tokens_per_frame(*size)
    paths = card.kv_caches  # minWM's PRoPE: a second attention and cache
    params = dit_params(d) + (paths - 1) * d.num_layers * (d.dim**2 + d.dim)
    text = CONTEXT_ENCODER_PARAMS[card.context_encoder]
    kv = paths * d.num_layers * 2 * window * tpf * d.dim * dtype_bytes
    if card.action_blocks:  # Matrix-Game's action modules, their mouse caches
        params += card.action_blocks * action_params(d.dim)
        kv += card.action_blocks * 2 * window * tpf * 1024 * dtype_bytes
    cross = d.num_layers * 2 * d.text_len * d.dim * dtype_bytes
    # One block's peak: the FFN's hidden, the block's q/k/v/o and residuals (float32 where the
    # modulation runs), and the attention's output over the window: a few dim-wide rows and one
    # ffn-wide per token, held twice over for the allocator's slack.
    n = tpf * frames
    act = 2 * n * (d.ffn_dim * dtype_bytes + 8 * d.dim * 4)
    return ModelCost(
        card.name,
        card.arch,
        params,
        text,
        (params + text) * dtype_bytes,
        kv + cross,
        act,
        block_flops(d, tpf, frames, window, passes, paths),
    )


def priced_profile(profile, preset: str):
    """`profile` (measured or published for another DiT configuration) with its DiT figures
    scaled to `preset` by the ratio of one block's FLOPs at each size; the VAE's and encoder's
    stay (the same VAE: a model on another VAE, Wan 2.2's, is refused). A DiT group's
    all-to-alls move activations: scaled by width x depth."""
    out = copy.deepcopy(profile)
    src = preset_card(profile.preset).dims
    if src is None:
        raise ValueError(f"the profile's model {profile.preset!r} has no DiT dimensions to price from")
    mine, theirs = (preset_card(n).latent_channels for n in (preset, profile.preset))
    if mine != theirs:  # another VAE: the profile's decode figures do not carry
        raise ValueError(
            f"{preset} decodes {mine}-channel latents with another VAE than the profile's {profile.preset} "
            f"({theirs} channels): profile {preset} itself"
        )
    dst = preset_card(preset).dims
    link = (dst.dim * dst.num_layers) / (src.dim * src.num_layers)
    for key, fig in out.sizes.items():
        w, h = (int(x) for x in key.split("x"))
        ratio = model_cost(preset, (w, h)).block_flops / model_cost(profile.preset, (w, h)).block_flops
        for t in fig.get("dit", {}).values():
            _scale(t, ratio)
        for g in fig.get("dit_group", {}).values():
            block, coll = g.get("block_ms", 0.0), g.get("collective_ms", 0.0)
            _scale(g, ratio)
            if "collective_ms" in g:  # the link's share scales with the bytes, not the FLOPs
                g["collective_ms"] = coll * link
                g["block_ms"] = (block - coll) * ratio + coll * link
        fig.pop("hybrid", None)  # a probe of the other model's DiT beside a shard: not priced
    out.preset = preset
    out.model = {**out.model, "priced_from": profile.preset}
    return out


def _scale(node: dict, ratio: float, times: bool = False) -> None:
    """Every time in `node` (a key ending in _ms, or any number under one: batch_ms by size)."""
    for k, v in node.items():
        if isinstance(v, dict):
            _scale(v, ratio, times or k.endswith("_ms"))
        elif (times or k.endswith("_ms")) and isinstance(v, (int, float)):
            node[k] = v * ratio
