"""Sliding-window attention: outputs equal transformers, and dead blocks go back to the pool.

Mistral with a 12-token window and 4-token blocks: prompts and generations far
longer than the window, in batches (a freed slot holds the pool's reserved null
block, which only the window mask ever reads), with
chunked prefill and with preemption. A windowed request's held blocks stop
growing once it passes the window; prefix caching stays correct when the early
blocks of a chain were freed or evicted; the pool balances to zero.
"""
from __future__ import annotations

import pytest

from conftest import assert_no_leaks, prefill_then_decode
from kvforge import LLM, SamplingParams
from kvforge.config import ModelConfig
from kvforge.engine.request import Request
from kvforge.kv.coordinator import KVCacheCoordinator
from kvforge.ledger import KVGroup
from tiny_models import hf_greedy

WINDOW, BS = 12, 4
PROMPTS = [list(range(10, 60)), [5, 17, 99, 3, 8, 200, 45], [i % 250 for i in range(31, 31 + 40)], [9] * 20]
NEW = 40
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
_REFS: dict[str, list[list[int]]] = {}


@pytest.fixture(scope="module", params=["mistral_swa", "mistral_swa_d64"])
def swa(tiny_model_factory, request):
    path, hf = tiny_model_factory(request.param)
    if path not in _REFS:
        _REFS[path] = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    return path, _REFS[path]


def _llm(path: str, **kw) -> LLM:
    kw.setdefault("dtype", "float32")  # the transformers parity is in fp32 (auto: bf16 on bf16 CPUs)
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("block_size", BS)
    return LLM(model=path, log_ledger=False, **kw)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({}, id="batch"),
        pytest.param({"max_num_batched_tokens": 7}, id="chunked-prefill"),
        pytest.param({"num_kv_blocks": 12, "max_num_batched_tokens": 16}, id="tiny-cache-preemption"),
        pytest.param({"enable_prefix_caching": False}, id="no-prefix-cache"),
        pytest.param({"attention_backend": "torch", "max_num_batched_tokens": 9}, id="reference-backend"),
    ],
)
def test_windowed_greedy_matches_transformers(swa, engine_kwargs):
    path, ref = swa
    llm = _llm(path, **engine_kwargs)
    assert [g.window for g in llm.engine.kv.groups] == [WINDOW]  # one group, every layer windowed
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
    if "num_kv_blocks" in engine_kwargs:
        # 12 blocks of 4 = 48 tokens: without window freeing a 90-token request could never finish
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.scheduler.max_seq_len > 48
    assert_no_leaks(llm.engine)


def test_held_blocks_stop_growing_past_the_window(swa):
    path, ref = swa
    engine = _llm(path).engine
    engine.add_request(prompt_token_ids=PROMPTS[0], params=GREEDY, request_id="long")
    held, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        held.append(engine.kv.num_held_blocks("long")[0])
        engine.check_integrity()
    assert tokens == ref[0]
    # the one-chunk prefill holds all 13 prompt blocks; from then on the window (3 blocks) + the block
    # being written (+ one partly dead block) suffice, where 90 tokens would need 23 blocks
    assert held[0] == 13
    assert max(held[1:-1]) <= WINDOW // BS + 2, held
    assert held[-2] == held[len(held) // 2], "held blocks kept growing after passing the window"
    assert held[-1] == 0
    assert_no_leaks(engine)


def test_hybrid_or_unwindowed_models_do_not_free():
    mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 10, "hidden_size": 8,
               "num_attention_heads": 2, "num_hidden_layers": 3}
    assert ModelConfig.from_hf({**mistral, "sliding_window": 16}).block_free_window == 16
    assert ModelConfig.from_hf({**mistral, "sliding_window": None}).block_free_window is None
    gemma2 = {**mistral, "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "sliding_window": 16}
    assert ModelConfig.from_hf(gemma2).sliding_windows == (16, None, 16)
    assert ModelConfig.from_hf(gemma2).block_free_window is None  # a global layer still reads every block
    gemma3 = {**gemma2, "model_type": "gemma3_text", "sliding_window_pattern": 3, "num_hidden_layers": 6}
    assert ModelConfig.from_hf(gemma3).sliding_windows == (16, 16, None, 16, 16, None)
    qwen2 = {**mistral, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    assert ModelConfig.from_hf(qwen2).sliding_windows == (None, 8, 8)
    assert ModelConfig.from_hf(qwen2).block_free_window is None


def test_window_freed_blocks_stay_hittable_until_evicted():
    kv = KVCacheCoordinator([KVGroup(WINDOW, (0,), 12)], BS)
    null = kv.pools[0].null_block
    prompt = list(range(100, 124))  # 6 full blocks
    a = Request("a", prompt, SamplingParams())
    prefill_then_decode(kv, a, 10)  # 34 tokens: blocks ending before 33 - 12 = 21 are dead -> blocks 0..4 freed
    (table,) = kv.tables("a").blocks
    assert table[:5] == [null] * 5 and null not in table[5:]
    assert kv.num_held_blocks("a") == [len(table) - 5] and kv.pool.num_free_blocks == 12 - len(table) + 5
    assert kv.block_ids("a")[0][:5] == [12] * 5  # the reserved null row: addressable, never attended

    # a same-prompt request hits the whole freed-but-cached chain: real blocks, never placeholders
    b = Request("b", prompt + [1], SamplingParams())
    hits, cached = kv.get_computed_blocks(b)
    (hit_blocks,) = hits.blocks
    assert cached == 24 and null not in hit_blocks and all(h.block_hash is not None for h in hit_blocks)
    assert kv.allocate_slots(b, 1, hits) == [[]]
    b.num_computed_tokens = b.num_tokens
    kv.check_integrity()
    kv.free(b)

    # evict the chain head (LRU front) by allocating for another request: the chain no longer hits at all
    c = Request("c", list(range(500, 500 + 4 * kv.pool.num_free_blocks)), SamplingParams())
    assert kv.allocate_slots(c, c.num_tokens) == [[]]
    kv.free(c)
    hits, cached = kv.get_computed_blocks(Request("d", prompt + [1], SamplingParams()))
    assert cached == 0 and hits.get_block_ids() == [[]]
    kv.free(a)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == 12


def test_fork_and_free_skip_window_placeholders():
    kv = KVCacheCoordinator([KVGroup(8, (0,), 16)], BS)
    null = kv.pools[0].null_block
    a = Request("a", list(range(20)), SamplingParams())
    prefill_then_decode(kv, a, 8)
    assert null in kv.tables("a").blocks[0]
    child = Request("a-1", list(a.all_token_ids), SamplingParams())
    child.num_computed_tokens = a.num_computed_tokens
    kv.fork(a, child)
    kv.check_integrity()
    assert null.ref_cnt == 0
    prefill_then_decode(kv, child, 6)  # the child frees its own dead blocks; shared ones stay with the parent
    kv.free(a)
    kv.free(child)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == 16 and null.ref_cnt == 0


def test_prefix_hits_on_a_windowed_model_stay_correct(swa):
    """Second run of the same prompts: hits on chains whose early blocks were window-freed, same tokens.

    The pool is large enough that the freed chain heads are not evicted before the second run (a window-freed
    head sits in the LRU queue like any freed block; once evicted the chain simply misses, see above).
    """
    path, ref = swa
    llm = _llm(path, num_kv_blocks=160)
    first = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    second = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in first] == ref == [o.outputs[0].token_ids for o in second]
    assert llm.engine.kv.stats.hits == sum((len(p) - 1) // BS * BS for p in PROMPTS)  # every full prompt block
    assert_no_leaks(llm.engine)
