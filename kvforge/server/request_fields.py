"""Which request fields kvforge knows, so none that changes the output is ever dropped in silence.

Every top-level field of a body falls in one of three sets:
- parsed: protocol.py (or a module it calls) reads and honours or refuses it;
- refused unless neutral: a field vLLM or OpenAI define that kvforge does not implement;
  sent with its neutral value it is fine, with any other value it is a 400 naming it;
- inert: it cannot change what is generated (user, metadata, ...): one debug log line.
Anything else is unknown: a 400 naming it, where OpenAI-compatible servers often drop it
and answer as if it had never been sent.
"""
from __future__ import annotations

import logging
from typing import Any

from kvforge.server.errors import APIError

log = logging.getLogger("kvforge.server")

_COMMON_PARSED = {
    "model", "n", "stream", "stream_options", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
    "seed", "min_tokens", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "kv_budget",
    "max_tokens", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern",
    "allowed_token_ids", "bad_words", "prompt_logprobs", "cache_salt",
}
PARSED = {
    "completion": _COMMON_PARSED | {"prompt", "echo", "suffix", "best_of"},
    "chat": _COMMON_PARSED | {"messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt", "tools",
                              "tool_choice", "parallel_tool_calls", "functions", "function_call",
                              "chat_template_kwargs", "include_reasoning"},
}

# field -> its neutral values: what kvforge does anyway. Delete a line here when a field becomes honoured.
_COMMON_REFUSED: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (None,), "structural_tag": (None,), "logits_processors": (None,),
    "return_tokens_as_token_ids": (False,), "return_token_ids": (False,), "kv_transfer_params": (None,),
    "vllm_xargs": (None,), "prediction": (None,), "prompt_embeds": (None,),
}
REFUSED: dict[str, dict[str, tuple[Any, ...]]] = {
    "completion": {**_COMMON_REFUSED, "add_special_tokens": (True,)},
    "chat": {**_COMMON_REFUSED, "add_special_tokens": (False,), "continue_final_message": (False,),
             "documents": (None,), "chat_template": (None,), "mm_processor_kwargs": (None,), "echo": (False,),
             "reasoning_effort": (None,), "audio": (None,), "modalities": (None, ["text"]),
             "web_search_options": (None,)},
}

# cannot change the generated tokens: accounting, tracing, storage and scheduling hints
INERT = {"user", "metadata", "store", "service_tier", "priority", "request_id", "safety_identifier",
         "prompt_cache_key", "verbosity"}


def check_fields(body: dict, kind: str) -> None:
    """400 for an unknown field, or a known one kvforge does not implement sent with a non-neutral value."""
    refused = REFUSED[kind]
    inert = []
    for name, value in body.items():
        if name in PARSED[kind]:
            continue
        if name in refused:
            if not _neutral(value, refused[name]):
                raise APIError(f"'{name}' is not supported by kvforge (only {refused[name][0]!r})", param=name)
        elif name in INERT:
            inert.append(name)
        else:
            route = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
            raise APIError(f"unknown field {name!r} for {route}", param=name or '""', code="unknown_field")
    if inert:
        log.debug("request fields that change nothing, ignored: %s", ", ".join(inert))


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """None (JSON null: absent) or one of the neutral values, type included (so 0 is not False)."""
    return value is None or any(value == v and type(value) is type(v) for v in neutral)
