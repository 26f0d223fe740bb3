"""Scoring through the server: echo, prompt logprobs, max_tokens 0, penalties, tokenizer routes, models/{id}.

The lm-evaluation-harness payload (`local-completions` loglikelihood: token-id prompts, echo, max_tokens 1,
logprobs 1) is replayed exactly and parsed the way the harness parses it; the log-likelihoods must equal
transformers' within 1e-3 and the greedy flags must agree.
"""
from __future__ import annotations

import httpx
import openai
import pytest
import torch

from server_fixtures import MODEL_NAME, start_server, tiny_model_dir, wait_idle_and_check_blocks
from tiny_models import build_tiny_model

KEY = "sk-evals"


@pytest.fixture(scope="module")
def hf_and_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-evals"))
    return build_tiny_model(path, "llama_gqa"), path


@pytest.fixture(scope="module")
def server(hf_and_dir):
    srv = start_server(hf_and_dir[1], api_key=KEY, max_num_batched_tokens=32, dtype="float32")  # fp32: logprobs vs transformers
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(autouse=True)
def no_leaks(server):
    yield
    wait_idle_and_check_blocks(server)


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _ids(http, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def _text(http, ids: list[int]) -> str:
    return http.post("/detokenize", json={"tokens": ids}).json()["prompt"]


def test_lm_eval_loglikelihood_payload(http, hf_and_dir):
    hf = hf_and_dir[0]
    ctx = [_ids(http, "The capital of France is"), _ids(http, "2 + 2 =")]
    conts = [[_ids(http, " Paris"), _ids(http, " Rome")], [_ids(http, " 4"), _ids(http, " five")]]
    inputs, ctxlens = [], []
    for c, options in zip(ctx, conts):
        for o in options:
            inputs.append(c + o)
            ctxlens.append(len(c))
    payload = {"model": MODEL_NAME, "prompt": inputs, "temperature": 0, "max_tokens": 1, "logprobs": 1,
               "seed": 1234, "echo": True}  # lm_eval/models/openai_completions.py, loglikelihood
    out = http.post("/v1/completions", json=payload).json()
    choices = sorted(out["choices"], key=lambda ch: ch["index"])
    assert len(choices) == len(inputs)
    for choice, ids, ctxlen in zip(choices, inputs, ctxlens):
        lps = choice["logprobs"]
        assert len(lps["token_logprobs"]) == len(ids) + 1 and lps["token_logprobs"][0] is None
        assert choice["text"].startswith(_text(http, ids))
        got = sum(lps["token_logprobs"][ctxlen:-1])
        greedy = all(t == max(top.values()) for t, top in zip(lps["token_logprobs"][ctxlen:-1],
                                                             lps["top_logprobs"][ctxlen:-1]))
        ref = _hf_logprobs(hf, ids)
        want = sum(ref[j - 1, ids[j]].item() for j in range(ctxlen, len(ids)))
        want_greedy = all(ref[j - 1].argmax().item() == ids[j] for j in range(ctxlen, len(ids)))
        assert abs(got - want) < 1e-3 and greedy == want_greedy


def test_echo_max_tokens_zero_scores_the_prompt_only(http, hf_and_dir):
    ids = _ids(http, "hello world, scored")
    body = http.post("/v1/completions", json={"prompt": [ids], "max_tokens": 0, "echo": True, "logprobs": 2}).json()
    ch = body["choices"][0]
    assert ch["text"] == "hello world, scored" and ch["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    lps = ch["logprobs"]
    assert len(lps["tokens"]) == len(ids) and lps["top_logprobs"][0] is None
    ref = _hf_logprobs(hf_and_dir[0], ids)
    for j in range(1, len(ids)):
        assert abs(lps["token_logprobs"][j] - ref[j - 1, ids[j]].item()) < 1e-4
        top = lps["top_logprobs"][j]  # keyed by text: two ids that decode alike share a key
        assert 1 <= len(top) <= 2 and abs(max(top.values()) - ref[j - 1].max().item()) < 1e-4
    # the same through the openai SDK, streamed: one chunk carries the echoed prompt
    client = openai.OpenAI(base_url=http.base_url.join("/v1").__str__(), api_key=KEY, max_retries=0)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt="abc def", max_tokens=3, echo=True, temperature=0, stream=True))
    full = client.completions.create(model=MODEL_NAME, prompt="abc def", max_tokens=3, echo=True, temperature=0)
    assert text == full.choices[0].text and text.startswith("abc def")


def test_max_tokens_zero_needs_echo(http):
    r = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_vllm_prompt_logprobs_shape(http, hf_and_dir):
    ids = _ids(http, "shape check")
    ch = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 1,
                                             "temperature": 0}).json()["choices"][0]
    pl = ch["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    ref = _hf_logprobs(hf_and_dir[0], ids)
    for j in range(1, len(ids)):
        own = pl[j][str(ids[j])]
        assert abs(own["logprob"] - ref[j - 1, ids[j]].item()) < 1e-4
        assert own["decoded_token"] == _text(http, [ids[j]])
        assert any(e["rank"] == 1 for e in pl[j].values())
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                    "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_penalties_and_logit_bias_through_the_api(http):
    base = {"prompt": "abcabcabc", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    plain = http.post("/v1/completions", json=base).json()["choices"][0]["text"]
    (z,) = _ids(http, "z")
    forced = http.post("/v1/completions", json={**base, "logit_bias": {str(z): 100}}).json()
    assert forced["choices"][0]["text"] == "z" * 6
    bias = {str(_ids(http, c)[0]): -100 for c in set(plain)}
    banned = http.post("/v1/completions", json={**base, "logit_bias": bias}).json()
    assert not set(banned["choices"][0]["text"]) & set(plain)
    rep = http.post("/v1/completions", json={**base, "repetition_penalty": 1.5, "presence_penalty": 1.0,
                                             "frequency_penalty": 0.5}).json()
    assert rep["choices"][0]["finish_reason"] == "length"
    best = http.post("/v1/completions", json={**base, "temperature": 1.0, "seed": 3, "n": 2, "best_of": 4}).json()
    assert [c["index"] for c in best["choices"]] == [0, 1]


def test_tokenizer_routes_round_trip(http):
    text = "Hello, KV cache!"
    tok = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256 and len(tok["token_strs"]) == tok["count"]
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": text}
    messages = [{"role": "user", "content": "hi there"}]
    chat_tok = http.post("/tokenize", json={"messages": messages}).json()
    rendered = http.post("/detokenize", json={"tokens": chat_tok["tokens"]}).json()["prompt"]
    assert rendered == "<user>hi there\n<assistant>"  # the tiny model's chat template, generation prompt included
    bare = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert _text(http, bare["tokens"]) == "<user>hi there\n"
    usage = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == chat_tok["count"]
    info = http.get("/tokenizer_info").json()
    assert "eos_token" in info and info["chat_template"].startswith("{% for m in messages %}")
    assert http.post("/detokenize", json={"tokens": [10 ** 9]}).json()["error"]["param"] == "tokens"
    assert http.post("/tokenize", json={"prompt": 5}).json()["error"]["param"] == "prompt"


def test_models_retrieve_and_auth_on_new_routes(server, http):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found"  # OpenAI's error shape
    for method, path in [("GET", "/tokenizer_info"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                         ("GET", f"/v1/models/{MODEL_NAME}")]:
        assert httpx.request(method, server.url + path, json={"prompt": "a", "tokens": [1]}).status_code == 401
