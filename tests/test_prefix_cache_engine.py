"""Prefix caching and n > 1 through the real engine (tiny random model, block size 4).

Caching must never change a token: outputs are compared with caching off, on
every scheduling path (one batch, chunked prefill, preemption). n > 1 prefills
once and forks: ref counts, copy-on-write, seeds, abort and preemption.
"""
from __future__ import annotations

import pytest

from conftest import assert_no_leaks
from kvforge import LLM, SamplingParams

SHARED = [(7 * i + 3) % 250 for i in range(26)]  # 6 full blocks of 4 + 2 tokens
PROMPTS = [SHARED + [100 + j, 101 + j, 102 + j] for j in range(4)] + [SHARED[:13], [5, 9, 11]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, ignore_eos=True, seed=1234)


def _llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("dtype", "float32")  # the transformers parity is in fp32 (auto: bf16 on bf16 CPUs)
    kwargs.setdefault("num_kv_blocks", 96)
    kwargs.setdefault("block_size", 4)
    return LLM(model=path, log_ledger=False, **kwargs)


def _tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({}, id="one-batch"),
        pytest.param({"max_num_batched_tokens": 7}, id="chunked-prefill"),
        pytest.param({"num_kv_blocks": 14}, id="preemption"),
    ],
)
def test_outputs_identical_with_prefix_caching_on_and_off(tiny_model_factory, params, engine_kwargs):
    path, _ = tiny_model_factory("llama_gqa")
    results = {}
    for caching in (False, True):
        llm = _llm(path, enable_prefix_caching=caching, **engine_kwargs)
        first = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        second = llm.generate(prompt_token_ids=PROMPTS[::-1], sampling_params=params)[::-1]  # hits across calls
        results[caching] = (_tokens(first), _tokens(second))
        stats = llm.engine.kv.stats
        if caching:
            assert stats.hits > 0 and sum(o.num_cached_tokens for o in second) > 0
        else:
            assert stats.queries == 0 and all(o.num_cached_tokens == 0 for o in first + second)
        if "num_kv_blocks" in engine_kwargs:
            assert llm.engine.scheduler.num_preemptions > 0, "the tiny cache should force preemption"
        assert_no_leaks(llm.engine)
    assert results[True] == results[False]
    assert results[True][0] == results[True][1]


def test_num_cached_tokens_and_hit_rate(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    llm = _llm(path)
    (a,) = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY)
    (b,) = llm.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=GREEDY)
    (c,) = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY)
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 24  # the 6 full shared blocks
    assert c.num_cached_tokens == 28  # all 7 full blocks; the last prompt token is recomputed
    stats = llm.engine.kv.stats
    assert (stats.queries, stats.hits) == (3 * 29, 52)
    assert stats.recent_hit_rate == pytest.approx(52 / 87)
    assert c.outputs[0].token_ids == a.outputs[0].token_ids
    assert_no_leaks(llm.engine)


def test_different_cache_salt_never_hits(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    llm = _llm(path)
    (a,) = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY, cache_salt="tenant-a")
    (b,) = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY, cache_salt="tenant-b")
    (c,) = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY)
    (d,) = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY, cache_salt="tenant-a")
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens, d.num_cached_tokens) == (0, 0, 0, 28)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert_no_leaks(llm.engine)


def test_n4_forks_after_one_prefill_and_copies_on_write(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    llm = _llm(path)
    engine, kv = llm.engine, llm.engine.kv
    prompt = PROMPTS[0]  # 29 tokens: 7 full blocks and one holding 1 token
    rid = engine.add_request(prompt_token_ids=prompt, params=SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6))
    outs = engine.step()
    assert engine.counters.num_prompt_tokens == 29  # prefilled once, not four times
    samples = engine.samples[rid]
    assert len(samples) == 4 and [s.sample_index for s in samples] == [0, 1, 2, 3]
    tables = [kv.block_ids(s.request_id)[0] for s in samples]
    assert tables[0] == tables[1] == tables[2] == tables[3] and len(tables[0]) == 8
    assert [kv.pools[0].blocks[b].ref_cnt for b in tables[0]] == [4] * 8
    assert [o.request_id for o in outs] == [rid]
    assert [c.index for c in outs[0].outputs] == [0, 1, 2, 3] and not outs[0].finished
    engine.check_integrity()
    engine.step()  # each sample writes its first token into the shared partial block: 3 copies, 1 in place
    assert kv.num_cow_copies == 3
    tables = [kv.block_ids(s.request_id)[0] for s in samples]
    assert len({t[-1] for t in tables}) == 4 and len({tuple(t[:-1]) for t in tables}) == 1
    assert [kv.pools[0].blocks[b].ref_cnt for b in tables[0][:-1]] == [4] * 7
    engine.check_integrity()
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    (final,) = finals
    assert final.request_id == rid and [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in final.outputs)
    assert final.metrics.first_token_time is not None
    assert_no_leaks(engine)


def test_n4_seeds_match_separate_requests_and_survive_preemption(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    params = SamplingParams(n=4, temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    separate = [SamplingParams(temperature=1.0, seed=99 + i, max_tokens=16, ignore_eos=True) for i in range(4)]
    prompt = PROMPTS[2][:10]
    ref = [o.outputs[0].token_ids for o in _llm(path).generate(prompt_token_ids=[prompt] * 4, sampling_params=separate)]
    assert len({tuple(t) for t in ref}) > 1, "the seeds should give different samples"
    for kwargs in ({}, {"num_kv_blocks": 16}):
        llm = _llm(path, **kwargs)
        (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
        assert [c.token_ids for c in out.outputs] == ref
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        if kwargs:
            assert llm.engine.scheduler.num_preemptions > 0 and out.metrics.num_preemptions > 0
        assert_no_leaks(llm.engine)


def test_n_gt_1_streams_per_sample_deltas_and_text(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    llm = _llm(path)
    engine = llm.engine
    rid = engine.add_request("The quick brown fox", SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))
    texts = {i: "" for i in range(3)}
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            for c in out.outputs:
                texts[c.index] += c.delta_text
            if out.finished:
                final = out
    assert final is not None and [texts[i] for i in range(3)] == [c.text for c in final.outputs]
    assert_no_leaks(engine)


def test_abort_of_parent_aborts_every_sample(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    llm = _llm(path)
    engine = llm.engine
    waiting = engine.add_request(prompt_token_ids=PROMPTS[1], params=SamplingParams(n=4, max_tokens=50))
    assert engine.abort_request(waiting) and not engine.abort_request(waiting)
    rid = engine.add_request(prompt_token_ids=PROMPTS[0], params=SamplingParams(n=4, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 4
    assert engine.abort_request(rid)
    assert not engine.scheduler.requests and not engine.outputs.groups and not engine.outputs.states
    assert_no_leaks(engine)


def test_n_larger_than_max_num_seqs_is_rejected(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    llm = _llm(path, max_num_seqs=2)
    with pytest.raises(ValueError, match=r"n must be .*max_num_seqs=2.*got 3"):
        llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=SamplingParams(n=3))
    assert_no_leaks(llm.engine)


def test_reset_prefix_cache_refuses_while_blocks_in_use(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    llm = _llm(path)
    llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY)
    rid = llm.engine.add_request(prompt_token_ids=PROMPTS[1], params=GREEDY)
    llm.engine.step()
    with pytest.raises(RuntimeError, match="blocks are in use"):
        llm.reset_prefix_cache()
    assert llm.engine.pool.num_cached_blocks > 0
    llm.engine.abort_request(rid)
    llm.reset_prefix_cache()
    assert llm.engine.pool.num_cached_blocks == 0
    (out,) = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY)
    assert out.num_cached_tokens == 0
    assert_no_leaks(llm.engine)


def test_blocks_of_a_failed_step_are_never_hit(tiny_model_factory):
    """A block is published when its step is scheduled; if that step fails before writing its K/V, the
    block's hash is dropped at once, so no later request hits a row that holds no valid K/V."""
    from kvforge.engine.errors import StepFailed

    path, _ = tiny_model_factory("llama_gqa")
    llm = _llm(path)
    engine = llm.engine
    (fresh,) = _llm(path).generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY)
    execute = engine.runner.execute

    def broken(out):
        raise RuntimeError("simulated failure before the forward pass")

    engine.runner.execute = broken
    rid = engine.add_request(prompt_token_ids=PROMPTS[0], params=GREEDY)
    with pytest.raises(StepFailed):
        engine.step()
    assert engine.pool.num_cached_blocks == 0  # published when scheduled, dropped when the step failed
    engine.abort_request(rid)
    engine.runner.execute = execute
    (again,) = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY)
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == fresh.outputs[0].token_ids
    (third,) = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY)  # blocks that were written hit
    assert third.num_cached_tokens == 28 and third.outputs[0].token_ids == fresh.outputs[0].token_ids
    assert_no_leaks(engine)
