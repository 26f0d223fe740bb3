"""Reasoning end to end through the server (issue 44): `--reasoning-parser`, `reasoning_content` (whole and
streamed) and `chat_template_kwargs` reaching the template.

The seam: a tiny random-weight model (byte-level tokenizer) whose chat template reads `enable_thinking`
as Qwen3's does, served with `reasoning_parser` set. A model that thinks on its own is not available
offline, so a regex constraint forces the reply's shape, `<think>...</think>answer`; what is under test is
everything after the sampler: the parser splitting the real generated text, whole and streamed, and the
template receiving the request's variables (seen in the prompt's token count and through /tokenize).
"""
from __future__ import annotations

import json
import os
import re

import httpx
import pytest

from server_fixtures import MODEL_NAME, start_server, tiny_model_dir

EMPTY_BLOCK = "<think>\n\n</think>\n\n"  # what Qwen3's template writes when enable_thinking is false
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>"
            "{% if enable_thinking is defined and not enable_thinking %}" + EMPTY_BLOCK + "{% endif %}{% endif %}")
THINKING = r"<think>[a-z]{3,12}( [a-z]{3,12}){0,2}</think>[A-Z][a-z]{2,10}\."
MESSAGES = [{"role": "user", "content": "Think, then answer."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tiny_model_dir(tmp_path_factory)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = TEMPLATE
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return path


@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def server(request, model_dir):
    srv = start_server(model_dir, app_kwargs={"reasoning_parser": request.param})
    srv.parser = request.param  # type: ignore[attr-defined]
    yield srv
    srv.stop()


def _chat(server, **body) -> httpx.Response:  # type: ignore[no-untyped-def]
    return httpx.post(server.url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 60, **body})


def _stream(server, **body) -> tuple[str, str, str | None]:  # type: ignore[no-untyped-def]
    """(reasoning, content, finish reason) reassembled from the streamed deltas."""
    reasoning, content, finish = "", "", None
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 60, "stream": True,
                            **body}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            reasoning += choice["delta"].get("reasoning_content") or ""
            content += choice["delta"].get("content") or ""
            finish = choice.get("finish_reason") or finish
    return reasoning, content, finish


@pytest.mark.parametrize("seed", range(4))
def test_forced_thinking_is_split_into_reasoning_content_whole_and_streamed(server, seed):
    body = {"temperature": 1.0, "seed": seed, "guided_regex": THINKING}
    r = _chat(server, **body)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    reasoning, answer = msg["reasoning_content"], msg["content"]
    # the text the model generated, rebuilt from the two parts, is what the regex forced
    assert re.fullmatch(THINKING, f"<think>{reasoning}</think>{answer}"), msg
    assert "<think>" not in answer and "</think>" not in answer
    assert _stream(server, **body) == (reasoning, answer, "stop")  # same seed: the same reply, in deltas


def test_include_reasoning_false_drops_it(server):
    r = _chat(server, temperature=1.0, seed=0, guided_regex=THINKING, include_reasoning=False)
    msg = r.json()["choices"][0]["message"]
    assert msg.get("reasoning_content") is None and re.fullmatch(r"[A-Z][a-z]{2,10}\.", msg["content"]), msg


def test_without_a_think_block_the_parsers_differ(server):
    """deepseek_r1's template opens the block in the prompt: text before `</think>` is reasoning even with
    no `<think>`; qwen3 counts only an explicit block, so a reply without one is all content."""
    body = {"temperature": 1.0, "seed": 1, "guided_regex": r"[a-z]{3,12}</think>[A-Z][a-z]{2,10}\."}
    msg = _chat(server, **body).json()["choices"][0]["message"]
    if server.parser == "deepseek_r1":
        assert re.fullmatch(r"[a-z]{3,12}", msg["reasoning_content"]) and re.fullmatch(r"[A-Z][a-z]{2,10}\.",
                                                                                         msg["content"]), msg
    else:
        assert msg["reasoning_content"] is None and "</think>" in msg["content"], msg
    streamed = _stream(server, **body)
    assert streamed == (msg["reasoning_content"] or "", msg["content"] or "", "stop")


def test_chat_template_kwargs_reach_the_template(server):
    """enable_thinking=false makes the template write the empty block into the prompt: the chat route's prompt
    grows by exactly its tokens (one per byte here), and /tokenize renders the same text."""
    counts = {}
    for flag in (True, False):
        kw = {"chat_template_kwargs": {"enable_thinking": flag}}
        usage = _chat(server, max_tokens=1, **kw).json()["usage"]
        tok = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES, **kw}).json()
        assert tok["count"] == usage["prompt_tokens"]
        counts[flag] = (usage["prompt_tokens"], tok["tokens"])
    assert counts[False][0] - counts[True][0] == len(EMPTY_BLOCK.encode())
    assert httpx.post(server.url + "/detokenize", json={"tokens": counts[False][1]}).json()["prompt"].endswith(
        "<assistant>" + EMPTY_BLOCK)
    # no kwargs: the template's own default (thinking on, no block)
    assert _chat(server, max_tokens=1).json()["usage"]["prompt_tokens"] == counts[True][0]
    # qwen3 with thinking off: the reply is all content
    if server.parser == "qwen3":
        msg = _chat(server, temperature=1.0, seed=2, guided_regex=r"[A-Z][a-z]{2,10}\.",
                    chat_template_kwargs={"enable_thinking": False}).json()["choices"][0]["message"]
        assert msg["reasoning_content"] is None and re.fullmatch(r"[A-Z][a-z]{2,10}\.", msg["content"]), msg
