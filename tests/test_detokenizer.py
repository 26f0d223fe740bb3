"""Streaming detokenization must equal a one-shot decode and never show half a character."""
from __future__ import annotations

import pytest

from kvforge.engine.detokenizer import IncrementalDetokenizer
from kvforge.models.loader import default_model_path
from kvforge.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! This is a test.",
    "emoji 🤗🎉👍🏽 and 👨‍👩‍👧 family",
    "中文分词测试，日本語のテキスト、한국어",
    "mixed: naïve café — “quotes” … 😀end",
    "code:\n    for i in range(10):\n        print(i)\n",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from gguf import GGUFReader

    return Tokenizer.from_gguf(GGUFReader(default_model_path()))


def stream(tok: Tokenizer, prompt: list[int], ids: list[int], **kw) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, prompt, **kw)
    deltas = [detok.push([t]) for t in ids]
    return deltas, detok


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(tok: Tokenizer, text: str) -> None:
    prompt = tok.encode("User says:")
    ids = tok.encode(text, add_special_tokens=False)
    deltas, detok = stream(tok, prompt, ids)
    assert "".join(deltas) == detok.text == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert detok.output_token_ids == ids


def test_multibyte_character_is_held_back(tok: Tokenizer) -> None:
    ids = tok.encode("🤗", add_special_tokens=False)
    assert len(ids) > 1, "the emoji must span tokens for this test to mean anything"
    deltas, _ = stream(tok, [], ids)
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🤗"


def test_chunks_and_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nhi 世界<|im_end|>", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    out = detok.push(ids[:3]) + detok.push(ids[3:])
    assert out == detok.text == "assistant\nhi 世界"
    keep = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(keep.push([t]) for t in ids) == "<|im_start|>assistant\nhi 世界<|im_end|>"


def test_flush_releases_an_incomplete_tail(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🤗", add_special_tokens=False)[:-1]  # cut the emoji short
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.push([t]) for t in ids) == "ok"  # " " + partial emoji is one token: held
    assert detok.flush().endswith("\ufffd")
    assert detok.text == tok.decode(ids)


class CountingTokenizer:
    """Records how many ids each decode call sees, to pin the O(new tokens) cost."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.sizes = tok, []

    def decode(self, ids, skip_special_tokens=True) -> str:
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_work_per_push_is_bounded(tok: Tokenizer) -> None:
    ids = tok.encode("word " * 400, add_special_tokens=False)
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, tok.encode("a long prompt " * 50))
    for t in ids:
        detok.push([t])
    assert detok.text == "word " * 400
    assert max(counting.sizes) <= 8  # a few-token window, never the whole output
