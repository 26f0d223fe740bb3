"""The server exports KV utilization (issue 18): live gauges and the run's mean, hand-computed."""
from __future__ import annotations

import httpx
import pytest

from server_fixtures import MODEL_NAME, parse_metrics, start_server, tiny_model_dir, wait_idle_and_check_blocks

LBL = f'{{model_name="{MODEL_NAME}"}}'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tiny_model_dir(tmp_path_factory), kv_allocation="contiguous", max_model_len=64)
    yield srv
    srv.stop()


def test_metrics_report_kv_utilization(server):
    resp = httpx.post(server.url + "/v1/completions", json={
        "model": MODEL_NAME, "prompt": "abc", "max_tokens": 12, "temperature": 0, "ignore_eos": True}, timeout=60)
    assert resp.status_code == 200
    wait_idle_and_check_blocks(server)
    m = parse_metrics(httpx.get(server.url + "/metrics").text)
    # contiguous: 64 slots reserved for the whole run; steps stored 3, 4, ..., 14 tokens (12 steps)
    assert m["kvforge_kv_utilization_mean_ratio" + LBL] == pytest.approx(sum(range(3, 15)) / (64 * 12))
    # idle now: nothing allocated, nothing wasted
    assert m["kvforge_kv_slots_allocated" + LBL] == 0 and m["kvforge_kv_reserved_unused_slots" + LBL] == 0
    assert m["kvforge_kv_utilization_ratio" + LBL] == 1
