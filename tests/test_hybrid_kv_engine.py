"""Hybrid local/global models (Gemma 2, Gemma 3, Qwen2 with max_window_layers) on per-group KV pools.

Tiny models with an 8-token window on the local layers and 4-token blocks; the scheduler limits
(4 sequences, 16 batched tokens) make the local group's reservation (20 blocks) smaller than the
pool, so the split is live: the local group gets 20 blocks and the global group the rest. Greedy
tokens equal transformers for prompts far longer than the window, batched, chunked, under
preemption and with prefix hits; the local group's held blocks stop growing past the window while
the global group's grow; ledger, allocation and planner agree; the same memory holds more.
"""
from __future__ import annotations

import pytest

from conftest import assert_no_leaks
from kvforge import LLM, SamplingParams, ledger
from kvforge.ledger import KVGroup
from kvforge.planner import arch
from tiny_models import hf_greedy

BS, WINDOW, SEQS, BUDGET = 4, 8, 4, 16
PROMPTS = [list(range(10, 60)), [5, 17, 99, 3, 8, 200, 45], [i % 250 for i in range(31, 31 + 40)]]
NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
MODELS = {"gemma2": {}, "gemma3": {},
          "qwen2_bias": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}}
_REFS: dict[str, list[list[int]]] = {}


@pytest.fixture(scope="module", params=list(MODELS))
def hybrid(request, tiny_model_factory):
    path, hf = tiny_model_factory(request.param, **MODELS[request.param])
    if path not in _REFS:
        _REFS[path] = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    return path, _REFS[path]


def _llm(path: str, **kw) -> LLM:
    # fp32 names the path the transformers parity holds on (dtype="auto" is bf16 on CPUs with native bf16)
    kw = {"num_kv_blocks": 64, "block_size": BS, "max_num_seqs": SEQS, "max_num_batched_tokens": BUDGET,
          "dtype": "float32", **kw}
    return LLM(model=path, log_ledger=False, **kw)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({}, id="batch"),
        pytest.param({"max_num_batched_tokens": 7}, id="chunked-prefill"),
        pytest.param({"num_kv_blocks": 24}, id="tiny-cache-preemption"),
        pytest.param({"enable_prefix_caching": False}, id="no-prefix-cache"),
        pytest.param({"attention_backend": "torch"}, id="reference-backend"),
    ],
)
def test_greedy_matches_transformers(hybrid, engine_kwargs):
    path, ref = hybrid
    llm = _llm(path, **engine_kwargs)
    kv = llm.engine.kv
    assert [g.window for g in kv.groups] == [None, WINDOW]
    assert kv.pools[1].num_blocks < kv.pools[0].num_blocks  # the split is live
    assert _tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)) == ref
    if engine_kwargs.get("num_kv_blocks") == 24:
        # 24 single-table blocks, 23 usable beside each pool's null block: the global group gets 23 + 3 spare = 26
        # (qwen2: 1 global layer of 2) or 23 + 2 x 3 = 29 (gemma: 1 global layer of 3) blocks; three requests
        # need 19 + 8 + 16 of them
        assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm.engine)


def test_prefix_hits_leave_outputs_unchanged(hybrid):
    """Repeated and extended prompts hit; the local pool (68 blocks here) is large enough that the freed
    window blocks of the first run are not yet evicted (a freed block stays hittable only until reused)."""
    path, ref = hybrid
    llm = _llm(path, num_kv_blocks=128, max_num_seqs=16)
    assert llm.engine.kv.pools[1].num_blocks == 68 < llm.engine.kv.pools[0].num_blocks
    first = _tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY))
    second = _tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY))
    longer = [p + [7, 8, 9, 10, 11] for p in PROMPTS]  # a shared prefix, then new tokens
    third = _tokens(llm.generate(prompt_token_ids=longer, sampling_params=GREEDY))
    assert first == ref == second
    assert llm.engine.kv.stats.hits >= sum((len(p) - 1) // BS * BS for p in PROMPTS)  # the second run hit in full
    fresh = _llm(path, enable_prefix_caching=False)
    assert third == _tokens(fresh.generate(prompt_token_ids=longer, sampling_params=GREEDY))
    assert_no_leaks(llm.engine)


def test_local_blocks_stop_growing_past_the_window(hybrid):
    path, ref = hybrid
    engine = _llm(path).engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request(prompt_token_ids=PROMPTS[0], params=params, request_id="long")
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        held.append(engine.kv.num_held_blocks("long"))
        engine.check_integrity()
    full, local = [h[0] for h in held[:-1]], [h[1] for h in held[:-1]]
    assert full[-1] == 88 // BS and full == sorted(full)  # the global group keeps every block (88 tokens)
    decode = local[4:]  # 50 prompt tokens in chunks of 16: four prefill steps, then decodes
    assert max(decode) <= WINDOW // BS + 2, local
    assert decode[-1] == decode[len(decode) // 2], "local blocks kept growing past the window"
    assert held[-1] == [0, 0]
    assert_no_leaks(engine)


def test_ledger_allocation_and_planner_agree(hybrid, tiny_model_factory):
    path, _ = hybrid
    engine = _llm(path, num_kv_blocks=None, kv_cache_memory=200_000).engine
    shape = arch.kv_shape_from_hf(engine.model_config.extra)  # the planner's reading of config.json
    assert shape == engine.model_config.kv_shape()
    fmt = engine.cache_format
    n = ledger.num_blocks_for_memory(200_000, shape, BS, fmt)
    groups = ledger.split_kv_blocks(shape, fmt, BS, n, SEQS, BUDGET)
    assert engine.kv.groups == groups and len(groups) == 2
    allocated = sum(c.nbytes for c in engine.runner.caches)
    assert allocated == engine.report.kv_cache_bytes == ledger.kv_bytes_for_groups(shape, groups, BS, fmt) <= 200_000
    for layer, cache in enumerate(engine.runner.caches):
        # each layer holds its group's usable blocks and the group's null block
        assert cache.num_blocks == next(g.num_blocks for g in groups if layer in g.layers) + ledger.NULL_BLOCKS_PER_GROUP
    assert ledger.max_concurrency(200_000, shape, 64, fmt, BS, SEQS, BUDGET) == groups[0].num_blocks // 16
    assert engine.report.token_capacity == groups[0].num_blocks * BS
    assert f"window {WINDOW}" in engine.report.render()


def _run_workload(llm: LLM) -> tuple[int, int]:
    """Four 8-token prompts, 20 new tokens each (7 blocks of 4 at the end): (peak running at once, preemptions)."""
    engine, peak = llm.engine, 0
    for i in range(4):
        engine.add_request(prompt_token_ids=[(7 * i + j) % 250 for j in range(8)],
                           params=SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert_no_leaks(engine)
    return peak, engine.scheduler.num_preemptions


def test_same_memory_holds_more_than_one_table(hybrid, monkeypatch):
    """25 blocks' memory (24 usable + each pool's null block): one table for every layer holds 96 tokens, too few
    for four 28-token requests at once; per-group pools give the global layers 28 or 32 blocks (the local layers never need more than their
    20-block reservation), so all four run together without preemption."""
    path, _ = hybrid
    hybrid_llm = _llm(path, num_kv_blocks=25, enable_prefix_caching=False)
    assert hybrid_llm.engine.report.token_capacity > 24 * BS
    assert _run_workload(hybrid_llm) == (4, 0)

    def one_table(shape, fmt, bs, n, *limits):
        return [KVGroup(None, tuple(range(shape.num_layers)), n - ledger.NULL_BLOCKS_PER_GROUP)]

    monkeypatch.setattr("kvforge.engine.engine.split_kv_blocks", one_table)  # the design before KV groups
    single = _llm(path, num_kv_blocks=25, enable_prefix_caching=False)
    assert single.engine.report.token_capacity == 24 * BS
    assert single.engine.report.kv_cache_bytes >= hybrid_llm.engine.report.kv_cache_bytes
    peak, preemptions = _run_workload(single)
    assert peak < 4 or preemptions > 0
