"""Incremental detokenization: turn a growing list of token ids into text deltas to stream.

Decoding the whole output after every token is O(n^2) over a generation, and
decoding one token at a time is wrong: a byte-level token can be half of a
UTF-8 character, and sentencepiece tokens drop their leading space when decoded
alone. As in vLLM/TGI we keep two offsets into the ids: text is decoded for a
small window ids[prefix_offset:], and the delta is what that window says beyond
the text of ids[prefix_offset:read_offset], which was already emitted. The
window restarts at every emit, so each push costs O(new tokens).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens kept as left context so the first output token decodes as it would mid-text.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feeds output ids in with `push`, gets back only text that is final (no split characters)."""

    def __init__(self, tokenizer: _Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids: list[int] = context
        self._n_context = len(context)
        self._prefix_offset = 0          # start of the decode window
        self._read_offset = len(context)  # ids before this have been turned into emitted text
        self.text = ""                   # all output text emitted so far

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._n_context:]

    def push(self, token_ids: Sequence[int]) -> str:
        """Append new output ids; return the newly decodable text (possibly "")."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of a request: emit whatever is held back, even an incomplete character."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        window = self._ids[self._prefix_offset:]
        read = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window[:read])
        new_text = self._decode(window)
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT) and not final):
            # Nothing new, or the last token ends mid-character: wait for the next token.
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""
