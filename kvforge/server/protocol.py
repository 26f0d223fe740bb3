"""Request validation for the OpenAI-compatible API, with OpenAI-style error bodies.

Bodies arrive as untrusted JSON, so every known field is type-checked here and
a mistake becomes an `APIError` naming the field (`param`). Unknown fields, and known
ones kvforge does not implement, are refused (request_fields.py), so none is dropped in
silence. Values that need the tokenizer or the engine (prompt length, max_tokens fit) are
checked later in serving.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvforge.kv.salt import check_cache_salt
from kvforge.server.errors import APIError  # re-exported: protocol.APIError is the public name


@dataclass
class GenerationRequest:
    """A validated completions or chat request, before tokenization."""

    kind: str  # "completion" | "chat"
    model: str | None
    prompts: list[str | list[int]] = field(default_factory=list)  # completions
    messages: list[dict] | None = None  # chat
    add_generation_prompt: bool = True
    n: int = 1
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top-N to return per token; None = no logprobs
    echo: bool = False  # completions: the prompt's text (and logprobs) come first (kvforge/server/echo.py)
    prompt_logprobs: int | None = None  # vLLM's extension: top-k per prompt token in the response
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams keywords
    cache_salt: str | None = None  # tenant isolation: enters the block hash chain (kvforge.kv.salt)
    tools: Any = None  # chat: a ToolRequest (engine/chat_tools.py), or None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    include_reasoning: bool = True
    shape: Any = None  # chat: how replies are read (server/chat_output.py), set by serving.prepare


# field -> (accepted types, rule shown in the error)
_SAMPLING_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "temperature": ((int, float), "a number"),
    "top_p": ((int, float), "a number"),
    "top_k": ((int,), "an integer"),
    "min_p": ((int, float), "a number"),
    "seed": ((int,), "an integer"),
    "min_tokens": ((int,), "an integer"),
    "ignore_eos": ((bool,), "a boolean"),
    "skip_special_tokens": ((bool,), "a boolean"),
    "include_stop_str_in_output": ((bool,), "a boolean"),
    "kv_budget": ((int,), "an integer"),  # KV eviction: tokens this request keeps (engine started with kv_eviction)
    "presence_penalty": ((int, float), "a number"),
    "frequency_penalty": ((int, float), "a number"),
    "repetition_penalty": ((int, float), "a number"),
}


def _get(body: dict, name: str, types: tuple[type, ...], rule: str, default: Any = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
    if ok and isinstance(v, float) and not math.isfinite(v):
        ok = False
    if not ok:
        raise APIError(f"'{name}' must be {rule}, got {_show(v)}", param=name)
    return v


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _common(body: dict, kind: str) -> GenerationRequest:
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    from kvforge.server.request_fields import check_fields
    from kvforge.server.structured_fields import parse_constraint

    check_fields(body, kind)
    req = GenerationRequest(kind=kind, model=_get(body, "model", (str,), "a string"))
    req.n = _get(body, "n", (int,), "an integer", 1)  # its range is the engine's (max_num_seqs): one message
    req.stream = _get(body, "stream", (bool,), "a boolean", False)
    try:
        req.cache_salt = check_cache_salt(body.get("cache_salt"), "'cache_salt'")
    except ValueError as exc:
        raise APIError(str(exc), param="cache_salt") from None
    opts = body.get("stream_options")
    if opts is not None:
        if not req.stream:
            raise APIError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if not isinstance(opts, dict):
            raise APIError(f"'stream_options' must be an object, got {_show(opts)}", param="stream_options")
        req.include_usage = _get(opts, "include_usage", (bool,), "a boolean", False)
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise APIError(f"'stop' must be a string or a list of strings, got {_show(stop)}", param="stop")
    if isinstance(stop, list) and len(stop) > 16:
        raise APIError(f"'stop' may hold at most 16 strings, got {len(stop)}", param="stop")
    ids = body.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise APIError(f"'stop_token_ids' must be a list of integers, got {_show(ids)}", param="stop_token_ids")
    sampling: dict[str, Any] = {"stop": stop, "stop_token_ids": ids}
    for name, (types, rule) in _SAMPLING_FIELDS.items():
        v = _get(body, name, types, rule)
        if v is not None:
            sampling[name] = v
    sampling["structured_outputs"] = parse_constraint(body)  # response_format, structured_outputs, guided_*
    req.sampling = {k: v for k, v in sampling.items() if v is not None}
    req.prompt_logprobs = _get(body, "prompt_logprobs", (int,), "an integer")
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= 20:
        raise APIError(f"'prompt_logprobs' must be in [0, 20], got {req.prompt_logprobs}", param="prompt_logprobs")
    req.sampling.update(parse_logits_fields(body))
    return req


def _max_tokens(body: dict, name: str, allow_zero: bool = False) -> int | None:
    v = _get(body, name, (int,), "an integer")
    if v is not None and v < (0 if allow_zero else 1):
        raise APIError(f"'{name}' must be >= {0 if allow_zero else 1}, got {v}", param=name)
    return v


def parse_completion_request(body: Any) -> GenerationRequest:
    req = _common(body, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        req.prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        req.prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(
        isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(t) for t in p)) for p in prompt
    ):
        req.prompts = list(prompt)
    else:
        raise APIError(
            "'prompt' must be a non-empty string, a list of token ids, or a list of those, "
            f"got {_show(prompt)}", param="prompt",
        )
    if len(req.prompts) > 1 and len(req.prompts) * req.n > 256:  # one prompt: n is bounded by max_num_seqs
        raise APIError(f"{len(req.prompts)} prompts x n={req.n} exceeds 256 completions per request", param="prompt")
    req.echo = _get(body, "echo", (bool,), "a boolean", False)
    req.max_tokens = _max_tokens(body, "max_tokens", allow_zero=req.echo)  # 0 + echo: score the prompt only
    if body.get("max_tokens") is None:
        req.max_tokens = 16  # OpenAI's default for completions
    req.logprobs = _get(body, "logprobs", (int,), "an integer")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise APIError(f"'logprobs' must be in [0, 20], got {req.logprobs}", param="logprobs")
    if body.get("suffix") is not None:
        raise APIError("'suffix' is not supported by kvforge", param="suffix")
    best_of = _get(body, "best_of", (int,), "an integer")
    if best_of is not None and best_of != req.n:
        if best_of < req.n:
            raise APIError(f"'best_of' must be >= n ({req.n}), got {best_of}", param="best_of")
        if req.stream:
            raise APIError("'best_of' greater than n cannot be streamed (the best are known only at the end)",
                           param="best_of")
        req.sampling["best_of"] = best_of
    return req


def parse_chat_request(body: Any) -> GenerationRequest:
    req = _common(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(f"'messages' must be a non-empty list of messages, got {_show(messages)}", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"'messages[{i}]' must be an object with a string 'role'", param=f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise APIError(f"'messages[{i}].content' parts must all be {{'type': 'text', 'text': str}}",
                               param=f"messages[{i}].content")
            m = {**m, "content": "".join(p["text"] for p in content)}
            messages[i] = m
        elif not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise APIError(f"'messages[{i}].content' must be a string, got {_show(content)}", param=f"messages[{i}].content")
    if body.get("echo"):
        raise APIError("'echo' is not supported on chat completions; use /v1/completions with echo", param="echo")
    req.messages = messages
    req.add_generation_prompt = _get(body, "add_generation_prompt", (bool,), "a boolean", True)
    req.max_tokens = _max_tokens(body, "max_completion_tokens")
    if req.max_tokens is None:
        req.max_tokens = _max_tokens(body, "max_tokens")
    want = _get(body, "logprobs", (bool,), "a boolean", False)
    top = _get(body, "top_logprobs", (int,), "an integer")
    if top is not None and not want:
        raise APIError("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    if top is not None and not 0 <= top <= 20:
        raise APIError(f"'top_logprobs' must be in [0, 20], got {top}", param="top_logprobs")
    req.logprobs = (top or 0) if want else None
    from kvforge.server.tools import check_messages, parse_tools

    check_messages(messages)
    req.tools = parse_tools(body)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict) or {"messages", "tools", "add_generation_prompt"} & set(kwargs):
            raise APIError("'chat_template_kwargs' must be an object of template variables (not messages, tools "
                           "or add_generation_prompt)", param="chat_template_kwargs")
        req.chat_template_kwargs = kwargs
    req.include_reasoning = _get(body, "include_reasoning", (bool,), "a boolean", True)
    return req


def parse_logits_fields(body: dict) -> dict[str, Any]:
    """logit_bias (JSON keys are strings: token ids), allowed_token_ids and bad_words, type-checked; their
    ranges and the vocabulary are checked by SamplingParams and the engine."""
    out: dict[str, Any] = {}
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise APIError(f"'logit_bias' must be an object {{token id: bias}}, got {_show(bias)}", param="logit_bias")
        parsed = {}
        for k, v in bias.items():
            key_ok = isinstance(k, str) and k.strip().isascii() and k.strip().isdigit()
            if not key_ok or not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise APIError(f"'logit_bias' maps token ids to numbers, got {_show({k: v})}", param="logit_bias")
            if not -100 <= v <= 100:
                raise APIError(f"'logit_bias' values must be in [-100, 100], got {v} for token {k}", param="logit_bias")
            parsed[int(k)] = float(v)
        if parsed:
            out["logit_bias"] = parsed
    ids = body.get("allowed_token_ids")
    if ids is not None:
        if not (isinstance(ids, list) and ids and all(_is_int(t) for t in ids)):
            raise APIError(f"'allowed_token_ids' must be a non-empty list of token ids, got {_show(ids)}",
                           param="allowed_token_ids")
        out["allowed_token_ids"] = list(ids)
    words = body.get("bad_words")
    if words is not None:
        if not (isinstance(words, list) and all(isinstance(w, str) for w in words)):
            raise APIError(f"'bad_words' must be a list of strings, got {_show(words)}", param="bad_words")
        if words:
            out["bad_words"] = list(words)
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
