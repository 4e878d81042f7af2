"""Text encoders for the DiT (runs in the DiT worker process).

- `UMT5TextEncoder`: umT5-XXL through `transformers` from a local directory, either the
  diffusers layout (`text_encoder/` + `tokenizer/`) or the original Wan 2.1 release
  (`models_t5_umt5-xxl-enc-bf16.pth` + a tokenizer folder such as `google/umt5-xxl/`).
- `TinyTextEncoder`: the embedded preset's encoder, a seeded byte-level embedding with one
  attention layer (the trained default: more, `layers`); no download, deterministic, different
  prompts give different embeddings.

Both return (B, text_len, text_dim) with every position after the prompt's tokens zero, as
Wan's pipelines do (the DiT attends over all text_len positions without a mask).
"""

from __future__ import annotations

import html
import math
import re
from pathlib import Path

import ftfy
import regex
import torch
import torch.nn.functional as F
from torch import nn

from .loading import CheckpointError, load_into, read_state_dict


def clean_prompt(text: str) -> str:
    """What Wan's tokenizer wrapper does before tokenising (`tokenizers.py`, clean="whitespace",
    the mode its T5 encoder uses): repair the text with ftfy (mojibake, curly quotes, full-width
    letters), unescape HTML twice, strip, then collapse every run of whitespace to one space.
    Both encoders use it, so a prompt pasted with typographic quotes gives the same video as its
    plain-ASCII twin on the embedded default too."""
    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return regex.sub(r"\s+", " ", text).strip()


class TextLayer(nn.Module):
    """A pre-norm transformer layer (self-attention, then a 4x MLP, each added to the stream)
    whose output projections start at zero, so that a layer added to a trained encoder starts as
    the identity. Pre-norm: stacked post-norm layers (norm after the sum, as the first layer)
    collapsed the prompt's bytes onto one direction in training (token-to-token cosine 0.23 ->
    0.73 in 600 steps), and the DiT stopped reading them."""

    def __init__(self, dim: int, g: torch.Generator) -> None:
        super().__init__()
        self.qkv = nn.Parameter(torch.randn(dim, 3 * dim, generator=g) / math.sqrt(dim))
        self.out = nn.Parameter(torch.zeros(dim, dim))
        self.fc1 = nn.Parameter(torch.randn(dim, 4 * dim, generator=g) / math.sqrt(dim))
        self.fc2 = nn.Parameter(torch.zeros(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = (F.layer_norm(x, x.shape[-1:]) @ self.qkv).chunk(3, dim=-1)
        x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, :]) @ self.out
        return x + F.gelu(F.layer_norm(x, x.shape[-1:]) @ self.fc1) @ self.fc2


class TinyTextEncoder(nn.Module):
    """UTF-8 bytes -> seeded embeddings + sinusoidal positions -> one self-attention layer, and
    `layers - 1` more (`TextLayer`). One layer is the seeded default's; the trained default has
    three (`train.dit.TEXT_LAYERS`): in one, a byte cannot tell the object's colour word from the
    background's, whose place in the prompt moves with the words before it (issue 36)."""

    VOCAB = 258  # 256 bytes, end-of-text, padding

    def __init__(self, dim: int, text_len: int, seed: int = 20251, layers: int = 1) -> None:
        super().__init__()
        if layers < 1:
            raise ValueError(f"a text encoder needs at least one layer, got {layers}")
        self.dim, self.text_len = dim, text_len
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Parameter(torch.randn(self.VOCAB, dim, generator=g))
        self.qkv = nn.Parameter(torch.randn(dim, 3 * dim, generator=g) / math.sqrt(dim))
        self.out = nn.Parameter(torch.randn(dim, dim, generator=g) / math.sqrt(dim))
        self.layers = nn.ModuleList([TextLayer(dim, g) for _ in range(layers - 1)])
        pos = torch.arange(text_len, dtype=torch.float64)[:, None]
        freq = torch.pow(10000.0, -torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        pe = torch.zeros(text_len, dim, dtype=torch.float64)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
        self.register_buffer("pos", pe.float(), persistent=False)

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.full((len(prompts), self.text_len), self.VOCAB - 1, dtype=torch.long)
        mask = torch.zeros(len(prompts), self.text_len, dtype=torch.bool)
        for i, p in enumerate(prompts):
            b = list(clean_prompt(p).encode("utf-8"))[: self.text_len - 1] + [256]
            ids[i, : len(b)] = torch.tensor(b)
            mask[i, : len(b)] = True
        return ids, mask

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> torch.Tensor:
        return self(prompts)

    def forward(self, prompts: list[str]) -> torch.Tensor:
        """`encode` with autograd: what training the embedded default learns the grammar through."""
        ids, mask = self.tokenize(prompts)
        ids, mask = ids.to(self.embed.device), mask.to(self.embed.device)
        x = self.embed[ids] + self.pos  # (B, L, D)
        q, k, v = (x @ self.qkv).chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, :])
        x = F.layer_norm(x + y @ self.out, (self.dim,))
        if len(self.layers):
            for layer in self.layers:
                x = layer(x, mask)
            x = F.layer_norm(x, (self.dim,))
        return x * mask[..., None]


# Original Wan 2.1 umT5 key names -> transformers UMT5EncoderModel names.
_T5_KEYS = [
    (r"^token_embedding\.", "shared."),
    (r"^blocks\.(\d+)\.attn\.([qkvo])\.", r"encoder.block.\1.layer.0.SelfAttention.\2."),
    (r"^blocks\.(\d+)\.pos_embedding\.embedding\.", r"encoder.block.\1.layer.0.SelfAttention.relative_attention_bias."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.block.\1.layer.0.layer_norm."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.block.\1.layer.1.layer_norm."),
    (r"^blocks\.(\d+)\.ffn\.gate\.0\.", r"encoder.block.\1.layer.1.DenseReluDense.wi_0."),
    (r"^blocks\.(\d+)\.ffn\.fc1\.", r"encoder.block.\1.layer.1.DenseReluDense.wi_1."),
    (r"^blocks\.(\d+)\.ffn\.fc2\.", r"encoder.block.\1.layer.1.DenseReluDense.wo."),
    (r"^norm\.", "encoder.final_layer_norm."),
]

# umT5-XXL encoder, as Wan 2.1 builds it (wan/modules/t5.py: umt5_xxl).
UMT5_XXL = dict(
    vocab_size=256384,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6,
    dropout_rate=0.0,
)


def t5_key_from_original(key: str) -> str:
    for pat, rep in _T5_KEYS:
        key = re.sub(pat, rep, key)
    return key


def text_dtype(dit_dtype: torch.dtype) -> torch.dtype:
    """umT5's dtype beside a DiT of `dit_dtype`: the same, but bf16 for a float16 DiT. T5's
    activations outgrow float16's range (its feed-forward output overflows to inf; the reason
    transformers keeps T5's `wo` in fp32), and Wan runs it in bf16; the DiT casts the embedding
    to its own dtype (`WanDiT.set_prompt`)."""
    return torch.bfloat16 if dit_dtype == torch.float16 else dit_dtype


class UMT5TextEncoder:
    def __init__(
        self,
        root: str | Path,
        text_len: int = 512,
        device: str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        t5_config: dict | None = None,
    ) -> None:
        """t5_config: the encoder's shape for the original layout (default umT5-XXL). `dtype`: the
        DiT's; the encoder runs in `text_dtype(dtype)`."""
        dtype = text_dtype(dtype)
        from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

        root = Path(root)
        self.text_len = text_len
        self.device = torch.device(device)
        if (root / "text_encoder").is_dir():  # diffusers layout
            self.tokenizer = AutoTokenizer.from_pretrained(str(root / "tokenizer"))
            self.model = UMT5EncoderModel.from_pretrained(str(root / "text_encoder"), dtype=dtype)
        else:  # original Wan 2.1 layout
            ckpt = next(iter(sorted(root.glob("models_t5_*.pth"))), None)
            tok = next((p for p in (root / "google" / "umt5-xxl", root / "tokenizer") if p.is_dir()), None)
            if ckpt is None or tok is None:
                raise CheckpointError(
                    f"{root}: no text encoder found (expected text_encoder/ + tokenizer/, "
                    "or models_t5_*.pth + google/umt5-xxl/)"
                )
            self.tokenizer = AutoTokenizer.from_pretrained(str(tok))
            sd = {t5_key_from_original(k): v for k, v in read_state_dict(ckpt).items()}
            if "shared.weight" in sd:  # tied input embedding
                sd["encoder.embed_tokens.weight"] = sd["shared.weight"]
            with torch.device("meta"):
                self.model = UMT5EncoderModel(UMT5Config(**(t5_config or UMT5_XXL)))
            self.model.to_empty(device="cpu").to(dtype)
            load_into(self.model, sd, f"text encoder {ckpt.name}")
        self.model.to(device=self.device, dtype=dtype).eval().requires_grad_(False)

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Cleaned as Wan cleans them (`clean_prompt`), padded to text_len -> ids, mask (B, text_len)."""
        tok = self.tokenizer(
            [clean_prompt(p) for p in prompts],
            padding="max_length",
            max_length=self.text_len,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        return tok.input_ids, tok.attention_mask

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> torch.Tensor:
        ids, mask = self.tokenize(prompts)
        ids, mask = ids.to(self.device), mask.to(self.device)
        out = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        return out * mask[..., None].to(out.dtype)
