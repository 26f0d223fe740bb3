"""Compiles constraints into llguidance matchers, once per distinct constraint.

The llguidance tokenizer is built from the `tokenizers` JSON kvforge already holds (HF
folders and GGUF files alike), never through transformers. Compiling is the expensive part
(llguidance builds the lexer and drops the GIL while it does): the server compiles on a
worker thread before the request reaches the engine, so the engine loop only ever copies a
cached template matcher. Resource limits bound what one grammar may cost; a constraint over
them, or invalid, is a `StructuredOutputError` naming the request field.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance

from kvforge.engine.structured.params import StructuredOutputError, StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)


def _limits() -> llguidance.LLParserLimits:
    """Tighter than llguidance's defaults, so one hostile grammar costs bounded time and memory."""
    return llguidance.LLParserLimits(max_grammar_size=200_000, max_lexer_states=100_000,
                                     initial_lexer_fuel=1_000_000, verbose_errors=False)


def build_lltokenizer(tokenizer: Any, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of a kvforge Tokenizer; `vocab_size` is the model's logits width."""
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                  eos_token=list(tokenizer.eos_token_ids))


def grammar_definition(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON definition) for one constraint."""
    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            schema = spec.schema()
            if not isinstance(schema, dict):
                raise StructuredOutputError(f"{spec.field}: a JSON schema must be an object", spec.field)
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False})
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(str(spec.regex))
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in spec.choice or ())
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        return llguidance.grammar_from("grammar", str(spec.grammar))  # Lark, or GBNF converted to Lark
    except StructuredOutputError:
        raise
    except (ValueError, TypeError, RecursionError) as exc:  # not JSON, or GBNF that does not convert
        raise StructuredOutputError(f"{spec.field}: invalid {kind}: {_first_line(exc)}", spec.field) from exc


class GrammarCompiler:
    """Thread-safe: the server's worker threads and the engine thread both call `compile`."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.lltokenizer = build_lltokenizer(tokenizer, vocab_size)
        self.vocab_size = vocab_size
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # grammars compiled (cache misses): tests and /metrics read it

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for `spec`, at its start state; compiled once per distinct constraint."""
        key = f"{spec.kind}\0{spec.source()}"
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template.deep_copy()
        template = llguidance.LLMatcher(self.lltokenizer, grammar_definition(spec), log_level=0, limits=_limits())
        if template.is_error():
            raise StructuredOutputError(f"{spec.field}: invalid {spec.kind}: {_first_line(template.get_error())}",
                                        spec.field)
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = template
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return template.deep_copy()


def _first_line(exc: object) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]
