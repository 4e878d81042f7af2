"""The Wan DiT's configuration (the original release's and diffusers' config.json map onto it:
loading.py), with the variants this project serves: minWM's camera path, Matrix-Game's image
context and action modules."""

from __future__ import annotations

from dataclasses import dataclass

from .action import ActionConfig


@dataclass(frozen=True)
class DiTConfig:
    dim: int = 1536  # model width
    ffn_dim: int = 8960  # FFN hidden width
    freq_dim: int = 256  # sinusoidal timestep embedding size
    num_heads: int = 12  # head_dim = dim / num_heads = 128 for the real models
    num_layers: int = 30
    in_channels: int = 16  # latent channels (VAE z_dim)
    out_channels: int = 16
    text_dim: int = 4096  # umT5-XXL hidden size
    text_len: int = 512  # context is zero-padded to this many tokens, no mask
    patch_size: tuple[int, int, int] = (1, 2, 2)  # (t, h, w)
    eps: float = 1e-6
    rope_max_positions: int = 1024  # height and width table rows; frames are computed at any position
    rope_theta: float = 10000.0
    # minWM's camera path (prope.py): a second self-attention over the camera-transformed q, k, v,
    # added through `self_attn.prope_o`, with its own keys/values in the KV cache
    prope: bool = False
    # Matrix-Game 2.0's image-to-video DiT: cross-attention over CLIP image tokens of this width
    # through `img_emb` instead of text (0: text), and its action modules (action.py)
    image_dim: int = 0
    action: ActionConfig | None = None

    @property
    def cond_channels(self) -> int:
        """Channels concatenated to the latent before the patch embedding: Matrix-Game's mask and
        image latents (in 36, out 16); 0 for the text models."""
        return self.in_channels - self.out_channels

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def rope_split(self) -> tuple[int, int, int]:
        """Complex pairs per axis (t, h, w): [22, 21, 21] for head_dim 128."""
        d = self.head_dim
        hw = 2 * (d // 6)
        return ((d - 2 * hw) // 2, hw // 2, hw // 2)

    def tokens_per_frame(self, latent_h: int, latent_w: int) -> int:
        return (latent_h // self.patch_size[1]) * (latent_w // self.patch_size[2])
