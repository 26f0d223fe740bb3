"""Chaos: `kvforge serve` as a process under concurrent streams, random disconnects and poison requests, then
SIGTERM with streams still running (issue 13).

Only the poisoned requests may fail (with a 4xx); the KV pool balances (read from /metrics);
every stream a client reads to the end finishes with `[DONE]`, after an error event when the
drain cut it; the process exits 0 after the drain.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from server_fixtures import parse_metrics, tiny_model_dir, wait_for_health

pytestmark = pytest.mark.slow  # fault injection against a live server

POISONS = [
    {"prompt": "abc", "seed": 1180591620717411303424, "temperature": 1.0},
    {"prompt": "abc", "n": 2, "seed": 18446744073709551615, "temperature": 1.0},
    {"prompt": "abc", "max_tokens": 10**9},
    {"prompt": [1, 2, 10**9]},
]
RAW_POISONS = [b'{"prompt": "a\\ud800b"}', b"[" * 50_000 + b"]" * 50_000, b'{"prompt": "x"']


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def serve(tmp_path_factory):
    model = tiny_model_dir(tmp_path_factory)
    port = _free_port()
    cmd = [sys.executable, "-m", "kvforge.cli", "serve", "--model", model, "--port", str(port),
           "--served-model-name", "tiny", "--num-kv-blocks", "96", "--max-model-len", "512", "--max-num-seqs", "16",
           "--shutdown-timeout", "2", "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_for_health(proc, url, 120)
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _stream(url: str, body: dict, stop_after: int | None = None) -> tuple[int, list[str]]:
    """(status, data lines); with `stop_after`, hang up after that many events (a client going away)."""
    events: list[str] = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.text]
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if stop_after is not None and len(events) >= stop_after:
                    break
    return 200, events


def _one(url: str, i: int) -> tuple[str, int, list[str]]:
    rng = random.Random(i)
    kind = rng.choice(["stream", "stream", "plain", "disconnect", "poison"])
    base = {"model": "tiny", "prompt": "chaos " * rng.randint(1, 20), "max_tokens": rng.randint(4, 40),
            "ignore_eos": True, "temperature": rng.choice([0, 0.8]), "seed": rng.randint(0, 2**63 - 1)}
    if kind == "stream":
        return (kind, *_stream(url, base))
    if kind == "disconnect":
        return (kind, *_stream(url, {**base, "max_tokens": 200}, stop_after=rng.randint(1, 4)))
    if kind == "plain":
        r = httpx.post(url + "/v1/completions", json=base, timeout=120)
        return kind, r.status_code, [r.text]
    if rng.random() < 0.5:
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", **rng.choice(POISONS)}, timeout=120)
    else:
        r = httpx.post(url + "/v1/completions", content=rng.choice(RAW_POISONS),
                       headers={"content-type": "application/json"}, timeout=120)
    return kind, r.status_code, [r.text]


def test_chaos_then_sigterm(serve):
    proc, url = serve
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda i: _one(url, i), range(40)))
    for kind, status, events in results:
        if kind == "poison":
            assert 400 <= status < 500 and "param" in json.loads(events[0])["error"], events
        elif kind == "plain":
            assert status == 200, events
        else:
            assert status == 200 and events, events
            if kind == "stream":
                assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
    assert {k for k, _, _ in results} >= {"stream", "plain", "disconnect", "poison"}
    assert httpx.get(url + "/health", timeout=10).status_code == 200

    deadline = time.monotonic() + 60  # aborted streams are freed at the engine's next step
    while True:
        m = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
        lbl = '{model_name="tiny"}'
        if m["kvforge_kv_blocks_free" + lbl] == m["kvforge_kv_blocks_total" + lbl] and not m["kvforge_requests_running" + lbl]:
            break
        assert time.monotonic() < deadline, "KV blocks did not return to the pool"
        time.sleep(0.2)

    # SIGTERM with long streams in flight: they end with an error event and [DONE], the process exits 0
    long_body = {"model": "tiny", "prompt": "drain", "max_tokens": 480, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(_stream, url, long_body) for _ in range(4)]
        deadline = time.monotonic() + 60
        while True:  # wait until all four are generating
            m = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
            if m['kvforge_requests_running{model_name="tiny"}'] >= 4:
                break
            assert time.monotonic() < deadline, "long streams never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert httpx.get(url + "/health", timeout=10).status_code == 503
        for f in futs:
            status, events = f.result(60)
            assert status == 200 and events[-1] == "[DONE]", events[-3:]
            if "error" in events[-2]:
                assert "shutting down" in json.loads(events[-2])["error"]["message"]
    assert proc.wait(timeout=60) == 0, proc.stdout.read() if proc.stdout else ""
