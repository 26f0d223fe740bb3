"""Bad requests get 400/401/404/413 with an OpenAI-style error naming the problem; the server keeps serving."""
from __future__ import annotations

import httpx
import openai
import pytest

from kvforge.server.auth import resolve_api_key
from server_fixtures import MODEL_NAME, start_server, tiny_model_dir, wait_idle_and_check_blocks

OK_COMPLETION = {"model": MODEL_NAME, "prompt": "abc", "max_tokens": 3}
OK_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = start_server(model_dir, max_model_len=128)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def _still_serves(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json=OK_COMPLETION)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def _expect(resp: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    return err


BAD_COMPLETIONS = [
    ({"prompt": 123}, "prompt", "prompt"),
    ({"prompt": []}, "prompt", "prompt"),
    ({"prompt": [1, "a"]}, "prompt", "prompt"),
    ({"max_tokens": "5"}, "max_tokens", "integer"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"temperature": "hot"}, "temperature", "number"),
    ({"temperature": -1}, "temperature", ">= 0"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_p": True}, "top_p", "number"),
    ({"n": 0}, "n", "n"),
    ({"n": "2"}, "n", "integer"),
    ({"stream": "yes"}, "stream", "boolean"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"stop": 5}, "stop", "string"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"seed": 1.5}, "seed", "integer"),
    ({"logprobs": 99}, "logprobs", "[0, 20]"),
    ({"echo": "yes"}, "echo", "boolean"),
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "vocabulary"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
    ({"bad_words": "bad"}, "bad_words", "list of strings"),
    ({"best_of": 1, "n": 2}, "best_of", ">= n"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]"),
    ({"model": 7}, "model", "string"),
]


@pytest.mark.parametrize("patch,param,word", BAD_COMPLETIONS, ids=[p for _, p, _ in BAD_COMPLETIONS])
def test_bad_completion_fields(http, patch, param, word):
    _expect(http.post("/v1/completions", json={**OK_COMPLETION, **patch}), 400, param, word)


BAD_CHATS = [
    ({"echo": True}, "echo"),
    ({"logit_bias": {"1": "a"}}, "logit_bias"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"tools": [{"type": "function"}]}, "tools"),
]


@pytest.mark.parametrize("patch,param", BAD_CHATS, ids=[p for _, p in BAD_CHATS])
def test_bad_chat_fields(http, patch, param):
    _expect(http.post("/v1/chat/completions", json={**OK_CHAT, **patch}), 400, param)


def test_malformed_json_and_non_object_body(http):
    err = _expect(http.post("/v1/completions", content=b'{"prompt": "abc",', headers={"content-type": "application/json"}),
                  400, None, "not valid JSON")
    assert err["type"] == "invalid_request_error"
    _expect(http.post("/v1/completions", content=b"\xff\xfe", headers={"content-type": "application/json"}), 400, None, "JSON")
    _expect(http.post("/v1/chat/completions", json=[1, 2]), 400, None, "JSON object")
    _still_serves(http)


def test_prompt_longer_than_max_model_len(http):
    err = _expect(http.post("/v1/completions", json={**OK_COMPLETION, "prompt": "x" * 200}), 400, "prompt",
                  "200 tokens", "max_model_len is 128")
    assert err["code"] == "context_length_exceeded"
    _expect(http.post("/v1/chat/completions", json={**OK_CHAT, "messages": [{"role": "user", "content": "y" * 300}]}),
            400, "messages", "max_model_len")
    _still_serves(http)


def test_max_tokens_that_cannot_fit(http):
    _expect(http.post("/v1/completions", json={**OK_COMPLETION, "prompt": "x" * 100, "max_tokens": 50}),
            400, "max_tokens", "at most 28 new tokens")
    r = http.post("/v1/completions", json={**OK_COMPLETION, "prompt": "x" * 100, "max_tokens": 28, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 28


def test_chat_without_max_tokens_fills_the_context(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "z" * 90}], "ignore_eos": True})
    usage = r.json()["usage"]
    assert r.status_code == 200 and usage["prompt_tokens"] + usage["completion_tokens"] == 128


def test_token_ids_out_of_vocab(http):
    _expect(http.post("/v1/completions", json={**OK_COMPLETION, "prompt": [1, 2, 100000]}), 400, "prompt", "[0, 320)")
    _still_serves(http)


def test_oversized_body_is_413(http):
    r = http.post("/v1/completions", json={**OK_COMPLETION, "prompt": "x" * (70 * 1024)})
    _expect(r, 413, None, "limit")
    # a chunked upload (no Content-Length) is cut off at the limit too
    r = http.post("/v1/completions", content=iter([b'{"prompt": "', b"x" * (70 * 1024), b'"}']),
                  headers={"content-type": "application/json"})
    _expect(r, 413, None, "limit")
    _still_serves(http)


def test_unknown_model_is_404_and_unknown_route_too(http):
    err = _expect(http.post("/v1/completions", json={**OK_COMPLETION, "model": "gpt-9"}), 404, "model", "gpt-9")
    assert err["code"] == "model_not_found"
    assert http.get("/v1/nothing-here").status_code == 404
    assert "error" in http.get("/v1/nothing-here").json()


def test_bad_requests_leak_nothing(server, http):
    for patch, _, _ in BAD_COMPLETIONS:
        http.post("/v1/completions", json={**OK_COMPLETION, **patch})
    wait_idle_and_check_blocks(server)
    _still_serves(http)


# ---- --api-key --------------------------------------------------------------------------------
def test_api_key_required_everywhere_but_health(model_dir):
    srv = start_server(model_dir, api_key="s3cret")
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                 ("GET", "/v1/models"), ("GET", "/metrics")]:
                body = OK_CHAT if "chat" in path else OK_COMPLETION
                r = http.request(method, path, json=body if method == "POST" else None)
                assert r.status_code == 401, path
                assert r.json()["error"]["code"] == "invalid_api_key"
                wrong = http.request(method, path, json=body if method == "POST" else None,
                                     headers={"Authorization": "Bearer nope"})
                assert wrong.status_code == 401, path
                good = http.request(method, path, json=body if method == "POST" else None,
                                    headers={"Authorization": "Bearer s3cret"})
                assert good.status_code == 200, path
            assert http.get("/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=2).usage.completion_tokens >= 1
        wait_idle_and_check_blocks(srv)
    finally:
        srv.stop()


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("KVFORGE_API_KEY", "from-env")
    assert resolve_api_key(None) == "from-env"
    assert resolve_api_key("flag") == "flag"
    monkeypatch.setenv("KVFORGE_API_KEY", "")
    assert resolve_api_key(None) is None


def test_engine_that_cannot_continue_answers_503_and_frees_blocks(model_dir):
    """A failure outside any one request (here the whole step call) stops the engine: every waiter gets a 503
    without the exception's repr, /health turns 503, and the owner's on_fatal runs (the CLI exits non-zero)."""
    srv = start_server(model_dir)
    engine = srv.async_engine.engine
    fatal: list[BaseException] = []
    srv.async_engine.on_fatal = fatal.append
    real_step = engine.step
    calls = {"n": 0}

    def failing_step():  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device fault")
        return real_step()

    engine.step = failing_step  # type: ignore[method-assign]
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            r = http.post("/v1/completions", json={**OK_COMPLETION, "max_tokens": 50, "ignore_eos": True})
            err = _expect(r, 503, None, "internal error")
            assert err["type"] == "server_error" and "simulated" not in r.text
            assert http.get("/health").status_code == 503
            _expect(http.post("/v1/completions", json=OK_COMPLETION), 503, None, "engine")
        srv.async_engine._thread.join(5)  # type: ignore[union-attr]
        assert not srv.async_engine.alive
        assert len(fatal) == 1 and "simulated device fault" in str(fatal[0])
        engine.check_integrity()  # the engine thread is gone, so reading it here is safe
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
    finally:
        srv.stop()
