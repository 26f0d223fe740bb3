"""Tokenizer: a thin, typed wrapper over the `tokenizers` library.

The engine never imports `transformers`; it reads `tokenizer.json` (an HF
folder) or rebuilds a byte-level BPE tokenizer from GGUF metadata. Chat
templates are Jinja programs shipped with downloaded models, so they are
rendered in an immutable Jinja sandbox and can never reach Python internals.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

# End-of-turn markers that chat models emit instead of (or as well as) EOS.
# Counted as stop tokens only when the model's chat template writes them.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|return|>")


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model."""

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self._tok = backend
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        eos = list(dict.fromkeys(int(i) for i in eos_token_ids))
        # Chat models end a turn with a marker token; stop on it too when the template uses it.
        for marker in _END_OF_TURN_TOKENS:
            tid = backend.token_to_id(marker)
            if tid is not None and chat_template and marker in chat_template and tid not in eos:
                eos.append(tid)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self._special_ids = {
            tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special
        }

    # ---- constructors -------------------------------------------------
    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        """Load `tokenizer.json` + `tokenizer_config.json` (+ `generation_config.json`) from an HF folder."""
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise FileNotFoundError(f"no tokenizer.json in model folder {path!r}")
        backend = _HFTokenizer.from_file(tok_file)
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        gen = _read_json(os.path.join(path, "generation_config.json"))
        bos = _token_id(backend, cfg.get("bos_token"))
        eos_ids: list[int] = []
        eos = _token_id(backend, cfg.get("eos_token"))
        if eos is not None:
            eos_ids.append(eos)
        gen_eos = gen.get("eos_token_id")
        eos_ids += gen_eos if isinstance(gen_eos, list) else ([gen_eos] if gen_eos is not None else [])
        if bos is None and isinstance(gen.get("bos_token_id"), int):
            bos = gen["bos_token_id"]
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            chat_template=template,
        )

    @classmethod
    def from_gguf(cls, reader: Any) -> "Tokenizer":
        """Rebuild the tokenizer described by a GGUF file's (`gguf_file.GGUFFile`) `tokenizer.*` metadata."""
        from kvforge.gguf_tokenizer import build_gguf_tokenizer  # lazy: pulls in gguf/numpy

        backend, meta = build_gguf_tokenizer(reader)
        return cls(
            backend,
            bos_token_id=meta["bos_token_id"],
            eos_token_ids=meta["eos_token_ids"],
            add_bos_token=meta["add_bos_token"],
            chat_template=meta["chat_template"],
        )

    # ---- encode / decode ---------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS is prepended if the model wants one.

        BOS is not doubled when the backend's post-processor (or the text itself,
        e.g. a rendered chat template) already starts with it.
        """
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (special tokens dropped by default, like HF)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (byte-level spelling, e.g. 'Ġworld') of one id."""
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocab + added tokens)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of special (control) tokens, plus BOS/EOS ids."""
        ids = set(self._special_ids) | set(self.eos_token_ids)
        if self.bos_token_id is not None:
            ids.add(self.bos_token_id)
        return sorted(ids)

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (e.g. to save as tokenizer.json)."""
        return self._tok

    # ---- chat ----------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's chat template (sandboxed Jinja), returning the prompt text."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a plain prompt instead of messages")
        special = {
            "bos_token": self._token_text(self.bos_token_id),
            "eos_token": self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
        }
        _check_messages(messages)
        template = _compile_template(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **{**special, **kwargs})

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._tok.id_to_token(token_id) or "")

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={self.eos_token_ids}, chat_template={self.has_chat_template})"
        )


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_id(backend: _HFTokenizer, token: Any) -> int | None:
    """tokenizer_config writes special tokens as a string or as {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    return backend.token_to_id(token)


def _raise_exception(message: str) -> None:
    """Templates call this to reject inputs (e.g. roles out of order), as in HF."""
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    """Llama-3 style templates print today's date."""
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    # Jinja's built-in tojson escapes HTML characters; HF's (and the models') expects plain JSON.
    return json.dumps(value, ensure_ascii=False, indent=indent)


_COMPILED: dict[str, jinja2.Template] = {}


def _compile_template(source: str) -> jinja2.Template:
    """Compile once per template text, in an immutable sandbox: no attribute tricks, no mutation."""
    template = _COMPILED.get(source)
    if template is None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        template = _COMPILED[source] = env.from_string(source)
    return template


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a str 'role', got {msg!r:.80}")
        content = msg.get("content")
        if not (isinstance(content, (str, list)) or (content is None and msg.get("tool_calls"))):
            raise ValueError(f"messages[{i}]['content'] must be a str (or a list of parts), got {content!r:.80}")


def bos_prefix(tokenizer: Any) -> list[int]:
    """The ids the tokenizer puts before any text: [<bos>] where the model expects one (Gemma's GGUF says
    `add_bos_token`), nothing for SmolLM2.

    Eval text is encoded without special tokens so that it can be cut anywhere; every window and prompt
    then starts with this prefix, as a user's prompt does (and lm-evaluation-harness's rolling windows,
    whose first token is predicted from <bos>). Without it Gemma reads each window as if cut from the
    middle of a document. Only a leading <bos> counts: a post-processor that also appends <eos> to every
    encoding must not put one at the head of the text.
    """
    bos = getattr(tokenizer, "bos_token_id", None)
    return [bos] if bos is not None and tokenizer.encode("", add_special_tokens=True)[:1] == [bos] else []
