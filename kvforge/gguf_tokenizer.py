"""Rebuild the tokenizer a llama.cpp GGUF file stores (`tokenizer.ggml.*`) as a `tokenizers` backend.

Two models: `gpt2` (byte-level BPE with merges, split by the `pre` rule
llama.cpp names) and `llama` (sentencepiece: BPE whose merges come from the
piece scores, "▁" for spaces, byte fallback to `<0xXX>` tokens), encoding as
llama.cpp does.
"""
from __future__ import annotations

import logging
from typing import Any


def field(reader: Any, key: str, default: Any = None) -> Any:
    """One GGUF metadata value (scalar, string or list), or `default` when the key is absent.

    Lives here, below `models/`, because the tokenizer reads GGUF metadata too and must not import models.
    """
    f = reader.fields.get(key)
    return default if f is None else f.contents()


logger = logging.getLogger(__name__)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable unicode char table (byte-level BPE spells tokens with it)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer(pre: str | None) -> Any:
    """The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre` (how text is split before BPE)."""
    from tokenizers import Regex, pre_tokenizers as pt

    if pre in _SPLITS:
        return pt.Sequence([pt.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                            pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre == "smollm":  # SmolLM's tokenizer.json: single digits, then GPT-2 byte-level
        return pt.Sequence([pt.Digits(individual_digits=True),
                            pt.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre not in (None, "default", "gpt-2", "gpt2"):
        logger.warning("unknown tokenizer.ggml.pre %r; using GPT-2 byte-level splitting", pre)
    return pt.ByteLevel(add_prefix_space=False, use_regex=True)


def _byte_level_bpe(reader: Any, tokens: list[str], types: list[int]) -> Any:
    """`tokenizer.ggml.model == "gpt2"`: GPT-2 style byte-level BPE with the file's merges."""
    from tokenizers import Tokenizer, decoders, models

    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {}
    for i, tok in enumerate(tokens):  # a few files store raw text; respell it in the byte alphabet
        vocab[tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode())] = i
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", [])]
    backend = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(field(reader, "tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    return backend


_SPM_SPACE = "\u2581"  # sentencepiece spells " " as "▁"
# Pieces sentencepiece may build by merging: normal and user-defined. Never unknown (2),
# control (3), unused (5) or byte (6) pieces.
_SPM_MERGEABLE = (1, 4)


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to sentencepiece's (and llama.cpp's) encoding, best first.

    Sentencepiece BPE stores no merges: it repeatedly joins the adjacent pair whose
    concatenation is the highest-scoring piece in the vocabulary. A BPE model reproduces
    that when every way of cutting a piece in two is a merge ranked by the piece's score.
    """
    first_id: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        first_id.setdefault(tok, i)
    ranked = []
    for i, (tok, ty) in enumerate(zip(tokens, types)):
        if ty not in _SPM_MERGEABLE or first_id[tok] != i:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in first_id and right in first_id:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_bpe(reader: Any, tokens: list[str], types: list[int]) -> Any:
    """`tokenizer.ggml.model == "llama"`: sentencepiece BPE as llama.cpp runs it.

    Spaces become "▁"; with `add_space_prefix` (llama.cpp's default) every run of text
    that starts the input or follows a special token gets one "▁" in front; characters
    missing from the vocabulary fall back to their UTF-8 bytes (`<0xXX>` pieces). The
    text is never split into words first, so multi-space pieces can match.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    unk_id = field(reader, "tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = Tokenizer(models.BPE(vocab, spm_merges(tokens, scores, types), unk_token=unk,
                                   fuse_unk=True, byte_fallback=True))
    space_prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix", True))
    prefix = [normalizers.Prepend(_SPM_SPACE)] if space_prefix else []
    backend.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", _SPM_SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if space_prefix else []  # drop the prefix space again
    backend.decoder = decoders.Sequence([decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(),
                                         decoders.Fuse(), *strip])
    return backend


# tokenizer.ggml.model -> (builder, token types that are special: skipped when decoding, never split)
_TOKENIZER_MODELS = {
    "gpt2": (_byte_level_bpe, (3,)),
    "llama": (_sentencepiece_bpe, (2, 3)),
}


def _eos_post_processor(backend: Any, eos_id: int) -> Any:
    """`add_eos_token`: llama.cpp appends EOS whenever special tokens are added."""
    from tokenizers import processors

    eos = backend.id_to_token(eos_id)
    return processors.TemplateProcessing(single=f"$A {eos}", pair=f"$A {eos} $B {eos}",
                                         special_tokens=[(eos, eos_id)])


def build_gguf_tokenizer(reader: Any) -> tuple[Any, dict]:
    """Build a `tokenizers.Tokenizer` from GGUF metadata, plus its special-token facts."""
    from tokenizers import AddedToken

    kind = field(reader, "tokenizer.ggml.model")
    if kind not in _TOKENIZER_MODELS:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; supported: {sorted(_TOKENIZER_MODELS)} "
                         "(byte-level BPE 'gpt2', sentencepiece 'llama')")
    build, special_types = _TOKENIZER_MODELS[kind]
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens")
    types: list[int] = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    backend = build(reader, tokens, types)
    # Special tokens are never split; 4 = USER_DEFINED is matched whole, but is ordinary text.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty in special_types])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == 4])
    eos = [field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    if field(reader, "tokenizer.ggml.add_eos_token", False) and eos[0] is not None:
        backend.post_processor = _eos_post_processor(backend, int(eos[0]))
    meta = {
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_ids": [int(e) for e in eos if e is not None],
        # llama.cpp adds BOS to sentencepiece vocabularies unless the file says otherwise
        "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", kind == "llama")),
        "chat_template": field(reader, "tokenizer.chat_template"),
    }
    return backend, meta
