"""Issue 13: nothing a client sends can kill the engine. One regression test per finding (1-9), each of which
failed on the code before the fix, plus `n` through the server sharing the prompt's blocks (issue 14)."""
from __future__ import annotations

import concurrent.futures
import json
import logging
import socket
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from kvforge.cli import main
from kvforge.engine.args import EngineArgs, EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.request_check import RequestLimits, RequestRejected, check_request
from kvforge.engine.sampling_params import SEED_MAX, SamplingParams, sample_seed
from kvforge.server.app import build_app
from kvforge.server.async_engine import AsyncEngine
from kvforge.server.background import BackgroundServer
from kvforge.server.lifecycle import ServerLimits
from server_fixtures import MODEL_NAME, on_engine, parse_metrics, tiny_model_dir, wait_idle_and_check_blocks

ENGINE_OPTIONS = EngineConfig().to_dict()  # every flat engine option name
OK = {"model": MODEL_NAME, "prompt": "abc", "max_tokens": 3}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
LIMITS = ServerLimits(header_timeout=1.5, keep_alive_timeout=5, max_connections=48, shutdown_timeout=1.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


def _server(model_dir: str, limits: ServerLimits = LIMITS, **kwargs: object) -> BackgroundServer:
    engine_kw: dict = dict(num_kv_blocks=256, max_model_len=256, max_num_seqs=8, log_ledger=False)
    engine_kw.update({k: kwargs.pop(k) for k in list(kwargs) if k in ENGINE_OPTIONS})
    engine = LLMEngine(EngineArgs(model=model_dir, **engine_kw))
    return BackgroundServer(engine, model_name=MODEL_NAME, limits=limits, max_request_bytes=8 << 20,
                            **kwargs).start()  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def server(model_dir):
    srv = _server(model_dir, body_timeout=1.0, max_waiting_requests=6)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def _eventually(check, what: str, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    """Poll `check` until it returns something truthy (for events a test cannot subscribe to: a log line, a
    socket the server has accepted or dropped); a slow machine waits longer, it never decides the outcome."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return got


def _connections(srv: BackgroundServer) -> int:
    """Connections uvicorn holds open now (what its connection cap counts)."""
    return len(srv.server.server_state.connections)


def _healthy(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json=OK)
    assert r.status_code == 200, r.text


def _error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err


def _sse(r: httpx.Response) -> list[str]:
    return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


# ---- 1. a seed outside int64 killed the engine thread for good -----------------------------------------------------
@pytest.mark.parametrize("body", [{"seed": 1180591620717411303424}, {"n": 2, "seed": 18446744073709551615},
                                  {"seed": -1}, {"seed": 2**63}])
def test_out_of_range_seeds_are_400_and_the_engine_lives(http, server, body):
    err = _error(http.post("/v1/completions", json={**OK, "temperature": 1.0, **body}), 400, "seed")
    assert "2**63 - 1" in err["message"]
    _healthy(http)


def test_top_seed_with_n_wraps_instead_of_overflowing(http, server):
    r = http.post("/v1/completions", json={**OK, "temperature": 1.0, "n": 2, "seed": SEED_MAX, "ignore_eos": True})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert sample_seed(SEED_MAX, 1) == 0 and sample_seed(5, 2) == 7
    wait_idle_and_check_blocks(server)


def test_seed_range_in_sampling_params_engine_and_cli(model_dir, capsys):
    for bad in (-1, 2**63, 2**64 - 1):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=bad)
    params = SamplingParams(seed=1)
    params.seed = 2**64  # reassigned after validation: the engine's own check still refuses it
    with pytest.raises(RequestRejected, match="seed"):
        check_request([1, 2], params, RequestLimits(256, 256, 320, 8, 16))
    with pytest.raises(ValueError, match="seed"):
        EngineArgs(model=model_dir, seed=2**63)
    assert main(["generate", "x", "--model", model_dir, "--sampling-seed", str(2**64)]) == 2
    assert main(["generate", "x", "--model", model_dir, "--seed", "-5"]) == 2
    err = capsys.readouterr().err
    assert "--sampling-seed" in err and "seed" in err


def test_one_failing_request_fails_alone_and_the_engine_keeps_serving(server, http):
    """A request whose step raises (a poisoned sampler) gets a generic 500 / error event; the engine lives on."""
    runner = server.async_engine.engine.runner
    real = runner._generator

    def poisoned(request_id, seed, sample_index=0):  # type: ignore[no-untyped-def]
        if seed == 4242:
            raise ValueError("Overflow when unpacking long long")
        return real(request_id, seed, sample_index)

    runner._generator = poisoned
    try:
        r = http.post("/v1/completions", json={**OK, "temperature": 1.0, "seed": 4242})
        err = _error(r, 500, None)
        assert "Overflow" not in r.text and err["type"] == "server_error"
        with http.stream("POST", "/v1/completions", json={**OK, "temperature": 1.0, "seed": 4242, "stream": True}) as s:
            events = _sse(s)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "internal_error"
        _healthy(http)
        assert server.async_engine.alive
    finally:
        runner._generator = real
    wait_idle_and_check_blocks(server)


# ---- 2. 500 instead of 400; 500 bodies leaked exception reprs ------------------------------------------------------
def test_lone_surrogates_are_400_naming_the_field(http):
    raw = b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}'
    _error(http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), 400, "prompt")
    raw = b'{"messages": [{"role": "user", "content": "x\\udfffy"}]}'
    _error(http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}),
           400, "messages[0].content")
    _healthy(http)


def test_json_nested_100000_deep_is_400(http):
    raw = b"[" * 100_000 + b"]" * 100_000
    err = _error(http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), 400, None)
    assert "nested" in err["message"]
    _healthy(http)


def test_chat_template_overflow_is_400(server, http):
    tok = server.async_engine.engine.tokenizer
    original = tok.chat_template
    tok.chat_template = "{% for i in range(messages[0]['content'] | int) %}x{% endfor %}"
    try:
        r = http.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "10000000"}]})
        _error(r, 400, "messages")
    finally:
        tok.chat_template = original
    _healthy(http)


def test_internal_errors_are_generic_500s(server, http, caplog):
    serving = server.app.state.serving
    real = serving.prepare
    serving.prepare = lambda req: (_ for _ in ()).throw(RuntimeError("secret internal detail"))
    try:
        with caplog.at_level(logging.ERROR, logger="kvforge.server"):
            r = http.post("/v1/completions", json=OK)
        err = _error(r, 500, None)
        assert "secret" not in r.text and err["code"] == "internal_error"
        assert any("secret internal detail" in str(rec.exc_info[1]) for rec in caplog.records if rec.exc_info)
    finally:
        serving.prepare = real
    _healthy(http)


# ---- 3. a client disconnecting mid-upload logged a traceback each time -----------------------------------------------
class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_disconnect_mid_upload_is_one_debug_line(server, http):
    handler = _Records()
    loggers = [logging.getLogger(n) for n in ("kvforge.server", "uvicorn.error", "uvicorn")]
    for lg in loggers:
        lg.addHandler(handler)
    old_level = loggers[0].level
    loggers[0].setLevel(logging.DEBUG)
    try:
        before = _connections(server)
        for _ in range(20):
            with socket.create_connection((server.host, server.port)) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"prompt\": \"ab")
                time.sleep(0.02)
        # every upload's connection gone from the server, and its line logged
        _eventually(lambda: _connections(server) <= before, "the server kept a dropped upload's connection")
        _eventually(lambda: any("disconnected" in r.getMessage() for r in handler.records), "no disconnect line")
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
        loggers[0].setLevel(old_level)
    noisy = [r for r in handler.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not noisy, [r.getMessage() for r in noisy]
    assert sum("disconnected" in r.getMessage() for r in handler.records) >= 1
    _healthy(http)


# ---- 4. no timeout on a slow or incomplete body; no connection cap ---------------------------------------------------
def _recv_all(s: socket.socket, timeout: float) -> bytes:
    return _recv_until_closed(s, timeout)[0]


def _recv_until_closed(s: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """(what arrived, whether the server closed the connection) within `timeout` (our side's limit)."""
    s.settimeout(timeout)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except socket.timeout:
        return data, False
    except ConnectionResetError:
        pass
    return data, True


def test_incomplete_body_gets_408_and_slow_head_is_closed(server, http):
    with socket.create_connection((server.host, server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": \"ab")
        reply, closed = _recv_until_closed(s, 30)
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply, reply[:200]  # the server's timeout
    assert closed, "the server answered 408 but kept the connection open"
    with socket.create_connection((server.host, server.port)) as s:  # slowloris: never finishes its head
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        reply, closed = _recv_until_closed(s, 30)
        assert closed and reply == b"", "the server did not close a connection whose head never finished"
    _healthy(http)


def test_connection_cap_answers_503(server, http):
    socks = [socket.create_connection((server.host, server.port)) for _ in range(LIMITS.max_connections)]  # type: ignore[arg-type]
    try:
        _eventually(lambda: _connections(server) >= LIMITS.max_connections, "the server never took the connections")
        r = httpx.post(server.url + "/v1/completions", json=OK, timeout=10)
        assert r.status_code == 503
    finally:
        for s in socks:
            s.close()
    _eventually(lambda: _connections(server) < LIMITS.max_connections, "the closed connections stayed open")
    _healthy(http)


# ---- 5. no backpressure -------------------------------------------------------------------------------------------
def test_full_queue_is_503_with_retry_after_and_counted(server, http):
    body = {**OK, "max_tokens": 60, "ignore_eos": True}
    before = parse_metrics(http.get("/metrics").text)
    with concurrent.futures.ThreadPoolExecutor(30) as pool:
        results = list(pool.map(lambda _: httpx.post(server.url + "/v1/completions", json=body, timeout=120), range(30)))
    busy = [r for r in results if r.status_code == 503]
    assert busy and all(r.status_code in (200, 503) for r in results)
    assert all(r.headers.get("retry-after") == "1" and r.json()["error"]["code"] == "server_busy" for r in busy)
    after = parse_metrics(http.get("/metrics").text)
    key = f'kvforge_requests_rejected_total{{model_name="{MODEL_NAME}",reason="queue_full"}}'
    assert after[key] - before.get(key, 0) == len(busy)
    assert after[f'kvforge_max_waiting_requests{{model_name="{MODEL_NAME}"}}'] == 6
    wait_idle_and_check_blocks(server)


# ---- 6. shutdown cut streams without an error event or [DONE] --------------------------------------------------------
def test_drain_finishes_short_requests_and_ends_long_streams_cleanly(model_dir):
    # long streams must outlast the 1 s shutdown timeout even on a fast, idle machine
    srv = _server(model_dir, max_num_seqs=8, max_model_len=4096, num_kv_blocks=600)
    try:
        long_body = {**OK, "max_tokens": 4000, "ignore_eos": True, "stream": True, "prompt": "a"}
        short_body = {**OK, "max_tokens": 2, "ignore_eos": True, "stream": True}

        def stream(body: dict) -> list[str]:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                return _sse(r)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(stream, long_body) for _ in range(2)]
            deadline = time.monotonic() + 30
            # both long streams are in the engine before the drain: on a loaded machine one could otherwise
            # arrive after it started and be refused (503, no events)
            while srv.async_engine.num_in_flight < 2:
                assert time.monotonic() < deadline, "the requests never reached the engine"
                time.sleep(0.01)
            short = pool.submit(stream, short_body)
            while srv.async_engine.num_in_flight < 3 and not short.done():
                assert time.monotonic() < deadline, "the requests never reached the engine"
                time.sleep(0.01)
            srv.drain()
            health = _eventually(lambda: [h for h in [httpx.get(srv.url + "/health", timeout=5)] if h.status_code == 503],
                                 "/health never said draining")[0]
            refused = httpx.post(srv.url + "/v1/completions", json=OK, timeout=5)
            longs = [f.result(30) for f in futs]
            shorts = short.result(30)
        assert health.status_code == 503 and health.json()["error"]["code"] == "draining"
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"  # as /health says
        assert shorts[-1] == "[DONE]" and json.loads(shorts[-2])["choices"][0]["finish_reason"] == "length"
        for events in longs:
            assert events[-1] == "[DONE]"
            assert "shutdown-timeout" in json.loads(events[-2])["error"]["message"]
        srv.thread.join(15)
        assert not srv.thread.is_alive(), "the server did not stop after draining"
        engine = srv.async_engine.engine
        srv.async_engine.shutdown()
        engine.check_integrity()
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
    finally:
        srv.stop()


# ---- 7. model files that crashed with tracebacks ------------------------------------------------------------------
def _broken_copy(src: str, dst, edit=None, header: bytes | None = None) -> str:  # type: ignore[no-untyped-def]
    import shutil

    shutil.copytree(src, dst)
    if edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if header is not None:
        (dst / "model.safetensors").write_bytes(header)
    return str(dst)


BROKEN_CONFIGS = [
    ("heads0", lambda c: c.update(num_attention_heads=0), "num_attention_heads"),
    ("layers-1", lambda c: c.update(num_hidden_layers=-1), "num_hidden_layers"),
    ("layers3", lambda c: c.update(num_hidden_layers=3), "num_hidden_layers"),
    ("kvheads3", lambda c: c.update(num_key_value_heads=3), "num_key_value_heads"),
    ("vocab", lambda c: c.update(vocab_size=999), "vocab_size"),
    ("head_dim", lambda c: c.update(head_dim=8), "head_dim"),
    ("hidden_str", lambda c: c.update(hidden_size="64"), "hidden_size"),
    ("no_vocab", lambda c: c.pop("vocab_size"), "vocab_size"),
]


@pytest.mark.parametrize("name,edit,field", BROKEN_CONFIGS, ids=[b[0] for b in BROKEN_CONFIGS])
def test_broken_config_exits_2_naming_file_and_field(model_dir, tmp_path, capsys, name, edit, field):
    path = _broken_copy(model_dir, tmp_path / name, edit)
    assert main(["generate", "x", "--model", path, "--quiet-ledger"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config.json" in err and field in err, err


@pytest.mark.parametrize("header", [
    (2**62).to_bytes(8, "little") + b"{}",
    (40).to_bytes(8, "little") + b'{"model.embed_tokens.weight": {"dtype": "F32", "shape": [1000000000, 1000000], '
                                 b'"data_offsets": [0, 4]}}',
    (9).to_bytes(8, "little") + b"not json!",
], ids=["2^62-header", "huge-shape", "not-json"])
def test_hostile_safetensors_header_exits_2(model_dir, tmp_path, capsys, header):
    path = _broken_copy(model_dir, tmp_path / "st", header=header)
    assert main(["generate", "x", "--model", path, "--quiet-ledger"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.safetensors" in err, err


# ---- 8. /v1/models reported max_model_len 8192 with a 64-token cache ------------------------------------------------
def test_models_reports_the_effective_limit_and_the_ledger(model_dir):
    engine = LLMEngine(EngineArgs(model=model_dir, num_kv_blocks=4, block_size=16, max_model_len=256,
                                  max_num_batched_tokens=64, log_ledger=False))
    card = TestClient(build_app(AsyncEngine(engine), MODEL_NAME)).get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == engine.scheduler.max_seq_len <= 64
    # 4 blocks of memory, one the pool's reserved null block: 3 usable blocks of 16 tokens
    assert card["kvforge"]["configured_max_model_len"] == 256 and card["kvforge"]["kv_cache_tokens"] == 48


# ---- 9. a 1,000-message chat --------------------------------------------------------------------------------------
def test_thousand_message_chat_is_handled_as_one_prompt(http):
    """Rendering and tokenizing 1,000 messages is linear (profiled: 0.2 s); the prompt is then judged by its
    length like any other: here too long for max_model_len, a 400 naming 'messages', at once."""
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(1000)]
    err = _error(http.post("/v1/chat/completions", json={**CHAT, "messages": msgs}), 400, "messages")
    assert err["code"] == "context_length_exceeded"
    _healthy(http)


# ---- issue 14: one admission check; n through the server shares the prompt's blocks --------------------------------
def test_check_request_is_the_one_admission_check(server):
    engine = server.async_engine.engine
    with pytest.raises(RequestRejected) as exc:
        engine.check_request([1] * 300, SamplingParams())
    assert exc.value.param == "prompt" and exc.value.code == "context_length_exceeded"
    with pytest.raises(RequestRejected) as exc:
        engine.check_request([1, 2], SamplingParams(max_tokens=1000), strict_max_tokens=True)
    assert exc.value.param == "max_tokens"
    assert engine.check_request([1, 2], SamplingParams(max_tokens=1000)) == 254  # offline: stops at the limit
    with pytest.raises(RequestRejected, match="max_num_seqs"):
        engine.check_request([1, 2], SamplingParams(n=9))


def test_n4_through_the_server_shares_the_prompt_blocks(server, http):
    prompt = "x" * 40  # 40 byte tokens: two full blocks of 16 and a partial one
    seen: dict = {}

    def peek(e: LLMEngine) -> None:
        for rid, samples in e.samples.items():
            if len(samples) == 4:
                table = e.kv.managers[0].tables if hasattr(e.kv, "managers") else e.kv.tables
                seen["refs"] = [b.ref_cnt for b in table[samples[0].request_id][:2]]
                seen["prompt_tokens"] = e.counters.num_prompt_tokens

    before = on_engine(server, lambda e: e.counters.num_prompt_tokens)
    body = {**OK, "prompt": prompt, "n": 4, "max_tokens": 30, "temperature": 1.0, "seed": 7, "ignore_eos": True,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 4 and not seen:
                on_engine(server, peek)
    assert seen["refs"] == [4, 4], seen
    assert seen["prompt_tokens"] - before == 40  # the prompt was prefilled once, not four times
    r = http.post("/v1/completions", json={**body, "stream": False})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3] and len({c["text"] for c in choices}) > 1
    assert r.json()["usage"]["completion_tokens"] == 120 and r.json()["usage"]["prompt_tokens"] == 40
    wait_idle_and_check_blocks(server)


# ---- issue 14 item 7: /metrics by prometheus-client, every vllm: alias kept ----------------------------------------
VLLM_ALIASES = {  # every alias the hand-written exposition had, with its type
    "vllm:kv_cache_usage_perc": "gauge", "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:num_preemptions": "counter", "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
}


def test_metrics_parse_with_prometheus_client_and_keep_every_vllm_alias(http):
    from prometheus_client.parser import text_string_to_metric_families

    _healthy(http)
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    for name, kind in VLLM_ALIASES.items():
        assert name in families and families[name].type == kind, name
        assert all(s.labels.get("model_name") == MODEL_NAME for s in families[name].samples), name
    kv = {n[len("kvforge_"):] for n in families if n.startswith("kvforge_")}
    assert {"requests_rejected", "requests_waiting", "max_waiting_requests", "draining"} <= kv
    success = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert success == {"stop", "length"}  # vLLM counts only successful requests there
    assert not any(s.name.endswith("_created") for f in families.values() for s in f.samples)


# ---- finding 1, last part: an engine that cannot continue ends the process with a non-zero exit code ----------------
def test_kvforge_serve_exits_1_when_the_engine_cannot_continue(model_dir, monkeypatch, capsys):
    import threading

    from test_chaos import _free_port

    real_step = LLMEngine.step

    def broken_step(self):  # type: ignore[no-untyped-def]
        if self.counters.num_steps >= 1:
            raise RuntimeError("simulated device loss")
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", broken_step)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    replies: list[int] = []

    def client() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                replies.append(httpx.post(url + "/v1/completions", json={**OK, "max_tokens": 5}, timeout=30).status_code)
                return
            except httpx.HTTPError:
                time.sleep(0.1)

    t = threading.Thread(target=client, daemon=True)
    t.start()
    code = main(["serve", "--model", model_dir, "--port", str(port), "--served-model-name", MODEL_NAME,
                 "--num-kv-blocks", "32", "--max-model-len", "128", "--log-level", "error"])
    t.join(30)
    assert code == 1 and replies == [503]
    assert "cannot continue" in capsys.readouterr().err
