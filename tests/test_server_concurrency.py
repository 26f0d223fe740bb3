"""Many streaming clients at once, some hanging up early: the rest are right, and no block leaks."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from server_fixtures import MODEL_NAME, parse_metrics, start_server, tiny_model_dir, wait_idle_and_check_blocks

N_CLIENTS = 32
LONG = 200  # tokens the disconnecting clients ask for; they hang up long before
FINISHED = 'kvforge_requests_finished_total{model_name="%s",finished_reason="%s"}'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # a small pool (160 blocks of 16 tokens) and 32 sequence slots: every client is in flight at once
    srv = start_server(tiny_model_dir(tmp_path_factory), num_kv_blocks=160, max_num_seqs=32)
    yield srv
    srv.stop()


def _finished(srv, reason: str) -> float:  # type: ignore[no-untyped-def]
    return parse_metrics(httpx.get(srv.url + "/metrics").text)[FINISHED % (MODEL_NAME, reason)]


def _body(i: int, stream: bool) -> dict:
    leaves = i % 3 == 0
    return {"model": MODEL_NAME, "prompt": f"client {i}: tell me about block {i * 7}", "temperature": 0,
            "max_tokens": LONG if leaves else 16, "ignore_eos": True, "stream": stream}


async def _client(http: httpx.AsyncClient, i: int) -> str | None:
    """Stream one completion; every third client reads two events and disconnects."""
    text, events = "", 0
    async with http.stream("POST", "/v1/completions", json=_body(i, stream=True)) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return text
            events += 1
            text += json.loads(line[6:])["choices"][0]["text"]
            if i % 3 == 0 and events == 2:
                return None  # leaving the `async with` closes the connection mid-stream
    raise AssertionError(f"client {i}: stream ended without [DONE]")


def test_32_streaming_clients_a_third_disconnect(server):
    staying = [i for i in range(N_CLIENTS) if i % 3]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        expected = {i: http.post("/v1/completions", json=_body(i, stream=False)).json()["choices"][0]["text"]
                    for i in staying}
    aborted_before = _finished(server, "abort")

    async def run_all() -> list[str | None]:
        limits = httpx.Limits(max_connections=N_CLIENTS + 4)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as http:
            return await asyncio.wait_for(asyncio.gather(*(_client(http, i) for i in range(N_CLIENTS))), 120)

    results = asyncio.run(run_all())
    for i in staying:
        assert results[i] == expected[i], f"client {i}"
    wait_idle_and_check_blocks(server)
    # each disconnect became an abort; none ran on to its 200 tokens
    assert _finished(server, "abort") - aborted_before == N_CLIENTS - len(staying)


def test_non_streaming_client_that_times_out_is_aborted(server):
    aborted_before = _finished(server, "abort")
    body = {**_body(0, stream=False), "max_tokens": 240, "prompt": "x"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.05))
    wait_idle_and_check_blocks(server)
    assert _finished(server, "abort") - aborted_before == 1
    # and the server still answers
    r = httpx.post(server.url + "/v1/completions", json=_body(1, stream=False), timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
