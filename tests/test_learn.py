"""`kvforge learn` (issue 18): the NumPy minimal cache, cached vs uncached decode, and each demo's --quick run."""
from __future__ import annotations

import re

import numpy as np
import pytest

from kvforge import LLM, SamplingParams
from kvforge.cli import main
from kvforge.learn.minimal_cache import KVCache, SingleHeadAttention, decode_step, prefill, run_both
from kvforge.learn.why_cache import generate_without_cache


@pytest.mark.parametrize("d, num_tokens, prompt_len, seed", [(8, 20, 1, 0), (32, 50, 7, 1), (64, 96, 33, 2)])
def test_minimal_cache_equals_full_recomputation(d, num_tokens, prompt_len, seed):
    attn = SingleHeadAttention(d, seed)
    tokens = np.random.default_rng(seed + 10).standard_normal((num_tokens, d))
    cached, recomputed = run_both(attn, tokens, prompt_len)
    assert cached.shape == (num_tokens - prompt_len + 1, d)
    np.testing.assert_allclose(cached, recomputed, rtol=0, atol=1e-6)


def test_minimal_cache_grows_one_row_per_decode_step():
    attn = SingleHeadAttention(16)
    x = np.random.default_rng(0).standard_normal((10, 16))
    cache = KVCache(16)
    prefill(attn, x[:6], cache)
    assert cache.k.shape == (6, 16)
    decode_step(attn, x[6], cache)
    assert cache.k.shape == cache.v.shape == (7, 16)


def test_cached_decode_equals_uncached_decode_through_the_engine(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    llm = LLM(model=path, log_ledger=False, dtype="float32", enable_prefix_caching=False, num_kv_blocks=64, block_size=4)
    prompt = [11, 42, 7, 99, 3, 250, 18]
    (out,) = llm.generate(prompt_token_ids=[prompt],
                          sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert generate_without_cache(llm.engine, prompt, 12) == out.outputs[0].token_ids
    llm_cached = LLM(model=path, log_ledger=False, dtype="float32", num_kv_blocks=64, block_size=4)
    with pytest.raises(ValueError, match="prefix caching off"):
        generate_without_cache(llm_cached.engine, prompt, 1)


def test_learn_why_cache_quick(tiny_model_factory, capsys, tmp_path):
    path, _ = tiny_model_factory("llama_gqa")
    png = tmp_path / "why.png"
    assert main(["learn", "why-cache", "--quick", "--model", path, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    diff = float(re.search(r"max \|cached - recomputed\| = (\S+);", out).group(1))
    assert diff < 1e-6
    assert re.search(r"^\s+64\s", out, re.M) and re.search(r"^\s+256\s", out, re.M)
    assert "without cache x" in out and "with cache x" in out
    assert png.stat().st_size > 0


def test_learn_prefill_vs_decode_quick(tiny_model_factory, capsys):
    path, _ = tiny_model_factory("llama_gqa")
    assert main(["learn", "prefill-vs-decode", "--quick", "--model", path]) == 0
    out = capsys.readouterr().out
    assert "compute peak" in out and "read bandwidth" in out and "ridge point" in out
    rows = {(m.group(1), int(m.group(2))): float(m.group(3))
            for m in re.finditer(r"^\s*(prefill|decode)\s+(\d+)\s+\d+\s+\S+\s+\S+\s+\S+\s+\S+\s+(\S+)", out, re.M)}
    assert set(rows) == {("prefill", 1), ("prefill", 32), ("decode", 1), ("decode", 32)}
    # FLOPs per byte: prefill reuses each weight for every prompt token, decode at batch 1 does not
    assert rows[("prefill", 32)] > rows[("decode", 32)] > rows[("decode", 1)]


def test_learn_paging_quick(tiny_model_factory, capsys):
    path, _ = tiny_model_factory("llama_gqa")
    assert main(["learn", "paging", "--quick", "--model", path, "--cpu-time", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "greedy outputs identical: True" in out
    peak = {m.group(1): int(m.group(2)) for m in re.finditer(
        r"^\s*(contiguous|paged)\s+\S+\s+\S+\s+\S+%\s+\S+%\s+\S+\s+\S+%\s+(\d+)", out, re.M)}
    assert peak["contiguous"] <= 3 < peak["paged"]  # 3 reservations fit; paging admits more
    util = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\s*(contiguous|paged)\s+\S+\s+\S+\s+(\S+)%", out, re.M)}
    assert util["paged"] > 80 > util["contiguous"]


def test_learn_paging_serve_runs_both_modes_through_a_server(tiny_model_factory, capsys):
    path, _ = tiny_model_factory("llama_gqa")
    assert main(["learn", "paging", "--serve", "--quick", "--port", "0", "--pause", "0", "--model", path,
                 "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"open http://127\.0\.0\.1:\d+/kv", out)
    runs = {m.group(1): (float(m.group(2)), int(m.group(3))) for m in re.finditer(
        r"^  (contiguous|paged): .* KV utilization ([\d.]+)%, peak (\d+) sequences", out, re.M)}
    assert runs["paged"][0] > runs["contiguous"][0] and runs["paged"][1] > runs["contiguous"][1]
    assert main(["learn", "paging", "--serve", "--rounds", "0"]) == 2


def test_learn_bad_input(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["learn", "why-cache", "--contexts", "64,x"])
    assert exc.value.code == 2
    assert main(["learn", "paging", "--num-requests", "0"]) == 2
    assert "--num-requests" in capsys.readouterr().err
