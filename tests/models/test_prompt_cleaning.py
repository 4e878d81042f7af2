"""Wan's prompt cleaning (its `tokenizers.py`, clean="whitespace") before both text encoders."""

from __future__ import annotations

import html

import ftfy
import pytest
import regex
import torch

from streamdiff.models.wan.text import TinyTextEncoder, UMT5TextEncoder, clean_prompt

from ..helpers import TOKENIZER_WORDS, write_tokenizer

# Each messy prompt and the plain ASCII prompt a user meant by it.
PAIRS = [
    ("\u201ca red fox\u201d runs through snow", '"a red fox" runs through snow'),  # curly quotes
    ("a \uff52\uff45\uff44 fox", "a red fox"),  # full-width letters
    ("fox &amp;amp; whale &lt;3", "fox & whale <3"),  # HTML entities, escaped twice
    ("caf\u00c3\u00a9 at night", "caf\u00e9 at night"),  # UTF-8 read as Latin-1 (mojibake)
    ("  a\tblue\n\n whale\u3000city  ", "a blue whale city"),  # tabs, newlines, ideographic space
]


def wan_clean(text: str) -> str:
    """Wan's basic_clean then whitespace_clean, as written in its tokenizers.py."""
    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return regex.sub(r"\s+", " ", text).strip()


@pytest.mark.parametrize("messy,plain", PAIRS)
def test_clean_prompt_is_wans_cleaning(messy, plain):
    assert clean_prompt(messy) == wan_clean(messy) == plain


@pytest.fixture(scope="module")
def umt5(tmp_path_factory):
    from transformers import UMT5Config, UMT5EncoderModel

    root = tmp_path_factory.mktemp("umt5")
    torch.manual_seed(0)
    cfg = dict(vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    UMT5EncoderModel(UMT5Config(**cfg)).eval().save_pretrained(str(root / "text_encoder"))
    # The test words plus the punctuation and accented word of PAIRS, so that a messy prompt left
    # uncleaned tokenises differently from its plain twin (<unk> against the word).
    write_tokenizer(root / "tokenizer", [*TOKENIZER_WORDS, '"', "&", "<", "3", "caf\u00e9"])
    return UMT5TextEncoder(root, text_len=16, dtype=torch.float32)


@pytest.mark.parametrize("messy,plain", PAIRS)
def test_umt5_tokenises_messy_prompts_as_their_clean_twins(umt5, messy, plain):
    ids, mask = umt5.tokenize([messy, plain])
    assert torch.equal(ids[0], ids[1]) and torch.equal(mask[0], mask[1])
    assert torch.equal(umt5.encode([messy]), umt5.encode([plain]))
    raw = umt5.tokenizer([messy, plain], padding="max_length", max_length=16, return_tensors="pt").input_ids
    if (messy, plain) != PAIRS[-1]:  # uncleaned they differ (runs of whitespace the tokenizer splits on anyway)
        assert not torch.equal(raw[0], raw[1])


def test_tiny_encoder_cleans_the_same_way():
    """The embedded default's byte-level encoder sees the cleaned bytes: a messy prompt gives the
    same embedding as its plain twin, while the bytes themselves would differ."""
    enc = TinyTextEncoder(dim=16, text_len=32)
    for messy, plain in PAIRS:
        assert torch.equal(enc.encode([messy]), enc.encode([plain]))
        assert messy.encode() != plain.encode()
