"""No field that changes the output is dropped in silence (issue 44).

vLLM's `ChatCompletionRequest` and `CompletionRequest` field lists, written down here, are
walked with a non-neutral value each: every one is honoured (200) or refused with a 400
naming it, never silently accepted and ignored. Fields other helpers are adding (echo,
logprobs, penalties, logit_bias, best_of, prompt_logprobs, cache_salt) pass either way.
"""
from __future__ import annotations

import httpx
import pytest

from kvforge.server.request_fields import INERT, PARSED, REFUSED
from server_fixtures import MODEL_NAME, start_server, tiny_model_dir, wait_idle_and_check_blocks

# vLLM (v0.10/0.11) vllm/entrypoints/openai/protocol.py field names, with a non-neutral probe value each
COMMON_PROBES = {
    "model": MODEL_NAME, "frequency_penalty": 0.5, "logit_bias": {"5": 10.0}, "max_tokens": 3, "n": 2,
    "presence_penalty": 0.5, "seed": 3, "stop": ["zz"], "stream": False, "stream_options": None,
    "temperature": 0.7, "top_p": 0.9, "user": "u1", "use_beam_search": True, "top_k": 5, "min_p": 0.1,
    "repetition_penalty": 1.2, "length_penalty": 0.5, "stop_token_ids": [7], "include_stop_str_in_output": True,
    "ignore_eos": True, "min_tokens": 2, "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 2, "prompt_logprobs": 1, "allowed_token_ids": [1, 2, 3], "bad_words": ["a"],
    "add_special_tokens": "flip", "response_format": {"type": "json_object"},
    "structured_outputs": {"regex": "[a-c]{2}"}, "guided_json": {"type": "object"}, "guided_regex": "[a-c]{2}",
    "guided_choice": ["ab", "cd"], "guided_grammar": 'start: "ab"', "structural_tag": "{}",
    "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ", "priority": 1, "request_id": "r1",
    "logits_processors": ["x"], "return_tokens_as_token_ids": True, "return_token_ids": True,
    "cache_salt": "salt", "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "logprobs": None,
}
CHAT_FIELDS = {
    **COMMON_PROBES, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2,
    "max_completion_tokens": 3, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "none", "reasoning_effort": "high", "include_reasoning": False, "parallel_tool_calls": False,
    "echo": True, "add_generation_prompt": False, "continue_final_message": True, "documents": [{"a": "b"}],
    "chat_template": "{{ messages }}", "chat_template_kwargs": {"x": 1}, "mm_processor_kwargs": {"a": 1},
}
COMPLETION_FIELDS = {
    **COMMON_PROBES, "prompt": "hi", "best_of": 3, "echo": True, "logprobs": 2, "suffix": "end",
    "prompt_embeds": "AAAA",
}
BASE = {"chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        "completion": {"prompt": "hi", "max_tokens": 3}}
ROUTES = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
# someone else's fields, which may be refused today and honoured after a merge
EITHER = {"echo", "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty", "repetition_penalty",
          "logit_bias", "best_of", "prompt_logprobs", "cache_salt"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tiny_model_dir(tmp_path_factory), max_model_len=2048)  # byte tokens: tools are long
    yield srv
    srv.stop()


def _probe(kind: str, name: str, value: object) -> dict:
    if value == "flip":  # add_special_tokens: the opposite of what the route does
        value = kind == "chat"
    return {**BASE[kind], name: value}


@pytest.mark.parametrize("kind,fields", [("chat", CHAT_FIELDS), ("completion", COMPLETION_FIELDS)])
def test_every_vllm_field_is_honoured_or_refused_by_name(server, kind, fields):
    silent = []
    for name, value in fields.items():
        assert name in PARSED[kind] or name in REFUSED[kind] or name in INERT, f"{name} is in no list"
        r = httpx.post(server.url + ROUTES[kind], json=_probe(kind, name, value), timeout=60)
        if r.status_code == 400:
            assert r.json()["error"]["param"].split(".")[0].split("[")[0] == name, (name, r.json())
            continue
        assert r.status_code == 200, (name, r.status_code, r.text)
        if name in REFUSED[kind] and name not in EITHER:
            silent.append(name)  # accepted with a value kvforge cannot honour
    assert silent == []
    wait_idle_and_check_blocks(server)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_unknown_fields_are_400_and_inert_ones_are_accepted(server, kind):
    r = httpx.post(server.url + ROUTES[kind], json={**BASE[kind], "xyz_unknown": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "xyz_unknown"
    r = httpx.post(server.url + ROUTES[kind], json={**BASE[kind], "user": "me", "metadata": {"a": "b"}}, timeout=60)
    assert r.status_code == 200, r.text
