"""The CLIP image encoder of Matrix-Game 2.0 (and Wan 2.1's image-to-video): open-clip's
XLM-RoBERTa ViT-H/14 visual tower, read as transformers' `CLIPVisionModel` (the layout of
`image_encoder/` in Wan-AI's I2V diffusers releases, the same weights).

Matrix-Game's `CLIPModel.encode_video` (wan/vae/wanx_vae_src/clip.py): the picture in [-1, 1]
resized to 224x224 (bicubic, no crop: its 640x352 frame is squeezed), taken to [0, 1] and
normalised with OpenAI's CLIP mean and std, through the first 31 of the 32 blocks
(`use_31_block`): transformers' `hidden_states[-2]`, 257 tokens of 1280.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


class ClipImageEncoder:
    def __init__(self, directory: str | Path, device: str, dtype: torch.dtype) -> None:
        from transformers import CLIPVisionModel

        try:
            self.model = CLIPVisionModel.from_pretrained(str(directory), dtype=dtype).to(device).eval()
        except (OSError, ValueError) as exc:
            raise OSError(f"{directory}: not a CLIP vision model (transformers' layout): {exc}") from None
        self.model.requires_grad_(False)
        self.size = self.model.config.image_size
        self.device, self.dtype = device, dtype

    @property
    def width(self) -> int:
        return self.model.config.hidden_size

    @torch.no_grad()
    def encode(self, image: torch.Tensor) -> torch.Tensor:
        """(H, W, 3) uint8 -> (1, tokens, width) in the model's dtype."""
        x = image.permute(2, 0, 1)[None].float().to(self.device) / 127.5 - 1.0
        x = F.interpolate(x, size=(self.size, self.size), mode="bicubic", align_corners=False)
        mean = torch.tensor(MEAN, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(STD, device=x.device).view(1, 3, 1, 1)
        x = ((x * 0.5 + 0.5) - mean) / std
        out = self.model(pixel_values=x.to(self.dtype), output_hidden_states=True)
        return out.hidden_states[-2]
