"""Matrix-Game's CLIP image encoder (models/wan/clip.py), as its `CLIPModel.encode_video` runs
(Matrix-Game-2/wan/vae/wanx_vae_src/clip.py, transcribed): the picture in [-1, 1] squeezed to
the model's square size (bicubic, no crop), taken to [0, 1] and normalised with OpenAI's CLIP
statistics, then the vision tower's embeddings, pre-norm and all of its blocks but the last
(`use_31_block`), with no final norm. A small transformers CLIP vision model, fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from streamdiff.models.wan.clip import ClipImageEncoder  # noqa: E402


def test_the_image_tokens_are_all_blocks_but_the_last_on_the_squeezed_picture(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=28, patch_size=14,
        hidden_act="gelu",
    )  # fmt: skip
    transformers.CLIPVisionModel(cfg).eval().save_pretrained(str(tmp_path / "clip"))
    enc = ClipImageEncoder(tmp_path / "clip", "cpu", torch.float32)
    image = torch.randint(0, 256, (44, 80, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    got = enc.encode(image)

    vm = getattr(enc.model, "vision_model", enc.model)  # transformers 5 flattened the tower into the model
    x = image.permute(2, 0, 1)[None].float() / 127.5 - 1
    x = F.interpolate(x, size=(28, 28), mode="bicubic", align_corners=False).mul(0.5).add(0.5)
    x = (x - torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)) / torch.tensor(
        [0.26862954, 0.26130258, 0.27577711]
    ).view(1, 3, 1, 1)
    with torch.no_grad():
        h = vm.pre_layrnorm(vm.embeddings(x))
        for layer in vm.encoder.layers[:-1]:
            out = layer(h, None)
            h = out[0] if isinstance(out, tuple) else out
    assert got.shape == (1, 1 + (28 // 14) ** 2, 32)
    torch.testing.assert_close(got, h, rtol=1e-5, atol=1e-5)
    last = enc.model(pixel_values=x).last_hidden_state
    assert not torch.allclose(got, last)  # not the whole tower
