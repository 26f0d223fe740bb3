"""The OpenAI-compatible server, driven by the official `openai` client against a tiny model."""
from __future__ import annotations

import httpx
import openai
import pytest

from kvforge.engine.llm import LLM
from kvforge.engine.sampling_params import SamplingParams
from server_fixtures import MODEL_NAME, parse_metrics, start_server, tiny_model_dir, wait_idle_and_check_blocks

PROMPTS = ["Hello there, how are you", "The KV cache is", "abc"]
GREEDY = {"temperature": 0, "max_tokens": 12}
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = start_server(model_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy outputs of the offline LLM API on its own engine: what the server must reproduce."""
    llm = LLM(model=model_dir, num_kv_blocks=64, max_model_len=256, log_ledger=False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return {p: o.outputs[0] for p, o in zip(PROMPTS, outs)}


@pytest.fixture(autouse=True)
def no_leaks(server):
    yield
    wait_idle_and_check_blocks(server)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(server.url + "/health").status_code == 200


def test_completion_matches_offline_llm_and_counts_usage(server, client, reference):
    tok = server.async_engine.engine.tokenizer
    for prompt in PROMPTS:
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, extra_body=NO_EOS, **GREEDY)
        assert r.object == "text_completion" and len(r.choices) == 1
        assert r.choices[0].text == reference[prompt].text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(tok.encode(prompt))
        assert r.usage.completion_tokens == 12
        assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_completion_token_id_prompt(client, server, reference):
    ids = server.async_engine.engine.tokenizer.encode(PROMPTS[1])
    r = client.completions.create(model=MODEL_NAME, prompt=ids, extra_body=NO_EOS, **GREEDY)
    assert r.choices[0].text == reference[PROMPTS[1]].text


def test_streamed_completion_equals_non_streamed(client):
    for prompt in PROMPTS:
        full = client.completions.create(model=MODEL_NAME, prompt=prompt, extra_body=NO_EOS, **GREEDY)
        chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, stream=True,
                                                stream_options={"include_usage": True}, extra_body=NO_EOS, **GREEDY))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == full.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.model_dump()["completion_tokens"] == 12
        assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
        assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage(client):
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="abc", stream=True, **GREEDY))
    assert chunks and all(c.usage is None and len(c.choices) == 1 for c in chunks)


def test_chat_completion_and_stream(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, extra_body=NO_EOS, **GREEDY)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and len(r.choices[0].message.content) > 0
    assert r.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=NO_EOS, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_chat_prompt_is_the_chat_template(client, server):
    """Usage counts the rendered template, so the template really was applied."""
    tok = server.async_engine.engine.tokenizer
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    assert r.usage.prompt_tokens == len(tok.encode("<user>hi\n<assistant>", add_special_tokens=False))


def test_n2_seeded_sampling(client):
    kw = dict(model=MODEL_NAME, prompt="The KV cache is", n=2, max_tokens=10, temperature=1.0, seed=7, extra_body=NO_EOS)
    r = client.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.choices[0].text != r.choices[1].text  # seed + i: different samples
    assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens == len("The KV cache is")
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible
    streamed = {0: "", 1: ""}
    for c in client.completions.create(stream=True, **kw):
        streamed[c.choices[0].index] += c.choices[0].text
    assert [streamed[0], streamed[1]] == [c.text for c in r.choices]


def test_n2_greedy_chat_stream(client):
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                                 n=2, stream=True, extra_body=NO_EOS, **GREEDY))
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].delta.content or ""
    assert texts[0] == texts[1] != ""


def _printable_stop(text: str) -> str | None:
    for i, ch in enumerate(text[2:], start=2):
        if ch.isascii() and ch.isprintable() and ch not in text[:i]:
            return ch
    return None


def test_stop_strings(client):
    for prompt in PROMPTS:
        base = client.completions.create(model=MODEL_NAME, prompt=prompt, extra_body=NO_EOS,
                                          temperature=0, max_tokens=30).choices[0].text
        stop = _printable_stop(base)
        if stop is None:
            continue
        expected = base[: base.index(stop)]
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, stop=[stop, "never-seen"],
                                      extra_body=NO_EOS, temperature=0, max_tokens=30)
        assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
        assert r.choices[0].model_extra["stop_reason"] == stop
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL_NAME, prompt=prompt, stop=stop, stream=True, extra_body=NO_EOS, temperature=0, max_tokens=30))
        assert streamed == expected
        return
    pytest.fail("no prompt produced a printable character to stop on")


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL_NAME, prompt="abc", logprobs=3, extra_body=NO_EOS, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        # greedy picks the most likely token (byte tokens can share a display text, so keys may collide)
        assert chosen >= max(top.values()) - 1e-5
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_logprobs_streamed(client):
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                                 logprobs=True, top_logprobs=2, stream=True, extra_body=NO_EOS, **GREEDY))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 12
    assert all(len(e.top_logprobs) == 2 and e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in entries)


def test_metrics_exposition(server, client):
    before = parse_metrics(httpx.get(server.url + "/metrics").text)
    client.completions.create(model=MODEL_NAME, prompt="abc", extra_body=NO_EOS, **GREEDY)
    wait_idle_and_check_blocks(server)
    resp = httpx.get(server.url + "/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    after = parse_metrics(resp.text)
    lbl = f'{{model_name="{MODEL_NAME}"}}'
    assert after["kvforge_generation_tokens_total" + lbl] - before["kvforge_generation_tokens_total" + lbl] == 12
    assert after["kvforge_prompt_tokens_total" + lbl] - before["kvforge_prompt_tokens_total" + lbl] == 3
    # num_kv_blocks=256 is the memory of 256 blocks; the pool's reserved null block takes one of them
    assert after["kvforge_kv_blocks_free" + lbl] == after["kvforge_kv_blocks_total" + lbl] == 255
    assert after["kvforge_requests_running" + lbl] == 0 and after["kvforge_kv_cache_usage_ratio" + lbl] == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        key = f"kvforge_{name}_count{lbl}"
        assert after[key] - before[key] == 1
    itl = f"kvforge_inter_token_latency_seconds_count{lbl}"
    assert after[itl] - before[itl] == 11
    assert after[f"vllm:generation_tokens_total{lbl}"] == after[f"kvforge_generation_tokens_total{lbl}"]
    assert after[f"vllm:e2e_request_latency_seconds_count{lbl}"] == after[f"kvforge_e2e_request_latency_seconds_count{lbl}"]
    assert f'vllm:time_to_first_token_seconds_bucket{{model_name="{MODEL_NAME}",le="+Inf"}}' in after
    assert f"vllm:prefix_cache_queries_total{lbl}" in after and f"vllm:num_preemptions_total{lbl}" in after


def test_prefix_cache_hit_reported_as_cached_tokens(client):
    prompt = "A shared system prompt that spans more than two KV blocks of sixteen tokens each. " + "q"
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens >= 64
