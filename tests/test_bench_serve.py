"""`kvforge bench serve` against a tiny-model server on a free loopback port, plus its pure parts."""
from __future__ import annotations

import json
import statistics

import pytest

from kvforge.cli import main
from kvforge.commands.bench_client import RequestResult, poisson_gaps
from kvforge.commands.bench_datasets import random_dataset, shared_prefix_dataset
from kvforge.commands.bench_serve import format_table, percentile, summarize
from server_fixtures import MODEL_NAME, start_server, tiny_model_dir, wait_idle_and_check_blocks


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tiny_model_dir(tmp_path_factory))
    yield srv
    srv.stop()


def _bench(url: str, *extra: str) -> list[str]:
    return ["bench", "serve", "--base-url", url, "--num-prompts", "8", "--input-len", "6", "--output-len", "5", *extra]


def test_bench_serve_random_poisson(server, tmp_path, capsys):
    out = tmp_path / "raw.json"
    assert main(_bench(server.url, "--request-rate", "40", "--save-json", str(out))) == 0
    table = capsys.readouterr().out
    for label in ("Successful requests:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Median TTFT (ms):", "P99 TPOT (ms):", "Mean ITL (ms):", "P99 E2EL (ms):", "Failed requests:"):
        assert label in table
    raw = json.loads(out.read_text())
    s = raw["summary"]
    assert s["completed"] == 8 and s["failed"] == 0
    assert s["total_output_tokens"] == 8 * 5  # EOS ignored: exactly max_tokens each
    assert raw["config"]["model"] == MODEL_NAME and raw["config"]["request_rate"] == "40"
    reqs = raw["requests"]
    assert len(reqs) == 8 and all(r["success"] and 0 < r["ttft"] <= r["latency"] for r in reqs)
    # at most one SSE content event per token after the first (byte tokens holding half a UTF-8 character send none)
    assert all(len(r["itl"]) <= 4 for r in reqs) and sum(len(r["itl"]) for r in reqs) > 0
    assert s["ttft_ms"]["median"] > 0 and s["e2el_ms"]["p99"] >= s["e2el_ms"]["median"]
    assert sorted(r["start"] for r in reqs) == [r["start"] for r in reqs]  # sent in order
    wait_idle_and_check_blocks(server)


def test_bench_serve_shared_prefix_chat_with_concurrency(server, tmp_path, capsys):
    out = tmp_path / "raw.json"
    argv = _bench(server.url, "--dataset", "shared-prefix", "--prefix-len", "12", "--num-prefixes", "1",
                  "--max-concurrency", "2", "--endpoint", "chat", "--save-json", str(out))
    assert main(argv) == 0
    s = json.loads(out.read_text())["summary"]
    assert s["completed"] == 8 and s["cached_input_tokens"] >= 16 * 6  # later requests hit the shared prefix
    capsys.readouterr()


def test_bench_serve_counts_failures(server, capsys):
    # 300 output tokens cannot fit max_model_len 256: every request gets HTTP 400
    assert main(_bench(server.url, "--output-len", "300")) == 1
    out = capsys.readouterr().out
    assert "Failed requests:" in out and "HTTP 400" in out and "max_tokens" in out


def test_bench_serve_usage_errors_exit_2(server, capsys):
    assert main(_bench(server.url, "--num-prompts", "0")) == 2
    assert main(_bench(server.url, "--request-rate", "0")) == 2
    assert main(_bench("http://127.0.0.1:9", "--model", "x", "--num-prompts", "1", "--timeout", "5")) == 1
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9"]) == 2  # cannot resolve the model
    assert "--num-prompts" in capsys.readouterr().err


def test_datasets_are_seeded_and_sized():
    a = random_dataset(20, 50, 10, 0.5, seed=3)
    assert a == random_dataset(20, 50, 10, 0.5, seed=3) and a != random_dataset(20, 50, 10, 0.5, seed=4)
    assert all(25 <= len(r.prompt.split()) <= 75 and 5 <= r.max_tokens <= 15 for r in a)
    assert {r.max_tokens for r in random_dataset(5, 8, 7, 0.0, seed=0)} == {7}
    b = shared_prefix_dataset(9, 30, 3, 5, 4, 0.0, seed=0)
    prefixes = {r.prompt.split("\nUser: ")[0] for r in b}
    assert len(prefixes) == 3 and b[0].prompt.split("\nUser: ")[0] == b[3].prompt.split("\nUser: ")[0]


def test_poisson_gaps_have_the_requested_rate():
    gaps = poisson_gaps(20.0, 4000, seed=1)
    assert statistics.fmean(gaps) == pytest.approx(1 / 20.0, rel=0.06)


def test_percentile_and_summary():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 99) == 99.0
    ok = RequestResult(success=True, prompt_tokens=10, output_tokens=5, ttft=0.1, itl=[0.02] * 4, latency=0.18)
    bad = RequestResult(error="HTTP 400: nope")
    s = summarize([ok, ok, bad], duration=2.0)
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["HTTP 400: nope"]
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 5.0 and s["total_token_throughput"] == 15.0
    assert s["ttft_ms"]["median"] == pytest.approx(100.0) and s["tpot_ms"]["mean"] == pytest.approx(20.0)
    assert s["itl_ms"]["p99"] == pytest.approx(20.0)
    assert "Mean TTFT (ms):" in format_table(s, "t")
